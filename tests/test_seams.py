"""Safety at the seams: the compositions users run, each a regression test of issue 9.

1. a reservation judges its lag against the pointer of ITS OWN atomic step, so a version
   activated by another process between admission and reservation cannot carry a stale
   rollout in; 2. the required worker set is durable registry state every coordinator uses;
   3. the ledger refuses writes its spec rejects; 4. an older-than-active version is never
   distributed; 5. `ledger check` compares the replayed trace with the stored rows and names
   each problem once; 6. a ledger whose file was deleted or replaced fails closed;
   7. read-only commands never write.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import attrs
import numpy as np
import pytest

from rollout_lifecycle import activate_policy_version
from rollout_lifecycle.model.backends import Backend, open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.errors import ActivationError, LedgerError
from rollout_lifecycle.model.gate import AdmissionGate, GatePolicy
from rollout_lifecycle.model.ledger import ReserveRequest, WriteRefused
from rollout_lifecycle.model.records import (
    ActionEvidence,
    AdmissionPolicy,
    AdmissionStamp,
    BehaviorPolicy,
    GenerationConditions,
    LedgerEntry,
    Reward,
    Rollout,
    RolloutIdentity,
    WorkerAck,
    to_jsonable,
)
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.model.sqlite_common import FileReplaced, connect
from rollout_lifecycle.stateful_tests.backends import durable_url

H = {v: f"{v:x}".rjust(64, "c") for v in range(10)}
WORKERS = ["gen-0", "gen-1"]
REWARD = Reward("rm", "1", 0.5)
CONDITIONS = GenerationConditions("tok", 1.0, 1.0, -1, 8)
POLICY = AdmissionPolicy(max_lag=1, max_drift=0.2)  # the deployment's recorded policy


def _rollout(rid: str, version: int) -> Rollout:
    return Rollout(
        identity=RolloutIdentity(rid, "p", "d", 0),
        behavior=BehaviorPolicy(version, H[version]),
        conditions=CONDITIONS,
        evidence=ActionEvidence((1, 2), (True, True), (-0.5, -0.5)),
    )


def _activate(c: ActivationCoordinator, version: int) -> None:
    c.prepare(version)
    c.commit_artifact(version, H[version])
    c.distribute(version)
    for w in c.required_workers:
        token = c.attempt_token(w, version)
        assert c.record_ack(WorkerAck(w, version, H[version], token=token)).counted
    assert c.try_activate(version).activated


@contextlib.contextmanager
def two_processes(kind: str, tmp_path: Path) -> Iterator[tuple[Backend, Backend]]:
    """A learner's and an activator's backend on one state: SQLite opens the file twice and
    PostgreSQL one schema twice (two pools, as two processes would); memory shares the
    objects."""
    if kind == "memory":
        b = open_backend("memory://")
        try:
            yield b, b
        finally:
            b.close()
        return
    url = durable_url(kind, tmp_path)
    with open_backend(url) as learner, open_backend(url) as activator:
        yield learner, activator


@pytest.mark.parametrize("kind", ["memory", "sqlite", "postgresql"])
def test_pointer_moved_between_admission_and_reservation_is_refused(
    kind: str, tmp_path: Path
) -> None:
    """Problem 1: the README pattern (admit against the pointer, then reserve) is refused
    with 'pointer_moved' when another process activated a version in between."""
    with two_processes(kind, tmp_path) as (learner, activator):
        set_admission_policy(activator.registry, POLICY, "set by the operator")
        coord = ActivationCoordinator(
            activator.registry, WORKERS, ledger=activator.ledger, policy=POLICY
        )
        _activate(coord, 0)
        _activate(coord, 1)
        ro = _rollout("r0", 0)
        learner.ledger.add(attrs.evolve(ro.entry(), state="rewarded", reward=REWARD))
        entry = learner.ledger.get("r0")
        view = ActivationCoordinator(learner.registry)  # reads the registry's worker set
        gate = AdmissionGate(GatePolicy(max_lag=1, max_drift=0.2), registry=view.activated_hash)
        current = view.pointer()
        assert current is not None and current.version == 1
        (d,) = gate.assess_batch(
            [attrs.evolve(ro, status=entry)], np.full((1, 2), -0.5), current.version
        )
        assert d.accepted and d.lag == 1
        _activate(coord, 2)  # another process moves the pointer: v0 is now 2 behind
        (out,) = learner.ledger.reserve_batch(
            "update-1", [ReserveRequest("r0", entry.revision, d.stamp())]
        )
        assert (out.reserved, out.reason) == (False, "pointer_moved")
        assert "re-admit" in out.detail
        assert learner.ledger.get("r0") == entry
        single = learner.ledger.reserve("r0", entry.revision, "update-1", d.stamp())
        assert (single.reserved, single.reason) == (False, "pointer_moved")
        # re-admitted against v2 the rollout is stale: the gate says so, nothing is consumed
        (again,) = gate.assess_batch([attrs.evolve(ro, status=entry)], np.full((1, 2), -0.5), 2)
        assert again.reason == "stale_policy"


@pytest.mark.parametrize("kind", ["memory", "sqlite", "postgresql"])
def test_version_that_never_activated_is_not_reserved(kind: str, tmp_path: Path) -> None:
    """A rollout of a version that never became active is refused at the write."""
    with two_processes(kind, tmp_path) as (learner, activator):
        set_admission_policy(activator.registry, POLICY, "set by the operator")
        coord = ActivationCoordinator(
            activator.registry, WORKERS, ledger=activator.ledger, policy=POLICY
        )
        _activate(coord, 0)
        learner.ledger.add(
            LedgerEntry(
                rollout_id="ghost",
                behavior_version=3,
                artifact_hash=H[3],
                state="rewarded",
                reward=REWARD,
            )
        )
        stamp = AdmissionStamp(
            current_version=3,
            behavior_version=3,
            max_lag=1,
            max_drift=0.2,
            drift=0.0,
            freshness="fresh",
            reason="ok",
            accepted=True,
        )
        out = learner.ledger.reserve("ghost", 0, "u", stamp)
        assert (out.reserved, out.reason) == (False, "version_not_active")


def test_second_coordinator_with_another_worker_set_is_refused(tmp_path: Path) -> None:
    """Problem 2: the required set is durable; a coordinator requiring only gen-0 cannot
    attach, and one attached without a set activates only with every worker's ack."""
    url = f"sqlite:///{tmp_path / 'state.db'}"
    with open_backend(url) as trainer_side, open_backend(url) as other_side:
        trainer = ActivationCoordinator(trainer_side.registry, WORKERS)
        with pytest.raises(ActivationError, match="the registry requires workers"):
            ActivationCoordinator(other_side.registry, ["gen-0"])
        other = ActivationCoordinator(other_side.registry)
        assert other.required_workers == tuple(WORKERS)
        trainer.prepare(1)
        trainer.commit_artifact(1, H[1])
        trainer.distribute(1)
        token = trainer.attempt_token("gen-0", 1)
        assert trainer.record_ack(WorkerAck("gen-0", 1, H[1], token=token)).counted
        res = other.try_activate(1)
        assert (res.activated, res.reason) == (False, "missing_worker_ack")
        assert other.pointer() is None
        # an explicit, recorded change is the only way to shrink the set
        other.change_membership(["gen-0"], "gen-1 decommissioned by the operator")
        assert trainer.required_workers == ("gen-0",)
        assert trainer.try_activate(1).activated
        kinds = [e.kind for e in trainer_side.registry.trace()]
        assert kinds.count("membership") == 2


