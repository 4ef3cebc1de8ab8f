"""What the SQLite ledger and the SQLite registry share: connections, schema versions, events.

Both live in one database file so that their events share one global order (the `events`
table's `seq`, never reused: see `NEXT_COLUMNS`), which the spec's trace replay needs to
judge, for example, that a reservation was admitted against the version active at that moment.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from rollout_lifecycle.model.errors import LedgerError, StorageFull, schema_steps, tampered
from rollout_lifecycle.model.events import (
    GENESIS,
    SEAL,
    ChainHead,
    EntryStates,
    Payload,
    RowRecorded,
    StoredEvent,
    StoredRows,
    TraceEvent,
    chain_broken,
    chain_evidence,
    chain_hash,
    event_subject,
    events_where,
    recorded_rows,
    row_event,
    stored_payload,
)
from rollout_lifecycle.model.sqlite_files import FileReplaced as FileReplaced
from rollout_lifecycle.model.sqlite_files import connecting, guard_open, stamp_file_id


def write_failed(where: str, exc: sqlite3.Error) -> LedgerError:
    """The typed error of a failed write, the same for the ledger and the registry: a full
    disk is StorageFull (nothing written, free space and retry), anything else LedgerError."""
    code = getattr(exc, "sqlite_errorcode", None)
    if "no such table: events_chain" in str(exc):  # dropped under an open writer
        return tampered(
            where, "has no head (its events_chain table was dropped)", f"sqlite:///{where}"
        )
    if code == sqlite3.SQLITE_FULL or "disk is full" in str(exc):
        return StorageFull(
            f"{where}: write failed, nothing written: the database's disk is full ({exc}); "
            "free space on its filesystem (or move the database) and retry"
        )
    return LedgerError(f"{where}: write failed, nothing written ({exc})")


BUSY_TIMEOUT_MS = 30_000  # well above the 5 s default: 8 threads and 4 processes contend

_EVENTS_DDL = """
CREATE TABLE IF NOT EXISTS events (
    seq     INTEGER PRIMARY KEY,
    txn     INTEGER NOT NULL,
    kind    TEXT NOT NULL,
    subject TEXT NOT NULL,
    payload TEXT NOT NULL,
    prev_hash BLOB,
    hash      BLOB
);
CREATE INDEX IF NOT EXISTS events_subject ON events(kind, subject);
"""

# The ledger's durable counters (model.ledger.statistics_from): columns of the chain's head
# row, which every appending step writes anyway, so counting adds no page to a commit (a
# table of its own was one more page, and one more statement, per step)
HEAD_COUNTERS = ("writes", "reservations", "expirations", "commits", "aborts")
_COUNTER_COLUMNS = "".join(f",\n    {c} INTEGER NOT NULL DEFAULT 0" for c in HEAD_COUNTERS)

# The hash chain's head (see model.events): one row, updated in every appending transaction.
_CHAIN_DDL = f"""
CREATE TABLE IF NOT EXISTS events_chain (
    id         INTEGER PRIMARY KEY CHECK (id = 1),
    base_seq   INTEGER NOT NULL,
    base_count INTEGER NOT NULL,
    last_seq   INTEGER NOT NULL,
    last_hash  BLOB NOT NULL{_COUNTER_COLUMNS}
)
"""
# a file whose events predate the chain: they stay as an unchained prefix, counted here
_CHAIN_START = (
    "INSERT INTO events_chain(id, base_seq, base_count, last_seq, last_hash) "
    "SELECT 1, COALESCE(MAX(seq), 0), COUNT(*), COALESCE(MAX(seq), 0), ? FROM events"
)
# the next txn, the last seq ever handed out and the chain's head hash: read under the
# caller's write lock (its three columns: a caller may read them in one statement with
# something else it reads under the same lock, and hand them to `append_events` as `head`).
# Every step appends with a higher seq and a higher txn than the one before, so the event
# of the highest seq carries the highest txn: one descent of the table's own b-tree, no index
# on txn to update with every append. The head's last_seq is every seq ever handed out, even
# when the last events were deleted since (AUTOINCREMENT's counter did that before: one more
# page written per commit); MAX(seq) covers a head that was deleted.
# The last three columns are what `append_events` checks before it chains on (see
# model.events.chain_broken): the newest event's hash and seq, and the head's base seq; they
# read the pages the first three read, so they cost no page more.
NEXT_COLUMNS = (
    "COALESCE((SELECT txn FROM events ORDER BY seq DESC LIMIT 1), 0) + 1, "
    "MAX(COALESCE((SELECT last_seq FROM events_chain WHERE id = 1), 0), "
    "COALESCE((SELECT MAX(seq) FROM events), 0)), "
    "(SELECT last_hash FROM events_chain WHERE id = 1), "
    "(SELECT hash FROM events ORDER BY seq DESC LIMIT 1), "
    "(SELECT seq FROM events ORDER BY seq DESC LIMIT 1), "
    "(SELECT base_seq FROM events_chain WHERE id = 1)"
)
_NEXT = f"SELECT {NEXT_COLUMNS}"
_APPEND = (
    "INSERT INTO events(seq, txn, kind, subject, payload, prev_hash, hash) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_HEAD = (
    "INSERT INTO events_chain(id, base_seq, base_count, last_seq, last_hash) "
    "VALUES (1, 0, 0, ?, ?) ON CONFLICT(id) DO UPDATE SET "
    "last_seq = excluded.last_seq, last_hash = excluded.last_hash"
)


def _check_counters(names: tuple[str, ...]) -> None:
    """Refuse a counter the head has no column for (a name is SQL text here, never data)."""
    unknown = set(names) - set(HEAD_COUNTERS)
    if unknown:
        raise LedgerError(f"no stored counter is named {sorted(unknown)}")


def _head_sql(names: tuple[str, ...]) -> str:
    """`_HEAD` that also adds to the counters `names` (one value each, after the head's)."""
    sql = _HEADS.get(names)
    if sql is None:
        _check_counters(names)
        cols = "".join(f", {c}" for c in names)
        marks = ", ?" * len(names)
        adds = "".join(f", {c} = {c} + excluded.{c}" for c in names)
        sql = _HEADS[names] = (
            f"INSERT INTO events_chain(id, base_seq, base_count, last_seq, last_hash{cols}) "
            f"VALUES (1, 0, 0, ?, ?{marks}) ON CONFLICT(id) DO UPDATE SET "
            f"last_seq = excluded.last_seq, last_hash = excluded.last_hash{adds}"
        )
    return sql


_HEADS: dict[tuple[str, ...], str] = {(): _HEAD}


def count_sql(names: tuple[str, ...]) -> str:
    """The statement that adds to the counters `names` (one value each) in the head row, for
    a step that appends no event. A head that was deleted stays missing (the audit names
    that); its counts are then lost, as a counter table's would be with the table."""
    sql = _COUNTS.get(names)
    if sql is None:
        _check_counters(names)
        adds = ", ".join(f"{c} = {c} + ?" for c in names)
        sql = _COUNTS[names] = f"UPDATE events_chain SET {adds} WHERE id = 1"
    return sql


_COUNTS: dict[tuple[str, ...], str] = {}

# the chain itself: the audit reads events and head on their own (schema_meta is a table
# like the others: its rows are recorded in the chain and compared)
_NOT_STATE = ("events", "events_chain")

_META_DDL = """
CREATE TABLE IF NOT EXISTS schema_meta (
    component TEXT PRIMARY KEY,
    version   INTEGER NOT NULL
);
"""


def sqlite_url(path: str | Path) -> str:
    """The backend URL of the SQLite file at `path`, absolute: what an operator's command
    (`--backend`) must name, whatever folder it is run from."""
    return "sqlite:///" + str(Path(path).absolute())


def connect_read_only(path: Path) -> sqlite3.Connection:
    """Open an existing database so that nothing can be written through the connection.

    `mode=ro` never creates tables or files of its own content; on read-only storage where
    SQLite cannot create the WAL index (-shm) either, the file is opened `immutable`, which
    is exact because nothing can change it there. Refused (FileReplaced) while the -wal
    beside the file belongs to another one (see `guard_open`).
    """
    guard_open(path)
    with connecting():  # its locks are taken here (see sqlite_files.close_unlocked)
        return _connect_read_only(path)


def absent_sidecars(path: Path) -> tuple[Path, ...]:
    """The -wal and -shm beside `path`, if NEITHER exists yet: the ones a read-only open is
    about to create (SQLite needs them to read a WAL database, and a reader cannot remove
    them). Empty when either exists: then a writer has, or had, the file open."""
    pair = (Path(f"{path}-wal"), Path(f"{path}-shm"))
    return () if any(p.exists() for p in pair) else pair


def remove_read_sidecars(path: Path, created: Sequence[Path]) -> None:
    """Leave the folder as a read-only open found it: close one last ordinary connection,
    which makes SQLite fold the (empty) -wal back and delete it and the -shm. Nothing of the
    database changes; if another connection still has the file open, SQLite keeps both for
    it, and that connection removes them when it closes."""
    if not created or not any(p.exists() for p in created):
        return
    try:
        with connecting():
            conn = sqlite3.connect(str(path), timeout=0.5, isolation_level=None)
            try:
                conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchall()
            finally:
                conn.close()
    except sqlite3.Error:
        return  # busy or unreadable: the files stay, exactly as SQLite left them


def _connect_read_only(path: Path) -> sqlite3.Connection:
    uri = f"{path.resolve().as_uri()}?mode=ro"
    conn = sqlite3.connect(
        uri, uri=True, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
    )
    try:
        conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchall()
    except sqlite3.OperationalError:
        conn.close()
        if os.access(path.parent, os.W_OK):
            raise
        conn = sqlite3.connect(
            f"{uri}&immutable=1", uri=True, isolation_level=None, check_same_thread=False
        )
        try:
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchall()
        except BaseException:
            conn.close()
            raise
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA query_only = ON")
    return conn


def has_component(conn: sqlite3.Connection, component: str) -> int | None:
    """The schema version of `component` in this file, or None when it has none."""
    row = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_meta'"
    ).fetchone()
    if row is None:
        return None
    found = conn.execute(
        "SELECT version FROM schema_meta WHERE component = ?", (component,)
    ).fetchone()
    return None if found is None else int(found[0])


