"""Two-phase activation over every registry backend: acks, refusals, failures, rollback, restart."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from rollout_lifecycle.model.artifacts import ArtifactStore, WorkerLoader
from rollout_lifecycle.model.backends import sqlite_path
from rollout_lifecycle.model.coordinator import ActivationCoordinator, Settled
from rollout_lifecycle.model.errors import ActivationError, IllegalTransition
from rollout_lifecycle.model.events import ArtifactChanged, EventLog
from rollout_lifecycle.model.ledger import ManualClock, MemoryLedger
from rollout_lifecycle.model.records import ActivePointer, LedgerEntry, WorkerAck
from rollout_lifecycle.model.registry import (
    ArtifactChange,
    MemoryRegistry,
    RegistryStep,
    RegistryStore,
    RegistryView,
    SQLiteRegistry,
    WorkerReport,
)
from rollout_lifecycle.model.sqlite_common import connect, read_events
from rollout_lifecycle.model.sqlite_ledger import SQLiteLedger
from rollout_lifecycle.spec.invariants import check_trace
from rollout_lifecycle.stateful_tests.backends import fresh_schema, postgres_url

WORKERS = ("w0", "w1")
H = {v: f"{v:x}".rjust(64, "a") for v in range(10)}
BAD = "f" * 64

Opener = Callable[[], RegistryStore]


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def open_registry(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    """Open the backend's registry: memory gives the same object, SQLite and PostgreSQL a
    new connection to the same state (one file; one schema of the test server)."""
    opened: list[RegistryStore] = []
    mem = MemoryRegistry()
    schema = None
    if request.param == "postgresql":
        schema = fresh_schema(postgres_url(), tmp_path)

    def opener() -> RegistryStore:
        reg: RegistryStore
        if request.param == "memory":
            reg = mem
        elif request.param == "sqlite":
            reg = SQLiteRegistry(tmp_path / "state.db")
        else:
            from rollout_lifecycle.model.postgres_registry import PostgresRegistry

            reg = PostgresRegistry(postgres_url(), schema=schema)
        opened.append(reg)
        return reg

    yield opener
    for r in opened:
        r.close()


@pytest.fixture
def coord(open_registry: Opener) -> ActivationCoordinator:
    """A coordinator with two required workers and no ledger."""
    return ActivationCoordinator(open_registry(), WORKERS)


def ack(
    worker: str,
    version: int,
    h: str | None = None,
    inc: int = 0,
    seq: int = 0,
    token: str | None = None,
) -> WorkerAck:
    """A worker's report of what it loaded (echoing `token` if it answers an attempt)."""
    return WorkerAck(worker, version, H[version] if h is None else h, inc, seq, token=token)


def answer(
    c: ActivationCoordinator,
    worker: str,
    version: int,
    h: str | None = None,
    inc: int = 0,
    seq: int = 0,
) -> WorkerAck:
    """The ack a worker sends for the current distribution attempt: it echoes its token."""
    return ack(worker, version, h, inc, seq, token=c.attempt_token(worker, version))


def ready(c: ActivationCoordinator, version: int) -> None:
    """Prepare, commit and distribute `version` (state awaiting_acks)."""
    c.prepare(version)
    c.commit_artifact(version, H[version])
    c.distribute(version)


def activate(c: ActivationCoordinator, version: int, seq: int = 0) -> None:
    """Drive `version` all the way to active with both workers' acks."""
    ready(c, version)
    for w in WORKERS:
        assert c.record_ack(answer(c, w, version, seq=seq)).counted
    res = c.try_activate(version)
    assert res.activated, res


def assert_trace_ok(c: ActivationCoordinator) -> None:
    """The spec's invariants hold over the whole recorded history."""
    report = check_trace(c.trace())
    assert report.ok, [str(v) for v in report.violations]


# ---- the happy path ------------------------------------------------------------------------


def test_activation_on_all_acks(coord: ActivationCoordinator) -> None:
    """With the artifact committed and every worker acking (version, hash), the pointer flips."""
    ready(coord, 1)
    assert coord.record_ack(answer(coord, "w0", 1)).counted
    assert coord.record_ack(answer(coord, "w1", 1)).counted
    res = coord.try_activate(1)
    assert (res.activated, res.reason) == (True, "activated")
    assert res.active_pointer == ActivePointer(1, H[1]) == coord.pointer()
    assert coord.artifact(1).state == "active"
    hist = coord.history()
    assert [e.event for e in hist] == ["register", "commit_artifact", "distribute", "activate"]
    act = hist[-1]
    assert act.before is not None and act.pointer_before is None
    assert act.pointer_after == ActivePointer(1, H[1])
    assert act.required_workers == WORKERS
    assert {a.worker_id for a in act.acks} == set(WORKERS)
    assert hist[0].before is None and hist[0].after.state == "prepared"
    assert_trace_ok(coord)


def test_second_activation_supersedes_in_the_same_step(coord: ActivationCoordinator) -> None:
    """Activating v2 moves v1 to superseded in one transaction with the pointer switch."""
    activate(coord, 1)
    activate(coord, 2, seq=1)
    assert coord.pointer() == ActivePointer(2, H[2])
    assert coord.artifact(1).state == "superseded"
    assert coord.artifact(2).rollback_version == 1
    last = coord.history()[-2:]
    assert [e.event for e in last] == ["activate", "supersede"]
    assert last[0].txn == last[1].txn
    assert all(e.pointer_before == ActivePointer(1, H[1]) for e in last)
    assert coord.statistics().workers_in_sync == WORKERS
    assert_trace_ok(coord)


# ---- refusals keep the old pointer ---------------------------------------------------------


def test_missing_ack_keeps_old_pointer(open_registry: Opener) -> None:
    """A required worker that never reported: refused with missing_worker_ack, nothing written."""
    activate(ActivationCoordinator(open_registry(), WORKERS), 1)
    c = ActivationCoordinator(open_registry())  # the registry's set, read back
    assert c.required_workers == WORKERS
    c.change_membership((*WORKERS, "w2"), "scaled up by one worker")
    ready(c, 2)
    for w in WORKERS:
        c.record_ack(answer(c, w, 2, seq=1))
    n = len(c.history())
    res = c.try_activate(2)
    assert (res.activated, res.reason) == (False, "missing_worker_ack")
    assert (res.missing_workers, res.mismatched_workers) == (("w2",), ())
    assert c.pointer() == res.active_pointer == ActivePointer(1, H[1])
    assert c.artifact(2).state == "awaiting_acks"
    assert len(c.history()) == n
    assert c.record_ack(answer(c, "w2", 2)).counted
    assert c.try_activate(2).activated


def test_missing_ack_on_first_activation(coord: ActivationCoordinator) -> None:
    """Before any activation a worker with no report at all is listed as missing."""
    ready(coord, 1)
    coord.record_ack(answer(coord, "w0", 1))
    res = coord.try_activate(1)
    assert (res.reason, res.missing_workers, res.active_pointer) == (
        "missing_worker_ack",
        ("w1",),
        None,
    )
    assert coord.pointer() is None


def test_wrong_hash_keeps_old_pointer(coord: ActivationCoordinator) -> None:
    """A worker that loaded other bytes under the right version blocks the switch."""
    activate(coord, 1)
    ready(coord, 2)
    coord.record_ack(answer(coord, "w0", 2, seq=1))
    coord.record_ack(answer(coord, "w1", 2, h=BAD, seq=1))
    res = coord.try_activate(2)
    assert (res.reason, res.mismatched_workers) == ("worker_mismatch", ("w1",))
    assert coord.pointer() == ActivePointer(1, H[1])
    assert coord.artifact(2).state == "awaiting_acks"


