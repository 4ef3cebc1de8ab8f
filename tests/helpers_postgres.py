"""Entry points that child processes of the PostgreSQL tests run (importable by module name,
for multiprocessing's 'spawn' and for `python -c`)."""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rollout_lifecycle.model.ledger import ReserveRequest
from tests.helpers_ledger import ids, stamp


def race_thread(
    ledger: Any, base: str, n: int, seed: int, singles: int, chunk: int
) -> dict[str, Any]:
    """Try every one of the n rollouts (shuffled): `singles` by single CAS under one update,
    the rest in batches of `chunk` under one update each; commit whatever each update won."""
    order = ids(n)
    random.Random(seed).shuffle(order)
    reasons: Counter[str] = Counter()
    won: dict[str, list[str]] = {}
    commits = 0
    single_update = f"{base}.s"
    got: list[str] = []
    for rid in order[:singles]:
        out = ledger.reserve(rid, 0, single_update, stamp())
        reasons[out.reason] += 1
        if out.reserved:
            got.append(rid)
    if got:
        ledger.commit(single_update, got)
        commits += 1
        won[single_update] = got
    for i in range(singles, n, chunk):
        update = f"{base}.b{i}"
        outs = ledger.reserve_batch(
            update, [ReserveRequest(r, 0, stamp()) for r in order[i : i + chunk]]
        )
        mine = [o.rollout_id for o in outs if o.reserved]
        reasons.update(o.reason for o in outs)
        if mine:
            ledger.commit(update, mine)
            commits += 1
            won[update] = mine
    return {"won": won, "reasons": dict(reasons), "commits": commits}


def race_process(
    url: str, proc: int, n: int, threads: int, barrier: Any, results: Any, chunk: int = 250
) -> None:
    """One OS process: `threads` threads race over every rollout through one pool."""
    from rollout_lifecycle.model.postgres_ledger import PostgresLedger

    try:
        ledger = PostgresLedger(url, pool_size=threads)
        outs: list[dict[str, Any]] = []
        errors: list[str] = []
        start = threading.Barrier(threads + 1)

        def run(t: int) -> None:
            try:
                start.wait()
                outs.append(race_thread(ledger, f"p{proc}.t{t}", n, proc * 1000 + t, 50, chunk))
            except BaseException as exc:
                errors.append(repr(exc))

        workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        barrier.wait(timeout=120)  # every process is connected and about to race
        start.wait()
        for w in workers:
            w.join()
        ledger.close()
        results.put({"proc": proc, "threads": outs, "errors": errors})
    except BaseException as exc:  # the parent must see why a child failed
        results.put({"proc": proc, "threads": [], "errors": [repr(exc)]})
        raise


def _signal(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(text)
    os.replace(tmp, path)


def crash_child(url: str, update_id: str, n: int, where: str, signal: str) -> None:
    """One reserve_batch of n rollouts, then wait to be SIGKILLed.

    where='in-batch': stall after the batch's compare-and-set statement ran (its rows are
    changed and locked inside the open transaction) and before COMMIT; 'after-commit':
    stall once the batch committed.
    """
    import rollout_lifecycle.model.postgres_ledger as pl

    ledger = pl.PostgresLedger(url)
    if where == "in-batch":
        real = pl.append_events

        def stalling(conn: Any, events: Any, **kwargs: Any) -> Any:
            _signal(signal, "in-batch")
            time.sleep(600)
            return real(conn, events, **kwargs)

        vars(pl)["append_events"] = stalling  # looked up in the module at each call
    outs = ledger.reserve_batch(update_id, [ReserveRequest(r, 0, stamp()) for r in ids(n)])
    assert all(o.reserved for o in outs)
    _signal(signal, "committed")
    time.sleep(600)


def lease_child(url: str, update_id: str, signal: str) -> None:
    """A learner that reserves every waiting rollout with a one-hour lease, then dies."""
    from rollout_lifecycle.model.postgres_ledger import PostgresLedger

    ledger = PostgresLedger(url, lease_seconds=3600.0)
    waiting = ledger.in_state("rewarded")
    reqs = [ReserveRequest(e.rollout_id, e.revision, stamp(e.behavior_version)) for e in waiting]
    outs = ledger.reserve_batch(update_id, reqs)
    assert outs and all(o.reserved for o in outs)
    _signal(signal, "reserved")
    time.sleep(600)
