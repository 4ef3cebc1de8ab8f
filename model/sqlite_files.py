"""A SQLite file that stops being the database that was opened fails closed.

SQLite ties a database to its ``-wal`` and ``-shm`` by NAME only. What it does when someone
moves, deletes or overwrites the file of a running ledger (measured; see docs/sqlite.md):

- Replaced (``mv``, a copy moved in, a restored backup) or deleted: open connections keep
  using the old file, and its ``-wal`` and ``-shm`` stay beside the new one under the same
  names. A fresh open of the new file reads the old file's pages from that ``-wal`` and,
  when it closes, copies them INTO the new file. The old file's last connection, seeing
  its file moved, neither checkpoints nor removes them: the old file's last transactions
  stay in a ``-wal`` beside the wrong file for good.
- Overwritten in place (``cp other.db ledger.db``, truncate and write): same inode, other
  bytes, with the open connections' ``-wal`` pages laid over them.
- A ``-wal`` left by a killed process that had another database open under this name: a
  fresh open applies it to whatever the name holds now.

So every use checks that the name still names the opened file (its inode) with the opened
content (a random per-file id in the header's ``user_version``, a change counter that never
goes back). The first use that finds otherwise fails closed, and for a replaced or deleted
file first hands the ``-wal`` back: a TRUNCATE checkpoint through a connection that still
has the old file writes the old file's last transactions into the old file (wherever it now
is) and leaves an empty ``-wal``, so the new file opens correctly and nothing is lost. Every
ledger and registry of this process on that file is then closed. An open is refused while
the ``-wal``/``-shm`` beside the file still belong to another one (a process holds them but
not the file, or their pages carry another file's id).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import secrets
import sqlite3
import struct
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, NoReturn

from rollout_lifecycle.model.errors import LedgerError

FileId = tuple[int, int]

_HEADER = 100
_MAGIC = b"SQLite format 3\x00"
_WAL_MAGIC = (0x377F0682, 0x377F0683)  # the low bit says the checksum's byte order
# A user xattr on the -wal naming the file (device:inode) it was written for: SQLite links
# the two by name only, so after a crash this is the one way to tell whose it is
WAL_MARK = "user.rollout_lifecycle.db"


class FileReplaced(LedgerError):
    """The database file was deleted, replaced or overwritten while open, or the -wal beside
    it belongs to another file: every use fails closed and nothing is written."""


def file_identity(path: Path) -> FileId:
    """(device, inode) of the file now; identifies THIS file, not whatever the name holds."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def new_file_id() -> int:
    """A random id for a new database file, kept in its header (``PRAGMA user_version``)."""
    return 1 + secrets.randbelow(2**31 - 1)


class Header(NamedTuple):
    """The two fields of a database header that tell one file's content from another's."""

    counter: int  # the file change counter: never goes back in one file
    file_id: int  # PRAGMA user_version: a random id written when the file was created


def parse_header(data: bytes) -> Header | None:
    """The header fields, or None when `data` holds no database header (not yet written)."""
    if len(data) < _HEADER or not data.startswith(_MAGIC):
        return None
    counter, file_id = struct.unpack_from(">I", data, 24)[0], struct.unpack_from(">i", data, 60)[0]
    return Header(counter, file_id)


# ---- messages: what happened, and what to do ----------------------------------------------


class Finding(NamedTuple):
    """What happened to an open file: "deleted", "replaced" or "overwritten", and how."""

    kind: str
    detail: str = ""