FILE_MODE_ENV = "ROLLOUT_LIFECYCLE_SQLITE_MODE"
DEFAULT_FILE_MODE = 0o600


def file_mode() -> int | None:
    """The permissions a new database file (and so its -wal and -shm, which SQLite gives
    the database file's) is created with: owner-only by default, since a SQLite file is one
    trust domain (whoever can write it is the operator). ROLLOUT_LIFECYCLE_SQLITE_MODE
    names another, in octal (e.g. 0640), or `umask` for SQLite's own (0644 less the
    process's umask); None then."""
    raw = os.environ.get(FILE_MODE_ENV, "").strip()
    if not raw:
        return DEFAULT_FILE_MODE
    if raw == "umask":
        return None
    try:
        mode = int(raw, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777 or not mode & 0o600 == 0o600:
        raise LedgerError(
            f"{FILE_MODE_ENV}={raw!r}: give permissions in octal that let the owner read and "
            "write (e.g. 0600, 0640), or 'umask' for SQLite's default"
        )
    return mode


def create_private(path: Path) -> None:
    """Create `path` empty with `file_mode()` if it does not exist yet, so SQLite (which
    gives a new file's -wal and -shm the database file's permissions) never makes any of
    the three readable by others; an existing file keeps its permissions."""
    mode = file_mode()
    if mode is None:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, mode)  # exactly this mode, whatever the umask
    finally:
        os.close(fd)


