"""Issue 22's speed figures for `rollout-lifecycle bench`, each next to its baseline.

Like the rest of the report (cli/benchmarks.py), nothing here is a pass/fail on time: every
figure is a ratio to a baseline doing the same work, timed in the same run, the variants
interleaved (A B A B ...) and the median of the repeats kept.

- gate: `assess_arrays` on CPU tensors per dtype (float32, bfloat16, float16) and torch
  thread count, against the bare torch expression on the same tensors; the records path
  (`AdmissionGate.assess_batch`) against the array path on float32, the two timed as a
  pair of their own (`_records_pair`), and the records path's floor (RECORDS_FLOOR).
- admit: the `admit` command's read-parse-gate-write loop against a plain loop that reads
  the same file with json.loads, takes the masked mean with numpy and writes one decision
  line per rollout.
- startup: the modules `rollout-lifecycle --help` imports (`python -X importtime`), and its
  wall time next to the bare interpreter's.
- ledger-check: `rollout-lifecycle ledger check` seconds per event on SQLite ledgers of
  three sizes (three events per rollout), built through the public API: wall time, and the
  check's own CPU time (`cpu_s`), which the other work on a shared machine cannot inflate.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from rollout_lifecycle.cli import benchmarks as B

Progress = Callable[[str], None]
Goal = Callable[..., dict[str, Any]]  # (what, measured, target, load1=None)

PARTS = ("gate", "admit", "startup", "ledger-check")


@attrs.frozen
class SpeedSizes:
    """How much work each of these parts does."""

    gate_batches: tuple[int, ...]
    gate_widths: tuple[int, ...]
    gate_threads: tuple[int, ...]
    repeats: int
    admit_rollouts: int
    admit_tokens: int
    admit_repeats: int
    check_rollouts: tuple[int, ...]
    check_repeats: int


FULL = SpeedSizes(
    gate_batches=(256, 1024, 4096),
    gate_widths=(1024, 4096),
    gate_threads=(1, 2),
    repeats=7,
    admit_rollouts=16_384,
    admit_tokens=256,
    admit_repeats=5,
    check_rollouts=(1_000, 10_000, 100_000),
    check_repeats=5,
)
QUICK = SpeedSizes(
    gate_batches=(64,),
    gate_widths=(256,),
    gate_threads=(1, 2),
    repeats=2,
    admit_rollouts=200,
    admit_tokens=64,
    admit_repeats=1,
    check_rollouts=(30, 100),
    check_repeats=1,
)
DTYPES = ("float32", "bfloat16", "float16")


def _nothing(_: str) -> None:
    return None


def interleaved_wall_cpu(
    variants: dict[str, Callable[[], Any]], repeats: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall and CPU time (s; CPU: this process's, which other work on a shared
    machine inflates less) of each variant, the variants run in turn `repeats` times.

    The order rotates each round, so every variant follows every other equally often: what
    one leaves behind (caches it evicted, torch's worker threads still spinning on the other
    core) weighs on all alike, not always on the one after it."""
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants.items())
    for r in range(repeats):
        k = r % len(order) if order else 0
        for name, fn in order[k:] + order[:k]:
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    return (
        {name: statistics.median(ts) for name, ts in wall.items()},
        {name: statistics.median(ts) for name, ts in cpu.items()},
    )


