"""One SQLite file's connections for the ledger: one per thread, guarded against the file
being replaced, with the write and read transactions every ledger step runs in.

Kept apart from the ledger's store so that the store holds only what the ledger stores.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

from rollout_lifecycle.model.errors import LedgerError, newer_schema
from rollout_lifecycle.model.lineage_index import ensure_sqlite
from rollout_lifecycle.model.sqlite_common import (
    FileReplaced,
    connect,
    create_private,
    ensure_schema,
    has_component,
    write_failed,
)
from rollout_lifecycle.model.sqlite_files import FileGuard, hand_back, read_file_id

T = TypeVar("T")


class _Handle:
    """One thread's connection. The thread-local drops it when its thread ends, and then it
    closes the connection, so short-lived threads do not leak open files."""

    __slots__ = ("__weakref__", "conn", "pid", "turn")

    def __init__(self, conn: sqlite3.Connection, turn: int | None) -> None:
        self.conn = conn
        self.pid = os.getpid()
        self.turn = turn  # this connection's descriptor of the writers' queue file

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.conn.close()
        if self.turn is not None:
            with contextlib.suppress(OSError):
                os.close(self.turn)
            self.turn = None

    def __del__(self) -> None:
        # a forked child must not close what it inherited: SQLite's POSIX locks are per
        # process and file, so closing it there can silently drop the child's own locks
        if self.pid == os.getpid():
            self.close()


class Connections:
    """Each thread uses its own connection, so no Python lock serialises readers; SQLite's
    write lock plus the revision compare-and-set are what make writes exclusive."""

    def __init__(
        self,
        path: Path,
        *,
        read_only: bool,
        component: str,
        version: int,
        ddl: str,
        migrations: Mapping[int, str] | None = None,
    ) -> None:
        self.path = path
        self.read_only = read_only
        self.local = threading.local()
        self._handles: weakref.WeakSet[_Handle] = weakref.WeakSet()
        self._inherited: list[_Handle] = []
        self.lock = threading.Lock()
        self._closed = False
        # where a benchmark asks for it (cli/bench_fleet.py), each write's wait for the
        # file's write lock (BEGIN IMMEDIATE), in seconds; None: nothing is recorded
        self.lock_waits: list[float] | None = None
        # fails every use closed once the path stops naming this file (sqlite_files)
        self._guard: FileGuard | None = None
        try:
            if read_only:
                self._check_readable(self.conn(), component, version)
            else:
                ensure_schema(self.conn(), component, version, ddl, migrations=migrations)
                # the lineage index, linked here when the registry's tables came first
                ensure_sqlite(self.conn(), registry=False)
            self._guard = FileGuard(
                self.path, "ledger", read_file_id(self.conn()), self._lost, writer=not read_only
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

    def conn(self) -> sqlite3.Connection:
        """This thread's connection; a forked child opens its own (SQLite forbids sharing)."""
        if self._guard is not None and self._guard.lost is not None:
            raise FileReplaced(self._guard.lost)
        if self._closed:
            raise LedgerError(f"ledger {self.path} is closed; open a new SQLiteLedger")
        handle: _Handle | None = getattr(self.local, "handle", None)
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
        with self.lock:
            if self._closed:
                conn.close()
                raise LedgerError(f"ledger {self.path} is closed; open a new SQLiteLedger")
            handle = _Handle(conn, None if self.read_only else open_turn(self.path))
            self._handles.add(handle)
        self.local.handle = handle
        if self._guard is not None:
            self._guard.opened()  # the -wal may be a new one: mark it as this file's
        return conn

    def write(self, body: Callable[[sqlite3.Connection], T]) -> T:
        """`body` in one BEGIN IMMEDIATE ... COMMIT; any exception rolls everything back.
        (A plain call rather than a context manager: every write of the ledger runs it.)"""
        if self.read_only:
            raise LedgerError(f"ledger {self.path} was opened read-only; nothing was written")
        conn = self.conn()
        turn: int | None = self.local.handle.turn
        waits = self.lock_waits
        t0 = time.perf_counter() if waits is not None else 0.0
        if turn is not None:
            try:
                fcntl.flock(turn, fcntl.LOCK_EX)
            except OSError:
                turn = None  # no queue here (a file system without flock): SQLite's alone
        try:
            if conn.in_transaction:
                # only a failed ROLLBACK can leave one open; never build on its leftovers
                conn.execute("ROLLBACK")
            conn.execute("BEGIN IMMEDIATE")
            if waits is not None:
                waits.append(time.perf_counter() - t0)
        except sqlite3.Error as exc:
            leave_turn(turn)
            raise LedgerError(f"{self.path}: cannot start a write ({exc})") from exc
        try:
            self.check_file()
            out = body(conn)
            conn.execute("COMMIT")
        except BaseException as exc:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise write_failed(str(self.path), exc) from exc
            raise
        finally:
            leave_turn(turn)
        return out

    @contextlib.contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """A read transaction: every SELECT inside sees one consistent snapshot (WAL)."""
        self.check_file()  # before: a finding closes the connection a snapshot would use
        conn = self.conn()
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

    def _check_readable(self, conn: sqlite3.Connection, component: str, version: int) -> None:
        """A read-only open needs an existing ledger of a schema this program knows."""
        stored = has_component(conn, component)
        if stored is None:
            raise LedgerError(f"{self.path} holds no rollout-lifecycle ledger")
        if stored > version:
            raise LedgerError(newer_schema(str(self.path), component, stored, version))

    def _lost(self, give_back: bool) -> bool:
        """The file is gone (see sqlite_files.lose_file): if asked, fold its -wal back into
        it through this thread's connection or an idle one, then close; True if folded."""
        folded = False
        if give_back:
            mine: _Handle | None = getattr(self.local, "handle", None)
            with self.lock:
                idle = [h for h in self._handles if h is not mine and h.pid == os.getpid()]
            if mine is not None and mine.pid == os.getpid():
                folded = hand_back(mine.conn, own=True)
            for h in idle:
                folded = folded or hand_back(h.conn, own=False)
        self.close()
        return folded

    def check_file(self) -> None:
        """Fail closed when the file was deleted, replaced or overwritten under this open
        ledger; the first finding closes it (and this process's registries on the file)."""
        if self._guard is not None:
            self._guard.check()

    def close(self) -> None:
        """Close every thread's connection; later use raises LedgerError. Idempotent."""
        with self.lock:
            self._closed = True
            handles = [h for h in self._handles if h.pid == os.getpid()]
            self._handles = weakref.WeakSet()
        for h in handles:
            h.close()
        if self._guard is not None:
            self._guard.release()  # after the connections: see sqlite_files._OpenFile


def open_turn(path: Path) -> int | None:
    """A descriptor of the writers' queue beside the database (`<file>-writers`), or None
    where it cannot be made (a read-only folder: SQLite's own lock alone then).

    SQLite's busy handler polls: a waiting writer sleeps up to 100 ms between tries, and a
    writer in a tight loop re-takes the lock in between, so under contention the others
    wait for seconds. Writers that block on an flock of this file first are woken the
    moment it is released, so the lock passes between them (SQLite's lock still decides
    who writes; the queue only orders who asks). It is created with the database's mode
    (`file_mode`: owner-only unless ROLLOUT_LIFECYCLE_SQLITE_MODE says otherwise)."""
    sidecar = Path(f"{path}-writers")
    try:
        create_private(sidecar)
        return os.open(sidecar, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        return None


def leave_turn(turn: int | None) -> None:
    if turn is not None:
        with contextlib.suppress(OSError):
            fcntl.flock(turn, fcntl.LOCK_UN)