def test_stale_ack_from_older_version_does_not_count(coord: ActivationCoordinator) -> None:
    """A worker's ack of v1 never counts toward v2 (field-notes bug 12)."""
    activate(coord, 1)
    ready(coord, 2)
    coord.record_ack(answer(coord, "w0", 2, seq=1))
    res = coord.try_activate(2)
    assert (res.reason, res.mismatched_workers) == ("worker_mismatch", ("w1",))
    # a delayed copy of w1's v1 ack arriving after its v2 ack is out of order, not counted
    assert coord.record_ack(answer(coord, "w1", 2, seq=2)).counted
    late = coord.record_ack(ack("w1", 1, seq=0))
    assert (late.counted, late.reason) == (False, "out_of_order")
    assert coord.try_activate(2).activated


def test_uncommitted_artifact_never_activates(coord: ActivationCoordinator) -> None:
    """Acks for a prepared (or committed but undistributed) artifact never flip the pointer,
    nor do they count once it is distributed: no attempt was open, so they carry no token."""
    activate(coord, 1)
    coord.prepare(2)
    for w in WORKERS:
        got = coord.record_ack(ack(w, 2, seq=1))
        assert (got.counted, got.reason, got.recorded) == (False, "reported", True)
    res = coord.try_activate(2)
    assert (res.activated, res.reason) == (False, "artifact_not_committed")
    coord.commit_artifact(2, H[2])
    res = coord.try_activate(2)
    assert (res.activated, res.reason) == (False, "not_awaiting_acks")
    assert coord.pointer() == ActivePointer(1, H[1])
    coord.distribute(2)
    res = coord.try_activate(2)
    assert (res.activated, res.missing_workers) == (False, WORKERS)
    for w in WORKERS:
        assert coord.record_ack(answer(coord, w, 2, seq=2)).counted
    assert coord.try_activate(2).activated


def test_non_monotonic_and_reused_versions_are_refused(coord: ActivationCoordinator) -> None:
    """prepare refuses a version not above every registered one, and any reuse."""
    activate(coord, 3)
    n = len(coord.history())
    with pytest.raises(ActivationError, match="already registered"):
        coord.prepare(3)
    with pytest.raises(ActivationError, match="not greater"):
        coord.prepare(2)
    coord.prepare(5)
    coord.commit_artifact(5, H[5])
    coord.abandon(5, "operator")
    with pytest.raises(ActivationError, match="already registered"):
        coord.prepare(5)  # even an abandoned version is never reused
    with pytest.raises(ActivationError, match="not greater"):
        coord.prepare(4)
    assert len(coord.history()) == n + 3
    assert coord.pointer() == ActivePointer(3, H[3])


def test_older_than_active_distribution_is_refused(coord: ActivationCoordinator) -> None:
    """Once a newer version is active, distributing an older one is refused, nothing written.

    It could never activate (versions only move forward), and it would hold the single
    distribution slot: in a two-coordinator race it blocked every newer version.
    """
    activate(coord, 1)
    coord.prepare(2)
    coord.commit_artifact(2, H[2])
    ready(coord, 3)
    for w in WORKERS:
        coord.record_ack(answer(coord, w, 3, seq=5))
    assert coord.try_activate(3).activated
    before = coord.artifacts()
    with pytest.raises(ActivationError, match="not newer than the active v3"):
        coord.distribute(2)
    assert coord.artifacts() == before and coord.pointer() == ActivePointer(3, H[3])
    prepared = coord.artifact(2)
    assert prepared.state == "committed"
    assert_trace_ok(coord)


def test_one_distribution_at_a_time(coord: ActivationCoordinator) -> None:
    """While one version awaits acks, distributing or retrying another is refused, unchanged."""
    activate(coord, 1)
    ready(coord, 2)
    coord.prepare(3)
    coord.commit_artifact(3, H[3])
    before = coord.artifacts()
    with pytest.raises(ActivationError, match="one distribution at a time"):
        coord.distribute(3)
    assert coord.artifacts() == before
    coord.fail_distribution(2, "timeout")
    coord.distribute(3)
    with pytest.raises(ActivationError, match="v3 is still awaiting acks"):
        coord.retry(2)
    assert_trace_ok(coord)


# ---- worker reports ------------------------------------------------------------------------


def test_ack_ordering_reasons(coord: ActivationCoordinator) -> None:
    """Reports are kept per worker by (incarnation, seq); every ignored one says why."""
    ready(coord, 1)
    assert coord.record_ack(answer(coord, "w0", 1, seq=3)).reason == "counted"
    assert coord.record_ack(answer(coord, "w0", 1, seq=3)).reason == "duplicate"
    assert coord.record_ack(answer(coord, "w0", 1, h=BAD, seq=3)).reason == "conflicting_report"
    assert coord.record_ack(answer(coord, "w0", 1, seq=2)).reason == "out_of_order"
    assert coord.record_ack(ack("w9", 1)).reason == "not_required"
    # a token counts once: a new incarnation's ack of this attempt needs a fresh one (retry)
    assert coord.record_ack(answer(coord, "w0", 1, inc=1, seq=0)).reason == "spent_attempt_token"
    assert coord.reports() == {"w0": answer(coord, "w0", 1, seq=3), "w9": ack("w9", 1)}
    assert coord.statistics().acks == {
        "counted": 1,
        "duplicate": 1,
        "conflicting_report": 1,
        "out_of_order": 1,
        "not_required": 1,
        "spent_attempt_token": 1,
    }


def test_ack_from_previous_incarnation_after_restart_does_not_count(
    coord: ActivationCoordinator,
) -> None:
    """After a restart the worker's old ack is void, and a late one from before is ignored."""
    activate(coord, 1)
    ready(coord, 2)
    coord.record_ack(answer(coord, "w0", 2, seq=1))
    coord.record_ack(answer(coord, "w1", 2, seq=1))
    coord.worker_restarted("w1", 1)  # w1 crashed after acking: it no longer holds v2
    assert "w1" not in coord.reports()
    res = coord.try_activate(2)
    assert (res.reason, res.missing_workers) == ("missing_worker_ack", ("w1",))
    late = coord.record_ack(answer(coord, "w1", 2, inc=0, seq=9))  # sent before the crash
    assert (late.counted, late.reason) == (False, "stale_incarnation")
    assert not coord.try_activate(2).activated
    assert coord.pointer() == ActivePointer(1, H[1])
    # the new incarnation reloads, but this attempt's token counted once already: it takes a
    # new attempt (whose fresh tokens every worker acks) for w1's reload to count
    again = coord.record_ack(answer(coord, "w1", 2, inc=1, seq=0))
    assert (again.counted, again.reason) == (False, "spent_attempt_token")
    coord.fail_distribution(2, "w1 restarted")
    coord.retry(2)
    assert coord.record_ack(answer(coord, "w0", 2, seq=2)).counted
    assert coord.record_ack(answer(coord, "w1", 2, inc=1, seq=1)).counted
    assert coord.try_activate(2).activated


