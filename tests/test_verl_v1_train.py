"""The real run: verl 0.9.1's v1 trainer on the CPU with the ledger-backed buffer and the
two-phase checkpoint engine, SIGKILLed (trainer, then a rollout replica) and resumed from
verl's own checkpoint; judged from the durable ledger and registry. CI reruns it and judges
it as the committed reference was judged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollout_lifecycle.gpu_check.extra import missing_modules

REFERENCE = Path(__file__).parent.parent / "docs" / "gpu-check" / "trainer-cpu-reference.json"
FIELDS = (
    "pacing",
    "reserved_when_verl_ended",
    "verl_version",
    "trainer_mode",
    "steps",
    "rollout_replicas",
    "kills",
    "trajectories",
    "max_lag_trained",
    "policy",
    "activations",
    "spec",
)


def judged_ok(doc: dict[str, Any]) -> list[str]:
    """What the issue's bar says of a run (empty: it passes)."""
    t = doc["trajectories"]
    bad = []
    for key in ("dispatched", "consumed", "retired", "live", "lost", "trained_twice"):
        if key not in t:
            bad.append(f"trajectories.{key} missing")
    if t.get("lost") != 0 or t.get("trained_twice") != 0:
        bad.append(f"lost {t.get('lost')}, trained twice {t.get('trained_twice')}")
    if t.get("dispatched") != t.get("consumed", 0) + t.get("retired", 0) + t.get("live", 0):
        bad.append("dispatched is not consumed + retired + live")
    if not t.get("landed_by_worker"):  # LedgerAgentLoopWorker's landing ran in verl's loop
        bad.append(f"no group landed by the agent-loop worker: {t.get('landed_by_worker')}")
    if doc["max_lag_trained"] > doc["policy"]["max_lag"]:
        bad.append("trained past the policy's max_lag")
    if doc["spec"]["violations"] != 0:
        bad.append(f"{doc['spec']['violations']} spec violations")
    if {k["what"] for k in doc["kills"]} < {"trainer", "rollout_replica"}:
        bad.append(f"kills {doc['kills']}")
    if doc["steps"] < 6 or doc["rollout_replicas"] < 2:
        bad.append("fewer than 6 steps or 2 replicas")
    a = doc["activations"]
    if a["activated"] + a["failed"] != a["attempted"]:
        bad.append(f"activations {a}")
    if a["survivor_acks_not_counted"]:
        bad.append(f"surviving replicas' acks not counted: {a['survivor_acks_not_counted']}")
    p = doc["pacing"]
    if p["dispatch_refusals"] <= 0 or p["requeued"] <= 0:
        bad.append(f"no pacing inside verl's loop: {p}")
    if p["never_trained"] != 0:
        bad.append(f"{p['never_trained']} chains never trained")
    if p["max_attempts"] > doc["policy"]["max_attempts"]:
        bad.append(f"max attempts {p['max_attempts']} over the policy")
    if doc["reserved_when_verl_ended"] != 0:
        bad.append(f"{doc['reserved_when_verl_ended']} reserved when verl ended")
    return bad


def test_committed_reference_has_the_fields_and_passes() -> None:
    """docs/gpu-check/trainer-cpu-reference.json: every field the issue names, and the bar."""
    doc = json.loads(REFERENCE.read_text())
    assert all(f in doc for f in FIELDS), [f for f in FIELDS if f not in doc]
    assert doc["verl_version"] == "0.9.1" and doc["trainer_mode"] == "separate_async"
    assert judged_ok(doc) == []