def connect(path: str | Path, *, read_only: bool = False) -> sqlite3.Connection:
    """Open a database in autocommit mode with WAL and a long busy timeout.

    Autocommit (isolation_level=None) keeps a single-statement compare-and-set atomic on its
    own; multi-statement steps use explicit BEGIN IMMEDIATE so the write lock is taken up
    front instead of failing with "database is locked" on upgrade. With `read_only`, see
    `connect_read_only`.
    """
    p = Path(path)
    if str(p) != ":memory:" and not p.parent.exists():
        raise LedgerError(f"directory {p.parent} does not exist; create it first")
    if read_only:
        return connect_read_only(p)
    if str(p) != ":memory:":
        guard_open(p)  # before SQLite reads a -wal that may be another file's
        create_private(p)
    with connecting():  # its locks are taken here (see sqlite_files.close_unlocked)
        conn = sqlite3.connect(
            str(p), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
        )
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(p) != ":memory:" and str(mode).lower() != "wal":
                raise LedgerError(f"could not switch {p} to WAL journal mode (got {mode!r})")
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("PRAGMA foreign_keys = ON")
        except BaseException:
            conn.close()  # a half-opened connection must not keep the file (or a mount) busy
            raise
    return conn


_ADD_COLUMN = re.compile(r"ALTER TABLE (\w+) ADD COLUMN (\w+) ", re.IGNORECASE)


