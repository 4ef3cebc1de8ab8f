"""Benchmarks, reported as ratios against a baseline measured in the same run.

These machines are noisy, so no absolute target is asserted anywhere: each line compares two
ways of doing one job, timed back to back, best of several repeats.

    python benchmarks/run.py            # all
    python benchmarks/run.py --json out.json

1. Edge lookup: the table read off the declared machine vs firing a `transitions` trigger.
2. Admission: the vectorised batch gate vs the plain-Python single-rollout contract function.
3. Reservation: SQLite single-statement CAS and one-transaction batches vs the memory ledger.
4. Exploration: distinct states/s of the protocol models vs the TwoPhase reference spec.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_lifecycle.model.api import assess_policy_compatibility
from rollout_lifecycle.model.gate import assess_arrays
from rollout_lifecycle.model.ledger import MemoryLedger, ReserveRequest
from rollout_lifecycle.model.machines import LIFECYCLE, LIFECYCLE_STATES, LIFECYCLE_TRANSITIONS
from rollout_lifecycle.model.records import AdmissionStamp, LedgerEntry, Reward
from rollout_lifecycle.model.sqlite_ledger import SQLiteLedger
from rollout_lifecycle.spec.bounds import EXPLORER_MODELS
from rollout_lifecycle.spec.classic import TwoPhase
from rollout_lifecycle.spec.explorer import explore


def best_of(fn: Callable[[], Any], repeat: int = 5) -> float:
    """Fastest wall time of `repeat` runs (the least disturbed by the rest of the machine)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_edges(n: int = 20_000) -> dict[str, Any]:
    from transitions import Machine

    class M:
        pass

    clean = [{k: v for k, v in t.items() if k != "kind"} for t in LIFECYCLE_TRANSITIONS]
    model = M()
    machine = Machine(
        model=model,
        states=[s["name"] for s in LIFECYCLE_STATES],
        transitions=clean,
        initial="generated",
        auto_transitions=False,
    )

    def fire() -> None:
        for _ in range(n):
            machine.set_state("generated", model)
            model.reward_ready()  # type: ignore[attr-defined]

    def table() -> None:
        for _ in range(n):
            LIFECYCLE.next_state("generated", "reward_ready")

    t_fire, t_table = best_of(fire), best_of(table)
    return {
        "what": "lifecycle edge lookup, per call",
        "baseline_transitions_trigger_us": round(t_fire / n * 1e6, 3),
        "table_us": round(t_table / n * 1e6, 3),
        "speedup": round(t_fire / t_table, 1),
    }


def bench_gate(b: int = 256, t: int = 512) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    old = rng.normal(-1.0, 0.5, (b, t))
    cur = old + rng.normal(0.0, 0.02, (b, t))
    mask = rng.random((b, t)) < 0.8
    bvs = rng.integers(3, 6, b)

    def batch() -> None:
        assess_arrays(old, cur, mask, bvs, 5, 2, 0.2)

    rows = [(old[i].tolist(), cur[i].tolist(), mask[i].tolist(), int(bvs[i])) for i in range(b)]

    def single() -> None:
        for o, c, m, v in rows:
            assess_policy_compatibility(o, c, m, v, 5, 2, 0.2)

    t_single, t_batch = best_of(single, 3), best_of(batch, 5)
    return {
        "what": f"admission of {b} rollouts x {t} tokens",
        "baseline_single_python_s": round(t_single, 4),
        "batch_numpy_s": round(t_batch, 5),
        "speedup": round(t_single / t_batch, 1),
    }


STAMP = AdmissionStamp(
    current_version=0,
    behavior_version=0,
    max_lag=0,
    max_drift=0.2,
    drift=0.0,
    freshness="fresh",
    reason="ok",
    accepted=True,
)


def _fill(led: Any, n: int) -> None:
    entries = [
        LedgerEntry(
            rollout_id=f"r{i}",
            behavior_version=0,
            artifact_hash="h",
            state="rewarded",
            reward=Reward("rm", "1", 1.0),
        )
        for i in range(n)
    ]
    if hasattr(led, "add_many"):
        led.add_many(entries)
    else:
        for e in entries:
            led.add(e)


def bench_ledger(n: int = 2_000) -> dict[str, Any]:
    def single(led: Any) -> float:
        _fill(led, n)
        t0 = time.perf_counter()
        for i in range(n):
            led.reserve(f"r{i}", 0, "u", STAMP)
        return time.perf_counter() - t0

    def batch(led: Any) -> float:
        _fill(led, n)
        t0 = time.perf_counter()
        for k in range(0, n, 500):
            led.reserve_batch(
                "u", [ReserveRequest(f"r{i}", 0, STAMP) for i in range(k, min(n, k + 500))]
            )
        return time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as d:
        t_mem = min(single(MemoryLedger()) for _ in range(3))
        t_sql = min(single(SQLiteLedger(Path(d) / f"s{i}.db")) for i in range(2))
        t_sqlb = min(batch(SQLiteLedger(Path(d) / f"b{i}.db")) for i in range(2))
    return {
        "what": f"reserving {n} rollouts (winners)",
        "baseline_memory_per_s": round(n / t_mem),
        "sqlite_single_cas_per_s": round(n / t_sql),
        "sqlite_batch_500_per_s": round(n / t_sqlb),
        "sqlite_single_vs_memory": round(t_mem / t_sql, 3),
        "sqlite_batch_vs_single": round(t_sql / t_sqlb, 1),
    }


def bench_explorer() -> dict[str, Any]:
    def rate(model: Any) -> tuple[int, float]:
        t0 = time.perf_counter()
        r = explore(model)
        return r.distinct_states, time.perf_counter() - t0

    n_ref, t_ref = rate(TwoPhase(5))
    out: dict[str, Any] = {
        "what": "exhaustive BFS, distinct states per second",
        "baseline_twophase5_states_per_s": round(n_ref / t_ref),
    }
    for name in ("ledger-small", "activation-2v", "lifecycle"):
        n, t = rate(EXPLORER_MODELS[name][0]())
        out[f"{name}_states_per_s"] = round(n / t)
        out[f"{name}_vs_twophase"] = round((n / t) / (n_ref / t_ref), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    results = {}
    for name, fn in [
        ("edges", bench_edges),
        ("gate", bench_gate),
        ("ledger", bench_ledger),
        ("explorer", bench_explorer),
    ]:
        results[name] = fn()
        print(json.dumps({name: results[name]}), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
