"""What the SQLite ledger and the SQLite registry share: connections, schema versions, events.

Both live in one database file so that their events share one global order (the `events`
table's autoincrement `seq`), which the spec's trace replay needs to judge, for example,
that a reservation was admitted against the version active at that moment.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from rollout_lifecycle.model.errors import LedgerError
from rollout_lifecycle.model.events import (
    ArtifactChanged,
    EntryChanged,
    TraceEvent,
    WorkerReported,
    event_from_jsonable,
    event_to_jsonable,
)

BUSY_TIMEOUT_MS = 30_000  # well above the 5 s default: 8 threads and 4 processes contend

_EVENTS_DDL = """
CREATE TABLE IF NOT EXISTS events (
    seq     INTEGER PRIMARY KEY AUTOINCREMENT,
    txn     INTEGER NOT NULL,
    kind    TEXT NOT NULL,
    subject TEXT NOT NULL,
    payload TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_subject ON events(kind, subject);
CREATE INDEX IF NOT EXISTS events_txn ON events(txn);
"""

_META_DDL = """
CREATE TABLE IF NOT EXISTS schema_meta (
    component TEXT PRIMARY KEY,
    version   INTEGER NOT NULL
);
"""


class FileReplaced(LedgerError):
    """The database file was deleted or replaced while open: every use fails closed."""


def file_identity(path: Path) -> tuple[int, int]:
    """(device, inode) of the file now; identifies THIS file, not whatever the name holds."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def check_identity(path: Path, identity: tuple[int, int], what: str) -> None:
    """Refuse to go on when `path` no longer names the file that was opened.

    SQLite keeps writing into an unlinked file, and a file restored under the same name
    is a different database: two learners could then each consume one rollout, one in the
    old file and one in the new. Both cases fail closed here.
    """
    try:
        now = file_identity(path)
    except FileNotFoundError:
        raise FileReplaced(
            f"{what} {path} was deleted while open; nothing was written. Reopen it (or restore "
            "it and reopen) to go on"
        ) from None
    except OSError as exc:
        raise FileReplaced(
            f"{what} {path} cannot be checked ({exc}); nothing was written"
        ) from None
    if now != identity:
        raise FileReplaced(
            f"{what} {path} was replaced by another file while open; nothing was written. "
            "Reopen it to use the new file"
        )


def connect_read_only(path: Path) -> sqlite3.Connection:
    """Open an existing database so that nothing can be written through the connection.

    `mode=ro` never creates tables or files of its own content; on read-only storage where
    SQLite cannot create the WAL index (-shm) either, the file is opened `immutable`, which
    is exact because nothing can change it there.
    """
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
    NEWER program is refused with a message that says to upgrade.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        for stmt in (_META_DDL + _EVENTS_DDL + ddl).split(";"):
            if stmt.strip():
                conn.execute(stmt)
        row = conn.execute(
            "SELECT version FROM schema_meta WHERE component = ?", (component,)
        ).fetchone()
        if row is None:
            conn.execute(
                "INSERT INTO schema_meta(component, version) VALUES (?, ?)", (component, version)
            )
        elif int(row[0]) > version:
            raise LedgerError(
                f"database has {component} schema version {row[0]}, this program expects "
                f"{version}: the file was written by a newer rollout-lifecycle; upgrade to read it"
            )
        elif int(row[0]) < version:
            stored = int(row[0])
            steps = migrations or {}
            if any(v not in steps for v in range(stored, version)):
                raise LedgerError(
                    f"database has {component} schema version {stored}, this program expects "
                    f"{version} and cannot migrate it; use a new file"
                )
            for v in range(stored, version):
                for stmt in steps[v].split(";"):
                    if stmt.strip():
                        conn.execute(stmt)
            conn.execute(
                "UPDATE schema_meta SET version = ? WHERE component = ?", (version, component)
            )
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def event_subject(ev: TraceEvent) -> str:
    """The indexed subject of an event: rollout id, artifact version, worker id, or 'membership'."""
    if isinstance(ev, EntryChanged):
        return ev.rollout_id
    if isinstance(ev, ArtifactChanged):
        return str(ev.version)
    if isinstance(ev, WorkerReported):
        return ev.worker_id
    return "membership"


def append_events(conn: sqlite3.Connection, events: Sequence[TraceEvent]) -> list[TraceEvent]:
    """Append one atomic step's events inside the caller's open transaction.

    The txn number is max(txn) + 1, read under the caller's write lock, so it is unique.
    """
    if not events:
        return []
    row = conn.execute("SELECT COALESCE(MAX(txn), 0) + 1 FROM events").fetchone()
    txn = int(row[0])
    out: list[TraceEvent] = []
    for ev in events:
        subject = event_subject(ev)
        payload = event_to_jsonable(ev)
        payload.pop("seq", None)
        payload["txn"] = txn
        cur = conn.execute(
            "INSERT INTO events(txn, kind, subject, payload) VALUES (?, ?, ?, ?)",
            (txn, ev.kind, subject, json.dumps(payload, separators=(",", ":"))),
        )
        out.append(attrs.evolve(ev, seq=int(cur.lastrowid or 0), txn=txn))
    return out


def read_events(
    conn: sqlite3.Connection,
    kind: str | None = None,
    subject: str | None = None,
    *,
    after_seq: int = 0,
    exclude_kind: str | None = None,
) -> list[TraceEvent]:
    """Events in global order, optionally of one kind and one subject (rollout id / version),
    and only those after `after_seq` (an incremental reader need not re-read the table)."""
    sql = "SELECT seq, payload FROM events"
    args: list[str | int] = []
    where = []
    if after_seq:
        where.append("seq > ?")
        args.append(after_seq)
    if kind is not None:
        where.append("kind = ?")
        args.append(kind)
    if exclude_kind is not None:
        where.append("kind != ?")
        args.append(exclude_kind)
    if subject is not None:
        where.append("subject = ?")
        args.append(subject)
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY seq"
    out = []
    for seq, payload in conn.execute(sql, args):
        data = json.loads(payload)
        data["seq"] = seq
        out.append(event_from_jsonable(data))
    return out