def interleaved_medians(variants: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median wall time (s) of each variant: `interleaved_wall_cpu`'s wall part."""
    return interleaved_wall_cpu(variants, repeats)[0]


def _rounded(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


# ---- gate ------------------------------------------------------------------------------------


def bare_expression(old: Any, cur: Any, mask: Any) -> Any:
    """The masked mean |cur - old| per row as plain torch ops: what the gate is timed
    against (each op one pass over B x T, with its own thread fork/join)."""
    return ((cur - old).abs() * mask).sum(1) / mask.sum(1)


def gate_threads(torch_threads: int) -> int:
    """The threads the gate computes with at this torch thread count: up to two torch
    threads its kernel runs on the calling thread alone (model/gate.py, _SPLIT_FROM_THREADS),
    from three on that many threads."""
    from rollout_lifecycle.model import gate

    return 1 if torch_threads < gate._SPLIT_FROM_THREADS else torch_threads


def warm_bare_expression(torch: Any, old: Any, cur: Any, mask: Any) -> Callable[[], Any]:
    """The bare expression made as fair to it as the gate is to itself: its B x T
    temporaries allocated once and reused (the gate keeps warm scratch; fresh temporaries
    cost the bare expression thousands of minor page faults a call at large shapes), run
    with the threads the gate computes with (`gate_threads`: torch's OpenMP workers on
    more threads than that were oversubscribed on a busy machine)."""
    compute = torch.float64 if torch.float64 in (old.dtype, cur.dtype) else torch.float32
    d = torch.empty(old.shape, dtype=compute)
    s = torch.empty(old.shape[0], dtype=compute)
    c = torch.empty(old.shape[0], dtype=torch.int64)
    m = mask.to(compute)

    def run() -> Any:
        before = torch.get_num_threads()
        want = gate_threads(before)
        if want != before:
            torch.set_num_threads(want)
        try:
            if old.dtype == compute and cur.dtype == compute:
                torch.sub(cur, old, out=d)
            else:
                d.copy_(cur)
                d.sub_(old)
            d.abs_()
            d.mul_(m)
            torch.sum(d, 1, out=s)
            torch.sum(mask, 1, out=c)
            return s / c
        finally:
            if want != before:
                torch.set_num_threads(before)

    return run


def _gate_variants(
    torch: Any, gate: Any, data: dict[str, Any], rollouts: list[Any], dtype: str
) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[], Any]]]:
    """The gate and the bare expression on the same tensors; and, for float32, the pair
    that the records path is judged by: the gate (the array path) and the records path
    over the same rows, with the same current log-probs (else empty)."""
    from rollout_lifecycle.model.gate import assess_arrays

    old = torch.from_numpy(data["old"]).to(getattr(torch, dtype))
    cur = torch.from_numpy(data["cur"]).to(getattr(torch, dtype))
    mask = torch.from_numpy(data["mask"])
    bvs = data["bvs"]
    warm = warm_bare_expression(torch, old, cur, mask)

    def arrays() -> Any:
        return assess_arrays(old, cur, mask, bvs, B.CURRENT, B.MAX_LAG, B.MAX_DRIFT)

    variants: dict[str, Callable[[], Any]] = {
        "gate": arrays,
        "bare": lambda: bare_expression(old, cur, mask),
        "bare_warm": warm,
    }
    pair: dict[str, Callable[[], Any]] = {}
    if dtype == "float32":
        pair = {"arrays": arrays, "records": lambda: gate.assess_batch(rollouts, cur, B.CURRENT)}
    return variants, pair


def _records_pair(
    pair: dict[str, Callable[[], Any]],
    repeats: int,
    progress: Progress,
    b: int,
    t: int,
    threads: int,
) -> dict[str, Any]:
    """The records path against the array path, the two alone, interleaved and rotated
    (an even number of repeats: each goes first as often), both warmed up, with the
    torch threads of the row: wall and CPU medians and their ratios, and the load.

    Alone, not inside the gate/bare rotation: the bare expression's fresh B x T
    temporaries (the kernel zeroing their pages) and torch's workers spinning after its
    ops weigh on whichever call follows it, and a rotation of four variants over an odd
    number of repeats puts the records path after it more often than the array path
    (issue 36: 5.3x at B=256 T=1024 on 2 threads there, 1.8 to 2.1x in a pair). Twice the
    gate part's repeats: a pair is cheap, and its ratio is the goal."""
    load = B.load1()
    progress(f"gate records path / array path B={b} T={t} threads={threads} (load {load})")
    for fn in pair.values():  # warm up: first touch
        fn()
    wall, cpu = interleaved_wall_cpu(pair, 2 * repeats)  # even: each first as often
    return {
        "records_ms": {k: round(v * 1e3, 4) for k, v in wall.items()},
        "records_cpu_ms": {k: round(v * 1e3, 4) for k, v in cpu.items()},
        "records_vs_arrays": _rounded(B._ratio(wall["records"], wall["arrays"])),
        "records_vs_arrays_cpu": _rounded(B._ratio(cpu["records"], cpu["arrays"])),
        "records_load1": load,
    }