def _lost_message(what: str, path: Path, f: Finding, where: str | None, folded: bool | None) -> str:
    """The whole truth about a lost file, and what to do; `folded` is None while unknown."""
    wal, shm = f"{path.name}-wal", f"{path.name}-shm"
    if f.kind == "overwritten":
        return (
            f"{what} {path} was overwritten in place while open ({f.detail}); nothing more is "
            f"read or written through this {what}, which is closed. Its content cannot be "
            f"trusted: the pages of the old database still in {wal} lie over it, and SQLite "
            "writes them into it when the last connection closes. Stop every program using "
            "it, then restore the file you want from a backup (by itself, without any "
            "-wal/-shm) before opening it again"
        )
    head = f"{what} {path} was {f.kind} while open; nothing was written and this {what} is closed"
    old = "the deleted file" if f.kind == "deleted" else "the old file"
    at = f" ({where})" if where is not None and where != "with no name" else ""
    if folded is None:
        return f"{head}. Its {wal} and {shm} belong to {old}{at}"
    if folded and f.kind == "deleted":
        return (
            f"{head}. Its {wal} was written into the deleted file and is empty now, so a new "
            f"file can be created at {path} once every program that still has the deleted "
            "file open lets go (until then that is refused)"
        )
    if folded:
        return (
            f"{head}. The old file's last transactions, still in {wal}, were written into the "
            f"old file{at}, so nothing is lost, and {wal} is empty: {path} opens as the new "
            "file once every program that still has the old file open lets go (until then "
            "opening it is refused)"
        )
    move = (
        f"move {wal} to {where[3:]}-wal and remove {shm}"
        if where is not None and where.startswith("at ") and f.kind == "replaced"
        else f"move {wal} and {shm} aside (keep them)"
    )
    return (
        f"{head}. {wal} still holds {old}'s last transactions (writing them back failed: "
        f"another connection was using it), and they must not be applied to {path}: SQLite "
        f"would show {old}'s pages and copy them into the new file (opening is refused while "
        f"that can be told). Close every program that has {old}{at} open (a "
        "rollout-lifecycle ledger or registry there writes them back when it notices), or "
        f"{move}, then open {path} again"
    )


def _where(fd: int | None) -> str | None:
    """Where the file open on `fd` is now ("at PATH" or "with no name"), where Linux says."""
    if fd is None:
        return None
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    if target.endswith(" (deleted)"):
        return "with no name"
    return f"at {target}"


# ---- this process's open files -----------------------------------------------------------


class _OpenFile:
    """This process's view of one database file (inode): the guards on it and a descriptor
    to read its header.

    Closing ANY descriptor of a file drops every POSIX lock the process holds on it,
    SQLite's included (those of connections this module knows nothing of, too). So the
    descriptor is closed only once /proc/locks shows no lock of this process on the file
    (`_close_when_unlocked`), and where that cannot be seen there is none: the header
    check is then left out.
    """

    def __init__(self, key: FileId, fd: int | None, file_id: int) -> None:
        self.key = key
        self.fd = fd
        self.pid = os.getpid()
        self.guards: weakref.WeakSet[FileGuard] = weakref.WeakSet()
        self.file_id = file_id
        self.max_counter = 0
        self.seen = False  # the file's own header was read from disk at least once
        self.last = b""  # the header as last judged good: most looks find it unchanged
        self.lock = threading.Lock()

    def verify(self) -> str | None:
        """Why the bytes on disk are not this file's content any more, or None."""
        if self.fd is None:
            return None
        try:
            data = os.pread(self.fd, _HEADER, 0)
        except OSError as exc:
            return f"its header cannot be read ({exc})"
        if data == self.last:
            return None
        with self.lock:
            # read again under the lock: a header read before another thread judged a newer
            # one would otherwise look like the counter went back (and close the file under
            # every thread using it)
            try:
                data = os.pread(self.fd, _HEADER, 0)
            except OSError as exc:
                return f"its header cannot be read ({exc})"
            h = parse_header(data)
            if h is None:
                # before the first checkpoint a new file has no header on disk yet
                return "its database header is gone" if self.seen else None
            if h.file_id != self.file_id:
                if self.file_id == 0:
                    self.file_id = h.file_id  # a file from before ids got its id meanwhile
                elif h.file_id == 0 and not self.seen:
                    return None  # its id is written but not yet checkpointed
                else:
                    return f"it now holds the file with id {h.file_id:#x}, not {self.file_id:#x}"
            if h.counter < self.max_counter:
                return (
                    f"its change counter went back from {self.max_counter} to {h.counter}: "
                    "an older copy"
                )
            self.max_counter, self.seen, self.last = h.counter, True, data
            return None


_FILES: dict[FileId, _OpenFile] = {}
# re-entrant: a guard's finalizer (_forget) may run inside a section that holds it
_FILES_LOCK = threading.RLock()
# Held while this package opens a connection (which takes its lasting locks right then) and
# while a descriptor is judged free and closed, so no lock can be taken in between
_GATE = threading.RLock()


