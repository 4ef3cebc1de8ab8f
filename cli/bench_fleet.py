"""Issue 36's fleet part of `rollout-lifecycle bench`: N processes on one store, the ledger
against plain SQL doing the same work on the same kind of store, in one run.

The deployment question is reservations per second with several processes at once: half of
them add rollouts one at a time, the other half reserve one rollout at a time (against the
revision they already hold) and commit every 32 under a fresh update id (one process:
a reserver alone). The same processes then do the same writes as plain SQL, on a fresh file
(or schema) of the same table shape and durability: an UPDATE per reservation, one
UPDATE per commit of 32, an INSERT per add, each its own transaction. The ledger and the
plain SQL take turns at every N (the order rotating), so a busy spell of the machine falls
on both alike; the figure to read is the ratio inside one run.

Stores: SQLite in a folder (the system's temporary folder unless one is given) and on
tmpfs (/dev/shm), and PostgreSQL when a URL is given. Every cell reports reservations and
adds per second, the reservations' p50 and p99 latency, and, for SQLite, each writer's p99
wait for the file's write lock (BEGIN IMMEDIATE): SQLite's lock is not fair, so a writer
can wait long while another re-takes it, so on SQLite the plain SQL runs a second time with
its writers queued as the ledger's are ("queued", the baseline with the ledger's bounded
waits; the plain one shows what the unfair lock gives). The processes are started once
(spawn) and reused by every cell; each cell's rows are added before its clock starts, sized
from the rates seen so far, so no reserver runs dry (a cell where one did says so).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs

Progress = Callable[[str], None]

COMMIT_EVERY = 32


@attrs.frozen
class FleetSizes:
    """How long and how often the fleet runs: `seconds` per cell, `rounds` of every cell."""

    processes: tuple[int, ...]
    seconds: float
    rounds: int


FULL = FleetSizes(processes=(1, 2, 4, 8), seconds=2.0, rounds=1)
QUICK = FleetSizes(processes=(1, 2), seconds=0.3, rounds=1)


def variants(kind: str) -> list[str]:
    """What a cell runs on a store: the ledger, plain SQL, and on SQLite plain SQL whose
    writers take the ledger's writers' queue ("queued"; PostgreSQL's locks queue
    already)."""
    return ["ledger", "plain"] if kind == "postgres" else ["ledger", "plain", "queued"]


def roles(n: int) -> list[str]:
    """The processes of a fleet of n: half add, half reserve (one process: a reserver)."""
    if n == 1:
        return ["reserve"]
    return ["add"] * (n // 2) + ["reserve"] * (n - n // 2)


def _quantile(xs: Sequence[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of xs; None when empty."""
    if not xs:
        return None
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, math.ceil(q * len(ys)) - 1))]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


# ---- what one process does -------------------------------------------------------------------


def _reserved_payload() -> str:
    """A reserved entry's JSON, as the plain SQL writes it (the ledger's row shape)."""
    from rollout_lifecycle.cli import benchmarks as B
    from rollout_lifecycle.model.records import to_jsonable

    e = attrs.evolve(
        B._entries(1)[0],
        state="reserved",
        revision=1,
        reserved_by="u",
        lease_expires_at=1e9,
        admission=B.STAMP,
    )
    return json.dumps(to_jsonable(e))