def _migrate(conn: sqlite3.Connection, stmt: str) -> None:
    """One migration statement; an ADD COLUMN whose column the DDL already created (a file
    older than the table itself) is skipped, since SQLite has no ADD COLUMN IF NOT EXISTS."""
    m = _ADD_COLUMN.match(stmt)
    if m is not None:
        cols = {r[1] for r in conn.execute(f"PRAGMA table_info({m.group(1)})")}
        if m.group(2) in cols:
            return
    conn.execute(stmt)


def ensure_schema(
    conn: sqlite3.Connection,
    component: str,
    version: int,
    ddl: str,
    *,
    migrations: Mapping[int, str] | None = None,
) -> None:
    """Create `component`'s tables on first use, migrate an older schema, refuse a newer one.

    `migrations[v]` is the SQL that takes the component from schema v to v + 1 (run after
    the DDL, whose CREATE ... IF NOT EXISTS already adds new tables); a file written by a
    NEWER program is refused with a message that says to upgrade. A file without an id gets
    its random one here (see `sqlite_files.stamp_file_id`).
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        for stmt in (_META_DDL + _EVENTS_DDL + ddl).split(";"):
            if stmt.strip():
                conn.execute(stmt)
        _ensure_chain(conn)
        stamped = stamp_file_id(conn)
        row = conn.execute(
            "SELECT version FROM schema_meta WHERE component = ?", (component,)
        ).fetchone()
        recorded: list[TraceEvent] = []
        if row is None:
            conn.execute(
                "INSERT INTO schema_meta(component, version) VALUES (?, ?)", (component, version)
            )
            recorded.append(_schema_event(component, version, "created"))
        elif int(row[0]) != version:
            steps = schema_steps(
                "database", component, int(row[0]), version, migrations, "use a new file"
            )
            for script in steps:
                for stmt in script.split(";"):
                    if stmt.strip():
                        _migrate(conn, stmt.strip())
            conn.execute(
                "UPDATE schema_meta SET version = ? WHERE component = ?", (version, component)
            )
            recorded.append(_schema_event(component, version, f"migrated from {row[0]}"))
        sealing = seal_events(conn)
        append_events(conn, sealing or recorded, stamped=False)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    if stamped:
        # put the new id into the file itself now, so that every later use can compare the
        # header on disk with it (see sqlite_files.FileGuard); once per file
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)")


def _schema_event(component: str, version: int, why: str) -> RowRecorded:
    row = {"component": component, "version": version}
    return row_event("schema_meta", component, row, why, time.time())


def _tables(conn: sqlite3.Connection) -> set[str]:
    return {str(r[0]) for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def seal_events(conn: sqlite3.Connection) -> list[TraceEvent]:
    """Inside the caller's write transaction: if the file is not sealed yet (no SEAL row in
    schema_meta), write the SEAL row and return a RowRecorded of every row that the
    RECORDED_TABLES hold now (the SEAL row included), for the caller to append; else [].

    From then on every write of those tables records its row in the chain, so `ledger check`
    compares them with their history like every other table."""
    found = conn.execute("SELECT 1 FROM schema_meta WHERE component = ?", (SEAL[0],)).fetchone()
    if found is not None:
        return []
    conn.execute("INSERT INTO schema_meta(component, version) VALUES (?, ?)", SEAL)
    return recorded_rows(conn, _tables(conn), "recorded when the store was sealed")


def chain_required(conn: sqlite3.Connection) -> str | None:
    """Why this file must have a hash chain (None: it may predate the chain), read when its
    head is missing: a writer must then refuse rather than start a chain over the events."""
    if conn.execute("SELECT 1 FROM events WHERE hash IS NOT NULL LIMIT 1").fetchone():
        return "its events carry hashes"
    return chain_evidence(conn.execute, "instr(payload, ?)")


def _where(conn: sqlite3.Connection) -> tuple[str, str]:
    """(the file, its URL) of a connection, for an error message."""
    row = conn.execute("PRAGMA database_list").fetchone()
    path = str(row[2]) if row is not None and row[2] else "the SQLite database"
    return path, f"sqlite:///{path}"


def chain_state(conn: sqlite3.Connection) -> tuple[Any, ...]:
    """(head hash, newest event's hash, its seq, head's base seq): `chain_broken`'s input."""
    row = conn.execute(f"SELECT {NEXT_COLUMNS}").fetchone()
    return tuple(row[2:6])


