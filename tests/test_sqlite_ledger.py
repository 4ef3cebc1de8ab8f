"""What only the SQLite backend must show: durability, refusal of foreign files, a compare-
and-set decided by SQL, races across threads AND processes, and all-or-nothing on SIGKILL.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import rollout_lifecycle.model.ledger as ml
from rollout_lifecycle.model.errors import LedgerError, RevisionConflict
from rollout_lifecycle.model.events import EntryChanged
from rollout_lifecycle.model.ledger import ManualClock, RecoveryRule, ReserveRequest
from rollout_lifecycle.model.records import UpdateRecord
from rollout_lifecycle.model.sqlite_ledger import SCHEMA_VERSION, SQLiteLedger
from tests.helpers_ledger import add_rewarded, drive_to, ids, race_process, race_worker, stamp

REPO = Path(__file__).resolve().parent.parent


def entries_of(led: SQLiteLedger) -> list[EntryChanged]:
    """History as EntryChanged events."""
    out = []
    for ev in led.history():
        assert isinstance(ev, EntryChanged)
        out.append(ev)
    return out


# ---- files, schema, lifecycle of the object --------------------------------------------


def test_everything_survives_close_and_reopen(tmp_path: Path) -> None:
    """Entries, durable counters, bad versions and history are the same after reopen; the
    counts of outcomes that wrote nothing (a lost CAS) belong to the object that saw them."""
    path = tmp_path / "l.db"
    clock = ManualClock(50.0)
    led = SQLiteLedger(path, clock=clock, lease_seconds=5.0, recovery=RecoveryRule(1))
    add_rewarded(led, ids(4))
    drive_to(led, "x", "reward_timed_out")
    led.reserve_batch("u", [ReserveRequest(r, 0, stamp()) for r in ids(2)])
    led.reserve("r00002", 0, "w", stamp())
    led.reserve("r00003", 9, "v", stamp())
    led.commit("u", ids(2))
    led.quarantine_version(3, "failed activation")
    clock.advance(6.0)
    led.expire_leases()
    before = (led.snapshot(), led.statistics(), led.history())
    led.close()
    again = SQLiteLedger(path, clock=clock)
    assert (again.snapshot(), again.history()) == (before[0], before[2])
    durable = (
        "entries",
        "by_state",
        "writes",
        "reservations",
        "commits",
        "aborts",
        "expirations",
        "bad_versions",
    )
    assert {k: getattr(again.statistics(), k) for k in durable} == {
        k: getattr(before[1], k) for k in durable
    }
    assert again.statistics().bad_versions == (3,) and again.statistics().expirations == 1
    assert before[1].cas_conflicts == 1 and again.statistics().cas_conflicts == 0
    again.close()


def test_other_schema_version_is_refused(tmp_path: Path) -> None:
    """A file written by another ledger schema version raises LedgerError naming both."""
    path = tmp_path / "l.db"
    SQLiteLedger(path).close()
    raw = sqlite3.connect(path)
    raw.execute(
        "UPDATE schema_meta SET version = ? WHERE component = 'ledger'", (SCHEMA_VERSION + 1,)
    )
    raw.commit()
    raw.close()
    want = rf"schema version {SCHEMA_VERSION + 1}.*expects {SCHEMA_VERSION}"
    with pytest.raises(LedgerError, match=want):
        SQLiteLedger(path)


def test_non_sqlite_file_gives_ledger_error(tmp_path: Path) -> None:
    """A file that is not a database raises LedgerError (not sqlite3's error) and is kept."""
    path = tmp_path / "notes.txt"
    path.write_bytes(b"this is not a database\n" * 200)
    with pytest.raises(LedgerError, match="not a usable") as info:
        SQLiteLedger(path)
    assert not isinstance(info.value, sqlite3.Error)
    assert info.value.__suppress_context__
    assert path.read_bytes() == b"this is not a database\n" * 200


@pytest.mark.parametrize(
    ("make_path", "message"),
    [
        (lambda p: p / "missing-dir" / "l.db", "does not exist"),
        (lambda p: p, "is a directory"),
        (lambda p: ":memory:", "file path"),
    ],
    ids=["missing-directory", "directory", "memory"],
)
def test_bad_paths_give_ledger_error(
    tmp_path: Path, make_path: Callable[[Path], Any], message: str
) -> None:
    """Paths that cannot hold a shared ledger file raise LedgerError with what to do."""
    with pytest.raises(LedgerError, match=message):
        SQLiteLedger(make_path(tmp_path))


def test_bad_lease_is_a_value_error(tmp_path: Path) -> None:
    """A non-positive lease is refused before any file is created."""
    with pytest.raises(ValueError, match="lease_seconds"):
        SQLiteLedger(tmp_path / "l.db", lease_seconds=0)
    assert not (tmp_path / "l.db").exists()


def test_closed_ledger_raises_ledger_error(tmp_path: Path) -> None:
    """After close every call raises LedgerError; close itself is idempotent."""
    led = SQLiteLedger(tmp_path / "l.db")
    add_rewarded(led, ["a"])
    led.close()
    led.close()
    calls: list[Callable[[], object]] = [
        lambda: led.get("a"),
        lambda: led.find("a"),
        lambda: led.reserve("a", 0, "u", stamp()),
        lambda: led.reserve_batch("u", [ReserveRequest("a", 0, stamp())]),
        lambda: led.commit("u", []),
        lambda: led.snapshot(),
        lambda: led.statistics(),
        lambda: led.history(),
        lambda: led.expire_leases(),
    ]
    for call in calls:
        with pytest.raises(LedgerError, match="closed"):
            call()


def test_closed_in_another_thread_too(tmp_path: Path) -> None:
    """A thread that never used the ledger before close also gets LedgerError."""
    led = SQLiteLedger(tmp_path / "l.db")
    led.close()
    seen: list[BaseException] = []

    def use() -> None:
        try:
            led.snapshot()
        except BaseException as exc:
            seen.append(exc)

    t = threading.Thread(target=use)
    t.start()
    t.join()
    assert len(seen) == 1 and isinstance(seen[0], LedgerError)


def test_each_thread_connection_is_closed_when_its_thread_ends(tmp_path: Path) -> None:
    """Short-lived threads do not leak connections; close() closes the rest."""
    led = SQLiteLedger(tmp_path / "l.db")
    add_rewarded(led, ["a"])
    conns: list[sqlite3.Connection] = []

    def use() -> None:
        led.snapshot()
        # white-box: counting file descriptors cannot tell, because SQLite keeps a closed
        # connection's descriptor open while other connections hold locks on the file
        conns.append(led._local.handle.conn)

    threads = [threading.Thread(target=use) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert len(conns) == 6
    for c in conns:
        with pytest.raises(sqlite3.ProgrammingError, match="closed"):
            c.execute("SELECT 1")
    main = led._local.handle.conn
    main.execute("SELECT 1")
    led.close()
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        main.execute("SELECT 1")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_opens_its_own_connection(tmp_path: Path) -> None:
    """A ledger used before fork keeps working in the child (through a new connection)
    and in the parent afterwards."""
    led = SQLiteLedger(tmp_path / "l.db")
    add_rewarded(led, ["a", "b"])
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code
        ok = False
        with contextlib.suppress(BaseException):
            ok = led.reserve("a", 0, "child", stamp()).reason == "reserved"
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert led.get("a").reserved_by == "child"
    assert led.reserve("b", 0, "parent", stamp()).reason == "reserved"
    led.close()


def test_add_many_is_all_or_nothing(tmp_path: Path) -> None:
    """A duplicate anywhere in add_many adds none of the list."""
    led = SQLiteLedger(tmp_path / "l.db")
    add_rewarded(led, ["b"])
    with pytest.raises(LedgerError, match="already"):
        add_rewarded(led, ["a", "b", "c"])
    assert sorted(led.snapshot()) == ["b"] and len(led.history()) == 1
    led.close()


# ---- the compare-and-set is decided by SQL ---------------------------------------------


class Interleave:
    """Wraps a planner so another writer acts between our unlocked read and our UPDATE."""

    def __init__(self, name: str, competitor: Callable[[], object]) -> None:
        self.real = getattr(ml, name)
        self.competitor = competitor
        self.fired = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.fired:
            self.fired = True  # the competitor's own planning must not recurse
            self.competitor()
        return self.real(*args, **kwargs)


def test_lost_cas_in_reserve_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process-like writer wins between read and write: our conditional UPDATE
    matches no row, we report revision_conflict, and the winner's record stands."""
    path = tmp_path / "l.db"
    mine, other = SQLiteLedger(path), SQLiteLedger(path)
    add_rewarded(mine, ["a"])
    race = Interleave("plan_reserve", lambda: other.reserve("a", 0, "them", stamp()))
    monkeypatch.setattr(ml, "plan_reserve", race)
    out = mine.reserve("a", 0, "us", stamp())
    assert (out.reserved, out.reason) == (False, "revision_conflict")
    assert out.entry is not None and out.entry.reserved_by == "them"
    got = mine.get("a")
    assert (got.reserved_by, got.revision) == ("them", 1)
    assert [ev.update_id for ev in entries_of(mine)] == [None, "them"]
    st = mine.statistics()
    assert (st.reservations, st.cas_conflicts, st.writes) == (1, 1, 2)
    mine.close()
    other.close()


def test_lost_cas_to_the_same_update_is_idempotent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If our own update reserved the row meanwhile (another worker of it), the lost CAS
    re-plans on the current row and reports idempotent_retry."""
    path = tmp_path / "l.db"
    mine, other = SQLiteLedger(path), SQLiteLedger(path)
    add_rewarded(mine, ["a"])
    race = Interleave("plan_reserve", lambda: other.reserve("a", 0, "us", stamp()))
    monkeypatch.setattr(ml, "plan_reserve", race)
    out = mine.reserve("a", 0, "us", stamp())
    assert (out.reserved, out.reason) == (True, "idempotent_retry")
    assert mine.get("a").revision == 1 and len(mine.history()) == 2
    mine.close()
    other.close()


def test_lost_cas_in_transition_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transition whose CAS loses raises RevisionConflict with the revision found now."""
    path = tmp_path / "l.db"
    mine, other = SQLiteLedger(path), SQLiteLedger(path)
    add_rewarded(mine, ["a"])
    monkeypatch.setattr(
        ml,
        "plan_transition",
        Interleave("plan_transition", lambda: other.transition("a", "retire_stale", 0)),
    )
    with pytest.raises(RevisionConflict) as info:
        mine.transition("a", "quarantine", 0)
    assert (info.value.expected, info.value.actual) == (0, 1)
    assert mine.get("a").state == "retired_stale"
    assert [ev.event for ev in entries_of(mine)] == ["add", "retire_stale"]
    assert mine.statistics().cas_conflicts == 1
    mine.close()
    other.close()


def test_a_single_reservation_is_eight_statements(tmp_path: Path) -> None:
    """The read of the row and the update's record outside the step, then one transaction:
    the registry probe and the events' next txn/seq/head in ONE statement, the update's
    record (read under the lock: a poisoned update reserves nothing), the compare-and-set,
    the event, the chain head with both counters (its columns) in ONE statement, COMMIT.
    The first reservation of an update also records it (one more row and event). The
    events still chain and the counters still add."""
    led = SQLiteLedger(tmp_path / "l.db")
    add_rewarded(led, ["a", "b"])
    assert led.reserve("a", 0, "u", stamp()).reserved  # the first records "u"
    assert led.update("u") == UpdateRecord("u", "open")
    seen: list[str] = []
    led._conn().set_trace_callback(seen.append)
    assert led.reserve("b", 0, "u", stamp()).reserved
    led._conn().set_trace_callback(None)
    heads = [" ".join(s.split()[:3]) for s in seen]
    assert heads == [
        "SELECT r.entry, u.update_id,",
        "BEGIN IMMEDIATE",
        "SELECT EXISTS (SELECT",
        "SELECT update_id, status,",
        "UPDATE rollouts SET",
        "INSERT INTO events(seq,",
        "INSERT INTO events_chain(id,",
        "COMMIT",
    ], seen
    evs = entries_of(led)
    assert [(e.event, e.rollout_id) for e in evs][-2:] == [("reserve", "a"), ("reserve", "b")]
    # "u"'s record was written with "a"'s reservation, one event after it
    assert len({e.txn for e in evs[-2:]}) == 2 and evs[-1].seq == evs[-2].seq + 2
    st = led.statistics()
    assert (st.writes, st.reservations) == (4, 2)
    rows = led.stored_rows()
    assert rows.head is not None and rows.head.last_seq == evs[-1].seq
    assert rows.events[-1].hash == rows.head.last_hash
    assert rows.events[-1].prev_hash == rows.events[-2].hash
    led.close()


def test_a_single_reservation_judges_the_stamp_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a registry, the plan judges the stamp's own figures and the step, under its
    lock, only what the premise adds; a premise that moved since is still refused there."""
    from rollout_lifecycle.model import rules
    from rollout_lifecycle.model.backends import open_backend
    from rollout_lifecycle.model.records import AdmissionStamp, LedgerEntry, Reward
    from tests.data.old_layout_builder import build

    path = tmp_path / "l.db"
    build(str(path))  # v0 active, r3 rewarded
    calls: list[object] = []
    real = rules.stamp_contradictions

    def counted(a: AdmissionStamp) -> list[str]:
        calls.append(a)
        return real(a)

    monkeypatch.setattr(rules, "stamp_contradictions", counted)
    good = AdmissionStamp(0, 0, 1, 0.2, 0.0, "fresh", "ok", True)
    with open_backend(f"sqlite:///{path}") as b:
        assert b.ledger.reserve("r3", 2, "u", good).reserved
        assert calls == [good]
        # a stamp looser than the recorded policy (max_lag 1) is a premise refusal, in-step
        loose = AdmissionStamp(0, 0, 5, 0.2, 0.0, "fresh", "ok", True)
        b.ledger.add(LedgerEntry("x", 0, "h", state="rewarded", reward=Reward("f", "1", 1.0)))
        out = b.ledger.reserve("x", 0, "u", loose)
        assert not out.reserved and out.reason == "looser_than_policy", out


# ---- 8 threads and 4 processes ---------------------------------------------------------


def test_threads_and_processes_race_for_10000_rollouts(tmp_path: Path) -> None:
    """8 threads and 4 spawned processes each try every rollout: exactly one winner each,
    the winner's update id is the one recorded, losers wrote nothing, counters add up."""
    n, threads_n, procs_n = 10_000, 8, 4
    path = tmp_path / "race.db"
    led = SQLiteLedger(path)
    add_rewarded(led, ids(n))
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Barrier(procs_n + 1)
    results: Any = ctx.Queue()
    procs = [
        ctx.Process(target=race_process, args=(str(path), f"p{k}", n, 100 + k, ready, results))
        for k in range(procs_n)
    ]
    for p in procs:
        p.start()
    go = threading.Event()
    thread_results: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def racer(k: int) -> None:
        try:
            go.wait()
            thread_results.append(race_worker(str(path), f"t{k}", n, k, singles=50, chunk=250))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=racer, args=(k,)) for k in range(threads_n)]
    for t in threads:
        t.start()
    ready.wait(timeout=120)  # every process has imported and is about to race
    go.set()
    for t in threads:
        t.join()
    proc_results = []
    for _ in procs:
        try:
            proc_results.append(results.get(timeout=120))
        except queue.Empty:
            break
    for p in procs:
        p.join(timeout=60)
    assert errors == []
    assert [r.get("error") for r in proc_results] == [None] * procs_n
    assert all(p.exitcode == 0 for p in procs)

    winners: dict[str, list[str]] = defaultdict(list)
    reasons: Counter[str] = Counter()
    for r in [*thread_results, *proc_results]:
        reasons.update(r["reasons"])
        for rid in r["won"]:
            winners[rid].append(r["update_id"])
    assert sorted(winners) == ids(n)
    assert all(len(w) == 1 for w in winners.values())
    snap = led.snapshot()
    for rid, (uid,) in winners.items():
        assert (snap[rid].state, snap[rid].reserved_by, snap[rid].revision) == ("reserved", uid, 1)
    writes_per_rollout = Counter(ev.rollout_id for ev in entries_of(led) if ev.event == "reserve")
    assert set(writes_per_rollout.values()) == {1}
    attempts = (threads_n + procs_n) * n
    st = led.statistics()
    assert st.reservations == reasons["reserved"] == n
    assert sum(reasons.values()) == attempts  # every attempt answered, by its own racer
    # losers wrote nothing at all: the file holds the n wins and their n adds, no counters
    # of losses (each racer's own object counts what it lost)
    assert st.writes == 2 * n and st.cas_conflicts == 0
    led.close()