class _Runner:
    """One process's share of a cell: `step()` does one add or one reservation (and, every
    32 reservations, the commit); `waits` holds each write's wait for the write lock."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.role: str = job["role"]
        self.ids: list[str] = job["ids"]
        self.next = 0
        self.held: list[str] = []
        self.batch = 0
        self.waits: list[float] = []

    def update_id(self) -> str:
        return f"u{self.job['index']}-{self.batch}"

    def step(self) -> bool:
        """One operation; False when a reserver has nothing left to reserve."""
        if self.role == "add":
            self.add(f"a{self.job['index']}-{self.next}")
            self.next += 1
            return True
        if self.next >= len(self.ids):
            return False
        rid = self.ids[self.next]
        self.next += 1
        self.reserve(rid)
        self.held.append(rid)
        if len(self.held) >= COMMIT_EVERY:
            self.finish()
        return True

    def finish(self) -> None:
        if self.held:
            self.commit(self.held)
            self.held = []
            self.batch += 1

    def add(self, rid: str) -> None:
        raise NotImplementedError

    def reserve(self, rid: str) -> None:
        raise NotImplementedError

    def commit(self, rids: list[str]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _LedgerRunner(_Runner):
    def __init__(self, job: dict[str, Any]) -> None:
        super().__init__(job)
        from rollout_lifecycle.cli import benchmarks as B

        self.stamp = B.STAMP
        self.entry = B._entries(1)[0]
        if job["store"] == "postgres":
            from rollout_lifecycle.model.postgres_ledger import PostgresLedger

            self.led: Any = PostgresLedger(job["where"], schema=job["schema"], pool_size=1)
        else:
            from rollout_lifecycle.model.sqlite_ledger import SQLiteLedger

            self.led = SQLiteLedger(job["where"])
            self.led.store.conns.lock_waits = self.waits
        self.led.find(self.ids[0] if self.ids else "r0")  # connect before the clock starts

    def add(self, rid: str) -> None:
        self.led.add(attrs.evolve(self.entry, rollout_id=rid))

    def reserve(self, rid: str) -> None:
        out = self.led.reserve(rid, 0, self.update_id(), self.stamp)
        if not out.reserved:
            raise RuntimeError(f"fleet: the reservation of {rid} was refused ({out.reason})")

    def commit(self, rids: list[str]) -> None:
        self.led.commit(self.update_id(), rids)

    def close(self) -> None:
        self.led.close()


_SQLITE_RESERVE = (
    "UPDATE rollouts SET state = 'reserved', revision = revision + 1, reserved_by = ?, "
    "lease_expires_at = ?, entry = ? WHERE rollout_id = ? AND revision = 0"
)
_SQLITE_COMMIT = (
    "UPDATE rollouts SET state = 'consumed', revision = revision + 1, reserved_by = NULL, "
    "lease_expires_at = NULL WHERE reserved_by = ?"
)
_SQLITE_ADD = "INSERT INTO rollouts VALUES (?, 'rewarded', 0, NULL, NULL, 0, ?)"


class _PlainSQLiteRunner(_Runner):
    """The same writes as bare SQL, each in its own BEGIN IMMEDIATE ... COMMIT (the wait
    for BEGIN IMMEDIATE is the wait for the write lock). Variant "queued": each write
    first takes the writers' queue beside the file, exactly as the ledger's writes do
    (`sqlite_conns.open_turn`), so its writers wait their turn instead of losing the
    lock to a writer in a tight loop: the baseline with the ledger's fairness."""

    def __init__(self, job: dict[str, Any]) -> None:
        super().__init__(job)
        from rollout_lifecycle.model.sqlite_common import connect
        from rollout_lifecycle.model.sqlite_conns import leave_turn, open_turn

        self.leave_turn = leave_turn  # imported once: the baseline carries no extra per write
        self.conn = connect(job["where"])
        self.turn = open_turn(Path(job["where"])) if job["variant"] == "queued" else None
        self.payload = _reserved_payload()
        self.conn.execute("SELECT COUNT(*) FROM rollouts WHERE rollout_id = 'r'").fetchall()

    def _write(self, sql: str, args: tuple[Any, ...]) -> int:
        t0 = time.perf_counter()
        if self.turn is not None:
            fcntl.flock(self.turn, fcntl.LOCK_EX)
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            self.waits.append(time.perf_counter() - t0)
            n = self.conn.execute(sql, args).rowcount
            self.conn.execute("COMMIT")
        finally:
            self.leave_turn(self.turn)
        return int(n)

    def add(self, rid: str) -> None:
        self._write(_SQLITE_ADD, (rid, self.payload))

    def reserve(self, rid: str) -> None:
        if self._write(_SQLITE_RESERVE, (self.update_id(), 1e9, self.payload, rid)) != 1:
            raise RuntimeError(f"fleet: the plain reservation of {rid} changed no row")

    def commit(self, rids: list[str]) -> None:
        self._write(_SQLITE_COMMIT, (self.update_id(),))

    def close(self) -> None:
        self.conn.close()
        if self.turn is not None:
            os.close(self.turn)