def _reset_after_fork() -> None:
    global _FILES_LOCK, _GATE
    _FILES_LOCK = threading.RLock()
    _GATE = threading.RLock()
    for f in _FILES.values():
        f.lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


LostHandler = Callable[[bool], bool]


class FileGuard:
    """What a ledger or registry checks before each use of its file.

    `check` raises FileReplaced once the name stops naming the opened file or its content
    changed under it. The first finding fails every ledger and registry of this process on
    that file: each owner's `on_lost(hand_back)` closes its connections, the first one
    asked to hand back first folding a replaced or deleted file's -wal into it (it returns
    whether that worked). The owner is held weakly: one dropped without `close` still
    closes its connections as soon as it is collected.
    """

    def __init__(
        self, path: Path, what: str, file_id: int, on_lost: LostHandler, *, writer: bool
    ) -> None:
        self.path = Path(path)
        self._str_path = os.fspath(self.path)
        self.name = os.path.realpath(self.path)
        self.what = what
        self._on_lost: Callable[[], LostHandler | None] = (
            weakref.WeakMethod(on_lost) if inspect.ismethod(on_lost) else (lambda: on_lost)
        )
        self.lost: str | None = None
        self.released = False
        key = file_identity(self.path)
        with _FILES_LOCK:
            entry = _FILES.get(key)
            if entry is None:
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC) if _SEE_LOCKS else None
                if fd is not None:
                    st = os.fstat(fd)
                    if (st.st_dev, st.st_ino) != key:  # the name changed between two looks
                        _DEFERRED.append(((st.st_dev, st.st_ino), fd))
                        raise FileReplaced(
                            _lost_message(what, self.path, Finding("replaced"), None, None)
                        )
                entry = _FILES[key] = _OpenFile(key, fd, file_id)
            elif entry.file_id == 0:
                entry.file_id = file_id
            entry.guards.add(self)
        self.key = key
        self._file = entry
        self._finalizer = weakref.finalize(self, _forget, key, entry)
        self.writer = writer
        problem = entry.verify()
        if problem is not None:
            self._lose(Finding("overwritten", problem))
        self.opened()

    def opened(self) -> None:
        """The owner opened a connection (so the -wal exists): a writer marks it as this
        file's, so that a -wal left by a crash can be told from another file's."""
        if self.writer:
            mark_wal(self.path, self.key)

    def on_lost(self, hand_back: bool) -> bool:
        """Let the owner (if it still exists) hand back and close; True if it handed back."""
        fn = self._on_lost()
        return fn is not None and fn(hand_back)

    def check(self) -> None:
        """Raise FileReplaced unless the path still names the opened file, unchanged."""
        if self.lost is not None:
            raise FileReplaced(self.lost)
        if self.released:
            return  # the owner was closed: its own "closed" error is the true one
        try:
            st = os.stat(self._str_path)  # a str: no Path conversion on every use
            now = st.st_dev, st.st_ino
        except FileNotFoundError:
            self._lose(Finding("deleted"))
        except OSError as exc:
            raise FileReplaced(
                f"{self.what} {self.path} cannot be checked ({exc}); nothing was written"
            ) from None
        if now != self.key:
            self._lose(Finding("replaced"))
        problem = self._file.verify()
        if problem is not None:
            self._lose(Finding("overwritten", problem))

    def _lose(self, finding: Finding) -> NoReturn:
        """Fail this guard and every other guard of this process on the same file."""
        lose_file(self.key, self.path, finding)
        if self.lost is None:  # released meanwhile: not among the file's guards any more
            self.lost = _lost_message(self.what, self.path, finding, None, None)
        raise FileReplaced(self.lost)

    def release(self) -> None:
        """The owner closed its connections: forget it (closing the descriptor if last)."""
        self.released = True
        with _FILES_LOCK:
            self._file.guards.discard(self)
        self._finalizer()


