"""The floor of a PostgreSQL reservation: the CPU (client plus server) of the statements the
design needs, with the ledger's own Python taken out, next to the baselines of issue 22.

    python benchmarks/postgres_floor.py                  # starts a throwaway server
    python benchmarks/postgres_floor.py --rounds 5 --single-n 600 --batch-n 5000
    python benchmarks/postgres_floor.py --url postgresql://user@host/db --json out.json

`postgres_bench.py` measures the real code path against its baselines; this script takes
that path apart, so a ratio the real path cannot reach is shown by the parts it is made of
rather than claimed. Every sequence runs in one process on one connection (the real
reservations on the ledger's own pooled one), on fresh rows of its own, in interleaved
rounds; the figure is CPU per row: this process's (`time.process_time`) plus its server
backend's (`/proc/<pid>/schedstat`), so other load on the machine changes it little. Each
sequence's "base / total" is the median of the per-round ratios to the baseline of its mode.

Single (baseline: `plain`, the autocommit UPDATE of `postgres_bench.py`'s single mode):

    plain          UPDATE rollouts SET lease_expires_at = ... WHERE rollout_id = ...
    same_cols      the compare-and-set UPDATE of the same columns and entry JSON a reservation
                   writes (`_CAS_ONE`), autocommit: the write itself, nothing else
    peek           the reservation's first round trip (row, premise, server time)
    cas_fn         a PL/pgSQL function doing only that compare-and-set
    cas_event_fn   one doing that and a plain INSERT of the event row (seq and txn from the
                   sequences, zero hashes): no lock, no chain, no counters, no mark
    peek+cas_fn    the two round trips of the design with nothing else in them
    fn             `ledger_write_one_*` without the premise guard (CAS, event, chain, counters,
                   mark) and `fn_guard` with it
    peek+fn_guard  both round trips as a reservation sends them, the ledger's Python canned
    reserve        `PostgresLedger.reserve`, the whole path

Batch of `--chunk` (baseline: `same`, `postgres_bench.py`'s same-columns write: one
transaction of ``UPDATE ... FROM unnest(...)`` of the same columns and JSON plus an INSERT of
the same event rows):

    cas            the batch compare-and-set statement (`CAS_MANY`) alone, one transaction
    statements     the statements of a reservation batch with every value computed before the
                   clock (locks, premise, reading the rows, the CAS, the events with their
                   chain and counters, the commit mark): the server's share of the design
    reserve_batch  `PostgresLedger.reserve_batch`, the whole path

`--statements` (throwaway server only: it loads `pg_stat_statements` with `track = all`,
so the statements inside the PL/pgSQL function are timed too) prints instead where the
server's execution time goes: per statement, microseconds per reservation, for real
single reservations and real batches, each next to the backend's whole CPU per row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.postgres_bench import (  # noqa: E402
    _SAME_EVENTS,
    _SAME_UPDATE,
    _backend_pid,
    _columns,
    _cpu_of,
    _ids,
    _planned,
    _prepare,
    _stamp,
)

# the same-columns baseline's events, written beside the ledger's (see `_floor_ddl`)
_FLOOR_EVENTS = (
    _SAME_EVENTS.replace("INTO events(", "INTO floor_events(")
    .replace("nextval('events_seq')", "nextval('floor_events_seq')")
    .replace("nextval('events_txn')", "nextval('floor_events_txn')")
)
assert "floor_events(" in _FLOOR_EVENTS and "'events_" not in _FLOOR_EVENTS

SINGLE = (
    "plain",
    "same_cols",
    "peek",
    "cas_fn",
    "cas_event_fn",
    "peek+cas_fn",
    "fn",
    "fn_guard",
    "peek+fn_guard",
    "reserve",
)
BATCH = ("same", "cas", "statements", "reserve_batch")


def _floor_ddl(cas_step: str, params: Sequence[tuple[str, str]]) -> str:
    """Two functions around the ledger's own compare-and-set step (`cas_step`, the text
    `ledger_write_one` runs, over `params`, its (name, type) parameters): the CAS alone,
    and the CAS with a bare event INSERT (no lock, chain, counters or mark). The bare event
    goes to `floor_events`, shaped like `events` with its indexes: an unchained row in
    `events` itself would break the ledger's hash chain, which every later real write
    checks (the `fn` sequences after it were refused)."""
    types = dict(params)

    def declared(*names: str) -> str:
        return ", ".join(f"{n} {types[n]}" for n in names)

    cas_args = declared(
        "p_state", "p_revision", "p_reserved_by", "p_lease", "p_entry", "p_rollout_id", "p_expected"
    )
    bare_event = """\
    INSERT INTO floor_events(seq, txn, kind, subject, payload, prev_hash, hash)
    VALUES (nextval('floor_events_seq'), nextval('floor_events_txn'), p_kind, p_rollout_id,
            p_payload, decode(repeat('00', 32), 'hex'), decode(repeat('00', 32), 'hex'));
