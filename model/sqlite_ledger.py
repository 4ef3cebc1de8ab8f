"""The embedded default ledger: one SQLite file, safe across threads and processes.

Every decision is made by the shared planners in `model.ledger` on rows read from the file;
this module only makes "check the revision and write" indivisible. A single-row write
(`transition`, `reserve`) is a real compare-and-set: the row is read without a lock, planned
in Python, and written by ONE conditional ``UPDATE ... WHERE rollout_id = ? AND revision = ?``
whose rowcount decides who won; the short ``BEGIN IMMEDIATE`` around it only makes the event
row land atomically with the CAS. Batch steps read and write inside one ``BEGIN IMMEDIATE``
transaction, so a crash leaves all or nothing.

Counters live in a table updated in the same transaction as the write they count (or by a
single autocommit statement for outcomes that write no record), so statistics stay right
across processes and restarts.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import attrs

from rollout_lifecycle.model.clocks import sqlite_host_clock
from rollout_lifecycle.model.errors import (
    DuplicateRollout,
    InvalidLedgerArgument,
    LedgerError,
    RevisionConflict,
    UnknownRollout,
    brief,
)
from rollout_lifecycle.model.events import Change, EntryChanged, StoredRows, entry_events
from rollout_lifecycle.model.ledger import (
    CONFLICT,
    IDEMPOTENT,
    NO_REGISTRY,
    PROCESS_LOCAL_COUNTERS,
    RESERVED,
    ActivationPremise,
    Clock,
    LedgerStatistics,
    RecoveryRule,
    ReserveOutcome,
    ReserveRequest,
    as_entry,
    check_id,
    check_lease_seconds,
    check_limit,
    check_requests,
    check_revision,
    check_update_id,
    commit_plan,
    direct_changes,
    dispatch_entry,
    enforce,
    plan_add,
    plan_release,
    plan_reserve,
    plan_transition,
    renew_plan,
    replan_lost,
    statistics_from,
)
from rollout_lifecycle.model.machines import LIFECYCLE
from rollout_lifecycle.model.pacing import (
    LIVE_STATES,
    DispatchOutcome,
    DispatchPremise,
    oldest_first,
    plan_dispatch,
    rows_from_columns,
    stale_disposition,
    window_floor,
)
from rollout_lifecycle.model.records import (
    AdmissionPolicy,
    AdmissionStamp,
    Disposition,
    LedgerEntry,
    Reward,
    Rollout,
    from_jsonable,
    to_jsonable,
)
from rollout_lifecycle.model.rules import WAS_ACTIVE_STATES, retired_from_rows
from rollout_lifecycle.model.sqlite_common import (
    FileReplaced,
    append_events,
    connect,
    ensure_schema,
    has_component,
    read_events,
    read_stored,
    write_failed,
)
from rollout_lifecycle.model.sqlite_files import FileGuard, hand_back, read_file_id

COMPONENT = "ledger"
SCHEMA_VERSION = 1

# The indexed columns are copies of LedgerEntry fields that queries filter on; `entry` holds
# the whole record so nothing is lost. The CHECK repeats the exclusive-ownership invariant at
# the storage level, so a buggy raw write fails loudly instead of corrupting the file.
# `events_txn` makes append_events' MAX(txn) an index lookup instead of a table scan.
_DDL = """
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id       TEXT PRIMARY KEY,
    state            TEXT NOT NULL,
    revision         INTEGER NOT NULL,
    reserved_by      TEXT,
    lease_expires_at REAL,
    behavior_version INTEGER NOT NULL,
    entry            TEXT NOT NULL,
    CHECK ((reserved_by IS NULL) = (state <> 'reserved'))
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS rollouts_owner ON rollouts(reserved_by)
    WHERE reserved_by IS NOT NULL;
CREATE INDEX IF NOT EXISTS rollouts_lease ON rollouts(lease_expires_at)
    WHERE reserved_by IS NOT NULL;
CREATE INDEX IF NOT EXISTS rollouts_version ON rollouts(behavior_version, state);
CREATE INDEX IF NOT EXISTS rollouts_chain ON rollouts(json_extract(entry, '$.chain'))
    WHERE json_extract(entry, '$.chain') IS NOT NULL;
