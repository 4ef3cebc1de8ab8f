"""Paced dispatch as an action of the fuzzer, the explorer and the race (issue 21): every
dispatched rollout ends consumed, live, or retired with a cause, and a dispatch that
ignores the budget or the attempt bound is caught, by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.spec.bounds import EXPLORER_MODELS
from rollout_lifecycle.spec.explorer import explore
from rollout_lifecycle.stateful_tests.mutants import BY_NAME
from rollout_lifecycle.stateful_tests.race import RaceConfig, run_race
from rollout_lifecycle.stateful_tests.runner import README_SEED, run_campaign

LIVE = {"dispatched", "generated", "rewarded", "reserved"}
PACING_INVARIANTS = ("dispatch_paced", "dispatched_accounted_for")


def test_seeded_e2e_fuzz_dispatches_requeues_and_refuses(tmp_path: Path) -> None:
    """A seeded run of the end-to-end machine dispatches on chains, requeues, and meets
    both refusals of the pacing rule, every answer as its model predicts, with the two
    pacing invariants judged on every step and never violated."""
    report = run_campaign(
        ["e2e"], "memory", examples=60, seed=README_SEED, profile="ci", workdir=tmp_path
    )
    run = report.runs["e2e"]
    assert run.failure is None, run.failure
    for note in ("dispatched", "requeued", "no_capacity", "chain_live"):
        assert report.notes.get(f"pacing:{note}", 0) > 0, (note, report.notes)
    for name in PACING_INVARIANTS:
        assert report.invariants.get(name, 0) > 0, name
    for rule in ("paced_dispatch", "finish_paced", "retire_stale", "oldest_admissible"):
        assert run.rules.get(rule, 0) > 0, rule


@pytest.mark.parametrize("name", ["dispatch_ignores_budget", "requeue_ignores_max_attempts"])
def test_e2e_fuzz_catches_a_dispatch_that_breaks_the_rule(name: str, tmp_path: Path) -> None:
    """plan_dispatch patched to ignore the budget (or the attempt bound): the machine's
    model of the rule refuses the first such dispatch."""
    report = run_campaign(
        ["e2e"],
        "memory",
        examples=100,
        seed=0,
        profile="ci",
        workdir=tmp_path,
        mutant=BY_NAME[name](),
        mutant_name=name,
        shrink=False,
    )
    failure = report.runs["e2e"].failure
    assert failure is not None, f"{name} survived"
    want = "no_capacity" if name == "dispatch_ignores_budget" else "attempts_exhausted"
    assert want in failure.exception, failure.exception


def test_explorer_pacing_model_names_dispatch_paced() -> None:
    """The explorer's paced model is clean and reaches a requeue; with the budget
    ignored, its counterexample breaks the spec's `dispatch_paced` itself."""
    model = EXPLORER_MODELS["pacing"][0]()
    res = explore(model)
    assert res.ok and all(w is not None for w in res.sometimes.values()), res.sometimes
    for reason in ("dispatched", "no_capacity", "chain_live", "chain_done", "attempts_exhausted"):
        assert model.observed[f"dispatch:{reason}"] > 0, reason
    for name in ("dispatch_ignores_budget", "requeue_ignores_max_attempts"):
        with BY_NAME[name]():
            mutated = EXPLORER_MODELS["pacing"][0]()
            bad = explore(mutated)
        assert bad.violations, name
        state = bad.violations[0].final_state
        assert any("dispatch_paced" in v for v in mutated.violations_of(state)), name


@pytest.mark.slow
def test_short_race_with_dispatchers_accounts_for_every_dispatch(tmp_path: Path) -> None:
    """Two dispatchers race learners on shared chains under a budget: no violation, every
    dispatch call judged, and in the stored rows every dispatched attempt is consumed,
    live, or ended with its cause, each chain within max_attempts."""
    url = f"sqlite:///{tmp_path / 'race.db'}"
    cfg = RaceConfig(url=url, learners=2, dispatchers=2, seconds=5.0, seed=5, churn=True)
    report = run_race(cfg)
    assert report.ok, [str(v) for v in report.violations[:5]] + list(report.errors)
    totals = report.totals()
    assert totals.get("dispatch:dispatched", 0) > 0, totals
    assert sum(n for k, n in totals.items() if k.startswith("dispatch:")) > totals.get(
        "dispatch:dispatched", 0
    ), totals  # some refusals were judged too
    with open_backend(url, create=False) as b:
        chained = [e for e in b.ledger.snapshot().values() if e.chain is not None]
    assert chained
    for e in chained:
        ended = e.state not in LIVE and e.state != "consumed"
        assert not ended or (e.disposition is not None and e.disposition.cause), e
        assert 1 <= e.attempt <= cfg.max_attempts, e


@pytest.mark.slow
def test_race_names_dispatch_paced_when_the_budget_is_ignored(tmp_path: Path) -> None:
    """Every child process dispatches with plan_dispatch ignoring the budget: the spec's
    replay of the race's trace reports `dispatch_paced`."""
    url = f"sqlite:///{tmp_path / 'race.db'}"
    cfg = RaceConfig(url=url, learners=2, seconds=5.0, seed=1, mutant="dispatch_ignores_budget")
    report = run_race(cfg)
    names = {v.invariant for v in report.violations}
    assert "dispatch_paced" in names, (names, report.totals())