def bench_gate(sizes: SpeedSizes, progress: Progress = _nothing) -> dict[str, Any] | None:
    """Gate against the bare torch expression per dtype, shape and thread count (None
    without torch)."""
    torch = B._optional_torch()
    if torch is None:
        return None
    from rollout_lifecycle.model.gate import AdmissionGate, GatePolicy

    gate = AdmissionGate(GatePolicy(B.MAX_LAG, B.MAX_DRIFT, B.CONDITIONS), registry=B.REGISTRY)
    rows: list[dict[str, Any]] = []
    before = torch.get_num_threads()
    try:
        for b in sizes.gate_batches:
            for t in sizes.gate_widths:
                data = B._batch(b, t)
                rollouts = B._records(data)
                for threads in sizes.gate_threads:
                    torch.set_num_threads(threads)
                    for dtype in DTYPES:
                        load = B.load1()
                        progress(f"gate torch {dtype} B={b} T={t} threads={threads} (load {load})")
                        variants, pair = _gate_variants(torch, gate, data, rollouts, dtype)
                        for fn in variants.values():  # warm up: first touch, imports
                            fn()
                        med = interleaved_medians(variants, sizes.repeats)
                        row: dict[str, Any] = {
                            "dtype": dtype,
                            "B": b,
                            "T": t,
                            "threads": threads,
                            "ms": {k: round(v * 1e3, 4) for k, v in med.items()},
                            "gate_vs_bare": _rounded(B._ratio(med["gate"], med["bare"])),
                            "gate_vs_bare_warm": _rounded(B._ratio(med["gate"], med["bare_warm"])),
                            "bare_warm_threads": gate_threads(threads),
                            "load1": load,
                            "records_vs_arrays": None,
                        }
                        if pair:
                            row.update(_records_pair(pair, sizes.repeats, progress, b, t, threads))
                        rows.append(row)
    finally:
        torch.set_num_threads(before)
    return {
        "what": "assess_arrays on CPU tensors vs ((cur - old).abs() * mask).sum(1) / "
        "mask.sum(1) on the same tensors; records: AdmissionGate.assess_batch over Rollout "
        "records (float32 evidence) with float32 current log-probs, timed against the array "
        "path in a pair of their own",
        "torch": str(torch.__version__),
        "repeats": sizes.repeats,
        "rows": rows,
    }


# ---- admit -----------------------------------------------------------------------------------

_CONDITIONS = {
    "tokenizer_id": "tok",
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_tokens": 1 << 20,
}


