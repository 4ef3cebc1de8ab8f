"""Reservations per second on PostgreSQL: single and batch compare-and-set with 1 / 4 / 8
workers, each next to a plain UPDATE of the same rows by the same workers in the same run.

    python benchmarks/postgres_bench.py                       # starts a throwaway server
    python benchmarks/postgres_bench.py --url postgresql://user@host/db --json out.json

Each worker is an OS process with its own PostgresLedger (its own connection pool) and its
own disjoint share of freshly added rollouts, so every reservation wins: the figure is the
cost of a winning reservation through the real code path (read, plan, enforce, the premise
under its lock, the CAS statement, events and counters under the events lock, COMMIT). The
baseline is the bare write those rows need: one autocommit ``UPDATE ... WHERE rollout_id =``
per row for the single mode, one ``UPDATE ... WHERE rollout_id = ANY(...)`` per chunk for the
batch mode. The batch mode has a second baseline doing the SAME writes as a reservation
batch: per chunk, in one transaction (the same durability), one ``UPDATE ... FROM
unnest(...)`` of the same columns (state, revision, owner, lease, the entry's JSON) and one
INSERT of the same event rows (kind, subject, payload JSON, seq, txn, 32-byte hashes), the
JSON built before the clock starts: the database's own speed for that work. Wall time runs
from a barrier every worker has reached to the last one done. No figure is asserted
anywhere; the ratio inside one run is what to read.

`--repeats R` runs R interleaved rounds on fresh rows and reports medians (and the median
of the per-round ratios); the single mode also times every reservation next to a plain
UPDATE of the same row in the same process ("call by call": plain time / reservation
time), so a load that changes between runs falls on both alike. `--code DIR` (repeatable)
measures the CAS of the
rollout_lifecycle in that checkout: every round runs each one, so two versions are
compared against the same baselines in one run.

Every mode also measures CPU time per row, which a loaded machine does not change the way
it changes wall time: the worker process's own (`time.process_time`) and that of the
server process serving its connection (`pg_backend_pid()`, read from /proc/<pid>/schedstat,
or /proc/<pid>/stat in clock ticks where the kernel keeps no schedstat: 10 ms steps, so use
a few hundred rows or more), reported with the ratio baseline CPU / CAS CPU (client plus
server). Where the server runs on another machine its share shows as "?".

Standalone and importable: `run_bench(url, ...)` returns the rows as dicts.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HASH = "b" * 64


def _stamp() -> Any:
    from rollout_lifecycle.model.records import AdmissionStamp

    return AdmissionStamp(
        current_version=1,
        behavior_version=1,
        max_lag=1,
        max_drift=0.2,
        drift=0.0,
        freshness="fresh",
        reason="ok",
        accepted=True,
    )


def _ids(worker: int, n: int, tag: str) -> list[str]:
    return [f"{tag}-w{worker}-{i:06d}" for i in range(n)]


def _planned(rids: list[str], update_id: str) -> tuple[list[Any], list[str]]:
    """What reserving `rids` (as `_prepare` added them) writes: the new entries and the
    events' payloads, built as the ledger builds them (outside any clock)."""
    from rollout_lifecycle.model.events import entry_events, stored_payload
    from rollout_lifecycle.model.ledger import NO_REGISTRY, dump_entry, plan_reserve

    rows, payloads = [], []
    for rid in rids:
        before = _entry(rid)
        _, after = plan_reserve(
            before, rid, 0, update_id, _stamp(), premise=NO_REGISTRY, lease_expires_at=time.time()
        )
        assert after is not None
        (ev,) = entry_events([("reserve", before, after, update_id)], time.time())
        text = dump_entry(after)
        rows.append((after, text))
        payloads.append(stored_payload(ev, None))
    return rows, payloads


def _columns(part: Sequence[tuple[Any, str]]) -> tuple[list[Any], ...]:
    """Planned (entry, stored text) pairs as the columns a set-based write sends: ids,
    states, revisions, owners, leases, entry texts."""
    return (
        [a.rollout_id for a, _ in part],
        [a.state for a, _ in part],
        [a.revision for a, _ in part],
        [a.reserved_by for a, _ in part],
        [a.lease_expires_at for a, _ in part],
        [t for _, t in part],
    )


def _entry(rid: str) -> Any:
    from rollout_lifecycle.model.records import LedgerEntry, Reward

    return LedgerEntry(
        rollout_id=rid,
        behavior_version=1,
        artifact_hash=HASH,
        state="rewarded",
        reward=Reward("bench", "1", 1.0),
    )


