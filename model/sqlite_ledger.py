"""The embedded default ledger: one SQLite file, safe across threads and processes.

`SQLiteStore` is the ledger's store (see `model.ledger.Store`): every step of
`StoreLedger` runs inside one ``BEGIN IMMEDIATE`` transaction, so "read the rows and the
registry's premise, check revisions, write, append events, bump counters" is one atomic
step that a crash leaves all or nothing. A single reservation is planned on a read outside
the transaction; its conditional ``UPDATE ... WHERE rollout_id = ? AND revision = ?``
decides who won. A batch is a constant number of statements (``executemany`` in the one
transaction), not a statement per row.

Counters live in the chain head's row (sqlite_common.HEAD_COUNTERS), updated in the same
transaction (and statement) as the write they count, so statistics stay right across
processes and restarts.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from rollout_lifecycle.model.clocks import sqlite_host_clock
from rollout_lifecycle.model.errors import DuplicateRollout, LedgerError, brief
from rollout_lifecycle.model.events import (
    Change,
    EntryChanged,
    StoredRows,
    TraceEvent,
    UpdateChange,
    entry_events,
    update_events,
)
from rollout_lifecycle.model.ledger import (
    NO_REGISTRY,
    ActivationPremise,
    Clock,
    RecoveryRule,
    Step,
    StoreLedger,
    StoreView,
    Tallies,
    UnitOfWork,
    check_lease_seconds,
    load_entry,
    read_entry,
    update_from_row,
)
from rollout_lifecycle.model.records import (
    AdmissionPolicy,
    LedgerEntry,
    UpdateRecord,
)
from rollout_lifecycle.model.registry import policy_from_row
from rollout_lifecycle.model.rules import WAS_ACTIVE_STATES, retired_from_rows
from rollout_lifecycle.model.sql_unit import UPDATE_COLUMNS, SqlUnit, read_bad
from rollout_lifecycle.model.sqlite_common import (
    HEAD_COUNTERS,
    NEXT_COLUMNS,
    append_events,
    count_sql,
    read_counters,
    read_events,
    read_stored,
    sqlite_url,
)
from rollout_lifecycle.model.sqlite_conns import Connections

T = TypeVar("T")

COMPONENT = "ledger"
# 3: the ledger's update records (ledger_updates, created by the DDL) and their events
SCHEMA_VERSION = 3
# 1 -> 2, two changes in one step:
# - entry events store only the fields that changed (model.events.CHANGED); nothing stored is
#   rewritten (the chain hashes it), and a program of version 1, which reads only whole
#   before/after entries, would misread the new ones;
# - events are numbered without AUTOINCREMENT and with no index on txn (see sqlite_common
#   NEXT_COLUMNS; `ensure_schema` drops an older file's index); the counters are columns
#   of the chain's head (sqlite_common.HEAD_COUNTERS), which `ensure_schema` adds before
#   this migration moves the table's counts there: a program of version 1 could not append
#   to a file this version writes.
# Either is reason enough for version 1 to refuse the file, which the bump makes it do.
MIGRATIONS = {
    1: "UPDATE events_chain SET "
    + ", ".join(
        f"{c} = {c} + COALESCE((SELECT n FROM ledger_counters WHERE name = '{c}'), 0)"
        for c in HEAD_COUNTERS
    )
    + " WHERE id = 1; DROP TABLE ledger_counters",
    # the table is created by the DDL; updates that landed before it are not recorded (a
    # version that names one is refused: name it again after its next commit, or record
    # lineage "off"), and the bump makes an older program, which keeps no records, refuse
    2: "",
}

# The indexed columns are copies of LedgerEntry fields that queries filter on; `entry` holds
# the whole record so nothing is lost. The CHECK repeats the exclusive-ownership invariant at
# the storage level, so a buggy raw write fails loudly instead of corrupting the file.
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
CREATE TABLE IF NOT EXISTS ledger_updates (
    update_id TEXT PRIMARY KEY,
    status    TEXT NOT NULL CHECK (status IN ('open', 'landed', 'poisoned')),
    cause     TEXT,
    detail    TEXT NOT NULL DEFAULT '',
    CHECK ((cause IS NULL) = (status <> 'poisoned'))
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS ledger_updates_status ON ledger_updates(status);
"""

