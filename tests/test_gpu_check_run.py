"""`gpu-check run --device cpu` end to end through verl 0.9.1, and its three negative controls.

One session starts the clean run and the three controls side by side, each as the installed
command in its own process (verl's platform is process-wide), and every test reads their
results: the clean run passes every check; each control fails exactly its named checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from rollout_lifecycle.gpu_check.controls import CONTROLS, expected_failed_checks
from rollout_lifecycle.gpu_check.evidence import (
    REQUIRED_PATHS,
    judge_result,
    load_trace,
    trace_report,
    validate,
)
from rollout_lifecycle.gpu_check.extra import INSTALL_HINT, missing_modules
from rollout_lifecycle.gpu_check.hashing import tensors_sha256
from rollout_lifecycle.model.artifacts import ArtifactStore
from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.spec.invariants import check_trace

pytestmark = pytest.mark.skipif(
    bool(missing_modules()),
    reason=f"the [verl] extra is not installed ({', '.join(missing_modules())}): {INSTALL_HINT}",
)

CLI = [sys.executable, "-m", "rollout_lifecycle"]
RUNS = {"clean": None, **{name: name for name in CONTROLS}}


@attrs.frozen
class Run:
    """One finished `gpu-check run` process and what it left."""

    code: int
    stdout: str
    stderr: str
    root: Path
    label: str

    @property
    def path(self) -> Path:
        return self.root / f"{self.label}.json"

    @property
    def folder(self) -> Path:
        return self.root / self.label

    def doc(self) -> dict[str, Any]:
        return dict(json.loads(self.path.read_text()))


def _command(label: str, root: Path, control: str | None) -> list[str]:
    cmd = [*CLI, "gpu-check", "run", "--run-label", label, "--output", str(root)]
    cmd += ["--device", "cpu", "--json", "--quiet"]
    if control is not None:
        cmd.append(f"--control-{control}")
    return cmd


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """The clean run and each control, started together, each in its own process."""
    root = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = {}
    for name, control in RUNS.items():
        procs[name] = subprocess.Popen(
            _command(name, root, control),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
    out = {}
    deadline = time.monotonic() + 900
    for name, p in procs.items():
        so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        out[name] = Run(p.returncode, so, se, root, name)
    yield out


def test_clean_run_passes_every_check(runs: dict[str, Run]) -> None:
    """Exit 0, every check passed, no technical failure, JSON summary on stdout only."""
    r = runs["clean"]
    assert r.code == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout)
    assert summary["passed"] is True and summary["failed_checks"] == []
    doc = r.doc()
    assert doc["technical"] == [] and doc["passed"] is True
    assert all(c["passed"] for c in doc["checks"]), [c for c in doc["checks"] if not c["passed"]]
    assert len(doc["checks"]) == summary["checks"] >= 30
    assert "Traceback" not in r.stderr


def test_result_has_the_seed_field_paths_and_each_group_too(runs: dict[str, Run]) -> None:
    """Top level and every group document carry CONTRACT section 7's paths and the schema."""
    doc = runs["clean"].doc()
    assert validate(doc) == []
    assert [g["group"] for g in doc["groups"]] == ["release_resume", "resident"]
    for g in doc["groups"]:
        assert validate(g) == [], g["group"]
    assert {p for p, _ in REQUIRED_PATHS} >= {"update.grad_norm", "decision.admission"}