class _PlainPostgresRunner(_Runner):
    """The same writes as bare SQL on PostgreSQL, each one autocommit statement."""

    def __init__(self, job: dict[str, Any]) -> None:
        super().__init__(job)
        import psycopg

        self.conn = psycopg.connect(
            job["where"], autocommit=True, options=f"-c search_path={job['schema']}"
        )
        self.payload = _reserved_payload()
        self.conn.execute("SELECT 1").fetchall()

    def add(self, rid: str) -> None:
        self.conn.execute(_SQLITE_ADD.replace("?", "%s"), (rid, self.payload))

    def reserve(self, rid: str) -> None:
        sql = _SQLITE_RESERVE.replace("?", "%s")
        cur = self.conn.execute(sql, (self.update_id(), 1e9, self.payload, rid))
        if cur.rowcount != 1:
            raise RuntimeError(f"fleet: the plain reservation of {rid} changed no row")

    def commit(self, rids: list[str]) -> None:
        self.conn.execute(_SQLITE_COMMIT.replace("?", "%s"), (self.update_id(),))

    def close(self) -> None:
        self.conn.close()


def _runner(job: dict[str, Any]) -> _Runner:
    if job["variant"] == "ledger":
        return _LedgerRunner(job)
    if job["store"] == "postgres":
        return _PlainPostgresRunner(job)
    return _PlainSQLiteRunner(job)


def _run_timed(runner: _Runner, t0: float, t1: float) -> dict[str, Any]:
    """Operations from wall time t0 to t1: each reservation's (or add's) latency."""
    while time.time() < t0:
        time.sleep(max(0.0, min(0.01, t0 - time.time())))
    lat: list[float] = []
    dry = False
    end = time.perf_counter() + (t1 - time.time())
    while True:
        a = time.perf_counter()
        if a >= end:
            break
        if not runner.step():
            dry = True
            break
        lat.append(time.perf_counter() - a)
    active = time.perf_counter() - (end - (t1 - t0))
    runner.finish()  # the last held reservations are committed after the clock stopped
    return {
        "role": runner.role,
        "done": len(lat),
        "active_s": active,
        "ran_dry": dry,
        "latencies": lat,
        "waits": list(runner.waits),
    }


def worker_main(inbox: Any, outbox: Any) -> None:
    """A fleet process: for each job, open the store, say ready, run from t0 to t1."""
    while True:
        job = inbox.get()
        if job is None:
            return
        try:
            runner = _runner(job)
            outbox.put(("ready", job["index"], None))
            t0, t1 = inbox.get()
            result = _run_timed(runner, t0, t1)
            runner.close()
            outbox.put(("done", job["index"], result))
        except BaseException:
            outbox.put(("error", job["index"], traceback.format_exc()[-2000:]))


# ---- the stores, made ready for a cell -------------------------------------------------------


def _pool_ids(index: int, n: int) -> list[str]:
    return [f"p{index}-{i}" for i in range(n)]


_SQLITE_DDL = (
    "CREATE TABLE rollouts (rollout_id TEXT PRIMARY KEY, state TEXT NOT NULL, "
    "revision INTEGER NOT NULL, reserved_by TEXT, lease_expires_at REAL, "
    "behavior_version INTEGER NOT NULL, entry TEXT NOT NULL) WITHOUT ROWID;"
    "CREATE INDEX rollouts_owner ON rollouts(reserved_by) WHERE reserved_by IS NOT NULL;"
    "CREATE INDEX rollouts_lease ON rollouts(lease_expires_at) WHERE reserved_by IS NOT NULL;"
    "CREATE INDEX rollouts_version ON rollouts(behavior_version, state);"
)
_POSTGRES_DDL = (
    "CREATE TABLE rollouts (rollout_id text PRIMARY KEY, state text NOT NULL, "
    "revision bigint NOT NULL, reserved_by text, lease_expires_at double precision, "
    "behavior_version bigint NOT NULL, entry text NOT NULL);"
    "CREATE INDEX rollouts_owner ON rollouts(reserved_by);"
    "CREATE INDEX rollouts_version ON rollouts(behavior_version, state);"
)