def test_small_api_refuses_an_empty_worker_set() -> None:
    """Problem 2: activate_policy_version(..., {}, []) is a ValueError, not an activation."""
    with pytest.raises(ValueError, match="at least one required worker"):
        activate_policy_version(
            None, {"version": 1, "artifact_hash": H[1], "committed": True}, {}, []
        )


@pytest.mark.parametrize("url_kind", ["memory", "sqlite", "postgresql"])
def test_ledger_refuses_what_its_spec_rejects(url_kind: str, tmp_path: Path) -> None:
    """Problem 3: a rewarded entry with no reward, and a stamp contradicting itself, never
    land (refused before anything is written)."""
    url = "memory://" if url_kind == "memory" else durable_url(url_kind, tmp_path)
    with open_backend(url) as b:
        with pytest.raises(WriteRefused, match="without a reward value"):
            b.ledger.add(
                LedgerEntry(
                    rollout_id="x", behavior_version=0, artifact_hash=H[0], state="rewarded"
                )
            )
        assert b.ledger.find("x") is None
        assert b.trace() == []


def test_older_than_active_distribution_never_blocks_the_slot(tmp_path: Path) -> None:
    """Problem 4: two coordinators on one registry: the one behind cannot distribute an
    older version, so it never holds the single distribution slot."""
    url = f"sqlite:///{tmp_path / 'state.db'}"
    with open_backend(url) as a, open_backend(url) as b:
        ca = ActivationCoordinator(a.registry, WORKERS)
        cb = ActivationCoordinator(b.registry)
        ca.prepare(1)
        ca.commit_artifact(1, H[1])
        _activate(ca, 2)
        with pytest.raises(ActivationError, match="not newer than the active v2"):
            cb.distribute(1)
        assert all(x.state != "awaiting_acks" for x in cb.artifacts())
        _activate(cb, 3)  # the slot is free for newer versions
        assert ca.pointer() is not None and ca.pointer().version == 3  # type: ignore[union-attr]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "rollout-lifecycle"
    return subprocess.run(
        [str(script), *args], cwd=cwd, capture_output=True, text=True, check=False
    )