def refuse_broken_chain(conn: sqlite3.Connection, state: Sequence[Any]) -> None:
    """HistoryTampered if `state` (see `chain_state`) is a chain no writer may chain onto."""
    why = chain_broken(*state)
    if why is not None:
        path, url = _where(conn)
        raise tampered(path, why, url)


def verify_recorded_row(
    conn: sqlite3.Connection, table: str, key: str, row: Mapping[str, Any]
) -> None:
    """HistoryTampered unless the newest RowRecorded of `table`'s row `key` records exactly
    `row` and still matches its own hash: what a writer checks before it acts on a recorded
    row (the host clock's origin). One lookup through the events' (kind, subject) index."""
    found = conn.execute(
        "SELECT seq, txn, kind, subject, payload, prev_hash, hash FROM events "
        "WHERE kind = 'row' AND subject = ? ORDER BY seq DESC LIMIT 1",
        (f"{table}/{key}",),
    ).fetchone()
    what = f"the {table} row {key!r}"
    if found is None:
        why = f"holds no event recording {what}: the row was inserted by hand"
    else:
        seq, txn, kind, subject, payload, prev, h = found
        try:
            ok = isinstance(prev, bytes) and chain_hash(prev, seq, txn, kind, subject, payload) == h
            recorded = json.loads(payload).get("row") if ok else None
        except (TypeError, ValueError, AttributeError, struct.error):
            ok, recorded = False, None
        if not ok:
            why = f"holds an edited event #{seq} recording {what}"
        elif recorded != dict(row):
            why = f"records {what} as {recorded!r}, but the table holds {dict(row)!r}: edited"
        else:
            return
    path, url = _where(conn)
    raise tampered(path, why, url)


def _ensure_chain(conn: sqlite3.Connection) -> None:
    """Give an events table written before the hash chain its two columns and a head, and
    an older file the events' current layout.

    Its events stay unchained (the audit reports them as an unchained prefix, and how many
    there were); the chain starts with the next event appended. A file that had a chain
    (see `chain_required`) and lost its head, or whose head no longer names its newest event,
    is refused (HistoryTampered): starting a chain over it would bless the edit.
    """
    cols = {str(r[1]) for r in conn.execute("PRAGMA table_info(events)")}
    for col in ("prev_hash", "hash"):
        if col not in cols:
            conn.execute(f"ALTER TABLE events ADD COLUMN {col} BLOB")
    conn.execute(_CHAIN_DDL)
    cols = {str(r[1]) for r in conn.execute("PRAGMA table_info(events_chain)")}
    for col in HEAD_COUNTERS:
        if col not in cols:  # the ledger's migration moves its counters table here
            conn.execute(f"ALTER TABLE events_chain ADD COLUMN {col} INTEGER NOT NULL DEFAULT 0")
    # no query looks events up by txn (see NEXT_COLUMNS): the index of files written before
    # is one more page written with every append, for nothing
    conn.execute("DROP INDEX IF EXISTS events_txn")
    # counted once, when the chain begins (not on every open: COUNT scans the table)
    if conn.execute("SELECT 1 FROM events_chain WHERE id = 1").fetchone() is None:
        if conn.execute("SELECT 1 FROM events LIMIT 1").fetchone() is not None:
            why = chain_required(conn)
            if why is not None:
                path, url = _where(conn)
                raise tampered(path, f"has no head although {why}", url)
        conn.execute(_CHAIN_START, (GENESIS,))
    _raise_last_seq(conn)
    refuse_broken_chain(conn, chain_state(conn))