# ---- crash safety ----------------------------------------------------------------------


def _run_child_until(path: Path, n: int, stop_after: int | None, tmp_path: Path) -> str:
    """Start crash_child, wait for its signal, SIGKILL it; return what it signalled."""
    sig = tmp_path / "signal"
    code = (
        "from tests.helpers_ledger import crash_child; "
        f"crash_child({str(path)!r}, 'crashy', {n}, {stop_after!r}, {str(sig)!r})"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not sig.exists():
            if child.poll() is not None:
                err = child.stderr.read() if child.stderr else ""
                pytest.fail(f"child exited early ({child.returncode}): {err}")
            if time.monotonic() > deadline:
                pytest.fail("child never reached the kill point")
            time.sleep(0.01)
        said = sig.read_text()
        if said == "in-batch":
            # proof that the kill lands mid-transaction: the child holds the write lock
            raw = sqlite3.connect(path, timeout=0.05, isolation_level=None)
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                raw.execute("BEGIN IMMEDIATE")
            raw.close()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stderr:
            child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    return said


@pytest.mark.parametrize("kill_at", ["mid-batch", "after-commit"])
def test_sigkill_leaves_batch_all_or_nothing(tmp_path: Path, kill_at: str) -> None:
    """A reserve_batch killed mid-transaction leaves every rollout untouched; killed after
    COMMIT, every rollout is reserved by it; history and counters agree with the states."""
    n = 2000
    path = tmp_path / "crash.db"
    led = SQLiteLedger(path)
    add_rewarded(led, ids(n))
    untouched = led.snapshot()
    led.close()
    said = _run_child_until(path, n, 1500 if kill_at == "mid-batch" else None, tmp_path)
    assert said == ("in-batch" if kill_at == "mid-batch" else "committed")

    led = SQLiteLedger(path)
    snap = led.snapshot()
    assert sorted(snap) == ids(n)
    hist = entries_of(led)
    last = {ev.rollout_id: ev.after for ev in hist}
    assert last == snap  # history ends where the states are
    st = led.statistics()
    if kill_at == "mid-batch":
        assert snap == untouched
        assert [ev.event for ev in hist] == ["add"] * n
        assert (st.reservations, st.writes) == (0, n)
    else:
        assert all(e.reserved_by == "crashy" and e.revision == 1 for e in snap.values())
        reserves = [ev for ev in hist if ev.event == "reserve"]
        assert len(reserves) == n and len({ev.txn for ev in reserves}) == 1
        assert (st.reservations, st.writes) == (n, 2 * n)
    # the file is fully usable: the write lock was released and another update can write
    outs = led.reserve_batch("next", [ReserveRequest(r, snap[r].revision, stamp()) for r in ids(n)])
    want = "reserved" if kill_at == "mid-batch" else "not_rewarded"
    assert {o.reason for o in outs} == {want}
    led.close()