def _forget(key: FileId, entry: _OpenFile) -> None:
    """A guard is gone: once no guard of this process uses the file, let its descriptor go."""
    with _FILES_LOCK:
        alive = any(True for _ in entry.guards)  # iterating skips guards being collected
        if _FILES.get(key) is not entry or alive or entry.pid != os.getpid():
            return  # others still use it, or a forked child, which never closes (see _OpenFile)
        del _FILES[key]
        if entry.fd is not None:
            _DEFERRED.append((key, entry.fd))
    close_unlocked()


# descriptors to close once no POSIX lock of this process is on their file (see _OpenFile)
_DEFERRED: list[tuple[FileId, int]] = []
_SEE_LOCKS = os.path.exists("/proc/locks")


def connecting() -> threading.RLock:
    """Hold this around opening a connection and its first statements (see close_unlocked)."""
    return _GATE


def _lock_id(key: FileId) -> str:
    """A file as /proc/locks names it: major:minor:inode."""
    return f"{os.major(key[0]):02x}:{os.minor(key[0]):02x}:{key[1]}"


def close_unlocked() -> None:
    """Close the descriptors this module let go of whose files hold no lock of this process."""
    with _FILES_LOCK:
        if not _DEFERRED:
            return
    with _GATE:
        table = _read_proc_locks()
        if table is None:
            return
        me = str(os.getpid())
        locked = {f[5] for f in table if len(f) >= 8 and f[1] != "->" and f[4] == me}
        with _FILES_LOCK:
            free = [(k, fd) for k, fd in _DEFERRED if _lock_id(k) not in locked]
            _DEFERRED[:] = [d for d in _DEFERRED if d not in free]
        for _, fd in free:
            with contextlib.suppress(OSError):
                os.close(fd)


def lose_file(key: FileId, path: Path, finding: Finding) -> None:
    """Fail every guard of this process on `key`: mark them lost, hand a replaced or deleted
    file's -wal back to it through the first owner that can, then close them all (outside
    any lock of ours: an owner's close may wait for its own lock)."""
    with _FILES_LOCK:
        entry = _FILES.get(key)
        guards = [] if entry is None else list(entry.guards)
    if entry is None:
        return
    where = None if finding.kind == "overwritten" else _where(entry.fd)
    fresh = [g for g in guards if g.lost is None]
    for g in fresh:  # first, so no other thread starts anything on the file meanwhile
        g.lost = _lost_message(g.what, path, finding, where, None)
    folded = False
    for g in guards:
        with contextlib.suppress(Exception):  # closing must not hide the finding
            folded = g.on_lost(finding.kind != "overwritten" and not folded) or folded
    for g in fresh:
        g.lost = _lost_message(g.what, path, finding, where, folded)


def hand_back(conn: sqlite3.Connection, *, own: bool) -> bool:
    """Write a moved or deleted file's -wal into that file and empty the -wal.

    Runs on a connection that still has the old file: SQLite's own last close would leave
    the -wal (the file moved), beside a file it does not belong to. `own`: the caller's
    own connection, whose open transaction it may roll back; another thread's connection
    in a transaction is never touched (its statements would go on outside it). False
    when it could not (that, another connection reading the old file, an unusable one).
    """
    try:
        if conn.in_transaction:
            if not own:
                return False
            conn.execute("ROLLBACK")
        conn.execute("PRAGMA busy_timeout = 2000")  # a reader of the old file may be finishing
        busy = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
    except sqlite3.Error:
        return False
    return int(busy) == 0


# ---- refusing an open whose -wal belongs to another file ------------------------------------


def _lock_key(path: Path) -> str | None:
    try:
        return _lock_id(file_identity(path))
    except OSError:
        return None


def _read_proc_locks() -> list[list[str]] | None:
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            return [line.split() for line in f]
    except OSError:
        return None  # not Linux: who holds a file cannot be told


def lock_holders(path: Path, table: list[list[str]]) -> set[int]:
    """Process ids holding a POSIX lock on `path` (granted, not waiting), from /proc/locks."""
    key = _lock_key(path)
    if key is None:
        return set()
    out = set()
    for fields in table:
        # "1: POSIX  ADVISORY  READ 9027 fe:00:2154490 128 128"; "->" marks a waiter
        if len(fields) >= 8 and fields[1] != "->" and fields[5] == key:
            with contextlib.suppress(ValueError):
                out.add(int(fields[4]))
    return out