# the same columns a reservation batch writes, arrays sent in binary (%b): no quoting in Python;
# the rows found through the primary key (the ids again, as the CAS does: joined with the
# unnest alone the server hashes the whole table, a cost that grows with the table and that
# the reservation batch does not pay)
_SAME_UPDATE = """
UPDATE rollouts r SET state = u.state, revision = u.revision, reserved_by = u.reserved_by,
    lease_expires_at = u.lease, entry = u.entry
FROM unnest(%b::text[], %b::text[], %b::bigint[], %b::text[], %b::float8[], %b::text[])
    AS u(rollout_id, state, revision, reserved_by, lease, entry)
WHERE r.rollout_id = u.rollout_id AND r.rollout_id = ANY(%b::text[])
"""
_SAME_EVENTS = """
INSERT INTO events(seq, txn, kind, subject, payload, prev_hash, hash)
SELECT nextval('events_seq'), t.txn, 'entry', u.subject, u.payload, u.h, u.h
FROM (SELECT nextval('events_txn') AS txn) t,
    unnest(%b::text[], %b::text[], %b::bytea[]) AS u(subject, payload, h)
"""


def _cpu_of(pid: int | None) -> float | None:
    """CPU seconds (user + system) the process `pid` has used so far: /proc/<pid>/schedstat
    (nanoseconds) where the kernel fills it in, else /proc/<pid>/stat (clock ticks); None
    when the server's processes are not visible here (a server on another machine)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/schedstat") as fh:
            ns = int(fh.read().split()[0])
        if ns > 0:
            return ns / 1e9
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _backend_pid(conn: Any) -> int:
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    return int(row[0])


def _worker(
    url: str,
    schema: str,
    mode: str,
    worker: int,
    n: int,
    chunk: int,
    barrier: Any,
    out: Any,
    tag: str = "r",
    code: str | None = None,
) -> None:
    """One process: reserve its n rollouts of slice `tag` (mode cas-*), or write them as a
    baseline does (plain-*, same-batch), with rollout_lifecycle imported from `code`."""
    if code is not None:
        sys.path.insert(0, code)
    try:
        import psycopg

        from rollout_lifecycle.model.ledger import ReserveRequest
        from rollout_lifecycle.model.postgres_ledger import PostgresLedger

        rids = _ids(worker, n, tag)
        stamp = _stamp()
        same = _planned(rids, f"u{worker}") if mode == "same-batch" else ([], [])
        led = PostgresLedger(url, schema=schema, pool_size=1)
        conn = psycopg.connect(url, autocommit=True, options=f"-c search_path={schema}")
        # the server process doing this mode's work: the ledger's one pooled connection for
        # the CAS modes, the plain connection for the baselines
        uses_ledger = mode.startswith("cas") or mode == "mixed-single"
        pid = led.db.read(_backend_pid) if uses_ledger else _backend_pid(conn)
        barrier.wait(timeout=300)
        server0, client0 = _cpu_of(pid), time.process_time()
        t0 = time.perf_counter()
        won = 0
        split = [0.0, 0.0]  # mode mixed-single: seconds in reservations, in plain UPDATEs
        if mode == "mixed-single":  # each reservation, then the plain UPDATE of that row
            for rid in rids:
                t = time.perf_counter()
                won += led.reserve(rid, 0, f"u{worker}", stamp).reserved
                split[0] += time.perf_counter() - t
                t = time.perf_counter()
                conn.execute(
                    "UPDATE rollouts SET lease_expires_at = %s WHERE rollout_id = %s",
                    (time.time(), rid),
                )
                split[1] += time.perf_counter() - t
        elif mode == "cas-single":
            for rid in rids:
                won += led.reserve(rid, 0, f"u{worker}", stamp).reserved
        elif mode == "cas-batch":
            for i in range(0, n, chunk):
                reqs = [ReserveRequest(r, 0, stamp) for r in rids[i : i + chunk]]
                won += sum(o.reserved for o in led.reserve_batch(f"u{worker}.{i}", reqs))
        elif mode == "plain-single":
            for rid in rids:
                conn.execute(
                    "UPDATE rollouts SET lease_expires_at = %s WHERE rollout_id = %s",
                    (time.time(), rid),
                )
                won += 1
        elif mode == "plain-batch":
            for i in range(0, n, chunk):
                part = rids[i : i + chunk]
                with conn.transaction():
                    cur = conn.execute(
                        "UPDATE rollouts SET lease_expires_at = %s WHERE rollout_id = ANY(%s)",
                        (time.time(), part),
                    )
                won += cur.rowcount
        elif mode == "same-batch":
            entries, payloads = same
            for i in range(0, n, chunk):
                part = entries[i : i + chunk]
                cols = _columns(part)
                hashes = [bytes(32)] * len(part)
                with conn.transaction():
                    cur = conn.execute(_SAME_UPDATE, (*cols, cols[0]))
                    conn.execute(_SAME_EVENTS, (cols[0], payloads[i : i + chunk], hashes))
                won += cur.rowcount
        else:
            raise ValueError(mode)
        elapsed = time.perf_counter() - t0
        client_s, server1 = time.process_time() - client0, _cpu_of(pid)
        same_pid = (led.db.read(_backend_pid) if uses_ledger else _backend_pid(conn)) == pid
        server_s = None
        if server0 is not None and server1 is not None and same_pid:
            server_s = server1 - server0
        conn.close()
        led.close()
        import rollout_lifecycle

        out.put(
            {
                "worker": worker,
                "done": won,
                "t0": t0,
                "t1": t0 + elapsed,
                "code": str(Path(rollout_lifecycle.__file__).resolve().parents[1]),
                "split": split,
                "cpu": [client_s, server_s],
            }
        )
    except BaseException as exc:
        out.put({"worker": worker, "error": repr(exc)})
        raise


def _drop_baseline_events(url: str, schema: str) -> None:
    """The same-columns baseline inserts event rows outside the ledger's hash chain; they
    are deleted after it (outside any clock), so the next round's reservations find the
    chain ending where its head says (else they refuse the history as tampered with)."""
    import psycopg

    with psycopg.connect(url, autocommit=True, options=f"-c search_path={schema}") as conn:
        conn.execute(
            "DELETE FROM events WHERE seq > (SELECT last_seq FROM events_chain WHERE id = 1)"
        )


def _prepare(url: str, schema: str, workers: int, n: int, tags: tuple[str, ...] = ("r",)) -> None:
    """A fresh schema with v1 active and every worker's n rollouts of each slice in `tags`
    waiting (rewarded)."""
    import psycopg
    from psycopg import sql

    from rollout_lifecycle.model.coordinator import ActivationCoordinator
    from rollout_lifecycle.model.postgres_common import PostgresDatabase
    from rollout_lifecycle.model.postgres_ledger import PostgresLedger
    from rollout_lifecycle.model.postgres_registry import PostgresRegistry
    from rollout_lifecycle.model.records import AdmissionPolicy, WorkerAck
    from rollout_lifecycle.model.registry import set_admission_policy

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    db = PostgresDatabase(url, schema=schema)
    led = PostgresLedger(db)
    reg = PostgresRegistry(db)
    try:
        # reservations are judged against the deployment's recorded policy: record one
        set_admission_policy(reg, AdmissionPolicy(1, 0.2), "set by the operator")
        c = ActivationCoordinator(reg, ["w0"], ledger=led, policy=AdmissionPolicy(1, 0.2))
        c.prepare(1)
        c.commit_artifact(1, HASH)
        c.distribute(1)
        c.record_ack(WorkerAck("w0", 1, HASH, token=c.attempt_token("w0", 1)))
        assert c.try_activate(1).activated
        for w, tag in ((w, t) for w in range(workers) for t in tags):
            rids = _ids(w, n, tag)
            for i in range(0, n, 5000):
                led.add_many([_entry(r) for r in rids[i : i + 5000]])
    finally:
        led.close()
        reg.close()


def _run(
    url: str,
    schema: str,
    mode: str,
    workers: int,
    n: int,
    chunk: int,
    tag: str = "r",
    code: str | None = None,
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(workers)
    out: Any = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(url, schema, mode, w, n, chunk, barrier, out, tag, code))
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    got = [out.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [g["error"] for g in got if "error" in g]
    if errors:
        raise RuntimeError(f"{mode} x{workers}: {errors}")
    if code is not None and {g["code"] for g in got} != {str(Path(code).resolve())}:
        raise RuntimeError(f"{mode}: workers imported {sorted({g['code'] for g in got})}")
    done = sum(g["done"] for g in got)
    wall = max(g["t1"] for g in got) - min(g["t0"] for g in got)
    cas_s, plain_s = (sum(g["split"][i] for g in got) for i in (0, 1))
    server = [g["cpu"][1] for g in got]
    cpu = {
        "client_ms": 1e3 * sum(g["cpu"][0] for g in got) / done,
        "server_ms": None if None in server else 1e3 * sum(server) / done,
    }
    return {
        "done": done,
        "wall_s": wall,
        "per_s": done / wall,
        "split": [cas_s, plain_s],
        "cpu": cpu,
    }


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _cpu_total(cpu: dict[str, float | None]) -> float | None:
    client, server = cpu["client_ms"], cpu["server_ms"]
    return None if client is None or server is None else client + server


def _fmt_cpu(cpu: dict[str, float | None]) -> str:
    client, server = cpu["client_ms"], cpu["server_ms"]
    return f"{client:.3f}+" + ("?" if server is None else f"{server:.3f}")


def _cpu_row(cpus: list[dict[str, Any]], cas: str, base: str) -> dict[str, Any]:
    """Medians over the rounds of the CAS's CPU per row (client, server, both) and of the
    per-round ratio `base` CPU / CAS CPU (client plus server where the server's processes
    are visible, else None): like the throughput ratios, 1.0 means as cheap as `base`."""
    out: dict[str, Any] = {}
    if base == "plain":
        for part in ("client_ms", "server_ms"):
            got = [r[cas][part] for r in cpus]
            out[f"cpu_{part}"] = None if None in got else round(_median(got), 4)
    totals = [(_cpu_total(r[cas]), _cpu_total(r[base])) for r in cpus]
    if any(t is None or b is None or t <= 0 for t, b in totals):
        out[f"cpu_{base}_ms"], out[f"cpu_cas_vs_{base}"] = None, None
        return out
    out[f"cpu_{base}_ms"] = round(_median([b for _, b in totals]), 4)  # type: ignore[misc]
    out[f"cpu_cas_vs_{base}"] = round(_median([b / t for t, b in totals]), 3)  # type: ignore[operator]
    return out


def run_bench(
    url: str,
    *,
    workers: tuple[int, ...] = (1, 4, 8),
    single_n: int = 1500,
    batch_n: int = 10_000,
    chunk: int = 250,
    repeats: int = 1,
    codes: tuple[str | None, ...] = (None,),
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Every (mode, workers, code) row: CAS reservations/s, plain-UPDATE rows/s and (batch)
    same-columns rows/s, each the median over `repeats` rounds, with the median of the
    per-round ratios.

    `single_n` / `batch_n` are rollouts per worker and round. In each round every code's
    CAS runs on fresh rows of its own, one after the other; then the baselines run right
    after, on the rows the first code's CAS reserved (the same rows, the same row size, a
    warm cache). Rounds interleave, so slow and fast moments of a shared machine fall on
    every series alike.
    """
    say = progress or (lambda _t: None)
    rows = []
    for mode, n in (("single", single_n), ("batch", batch_n)):
        for k in workers:
            schema = f"bench_{mode}_{k}"
            kinds = ("c", "m") if mode == "single" else ("c",)
            tags = tuple(
                f"r{rep}{x}{c}" for rep in range(repeats) for x in kinds for c in range(len(codes))
            )
            say(f"preparing {mode} x{k}: {k * n * len(tags)} rollouts")
            _prepare(url, schema, k, n, tags)
            rounds: list[dict[str, Any]] = []
            cpus: list[dict[str, dict[str, float | None]]] = []  # per round: CPU ms per row
            for rep in range(repeats):
                got: dict[str, Any] = {}
                for c, code in enumerate(codes):
                    got[f"cas{c}"] = _run(
                        url, schema, f"cas-{mode}", k, n, chunk, f"r{rep}c{c}", code
                    )
                got["plain"] = _run(url, schema, f"plain-{mode}", k, n, chunk, f"r{rep}c0")
                if mode == "batch":
                    got["same"] = _run(url, schema, "same-batch", k, n, chunk, f"r{rep}c0")
                    _drop_baseline_events(url, schema)
                else:  # call by call: every reservation next to a plain UPDATE of its row
                    for c, code in enumerate(codes):
                        got[f"mixed{c}"] = _run(
                            url, schema, "mixed-single", k, n, chunk, f"r{rep}m{c}", code
                        )
                assert all(g["done"] == k * n for g in got.values()), got
                rounds.append({key: g["per_s"] for key, g in got.items()})
                cpus.append({key: g["cpu"] for key, g in got.items()})
                for key, g in got.items():
                    if key.startswith("mixed"):  # plain UPDATE time / reservation time
                        rounds[-1][key] = g["split"][1] / g["split"][0]
                say(
                    f"{mode:6} x{k} round {rep + 1}/{repeats}: "
                    + "  ".join(
                        f"{key} {v:.3f}" if key.startswith("mixed") else f"{key} {v:,.0f}/s"
                        for key, v in rounds[-1].items()
                    )
                    + "  CPU ms/row (client+server): "
                    + "  ".join(
                        f"{key} {_fmt_cpu(c)}"
                        for key, c in cpus[-1].items()
                        if not key.startswith("mixed")
                    )
                )
            for c, code in enumerate(codes):
                cas = [r[f"cas{c}"] for r in rounds]
                row: dict[str, Any] = {
                    "mode": mode,
                    "chunk": chunk if mode == "batch" else 1,
                    "workers": k,
                    "rows": k * n,
                    "repeats": repeats,
                    "code": code or str(ROOT),
                    "cas_per_s": round(_median(cas)),
                    "plain_update_per_s": round(_median([r["plain"] for r in rounds])),
                    "cas_vs_plain": round(_median([r[f"cas{c}"] / r["plain"] for r in rounds]), 3),
                    "rounds": rounds,
                }
                if mode == "single":
                    calls = [r[f"mixed{c}"] for r in rounds]
                    row["interleaved_cas_vs_plain"] = round(_median(calls), 3)
                row.update(_cpu_row(cpus, f"cas{c}", "plain"))
                if mode == "batch":
                    row.update(_cpu_row(cpus, f"cas{c}", "same"))
                    row["same_update_per_s"] = round(_median([r["same"] for r in rounds]))
                    row["cas_vs_same"] = round(
                        _median([r[f"cas{c}"] / r["same"] for r in rounds]), 3
                    )
                say(
                    f"{mode:6} x{k} {row['code']}: CAS {row['cas_per_s']:,}/s  ratio to plain "
                    f"UPDATE {row['cas_vs_plain']}"
                    + (
                        f"  to same-columns {row['cas_vs_same']}"
                        if mode == "batch"
                        else f"  (call by call: {row['interleaved_cas_vs_plain']})"
                    )
                )
                rows.append(row)
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| code | mode | workers | rows | CAS reservations/s | plain UPDATE rows/s | CAS / plain "
        "| call by call | same-columns rows/s | CAS / same |"
    )
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mode = f"batch ({r['chunk']}/stmt)" if r["mode"] == "batch" else "single"
        same = (
            f"{r['same_update_per_s']:,} | {r['cas_vs_same']:.2f}"
            if "same_update_per_s" in r
            else "- | -"
        )
        lines.append(
            f"| {r['code']} | {mode} | {r['workers']} | {r['rows']:,} | {r['cas_per_s']:,} | "
            f"{r['plain_update_per_s']:,} | {r['cas_vs_plain']:.2f} | "
            + (f"{r['interleaved_cas_vs_plain']:.2f}" if "interleaved_cas_vs_plain" in r else "-")
            + f" | {same} |"
        )
    return "\n".join(lines)