def test_restart_notice_after_new_incarnation_ack_keeps_it(coord: ActivationCoordinator) -> None:
    """A late restart notice does not void an ack the new incarnation already sent."""
    coord.record_ack(ack("w0", 1, inc=2, seq=0))
    rep = coord.worker_restarted("w0", 2)
    assert rep.ack == ack("w0", 1, inc=2, seq=0)
    assert coord.worker_restarted("w0", 1).floor == 2  # floors never go down


def test_restarted_worker_is_out_of_sync_until_it_reloads(coord: ActivationCoordinator) -> None:
    """A recovered worker does not count as serving the active version (bug 11) until it acks."""
    activate(coord, 1)
    coord.worker_restarted("w0", 1)
    st = coord.statistics()
    assert (st.workers_in_sync, st.workers_out_of_sync) == (("w1",), ("w0",))
    coord.record_ack(ack("w0", 1, inc=1))
    assert coord.statistics().workers_in_sync == WORKERS


# ---- failures, quarantine, stages ----------------------------------------------------------


def _ledger_with_rollouts(log: EventLog | None = None) -> MemoryLedger:
    led = MemoryLedger(event_log=log)
    for rid, v in [("r1", 1), ("r2", 2), ("r3", 2), ("r4", 3)]:
        led.add(LedgerEntry(rollout_id=rid, behavior_version=v, artifact_hash=H[v]))
    led.transition("r3", "generation_done", 0)
    return led


def test_failed_distribution_quarantines_that_versions_rollouts(open_registry: Opener) -> None:
    """Rollouts stamped with the failed version are quarantined (stage activation); others not."""
    led = _ledger_with_rollouts()
    c = ActivationCoordinator(open_registry(), WORKERS, ledger=led)
    activate(c, 1)
    ready(c, 2)
    c.record_ack(answer(c, "w0", 2, seq=1))
    before = led.snapshot()
    rec = c.fail_distribution(2, "load_timeout", "w1 did not answer in 60 s")
    assert rec.state == "distribution_failed"
    assert rec.failure is not None and rec.failure.stage == "distribution"
    assert c.pointer() == ActivePointer(1, H[1])
    after = led.snapshot()
    for rid in ("r2", "r3"):
        assert after[rid].state == "quarantined"
        d = after[rid].disposition
        assert d is not None and d.stage == "activation"
    assert after["r1"] == before["r1"] and after["r4"] == before["r4"]
    assert_trace_ok(c)


def test_shared_event_log_orders_registry_before_ledger_quarantine() -> None:
    """With one EventLog, the failure step precedes the quarantine it caused."""
    log = EventLog()
    led = _ledger_with_rollouts(log)
    c = ActivationCoordinator(MemoryRegistry(log), WORKERS, ledger=led)
    c.prepare(2)
    c.fail_commit(2, "disk_full")
    # the bad-version mark's recorded row (kind 'row', for `ledger check`) is bookkeeping
    kinds = [(e.kind, getattr(e, "event", None)) for e in log.events() if e.kind != "row"][-3:]
    assert kinds == [("artifact", "fail_commit"), ("entry", "quarantine"), ("entry", "quarantine")]


def test_every_failure_has_its_own_stage(open_registry: Opener) -> None:
    """Commit failure, distribution failure and abandonment are recorded at their stages."""
    led = _ledger_with_rollouts()
    c = ActivationCoordinator(open_registry(), WORKERS, ledger=led)
    c.prepare(1)
    f1 = c.fail_commit(1, "disk_full", "ENOSPC on shard 2").failure
    ready(c, 2)
    f2 = c.fail_distribution(2, "nccl_error").failure
    c.prepare(3)
    c.commit_artifact(3, H[3])
    f3 = c.abandon(3, "superseded_by_newer_run").failure
    assert f1 is not None and (f1.stage, f1.cause, f1.detail) == (
        "artifact",
        "disk_full",
        "ENOSPC on shard 2",
    )
    assert f2 is not None and (f2.stage, f2.cause) == ("distribution", "nccl_error")
    assert f3 is not None and (f3.stage, f3.cause) == ("distribution", "superseded_by_newer_run")
    assert {e.disposition.stage for e in led.snapshot().values() if e.disposition} == {"activation"}
    assert c.pointer() is None
    assert_trace_ok(c)


def test_retry_after_distribution_failure_can_activate(coord: ActivationCoordinator) -> None:
    """distribution_failed -> retry -> awaiting_acks keeps the failure and counts attempts."""
    ready(coord, 1)
    coord.fail_distribution(1, "worker_oom")
    rec = coord.retry(1)
    assert (rec.state, rec.attempts) == ("awaiting_acks", 2)
    assert rec.failure is not None and rec.failure.cause == "worker_oom"
    for w in WORKERS:
        coord.record_ack(answer(coord, w, 1, seq=1))
    assert coord.try_activate(1).activated
    assert_trace_ok(coord)


def test_ack_of_an_earlier_attempt_does_not_count(coord: ActivationCoordinator) -> None:
    """After a retry, an ack of the failed attempt counts as missing, and a delayed one
    arriving during the retry is refused with its reason, never counted."""
    ready(coord, 1)
    first = answer(coord, "w0", 1, seq=1)
    delayed = answer(coord, "w1", 1, seq=1)  # sent in attempt 1, still in flight
    assert coord.record_ack(first).counted
    coord.fail_distribution(1, "timeout")
    coord.retry(1)
    assert coord.attempt_token("w1", 1) != delayed.token
    late = coord.record_ack(delayed)
    assert (late.counted, late.reason, late.recorded) == (False, "stale_attempt_token", False)
    res = coord.try_activate(1)
    assert (res.activated, res.reason, res.missing_workers) == (
        False,
        "missing_worker_ack",
        WORKERS,
    )
    coord.record_ack(answer(coord, "w1", 1, seq=2))
    assert coord.try_activate(1).missing_workers == ("w0",)
    coord.record_ack(answer(coord, "w0", 1, seq=2))
    assert coord.try_activate(1).activated
    assert_trace_ok(coord)


def test_illegal_events_raise_and_change_nothing(coord: ActivationCoordinator) -> None:
    """Events the machine does not declare raise IllegalTransition; nothing is written."""
    coord.prepare(1)
    n = len(coord.history())
    calls: list[Callable[[], object]] = [
        lambda: coord.distribute(1),
        lambda: coord.retry(1),
        lambda: coord.fail_distribution(1, "x"),
        lambda: coord.abandon(1, "x"),
    ]
    for call in calls:
        with pytest.raises(IllegalTransition):
            call()
    coord.commit_artifact(1, H[1])
    with pytest.raises(IllegalTransition):
        coord.commit_artifact(1, BAD)  # a committed hash never changes
    with pytest.raises(IllegalTransition):
        coord.fail_commit(1, "late")
    assert coord.artifact(1).artifact_hash == H[1]
    coord.distribute(1)
    with pytest.raises(IllegalTransition):
        coord.abandon(1, "x")  # awaiting acks: fail_distribution first
    assert len(coord.history()) == n + 2
    with pytest.raises(ActivationError, match="not registered"):
        coord.distribute(7)
    with pytest.raises(ActivationError, match="not registered"):
        coord.try_activate(7)


# ---- rollback ------------------------------------------------------------------------------