@pytest.fixture
def demo_db(tmp_path: Path) -> Path:
    """A clean, complete run on SQLite (the demo)."""
    db = tmp_path / "demo.db"
    res = _cli("demo", "--backend", f"sqlite:///{db}", "--workdir", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    return db


def test_ledger_check_compares_stored_rows(demo_db: Path, tmp_path: Path) -> None:
    """Problem 5: a deleted row and a reverted row are violations of stored_matches_trace,
    each named once."""
    url = f"sqlite:///{demo_db}"
    assert _cli("ledger", "check", "--backend", url, cwd=tmp_path).returncode == 0
    conn = connect(demo_db)
    rows = conn.execute("SELECT rollout_id, entry FROM rollouts ORDER BY rollout_id").fetchall()
    (gone, _), (reverted, _) = rows[0], rows[1]
    conn.execute("DELETE FROM rollouts WHERE rollout_id = ?", (gone,))
    version = int(
        conn.execute(
            "SELECT behavior_version FROM rollouts WHERE rollout_id = ?", (reverted,)
        ).fetchone()[0]
    )
    # the row put back the way it was at dispatch, behind the trace's back
    old = LedgerEntry(rollout_id=reverted, behavior_version=version, artifact_hash=H[0])
    conn.execute(
        "UPDATE rollouts SET entry = ?, state = 'dispatched', revision = 0, reserved_by = NULL "
        "WHERE rollout_id = ?",
        (json.dumps(to_jsonable(old)), reverted),
    )
    conn.close()
    res = _cli("ledger", "check", "--backend", url, "--json", cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    data = json.loads(res.stdout)
    msgs = [v["message"] for v in data["violations"] if v["invariant"] == "stored_matches_trace"]
    assert any(m.startswith(f"{gone}: in the trace") for m in msgs), msgs
    assert any(m.startswith(f"{reverted}: stored dispatched") for m in msgs), msgs
    assert len(msgs) == 2


def test_ledger_check_names_each_bad_record_once(tmp_path: Path) -> None:
    """Problem 5: two bad records are two violations, however many steps follow them."""
    from rollout_lifecycle.model.events import EntryChanged
    from rollout_lifecycle.spec.invariants import check_trace

    good = LedgerEntry(rollout_id="a", behavior_version=0, artifact_hash=H[0])
    bad = [
        EntryChanged(
            1,
            1,
            0.0,
            "bad1",
            "add",
            None,
            LedgerEntry(
                rollout_id="bad1", behavior_version=0, artifact_hash=H[0], state="rewarded"
            ),
        ),
        EntryChanged(
            2,
            2,
            0.0,
            "bad2",
            "add",
            None,
            LedgerEntry(
                rollout_id="bad2", behavior_version=0, artifact_hash=H[0], state="rewarded"
            ),
        ),
    ]
    later = [
        EntryChanged(
            3 + i, 3 + i, 0.0, f"g{i}", "add", None, attrs.evolve(good, rollout_id=f"g{i}")
        )
        for i in range(20)
    ]
    report = check_trace([*bad, *later], with_registry=False)
    assert [v.invariant for v in report.violations] == ["reward_failures_never_trained"] * 2


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_ledger_fails_closed_when_its_file_goes_away(how: str, tmp_path: Path) -> None:
    """Problem 6: after the file is deleted or replaced under an open ledger, every write
    fails closed (FileReplaced), and the registry's too; nothing lands in the unlinked file."""
    db = tmp_path / "state.db"
    b = open_backend(f"sqlite:///{db}")
    try:
        b.ledger.add(LedgerEntry(rollout_id="a", behavior_version=0, artifact_hash=H[0]))
        backup = tmp_path / "copy.db"
        shutil.copy(db, backup)
        for suffix in ("", "-wal", "-shm"):
            p = Path(f"{db}{suffix}")
            if p.exists():
                p.unlink()
        if how == "replaced":
            shutil.copy(backup, db)
        with pytest.raises(FileReplaced, match=how):
            b.ledger.add(LedgerEntry(rollout_id="b", behavior_version=0, artifact_hash=H[0]))
        with pytest.raises(LedgerError):
            b.ledger.add(LedgerEntry(rollout_id="c", behavior_version=0, artifact_hash=H[0]))
        with pytest.raises(LedgerError, match=how):
            ActivationCoordinator(b.registry, WORKERS)
    finally:
        b.close()


def test_reading_commands_never_write(tmp_path: Path) -> None:
    """Problem 7: `ledger counts` on a ledger-only file adds no registry tables."""
    from rollout_lifecycle.model.sqlite_ledger import SQLiteLedger

    db = tmp_path / "ledger-only.db"
    led = SQLiteLedger(db)
    led.add(LedgerEntry(rollout_id="a", behavior_version=0, artifact_hash=H[0]))
    led.close()

    def tables() -> list[str]:
        c = sqlite3.connect(db)
        try:
            return sorted(r[0] for r in c.execute("SELECT name FROM sqlite_master"))
        finally:
            c.close()

    before = tables()
    for sub in (["counts"], ["show", "a"], ["history", "a"], ["check"]):
        res = _cli("ledger", *sub, "--backend", f"sqlite:///{db}", cwd=tmp_path)
        assert res.returncode == 0, (sub, res.stdout, res.stderr)
    assert tables() == before
    assert not any("registry" in t for t in tables())


def test_read_only_storage_is_read_and_said_plainly(tmp_path: Path) -> None:
    """Problem 7: on a read-only mount the reading commands work; a writer is told why."""
    if os.geteuid() != 0:
        pytest.skip("needs root to bind-mount a folder read-only")
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    db = src / "state.db"
    with open_backend(f"sqlite:///{db}") as b:
        b.ledger.add(LedgerEntry(rollout_id="a", behavior_version=0, artifact_hash=H[0]))
    mounted = subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.decode().strip()}")
    try:
        remount = subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True)
        if remount.returncode != 0:
            pytest.skip(f"cannot remount read-only: {remount.stderr.decode().strip()}")
        url = f"sqlite:///{ro / 'state.db'}"
        res = _cli("ledger", "counts", "--backend", url, "--json", cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        check = _cli("ledger", "check", "--backend", url, cwd=tmp_path)
        assert check.returncode == 0, check.stdout + check.stderr
        with pytest.raises(Exception, match=r"cannot be written|read-only|readonly"):
            open_backend(url)
    finally:
        if subprocess.run(["umount", str(ro)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(ro)], capture_output=True)  # detach when busy