def _checksum(data: bytes, order: str, s0: int, s1: int) -> tuple[int, int]:
    words = struct.unpack(f"{order}{len(data) // 4}I", data)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & 0xFFFFFFFF
        s1 = (s1 + words[i + 1] + s0) & 0xFFFFFFFF
    return s0, s1


def wal_page_one(wal: Path) -> list[Header | None] | None:
    """The database headers (page 1) in the committed frames of a -wal, oldest first.

    None when it holds no committed frame (SQLite then ignores it). Frames are taken as
    SQLite's recovery takes them: salts equal to the header's and the running checksum
    valid, up to the last commit frame.
    """
    try:
        f = open(wal, "rb")  # noqa: SIM115  # SQLite holds no lock on a -wal
    except FileNotFoundError:
        return None
    with f:
        head = f.read(32)
        if len(head) < 32:
            return None
        magic, _v, page, _ckpt, salt1, salt2, c1, c2 = struct.unpack(">8I", head)
        if magic not in _WAL_MAGIC or not 512 <= page <= 65536 or page & (page - 1):
            return None
        order = ">" if magic & 1 else "<"
        s = _checksum(head[:24], order, 0, 0)
        if s != (c1, c2):
            return None
        committed: list[Header | None] = []
        pending: list[Header | None] = []
        any_commit = False
        while True:
            frame = f.read(24 + page)
            if len(frame) < 24 + page:
                break
            pgno, commit, f1, f2, k1, k2 = struct.unpack_from(">6I", frame)
            if (f1, f2) != (salt1, salt2):
                break
            s = _checksum(frame[:8], order, *s)
            s = _checksum(frame[24:], order, *s)
            if s != (k1, k2):
                break
            if pgno == 1:
                pending.append(parse_header(frame[24 : 24 + _HEADER]))
            if commit:
                committed.extend(pending)
                pending = []
                any_commit = True
    return committed if any_commit else None


def _raw_header(path: Path, key: FileId) -> Header | None:
    """The header on disk, read without dropping a lock of this process (see _OpenFile)."""
    with _FILES_LOCK:
        entry = _FILES.get(key)
        if entry is not None and entry.fd is not None:
            return parse_header(os.pread(entry.fd, _HEADER, 0))
    with _GATE:
        table = _read_proc_locks()
        if table is None or os.getpid() in lock_holders(path, table):
            return None  # reading would close a descriptor of a file we lock: no evidence
        try:
            with open(path, "rb") as f:
                return parse_header(f.read(_HEADER))
        except FileNotFoundError:
            return None


def _mark(key: FileId) -> bytes:
    return f"{key[0]}:{key[1]}".encode()


def mark_wal(path: Path, key: FileId) -> None:
    """Note on `path`'s -wal which file it belongs to (see WAL_MARK); a writer does this
    whenever it opens a connection. Where the file system keeps no user xattrs, nothing."""
    wal = f"{path}-wal"
    with contextlib.suppress(OSError):
        if os.getxattr(wal, WAL_MARK) == _mark(key):
            return
    with contextlib.suppress(OSError):
        os.setxattr(wal, WAL_MARK, _mark(key))


def _leftover_wal(path: Path, wal: Path, key: FileId | None) -> str | None:
    """Why a -wal nobody holds is not this file's, or None when it may be (or is empty)."""
    frames = wal_page_one(wal)
    if frames is None:
        return None
    if key is None:
        return "the database it belongs to was deleted"
    try:
        mark: bytes | None = os.getxattr(wal, WAL_MARK)
    except OSError:
        mark = None
    if mark is not None and mark != _mark(key):
        return (
            f"it was written for the file with inode {mark.decode(errors='replace')}, and "
            f"{path.name} is {_mark(key).decode()}"
        )
    h = _raw_header(path, key)
    ones = [f for f in frames if f is not None]
    if h is None or not ones:
        return None  # never checkpointed, or no page 1 among its pages: nothing to compare
    if h.file_id != 0 and ones[-1].file_id != h.file_id:
        return f"its pages are of the file with id {ones[-1].file_id:#x}, not {h.file_id:#x}"
    if not ones[0].counter - 1 <= h.counter <= ones[-1].counter:
        return (
            f"its pages continue a file at change counter {ones[0].counter - 1}, "
            f"the file is at {h.counter}: another copy"
        )
    return None


