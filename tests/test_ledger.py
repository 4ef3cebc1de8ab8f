"""MemoryLedger's ownership and lease index: what it answers equals a scan of every entry,
and the ownership lookups never scan."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_lifecycle.model.errors import LedgerError
from rollout_lifecycle.model.ledger import (
    ManualClock,
    MemoryLedger,
    RecoveryRule,
    ReserveRequest,
)
from rollout_lifecycle.model.records import AdmissionStamp, LedgerEntry, Reward

STAMP = AdmissionStamp(
    current_version=0,
    behavior_version=0,
    max_lag=0,
    max_drift=0.2,
    drift=0.0,
    freshness="fresh",
    reason="ok",
    accepted=True,
)
UPDATES = ("u1", "u2", "u3")


def rewarded(rid: str) -> LedgerEntry:
    return LedgerEntry(rid, 0, "h", state="rewarded", reward=Reward("rm", "1", 1.0))


def scan_owned(led: MemoryLedger, update_id: str) -> list[str]:
    return sorted(rid for rid, e in led.snapshot().items() if e.reserved_by == update_id)


def scan_due(led: MemoryLedger, now: float) -> list[str]:
    return sorted(
        rid
        for rid, e in led.snapshot().items()
        if e.state == "reserved" and e.lease_expires_at is not None and e.lease_expires_at <= now
    )


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.sampled_from(UPDATES), st.lists(st.integers(0, 9))),
        st.tuples(st.just("commit"), st.sampled_from(UPDATES)),
        st.tuples(st.just("abort"), st.sampled_from(UPDATES)),
        st.tuples(st.just("fail"), st.sampled_from(UPDATES)),
        st.tuples(st.just("tick"), st.sampled_from([0.0, 3.0, 5.0, 11.0])),
        st.tuples(st.just("expire")),
        st.tuples(st.just("quarantine")),
        st.tuples(st.just("restore")),
    ),
    max_size=40,
)


@settings(max_examples=200)
@given(OPS)
def test_index_answers_as_a_scan_does(ops: list[tuple[Any, ...]]) -> None:
    """After any sequence of writes, reserved_by and expire_leases equal a full scan."""
    clock = ManualClock()
    led = MemoryLedger(clock=clock, lease_seconds=10.0)
    for i in range(10):
        led.add(rewarded(f"r{i}"))
    for op in ops:
        if op[0] == "reserve":
            ids = sorted(set(op[2]))
            snap = led.snapshot()
            reqs = [ReserveRequest(f"r{i}", snap[f"r{i}"].revision, STAMP) for i in ids]
            led.reserve_batch(op[1], reqs)
        elif op[0] == "commit":
            led.commit(op[1], led.reserved_by(op[1]))
        elif op[0] == "abort":
            led.abort(op[1])
        elif op[0] == "fail":
            led.fail_update(op[1], "oom")
        elif op[0] == "tick":
            clock.advance(op[1])
        elif op[0] == "expire":
            want = scan_due(led, clock())
            assert [e.rollout_id for e in led.expire_leases()] == want
        elif op[0] == "quarantine":
            led.quarantine_version(0, "bad")
            led.clear_bad_version(0)
        else:
            led = MemoryLedger.restore(
                led.snapshot().values(), led.bad_versions, clock=clock, lease_seconds=10.0
            )
        for u in UPDATES:
            assert led.reserved_by(u) == scan_owned(led, u)
        assert_counts_are_a_scan(led)
    assert scan_due(led, clock()) == [e.rollout_id for e in led.expire_leases()]


def assert_counts_are_a_scan(led: MemoryLedger) -> None:
    """The store's counts by state and version, and of held reservations, equal a scan."""
    entries = led.snapshot().values()
    by_state: dict[str, Counter[int]] = {}
    for e in entries:
        by_state.setdefault(e.state, Counter())[e.behavior_version] += 1
    kept = {s: dict(c) for s, c in led.store.versions.items() if c}
    assert kept == {s: dict(c) for s, c in by_state.items()}
    assert led.store._held == sum(e.reserved_by is not None for e in entries)
    assert {u: sorted(held) for u, held in led.store.owners.items()} == {
        u: scan_owned(led, u) for u in {e.reserved_by for e in entries} - {None}
    }


class _NoScan(dict[str, LedgerEntry]):
    """The entries mapping, refusing to be walked: lookups by id only."""

    def values(self) -> Any:
        raise AssertionError("scanned every entry")

    def items(self) -> Any:
        raise AssertionError("scanned every entry")

    def __iter__(self) -> Any:
        raise AssertionError("scanned every entry")