def test_rollback_to_recorded_pointer(coord: ActivationCoordinator) -> None:
    """rollback restores the active artifact's recorded pointer in one atomic step."""
    activate(coord, 1)
    activate(coord, 2, seq=1)
    p = coord.rollback()
    assert p == ActivePointer(1, H[1]) == coord.pointer()
    assert coord.artifact(2).state == "rolled_back"
    assert coord.artifact(1).state == "active"
    last = coord.history()[-2:]
    assert [e.event for e in last] == ["roll_back", "reinstate"]
    assert last[0].txn == last[1].txn
    assert last[0].pointer_before == ActivePointer(2, H[2])
    assert coord.statistics().workers_out_of_sync == WORKERS  # they still hold v2
    n = len(coord.history())
    with pytest.raises(ActivationError, match="no recorded rollback pointer"):
        coord.rollback()  # v1 was the first: nowhere to go
    assert len(coord.history()) == n
    # forward again: the next version must exceed v2, which is never reused
    with pytest.raises(ActivationError):
        coord.prepare(2)
    activate(coord, 3, seq=2)
    assert coord.artifact(3).rollback_version == 1
    assert_trace_ok(coord)


def test_rollback_refused_when_target_not_superseded(coord: ActivationCoordinator) -> None:
    """A rollback pointer naming a version that never became active is refused, nothing changed."""
    with pytest.raises(ActivationError, match="nothing to roll back"):
        coord.rollback()
    activate(coord, 1)
    ready(coord, 2)
    coord.prepare(3, rollback_version=2)
    coord.fail_distribution(2, "broken")
    coord.commit_artifact(3, H[3])
    coord.distribute(3)
    for w in WORKERS:
        coord.record_ack(answer(coord, w, 3, seq=1))
    assert coord.try_activate(3).activated
    n = len(coord.history())
    with pytest.raises(ActivationError, match="not 'superseded'"):
        coord.rollback()
    assert len(coord.history()) == n
    assert coord.pointer() == ActivePointer(3, H[3])


def test_prepare_validates_lineage(coord: ActivationCoordinator) -> None:
    """Parent and rollback pointers must be older; a rollback pointer must be registered."""
    with pytest.raises(ActivationError, match="older"):
        coord.prepare(2, parent_version=2)
    with pytest.raises(ActivationError, match="registered"):
        coord.prepare(2, rollback_version=1)
    rec = coord.prepare(2, parent_version=0, rollback_version=None)
    assert (rec.parent_version, rec.rollback_version, rec.state) == (0, None, "prepared")


def test_required_workers_are_validated(open_registry: Opener) -> None:
    """No required workers (disk alone would activate), duplicates or empty ids are refused."""
    reg = open_registry()
    for bad in ((), ("w0", "w0"), ("",)):
        with pytest.raises(ActivationError):
            ActivationCoordinator(reg, bad)


# ---- restart ---------------------------------------------------------------------------------


def test_restart_mid_activation_resumes_and_completes(open_registry: Opener) -> None:
    """A new coordinator on the same store sees the same pointer, attempt and reports."""
    led = _ledger_with_rollouts()
    c1 = ActivationCoordinator(open_registry(), WORKERS, ledger=led)
    activate(c1, 1)
    ready(c1, 2)
    c1.record_ack(answer(c1, "w0", 2, seq=1))
    c1.record_ack(answer(c1, "w1", 2, seq=1))
    c1.worker_restarted("w1", 1)
    c1.prepare(3)
    c1.fail_commit(3, "disk_full")
    pointer, reports = c1.pointer(), c1.reports()
    del c1

    c2 = ActivationCoordinator(open_registry(), WORKERS, ledger=led)
    assert c2.pointer() == pointer == ActivePointer(1, H[1])
    assert c2.reports() == reports
    pending = c2.resume()
    assert [a.version for a in pending.awaiting_acks] == [2]
    assert pending.awaiting_acks[0].attempts == 1
    assert c2.artifact(3).state == "commit_failed"
    assert pending.quarantined_versions == (3,)
    assert c2.record_ack(answer(c2, "w1", 2, inc=0, seq=5)).reason == "stale_incarnation"
    # w1's token of this attempt counted once already: its new incarnation needs a retry
    assert c2.record_ack(answer(c2, "w1", 2, inc=1, seq=0)).reason == "spent_attempt_token"
    c2.fail_distribution(2, "w1 restarted")
    c2.retry(2)
    assert c2.record_ack(answer(c2, "w0", 2, seq=2)).counted
    assert c2.record_ack(answer(c2, "w1", 2, inc=1, seq=1)).counted
    assert c2.try_activate(2).activated
    assert c2.pointer() == ActivePointer(2, H[2])
    assert_trace_ok(c2)


def test_resume_reapplies_quarantine_idempotently(open_registry: Opener) -> None:
    """A crash between the failure step and the ledger quarantine is healed by resume()."""
    led = _ledger_with_rollouts()
    c1 = ActivationCoordinator(open_registry(), WORKERS)  # the ledger call "never happened"
    ready(c1, 2)
    c1.fail_distribution(2, "lost")
    assert led.get("r2").state == "dispatched"
    c2 = ActivationCoordinator(open_registry(), WORKERS, ledger=led)
    c2.resume()
    assert led.get("r2").state == "quarantined"
    n = len(led.history())
    c2.resume()
    assert len(led.history()) == n


def test_sqlite_registry_and_ledger_share_one_file_and_order(tmp_path: Path) -> None:
    """Registry and ledger events land in the same `events` table, in causal order."""
    db = tmp_path / "state.db"
    led = SQLiteLedger(db)
    reg = SQLiteRegistry(db)
    try:
        led.add(LedgerEntry(rollout_id="r2", behavior_version=2, artifact_hash=H[2]))
        c = ActivationCoordinator(reg, WORKERS, ledger=led)
        ready(c, 2)
        c.fail_distribution(2, "nccl_error")
        conn = connect(db)
        evs = [e for e in read_events(conn) if e.kind != "row"]  # rows: the seal's, a mark's
        conn.close()
        assert [(e.kind, getattr(e, "event", None)) for e in evs] == [
            ("entry", "add"),
            ("membership", None),
            ("artifact", "register"),
            ("artifact", "commit_artifact"),
            ("artifact", "distribute"),
            ("artifact", "fail_distribution"),
            ("entry", "quarantine"),
        ]
        assert len({e.txn for e in evs}) == len(evs)
    finally:
        led.close()
        reg.close()


def test_sqlite_triggers_guard_write_once_rules(tmp_path: Path) -> None:
    """Even raw SQL cannot change a committed hash or insert a reused version."""
    reg = SQLiteRegistry(tmp_path / "state.db")
    c = ActivationCoordinator(reg, WORKERS)
    c.prepare(1)
    c.commit_artifact(1, H[1])
    conn = connect(tmp_path / "state.db")
    try:
        with pytest.raises(sqlite3.IntegrityError, match="never changes"):
            conn.execute("UPDATE registry_artifacts SET artifact_hash = 'x' WHERE version = 1")
        with pytest.raises(sqlite3.IntegrityError, match="never reused"):
            conn.execute(
                "INSERT INTO registry_artifacts(version, state, attempts) VALUES (0, 'prepared', 0)"
            )
    finally:
        conn.close()
        reg.close()