def test_a_trainer_that_died_after_its_last_checkpoint_is_resumed(tmp_path: Path) -> None:
    """The harness resumes while a step is not checkpointed OR the last process died: a
    replica killed late takes down verl's last weight sync after step 6's checkpoint, and
    only a resume publishes v6 (committing step 6's reservations)."""
    pytest.importorskip("verl")
    from rollout_lifecycle.gpu_check.verl_v1_train import Phase, TrainPlan, resume_needed

    plan = TrainPlan(tmp_path)
    (tmp_path / "ckpt").mkdir()
    mark = tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"

    def phase(rc: int) -> Phase:
        return Phase("resume-1", rc, 1.0, None)

    assert resume_needed(plan, phase(0))  # no checkpoint yet
    mark.write_text("5\n")
    assert resume_needed(plan, phase(0))
    mark.write_text("6\n")
    assert resume_needed(plan, phase(1)) and resume_needed(plan, phase(-9))
    assert not resume_needed(plan, phase(0))


def test_a_chain_is_judged_ended_only_when_nothing_holds_its_prompt() -> None:
    """Trained, open, held by the budget at the end (every try retired, last pacing record
    a refusal), or ended untrained: a prompt dropped for good, or one whose retired try
    was never offered again, still fails the verdict."""
    pytest.importorskip("verl")
    from rollout_lifecycle.gpu_check.verl_v1_train import chain_outcomes

    states = {
        "t": ["generation_failed", "consumed"],
        "o": ["generation_failed", "rewarded"],
        "h": ["generation_failed", "generation_failed"],
        "d": ["quarantined", "quarantined"],
        "g": ["generation_failed"],
    }
    log = [
        {"t": 1.0, "what": "dispatched", "chain": "h"},
        {"t": 3.0, "what": "no_capacity", "chain": "h"},  # held when the run ended
        {"t": 2.0, "what": "no_capacity", "chain": "g"},
        {"t": 4.0, "what": "dispatched", "chain": "g"},  # its last record: a dispatch
        {"t": 5.0, "what": "no_capacity", "chain": "d"},
        {"t": 6.0, "what": "dropped:attempts_exhausted", "chain": "d"},
    ]
    trained, open_, held, never = chain_outcomes(states, log)
    assert (trained, open_, held, never) == ({"t"}, {"o"}, {"h"}, ["d", "g"])


def test_the_docs_quote_the_committed_reference() -> None:
    """docs/verl-v1.md's result line and trace size are the committed reference's."""
    from rollout_lifecycle.cli.train_cmd import summary

    doc = json.loads(REFERENCE.read_text())
    text = (REFERENCE.parents[1] / "verl-v1.md").read_text()
    assert summary(doc) in text
    assert f"the trace ({doc['spec']['events']} events)" in text
    assert f"the spec's {doc['spec']['invariants']} invariants" in text


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(bool(missing_modules()), reason="the [verl] extra is not installed")
def test_the_real_training_run_survives_kill_9(tmp_path: Path) -> None:
    """`rollout-lifecycle gpu-check train` end to end on the CPU (three verl processes, about
    9 minutes on 2 loaded cores): exit 0 and the same judgement as the committed reference."""
    pytest.importorskip("transfer_queue")  # the [verl-v1] extra (make test installs it)
    exe = Path(sys.executable).with_name("rollout-lifecycle")
    report = tmp_path / "train.json"
    res = subprocess.run(
        [
            str(exe),
            "gpu-check",
            "train",
            "--output",
            str(tmp_path / "run"),
            "--report",
            str(report),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=1700,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=tmp_path,  # hydra writes outputs/ into the working folder
    )
    if res.returncode != 0 and report.exists():  # what CI shows of a failed run: its report
        doc = json.loads(report.read_text())
        why = {k: doc.get(k) for k in ("trajectories", "pacing", "activations", "phases")}
        # the bar's verdict first: CI keeps only a part of a long output
        pytest.fail(
            f"exit {res.returncode}; judged: {judged_ok(doc)}\n{res.stdout[-1500:]}\n"
            f"report: {json.dumps(why)}"
        )
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-3000:]}{res.stderr[-3000:]}"
    doc = json.loads(report.read_text())
    assert all(f in doc for f in FIELDS)
    assert judged_ok(doc) == [], doc