def test_ownership_lookups_never_scan_the_ledger() -> None:
    """commit, abort, fail_update, reserved_by and expire_leases read only what they touch,
    so their cost does not grow with the number of rollouts in the ledger."""
    clock = ManualClock()
    led = MemoryLedger(clock=clock, lease_seconds=5.0)
    for i in range(2000):
        led.add(rewarded(f"r{i}"))
    for u, rng in (("a", range(0, 3)), ("b", range(3, 6)), ("c", range(6, 9))):
        led.reserve_batch(u, [ReserveRequest(f"r{i}", 0, STAMP) for i in rng])
    led._entries = _NoScan(led._entries)
    assert led.reserved_by("a") == ["r0", "r1", "r2"]
    assert [e.state for e in led.commit("a", ["r0", "r1", "r2"])] == ["consumed"] * 3
    assert [e.state for e in led.abort("b")] == ["rewarded"] * 3
    assert led.expire_leases() == []
    clock.advance(5.0)
    assert [e.rollout_id for e in led.expire_leases()] == ["r6", "r7", "r8"]
    led.reserve_batch("d", [ReserveRequest("r10", 0, STAMP)])
    assert [e.state for e in led.fail_update("d", "nan loss")] == ["update_failed"]
    with pytest.raises(LedgerError):
        led.commit("d", ["r10"])


def test_lease_heap_stays_bounded() -> None:
    """Deadlines of reservations that ended are dropped: the heap does not grow forever."""
    led = MemoryLedger(
        clock=ManualClock(), lease_seconds=5.0, recovery=RecoveryRule(max_releases=10**6)
    )
    led.add(rewarded("r"))
    for k in range(5000):
        out = led.reserve_batch(f"u{k}", [ReserveRequest("r", 2 * k, STAMP)])
        assert out[0].reserved
        led.abort(f"u{k}")
    assert len(led._leases) <= 1025


@pytest.mark.parametrize("batch", [False, True])
def test_a_reservation_that_rebuilds_the_lease_heap_keeps_its_deadline(batch: bool) -> None:
    """The write whose deadline tips the heap into a rebuild is in the rebuilt heap: a
    crashed learner's reservation made at that moment is still returned when it expires."""
    clock = ManualClock()
    led = MemoryLedger(clock=clock, lease_seconds=5.0, recovery=RecoveryRule(max_releases=10**6))
    led.add(rewarded("r"))
    led.add(rewarded("x"))
    for k in range(1024):  # 1024 deadlines of ended reservations: the next push rebuilds
        assert led.reserve_batch(f"u{k}", [ReserveRequest("r", 2 * k, STAMP)])[0].reserved
        led.abort(f"u{k}")
    if batch:
        assert led.reserve_batch("crashed", [ReserveRequest("x", 0, STAMP)])[0].reserved
    else:
        assert led.reserve("x", 0, "crashed", STAMP).reserved
    assert len(led._leases) == 1  # rebuilt from what is held
    clock.advance(5.0)
    assert [e.rollout_id for e in led.expire_leases()] == ["x"]


def test_a_batch_step_records_its_entries_then_its_update_in_one_transaction() -> None:
    """A batch reservation that opens an update is one step: its entry events, then the
    update's `open` event, one txn, consecutive seqs after the step before (each event
    built once, stamped: the memory store's path for steps that write updates)."""
    from rollout_lifecycle.model.events import EntryChanged, UpdateChanged

    led = MemoryLedger()
    for i in range(3):
        led.add(rewarded(f"r{i}"))
    before = led.log.events()
    led.reserve_batch("u", [ReserveRequest(f"r{i}", 0, STAMP) for i in range(3)])
    step = led.log.events()[len(before) :]
    assert [type(e) for e in step] == [EntryChanged] * 3 + [UpdateChanged]
    assert [e.seq for e in step] == list(range(before[-1].seq + 1, before[-1].seq + 5))
    assert {e.txn for e in step} == {before[-1].txn + 1}
    assert [e.rollout_id for e in step if isinstance(e, EntryChanged)] == ["r0", "r1", "r2"]
    last = step[3]
    assert isinstance(last, UpdateChanged) and (last.update_id, last.event) == ("u", "open")
    assert last.before is None and last.after.update_id == "u"
