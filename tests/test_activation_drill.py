"""`rollout-lifecycle activation-drill`: real Ray workers, every fault kind, judged by the spec.

The drill runs as a user runs it (a subprocess of the installed command: real actors, real
safetensors loads, real process kills), once clean with every fault kind and once per
negative control, each of which must exit 1 naming its invariant. The spec's new
`served_after_sync` invariant is also shown on a coordinator over the memory backend, and
the committed reference run is checked against the figures its page shows.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from rollout_lifecycle.cli.main import cli
from rollout_lifecycle.gpu_check.drill import FAULT_KINDS, NEGATIVE_CONTROLS
from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.records import (
    ActionEvidence,
    AdmissionPolicy,
    BehaviorPolicy,
    GenerationConditions,
    Rollout,
    RolloutIdentity,
    WorkerAck,
)
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.spec.invariants import check_trace, violated_names

# a known-long module: a larger limit than the suite's default (pyproject.toml)
pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "activation-drill" / "cpu-reference.json"
PAGE = ROOT / "docs" / "activation-drill.md"


def drill(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The installed command, in a process of its own (Ray wants a fresh driver)."""
    cmd = [sys.executable, "-m", "rollout_lifecycle", "activation-drill", "--out", str(out)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=540, env=env, check=False
    )


def result(file: Path) -> dict[str, Any]:
    """A drill result document, checked against the command's published schema."""
    from jsonschema import Draft202012Validator

    doc: dict[str, Any] = json.loads(file.read_text())
    schema = json.loads((ROOT / "cli" / "schemas" / "activation-drill.schema.json").read_text())
    Draft202012Validator(schema).validate(doc)
    return doc


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_fault_kind_keeps_the_pointer_quarantines_and_retries(tmp_path: Path) -> None:
    """3 workers, every fault kind on its own version: 0 violations; each fault kept the
    old pointer, quarantined its version's rollouts, recorded its own cause, and its clean
    retry activated; every version ended activated."""
    p = drill(tmp_path, "--workers", "3", "--seed", "0")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    doc = result(tmp_path / "drill.json")
    assert doc["spec"]["violations"] == 0 and doc["spec"]["first_violations"] == []
    assert doc["workers"] == 3
    assert sorted(f["kind"] for f in doc["faults"]) == sorted(FAULT_KINDS)
    versions = [f["version"] for f in doc["faults"]]
    assert len(set(versions)) == len(versions)  # each fault on its own version
    causes = {f["cause"] for f in doc["faults"]}
    assert len(causes) == len(FAULT_KINDS)  # each failure recorded with its own cause
    for f in doc["faults"]:
        assert f["stage"] == "distribution", f
        assert f["pointer_kept"], f
        assert f["quarantined"] > 0, f
        assert f["retry_activated"], f
    assert doc["activations"] == doc["versions"]["attempted"]
    assert doc["acks"]["stale_attempt_token"] >= 3  # late acks after a retry never count
    assert doc["acks"].get("no_ack (load failed)", 0) >= 1  # the corrupted file is refused
    assert len(doc["coordinator_processes"]) == 2  # killed once, resumed by a new process
    procs = set(doc["worker_processes"].values())
    assert len(procs) == len(doc["worker_processes"])  # each worker its own process
    assert "0 violations" in p.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("control", "faults"),
    [("majority-ack", "none"), ("serve-before-resync", "restart-resync")],
)
def test_negative_controls_fail_naming_their_invariant(
    tmp_path: Path, control: str, faults: str
) -> None:
    """A driver that activates on a majority of acks, and a restarted worker that serves
    before it resynced: exit 1, and the spec names exactly the control's invariant."""
    p = drill(tmp_path, "--faults", faults, "--versions", "1", "--negative-control", control)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    name = NEGATIVE_CONTROLS[control]
    assert f"VIOLATION {name}:" in p.stdout
    assert set(result(tmp_path / "drill.json")["spec"]["by_invariant"]) == {name}