def _cpu_table(rows: list[dict[str, Any]]) -> str:
    """CPU per row (this client process and its server backend), medians of the rounds."""

    def ms(v: float | None) -> str:
        return "?" if v is None else f"{v:.3f}"

    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    head = (
        "| code | mode | client CPU ms | server CPU ms | plain UPDATE CPU ms | plain / CAS "
        "| same-columns CPU ms | same / CAS |"
    )
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mode = f"batch ({r['chunk']}/stmt)" if r["mode"] == "batch" else "single"
        lines.append(
            f"| {r['code']} | {mode} | {ms(r['cpu_client_ms'])} | {ms(r['cpu_server_ms'])} | "
            f"{ms(r['cpu_plain_ms'])} | {ratio(r['cpu_cas_vs_plain'])} | "
            + (
                f"{ms(r['cpu_same_ms'])} | {ratio(r['cpu_cas_vs_same'])} |"
                if "cpu_same_ms" in r
                else "- | - |"
            )
        )
    return "\n".join(lines)


_ROLES_OPS = ("reserve", "reserve_batch", "ack")


def _in_schema(url: str, schema: str) -> str:
    """`url` with its search_path set to `schema`."""
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}options=-csearch_path%3D{schema}"


def _roles_side(url: str, schema: str, roles: bool, rows: int) -> dict[str, Any]:
    """One deployment in `schema`: v1 active, policy (1, 0.2), `rows` rollouts of v1
    waiting, v2 awaiting acks from its one worker w0. With `roles`, a learner login and a
    worker login (the URLs returned); without, the admin's login does everything."""
    from rollout_lifecycle.model.backends import open_backend
    from rollout_lifecycle.model.coordinator import ActivationCoordinator
    from rollout_lifecycle.model.postgres_common import PostgresDatabase
    from rollout_lifecycle.model.postgres_setup import party_logins, setup_roles
    from rollout_lifecycle.model.records import AdmissionPolicy, WorkerAck
    from rollout_lifecycle.model.registry import set_admission_policy

    admin = _in_schema(url, schema)
    with open_backend(admin) as b:
        # the policy is the operator's to record (a coordinator only expects it)
        set_admission_policy(b.registry, AdmissionPolicy(1, 0.2), "set by the operator")
        coord = ActivationCoordinator(
            b.registry, ["w0"], ledger=b.ledger, policy=AdmissionPolicy(1, 0.2)
        )
        for v in (1, 2):
            coord.prepare(v, rollback_version=None)
            coord.commit_artifact(v, HASH if v == 1 else "c" * 64)
            coord.distribute(v)
            if v == 1:
                token = coord.attempt_token("w0", 1)
                coord.record_ack(WorkerAck("w0", 1, HASH, token=token))
                assert coord.try_activate(1).activated
        rids = _ids(0, rows, schema)
        for i in range(0, rows, 5000):
            b.ledger.add_many([_entry(r) for r in rids[i : i + 5000]])  # type: ignore[attr-defined]
    learner = worker = admin
    if roles:
        db = PostgresDatabase(admin).acquire()
        try:
            setup_roles(db)
            tag = f"bench{os.getpid()}"
            made = party_logins(
                db,
                admin,
                {f"{tag}_learner": ("learner", None), f"{tag}_worker": ("worker", "w0")},
            )
        finally:
            db.release()
        learner, worker = made[f"{tag}_learner"], made[f"{tag}_worker"]
    return {"rids": rids, "learner": learner, "worker": worker, "admin": admin}