def test_measured_update_figures(runs: dict[str, Run]) -> None:
    """Equal initial hashes; 8 LoRA tensors move: 4 B by gradient, 4 A by weight decay only."""
    doc = runs["clean"].doc()
    g1, g2 = doc["groups"]
    assert g1["initialization"]["adapter_sha256"] == g2["initialization"]["adapter_sha256"]
    assert g2["initialization"]["trained"] is True
    for g in (g1, g2):
        u = g["update"]
        assert u["changed_tensors"] == u["tensors_total"] == 8
        assert u["gradient_changed_tensors"] == 4 and u["weight_decay_only_tensors"] == 4
        roles = {t["role"]: set() for t in u["tensors"].values()}
        for t in u["tensors"].values():
            roles[t["role"]].add(t["change"])
        assert roles == {"lora_A": {"weight_decay"}, "lora_B": {"gradient"}}
        assert u["grad_norm"] > 0 and u["delta_l2"] > u["gradient_delta_l2"] > 0
        assert 0 < u["weight_decay_delta_l2"] < u["gradient_delta_l2"] / 100
        assert u["base_weights_unchanged"] is True
        assert u["after_sha256"] != g["initialization"]["adapter_sha256"]
    # the same seed and data give the same update in both groups, on the CPU bit for bit
    assert g1["update"]["after_sha256"] == g2["update"]["after_sha256"]


def test_same_version_logprobs_and_the_comparison_can_fail(runs: dict[str, Run]) -> None:
    """Same weights score the same tokens alike; dummy weights before the first sync do not."""
    cmp = runs["clean"].doc()["decision"]["comparisons"]
    assert cmp["same_version_after"]["max_abs_error"] <= 1e-5
    assert cmp["same_version_before"]["max_abs_error"] <= 1e-5
    assert cmp["same_version_after"]["tokens"] == cmp["same_version_before"]["tokens"] > 0
    assert cmp["before_first_sync"]["max_abs_error"] > 0.15  # the check would catch a stale copy
    assert cmp["version_shift"]["max_abs_error"] > 0  # the update really changed the policy


def test_the_ledger_beside_the_result_holds_the_consumed_rollouts(runs: dict[str, Run]) -> None:
    """Admitted rollouts are consumed by the update in the SQLite file; the pointer is v1."""
    r = runs["clean"]
    doc = r.doc()
    for g in doc["groups"]:
        db = r.folder / g["protocol"]["ledger"]
        with open_backend(f"sqlite:///{db.resolve()}", create=False) as b:
            snap = b.ledger.snapshot()
            admitted = {row["rollout_id"] for row in g["decision"]["admission"] if row["accepted"]}
            assert len(snap) == 8 and admitted
            for rid, e in snap.items():
                assert e.state == ("consumed" if rid in admitted else "rewarded"), rid
                assert e.behavior_version == 0 and e.admission is not None
            pointer = b.registry.pointer()
            assert pointer is not None and pointer.version == 1
            assert pointer.artifact_hash == g["protocol"]["artifacts"]["1"]["artifact_hash"]
        rows = g["decision"]["admission"]
        assert sum(row["accepted"] for row in rows) + sum(not row["accepted"] for row in rows) == 8


def test_artifacts_are_committed_and_hold_the_trained_tensors(runs: dict[str, Run]) -> None:
    """v1 on disk verifies against the registry, and its tensors hash to update.after_sha256."""
    r = runs["clean"]
    g = r.doc()["groups"][0]
    store = ArtifactStore(r.folder / "release_resume.artifacts", create=False)
    assert store.versions() == [0, 1]
    v1 = g["protocol"]["artifacts"]["1"]
    store.verify(1, v1["artifact_hash"])
    import safetensors.numpy as st_numpy

    tensors = st_numpy.load(store.read_bytes(1, "model.safetensors"))
    assert tensors_sha256(tensors) == g["update"]["after_sha256"]


def test_trace_replays_through_the_spec(runs: dict[str, Run]) -> None:
    """The saved trace replays with no violation, and the recorded report is reproduced."""
    r = runs["clean"]
    for g in r.doc()["groups"]:
        events = load_trace((r.folder / g["invariants"]["trace_file"]).read_text().splitlines())
        assert check_trace(events, quiescent=True).ok
        again = trace_report(events)
        assert again == {k: v for k, v in g["invariants"].items() if k != "trace_file"}
        assert len(again["held"]) == len(again["checked"]) >= 15
        kinds = {getattr(e, "event", e.kind) for e in events}
        assert {
            "reserve",
            "commit",
            "activate",
            "distribute",
            "commit_artifact",
            "membership",
        } <= kinds