def test_bad_options_are_usage_errors(tmp_path: Path) -> None:
    """Two workers, an unknown fault, a control without its fault, a backend the worker
    processes cannot share or parse: exit 2, before Ray starts; the CLI's fault names are
    the drill's (the CLI keeps its own copy so `--help` imports nothing heavy)."""
    from rollout_lifecycle.cli.drill_cmd import FAULT_NAMES

    assert FAULT_NAMES == FAULT_KINDS
    runner = CliRunner()
    for args in (
        ["--workers", "2"],
        ["--faults", "meteor-strike"],
        ["--faults", "slow-load", "--negative-control", "serve-before-resync"],
        ["--faults", "slow-load", "--versions", "1", "--negative-control", "majority-ack"],
        ["--backend", "memory://"],
        ["--backend", "nosuch://x"],
    ):
        r = runner.invoke(cli, ["activation-drill", "--out", str(tmp_path / "x"), *args])
        assert r.exit_code == 2, (args, r.output)
        assert "Traceback" not in r.output


def _rollout(rid: str, version: int, h: str) -> Rollout:
    cond = GenerationConditions("tok", 1.0, 1.0, -1, 2)
    ev = ActionEvidence(np.array([1, 2]), np.array([1, 1]), np.array([-0.5, -0.7]))
    return Rollout(RolloutIdentity(rid, "p", "d", 0), BehaviorPolicy(version, h), cond, ev)


def test_served_after_sync_names_a_restarted_worker_that_serves_before_resync() -> None:
    """Without Ray: a worker that reported what it loaded may serve it; after a restart it
    may serve only once it reported a load of its new incarnation."""
    h = "ab" * 32
    with open_backend("memory://") as be:
        set_admission_policy(be.registry, AdmissionPolicy(1, 0.2), "set by the operator")
        coord = ActivationCoordinator(
            be.registry, ["w0", "w1", "w2"], ledger=be.ledger, policy=AdmissionPolicy(1, 0.2)
        )
        coord.prepare(0)
        coord.commit_artifact(0, h)
        coord.distribute(0)
        for w in ("w0", "w1", "w2"):
            coord.record_ack(WorkerAck(w, 0, h, token=coord.attempt_token(w, 0)))
        assert coord.try_activate(0).activated
        be.ledger.add(_rollout("w0@0/0", 0, h))  # acked v0: fine
        coord.worker_restarted("w1", 1)
        be.ledger.add(_rollout("w1@1/0", 0, h))  # restarted, not resynced: a violation
        coord.record_ack(WorkerAck("w1", 0, h, incarnation=1))  # resync: reported
        be.ledger.add(_rollout("w1@1/1", 0, h))  # after the resync: fine
        be.ledger.add(_rollout("plain-id", 0, h))  # names no worker: not judged
        report = check_trace(be.trace())
    assert dict(violated_names(report.violations)) == {"served_after_sync": 1}
    assert "w1@1/0" in str(report.violations[0])


def test_reference_run_matches_its_page() -> None:
    """docs/activation-drill.md shows the committed run's figures, and the run is clean."""
    doc = result(REFERENCE)
    page = PAGE.read_text()
    assert doc["workers"] == 3
    assert doc["spec"]["violations"] == 0 and doc["spec"]["first_violations"] == []
    assert sorted(f["kind"] for f in doc["faults"]) == sorted(FAULT_KINDS)
    for f in doc["faults"]:
        assert {"kind", "version", "pointer_kept", "quarantined", "retry_activated"} <= set(f)
        assert f["pointer_kept"] and f["retry_activated"] and f["quarantined"] > 0
        cells = rf"^\| {re.escape(f['kind'])} \| v(\d+) \| ([^|]+) \| (\w+) \| (\d+) \|"
        row = re.search(cells, page, re.M)
        assert row is not None, f["kind"]
        assert int(row.group(1)) == f["version"]
        assert row.group(2).strip() == f"{f['stage']}: {f['cause']}"
        assert row.group(3) == "kept"
        assert int(row.group(4)) == f["quarantined"]
    v = doc["versions"]
    figures = {
        "workers": doc["workers"],
        "versions attempted": v["attempted"],
        "versions activated": v["activated"],
        "rollouts": doc["rollouts_total"],
        "quarantined": doc["quarantined"],
        "spec violations": doc["spec"]["violations"],
        "wall time (s)": doc["wall_s"],
        **{f"acks {k}": n for k, n in doc["acks"].items()},
    }
    for label, value in figures.items():
        assert f"| {label} | {value} |" in page, label