def _time_ops(calls: Sequence[Any], pid: int, between: Any = None) -> tuple[float, float | None]:
    """(wall ms, CPU ms client + server) per call, running `calls` in order; the CPU is
    None when the server backend could not be read before and after (another machine's
    server, or the pool replaced the connection meanwhile). `between`, when given, runs
    untimed before each call (on another connection: the backend `pid` does none of it)."""
    if between is None:
        s0, c0, w0 = _cpu_of(pid), time.process_time(), time.perf_counter()
        for call in calls:
            call()
        wall, client, s1 = time.perf_counter() - w0, time.process_time() - c0, _cpu_of(pid)
        if s0 is None or s1 is None:
            return 1e3 * wall / len(calls), None
        return 1e3 * wall / len(calls), 1e3 * (client + s1 - s0) / len(calls)
    wall = client = 0.0
    server: float | None = 0.0
    for call in calls:
        between()
        s0, c0, w0 = _cpu_of(pid), time.process_time(), time.perf_counter()
        call()
        wall, client = wall + time.perf_counter() - w0, client + time.process_time() - c0
        s1 = _cpu_of(pid)
        server = None if server is None or s0 is None or s1 is None else server + s1 - s0
    cpu = None if server is None else 1e3 * (client + server) / len(calls)
    return 1e3 * wall / len(calls), cpu