def test_concurrent_coordinators_register_each_version_once(tmp_path: Path) -> None:
    """Racing coordinators on one SQLite file: each version is registered exactly once."""
    db = tmp_path / "state.db"
    SQLiteRegistry(db).close()
    wins: list[int] = []
    losses: list[int] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        reg = SQLiteRegistry(db)
        c = ActivationCoordinator(reg, WORKERS)
        for v in range(1, 21):
            try:
                c.prepare(v)
                ok = True
            except ActivationError:
                ok = False
            with lock:
                (wins if ok else losses).append(v)
        reg.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reg = SQLiteRegistry(db)
    try:
        versions = [a.version for a in reg.artifacts()]
        assert len(wins) == len(versions) == len(set(wins))
        assert versions == sorted(versions)
        assert len(wins) + len(losses) == 80
        events = reg.history()
        assert all(isinstance(e, ArtifactChanged) and e.event == "register" for e in events)
    finally:
        reg.close()


def test_sqlite_registry_refuses_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    """Opening garbage as a registry is an ActivationError that says what to do."""
    bad = tmp_path / "not.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ActivationError, match="not a usable registry database"):
        SQLiteRegistry(bad)


def test_retried_version_that_activates_is_no_longer_bad(open_registry: Opener) -> None:
    """fail -> retry -> activate lifts the ledger's mark: new rollouts of it stay open."""
    led = MemoryLedger()
    c = ActivationCoordinator(open_registry(), WORKERS, ledger=led)
    activate(c, 1)
    ready(c, 2)
    c.fail_distribution(2, "timeout")
    assert 2 in led.bad_versions
    c.retry(2)
    for w in WORKERS:
        c.record_ack(answer(c, w, 2, seq=3))
    assert c.try_activate(2).activated
    assert 2 not in led.bad_versions
    e = led.add(LedgerEntry(rollout_id="fresh", behavior_version=2, artifact_hash=H[2]))
    assert e.state == "dispatched"
    assert_trace_ok(c)


def test_rollback_refused_while_a_distribution_awaits_acks(coord: ActivationCoordinator) -> None:
    """An ack collected before a rollback must not activate a version workers dropped."""
    activate(coord, 1)
    activate(coord, 2, seq=1)
    ready(coord, 3)
    coord.record_ack(answer(coord, "w0", 3, seq=9))
    before = coord.pointer()
    with pytest.raises(ActivationError, match="awaiting acks"):
        coord.rollback()
    assert coord.pointer() == before == ActivePointer(2, H[2])
    coord.fail_distribution(3, "operator")
    assert coord.rollback() == ActivePointer(1, H[1])
    assert_trace_ok(coord)


# ---- acks bound to an attempt, and to membership (issue 17, items 2 and 3) ----------------

W3 = ("w0", "w1", "w2")


def _three(open_registry: Opener) -> ActivationCoordinator:
    """Three required workers, v0 active on all of them, v1 distributed (awaiting acks)."""
    c = ActivationCoordinator(open_registry(), W3)
    c.prepare(0)
    c.commit_artifact(0, H[0])
    c.distribute(0)
    for w in W3:
        assert c.record_ack(answer(c, w, 0)).counted
    assert c.try_activate(0).activated
    ready(c, 1)
    return c


@pytest.mark.parametrize("numbered", [False, True], ids=["bare", "inc-seq-attempt"])
def test_leaving_voids_acks_and_rejoining_needs_a_fresh_one(
    open_registry: Opener, numbered: bool
) -> None:
    """Issue 17 item 2: w2 acks v1, leaves, reloads v0 and says so, re-joins; w0 and w1 ack
    v1: v1 must not activate while w2 holds v0, whatever numbers the acks echo."""
    c = _three(open_registry)
    extra = {"incarnation": 0, "seq": 5, "attempt": 1} if numbered else {}
    old_token = c.attempt_token("w2", 1)
    w2_v1 = WorkerAck("w2", 1, H[1], token=old_token, **extra)
    assert c.record_ack(w2_v1).counted
    c.change_membership(("w0", "w1"), "w2 drained for maintenance")
    assert "w2" not in c.reports()  # leaving voided its ack, in the same step
    with pytest.raises(ActivationError, match="not a required worker"):
        c.attempt_token("w2", 1)
    if numbered:
        extra = {"incarnation": 0, "seq": 6, "attempt": 1}
    got = c.record_ack(WorkerAck("w2", 0, H[0], **extra))  # it reloaded v0, and reports it
    assert (got.counted, got.reason, got.recorded) == (False, "not_required", True)
    assert c.reports()["w2"].version == 0  # recorded, not dropped: we know what w2 holds
    reported = [e for e in c.trace() if getattr(e, "worker_id", None) == "w2"]
    assert reported[-1].ack is not None and reported[-1].ack.version == 0
    c.change_membership(W3, "w2 is back")
    fresh = c.attempt_token("w2", 1)
    assert fresh != old_token
    for w in ("w0", "w1"):
        assert c.record_ack(answer(c, w, 1, seq=7)).counted
    res = c.try_activate(1)
    assert (res.activated, res.reason, res.mismatched_workers) == (
        False,
        "worker_mismatch",
        ("w2",),
    )
    assert c.pointer() == ActivePointer(0, H[0])
    # the ack w2 sent before it left is still in flight: it never counts again
    again = c.record_ack(attrs.evolve(w2_v1, seq=8) if numbered else w2_v1)
    assert (again.counted, again.reason) == (False, "stale_attempt_token")
    assert not c.try_activate(1).activated
    assert c.record_ack(answer(c, "w2", 1, seq=9)).counted
    assert c.try_activate(1).activated
    assert_trace_ok(c)


@pytest.mark.parametrize("late_form", ["old_token", "no_token"])
def test_delayed_ack_of_a_failed_attempt_is_refused(open_registry: Opener, late_form: str) -> None:
    """Issue 17 item 3, in the README's own form: distribute v1, fail it, retry; w1 reports it
    restored v0; w0 acks v1; w1's delayed ack of the failed attempt arrives: refused with a
    typed reason, and v1 does not activate while w1 holds v0."""
    c = ActivationCoordinator(open_registry(), WORKERS)
    activate(c, 0)
    ready(c, 1)
    first = c.attempt_tokens(1)
    c.fail_distribution(1, "ack_timeout")
    c.retry(1)
    assert c.attempt_tokens(1).keys() == first.keys()
    assert all(c.attempt_tokens(1)[w] != first[w] for w in WORKERS)
    restored = c.record_ack(WorkerAck("w1", 0, H[0]))
    assert (restored.counted, restored.reason, restored.recorded) == (False, "reported", True)
    assert c.record_ack(WorkerAck("w0", 1, H[1], token=c.attempt_token("w0", 1))).counted
    token = first["w1"] if late_form == "old_token" else None
    late = c.record_ack(WorkerAck("w1", 1, H[1], token=token))
    want = "stale_attempt_token" if late_form == "old_token" else "missing_attempt_token"
    assert (late.counted, late.reason, late.recorded) == (False, want, False)
    assert c.reports()["w1"].version == 0
    res = c.try_activate(1)
    assert (res.activated, res.reason, res.mismatched_workers) == (
        False,
        "worker_mismatch",
        ("w1",),
    )
    assert c.pointer() == ActivePointer(0, H[0])
    assert c.statistics().acks[want] == 1
    assert_trace_ok(c)


def test_ack_without_a_token_is_refused_and_not_stored(coord: ActivationCoordinator) -> None:
    """An ack of the version awaiting acks without its attempt's token never counts."""
    ready(coord, 1)
    got = coord.record_ack(ack("w0", 1))
    assert (got.counted, got.reason, got.recorded) == (False, "missing_attempt_token", False)
    assert coord.reports() == {}
    assert coord.try_activate(1).missing_workers == WORKERS