"""
    tables = """
CREATE TABLE IF NOT EXISTS floor_events (LIKE events INCLUDING ALL);
CREATE SEQUENCE IF NOT EXISTS floor_events_seq;
CREATE SEQUENCE IF NOT EXISTS floor_events_txn;"""
    return tables + "".join(
        f"""
CREATE OR REPLACE FUNCTION {name}({args})
RETURNS text LANGUAGE plpgsql AS $$
BEGIN
{cas_step}{then}    RETURN 'won';
END
$$;"""
        for name, args, then in (
            ("floor_cas_only", cas_args, ""),
            ("floor_cas_event", f"{cas_args}, {declared('p_kind', 'p_payload')}", bare_event),
        )
    )


def _measure(fn: Callable[[Any], Any], items: list[Any], pid: int) -> tuple[float, float]:
    """CPU ms per item: (client, server) while `fn` runs over `items`."""
    s0, c0 = _cpu_of(pid), time.process_time()
    for item in items:
        fn(item)
    client, s1 = time.process_time() - c0, _cpu_of(pid)
    if s0 is None or s1 is None:
        raise RuntimeError("the server's processes are not visible here; run it locally")
    return 1e3 * client / len(items), 1e3 * (s1 - s0) / len(items)


def run_floor(
    url: str, *, rounds: int = 3, single_n: int = 600, batch_n: int = 5000, chunk: int = 250
) -> dict[str, dict[str, Any]]:
    """Per sequence: median client, server and total CPU ms per row, and the median of the
    per-round ratios baseline / total (`plain` for single, `same` for batch)."""
    import psycopg

    from rollout_lifecycle.model import postgres_functions as pf
    from rollout_lifecycle.model import postgres_ledger as pl
    from rollout_lifecycle.model.events import entry_events, event_subject
    from rollout_lifecycle.model.ledger import ReserveRequest
    from rollout_lifecycle.model.postgres_common import append_events
    from rollout_lifecycle.model.postgres_ledger import PostgresLedger

    schema = "floor"
    single_tags = [f"s{k}r{r}" for r in range(rounds) for k in range(len(SINGLE))]
    batch_tags = [f"b{k}r{r}" for r in range(rounds) for k in range(len(BATCH))]
    _prepare(url, schema, 1, single_n + 1, tuple(single_tags))
    # the batch rows in the same schema (one registry): add them through a ledger
    led = PostgresLedger(url, schema=schema, pool_size=1)
    from benchmarks.postgres_bench import _entry

    for tag in batch_tags:
        rids = _ids(0, batch_n, tag)
        for i in range(0, batch_n, 5000):
            led.add_many([_entry(r) for r in rids[i : i + 5000]])
    conn = psycopg.connect(url, autocommit=True, options=f"-c search_path={schema}")
    conn.execute(_floor_ddl(pl._CAS_STEP, pl._WRITE_ONE_ARGS))
    stamp = _stamp()
    cpid, lpid = _backend_pid(conn), led.db.read(_backend_pid)
    spare = _ids(0, single_n + 1, single_tags[0])[-1]  # one reservation for its texts
    assert led.reserve(spare, 0, "u0", stamp).reserved
    row = conn.execute("SELECT entry FROM rollouts WHERE rollout_id = %s", (spare,)).fetchone()
    ev = conn.execute(
        "SELECT payload FROM events WHERE kind = 'entry' AND subject = %s", (spare,)
    ).fetchone()
    # the premise a single reservation of these rows peeks (of their version and the stamp's)
    judged = [stamp.current_version]
    prem = conn.execute(pl._PEEK, (judged, spare, spare, "u0")).fetchone()
    assert row is not None and ev is not None and prem is not None
    entry, payload, premise = str(row[0]), str(ev[0]), str(prem[3])

    def peek(rid: str) -> None:
        conn.execute(pl._PEEK, (judged, rid, rid, "u0")).fetchone()

    def pair(first: Callable[[str], None], then: Callable[[str], None]) -> Callable[[str], None]:
        def both(rid: str) -> None:
            first(rid)
            then(rid)

        return both

    def cas_fn(rid: str) -> None:
        got = conn.execute(
            "SELECT floor_cas_only(%s, %s, %s, %s, %s, %s, %s)",
            ("reserved", 1, "u", time.time(), entry, rid, 0),
        ).fetchone()
        assert got is not None and got[0] == "won", got

    def cas_event_fn(rid: str) -> None:
        got = conn.execute(
            "SELECT floor_cas_event(%s, %s, %s, %s, %s, %s, %s, %s, %s)",
            ("reserved", 1, "u", time.time(), entry, rid, 0, "entry", payload),
        ).fetchone()
        assert got is not None and got[0] == "won", got

    def fn(rid: str, guard: int) -> None:
        # the update the spare reservation recorded: the write function guards its status
        args = ("reserve", guard, premise if guard else None, "reserved", 1, "u0", time.time())
        args = (*args, entry, rid)
        counters = ("{reservations,writes}", "{1,1}")
        got = conn.execute(
            pl._WRITE_ONE_CALL,
            (*args, 0, "entry", payload, *counters, None, os.urandom(16).hex()),
        ).fetchone()
        assert got is not None and got[0] == "won", got

    single: dict[str, tuple[Callable[[Any], Any], int]] = {
        "plain": (
            lambda r: conn.execute(
                "UPDATE rollouts SET lease_expires_at = %s WHERE rollout_id = %s",
                (time.time(), r),
            ),
            cpid,
        ),
        "same_cols": (
            lambda r: conn.execute(pl._CAS_ONE, ("reserved", 1, "u", time.time(), entry, r, 0)),
            cpid,
        ),
        "peek": (peek, cpid),
        "cas_fn": (cas_fn, cpid),
        "cas_event_fn": (cas_event_fn, cpid),
        "peek+cas_fn": (pair(peek, cas_fn), cpid),
        "fn": (lambda r: fn(r, 0), cpid),
        "fn_guard": (lambda r: fn(r, 2), cpid),
        "peek+fn_guard": (pair(peek, lambda r: fn(r, 2)), cpid),
        "reserve": (lambda r: led.reserve(r, 0, "u", stamp).reserved or _lost(r), lpid),
    }

    def chunks(tag: str) -> list[Any]:
        """The batch's rows of `tag` in chunks, each with everything its statements send,
        built before the clock: the CAS's columns, the same-columns baseline's, the events."""
        rids = _ids(0, batch_n, tag)
        rows, payloads = _planned(rids, "u0")
        out = []
        for i in range(0, batch_n, chunk):
            part, pays = rows[i : i + chunk], payloads[i : i + chunk]
            ids, *cols = _columns(part)
            cas = (ids, [0] * len(part), *cols)
            same = (ids, *cols, ids)
            before = [_entry(r) for r in ids]
            evs = entry_events(
                [("reserve", b, a, "u0") for b, (a, _) in zip(before, part, strict=True)],
                time.time(),
            )
            out.append((ids, cas, same, pays, evs))
        return out

    prologue = f"BEGIN; {pl._LOCKS['premise']}"  # what `reserve_batch`'s step takes

    def same_batch(c: Any) -> None:
        ids, _, same, pays, _ = c
        with conn.transaction():
            conn.execute(_SAME_UPDATE, same)
            conn.execute(_FLOOR_EVENTS, (ids, pays, [bytes(32)] * len(ids)))

    def cas_batch(c: Any) -> None:
        ids, expected, states, revisions, owners, leases, entries = c[1]
        named = {
            "ids": ids,
            "expected": expected,
            "states": states,
            "revisions": revisions,
            "owners": owners,
            "leases": leases,
            "entries": entries,
            "edges": ["rewarded>reserved"],
            "versions": None,  # no registry: the stamp alone, as in `_prepare`
        }
        with conn.transaction():
            got = conn.execute(pf.CAS_MANY, named).fetchall()
        assert len(got) == len(c[0]), len(got)

    def statements(c: Any) -> None:
        ids, cas, _, pays, evs = c
        conn.execute(prologue)
        try:
            conn.execute(f"SELECT {pl._NOW}, {pl._PREMISE}").fetchone()
            conn.execute(
                "SELECT rollout_id, entry FROM rollouts WHERE rollout_id = ANY(%s::text[])",
                (ids,),
            ).fetchall()
            got = conn.execute(pl._WRITE_ROWS, ("reserve_batch", *cas)).fetchall()
            assert len(got) == len(ids), len(got)
            text = dict(zip(ids, pays, strict=True))  # by subject: one event per row
            append_events(
                conn,
                evs,
                counters={"reservations": len(ids), "writes": len(ids)},
                payload_of=lambda e, _: text[event_subject(e)],
                stamped=False,
                op="reserve_batch",
            )
            conn.execute(f"SELECT rl_mark('{os.urandom(16).hex()}'); COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def reserve_batch(c: Any) -> None:
        ids = c[0]
        got = led.reserve_batch(f"b{ids[0]}", [ReserveRequest(r, 0, stamp) for r in ids])
        assert all(o.reserved for o in got)

    batch: dict[str, tuple[Callable[[Any], Any], int]] = {
        "same": (same_batch, cpid),
        "cas": (cas_batch, cpid),
        "statements": (statements, cpid),
        "reserve_batch": (reserve_batch, lpid),
    }
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in (*SINGLE, *BATCH)}
    for rnd in range(rounds):
        for k, name in enumerate(SINGLE):
            fn_, pid = single[name]
            got[name].append(_measure(fn_, _ids(0, single_n, f"s{k}r{rnd}"), pid))
        for k, name in enumerate(BATCH):
            fn_, pid = batch[name]
            items = chunks(f"b{k}r{rnd}")
            c, s = _measure(fn_, items, pid)
            got[name].append((c / chunk, s / chunk))  # per row
    conn.close()
    led.close()
    out: dict[str, dict[str, Any]] = {}
    for names, base in ((SINGLE, "plain"), (BATCH, "same")):
        for name in names:
            runs = got[name]
            out[name] = {
                "client_ms": statistics.median(c for c, _ in runs),
                "server_ms": statistics.median(s for _, s in runs),
                "total_ms": statistics.median(c + s for c, s in runs),
                "base_vs_total": statistics.median(
                    (bc + bs) / (c + s) for (c, s), (bc, bs) in zip(runs, got[base], strict=True)
                ),
            }
    return out


def statement_profile(
    url: str, *, single_n: int = 2000, batch_n: int = 5000, chunk: int = 250
) -> str:
    """Where a reservation's server time goes: `pg_stat_statements` (which must be loaded,
    `track = all`) over `single_n` real reservations, then over `batch_n` rows reserved in
    batches of `chunk`; execution microseconds per row by statement, and the backend's CPU
    per row (execution plus protocol, parse and bind, COMMIT)."""
    import psycopg

    from rollout_lifecycle.model.ledger import ReserveRequest
    from rollout_lifecycle.model.postgres_ledger import PostgresLedger

    schema = "profile"
    _prepare(url, schema, 1, max(single_n, batch_n) + 50, ("s", "b", "x"))
    admin = psycopg.connect(url, autocommit=True)
    admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    led = PostgresLedger(url, schema=schema, pool_size=1)
    stamp = _stamp()
    pid = led.db.read(_backend_pid)
    lines = []
    top = (
        "SELECT calls, total_exec_time, left(regexp_replace(query, '\\s+', ' ', 'g'), 90) "
        "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database "
        "WHERE datname = current_database()) ORDER BY total_exec_time DESC LIMIT 14"
    )

    def profile(what: str, body: Callable[[], int], pid: int = pid) -> None:
        admin.execute("SELECT pg_stat_statements_reset()")
        s0, c0 = _cpu_of(pid), time.process_time()
        n = body()
        client, s1 = time.process_time() - c0, _cpu_of(pid)
        server = None if s0 is None or s1 is None else 1e6 * (s1 - s0) / n
        lines.append(
            f"{what}: {n} rows; CPU per row: client {1e6 * client / n:.1f} us, server backend "
            + ("?" if server is None else f"{server:.1f} us")
        )
        lines.append("| calls | exec us per row | statement |")
        lines.append("|---:|---:|---|")
        for calls, total_ms, query in admin.execute(top).fetchall():
            if "pg_stat_statements" not in query:
                lines.append(f"| {calls} | {1e3 * total_ms / n:.2f} | `{query}` |")

    rids = _ids(0, max(single_n, batch_n) + 50, "s")
    for r in rids[:50]:  # warm: prepared statements, the function compiled
        led.reserve(r, 0, "u", stamp)

    def single() -> int:
        for r in rids[50 : 50 + single_n]:
            assert led.reserve(r, 0, "u", stamp).reserved
        return single_n

    def batch() -> int:
        ids = _ids(0, max(single_n, batch_n) + 50, "b")[:batch_n]
        for i in range(0, batch_n, chunk):
            part = [ReserveRequest(r, 0, stamp) for r in ids[i : i + chunk]]
            assert all(o.reserved for o in led.reserve_batch(f"u{i}", part))
        return batch_n

    conn = psycopg.connect(url, autocommit=True, options=f"-c search_path={schema}")
    rows, payloads = _planned(_ids(0, max(single_n, batch_n) + 50, "x")[:batch_n], "u0")

    def same() -> int:  # postgres_bench.py's same-columns baseline, the JSON built before
        for i in range(0, batch_n, chunk):
            ids, *cols = _columns(rows[i : i + chunk])
            with conn.transaction():
                conn.execute(_SAME_UPDATE, (ids, *cols, ids))
                conn.execute(_SAME_EVENTS, (ids, payloads[i : i + chunk], [bytes(32)] * len(ids)))
        return batch_n

    profile("single", single)
    profile(f"batch ({chunk})", batch)
    profile(f"same-columns baseline ({chunk})", same, _backend_pid(conn))
    conn.close()
    led.close()
    admin.close()
    return "\n".join(lines)


def _lost(rid: str) -> bool:
    raise AssertionError(f"reservation of {rid} lost")


def main(argv: list[str] | None = None) -> int:
    """Command line: print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="postgresql:// URL (default: start a throwaway server)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    ap.add_argument("--single-n", type=int, default=600, help="rows per single sequence")
    ap.add_argument("--batch-n", type=int, default=5000, help="rows per batch sequence")
    ap.add_argument("--chunk", type=int, default=250, help="rows per batch")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument(
        "--statements",
        action="store_true",
        help="profile the server's statements instead (pg_stat_statements; throwaway server)",
    )
    args = ap.parse_args(argv)
    server = None
    url = args.url
    if url is None:
        from tests.pg_server import create_server, new_database

        server = create_server()
        if args.statements:
            with (server.data / "postgresql.conf").open("a") as fh:
                fh.write(
                    "shared_preload_libraries = 'pg_stat_statements'\n"
                    "pg_stat_statements.track = all\n"
                )
            server.restart()
        url = new_database(server, "floor")
        print(f"throwaway server on port {server.port} (fsync off, synchronous_commit on)")
    elif args.statements:
        ap.error("--statements starts its own server (it loads pg_stat_statements)")
    try:
        if args.statements:
            print(statement_profile(url, batch_n=args.batch_n, chunk=args.chunk))
            return 0
        rows = run_floor(
            url,
            rounds=args.rounds,
            single_n=args.single_n,
            batch_n=args.batch_n,
            chunk=args.chunk,
        )
    finally:
        if server is not None:
            server.remove()
    print(f"CPU ms per row, medians of {args.rounds} interleaved rounds")
    print("| sequence | client | server | total | baseline / total |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['client_ms']:.4f} | {r['server_ms']:.4f} | {r['total_ms']:.4f} "
            f"| {r['base_vs_total']:.2f} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