# how often, and how far apart, `guard_open` reads /proc/locks again before it believes a
# process holds a file's -shm without the file (see `_lasting_holders`)
_RECHECKS, _RECHECK_S = 5, 0.02


def _lasting_holders(path: Path, shm: Path, table: list[list[str]]) -> set[int]:
    """The processes that hold `shm` but not `path` in `table` and still do at each of a few
    later reads of /proc/locks (`table` is refreshed in place): a connection that is
    opening or closing the file holds the -shm without the file for an instant (SQLite
    takes and drops the two in turn; eight processes opening one new file at once caught
    one there), while a process that still has an old file open under this name holds
    that -shm for as long as it has it open."""
    others = lock_holders(shm, table) - lock_holders(path, table)
    for _ in range(_RECHECKS if others else 0):
        time.sleep(_RECHECK_S)
        table[:] = _read_proc_locks() or []
        others &= lock_holders(shm, table) - lock_holders(path, table)
        if not others:
            break
    return others


def guard_open(path: Path) -> None:
    """Before SQLite opens `path`: refuse when the -wal/-shm beside it are not its own.

    This process's ledgers and registries still on a file the name no longer names are
    failed first (closing them hands the old -wal back to the old file). Then, on Linux
    (/proc/locks), a process holding the -shm but not the file, or a -wal nobody holds whose
    pages are another file's, means SQLite would show that file's pages here: refused.
    """
    name = os.path.realpath(path)
    try:
        key: FileId | None = file_identity(path)
    except OSError:
        key = None
    with _FILES_LOCK:
        stale = {
            k
            for k, entry in list(_FILES.items())
            if k != key and any(g.name == name and g.lost is None for g in entry.guards)
        }
    for k in stale:
        lose_file(k, path, Finding("replaced" if key is not None else "deleted"))
    close_unlocked()  # their descriptors, now that their connections are closed
    shm, wal = Path(f"{path}-shm"), Path(f"{path}-wal")
    if not shm.exists() and not wal.exists():
        return
    table = _read_proc_locks()
    if table is None:
        return
    others = _lasting_holders(path, shm, table)
    if others:
        who = ", ".join(str(p) for p in sorted(others))
        mine = (
            " (this process: close its other connections to the old file)"
            if (os.getpid() in others)
            else ""
        )
        gone = "was deleted" if key is None else "was replaced"
        raise FileReplaced(
            f"{path} {gone} while process {who}{mine} still has the old file open; the "
            f"{path.name}-wal and {path.name}-shm beside it belong to that old file, and "
            "opening now would show the old file's pages (and, on close, copy them into the "
            "new one). Nothing was opened. Stop those programs (a rollout-lifecycle ledger "
            "or registry in them fails closed at its next call and lets go), then open it again"
        )
    if lock_holders(shm, table) or not wal.exists():
        return
    why = _leftover_wal(path, wal, key)
    if why is not None:
        raise FileReplaced(
            f"{path.name}-wal beside {path} is not that file's ({why}): a program that had "
            "another database open under this name was stopped before it closed it, and "
            f"SQLite would apply that database's pages to {path}. Nothing was opened. If "
            f"{path} is the file you want, move {path.name}-wal and {path.name}-shm aside "
            "(keep them: they hold the other database's last transactions), then open it "
            f"again. If instead {path} and its -wal were moved or copied here together, as "
            f"a pair, remove the mark and open it again: setfattr -x {WAL_MARK} {wal}"
        )


def stamp_file_id(conn: sqlite3.Connection) -> bool:
    """Give the file its random id (inside the caller's write transaction) if it has none."""
    if int(conn.execute("PRAGMA user_version").fetchone()[0]) != 0:
        return False
    conn.execute(f"PRAGMA user_version = {new_file_id()}")
    return True


def read_file_id(conn: sqlite3.Connection) -> int:
    """The file's id as SQLite sees it (0 for a file from before ids)."""
    return int(conn.execute("PRAGMA user_version").fetchone()[0])