def run_roles(
    url: str,
    *,
    rounds: int = 5,
    single_n: int = 200,
    batches: int = 4,
    chunk: int = 250,
    acks: int = 200,
    progress: Any = None,
) -> dict[str, Any]:
    """Per-operation cost with roles against without, in one run: the same deployment in
    two schemas of one database, one with `deployment roles` and a login per party, one
    with none (the admin's login); `reserve`, `reserve_batch(chunk)` and a worker's `ack`
    timed in interleaved rounds (the order flips each round), one process, one connection
    each. Medians of wall and CPU (client + the server backend's) per operation, and the
    median of the per-round ratios roles / none."""
    from rollout_lifecycle.model.coordinator import ActivationCoordinator
    from rollout_lifecycle.model.postgres_ledger import PostgresLedger
    from rollout_lifecycle.model.postgres_registry import PostgresRegistry
    from rollout_lifecycle.model.records import WorkerAck

    say = progress or (lambda _t: None)
    per_round = single_n + batches * chunk
    sides = {
        mode: _roles_side(url, f"roles_{mode}", mode == "on", rounds * per_round + 1)
        for mode in ("off", "on")
    }
    load = [os.getloadavg()]
    open_: dict[str, Any] = {}
    admins: dict[str, Any] = {}  # the operator's coordinator: a fresh attempt for each ack
    for mode, side in sides.items():
        led = PostgresLedger(side["learner"], pool_size=1)
        reg = PostgresRegistry(side["worker"], pool_size=1)
        coord = ActivationCoordinator(reg)
        admins[mode] = ActivationCoordinator(PostgresRegistry(side["admin"], pool_size=1))
        token = coord.attempt_token("w0", 2)
        open_[mode] = (led, reg, coord, token, led.db.read(_backend_pid), reg.db.read(_backend_pid))
        led.reserve(side["rids"][-1], 0, "warm", _stamp())  # pools and plans warmed
        coord.record_ack(WorkerAck("w0", 2, "c" * 64, seq=0, token=token))
    results: dict[str, list[float | None]] = {
        f"{op}:{mode}:{m}": []
        for op in _ROLES_OPS
        for mode in ("off", "on")
        for m in ("wall", "cpu")
    }
    seq = {"off": 1, "on": 1}
    for r in range(rounds):
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        for mode in order:
            led, reg, coord, token, _, _ = open_[mode]
            # the backends serving them now (a pool may have replaced a connection)
            lpid, rpid = led.db.read(_backend_pid), reg.db.read(_backend_pid)
            rids = sides[mode]["rids"][r * per_round : (r + 1) * per_round]
            stamp = _stamp()
            singles = [
                functools.partial(_reserve_one, led, rid, f"u{mode}{r}", stamp)
                for rid in rids[:single_n]
            ]
            batch = [
                functools.partial(
                    _reserve_many,
                    led,
                    f"b{mode}{r}.{k}",
                    rids[single_n + k * chunk : single_n + (k + 1) * chunk],
                    stamp,
                )
                for k in range(batches)
            ]
            # a token counts once (issue 31): each ack is of a fresh attempt, which the
            # operator's login makes untimed before it
            fresh = {"token": token}
            acked = [functools.partial(_ack, coord, fresh, seq[mode] + i + 1) for i in range(acks)]
            seq[mode] += acks
            renew = functools.partial(_fresh_attempt, admins[mode], fresh)
            for op, calls, pid, between in (
                ("reserve", singles, lpid, None),
                ("reserve_batch", batch, lpid, None),
                ("ack", acked, rpid, renew),
            ):
                wall, cpu = _time_ops(calls, pid, between)
                results[f"{op}:{mode}:wall"].append(wall)
                results[f"{op}:{mode}:cpu"].append(cpu)
        say(f"round {r + 1}/{rounds} done")
    load.append(os.getloadavg())
    for led, reg, *_ in open_.values():
        led.close()
        reg.close()
    for admin in admins.values():
        admin.registry.close()
    out: dict[str, Any] = {"load": load, "rounds": rounds, "ops": {}}
    for op in _ROLES_OPS:
        row: dict[str, Any] = {}
        for m in ("wall", "cpu"):
            # rounds where both sides were measured (a CPU figure may be missing)
            pairs = [
                (a, b)
                for a, b in zip(results[f"{op}:off:{m}"], results[f"{op}:on:{m}"], strict=True)
                if a is not None and b is not None
            ]
            row[f"off_{m}_ms"] = _median([a for a, _ in pairs]) if pairs else None
            row[f"on_{m}_ms"] = _median([b for _, b in pairs]) if pairs else None
            row[f"ratio_{m}"] = _median([b / a for a, b in pairs]) if pairs else None
            row[f"rounds_{m}"] = len(pairs)
        out["ops"][op] = row
    return out