def _raise_last_seq(conn: sqlite3.Connection) -> None:
    """A file whose events table numbers with AUTOINCREMENT (written before
    `NEXT_COLUMNS` read the last seq off the head) may have handed out seqs past the head's
    last_seq: events deleted before the chain began. The head takes AUTOINCREMENT's counter
    while the chain holds no event yet (from its first event on, the head is the highest seq
    ever handed out), so no seq is handed out twice; the audit reads no last_seq then."""
    if conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'sqlite_sequence'"
    ).fetchone():
        conn.execute(
            "UPDATE events_chain SET last_seq = s.seq FROM (SELECT seq FROM sqlite_sequence "
            "WHERE name = 'events') AS s WHERE id = 1 AND last_hash = ? AND last_seq < s.seq",
            (GENESIS,),
        )


def append_events(
    conn: sqlite3.Connection,
    events: Sequence[TraceEvent],
    payload_of: Payload = stored_payload,
    *,
    stamped: bool = True,
    head: Sequence[Any] | None = None,
    counts: Mapping[str, int] | None = None,
) -> list[TraceEvent]:
    """Append one atomic step's events inside the caller's open transaction (BEGIN
    IMMEDIATE), each chained by hash to its predecessor, and move the chain's head.

    txn, seq and the head are read under the caller's write lock, so they are unique and
    the chain has no forks. A head that is missing, or that does not name the newest stored
    event, refuses the write (HistoryTampered, see `model.events.chain_broken`): chaining on
    would bless an edited history. Returns the
    events with their seq and txn (none when not `stamped`: a caller that drops them need
    not pay for copies). `head`: the `NEXT_COLUMNS` the caller read in this same
    transaction (under the same write lock, after its last append), saving that statement.
    `counts`: the ledger's counters to add to (`HEAD_COUNTERS`), in the head's statement.
    """
    if not events:
        return []
    row = conn.execute(_NEXT).fetchone() if head is None else head
    refuse_broken_chain(conn, row[2:6])
    txn, last = int(row[0]), int(row[1])
    prev = row[2]
    rows = []
    out: list[TraceEvent] = []
    for i, ev in enumerate(events, 1):
        seq, subject, payload = last + i, event_subject(ev), payload_of(ev, txn)
        h = chain_hash(prev, seq, txn, ev.kind, subject, payload)
        rows.append((seq, txn, ev.kind, subject, payload, prev, h))
        if stamped:
            out.append(attrs.evolve(ev, seq=seq, txn=txn))
        prev = h
    if len(rows) == 1:
        conn.execute(_APPEND, rows[0])
    else:
        conn.executemany(_APPEND, rows)
    if counts:
        conn.execute(_head_sql(tuple(counts)), (last + len(events), prev, *counts.values()))
    else:
        conn.execute(_HEAD, (last + len(events), prev))
    return out