def test_saved_result_rejudges_to_the_same_checks(runs: dict[str, Run]) -> None:
    """Every check is a function of the saved file: re-judging it gives the recorded checks."""
    for name in RUNS:
        doc = runs[name].doc()
        technical, checks = judge_result(doc)
        assert technical == []
        assert [c.to_json() for c in checks] == doc["checks"], name


def test_generation_side_memory_modes(runs: dict[str, Run]) -> None:
    """Group one releases before the update and is resumed by verl's sync; group two never."""
    groups = runs["clean"].doc()["groups"]
    ev = {
        g["group"]: [(e["phase"], e["event"]) for e in g["generation_side"]["events"]]
        for g in groups
    }
    assert ("update", "release") in ev["release_resume"]
    assert ("sync_v1", "resume") in ev["release_resume"]
    assert not any(e in ("release", "resume") for _, e in ev["resident"])
    for g in groups:
        anns = g["sync_rpc_and_version"]["announcements"]
        assert [a["version"] for a in anns] == [0, 1]


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_negative_control_fails_exactly_its_checks(runs: dict[str, Run], control: str) -> None:
    """Each control exits 1 with exactly its declared checks failed, in both groups."""
    r = runs[control]
    assert r.code == 1, r.stderr[-2000:]
    doc = r.doc()
    assert doc["technical"] == []
    failed = {c["name"] for c in doc["checks"] if not c["passed"]}
    assert failed == expected_failed_checks(control)
    assert doc["negative_control"]["as_expected"] is True
    assert json.loads(r.stdout)["failed_checks"] == doc["failed_checks"]


def test_stale_copy_is_refused_by_the_coordinator(runs: dict[str, Run]) -> None:
    """An honest ack of stale weights: the pointer stays at v0, v1's distribution failed."""
    for g in runs["stale-generation-copy"].doc()["groups"]:
        assert g["protocol"]["activation"]["reason"] == "worker_mismatch"
        assert g["protocol"]["pointer_after"]["version"] == 0
        assert (
            g["sync_rpc_and_version"]["held_after_sync"]
            == g["protocol"]["artifacts"]["0"]["artifact_hash"]
        )
        assert g["invariants"]["violated"] == {}


def test_lying_ack_fools_the_coordinator_but_not_the_check(runs: dict[str, Run]) -> None:
    """The echoed registry hash activates v1; the harness's own read-back tells the truth."""
    for g in runs["ack-registered-hash"].doc()["groups"]:
        v1 = g["protocol"]["artifacts"]["1"]["artifact_hash"]
        ack = g["sync_rpc_and_version"]["acks"][-1]
        assert g["protocol"]["pointer_after"]["version"] == 1
        assert ack["artifact_hash"] == v1 != ack["held_at_ack"]
        assert g["invariants"]["violated"] == {}


def test_version_before_load_is_seen_in_the_announcement(runs: dict[str, Run]) -> None:
    """The v1 announcement was made while the copy still held v0's weights."""
    for g in runs["version-before-load"].doc()["groups"]:
        ann = g["sync_rpc_and_version"]["announcements"][-1]
        assert ann["version"] == 1
        assert ann["held"] == g["protocol"]["artifacts"]["0"]["artifact_hash"]
        assert (
            g["sync_rpc_and_version"]["held_after_sync"]
            == g["protocol"]["artifacts"]["1"]["artifact_hash"]
        )


def test_an_existing_result_is_never_overwritten(runs: dict[str, Run]) -> None:
    """A second run under a used label is refused (exit 2) before any work; the file is intact."""
    r = runs["clean"]
    before = r.path.read_bytes()
    proc = subprocess.run(
        _command("clean", r.root, None), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2
    assert "new label" in proc.stderr and "Traceback" not in proc.stderr
    assert r.path.read_bytes() == before