CREATE TABLE IF NOT EXISTS ledger_bad_versions (
    version INTEGER PRIMARY KEY,
    reason  TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS ledger_counters (
    name TEXT PRIMARY KEY,
    n    INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS events_txn ON events(txn);
"""

_CAS = (
    "UPDATE rollouts SET state = ?, revision = ?, reserved_by = ?, lease_expires_at = ?, "
    "entry = ? WHERE rollout_id = ? AND revision = ?"
)
_BUMP = (
    "INSERT INTO ledger_counters(name, n) VALUES (?, ?) "
    "ON CONFLICT(name) DO UPDATE SET n = n + excluded.n"
)
_INSERT = (
    "INSERT INTO rollouts(rollout_id, state, revision, reserved_by, lease_expires_at, "
    "behavior_version, entry) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(rollout_id) DO NOTHING"
)

# Same reason -> counter mapping as MemoryLedger; the conformance suite compares the counts.
_COUNTER_OF = {
    RESERVED: "reservations",
    IDEMPOTENT: "idempotent_retries",
    CONFLICT: "cas_conflicts",
}

# outcomes that write no record are counted in memory, never in the file: a losing
# compare-and-set, a refused reservation and an idempotent retry write nothing at all
_IN_CHUNK = 500  # ids per IN (...) list, well under SQLite's bound-parameter limit
_WAS_ACTIVE = tuple(sorted(WAS_ACTIVE_STATES))
_WAS_ACTIVE_MARKS = ",".join("?" * len(_WAS_ACTIVE))
_LIVE_MARKS = ",".join("?" * len(LIVE_STATES))
_PACING_COLUMNS = (
    "SELECT rollout_id, state, behavior_version, json_extract(entry, '$.chain'), "
    "json_extract(entry, '$.attempt'), json_extract(entry, '$.tokens'), "
    "json_extract(entry, '$.admission.current_version') FROM rollouts"
)

# Read off the machine, so "which states can be quarantined directly" is never retyped.
_QUARANTINABLE = tuple(s for s in LIFECYCLE.states if LIFECYCLE.is_legal(s, "quarantine"))


def _dump(entry: LedgerEntry) -> str:
    return json.dumps(to_jsonable(entry), separators=(",", ":"))


def _load(text: str) -> LedgerEntry:
    return from_jsonable(LedgerEntry, json.loads(text))


def _counter_of(reason: str) -> str:
    return _COUNTER_OF.get(reason, "refused")


class _Handle:
    """One thread's connection. The thread-local drops it when its thread ends, and then it
    closes the connection, so short-lived threads do not leak open files."""

    __slots__ = ("__weakref__", "conn", "pid")

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.pid = os.getpid()

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.conn.close()

    def __del__(self) -> None:
        # a forked child must not close what it inherited: SQLite's POSIX locks are per
        # process and file, so closing it there can silently drop the child's own locks
        if self.pid == os.getpid():
            self.close()


class SQLiteLedger:
    """Durable ledger in one SQLite file (WAL); several threads and processes may share it.

    Each thread uses its own connection, so no Python lock serialises readers; SQLite's
    write lock plus the revision compare-and-set are what make writes exclusive.
    """

    #: counters of outcomes that write nothing; each ledger object counts its own, so
    #: statistics() from a later process shows 0 for them (``ledger counts`` says so)
    process_local_counters: ClassVar[frozenset[str]] = PROCESS_LOCAL_COUNTERS

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Clock | None = None,
        lease_seconds: float = 600.0,
        recovery: RecoveryRule | None = None,
        read_only: bool = False,
    ) -> None:
        """Open (creating on first use) the ledger in `path`.

        `clock` is for tests and simulations only: by default lease deadlines and expiry
        use the host's clock as the ledger records it (model.clocks.HostClock), never
        this process's wall clock.
        """
        lease_seconds = check_lease_seconds(lease_seconds)
        self.read_only = read_only
        if str(path) == ":memory:":
            # each thread's connection would get its own private database
            raise LedgerError("SQLiteLedger needs a file path; use MemoryLedger for memory")
        self.path = Path(path)
        if self.path.is_dir():
            raise LedgerError(f"{self.path} is a directory; give a database file path inside it")
        self.clock: Clock = clock if clock is not None else time.time
        self.lease_seconds = float(lease_seconds)
        self.recovery = recovery or RecoveryRule()
        self._registry_seen = False
        self._outcomes: Counter[str] = Counter()  # outcomes that write nothing (see _bump)
        self._local = threading.local()
        self._handles: weakref.WeakSet[_Handle] = weakref.WeakSet()
        self._inherited: list[_Handle] = []
        self._handles_lock = threading.Lock()
        self._closed = False
        # fails every use closed once the path stops naming this file (sqlite_files)
        self._guard: FileGuard | None = None
        try:
            if read_only:
                self._check_readable(self._conn())
            else:
                ensure_schema(self._conn(), COMPONENT, SCHEMA_VERSION, _DDL)
            if clock is None:
                self.clock = sqlite_host_clock(self._conn(), read_only=read_only)
            self._guard = FileGuard(
                self.path,
                "ledger",
                read_file_id(self._conn()),
                self._lost,
                writer=not read_only,
            )
        except sqlite3.Error as exc:
            self.close()
            raise LedgerError(
                f"{self.path} is not a usable ledger database ({exc}); "
                "give a new file path or an existing ledger file"
            ) from None
        except BaseException:
            self.close()
            raise

    # ---- connections and transactions ---------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        """This thread's connection; a forked child opens its own (SQLite forbids sharing)."""
        if self._guard is not None and self._guard.lost is not None:
            raise FileReplaced(self._guard.lost)
        if self._closed:
            raise LedgerError(f"ledger {self.path} is closed; open a new SQLiteLedger")
        handle: _Handle | None = getattr(self._local, "handle", None)
        if handle is not None:
            if handle.pid == os.getpid():
                return handle.conn
            # a connection inherited through fork must never be used or closed here
            self._inherited.append(handle)
        if self._guard is not None:
            self._guard.check()  # a new connection must never open a file that replaced ours
        try:
            conn = connect(self.path, read_only=self.read_only)
            # connect() may succeed on a non-database file; the first read tells
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchall()
        except sqlite3.Error as exc:
            raise LedgerError(
                f"{self.path} is not a usable SQLite database ({exc}); "
                "give a new file path or an existing ledger file"
            ) from None
        with self._handles_lock:
            if self._closed:
                conn.close()
                raise LedgerError(f"ledger {self.path} is closed; open a new SQLiteLedger")
            handle = _Handle(conn)
            self._handles.add(handle)
        self._local.handle = handle
        if self._guard is not None:
            self._guard.opened()  # the -wal may be a new one: mark it as this file's
        return conn

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One BEGIN IMMEDIATE ... COMMIT; any exception rolls everything back."""
        if self.read_only:
            raise LedgerError(f"ledger {self.path} was opened read-only; nothing was written")
        conn = self._conn()
        try:
            if conn.in_transaction:
                # only a failed ROLLBACK can leave one open; never build on its leftovers
                conn.execute("ROLLBACK")
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise LedgerError(f"{self.path}: cannot start a write ({exc})") from exc
        try:
            self._check_file()
            yield conn
            conn.execute("COMMIT")
        except BaseException as exc:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise write_failed(str(self.path), exc) from exc
            raise

    def _check_readable(self, conn: sqlite3.Connection) -> None:
        """A read-only open needs an existing ledger of a schema this program knows."""
        version = has_component(conn, COMPONENT)
        if version is None:
            raise LedgerError(f"{self.path} holds no rollout-lifecycle ledger")
        if version > SCHEMA_VERSION:
            raise LedgerError(
                f"database has ledger schema version {version}, this program expects "
                f"{SCHEMA_VERSION}: the file was written by a newer rollout-lifecycle; upgrade"
            )

    def _lost(self, give_back: bool) -> bool:
        """The file is gone (see sqlite_files.lose_file): if asked, fold its -wal back into
        it through this thread's connection or an idle one, then close; True if folded."""
        folded = False
        if give_back:
            mine: _Handle | None = getattr(self._local, "handle", None)
            with self._handles_lock:
                idle = [h for h in self._handles if h is not mine and h.pid == os.getpid()]
            if mine is not None and mine.pid == os.getpid():
                folded = hand_back(mine.conn, own=True)
            for h in idle:
                folded = folded or hand_back(h.conn, own=False)
        self.close()
        return folded

    def _check_file(self) -> None:
        """Fail closed when the file was deleted, replaced or overwritten under this open
        ledger; the first finding closes it (and this process's registries on the file)."""
        if self._guard is not None:
            self._guard.check()

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """A read transaction: every SELECT inside sees one consistent snapshot (WAL)."""
        self._check_file()  # before: a finding closes the connection a snapshot would use
        conn = self._conn()
        try:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                conn.execute("COMMIT")
        except sqlite3.Error as exc:
            raise LedgerError(f"{self.path}: read failed ({exc})") from exc

    def _bump(self, conn: sqlite3.Connection, counts: Mapping[str, int]) -> None:
        """Add to counters: counts of writes go to the file in the caller's transaction;
        outcomes that write nothing (a lost compare-and-set, a refusal, an idempotent retry)
        are counted by this ledger object only, so a losing racer writes nothing at all."""
        local = {k: v for k, v in counts.items() if v and k in PROCESS_LOCAL_COUNTERS}
        if local:
            with self._handles_lock:
                self._outcomes.update(local)
        rows = [(k, v) for k, v in counts.items() if v and k not in PROCESS_LOCAL_COUNTERS]
        if len(rows) == 1:
            conn.execute(_BUMP, rows[0])
        elif rows:
            conn.executemany(_BUMP, rows)

    def _bump_now(self, counts: Mapping[str, int]) -> None:
        if any(k not in PROCESS_LOCAL_COUNTERS for k, v in counts.items() if v):
            if self.read_only:
                raise LedgerError(f"ledger {self.path} was opened read-only; nothing written")
            self._check_file()
            try:
                self._bump(self._conn(), counts)
            except sqlite3.Error as exc:
                raise LedgerError(f"{self.path}: could not update counters ({exc})") from exc
        else:
            self._bump(None, counts)  # type: ignore[arg-type]  # local counts touch no file

    @staticmethod
    def _row(conn: sqlite3.Connection, rollout_id: str) -> LedgerEntry | None:
        rows = conn.execute(
            "SELECT entry FROM rollouts WHERE rollout_id = ?", (rollout_id,)
        ).fetchall()
        return _load(rows[0][0]) if rows else None

    @staticmethod
    def _rows(conn: sqlite3.Connection, rollout_ids: Sequence[str]) -> dict[str, LedgerEntry]:
        # bound parameters, chunked under SQLite's limit: every id compares byte for byte,
        # NUL included (json_each cut such ids at the NUL and reported them missing)
        out: dict[str, LedgerEntry] = {}
        ids = list(rollout_ids)
        for start in range(0, len(ids), _IN_CHUNK):
            part = ids[start : start + _IN_CHUNK]
            marks = ",".join("?" * len(part))
            rows = conn.execute(
                f"SELECT rollout_id, entry FROM rollouts WHERE rollout_id IN ({marks})", part
            ).fetchall()
            out.update((rid, _load(text)) for rid, text in rows)
        return out

    @staticmethod
    def _owned(conn: sqlite3.Connection, update_id: str) -> list[LedgerEntry]:
        rows = conn.execute(
            "SELECT entry FROM rollouts WHERE reserved_by = ?", (update_id,)
        ).fetchall()
        return sorted((_load(r[0]) for r in rows), key=lambda e: e.rollout_id)

    @staticmethod
    def _bad_versions(conn: sqlite3.Connection) -> set[int]:
        return {int(r[0]) for r in conn.execute("SELECT version FROM ledger_bad_versions")}

    @staticmethod
    def _cas(conn: sqlite3.Connection, before: LedgerEntry, after: LedgerEntry) -> bool:
        """THE compare-and-set: one conditional UPDATE; False when the revision moved on."""
        cur = conn.execute(
            _CAS,
            (
                after.state,
                after.revision,
                after.reserved_by,
                after.lease_expires_at,
                _dump(after),
                after.rollout_id,
                before.revision,
            ),
        )
        return cur.rowcount == 1

    def _apply(self, conn: sqlite3.Connection, changes: Sequence[Change]) -> None:
        """Write planned changes inside the caller's transaction, with their events."""
        for _, before, after, _ in changes:
            # rows were read under this transaction's write lock, so a lost CAS is a bug
            if before is None or not self._cas(conn, before, after):
                raise LedgerError(f"rollout {after.rollout_id!r} changed under the write lock")
        self._events(conn, changes)

    def _premise(self, conn: sqlite3.Connection) -> ActivationPremise:
        """The active pointer and ever-active versions, read inside the caller's transaction.

        Ledger and registry share the file, so under this transaction's write lock no
        pointer switch can land between this read and the reservation's write. A file
        without registry tables (a ledger on its own) gives NO_REGISTRY.
        """
        if not self._registry_seen:
            row = conn.execute("SELECT 1 FROM schema_meta WHERE component = 'registry'").fetchone()
            if row is None:
                return NO_REGISTRY
            self._registry_seen = True  # a registry, once created, never goes away
        (pointer,) = conn.execute(
            "SELECT (SELECT version FROM registry_pointer WHERE id = 1)"
        ).fetchone()
        # by name: a registry not yet migrated to the pacing columns reads them as None
        cur = conn.execute("SELECT * FROM registry_policy WHERE id = 1")
        found = cur.fetchone()
        names = [d[0] for d in cur.description]
        pol = {} if found is None else dict(zip(names, found, strict=True))
        was = conn.execute(
            f"SELECT version, state, failure FROM registry_artifacts "
            f"WHERE state IN ({_WAS_ACTIVE_MARKS})",
            _WAS_ACTIVE,
        ).fetchall()
        return ActivationPremise(
            None if pointer is None else int(pointer),
            frozenset(int(r[0]) for r in was),
            None
            if not pol
            else AdmissionPolicy(
                int(pol["max_lag"]),
                float(pol["max_drift"]),
                None if pol.get("batch_size") is None else int(pol["batch_size"]),
                None if pol.get("max_attempts") is None else int(pol["max_attempts"]),
            ),
            retired_from_rows((r[0], r[2]) for r in was if r[1] == "rolled_back"),
        )

    def _events(self, conn: sqlite3.Connection, changes: Sequence[Change]) -> None:
        if not changes:
            return
        enforce(a for _, _, a, _ in changes)
        append_events(conn, entry_events(changes, self.clock()))
        self._bump(conn, {"writes": len(changes)})

    # ---- protocol ---------------------------------------------------------------------------

    def add(self, rollout: Rollout | LedgerEntry) -> LedgerEntry:
        """Insert a new rollout at revision 0; its id must be new."""
        return self.add_many([rollout])[0]

    def add_many(self, rollouts: Sequence[Rollout | LedgerEntry]) -> list[LedgerEntry]:
        """Insert several new rollouts in one transaction (one fsync instead of one each).

        All or nothing: a duplicate id anywhere (in the file or the list) adds none of them.
        """
        entries = [as_entry(r) for r in rollouts]
        for e in entries:
            plan_add(e, ())  # validate before taking the write lock
        if not entries:
            return []
        with self._write() as conn:
            bad = self._bad_versions(conn)
            plans = [plan_add(e, bad) for e in entries]
            entries = [p[-1][2] for p in plans]
            for e in entries:
                cur = conn.execute(
                    _INSERT,
                    (
                        e.rollout_id,
                        e.state,
                        e.revision,
                        e.reserved_by,
                        e.lease_expires_at,
                        e.behavior_version,
                        _dump(e),
                    ),
                )
                if cur.rowcount != 1:
                    raise DuplicateRollout(f"rollout {e.rollout_id!r} is already in the ledger")
            self._events(conn, [(ev, b, a, None) for p in plans for ev, b, a in p])
        return entries

    def find(self, rollout_id: str) -> LedgerEntry | None:
        """The entry, or None when absent."""
        check_id(rollout_id)
        self._check_file()
        try:
            return self._row(self._conn(), rollout_id)
        except sqlite3.Error as exc:
            raise LedgerError(f"{self.path}: read failed ({exc})") from exc

    def get(self, rollout_id: str) -> LedgerEntry:
        """The entry; UnknownRollout when absent."""
        e = self.find(rollout_id)
        if e is None:
            raise UnknownRollout(f"rollout {rollout_id!r} is not in the ledger")
        return e

    def transition(
        self,
        rollout_id: str,
        event: str,
        expected_revision: int,
        *,
        reward: Reward | None = None,
        disposition: Disposition | None = None,
        tokens: int | None = None,
    ) -> LedgerEntry:
        """Fire a direct lifecycle event under compare-and-set; nothing changes on failure."""
        changes = direct_changes(event, reward, disposition, tokens)
        check_revision(expected_revision)
        entry = self.get(rollout_id)
        if entry.revision != expected_revision:
            self._bump_now({"cas_conflicts": 1})
            raise RevisionConflict(rollout_id, expected_revision, entry.revision)
        new = plan_transition(entry, event, **changes)
        with self._write() as conn:
            if self._cas(conn, entry, new):
                self._events(conn, [(event, entry, new, None)])
                return new
            # lost between our read and our write: count it, report what is there now
            self._bump(conn, {"cas_conflicts": 1})
            now = self._row(conn, rollout_id)
        raise RevisionConflict(rollout_id, expected_revision, now.revision if now else -1)

    def reserve(
        self,
        rollout_id: str,
        expected_revision: int,
        update_id: str,
        admission: AdmissionStamp | None,
    ) -> ReserveOutcome:
        """Compare-and-set reservation of one rollout: unlocked read, one conditional UPDATE."""
        check_update_id(update_id)
        entry = self.find(rollout_id)
        lease = self.clock() + self.lease_seconds
        # plan on the unlocked read (a conflict or a bad stamp costs no write lock) ...
        out, new = plan_reserve(
            entry,
            rollout_id,
            expected_revision,
            update_id,
            admission,
            premise=NO_REGISTRY,
            lease_expires_at=lease,
        )
        if new is None or entry is None:
            self._bump_now({_counter_of(out.reason): 1})
            return out
        with self._write() as conn:
            # ... and judge the premise against the pointer of THIS moment, under the lock
            refusal = self._premise(conn).refusal(admission, entry.behavior_version)
            if refusal is not None:
                self._bump(conn, {"refused": 1})
                return ReserveOutcome(rollout_id, False, refusal[0], entry, refusal[1])
            if self._cas(conn, entry, new):
                self._events(conn, [("reserve", entry, new, update_id)])
                self._bump(conn, {"reservations": 1})
                return out
            # The CAS lost. Re-plan on the row as it is now (under the write lock): revisions
            # only grow, so the planner can only say conflict, or idempotent if our own
            # update reserved it meanwhile (e.g. through a concurrent batch).
            now = self._row(conn, rollout_id)
            again = replan_lost(now, rollout_id, expected_revision, update_id, admission, lease)
            self._bump(conn, {_counter_of(again.reason): 1})
            return again

    def reserve_batch(
        self, update_id: str, requests: Sequence[ReserveRequest]
    ) -> list[ReserveOutcome]:
        """Reserve many rollouts in one transaction; each item wins or loses on its own CAS."""
        check_update_id(update_id)
        requests = check_requests(requests)
        if not requests:
            return []
        outcomes: list[ReserveOutcome] = []
        with self._write() as conn:
            lease = self.clock() + self.lease_seconds
            premise = self._premise(conn)
            entries = self._rows(conn, [r.rollout_id for r in requests])
            changes: list[Change] = []
            counts: Counter[str] = Counter()
            for r in requests:
                entry = entries.get(r.rollout_id)
                out, new = plan_reserve(
                    entry,
                    r.rollout_id,
                    r.expected_revision,
                    update_id,
                    r.admission,
                    premise=premise,
                    lease_expires_at=lease,
                )
                counts[_counter_of(out.reason)] += 1
                if new is not None and entry is not None:
                    # written as we go, so a crash mid-batch leaves an open transaction
                    # with real row changes that recovery must roll back
                    if not self._cas(conn, entry, new):
                        raise LedgerError(f"rollout {r.rollout_id!r} changed under the write lock")
                    changes.append(("reserve", entry, new, update_id))
                outcomes.append(out)
            self._events(conn, changes)
            self._bump(conn, counts)
        return outcomes

    def dispatch(self, rollout: Rollout | LedgerEntry, *, chain: str) -> DispatchOutcome:
        """Start a rollout of `chain` only within the staleness budget (model.pacing): the
        pointer, the policy, the live count and the chain are read under the write lock."""
        entry = dispatch_entry(rollout, chain)
        with self._write() as conn:
            act = self._premise(conn)
            floor = window_floor(act.pointer_version, act.policy)
            (live,) = conn.execute(
                f"SELECT COUNT(*) FROM rollouts WHERE state IN ({_LIVE_MARKS}) "
                "AND behavior_version >= ?",
                (*LIVE_STATES, -1 if floor is None else floor),
            ).fetchone()
            states = tuple(
                r[0]
                for r in conn.execute(
                    "SELECT state FROM rollouts WHERE json_extract(entry, '$.chain') = ?",
                    (chain,),
                )
            )
            premise = DispatchPremise(
                act.pointer_version, act.was_active, act.policy, int(live), states
            )
            out, new = plan_dispatch(entry, chain, premise)
            if new is None:
                return out
            changes = plan_add(new, self._bad_versions(conn), dispatched=True)
            written = changes[-1][2]
            cur = conn.execute(
                _INSERT,
                (
                    new.rollout_id,
                    written.state,
                    written.revision,
                    None,
                    None,
                    new.behavior_version,
                    _dump(written),
                ),
            )
            if cur.rowcount != 1:
                raise DuplicateRollout(f"rollout {new.rollout_id!r} is already in the ledger")
            self._events(conn, [(ev, b, a, None) for ev, b, a in changes])
        return attrs.evolve(out, entry=written)

    def retire_stale(self) -> list[LedgerEntry]:
        """Retire, with their cause, rewarded rollouts now too old for the pointer."""
        with self._write() as conn:
            act = self._premise(conn)
            floor = window_floor(act.pointer_version, act.policy)
            if floor is None or act.policy is None or act.pointer_version is None:
                return []
            rows = conn.execute(
                "SELECT entry FROM rollouts WHERE state = 'rewarded' AND behavior_version < ? "
                "ORDER BY rollout_id",
                (floor,),
            ).fetchall()
            due = [_load(r[0]) for r in rows]
            pointer, bound = act.pointer_version, act.policy.max_lag
            new = [
                plan_transition(
                    e,
                    "retire_stale",
                    disposition=stale_disposition(pointer - e.behavior_version, bound, pointer),
                )
                for e in due
            ]
            self._apply(conn, [("retire_stale", b, a, None) for b, a in zip(due, new, strict=True)])
        return new

    def oldest_admissible(self, limit: int) -> list[LedgerEntry]:
        """Up to `limit` rewarded rollouts still within the lag bound, oldest first."""
        limit = check_limit(limit)
        with self._read() as conn:
            act = self._premise(conn)
            floor = window_floor(act.pointer_version, act.policy)
            top = act.pointer_version
            rows = conn.execute(
                "SELECT entry FROM rollouts WHERE state = 'rewarded' AND behavior_version >= ? "
                "AND behavior_version <= ? ORDER BY behavior_version, "
                "COALESCE(json_extract(entry, '$.attempt'), 0) DESC, rollout_id LIMIT ?",
                (-1 if floor is None else floor, 2**62 if top is None else top, limit),
            ).fetchall()
        return oldest_first(_load(r[0]) for r in rows)

    def commit(self, update_id: str, rollout_ids: Sequence[str]) -> list[LedgerEntry]:
        """Consume exactly the rollouts `update_id` reserved, atomically; else CommitMismatch."""
        check_update_id(update_id)
        with self._write() as conn:
            owned = self._owned(conn, update_id)
            new = commit_plan(update_id, rollout_ids, owned)
            self._apply(
                conn, [("commit", b, a, update_id) for b, a in zip(owned, new, strict=True)]
            )
            self._bump(conn, {"commits": 1})
        return new

    def abort(self, update_id: str) -> list[LedgerEntry]:
        """Return every reservation of `update_id` under the recovery rule."""
        check_update_id(update_id)
        with self._write() as conn:
            owned = self._owned(conn, update_id)
            bad = self._bad_versions(conn)
            new = [plan_release(e, "abort", self.recovery, bad) for e in owned]
            self._apply(conn, [("abort", b, a, update_id) for b, a in zip(owned, new, strict=True)])
            self._bump(conn, {"aborts": 1})
        return new

    def fail_update(self, update_id: str, cause: str, detail: str = "") -> list[LedgerEntry]:
        """The update itself failed with this data: its rollouts end in update_failed."""
        check_update_id(update_id)
        if not isinstance(cause, str) or not cause:
            raise InvalidLedgerArgument(f"cause must be a non-empty string, got {brief(cause)}")
        with self._write() as conn:
            owned = self._owned(conn, update_id)
            new = [
                plan_transition(
                    e,
                    "update_failed",
                    reserved_by=None,
                    lease_expires_at=None,
                    disposition=Disposition("update", cause, detail),
                )
                for e in owned
            ]
            self._apply(
                conn, [("update_failed", b, a, update_id) for b, a in zip(owned, new, strict=True)]
            )
        return new

    def expire_leases(self) -> list[LedgerEntry]:
        """Return reservations whose lease ran out (a crashed learner never blocks forever)."""
        with self._write() as conn:
            now = self.clock()
            rows = conn.execute(
                "SELECT entry FROM rollouts WHERE reserved_by IS NOT NULL "
                "AND lease_expires_at IS NOT NULL AND lease_expires_at <= ?",
                (now,),
            ).fetchall()
            due = sorted((_load(r[0]) for r in rows), key=lambda e: e.rollout_id)
            bad = self._bad_versions(conn)
            new = [plan_release(e, "expire_lease", self.recovery, bad) for e in due]
            self._apply(
                conn, [("expire_lease", b, a, b.reserved_by) for b, a in zip(due, new, strict=True)]
            )
            self._bump(conn, {"expirations": len(new)})
        return new

    def renew_leases(self, update_id: str) -> list[LedgerEntry]:
        """Heartbeat of a long update: every rollout it holds gets a full lease from now
        (the ledger's clock), in one transaction."""
        check_update_id(update_id)
        with self._write() as conn:
            owned = self._owned(conn, update_id)
            new = renew_plan(owned, self.clock(), self.lease_seconds)
            self._apply(
                conn, [("renew_lease", b, a, update_id) for b, a in zip(owned, new, strict=True)]
            )
        return new

    def quarantine_version(self, version: int, reason: str) -> list[LedgerEntry]:
        """Mark a version bad: quarantine its open rollouts now, reserved ones on return."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        marks = ",".join("?" * len(_QUARANTINABLE))
        with self._write() as conn:
            conn.execute(
                "INSERT INTO ledger_bad_versions(version, reason) VALUES (?, ?) "
                "ON CONFLICT(version) DO NOTHING",
                (version, reason),
            )
            rows = conn.execute(
                f"SELECT entry FROM rollouts WHERE behavior_version = ? AND state IN ({marks})",
                (version, *_QUARANTINABLE),
            ).fetchall()
            due = sorted((_load(r[0]) for r in rows), key=lambda e: e.rollout_id)
            d = Disposition("activation", "failed_version", reason)
            new = [plan_transition(e, "quarantine", disposition=d) for e in due]
            self._apply(conn, [("quarantine", b, a, None) for b, a in zip(due, new, strict=True)])
        return new

    def clear_bad_version(self, version: int) -> None:
        """Lift the mark: the version became active after a retry, its new rollouts are good.

        Rollouts already quarantined stay quarantined (terminal states absorb).
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        with self._write() as conn:
            conn.execute("DELETE FROM ledger_bad_versions WHERE version = ?", (version,))

    @property
    def bad_versions(self) -> frozenset[int]:
        """Versions marked bad by quarantine_version, in this file (any process)."""
        with self._read() as conn:
            return frozenset(self._bad_versions(conn))

    def reserved_by(self, update_id: str) -> list[str]:
        """Ids currently reserved by `update_id`, sorted."""
        with self._read() as conn:
            rows = conn.execute(
                "SELECT rollout_id FROM rollouts WHERE reserved_by = ?", (update_id,)
            ).fetchall()
        return sorted(r[0] for r in rows)

    def snapshot(self) -> dict[str, LedgerEntry]:
        """A consistent copy of every entry (one SELECT sees one WAL snapshot)."""
        with self._read() as conn:
            rows = conn.execute("SELECT rollout_id, entry FROM rollouts").fetchall()
        return {rid: _load(text) for rid, text in sorted(rows)}

    def history(self, rollout_id: str | None = None) -> list[EntryChanged]:
        """This file's ledger trace (shared `events` table), optionally for one rollout."""
        if rollout_id is not None:
            check_id(rollout_id)
        with self._read() as conn:
            evs = read_events(conn, "entry", rollout_id)
        return [e for e in evs if isinstance(e, EntryChanged)]

    def stored_rows(self) -> StoredRows:
        """Every table of the file (ledger and registry), the events with their hash chain
        and its head, from one WAL snapshot: what `ledger check` audits."""
        with self._read() as conn:
            return read_stored(conn)

    def statistics(self) -> LedgerStatistics:
        """Counts by state and counters of writes, wins, losses and returns, from one snapshot."""
        with self._read() as conn:
            by_state = dict(
                conn.execute("SELECT state, COUNT(*) FROM rollouts GROUP BY state").fetchall()
            )
            counters = Counter(dict(conn.execute("SELECT name, n FROM ledger_counters").fetchall()))
            bad = self._bad_versions(conn)
        with self._handles_lock:
            counters.update(self._outcomes)
            pacing = rows_from_columns(conn.execute(_PACING_COLUMNS))
        # counting states in SQL avoids decoding every entry; the rest is the shared builder
        base = statistics_from((), counters, bad, pacing)
        states = {s: int(by_state.get(s, 0)) for s in base.by_state}
        return attrs.evolve(base, entries=sum(states.values()), by_state=states)

    def close(self) -> None:
        """Close every thread's connection; later use raises LedgerError. Idempotent."""
        with self._handles_lock:
            self._closed = True
            handles = [h for h in self._handles if h.pid == os.getpid()]
            self._handles = weakref.WeakSet()
        for h in handles:
            h.close()
        if self._guard is not None:
            self._guard.release()  # after the connections: see sqlite_files._OpenFile

    def __enter__(self) -> SQLiteLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