def _reserve_one(led: Any, rid: str, update: str, stamp: Any) -> None:
    out = led.reserve(rid, 0, update, stamp)
    assert out.reserved, out


def _reserve_many(led: Any, update: str, rids: Sequence[str], stamp: Any) -> None:
    from rollout_lifecycle.model.ledger import ReserveRequest

    outs = led.reserve_batch(update, [ReserveRequest(x, 0, stamp) for x in rids])
    assert all(o.reserved for o in outs), [o.reason for o in outs if not o.reserved][:3]


def _ack(coord: Any, fresh: dict[str, str], seq: int) -> None:
    """A worker's ack of v2 echoing the token of the attempt now awaiting acks."""
    from rollout_lifecycle.model.records import WorkerAck

    got = coord.record_ack(WorkerAck("w0", 2, "c" * 64, seq=seq, token=fresh["token"]))
    assert got.counted, got


def _fresh_attempt(admin: Any, fresh: dict[str, str]) -> None:
    """The operator fails v2's attempt and distributes it again: a new token to echo."""
    admin.fail_distribution(2, "bench", "a fresh attempt for the next timed ack")
    admin.retry(2)
    fresh["token"] = admin.attempt_tokens(2)["w0"]


def _roles_table(res: dict[str, Any], chunk: int) -> str:
    def f(v: float | None, width: int) -> str:
        return f"{'-':>{width}}" if v is None else f"{v:>{width}.3f}"

    lines = [
        f"{'operation':<22}{'none ms':>10}{'roles ms':>10}{'ratio':>8}"
        f"{'none CPU':>10}{'roles CPU':>10}{'ratio':>8}{'rounds':>8}"
    ]
    for op, row in res["ops"].items():
        name = f"reserve_batch({chunk})" if op == "reserve_batch" else op
        lines.append(
            f"{name:<22}{f(row['off_wall_ms'], 10)}{f(row['on_wall_ms'], 10)}"
            f"{f(row['ratio_wall'], 8)}{f(row['off_cpu_ms'], 10)}{f(row['on_cpu_ms'], 10)}"
            f"{f(row['ratio_cpu'], 8)}{row['rounds_cpu']:>8}"
        )
    first, last = res["load"][0], res["load"][-1]
    lines.append(
        f"(ms per operation, medians of {res['rounds']} rounds, CPU over the rounds where "
        "both backends were read; ratio = roles / none, median of per-round ratios; load "
        f"average {first[0]:.2f} -> {last[0]:.2f})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: print the table (and write JSON with --json)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="postgresql:// URL (default: start a throwaway server)")
    ap.add_argument("--workers", default="1,4,8", help="comma-separated worker counts")
    ap.add_argument("--single-n", type=int, default=1500, help="rollouts per worker, single")
    ap.add_argument("--batch-n", type=int, default=10_000, help="rollouts per worker, batch")
    ap.add_argument("--chunk", type=int, default=250, help="rollouts per batch statement")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds (medians)")
    ap.add_argument(
        "--roles",
        action="store_true",
        help="instead: per-operation cost (reserve, reserve_batch(--chunk), ack) with PostgreSQL "
        "roles against without, in one run (--repeats rounds, default 5)",
    )
    ap.add_argument("--acks", type=int, default=600, help="acks per round, with --roles")
    ap.add_argument(
        "--code",
        type=Path,
        action="append",
        help="measure the CAS of the rollout_lifecycle in this checkout (repeatable: each "
        "round runs every one; default: this checkout)",
    )
    args = ap.parse_args(argv)
    codes = tuple(str(c.resolve()) for c in args.code) if args.code else (None,)
    workers = tuple(int(x) for x in args.workers.split(","))
    server = None
    url = args.url
    if url is None:
        from tests.pg_server import create_server, new_database

        server = create_server()
        url = new_database(server, "bench")
        print(f"throwaway server on port {server.port} (fsync off, synchronous_commit on)")
    if args.roles:
        try:
            res = run_roles(
                url,
                rounds=max(args.repeats, 5) if args.repeats == 1 else args.repeats,
                single_n=args.single_n,
                batches=max(1, args.batch_n // args.chunk),
                chunk=args.chunk,
                acks=args.acks,
                progress=print,
            )
        finally:
            if server is not None:
                server.remove()
        print()
        print(_roles_table(res, args.chunk))
        if args.json is not None:
            from rollout_lifecycle.model.atomic import atomic_write

            atomic_write(args.json, json.dumps(res, indent=2) + "\n")
        return 0
    try:
        rows = run_bench(
            url,
            workers=workers,
            single_n=args.single_n,
            batch_n=args.batch_n,
            chunk=args.chunk,
            repeats=args.repeats,
            codes=codes,
            progress=print,
        )
    finally:
        if server is not None:
            server.remove()
    print()
    print(_table(rows))
    print()
    print(_cpu_table(rows))
    if args.json is not None:
        from rollout_lifecycle.model.atomic import atomic_write

        atomic_write(args.json, json.dumps({"rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