# THE compare-and-set: a conditional UPDATE whose rowcount says whether the revision held
_CAS = (
    "UPDATE rollouts SET state = ?, revision = ?, reserved_by = ?, lease_expires_at = ?, "
    "entry = ? WHERE rollout_id = ? AND revision = ?"
)
# a step's premise read, with what `append_events` reads next (NEXT_COLUMNS) in the same
# statement: both under the step's write lock, and nothing appends events in between
_HAS_REGISTRY = "SELECT EXISTS (SELECT 1 FROM schema_meta WHERE component = 'registry')"
_POINTER = "SELECT (SELECT version FROM registry_pointer WHERE id = 1)"
_PROBE_NEXT = f"{_HAS_REGISTRY}, {NEXT_COLUMNS}"
_POINTER_NEXT = f"{_POINTER}, {NEXT_COLUMNS}"
_FIND = "SELECT entry FROM rollouts WHERE rollout_id = ?"
# a row and an update's record in one statement (one snapshot): what a reservation plans on
_FIND_WITH_UPDATE = (
    f"SELECT r.entry, {', '.join('u.' + c for c in UPDATE_COLUMNS.split(', '))} FROM (SELECT 1) "
    "LEFT JOIN rollouts r ON r.rollout_id = ? LEFT JOIN ledger_updates u ON u.update_id = ?"
)
_INSERT = (
    "INSERT INTO rollouts(rollout_id, state, revision, reserved_by, lease_expires_at, "
    "behavior_version, entry) VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_HAS_UPDATES = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'ledger_updates'"
_IN_CHUNK = 500  # ids per IN (...) list, well under SQLite's bound-parameter limit
_WAS_ACTIVE = tuple(sorted(WAS_ACTIVE_STATES))
_WAS_ACTIVE_MARKS = ",".join("?" * len(_WAS_ACTIVE))
_EVER_ACTIVE = (
    "SELECT version, state, failure, artifact_hash FROM registry_artifacts "
    f"WHERE state IN ({_WAS_ACTIVE_MARKS})"
)
# the versions a step judges, looked up by primary key (not a scan of every version)
_OF_VERSIONS = " AND version IN (SELECT value FROM json_each(?))"


def _marks(n: int) -> str:
    return ",".join("?" * n)


class _Unit(SqlUnit):
    """One step's access to the file, inside its BEGIN IMMEDIATE transaction."""

    def __init__(self, store: SQLiteStore, conn: sqlite3.Connection) -> None:
        super().__init__(conn)
        self.store = store
        # NEXT_COLUMNS as read with the premise, for the next append (used once)
        self.head: Sequence[Any] | None = None
        found = store.found  # a single reservation plans on the entry `find` just read
        if found is not None:
            self.texts[id(found[0])] = found

    def read_rows(self, rollout_ids: Sequence[str]) -> dict[str, LedgerEntry]:
        return self.store.rows(self.conn, rollout_ids, self.load)

    def read_premise(self, versions: Collection[int] | None = None) -> ActivationPremise:
        premise, self.head = self.store.premise(self.conn, versions)
        return premise

    def read_policy(self) -> tuple[int | None, AdmissionPolicy | None]:
        return self.store.pointer_policy(self.conn)

    def server_now(self) -> float | None:
        return None  # the ledger's clock (the host's, as the file records it)

    def insert(self, entries: Sequence[LedgerEntry]) -> None:
        ids = [e.rollout_id for e in entries]
        taken = set(self.store.rows(self.conn, ids)) if entries else set()
        seen: set[str] = set()
        for rid in ids:
            if rid in taken or rid in seen:
                raise DuplicateRollout(f"rollout {brief(rid)} is already in the ledger")
            seen.add(rid)
        self.conn.executemany(
            _INSERT,
            [
                (
                    e.rollout_id,
                    e.state,
                    e.revision,
                    e.reserved_by,
                    e.lease_expires_at,
                    e.behavior_version,
                    self.dump(e),
                )
                for e in entries
            ],
        )

    def write(self, pairs: Sequence[tuple[LedgerEntry, LedgerEntry]]) -> set[str]:
        rows = [
            (
                a.state,
                a.revision,
                a.reserved_by,
                a.lease_expires_at,
                self.dump_after(b, a),
                a.rollout_id,
                b.revision,
            )
            for b, a in pairs
        ]
        if len(rows) == 1:
            won = self.conn.execute(_CAS, rows[0]).rowcount == 1
            return {pairs[0][1].rollout_id} if won else set()
        if self.conn.executemany(_CAS, rows).rowcount == len(rows):
            return {a.rollout_id for _, a in pairs}
        # a batch always reads its rows under this transaction's write lock: it cannot lose
        raise LedgerError(f"{self.store.path}: rows changed under the write lock")

    def append(
        self,
        changes: Sequence[Change],
        at: float,
        counts: Mapping[str, int],
        updates: Sequence[UpdateChange] = (),
    ) -> None:
        counted = {k: v for k, v in counts.items() if v}
        recorded = self.recorded_events(at)
        if changes or updates or recorded:  # the counters ride in the chain head's statement
            head, self.head = self.head, None
            events: list[TraceEvent] = [*entry_events(changes, at)]
            if updates:
                self.put_updates(updates)
                events += update_events(updates, at)
            events += recorded
            append_events(self.conn, events, self.payload, stamped=False, head=head, counts=counted)
        elif counted:
            self.conn.execute(count_sql(tuple(counted)), tuple(counted.values()))


class SQLiteStore:
    """The ledger's tables in one SQLite file (WAL); see the module doc."""

    def __init__(self, path: Path, *, read_only: bool) -> None:
        if str(path) == ":memory:":
            # each thread's connection would get its own private database
            raise LedgerError("SQLiteLedger needs a file path; use MemoryLedger for memory")
        if path.is_dir():
            raise LedgerError(f"{path} is a directory; give a database file path inside it")
        self.path = path
        self.url = sqlite_url(path)  # named in hints (see StoreLedger._located)
        self.read_only = read_only
        self._registry_seen = False
        # the entry `find` read last, with its stored text when it is exactly what `dump`
        # makes: a step writing over that very object reuses the text (any thread's:
        # the object itself is checked, by identity)
        self.found: tuple[LedgerEntry, str] | None = None
        self.conns = Connections(
            path,
            read_only=read_only,
            component=COMPONENT,
            version=SCHEMA_VERSION,
            ddl=_DDL,
            migrations=MIGRATIONS,
        )

    def atomic(self, body: Callable[[UnitOfWork], T], step: Step) -> T:
        """One BEGIN IMMEDIATE transaction: the file's write lock covers every read."""
        return self.conns.write(lambda conn: body(_Unit(self, conn)))

    def view(self, body: Callable[[StoreView], T], what: str) -> T:
        """One read transaction (a WAL snapshot): no write lock, fine on a read-only file."""
        with self.conns.read() as conn:
            return body(_Unit(self, conn))

    @staticmethod
    def rows(
        conn: sqlite3.Connection,
        rollout_ids: Sequence[str],
        load: Callable[[str], LedgerEntry] = load_entry,
    ) -> dict[str, LedgerEntry]:
        # bound parameters, chunked under SQLite's limit: every id compares byte for byte,
        # NUL included (json_each cut such ids at the NUL and reported them missing)
        out: dict[str, LedgerEntry] = {}
        ids = list(rollout_ids)
        for start in range(0, len(ids), _IN_CHUNK):
            part = ids[start : start + _IN_CHUNK]
            sql = (
                f"SELECT rollout_id, entry FROM rollouts WHERE rollout_id IN ({_marks(len(part))})"
            )
            out.update((rid, load(text)) for rid, text in conn.execute(sql, part).fetchall())
        return out

    def _load_found(self, text: str) -> LedgerEntry:
        entry, exact = read_entry(text)
        if exact:
            self.found = (entry, text)
        return entry

    def premise(
        self, conn: sqlite3.Connection, versions: Collection[int] | None = None
    ) -> tuple[ActivationPremise, Sequence[Any]]:
        """The active pointer, the policy and the facts of `versions` (None: of every
        version; see `StoreView.read_premise`), read inside the caller's transaction, and
        the events' NEXT_COLUMNS read with them (see `append_events`).

        Ledger and registry share the file, so under this transaction's write lock no
        pointer switch can land between this read and the reservation's write. A file
        without registry tables (a ledger on its own) gives NO_REGISTRY.
        """
        if not self._registry_seen:
            found, *head = conn.execute(_PROBE_NEXT).fetchone()
            if not found:
                return NO_REGISTRY, head
            self._registry_seen = True  # a registry, once created, never goes away
        pointer, *head = conn.execute(_POINTER_NEXT).fetchone()
        policy = self._policy(conn)
        if versions is None:
            was = conn.execute(_EVER_ACTIVE, _WAS_ACTIVE).fetchall()
        elif versions:  # one statement for any number: the versions as one JSON array
            only = json.dumps(sorted(versions))
            was = conn.execute(_EVER_ACTIVE + _OF_VERSIONS, (*_WAS_ACTIVE, only)).fetchall()
        else:
            was = []
        premise = ActivationPremise(
            None if pointer is None else int(pointer),
            frozenset(int(r[0]) for r in was),
            policy,
            retired_from_rows((r[0], r[2]) for r in was if r[1] == "rolled_back"),
            {int(r[0]): str(r[3]) for r in was if r[3] is not None},
        )
        return premise, head

    @staticmethod
    def _policy(conn: sqlite3.Connection) -> AdmissionPolicy | None:
        # by name: a registry not yet migrated to the pacing columns reads them as None
        cur = conn.execute("SELECT * FROM registry_policy WHERE id = 1")
        found = cur.fetchone()
        names = [d[0] for d in cur.description]
        return None if found is None else policy_from_row(dict(zip(names, found, strict=True)))

    def pointer_policy(self, conn: sqlite3.Connection) -> tuple[int | None, AdmissionPolicy | None]:
        """The active version and the recorded policy, as `premise` reads them (None, None
        without a registry), without the ever-active versions (a caller's pre-check)."""
        if not self._registry_seen:
            if not conn.execute(_HAS_REGISTRY).fetchone()[0]:
                return None, None
            self._registry_seen = True
        (pointer,) = conn.execute(_POINTER).fetchone()
        return None if pointer is None else int(pointer), self._policy(conn)

    # ---- reads outside a step -----------------------------------------------------------

    def find(self, rollout_id: str) -> LedgerEntry | None:
        self.conns.check_file()
        try:
            row = self.conns.conn().execute(_FIND, (rollout_id,)).fetchone()
        except sqlite3.Error as exc:
            raise LedgerError(f"{self.path}: read failed ({exc})") from exc
        return None if row is None else self._load_found(row[0])

    def find_with_update(
        self, rollout_id: str, update_id: str
    ) -> tuple[LedgerEntry | None, UpdateRecord | None]:
        self.conns.check_file()
        try:
            row = self.conns.conn().execute(_FIND_WITH_UPDATE, (rollout_id, update_id)).fetchone()
        except sqlite3.Error as exc:
            raise LedgerError(f"{self.path}: read failed ({exc})") from exc
        entry = None if row[0] is None else self._load_found(row[0])
        return entry, None if row[1] is None else update_from_row(row[1:])

    def find_update(self, update_id: str) -> UpdateRecord | None:
        return self.all_updates([update_id]).get(update_id)

    def all_updates(self, only: Sequence[str] | None = None) -> dict[str, UpdateRecord]:
        with self.conns.read() as conn:
            if conn.execute(_HAS_UPDATES).fetchone() is None:
                return {}  # a file of ledger schema 2 opened read-only
            sql = f"SELECT {UPDATE_COLUMNS} FROM ledger_updates"
            if only is None:
                rows = conn.execute(sql + " ORDER BY update_id").fetchall()
            else:
                where = f" WHERE update_id IN ({_marks(len(only))})"
                rows = conn.execute(sql + where, only).fetchall()
            return {str(r[0]): update_from_row(r) for r in rows}

    def reserved_by(self, update_id: str) -> list[str]:
        with self.conns.read() as conn:
            sql = "SELECT rollout_id FROM rollouts WHERE reserved_by = ?"
            return sorted(r[0] for r in conn.execute(sql, (update_id,)).fetchall())

    def in_state(self, state: str, limit: int | None) -> list[LedgerEntry]:
        sql = "SELECT entry FROM rollouts WHERE state = ? ORDER BY rollout_id LIMIT ?"
        with self.conns.read() as conn:
            rows = conn.execute(sql, (state, -1 if limit is None else limit)).fetchall()
        return [load_entry(r[0]) for r in rows]

    def snapshot(self) -> dict[str, LedgerEntry]:
        with self.conns.read() as conn:
            rows = conn.execute("SELECT rollout_id, entry FROM rollouts").fetchall()
        return {rid: load_entry(text) for rid, text in sorted(rows)}

    def bad_versions(self) -> frozenset[int]:
        with self.conns.read() as conn:
            return read_bad(conn)

    def history(self, rollout_id: str | None) -> list[EntryChanged]:
        with self.conns.read() as conn:
            evs = read_events(conn, "entry", rollout_id)
        return [e for e in evs if isinstance(e, EntryChanged)]

    def tallies(self) -> Tallies:
        # counting states in SQL avoids decoding every entry
        with self.conns.read() as conn:
            by_state = dict(
                conn.execute("SELECT state, COUNT(*) FROM rollouts GROUP BY state").fetchall()
            )
            counters = read_counters(conn)
            return by_state, counters, read_bad(conn), _Unit(self, conn).pacing_rows()

    def stored_rows(self) -> StoredRows:
        with self.conns.read() as conn:
            return read_stored(conn)

    def close(self) -> None:
        self.conns.close()


class SQLiteLedger(StoreLedger):
    """Durable ledger in one SQLite file (WAL); several threads and processes may share it."""

    store: SQLiteStore

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
        store = SQLiteStore(Path(path), read_only=read_only)
        if clock is None:
            try:
                clock = sqlite_host_clock(store.conns.conn(), read_only=read_only)
            except BaseException:
                store.close()
                raise
        super().__init__(store, clock=clock, lease_seconds=lease_seconds, recovery=recovery)

    @property
    def path(self) -> Path:
        """The database file."""
        return self.store.path

    @property
    def read_only(self) -> bool:
        """Whether nothing may be written through this ledger."""
        return self.store.read_only

    def stored_rows(self) -> StoredRows:
        """Every table of the file (ledger and registry), the events with their hash chain
        and its head, from one WAL snapshot: what `ledger check` audits."""
        return self.store.stored_rows()

    # white-box views for tests that reach this thread's connection
    def _conn(self) -> sqlite3.Connection:
        return self.store.conns.conn()

    @property
    def _local(self) -> threading.local:
        return self.store.conns.local