def test_token_of_another_worker_is_refused(coord: ActivationCoordinator) -> None:
    """Echoing another worker's token of the same attempt is refused by name."""
    ready(coord, 1)
    got = coord.record_ack(ack("w0", 1, token=coord.attempt_token("w1", 1)))
    assert (got.counted, got.reason) == (False, "foreign_attempt_token")
    got = coord.record_ack(ack("w0", 1, token="made-up"))
    assert (got.counted, got.reason) == (False, "stale_attempt_token")
    assert coord.reports() == {}


def test_attempt_tokens_are_random_per_worker_and_attempt(coord: ActivationCoordinator) -> None:
    """Each attempt issues each worker its own 128-bit token; none exists outside an attempt."""
    with pytest.raises(ActivationError, match="not registered"):
        coord.attempt_token("w0", 1)
    coord.prepare(1)
    coord.commit_artifact(1, H[1])
    with pytest.raises(ActivationError, match="not awaiting acks"):
        coord.attempt_token("w0", 1)
    coord.distribute(1)
    a1 = coord.attempt_tokens(1)
    assert sorted(a1) == sorted(WORKERS) and len(set(a1.values())) == 2
    assert all(len(t) == 32 and int(t, 16) >= 0 for t in a1.values())
    with pytest.raises(ActivationError, match="not a required worker"):
        coord.attempt_token("w9", 1)
    coord.fail_distribution(1, "timeout")
    with pytest.raises(ActivationError, match="not awaiting acks"):
        coord.attempt_token("w0", 1)
    coord.retry(1)
    a2 = coord.attempt_tokens(1)
    assert not set(a1.values()) & set(a2.values())
    dist = [e for e in coord.history(1) if e.event in ("distribute", "retry")]
    assert [{t.worker_id: t.token for t in e.tokens} for e in dist] == [a1, a2]
    assert [{t.attempt for t in e.tokens} for e in dist] == [{1}, {2}]


def test_joining_worker_gets_a_token_for_the_attempt_in_flight(open_registry: Opener) -> None:
    """A worker added while a version awaits acks is issued a token, recorded in the
    membership change, and the activation waits for its ack."""
    c = ActivationCoordinator(open_registry(), WORKERS)
    ready(c, 1)
    for w in WORKERS:
        c.record_ack(answer(c, w, 1))
    c.change_membership(W3, "scaled up")
    change = [e for e in c.trace() if e.kind == "membership"][-1]
    assert [(t.worker_id, t.version, t.attempt) for t in change.tokens] == [("w2", 1, 1)]
    assert change.tokens[0].token == c.attempt_token("w2", 1)
    assert c.try_activate(1).missing_workers == ("w2",)
    assert c.record_ack(answer(c, "w2", 1)).counted
    assert c.try_activate(1).activated
    assert_trace_ok(c)


def test_registry_refuses_plans_that_break_the_token_rules(open_registry: Opener) -> None:
    """Even a buggy plan cannot activate on a stale or missing token, store a forged one,
    keep a leaver's ack, or open an attempt without tokens: check_step refuses each."""
    c = ActivationCoordinator(open_registry(), WORKERS)
    ready(c, 1)
    old = c.attempt_tokens(1)
    for w in WORKERS:
        c.record_ack(answer(c, w, 1))
    c.fail_distribution(1, "timeout")
    c.retry(1)  # the stored acks now echo tokens of attempt 1
    reg = c.registry
    rec = reg.artifact(1)
    assert rec is not None

    def activate_plan(view: RegistryView) -> tuple[RegistryStep, None]:
        ch = ArtifactChange("activate", rec, attrs.evolve(rec, state="active"))
        return RegistryStep(0.0, (ch,), pointer=ActivePointer(1, H[1])), None

    with pytest.raises(ActivationError, match="missing_worker_ack"):
        reg.transact(activate_plan)

    def forged_plan(view: RegistryView) -> tuple[RegistryStep, None]:
        forged = WorkerReport("w0", 0, WorkerAck("w0", 1, H[1], 0, 9, token=old["w0"]))
        return RegistryStep(0.0, workers=(forged,)), None

    with pytest.raises(ActivationError, match="not the current attempt"):
        reg.transact(forged_plan)

    def keep_leaver_plan(view: RegistryView) -> tuple[RegistryStep, None]:
        return RegistryStep(0.0, membership=("w0",), membership_reason="x", revoked=("w1",)), None

    with pytest.raises(ActivationError, match="ack stays standing"):
        reg.transact(keep_leaver_plan)

    c.fail_distribution(1, "again")
    rec = reg.artifact(1)
    assert rec is not None

    def tokenless_retry(view: RegistryView) -> tuple[RegistryStep, None]:
        ch = ArtifactChange("retry", rec, attrs.evolve(rec, state="awaiting_acks", attempts=3))
        return RegistryStep(0.0, (ch,)), None

    with pytest.raises(ActivationError, match="issues no token"):
        reg.transact(tokenless_retry)
    assert reg.artifact(1) == rec and c.pointer() is None
    assert_trace_ok(c)


def test_the_loader_echoes_the_token_for_the_worker(open_registry: Opener, tmp_path: Path) -> None:
    """WorkerLoader.load(..., token=...) builds the ack with the token: the user never does."""
    store = ArtifactStore(tmp_path / "artifacts")
    stored = store.write(1, files={"weights.bin": b"v1"})
    c = ActivationCoordinator(open_registry(), WORKERS)
    c.prepare(1)
    c.commit_artifact(1, stored.artifact_hash)
    c.distribute(1)
    for w in WORKERS:
        _, got = WorkerLoader(store, w).load(1, stored.artifact_hash, token=c.attempt_token(w, 1))
        assert got.token == c.attempt_token(w, 1)
        assert c.record_ack(got).counted
    _, untokened = WorkerLoader(store, "w0").load(1, stored.artifact_hash)
    assert c.record_ack(untokened).reason == "missing_attempt_token"
    assert c.try_activate(1).activated
    assert_trace_ok(c)


def test_read_only_registry_from_before_attempt_tokens(tmp_path: Path) -> None:
    """A file written before the attempt-token table existed reads as holding no tokens
    (read-only opens never create tables), instead of failing on the missing table."""
    db = tmp_path / "state.db"
    reg = SQLiteRegistry(db)
    activate(ActivationCoordinator(reg, WORKERS), 1)
    reg.close()
    conn = connect(db)
    conn.execute("DROP TABLE registry_attempt_tokens")
    conn.close()
    ro = SQLiteRegistry(db, read_only=True)
    try:
        assert ro.attempt_tokens() == [] and ro.pointer() == ActivePointer(1, H[1])
    finally:
        ro.close()


# ---- a token counts once (issue 31 item 3) -------------------------------------------------