def read_events(
    conn: sqlite3.Connection,
    kind: str | None = None,
    subject: str | None = None,
    *,
    after_seq: int = 0,
    exclude_kind: str | None = None,
    states: EntryStates | None = None,
) -> list[TraceEvent]:
    """Events in global order, optionally of one kind and one subject (rollout id / version),
    and only those after `after_seq` (an incremental reader need not re-read the table).

    Entry events that store only what changed are rebuilt from their rollout's earlier
    events: those read here, those `states` holds (an incremental reader passes the same
    one each time), and for any other rollout its events up to `after_seq`, read in one
    more query."""
    where, args = events_where("?", after_seq, kind, exclude_kind, subject)
    sql = f"SELECT seq, payload FROM events WHERE {where} ORDER BY seq"
    rows = [(seq, json.loads(payload)) for seq, payload in conn.execute(sql, args)]
    known = EntryStates() if states is None else states
    if after_seq:
        known.catch_up(
            [data for _, data in rows],
            lambda ids: (
                p
                for (p,) in conn.execute(
                    "SELECT payload FROM events WHERE kind = 'entry' AND seq <= ? "
                    "AND subject IN (SELECT value FROM json_each(?)) ORDER BY seq",
                    (after_seq, json.dumps(ids)),
                )
            ),
        )
    out = []
    for seq, data in rows:
        data["seq"] = seq
        out.append(known.event(data))
    return out


def read_stored(conn: sqlite3.Connection) -> StoredRows:
    """Every table of the file, the events with their chain columns, and the chain's head,
    read inside the caller's read transaction (one WAL snapshot). Reads only: a file whose
    events have no hash columns reads as `chained=False` (and `head` None without its table)."""
    names = [
        str(r[0])
        for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite%' "
            "ORDER BY name"
        )
    ]
    cols = {str(r[1]) for r in conn.execute("PRAGMA table_info(events)")}
    # the hash columns are read wherever they exist, even when the head's table is gone
    chained = {"prev_hash", "hash"} <= cols
    events: list[StoredEvent] = []
    if "events" in names:
        links = "prev_hash, hash" if chained else "NULL, NULL"
        events = [
            StoredEvent(*r)
            for r in conn.execute(
                f"SELECT seq, txn, kind, subject, payload, {links} FROM events ORDER BY seq"
            )
        ]
    head = None
    if "events_chain" in names:
        found = conn.execute(
            "SELECT base_seq, base_count, last_seq, last_hash FROM events_chain WHERE id = 1"
        ).fetchone()
        head = None if found is None else ChainHead(*found)
    tables: dict[str, list[dict[str, Any]]] = {}
    if "ledger_counters" not in names and _stores_counters(conn, names):
        # not compared (they count calls), but listed as before they moved into the head
        row = conn.execute(f"SELECT {', '.join(HEAD_COUNTERS)} FROM events_chain").fetchone()
        tables["ledger_counters"] = [
            {"name": c, "n": n} for c, n in zip(HEAD_COUNTERS, row or (), strict=False) if n
        ]
    for name in names:
        if name in _NOT_STATE:
            continue
        quoted = '"' + name.replace('"', '""') + '"'
        cur = conn.execute(f"SELECT * FROM {quoted}")
        columns = [str(d[0]) for d in cur.description]
        tables[name] = [dict(zip(columns, r, strict=True)) for r in cur]
    return StoredRows(events=events, head=head, tables=tables, chained=chained)


def _stores_counters(conn: sqlite3.Connection, names: Sequence[str]) -> bool:
    """Whether the file holds a ledger whose counters are columns of the chain's head."""
    if "events_chain" not in names or "schema_meta" not in names:
        return False
    cols = {str(r[1]) for r in conn.execute("PRAGMA table_info(events_chain)")}
    return set(HEAD_COUNTERS) <= cols and has_component(conn, "ledger") is not None


def read_counters(conn: sqlite3.Connection) -> dict[str, int]:
    """The ledger's durable counters: the head's columns, or the table of a file of ledger
    schema 1 opened read-only (never migrated)."""
    found = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'ledger_counters'"
    ).fetchone()
    if found is not None:
        return {str(k): int(n) for k, n in conn.execute("SELECT name, n FROM ledger_counters")}
    row = conn.execute(f"SELECT {', '.join(HEAD_COUNTERS)} FROM events_chain").fetchone()
    return {} if row is None else dict(zip(HEAD_COUNTERS, row, strict=True))