def _admit_input(path: Path, n: int, tokens: int) -> None:
    """`n` rollouts of tokens/2..tokens tokens (80% actions), versions 3..5, as JSONL."""
    rng = random.Random(0)
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            k = rng.randint(max(1, tokens // 2), tokens)
            old = [round(-3 * rng.random(), 4) for _ in range(k)]
            row = {
                "rollout_id": f"r{i}",
                "prompt_id": f"p{i}",
                "dataset": "bench",
                "sample_index": 0,
                "behavior_version": rng.randint(3, 5),
                "artifact_hash": "h",
                "conditions": _CONDITIONS,
                "response_token_ids": [rng.randrange(50_000) for _ in range(k)],
                "action_mask": [rng.random() < 0.8 for _ in range(k)],
                "behavior_log_probs": old,
                "current_log_probs": [round(o + rng.gauss(0, 0.02), 4) for o in old],
            }
            f.write(json.dumps(row) + "\n")


def _plain_admit(src: Path, dst: Path, current: int, max_lag: int, max_drift: float) -> None:
    """The baseline: json.loads per line, the masked mean with numpy, lag and drift
    decided, one JSON decision line written per rollout."""
    with src.open("rb") as f, dst.open("w", encoding="utf-8") as out:
        for line in f:
            r = json.loads(line)
            old = np.asarray(r["behavior_log_probs"], np.float64)
            cur = np.asarray(r["current_log_probs"], np.float64)
            mask = np.asarray(r["action_mask"], np.bool_)
            k = int(np.count_nonzero(mask))
            lag = current - r["behavior_version"]
            drift = float(np.abs(cur[mask] - old[mask]).sum()) / k if k else None
            ok = drift is not None and 0 <= lag <= max_lag and drift <= max_drift
            decision = {"rollout_id": r["rollout_id"], "accepted": ok, "drift": drift, "lag": lag}
            out.write(json.dumps(decision, separators=(",", ":")) + "\n")


def bench_admit(sizes: SpeedSizes, progress: Progress = _nothing) -> dict[str, Any]:
    """The admit loop against the plain loop, on the same file, in one run."""
    from rollout_lifecycle.cli import admit_cmd
    from rollout_lifecycle.model.gate import AdmissionGate, GatePolicy

    n, tokens = sizes.admit_rollouts, sizes.admit_tokens
    gate = AdmissionGate(GatePolicy(B.MAX_LAG, B.MAX_DRIFT))
    with tempfile.TemporaryDirectory(prefix="rl-bench-admit-") as tmp:
        src = Path(tmp) / "in.jsonl"
        progress(f"admit: writing {n} rollouts of up to {tokens} tokens")
        _admit_input(src, n, tokens)

        def admit() -> None:
            admit_cmd._run(
                src, Path(tmp) / "admit.jsonl", gate, B.CURRENT, admit_cmd.DEFAULT_CHUNK, True, True
            )

        def plain() -> None:
            _plain_admit(src, Path(tmp) / "plain.jsonl", B.CURRENT, B.MAX_LAG, B.MAX_DRIFT)

        load = B.load1()
        progress(f"admit: {sizes.admit_repeats} interleaved repeats (load {load})")
        variants = {"admit": admit, "plain_loop": plain}
        for fn in variants.values():
            fn()
        med = interleaved_medians(variants, sizes.admit_repeats)
        size = src.stat().st_size
    return {
        "what": "the admit command's loop (admit_cmd._run: read, parse and validate, gate in "
        "chunks, write decisions atomically) vs a plain loop (json.loads per line, numpy "
        "masked mean, lag and drift decided, one JSON decision line written)",
        "rollouts": n,
        "max_tokens": tokens,
        "input_bytes": size,
        "s": {k: round(v, 4) for k, v in med.items()},
        "admit_vs_plain_loop": _rounded(B._ratio(med["admit"], med["plain_loop"])),
        "load1": load,
    }


# ---- startup ---------------------------------------------------------------------------------

_FORBIDDEN = ("hypothesis", "torch")


def bench_startup(repeats: int, progress: Progress = _nothing) -> dict[str, Any]:
    """What `rollout-lifecycle --help` imports, and its wall time next to a bare start."""
    progress("startup: python -X importtime -m rollout_lifecycle --help")
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "rollout_lifecycle", "--help"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    modules = [
        line.rpartition("|")[2].strip()
        for line in res.stderr.splitlines()
        if line.startswith("import time:")
    ]
    forbidden = sorted({m for m in modules if m.partition(".")[0] in _FORBIDDEN})

    def run(*args: str) -> Callable[[], Any]:
        return lambda: subprocess.run([sys.executable, *args], capture_output=True, check=False)

    med = interleaved_medians(
        {"help": run("-m", "rollout_lifecycle", "--help"), "bare_python": run("-c", "pass")},
        repeats,
    )
    return {
        "command": "python -X importtime -m rollout_lifecycle --help",
        "exit": res.returncode,
        "modules_imported": len(modules),
        "forbidden_imported": forbidden,
        "imports_hypothesis": any(m.partition(".")[0] == "hypothesis" for m in modules),
        "imports_torch": any(m.partition(".")[0] == "torch" for m in modules),
        "s": {k: round(v, 4) for k, v in med.items()},
    }


# ---- ledger check ----------------------------------------------------------------------------

H0 = "a" * 64


def build_ledger(path: Path, n: int, batch: int = 1000) -> None:
    """A SQLite ledger of `n` consumed rollouts written through the public API: v0
    activated, each rollout added rewarded, reserved in a batch and committed (three events
    per rollout plus the registry's)."""
    from rollout_lifecycle.model.backends import open_backend
    from rollout_lifecycle.model.coordinator import ActivationCoordinator
    from rollout_lifecycle.model.ledger import ReserveRequest
    from rollout_lifecycle.model.records import (
        AdmissionPolicy,
        AdmissionStamp,
        LedgerEntry,
        Reward,
        WorkerAck,
    )
    from rollout_lifecycle.model.registry import set_admission_policy

    reward = Reward("rm", "1", 1.0)
    stamp = AdmissionStamp(
        current_version=0,
        behavior_version=0,
        max_lag=1,
        max_drift=0.2,
        drift=0.01,
        freshness="fresh",
        reason="ok",
        accepted=True,
    )
    with open_backend(f"sqlite:///{path}") as be:
        coord = ActivationCoordinator(be.registry, ["g0"], ledger=be.ledger)
        set_admission_policy(coord.registry, AdmissionPolicy(1, 0.2), "benchmark")
        coord.prepare(0)
        coord.commit_artifact(0, H0)
        coord.distribute(0)
        coord.record_ack(WorkerAck("g0", 0, H0, token=coord.attempt_token("g0", 0)))
        if not coord.try_activate(0).activated:
            raise RuntimeError("the benchmark ledger's v0 did not activate")
        led: Any = be.ledger
        for start in range(0, n, batch):
            ids = [f"r{i}" for i in range(start, min(n, start + batch))]
            led.add_many([LedgerEntry(r, 0, H0, state="rewarded", reward=reward) for r in ids])
            won = led.reserve_batch(f"u{start}", [ReserveRequest(r, 0, stamp) for r in ids])
            if not all(o.reserved for o in won):
                raise RuntimeError("a benchmark reservation was refused")
            led.commit(f"u{start}", ids)


def check_seconds(db: Path) -> tuple[int, float, float]:
    """(events, wall seconds, CPU seconds) that `rollout-lifecycle ledger check` reports for
    this ledger."""
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_lifecycle",
            "ledger",
            "check",
            "--backend",
            f"sqlite:///{db}",
            "--json",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=3600,
    )
    data = json.loads(res.stdout)
    if res.returncode != 0 or not data["ok"]:
        raise RuntimeError(f"ledger check of the benchmark ledger failed: {res.stderr[-500:]}")
    return int(data["events"]), float(data["elapsed_s"]), float(data["cpu_s"])


def bench_ledger_check(sizes: SpeedSizes, progress: Progress = _nothing) -> dict[str, Any]:
    """Seconds per event of `ledger check` at each size, the sizes checked in turn."""
    per_event: dict[int, list[float]] = {n: [] for n in sizes.check_rollouts}
    cpu_per_event: dict[int, list[float]] = {n: [] for n in sizes.check_rollouts}
    events: dict[int, int] = {}
    load = B.load1()
    with tempfile.TemporaryDirectory(prefix="rl-bench-check-") as tmp:
        dbs = {}
        for n in sizes.check_rollouts:
            progress(f"ledger check: building a ledger of {n} rollouts")
            dbs[n] = Path(tmp) / f"ledger{n}.db"
            build_ledger(dbs[n], n)
        for rep in range(sizes.check_repeats):
            for n, db in dbs.items():
                progress(f"ledger check: {n} rollouts (repeat {rep + 1})")
                events[n], seconds, cpu = check_seconds(db)
                per_event[n].append(seconds / events[n])
                cpu_per_event[n].append(cpu / events[n])
    us = {n: statistics.median(v) * 1e6 for n, v in per_event.items()}
    cpu_us = {n: statistics.median(v) * 1e6 for n, v in cpu_per_event.items()}
    rows = [
        {
            "rollouts": n,
            "events": events[n],
            "us_per_event": round(us[n], 2),
            "cpu_us_per_event": round(cpu_us[n], 2),
        }
        for n in sizes.check_rollouts
    ]
    smallest, largest = us[sizes.check_rollouts[0]], us[sizes.check_rollouts[-1]]
    return {
        "what": "rollout-lifecycle ledger check --json on SQLite ledgers built through the "
        "API (elapsed_s it reports: reading every row and event, the chain, the replay and "
        "the column comparison; cpu_s: the check's own CPU time over the same span), the "
        "sizes checked in turn, median of the repeats",
        "repeats": sizes.check_repeats,
        "rows": rows,
        "largest_vs_smallest": _rounded(B._ratio(largest, smallest)),
        "max_vs_min": _rounded(B._ratio(max(us.values()), min(us.values()))),
        "cpu_max_vs_min": _rounded(B._ratio(max(cpu_us.values()), min(cpu_us.values()))),
        "load1": load,
    }


# ---- the report ------------------------------------------------------------------------------


def run(quick: bool, parts: Sequence[str], progress: Progress = _nothing) -> dict[str, Any]:
    """The parts of `parts` that are this module's, under their report keys."""
    sizes = QUICK if quick else FULL
    out: dict[str, Any] = {}
    if "gate" in parts:
        out["gate"] = bench_gate(sizes, progress)
    if "admit" in parts:
        out["admit"] = bench_admit(sizes, progress)
    if "startup" in parts:
        out["startup"] = bench_startup(1 if quick else 5, progress)
    if "ledger-check" in parts:
        out["ledger_check"] = bench_ledger_check(sizes, progress)
    return out


def goals(report: dict[str, Any], goal: Goal) -> list[dict[str, Any]]:
    """Issue 22's goals, each with the ratio this run measured."""
    out: list[dict[str, Any]] = []
    for row in (report.get("gate") or {}).get("rows", []):
        case = f"torch {row['dtype']} B={row['B']} T={row['T']} {row['threads']} thread(s)"
        load = row.get("load1")
        if "gate_vs_bare_warm" in row:  # the fair baseline (issue 36); older reports: none
            out.append(
                goal(
                    f"{case}: gate / bare torch expression (warm buffers, "
                    f"{row['bare_warm_threads']} thread(s))",
                    row["gate_vs_bare_warm"],
                    "<= 1",
                    load,
                )
            )
        else:
            out.append(goal(f"{case}: gate / bare torch expression", row["gate_vs_bare"], "<= 1"))
        if row["records_vs_arrays"] is not None and "records_ms" not in row:
            # reports from before issue 36: timed inside the gate/bare rotation
            out.append(
                goal(f"{case}: records path / array path", row["records_vs_arrays"], "<= 1.3", load)
            )
        elif row["records_vs_arrays"] is not None:
            # issue 36: 1.3 from T = 4096; below, the per-record floor (RECORDS_FLOOR); wall
            # and CPU time (which the machine's other work inflates less), as ledger check's
            long_rows = row["T"] >= RECORDS_GOAL_FROM_T
            floor = "" if long_rows else " (under T = 4096: the per-record floor)"
            target = "<= 1.3" if long_rows else f"<= {RECORDS_FLOOR_SHORT}"
            what = f"{case}: records path / array path, in a pair of their own"
            pair_load = row.get("records_load1", load)
            out += [
                goal(what + floor, row["records_vs_arrays"], target, pair_load),
                goal(what + ", CPU time" + floor, row["records_vs_arrays_cpu"], target, pair_load),
            ]
    sq = (report.get("ledgers") or {}).get("sqlite")
    if sq:
        r = sq["ratios"]
        vs_update = r.get("single_vs_autocommit_update")
        out += [
            goal(
                f"sqlite: batch({sq['batch_size']}) / executemany of the same rows and their "
                "event rows",
                r.get("batch_vs_executemany_with_events"),
                ">= 0.3",
                sq.get("load1"),
            ),
            goal(
                "sqlite: single CAS time / autocommit UPDATE time, on disk (synchronous "
                f"{sq['baseline'].get('synchronous')})",
                None if not vs_update else round(1 / vs_update, 3),
                "<= 1.2",
                sq.get("load1"),
            ),
        ]
        tmpfs = sq.get("tmpfs")
        if tmpfs is not None:  # reports from before the tmpfs measurement have none
            vs_tmpfs = r.get("single_vs_autocommit_update_tmpfs")
            how = (
                f"(synchronous {tmpfs['baseline']['synchronous']})"
                if tmpfs["measured"]
                else f"(not measured: {tmpfs['why']})"
            )
            out.append(
                goal(
                    f"sqlite: single CAS time / autocommit UPDATE time, on tmpfs {how}",
                    None if not vs_tmpfs else round(1 / vs_tmpfs, 3),
                    "<= 3",
                    tmpfs.get("load1"),
                )
            )
    adm = report.get("admit")
    if adm:
        out.append(
            goal(
                f"admit / plain json.loads + numpy loop ({adm['rollouts']} rollouts)",
                adm["admit_vs_plain_loop"],
                "<= 1.2",
                adm.get("load1"),
            )
        )
    st = report.get("startup")
    if st:
        out.append(
            goal(
                "--help: Hypothesis and torch modules imported",
                len(st["forbidden_imported"]),
                "<= 0",
            )
        )
    lc = report.get("ledger_check")
    if lc:
        lo, hi = lc["rows"][0]["events"], lc["rows"][-1]["events"]
        out.append(
            goal(
                f"ledger check: us per event, largest / smallest of {lo}..{hi} events",
                lc["max_vs_min"],
                "<= 1.15",
                lc.get("load1"),
            )
        )
        out.append(
            goal(
                f"ledger check: CPU us per event, largest / smallest of {lo}..{hi} events",
                lc.get("cpu_max_vs_min"),
                "<= 1.15",
                lc.get("load1"),
            )
        )
    return out


def markdown(report: dict[str, Any]) -> list[list[str]]:
    """This module's parts as Markdown, one block of lines per part that ran."""
    blocks: list[list[str]] = []
    gate = report.get("gate")
    if gate:
        lines = [
            "## Gate per dtype and thread count (issue 22)",
            "",
            gate["what"] + f"; torch {gate['torch']}, median of {gate['repeats']} interleaved "
            "repeats. Times in ms.",
            "",
            "| dtype | B | T | threads | gate | bare | bare warm | records | gate/bare "
            "| gate/bare warm | records/arrays | load |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in gate["rows"]:
            ms = r["ms"]
            lines.append(
                f"| {r['dtype']} | {r['B']} | {r['T']} | {r['threads']} | {_fmt(ms['gate'])} "
                f"| {_fmt(ms['bare'])} | {_fmt(ms.get('bare_warm'))} | "
                f"{_fmt(ms.get('records'))} | {_fmt(r['gate_vs_bare'])} | "
                f"{_fmt(r.get('gate_vs_bare_warm'))} | {_fmt(r['records_vs_arrays'])} | "
                f"{_fmt(r.get('load1'))} |"
            )
        if any("bare_warm" in r["ms"] for r in gate["rows"]):
            lines += [
                "",
                "bare warm: the same expression with its B x T temporaries allocated once "
                "and reused, on the threads the gate computes with (one up to two torch "
                "threads): the fair baseline the gate's goal is judged against. load: the "
                "1-minute load average when the row was measured.",
            ]
        pairs = [r for r in gate["rows"] if "records_ms" in r]
        if pairs:  # reports from before issue 36 timed the records path in the rotation
            lines += _records_pair_markdown(pairs)
        blocks.append(lines)
    adm = report.get("admit")
    if adm:
        lines = [
            "## admit (issue 22)",
            "",
            f"{adm['what']}; {adm['rollouts']} rollouts of up to {adm['max_tokens']} tokens "
            f"({adm['input_bytes']:,} bytes). admit {_fmt(adm['s']['admit'])} s, plain loop "
            f"{_fmt(adm['s']['plain_loop'])} s: {_fmt(adm['admit_vs_plain_loop'])}x.",
        ]
        blocks.append(lines)
    st = report.get("startup")
    if st:
        lines = [
            "## Start-up (issue 22)",
            "",
            f"`{st['command']}` imports {st['modules_imported']} modules; Hypothesis: "
            f"{'yes' if st['imports_hypothesis'] else 'no'}, torch: "
            f"{'yes' if st['imports_torch'] else 'no'}. `--help` takes {_fmt(st['s']['help'])}"
            f" s, a bare `python -c pass` {_fmt(st['s']['bare_python'])} s (medians).",
        ]
        blocks.append(lines)
    lc = report.get("ledger_check")
    if lc:
        lines = [
            "## ledger check per event (issue 22)",
            "",
            lc["what"] + f" of {lc['repeats']}.",
            "",
            "| rollouts | events | us per event | CPU us per event |",
            "|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['rollouts']} | {r['events']} | {_fmt(r['us_per_event'])} | "
            f"{_fmt(r.get('cpu_us_per_event'))} |"
            for r in lc["rows"]
        ]
        lines += [
            "",
            f"Largest / smallest: {_fmt(lc['largest_vs_smallest'])}; max / min: "
            f"{_fmt(lc['max_vs_min'])}; CPU max / min: {_fmt(lc.get('cpu_max_vs_min'))}.",
        ]
        blocks.append(lines)
    return blocks


# issue 36's goal for the records path, records / arrays <= 1.3, holds from this width; under
# it the records path's fixed cost per record (RECORDS_FLOOR) is a bound of its own
RECORDS_GOAL_FROM_T = 4096
RECORDS_FLOOR_SHORT = 3
RECORDS_FLOOR = (
    "The records path's floor: whatever it computes, it reads each record (its status, "
    "conditions and evidence, and the sizes of its three arrays: objects scattered in "
    "memory, about ten cache lines a record, out of the caches at large B), subtracts "
    "each row in a numpy call of its own (the rows are separate arrays) and lays its mask "
    "out joined: about 1.6 to 3.7 us a record (issue 36's runs, 2 loaded cores; the more "
    "the larger B), where the array path spends about 1.5 to 2 ns a token on the whole B "
    "x T. At T = 4096 a record costs the array path about 6 us, so the records path is "
    "about 1.35 to 1.65 times it (the figures above spread +-0.15 with the load; summing "
    "long float32 rows over their own 256-token chunks on one thread took 0.05-0.1 off "
    "in an A/B of the kernel alone, not visible past this spread); at T = "
    "1024 (about 2 us a record) the same fixed cost makes it about 1.7 to 2.3 times, "
    "which no change inside the kernel can bring to 1.3: only fewer reads or calls per "
    "record could."
)


def _records_pair_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The records path / array path pairs (issue 36) as a table, with the floor."""
    lines = [
        "",
        "### Records path / array path (float32)",
        "",
        "The two alone, interleaved and rotated, same torch threads, both warmed up; wall "
        "and CPU medians in ms (CPU: this process's, which the machine's other work "
        "inflates less).",
        "",
        "| B | T | threads | arrays | records | records/arrays | arrays CPU | records CPU "
        "| records/arrays CPU | load |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        wall, cpu = r["records_ms"], r["records_cpu_ms"]
        lines.append(
            f"| {r['B']} | {r['T']} | {r['threads']} | {_fmt(wall['arrays'])} | "
            f"{_fmt(wall['records'])} | {_fmt(r['records_vs_arrays'])} | "
            f"{_fmt(cpu['arrays'])} | {_fmt(cpu['records'])} | "
            f"{_fmt(r['records_vs_arrays_cpu'])} | {_fmt(r['records_load1'])} |"
        )
    return [*lines, "", RECORDS_FLOOR]


def _fmt(v: Any) -> str:
    """A number as the report prints it ('-' for none)."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.2f}"
    return str(v)