def test_a_duplicate_of_a_voided_ack_never_counts(open_registry: Opener) -> None:
    """The README form (token, no seq): w0's v1 ack counts, w0 then reports it restored v0,
    and a network duplicate of the v1 ack arrives: refused 'spent_attempt_token', durably
    (a coordinator on a new connection refuses it too), so v1 never activates while w0
    holds v0. A copy arriving while the counted ack still stands is a harmless duplicate."""
    c = ActivationCoordinator(open_registry(), WORKERS)
    activate(c, 0)
    ready(c, 1)
    v1 = {w: WorkerAck(w, 1, H[1], token=c.attempt_token(w, 1)) for w in WORKERS}
    assert c.record_ack(v1["w0"]).reason == "counted"
    assert c.record_ack(v1["w0"]).reason == "duplicate"  # still standing: nothing changes
    assert c.record_ack(v1["w1"]).reason == "counted"
    assert c.record_ack(WorkerAck("w0", 0, H[0])).reason == "reported"  # restored v0
    late = c.record_ack(v1["w0"])  # the network's duplicate of the first ack
    assert (late.counted, late.recorded, late.reason) == (False, False, "spent_attempt_token")
    assert c.reports()["w0"].version == 0
    res = c.try_activate(1)
    assert (res.activated, res.mismatched_workers) == (False, ("w0",))
    spent = {t.worker_id: t.spent for t in c.registry.attempt_tokens(1)}
    assert spent == {"w0": True, "w1": True}
    again = ActivationCoordinator(open_registry())  # another process, the same registry
    assert again.record_ack(v1["w0"]).reason == "spent_attempt_token"
    assert not again.try_activate(1).activated
    assert c.pointer() == ActivePointer(0, H[0])
    # the way out is a new attempt: fresh (unspent) tokens, and w0 reloads v1
    again.fail_distribution(1, "w0 went back to v0")
    again.retry(1)
    for w in WORKERS:
        assert again.record_ack(WorkerAck(w, 1, H[1], token=again.attempt_token(w, 1))).counted
    assert again.try_activate(1).activated
    assert_trace_ok(again)


def test_the_registry_refuses_a_plan_that_stores_a_spent_token(open_registry: Opener) -> None:
    """Whatever a plan says, the registry never stores an ack echoing a spent token (the
    write path's rule), and the spec names such a history (checkers.py)."""
    c = ActivationCoordinator(open_registry(), WORKERS)
    ready(c, 1)
    first = WorkerAck("w0", 1, H[1], seq=0, token=c.attempt_token("w0", 1))
    assert c.record_ack(first).counted
    assert c.record_ack(ack("w0", 0, seq=1)).reason == "reported"
    reg = c.registry

    def recount(view: RegistryView) -> tuple[RegistryStep, None]:
        return RegistryStep(0.0, workers=(WorkerReport("w0", 0, attrs.evolve(first, seq=2)),)), None

    with pytest.raises(ActivationError, match="counts once"):
        reg.transact(recount)
    assert c.reports()["w0"].version == 0
    assert_trace_ok(c)


# ---- activation deadlines (issue 31 item 8) --------------------------------------------------


def test_ack_timeout_is_validated(open_registry: Opener) -> None:
    """ack_timeout is a finite number of seconds > 0; anything else is refused typed."""
    reg = open_registry()
    for bad in (0, -1, float("nan"), float("inf"), True, "60", None):
        with pytest.raises(ActivationError, match="ack_timeout"):
            ActivationCoordinator(reg, WORKERS, ack_timeout=bad)  # type: ignore[arg-type]


def test_a_killed_activator_is_failed_at_its_deadline(open_registry: Opener) -> None:
    """The activator distributes v2, one worker acks, and the activator dies. Before the
    deadline the next coordinator's distribute is refused (saying when it passes) and
    settle() leaves the attempt alone; from the deadline on, the next distribute fails it
    ('ack_deadline_passed', stage distribution), quarantines its rollouts, and goes on."""
    clock = ManualClock(1000.0)
    led = _ledger_with_rollouts()
    c1 = ActivationCoordinator(open_registry(), WORKERS, ledger=led, clock=clock, ack_timeout=30)
    activate(c1, 1)
    ready(c1, 2)
    assert c1.artifact(2).ack_deadline == 1030.0
    assert c1.record_ack(answer(c1, "w0", 2, seq=2)).counted
    led.add(LedgerEntry(rollout_id="v2-r", behavior_version=2, artifact_hash=H[2]))
    del c1  # SIGKILL: nothing more from it

    c2 = ActivationCoordinator(open_registry(), ledger=led, clock=clock, ack_timeout=30)
    c2.prepare(3)
    c2.commit_artifact(3, H[3])
    clock.advance(29.5)
    with pytest.raises(ActivationError, match="deadline passes in 0 s"):
        c2.distribute(3)
    assert c2.settle().awaiting == ((2, 1030.0),)
    assert c2.artifact(2).state == "awaiting_acks"
    clock.advance(0.5)  # exactly at the deadline
    rec = c2.distribute(3)
    assert rec.state == "awaiting_acks" and rec.ack_deadline == 1060.0
    failed = c2.artifact(2)
    assert failed.state == "distribution_failed" and failed.failure is not None
    assert (failed.failure.stage, failed.failure.cause) == ("distribution", "ack_deadline_passed")
    assert "w1" in failed.failure.detail
    assert led.get("v2-r").state == "quarantined"
    assert c2.pointer() == ActivePointer(1, H[1])
    assert_trace_ok(c2)


def test_an_activator_killed_after_the_acks_is_activated_by_the_next_action(
    open_registry: Opener,
) -> None:
    """Every required worker acked v2, and the activator died before try_activate: the next
    coordinator's distribute activates v2 first (before any deadline), then distributes v3;
    a rollback in that situation settles, and is refused because the active version moved."""
    clock = ManualClock(0.0)
    c1 = ActivationCoordinator(open_registry(), WORKERS, clock=clock)
    activate(c1, 1)
    ready(c1, 2)
    for w in WORKERS:
        assert c1.record_ack(answer(c1, w, 2, seq=2)).counted
    del c1

    c2 = ActivationCoordinator(open_registry(), clock=clock)
    c2.prepare(3)
    c2.commit_artifact(3, H[3])
    c2.distribute(3)
    assert c2.pointer() == ActivePointer(2, H[2])
    assert c2.artifact(3).state == "awaiting_acks"
    for w in WORKERS:
        assert c2.record_ack(answer(c2, w, 3, seq=3)).counted
    del c2

    c3 = ActivationCoordinator(open_registry(), clock=clock)
    with pytest.raises(ActivationError, match="activated v3"):
        c3.rollback()
    assert c3.pointer() == ActivePointer(3, H[3])
    # v3 was prepared while v1 was active: that is its recorded rollback pointer
    assert c3.rollback() == ActivePointer(1, H[1])
    assert_trace_ok(c3)


def test_resume_and_settle_resolve_a_pending_attempt(open_registry: Opener) -> None:
    """resume() after a restart settles too: an attempt past its deadline is failed with its
    cause, and a second settle (another coordinator racing) finds nothing left to do."""
    clock = ManualClock(0.0)
    c1 = ActivationCoordinator(open_registry(), WORKERS, clock=clock, ack_timeout=5)
    activate(c1, 1)
    ready(c1, 2)
    clock.advance(5.0)
    c2 = ActivationCoordinator(open_registry(), clock=clock)
    pending = c2.resume()
    assert pending.awaiting_acks == ()
    assert [a.version for a in pending.distribution_failed] == [2]
    assert c1.settle() == Settled((), (), ())
    fails = [e for e in c2.history(2) if e.event == "fail_distribution"]
    assert len(fails) == 1 and fails[0].at >= 5.0
    assert_trace_ok(c2)


