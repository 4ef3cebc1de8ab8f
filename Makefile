# Two commands work on a fresh machine with Python 3.11 and the package index:
#   make campaign   set everything up, run the main job on SQLite (a verdict in ~5 minutes;
#                   PROFILE=thorough for the README's first budget, PROFILE=ci as CI runs it)
#   make test       set everything up, run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
OUT    ?= campaign-out
PROFILE ?= fast
# torch is needed by the tests that feed tensors to the gate and by the real-run check;
# pin the CPU build FIRST (pip takes it from local disk here; an unpinned torch pulls several
# GB of CUDA), then the [verl] extra, whose torch range it satisfies; [postgres] is psycopg 3
# for the PostgreSQL backend (its tests start a throwaway server, see docs/postgres.md)
TORCH  ?= torch==2.13.0
LABEL  ?= cpu-$(shell date -u +%Y%m%dT%H%M%SZ)
# the versions the suite last passed with (pyproject.toml keeps ranges); CONSTRAINTS= to
# resolve freely, e.g. with a CUDA torch
CONSTRAINTS ?= constraints.txt
PIP_C  := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

.PHONY: campaign campaign-docs test setup setup-campaign setup-dev lint demo docs bench gpu-check drill clean

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ needed"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml $(CONSTRAINTS)
	$(BIN)/python -m pip install --quiet $(PIP_C) -e .
	touch $@

# [campaign] is Hypothesis, which only the fuzzing commands (campaign, fuzz, mutants) need
$(VENV)/.installed-campaign: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet $(PIP_C) -e ".[campaign]"
	touch $@

# [postgres-binary]: psycopg with its own libpq, so the tests have a driver on any machine
$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet $(PIP_C) "$(TORCH)"
	$(BIN)/python -m pip install --quiet $(PIP_C) -e ".[dev,campaign,verl,verl-v1,postgres-binary]"
	touch $@

setup: $(VENV)/.installed

setup-campaign: $(VENV)/.installed-campaign

setup-dev: $(VENV)/.installed-dev

# the adapter stage needs the [verl] extra (`make setup-dev`); without it the campaign says
# loudly that it skipped the stage (PROFILE=ci refuses to skip it: exit 3)
campaign: setup-campaign
	$(BIN)/rollout-lifecycle campaign --backend sqlite --profile $(PROFILE) --out $(OUT)

# the README's and docs/campaign.md's figures, rendered from the committed reports in
# docs/campaign/ (a test checks them against the reports)
campaign-docs: setup
	$(BIN)/python -m rollout_lifecycle.cli.campaign_report

# --tb=short: a failure's traceback in a few lines, so CI's excerpt shows every failure
test: setup-dev
	$(BIN)/python -m pytest -q --tb=short

lint: setup-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

demo: setup
	$(BIN)/rollout-lifecycle demo

docs: setup
	$(BIN)/rollout-lifecycle diagram --write-docs docs/diagrams

bench: setup-dev
	$(BIN)/rollout-lifecycle bench

# the real-run check on this machine (small model; cuda when torch sees one): preflight, run
gpu-check: setup-dev
	$(BIN)/rollout-lifecycle gpu-check preflight --run-label $(LABEL)
	$(BIN)/rollout-lifecycle gpu-check run --run-label $(LABEL)

# atomic activation across 3 Ray workers under every fault kind (docs/activation-drill.md)
drill: setup-dev
	$(BIN)/rollout-lifecycle activation-drill --workers 3

clean:
	rm -rf $(VENV) $(OUT) .hypothesis .pytest_cache .mypy_cache .ruff_cache gpu-check-results guide-run
