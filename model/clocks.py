"""One clock per deployment: lease deadlines never come from each client's wall clock.

A lease is the one time-based safety decision: a learner whose clock runs 700 s behind
computes a 600 s deadline that is already past, and a janitor whose clock runs ahead
expires every live lease at once. So the clock is the deployment's, not the caller's:

- PostgreSQL: the database server's clock, read inside the writing transaction
  (`clock_timestamp()`, see model.postgres_ledger).
- SQLite (one host): the host kernel's clock, read from /proc rather than through the
  process's C library, so a per-process time shift (libfaketime, a container with another
  time namespace offset, a test harness) cannot move it; and its origin is recorded in
  the ledger file once per boot, so later steps of the host's wall clock (NTP, an
  operator's `date -s`) do not move lease deadlines either: ledger time is
  `origin + seconds since boot`, monotonic for the whole boot.
- memory: one process, its own clock.

An injectable clock (`clock=` on every ledger) stays for tests and simulations only.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path

from rollout_lifecycle.model.events import row_event
from rollout_lifecycle.model.sqlite_common import append_events, verify_recorded_row

_PROC = Path("/proc")


def read_host_clock() -> tuple[str, float, float] | None:
    """(boot id, wall-clock seconds at boot, seconds since boot) from the kernel, or None
    where /proc does not offer them (then callers fall back to the process clock)."""
    try:
        boot_id = (_PROC / "sys/kernel/random/boot_id").read_text().strip()
        uptime = float((_PROC / "uptime").read_text().split()[0])
        btime = next(
            float(line.split()[1])
            for line in (_PROC / "stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot_id, btime, uptime


def uptime_seconds() -> float | None:
    """Seconds since boot as the kernel counts them (CLOCK_BOOTTIME), or None.

    Every ledger step reads it (a lease deadline, an event's time), so the file is kept
    open and re-read from offset 0 (one pread: the kernel renders it afresh each time)
    instead of opened, read and closed per reading.
    """
    try:
        fd = _UPTIME_FD[0] if _UPTIME_FD else _open_uptime()
        return float(os.pread(fd, 64, 0).split()[0])
    except (OSError, ValueError, IndexError):
        return None


_UPTIME_FD: list[int] = []  # /proc/uptime, opened on first use


def _open_uptime() -> int:
    with _UPTIME_LOCK:
        if not _UPTIME_FD:
            _UPTIME_FD.append(os.open(_PROC / "uptime", os.O_RDONLY | os.O_CLOEXEC))
        return _UPTIME_FD[0]


_UPTIME_LOCK = threading.Lock()


class HostClock:
    """Ledger time on one host: a recorded origin plus the kernel's seconds since boot.

    `origin` is the wall-clock time of this boot as first recorded for the ledger; reading
    never consults the process's own clock, so every process on the host agrees whatever
    its time zone, its libfaketime offset or later steps of the system clock. Where /proc
    is missing (not Linux) it is the process clock, and the docs say so.
    """

    def __init__(self, origin: float | None) -> None:
        self.origin = origin

    def __call__(self) -> float:
        if self.origin is not None:
            up = uptime_seconds()
            if up is not None:
                return self.origin + up
        return time.time()


_ORIGIN = "SELECT origin FROM host_clock WHERE boot_id = ?"


def sqlite_host_clock(conn: sqlite3.Connection, *, read_only: bool) -> HostClock:
    """The host clock of the ledger file `conn` is open on: this boot's origin as first
    recorded in the file (the first writer after a boot records the kernel's boot time;
    every later process, whatever its own clock, reads it back).

    The origin decides every lease deadline, so it is recorded in the hash chain with the
    row (a RowRecorded, in the same transaction), and a writer checks the row against that
    event before using it: an origin edited in the table (which would expire every live
    lease at the next janitor) is refused with HistoryTampered, and `ledger check` names
    it. Read-only opens use the row as stored (they decide nothing)."""
    host = read_host_clock()
    if host is None:
        return HostClock(None)
    boot_id, btime, up = host
    row = None
    try:
        if not read_only:
            row = _record_origin(conn, boot_id, btime, btime + up)
        else:
            row = conn.execute(_ORIGIN, (boot_id,)).fetchone()
    except sqlite3.OperationalError:  # a read-only open of a file that predates the table
        row = None
    return HostClock(btime if row is None else float(row[0]))


def _record_origin(
    conn: sqlite3.Connection, boot_id: str, btime: float, now: float
) -> tuple[float] | None:
    """This boot's recorded origin, recording it (row and event, one transaction) when no
    process has since the boot; HistoryTampered when the row is not what its event says."""
    try:
        row = conn.execute(_ORIGIN, (boot_id,)).fetchone()
    except sqlite3.OperationalError:  # no table yet
        row = None
    if row is None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS host_clock "
                "(boot_id TEXT PRIMARY KEY, origin REAL NOT NULL)"
            )
            cur = conn.execute(
                "INSERT INTO host_clock(boot_id, origin) VALUES (?, ?) "
                "ON CONFLICT(boot_id) DO NOTHING",
                (boot_id, btime),
            )
            if cur.rowcount == 1:
                ev = row_event(
                    "host_clock",
                    boot_id,
                    {"boot_id": boot_id, "origin": btime},
                    "the first writer after this boot",
                    now,
                )
                append_events(conn, [ev], stamped=False)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        row = conn.execute(_ORIGIN, (boot_id,)).fetchone()
    if row is not None:
        verify_recorded_row(conn, "host_clock", boot_id, {"boot_id": boot_id, "origin": row[0]})
    return None if row is None else (float(row[0]),)