def _entry_payload() -> str:
    from rollout_lifecycle.cli import benchmarks as B
    from rollout_lifecycle.model.records import to_jsonable

    return json.dumps(to_jsonable(B._entries(1)[0]))


def _prepare(store: str, variant: str, where: str, pools: dict[int, int]) -> dict[str, Any]:
    """A fresh file (SQLite) or schema (PostgreSQL) holding every reserver's pool of
    rewarded rollouts; what the jobs need to open it."""
    from rollout_lifecycle.cli import benchmarks as B

    rows = [rid for index, n in pools.items() for rid in _pool_ids(index, n)]
    tag = f"{random.getrandbits(40):x}"
    if store == "postgres":
        import psycopg

        schema = f"fleet_{variant}_{tag}"
        if variant == "ledger":
            from rollout_lifecycle.model.postgres_ledger import PostgresLedger

            led: Any = PostgresLedger(where, schema=schema, pool_size=1)
            try:
                _add_all(led, rows, B)
            finally:
                led.close()
        else:
            payload = _entry_payload()
            with psycopg.connect(where, autocommit=True) as pg:
                pg.execute(f"CREATE SCHEMA {schema}")
                pg.execute(f"SET search_path = {schema}")
                pg.execute(_POSTGRES_DDL)
                with pg.transaction(), pg.cursor() as cur:
                    cur.executemany(
                        "INSERT INTO rollouts VALUES (%s, 'rewarded', 0, NULL, NULL, 0, %s)",
                        [(r, payload) for r in rows],
                    )
        return {"where": where, "schema": schema}
    path = str(Path(where) / f"fleet-{variant}-{tag}.db")
    if variant == "ledger":
        from rollout_lifecycle.model.sqlite_ledger import SQLiteLedger

        led = SQLiteLedger(path)
        try:
            _add_all(led, rows, B)
        finally:
            led.close()
    else:
        from rollout_lifecycle.model.sqlite_common import connect

        payload = _entry_payload()
        conn = connect(path)
        try:
            conn.executescript(_SQLITE_DDL)
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT INTO rollouts VALUES (?, 'rewarded', 0, NULL, NULL, 0, ?)",
                [(r, payload) for r in rows],
            )
            conn.execute("COMMIT")
        finally:
            conn.close()
    return {"where": path, "schema": None}


def _add_all(led: Any, rows: list[str], B: Any) -> None:
    entry = B._entries(1)[0]
    for k in range(0, len(rows), 5_000):
        led.add_many([attrs.evolve(entry, rollout_id=r) for r in rows[k : k + 5_000]])