@pytest.mark.postgres
def test_postgres_deadlines_come_from_the_server_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On PostgreSQL an attempt's deadline is the server's clock_timestamp() + ack_timeout,
    read inside the step: a client whose clock is 10**6 s off sets the same deadline."""
    import time

    import psycopg

    from rollout_lifecycle.model.postgres_registry import PostgresRegistry

    url = postgres_url()
    schema = fresh_schema(url, tmp_path)
    reg = PostgresRegistry(url, schema=schema)
    try:
        c = ActivationCoordinator(reg, WORKERS, ack_timeout=60)
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() - 1e6)
        ready(c, 1)
        monkeypatch.setattr(time, "time", real)
        with psycopg.connect(url) as conn:
            row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        assert row is not None
        deadline = c.artifact(1).ack_deadline
        assert deadline is not None and abs(deadline - (float(row[0]) + 60)) < 30
    finally:
        reg.close()


def test_read_only_registry_from_before_deadlines_and_spent_tokens(tmp_path: Path) -> None:
    """A registry of schema 5 (no ack_deadline, no spent column), opened read-only, reads
    as having no deadlines and no spent tokens; a writer migrates it and keeps going."""
    db = tmp_path / "state.db"
    reg = SQLiteRegistry(db)
    activate(ActivationCoordinator(reg, WORKERS), 1)
    reg.close()
    conn = connect(db)
    conn.execute("ALTER TABLE registry_artifacts DROP COLUMN ack_deadline")
    conn.execute("ALTER TABLE registry_attempt_tokens DROP COLUMN spent")
    conn.execute("UPDATE schema_meta SET version = 5 WHERE component = 'registry'")
    conn.close()
    ro = SQLiteRegistry(db, read_only=True)
    try:
        assert [a.ack_deadline for a in ro.artifacts()] == [None]
        assert [t.spent for t in ro.attempt_tokens()] == [False, False]
    finally:
        ro.close()
    again = ActivationCoordinator(SQLiteRegistry(db), WORKERS)
    ready(again, 2)
    assert again.artifact(2).ack_deadline is not None
    assert again.record_ack(answer(again, "w0", 2, seq=2)).counted
    assert [t.spent for t in again.registry.attempt_tokens(2)] == [True, False]
    again.registry.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_an_older_registry_is_migrated_with_its_spent_tokens(kind: str, tmp_path: Path) -> None:
    """A registry from before deadlines and spent tokens (its columns dropped, its schema
    version set back) is migrated on open: the tokens its stored acks already echoed are
    marked spent, as replaying its history says (`ledger check` agrees), and a duplicate
    of a counted ack is refused from then on."""
    import json

    from click.testing import CliRunner

    from rollout_lifecycle.cli.main import cli
    from rollout_lifecycle.model.backends import open_backend
    from rollout_lifecycle.stateful_tests.backends import durable_url

    url = durable_url(kind, tmp_path)
    with open_backend(url) as b:
        c = ActivationCoordinator(b.registry, WORKERS, ledger=b.ledger)
        activate(c, 1)
        ready(c, 2)
        first = WorkerAck("w0", 2, H[2], token=c.attempt_token("w0", 2))  # README form
        assert c.record_ack(first).counted
        old = 5 if kind == "sqlite" else 3
        drop = (
            "ALTER TABLE registry_artifacts DROP COLUMN ack_deadline",
            "ALTER TABLE registry_attempt_tokens DROP COLUMN spent",
            f"UPDATE schema_meta SET version = {old} WHERE component = 'registry'",
        )
        if kind == "sqlite":
            conn = connect(sqlite_path(url))
            for stmt in drop:
                conn.execute(stmt)
            conn.close()
        else:
            import psycopg

            with psycopg.connect(url, autocommit=True) as pg:
                for stmt in drop:
                    pg.execute(stmt)
    with open_backend(url) as b:
        c = ActivationCoordinator(b.registry)
        spent = {(t.version, t.worker_id): t.spent for t in b.registry.attempt_tokens()}
        assert spent == {(1, "w0"): True, (1, "w1"): True, (2, "w0"): True, (2, "w1"): False}
        assert c.record_ack(WorkerAck("w0", 1, H[1])).reason == "reported"
        assert c.record_ack(first).reason == "spent_attempt_token"
    res = CliRunner().invoke(cli, ["ledger", "check", "--backend", url, "--json", "--quiet"])
    # the deadlines this test's own events carry were dropped with their column (a real
    # older file has events without them: tests/test_sqlite_layout.py); the spent marks
    # the migration wrote agree with the replayed history
    found = [v["message"] for v in json.loads(res.output)["violations"]]
    assert found and all("ack_deadline" in m for m in found), found


def test_a_weight_sync_decodes_the_same_records_however_many_versions_came_before(
    open_registry: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version's whole activation (prepare, commit, distribute, acks, activate) reads the
    records it judges, not every record: on a database it decodes as many at v60 as at v3.
    Each step read all of them (to find the version awaiting acks, or the lineage claims),
    so a long run's weight sync grew with its length: 3 ms a version at 250 versions,
    32 ms at 2,000 on SQLite."""
    from rollout_lifecycle.model import postgres_registry, registry

    reg = open_registry()
    if isinstance(reg, MemoryRegistry):
        pytest.skip("a memory registry decodes nothing")
    c = ActivationCoordinator(reg, WORKERS)
    decoded = [0]
    real = registry._row_to_record

    def counting(row: Any) -> Any:
        decoded[0] += 1
        return real(row)

    for module in (registry, postgres_registry):
        monkeypatch.setattr(module, "_row_to_record", counting)
    per_version = {}
    for v in range(1, 61):
        decoded[0] = 0
        c.prepare(v)
        c.commit_artifact(v, "a" * 64)
        c.distribute(v)
        for w in WORKERS:
            assert c.record_ack(WorkerAck(w, v, "a" * 64, token=c.attempt_token(w, v))).counted
        assert c.try_activate(v).activated
        per_version[v] = decoded[0]
    assert per_version[60] == per_version[3], per_version


def test_the_version_awaiting_acks_is_found_by_an_index(
    open_registry: Opener, tmp_path: Path
) -> None:
    """The read every weight sync makes for the version awaiting acks (`awaiting`) goes
    through an index on the artifact's state, not a scan of every version registered: on
    SQLite it was 0.17 ms at 3,000 versions, three times per weight sync, and growing."""
    reg = open_registry()
    if isinstance(reg, MemoryRegistry):
        pytest.skip("a memory registry has no index")
    c = ActivationCoordinator(reg, WORKERS)
    c.prepare(1)
    c.commit_artifact(1, "a" * 64)
    c.distribute(1)
    assert [a.version for a in reg.awaiting()] == [1]
    if isinstance(reg, SQLiteRegistry):
        seen: list[str] = []
        conn = sqlite3.connect(tmp_path / "state.db")
        try:
            reg._conn.set_trace_callback(seen.append)
            reg.awaiting()
            reg._conn.set_trace_callback(None)
            (sql,) = [s for s in seen if "registry_artifacts" in s]
            plan = " ".join(str(r[-1]) for r in conn.execute(f"EXPLAIN QUERY PLAN {sql}"))
        finally:
            conn.close()
        assert "USING INDEX registry_artifacts_state" in plan, plan
    else:
        names = reg.db.read(  # type: ignore[attr-defined]
            lambda conn: conn.execute(
                "SELECT indexdef FROM pg_indexes WHERE schemaname = current_schema() "
                "AND tablename = 'registry_artifacts'"
            ).fetchall()
        )
        assert any("(state)" in str(r[0]) for r in names), names