def _drop(store: str, opened: dict[str, Any]) -> None:
    """Free what a cell used: its file and sidecars, or its schema."""
    if store == "postgres":
        import psycopg

        with psycopg.connect(opened["where"], autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {opened['schema']} CASCADE")
        return
    for suffix in ("", "-wal", "-shm", "-journal"):
        with contextlib.suppress(OSError):
            os.unlink(opened["where"] + suffix)


# ---- the fleet -------------------------------------------------------------------------------


class Fleet:
    """`size` spawned processes, reused by every cell."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.outbox: Any = ctx.Queue()
        self.inboxes: list[Any] = [ctx.Queue() for _ in range(size)]
        self.procs = [
            ctx.Process(target=worker_main, args=(box, self.outbox), daemon=True)
            for box in self.inboxes
        ]
        for p in self.procs:
            p.start()

    def _collect(self, n: int, kind: str, timeout: float) -> dict[int, Any]:
        got: dict[int, Any] = {}
        while len(got) < n:
            what, index, value = self.outbox.get(timeout=timeout)
            if what == "error":
                raise RuntimeError(f"fleet process {index} failed:\n{value}")
            if what != kind:
                raise RuntimeError(f"fleet process {index}: {what} where {kind} was due")
            got[index] = value
        return got

    def run(self, jobs: list[dict[str, Any]], seconds: float) -> list[dict[str, Any]]:
        for job in jobs:
            self.inboxes[job["index"]].put(job)
        self._collect(len(jobs), "ready", 300.0)
        t0 = time.time() + 0.2
        for job in jobs:
            self.inboxes[job["index"]].put((t0, t0 + seconds))
        done = self._collect(len(jobs), "done", seconds + 300.0)
        return [done[j["index"]] for j in jobs]

    def close(self) -> None:
        for box in self.inboxes:
            box.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def _summary(results: list[dict[str, Any]], seconds: float, store: str) -> dict[str, Any]:
    """One variant's figures in one cell."""
    res = [r for r in results if r["role"] == "reserve"]
    adds = [r for r in results if r["role"] == "add"]
    lat = [x for r in res for x in r["latencies"]]
    out: dict[str, Any] = {
        "reservations": sum(r["done"] for r in res),
        "reservations_per_s": round(sum(r["done"] for r in res) / seconds, 1),
        "adds_per_s": round(sum(r["done"] for r in adds) / seconds, 1),
        "p50_ms": _ms(_quantile(lat, 0.5)),
        "p99_ms": _ms(_quantile(lat, 0.99)),
        "ran_dry": any(r["ran_dry"] for r in res),
    }
    if store != "postgres":
        per_writer = [_ms(_quantile(r["waits"], 0.99)) for r in results]
        out["lock_wait_p99_ms"] = per_writer
        out["lock_wait_p99_ms_max"] = max((x for x in per_writer if x is not None), default=None)
    return out


def _stores(folder: Path | None, postgres_url: str | None) -> list[tuple[str, str, str]]:
    """(name, kind, where) of each store this machine has."""
    from rollout_lifecycle.cli import benchmarks as B

    out = [("sqlite-disk", "sqlite", str(folder or Path(tempfile.gettempdir())))]
    if B.TMPFS.is_dir() and os.access(B.TMPFS, os.W_OK | os.X_OK):
        out.append(("sqlite-tmpfs", "sqlite", str(B.TMPFS)))
    if postgres_url:
        out.append(("postgres", "postgres", postgres_url))
    return out


@contextlib.contextmanager
def _scratch(where: str, kind: str) -> Iterator[str]:
    if kind == "postgres":
        yield where
        return
    with tempfile.TemporaryDirectory(prefix="rl-fleet-", dir=where) as tmp:
        yield tmp


def bench_fleet(
    sizes: FleetSizes,
    *,
    folder: Path | None = None,
    postgres_url: str | None = None,
    progress: Progress = lambda _: None,
) -> dict[str, Any]:
    """Every store x N x its variants (`variants`): the ledger and the plain SQL in turn at
    every N, the order rotating."""
    from rollout_lifecycle.cli import benchmarks as B

    cells: list[dict[str, Any]] = []
    fleet = Fleet(max(sizes.processes))
    try:
        for name, kind, where in _stores(folder, postgres_url):
            with _scratch(where, kind) as scratch:
                rate = _Rates()
                runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
                loads: dict[int, list[float | None]] = {}
                for rnd in range(sizes.rounds):
                    for k, n in enumerate(sizes.processes):
                        kinds = variants(kind)
                        turn = (rnd + k) % len(kinds)
                        order = kinds[turn:] + kinds[:turn]
                        for variant in order:
                            load = B.load1()
                            loads.setdefault(n, []).append(load)
                            progress(
                                f"fleet {name} N={n} {variant} ({sizes.seconds} s, load {load})"
                            )
                            got = _cell(fleet, kind, variant, scratch, n, sizes, rate)
                            runs.setdefault((n, variant), []).append(got)
                for n in sizes.processes:
                    cells.append(_cell_row(name, kind, n, runs, loads[n], sizes))
    finally:
        fleet.close()
    return {
        "what": "N processes on one store: half add rollouts one at a time, half reserve "
        "one at a time and commit every 32 (N=1: one reserver); the ledger against plain "
        "SQL doing the same writes on a fresh store of the same table shape (on SQLite "
        "also with its writers queued as the ledger's are), in turn at every N",
        "seconds_per_cell": sizes.seconds,
        "rounds": sizes.rounds,
        "commit_every": COMMIT_EVERY,
        "postgres": postgres_url is not None,
        "cells": cells,
    }


def _cell(
    fleet: Fleet,
    kind: str,
    variant: str,
    scratch: str,
    n: int,
    sizes: FleetSizes,
    rate: _Rates,
) -> dict[str, Any]:
    """One variant at N: fresh store, pools sized from the rates so far, the timed run;
    run again on larger pools (up to three times) when a reserver ran out of rollouts, as
    its rate would then be understated (the figure says so if it still did)."""
    for _ in range(3):
        results = _cell_once(fleet, kind, variant, scratch, n, sizes, rate.guess(variant, n))
        dry = any(r["ran_dry"] for r in results)
        per = [r["done"] / sizes.seconds for r in results if r["role"] == "reserve"]
        rate.saw(variant, n, max(per, default=0.0), dry)
        if not dry:
            break
    return _summary(results, sizes.seconds, kind)


def _cell_once(
    fleet: Fleet, kind: str, variant: str, scratch: str, n: int, sizes: FleetSizes, guess: float
) -> list[dict[str, Any]]:
    rs = roles(n)
    pool = int(guess * sizes.seconds * 1.5) + 64
    pools = {i: pool for i, role in enumerate(rs) if role == "reserve"}
    opened = _prepare(kind, variant, scratch, pools)
    try:
        jobs = [
            {
                "index": i,
                "role": role,
                "store": kind,
                "variant": variant,
                "where": opened["where"],
                "schema": opened["schema"],
                "ids": _pool_ids(i, pools[i]) if role == "reserve" else [],
            }
            for i, role in enumerate(rs)
        ]
        return fleet.run(jobs, sizes.seconds)
    finally:
        _drop(kind, opened)


class _Rates:
    """Reservations per second of one reserver, to size the next cell's pools: this N's
    from an earlier round, else the most any N reached yet, else a first guess."""

    FIRST: ClassVar[dict[str, float]] = {"ledger": 6000.0, "plain": 40000.0, "queued": 20000.0}

    def __init__(self) -> None:
        self.at: dict[tuple[str, int], float] = {}
        self.most: dict[str, float] = {}

    def guess(self, variant: str, n: int) -> float:
        return self.at.get((variant, n), self.most.get(variant, self.FIRST[variant]))

    def saw(self, variant: str, n: int, per_reserver: float, ran_dry: bool) -> None:
        got = 3 * self.guess(variant, n) if ran_dry else max(per_reserver, 50.0)
        self.at[(variant, n)] = got
        self.most[variant] = max(self.most.get(variant, 0.0), got)


def _median(xs: list[Any]) -> Any:
    vals = [x for x in xs if x is not None]
    if not vals:
        return None
    return round(statistics.median(vals), 3)


def _cell_row(
    name: str,
    kind: str,
    n: int,
    runs: dict[tuple[int, str], list[dict[str, Any]]],
    loads: list[float | None],
    sizes: FleetSizes,
) -> dict[str, Any]:
    """Medians over the rounds of each variant at N, and the ledger / plain ratio."""
    row: dict[str, Any] = {
        "store": name,
        "N": n,
        "reservers": roles(n).count("reserve"),
        "adders": roles(n).count("add"),
        "load1": _median(loads),
    }
    for variant in variants(kind):
        got = runs[(n, variant)]
        v: dict[str, Any] = {
            k: _median([g[k] for g in got])
            for k in ("reservations_per_s", "adds_per_s", "p50_ms", "p99_ms")
        }
        v["ran_dry"] = any(g["ran_dry"] for g in got)
        if kind != "postgres":
            v["lock_wait_p99_ms_max"] = _median([g["lock_wait_p99_ms_max"] for g in got])
            v["lock_wait_p99_ms"] = got[-1]["lock_wait_p99_ms"]
        row[variant] = v
    led = row["ledger"]["reservations_per_s"]
    for variant in variants(kind)[1:]:
        base = row[variant]["reservations_per_s"]
        ratio = round(led / base, 3) if led is not None and base else None
        row[f"ledger_vs_{variant}"] = ratio
    return row


def goals(report: dict[str, Any], goal: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 36's fleet goals at N=4, where the run measured them."""
    out: list[dict[str, Any]] = []
    targets = {"postgres": ">= 0.35", "sqlite-tmpfs": ">= 0.2"}
    for row in (report.get("fleet") or {}).get("cells", []):
        if row["N"] != 4:
            continue
        load = row.get("load1")
        if row["store"] in targets:
            out.append(
                goal(
                    f"fleet {row['store']} N=4: ledger / plain SQL reservations per s",
                    row["ledger_vs_plain"],
                    targets[row["store"]],
                    load,
                )
            )
        if row["store"] == "sqlite-tmpfs" and row.get("ledger_vs_queued") is not None:
            out.append(
                goal(
                    "fleet sqlite-tmpfs N=4: ledger / plain SQL whose writers queue as the "
                    "ledger's do (the baseline with the same bounded waits), reservations per s",
                    row["ledger_vs_queued"],
                    ">= 0.2",
                    load,
                )
            )
        if row["store"] == "sqlite-tmpfs":
            out.append(
                goal(
                    "fleet sqlite-tmpfs N=4: the ledger's writers' p99 wait for the write "
                    "lock, ms (most of any writer)",
                    row["ledger"].get("lock_wait_p99_ms_max"),
                    "<= 250",
                    load,
                )
            )
    return out


def markdown(report: dict[str, Any]) -> list[str]:
    """The fleet table, or nothing when the part did not run."""
    fleet = report.get("fleet")
    if not fleet:
        return []
    lines = [
        "## Fleet (issue 36)",
        "",
        fleet["what"] + f"; {fleet['seconds_per_cell']} s per cell, median of "
        f"{fleet['rounds']} round(s). Latencies are the reservations' (ms); lock wait: the "
        "most any writer waited for SQLite's write lock at its p99 (ms). queued: the plain "
        "SQL again, its writers taking the ledger's writers' queue first (SQLite only), "
        "the baseline with the ledger's bounded waits. load: the 1-minute load average "
        "when the cell started.",
        "",
        "| store | N | reservations/s ledger | plain | queued | ledger/plain | ledger/queued "
        "| p50 ledger | p50 plain | p99 ledger | p99 plain | lock wait p99 ledger | plain "
        "| queued | adds/s ledger | plain | queued | load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        "---:|",
    ]
    for r in fleet["cells"]:
        a, b, q = r["ledger"], r["plain"], r.get("queued") or {}
        dry = " (ran dry)" if a["ran_dry"] or b["ran_dry"] or q.get("ran_dry") else ""
        lines.append(
            f"| {r['store']} | {r['N']} | {_fmt(a['reservations_per_s'])}{dry} | "
            f"{_fmt(b['reservations_per_s'])} | {_fmt(q.get('reservations_per_s'))} | "
            f"{_fmt(r['ledger_vs_plain'])} | {_fmt(r.get('ledger_vs_queued'))} | "
            f"{_fmt(a['p50_ms'])} | {_fmt(b['p50_ms'])} | {_fmt(a['p99_ms'])} | "
            f"{_fmt(b['p99_ms'])} | {_fmt(a.get('lock_wait_p99_ms_max'))} | "
            f"{_fmt(b.get('lock_wait_p99_ms_max'))} | {_fmt(q.get('lock_wait_p99_ms_max'))} | "
            f"{_fmt(a['adds_per_s'])} | {_fmt(b['adds_per_s'])} | "
            f"{_fmt(q.get('adds_per_s'))} | {_fmt(r['load1'])} |"
        )
    if not fleet["postgres"]:
        lines += ["", "PostgreSQL: not measured in this run (no `--fleet-postgres` URL)."]
    return lines


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.2f}"
    return str(v)
