"""Measurements for `rollout-lifecycle bench`: every figure next to its baseline, in one run.

The machines this runs on are small and shared, so no figure here is a pass/fail on its own:
each job is timed side by side with the baselines it is judged against, the variants are
interleaved (A B C A B C ...) and the best of the repeats is kept (the run least disturbed
by the rest of the machine), and the report states ratios. Nothing here is a test.

1. admission: `assess_arrays` and `AdmissionGate.assess_batch` (records holding arrays)
   against the bare masked-mean expression in the same library, the read-once bound (one
   reduction per input array), a per-rollout loop, and verl's seq_mean_k1 rejection when
   verl is importable; peak extra memory (numpy: tracemalloc; torch: resident-set growth
   sampled every 0.5 ms in a helper thread, after malloc_trim, so a lower bound).
2. ledgers: reservations per second, one compare-and-set at a time and in batches, 1 / 4 / 8
   racing threads; commits per second at two ledger sizes; next to a plain UPDATE and an
   executemany of the same rows on a file with the same table and durability settings
   (SQLite), or a dict write under a lock (memory); and the memory ledger's per-row cost
   of batch reservations at ledger sizes up to 1e6 rollouts with the garbage collector on.
3. checkers: fuzz steps per second and explorer distinct states per second.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import json
import multiprocessing
import os
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import traceback
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from rollout_lifecycle.model.events import EntryChanged, stored_payload
from rollout_lifecycle.model.gate import AdmissionGate, GatePolicy, assess_arrays
from rollout_lifecycle.model.ledger import MemoryLedger, ReserveRequest
from rollout_lifecycle.model.records import (
    ActionEvidence,
    AdmissionStamp,
    BehaviorPolicy,
    GenerationConditions,
    LedgerEntry,
    Reward,
    Rollout,
    RolloutIdentity,
    to_jsonable,
)
from rollout_lifecycle.model.sqlite_common import connect
from rollout_lifecycle.model.sqlite_ledger import SQLiteLedger

SCHEMA = "rollout-lifecycle/bench-report/1"

Progress = Callable[[str], None]


@attrs.frozen
class Sizes:
    """How much work each part does: `full` for the committed report, `quick` for CI."""

    batches: tuple[int, ...]
    widths: tuple[int, ...]
    repeats: int
    rollouts: int  # ledger reservations per measurement (memory)
    sqlite_rollouts: int
    commit_sizes: tuple[int, int]
    sqlite_commit_sizes: tuple[int, int]
    racers: tuple[int, ...]
    race_rollouts: int
    ledger_repeats: int
    scale_rollouts: tuple[int, ...]  # memory ledger sizes for the per-row cost with gc on
    scale_repeats: int
    fuzz_examples: int
    fuzz_backends: tuple[str, ...]
    explore_max_states: int | None


FULL = Sizes(
    batches=(64, 1024, 4096),
    widths=(512, 4096),
    repeats=11,
    rollouts=20_000,
    sqlite_rollouts=1_000,
    commit_sizes=(1_000, 100_000),
    sqlite_commit_sizes=(1_000, 100_000),
    racers=(1, 4, 8),
    race_rollouts=2_000,
    ledger_repeats=3,
    scale_rollouts=(1_000, 10_000, 100_000, 1_000_000),
    scale_repeats=5,
    fuzz_examples=25,
    fuzz_backends=("memory", "sqlite"),
    explore_max_states=20_000,
)
QUICK = Sizes(
    batches=(64, 256),
    widths=(64, 512),
    repeats=2,
    rollouts=400,
    sqlite_rollouts=100,
    commit_sizes=(200, 2_000),
    sqlite_commit_sizes=(200, 1_000),
    racers=(1, 4),
    race_rollouts=100,
    ledger_repeats=1,
    scale_rollouts=(200, 2_000),
    scale_repeats=1,
    fuzz_examples=3,
    fuzz_backends=("memory",),
    explore_max_states=500,
)


def _nothing(_: str) -> None:
    return None


def _interleaved(variants: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float | None]:
    """Best wall time (s) of each variant, the variants run in turn `repeats` times."""
    best: dict[str, float | None] = dict.fromkeys(variants)
    for _ in range(repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            prev = best[name]
            best[name] = dt if prev is None else min(prev, dt)
    return best


def load1() -> float | None:
    """The 1-minute load average now, printed and recorded beside each figure (None where
    the platform has none): on a shared machine it says how disturbed a figure was."""
    if not hasattr(os, "getloadavg"):
        return None
    return round(os.getloadavg()[0], 2)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


# ---- 1. admission --------------------------------------------------------------------------


def _optional_torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def _verl_rejection() -> tuple[Callable[..., Any] | None, str | None]:
    """verl's rejection-mask function and verl's version, or (None, None) without verl."""
    try:
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask
    except Exception:  # verl absent, or present but broken: the column is skipped
        return None, None
    try:
        from importlib import metadata

        version: str | None = metadata.version("verl")
    except Exception:
        version = None
    return compute_rollout_rejection_mask, version


def _batch(b: int, t: int, seed: int = 0) -> dict[str, Any]:
    """B x T float32 log-probs, a mask right-padded to ragged lengths, behaviour versions."""
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.0, 0.5, (b, t)).astype(np.float32)
    cur = (old + rng.normal(0.0, 0.02, (b, t))).astype(np.float32)
    lengths = rng.integers(max(1, t // 2), t + 1, b)
    mask = (rng.random((b, t)) < 0.8) & (np.arange(t)[None, :] < lengths[:, None])
    bvs = rng.integers(3, 6, b).astype(np.int64)
    return {"old": old, "cur": cur, "mask": mask, "bvs": bvs, "lengths": lengths}


CONDITIONS = GenerationConditions(
    tokenizer_id="tok", temperature=1.0, top_p=1.0, top_k=-1, max_tokens=1 << 20
)
REGISTRY = {v: f"hash-v{v}" for v in range(10)}
CURRENT, MAX_LAG, MAX_DRIFT = 5, 2, 0.2


def _records(data: dict[str, Any]) -> list[Rollout]:
    """One rewarded Rollout per row, its evidence the row's arrays up to its length."""
    out = []
    reward = Reward("rm", "1", 1.0)
    for i, n in enumerate(data["lengths"].tolist()):
        v = int(data["bvs"][i])
        rid = f"r{i}"
        out.append(
            Rollout(
                identity=RolloutIdentity(rid, f"p{i}", "bench", i),
                behavior=BehaviorPolicy(v, REGISTRY[v]),
                conditions=CONDITIONS,
                evidence=ActionEvidence(np.arange(n), data["mask"][i, :n], data["old"][i, :n]),
                status=LedgerEntry(
                    rid, v, REGISTRY[v], state="rewarded", revision=1, reward=reward
                ),
            )
        )
    return out


def _np_variants(data: dict[str, Any], rollouts: list[Rollout]) -> dict[str, Callable[[], Any]]:
    old, cur, mask, bvs = data["old"], data["cur"], data["mask"], data["bvs"]
    gate = AdmissionGate(GatePolicy(MAX_LAG, MAX_DRIFT, CONDITIONS), registry=REGISTRY)
    lengths = data["lengths"].tolist()

    def loop() -> list[float]:
        out = []
        for i, n in enumerate(lengths):
            m = mask[i, :n]
            k = int(np.count_nonzero(m))
            out.append(float(np.abs(cur[i, :n][m] - old[i, :n][m]).sum()) / k if k else 0.0)
        return out

    return {
        "gate_arrays": lambda: assess_arrays(old, cur, mask, bvs, CURRENT, MAX_LAG, MAX_DRIFT),
        "gate_records": lambda: gate.assess_batch(rollouts, cur, CURRENT),
        "bare": lambda: (np.abs(cur - old) * mask).sum(1) / mask.sum(1),
        "read_once": lambda: (old.sum(1), cur.sum(1), np.count_nonzero(mask)),
        "python_loop": loop,
    }


def _torch_variants(
    torch: Any, data: dict[str, Any], rollouts: list[Rollout], verl: Callable[..., Any] | None
) -> dict[str, Callable[[], Any]]:
    old, cur, mask = (torch.from_numpy(data[k]) for k in ("old", "cur", "mask"))
    bvs = torch.from_numpy(data["bvs"])
    gate = AdmissionGate(GatePolicy(MAX_LAG, MAX_DRIFT, CONDITIONS), registry=REGISTRY)
    lengths = data["lengths"].tolist()

    def loop() -> list[float]:
        out = []
        for i, n in enumerate(lengths):
            m = mask[i, :n]
            k = int(torch.count_nonzero(m))
            out.append(float((cur[i, :n][m] - old[i, :n][m]).abs().sum()) / k if k else 0.0)
        return out

    variants: dict[str, Callable[[], Any]] = {
        "gate_arrays": lambda: assess_arrays(old, cur, mask, bvs, CURRENT, MAX_LAG, MAX_DRIFT),
        "gate_records": lambda: gate.assess_batch(rollouts, cur, CURRENT),
        "bare": lambda: ((cur - old).abs() * mask).sum(1) / mask.sum(1),
        "read_once": lambda: (old.sum(1), cur.sum(1), torch.count_nonzero(mask)),
        "python_loop": loop,
    }
    if verl is not None:
        # verl's own sequence-level rejection on the same tensors, log r computed as verl does
        variants["verl"] = lambda: verl(old - cur, mask, "seq_mean_k1", "0.5_2.0")
    return variants


def _tracemalloc_peak(fn: Callable[[], Any]) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return max(0, peak - before)


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _rss_peak(fn: Callable[[], Any]) -> int | None:
    """Resident-set growth during `fn`, sampled every 0.5 ms (None where /proc is absent)."""
    if not Path("/proc/self/statm").exists():
        return None
    gc.collect()
    _malloc_trim()
    base = _rss()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.0005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        fn()
    finally:
        done.set()
        th.join()
    peak[0] = max(peak[0], _rss())
    return max(0, peak[0] - base)


def bench_admission(sizes: Sizes, progress: Progress = _nothing) -> dict[str, Any]:
    """Every (library, B, T) case: times, peak extra memory and the goal ratios."""
    torch = _optional_torch()
    verl, verl_version = _verl_rejection() if torch is not None else (None, None)
    rows: list[dict[str, Any]] = []
    libraries = ["numpy"] + (["torch"] if torch is not None else [])
    for lib in libraries:
        for b in sizes.batches:
            for t in sizes.widths:
                load = load1()
                progress(f"admission {lib} B={b} T={t} (load {load})")
                data = _batch(b, t)
                rollouts = _records(data)
                if lib == "numpy":
                    variants = _np_variants(data, rollouts)
                else:
                    variants = _torch_variants(torch, data, rollouts, verl)
                for fn in variants.values():  # warm up (imports, first-touch of pages)
                    fn()
                best = _interleaved(variants, sizes.repeats)
                ms = {k: None if v is None else round(v * 1e3, 4) for k, v in best.items()}
                measure = _tracemalloc_peak if lib == "numpy" else _rss_peak
                peaks = {k: measure(variants[k]) for k in ("gate_arrays", "gate_records", "bare")}
                inputs = int(data["old"].nbytes + data["cur"].nbytes + data["mask"].nbytes)
                rows.append(
                    {
                        "library": lib,
                        "B": b,
                        "T": t,
                        "dtype": "float32",
                        "mask": "bool",
                        "ms": ms,
                        "input_bytes": inputs,
                        "peak_extra_bytes": peaks,
                        "peak_extra_vs_inputs": {
                            k: None if v is None else round(v / inputs, 4) for k, v in peaks.items()
                        },
                        "ratios": _admission_ratios(best),
                        "load1": load,
                    }
                )
    return {
        "what": "admission of B rollouts x T tokens, float32, bool mask, right-padded ragged rows",
        "variants": {
            "gate_arrays": "rollout_lifecycle assess_arrays on the B x T arrays",
            "gate_records": "AdmissionGate.assess_batch over Rollout records holding arrays",
            "bare": "(abs(cur - old) * mask).sum(1) / mask.sum(1) in the same library",
            "read_once": "old.sum(1), cur.sum(1), count_nonzero(mask): one reduction per input",
            "python_loop": "a Python loop over rollouts, the masked mean of each row",
            "verl": "verl compute_rollout_rejection_mask(old - cur, mask, 'seq_mean_k1')",
        },
        "memory": {
            "numpy": "tracemalloc peak above the level before the call",
            "torch": "resident-set growth sampled every 0.5 ms after malloc_trim (lower bound)",
        },
        "verl": verl_version,
        "torch": None if torch is None else str(torch.__version__),
        "torch_threads": None if torch is None else int(torch.get_num_threads()),
        "rows": rows,
    }


def _admission_ratios(best: dict[str, float | None]) -> dict[str, float | None]:
    arrays = best.get("gate_arrays")
    out = {
        "arrays_vs_bare": _ratio(arrays, best.get("bare")),
        "arrays_vs_read_once": _ratio(arrays, best.get("read_once")),
        "records_vs_arrays": _ratio(best.get("gate_records"), arrays),
        "python_loop_vs_arrays": _ratio(best.get("python_loop"), arrays),
        "verl_vs_arrays": _ratio(best.get("verl"), arrays),
    }
    return {k: None if v is None else round(v, 3) for k, v in out.items()}


# ---- 2. ledgers ------------------------------------------------------------------------------

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


def _entries(n: int, start: int = 0) -> list[LedgerEntry]:
    reward = Reward("rm", "1", 1.0)
    return [
        LedgerEntry(f"r{i}", 0, "h", state="rewarded", reward=reward)
        for i in range(start, start + n)
    ]


@contextlib.contextmanager
def _ledger(backend: str, folder: Path, entries: Sequence[LedgerEntry]) -> Iterator[Any]:
    if backend == "memory":
        yield MemoryLedger.restore(entries)
        return
    path = folder / f"l{random.getrandbits(40):x}.db"
    led = SQLiteLedger(path)
    try:
        for k in range(0, len(entries), 5_000):
            led.add_many(entries[k : k + 5_000])
        yield led
    finally:
        led.close()


class _OwnProcess:
    """One variant of `_reserve_round` in a process of its own (forked, its collector on):
    its own heap, so the collections its own garbage triggers are timed on it alone. In
    one shared heap the variant with the largest burst of live temporaries (a batch's
    outcomes, planned rows and events) tripped nearly every collection, full ones
    included, and so was timed for the garbage the single CAS left behind as well
    (issue 36: memory, 20,000 rows, 3 runs: 3.3-3.9 us a batched row of collections, 0.04
    a single one). What the parent left in the heap is frozen in the child (gc.freeze),
    so no variant traverses it. `turn(a, b)` runs the variant over rows a..b there and
    returns the seconds that took there; the parent orders the turns."""

    def __init__(self, setup: Callable[[contextlib.ExitStack], Callable[[int, int], None]]):
        ctx = multiprocessing.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_own_process_main, args=(setup, child), daemon=True)
        self._proc.start()
        child.close()
        self._answer()  # set up, or why not

    def _answer(self) -> Any:
        try:
            got = self._conn.recv()
        except EOFError:
            raise RuntimeError(
                f"a benchmark variant's process died ({self._proc.exitcode})"
            ) from None
        if isinstance(got, tuple) and got and got[0] == "error":
            raise RuntimeError(f"a benchmark variant failed in its process:\n{got[1]}")
        return got

    def turn(self, a: int, b: int) -> float:
        self._conn.send((a, b))
        return float(self._answer())

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()


def _own_process_main(
    setup: Callable[[contextlib.ExitStack], Callable[[int, int], None]], conn: Any
) -> None:
    """A variant's process: set it up, then run the turns the parent sends (None: stop)."""
    gc.freeze()  # the parent's objects: every variant inherits them, none is timed on them
    gc.enable()  # as a trainer runs
    random.seed()  # else every variant draws the parent's file names: one file for two
    try:
        with contextlib.ExitStack() as stack:
            run = setup(stack)
            conn.send("ready")
            while (job := conn.recv()) is not None:
                t0 = time.perf_counter()
                run(*job)
                conn.send(time.perf_counter() - t0)
    except BaseException:  # reported to the parent, which raises it
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _reserve_round(
    backend: str,
    folder: Path,
    entries: list[LedgerEntry],
    requests: list[ReserveRequest],
    plain: Callable[[], contextlib.AbstractContextManager[_Plain]],
    batch: int,
    rep: int,
    batches: bool,
) -> dict[str, float]:
    """One repeat of `_reserve_rates`: seconds each variant spent, every variant in turn
    per chunk of `batch` rows, the order rotating with the chunk and the repeat, each in
    its own process (`_OwnProcess`)."""
    n = len(entries)
    # rows per round of turns: a turn is a switch of process, whose caches start cold, so
    # it spans milliseconds of work, several batches; the singles on SQLite alternate with
    # their plain UPDATEs every few rows inside it (a commit's fsync varies), in memory
    # they run the round in one turn
    span = max(batch, 1000)
    turn = 25 if backend != "memory" else span

    def single(stack: contextlib.ExitStack) -> Callable[[int, int], None]:
        led = stack.enter_context(_ledger(backend, folder, entries))

        def run(a: int, b: int) -> None:
            for e in entries[a:b]:
                led.reserve(e.rollout_id, 0, "u", STAMP)

        return run

    def batched(stack: contextlib.ExitStack) -> Callable[[int, int], None]:
        led = stack.enter_context(_ledger(backend, folder, entries))

        def run(a: int, b: int) -> None:
            for k in range(a, b, batch):
                led.reserve_batch(f"u{rep}-{k}", requests[k : min(b, k + batch)])

        return run

    def baseline(method: str) -> Callable[[contextlib.ExitStack], Callable[[int, int], None]]:
        def setup(stack: contextlib.ExitStack) -> Callable[[int, int], None]:
            base = stack.enter_context(plain())
            if method == "single":
                return base.single
            write = getattr(base, method)

            def run(a: int, b: int) -> None:  # a transaction per batch of rows
                for k in range(a, b, batch):
                    write(k, min(b, k + batch))

            return run

        return setup

    setups: dict[str, Callable[[contextlib.ExitStack], Callable[[int, int], None]]] = {
        "single": single,
        "plain_single": baseline("single"),
    }
    jobs = []  # the batched variants, in the order they rotate through
    if batches:
        setups.update(batch=batched, plain_batch=baseline("many"))
        jobs = ["batch", "plain_batch"]
        if backend != "memory":  # the batch baseline that also logs events
            setups["plain_batch_events"] = baseline("many_with_events")
            jobs.append("plain_batch_events")
    spent = dict.fromkeys(setups, 0.0)
    with contextlib.ExitStack() as stack:
        procs: dict[str, _OwnProcess] = {}
        for name, setup in setups.items():
            procs[name] = _OwnProcess(setup)
            stack.callback(procs[name].close)

        def singles(a: int, b: int) -> None:
            for k in range(a, b, turn):
                hi = min(b, k + turn)
                spent["single"] += procs["single"].turn(k, hi)
                spent["plain_single"] += procs["plain_single"].turn(k, hi)

        def batched_turns(a: int, b: int) -> None:
            k = (rep + a // span) % len(jobs)
            for name in jobs[k:] + jobs[:k]:
                spent[name] += procs[name].turn(a, b)

        for c, a in enumerate(range(0, n, span)):
            b = min(n, a + span)
            if not batches:
                singles(a, b)
            elif (rep + c) % 2:
                batched_turns(a, b)
                singles(a, b)
            else:
                singles(a, b)
                batched_turns(a, b)
    return spent


def _reserve_rates(
    backend: str, folder: Path, n: int, batch: int, repeats: int, *, batches: bool = True
) -> tuple[dict[str, float], dict[str, Any]]:
    """Reservations per second, one CAS at a time and in batches, each next to its plain
    baseline, all in ONE phase: every variant (the ledger reserving singly, the one in
    batches, the baselines) is set up in a process of its own (`_OwnProcess`: each is timed
    for its own garbage collections only), and per chunk of `batch` rows each takes its
    turn, the order rotating chunk by chunk (the singles and their plain UPDATEs alternate
    every few rows inside their turn), so a slow spell of the disk (fsync) or the CPU falls
    on all alike. Each batch is its own update (a fresh update id), as a trainer's are.
    Best of `repeats`. Without `batches`, the single CAS and its baseline only."""
    entries = _entries(n)
    requests = [ReserveRequest(e.rollout_id, 0, STAMP) for e in entries]
    plain = _plain_memory(n) if backend == "memory" else _plain_sqlite(folder, n)
    totals: dict[str, float] = {}
    for rep in range(repeats):
        spent = _reserve_round(backend, folder, entries, requests, plain, batch, rep, batches)
        for name, dt in spent.items():
            totals[name] = min(totals.get(name, dt), dt)

    def per_s(name: str) -> float:
        return round(n / totals[name], 1)

    rates = {"single_per_s": per_s("single")}
    if batches:
        rates["batch_per_s"] = per_s("batch")
    if backend == "memory":
        baseline: dict[str, Any] = {
            "dict_write_per_s": per_s("plain_single"),
            f"dict_write_batch_{batch}_per_s": per_s("plain_batch"),
        }
        return rates, baseline
    baseline = {"autocommit_update_per_s": per_s("plain_single")}
    if batches:
        baseline[f"executemany_{batch}_per_s"] = per_s("plain_batch")
        # the same, plus each row's event row (payload and hashes made beforehand)
        baseline[f"executemany_with_events_{batch}_per_s"] = per_s("plain_batch_events")
    baseline.update(synchronous=_sqlite_synchronous(folder), journal_mode="wal")
    return rates, baseline


def _plain_rows(n: int, batch: int) -> float:
    """The floor of `_memory_scale` at n rollouts: the same rows reserved by hand, with
    nothing of the ledger: each entry evolved to its reserved form (attrs' validators, as
    the ledger's entries have), stored in a dict and logged as a tuple naming the old and
    new entry, in batches of `batch`. CPU microseconds per row, gc as the caller
    set it. It shows what the Python heap itself costs as it grows: with the collector on,
    its full collections traverse every live entry and logged row."""
    entries = _entries(n)
    rows = {e.rollout_id: e for e in entries}
    keys = [e.rollout_id for e in entries]
    del entries
    log: list[tuple[str, str, LedgerEntry, LedgerEntry, str]] = []
    evolve = attrs.evolve
    c0 = time.process_time()
    for k in range(0, n, batch):
        for rid in keys[k : k + batch]:
            e = rows[rid]
            after = evolve(
                e,
                state="reserved",
                revision=e.revision + 1,
                reserved_by="u",
                lease_expires_at=1e9,
                admission=STAMP,
            )
            rows[rid] = after
            log.append((rid, "reserve", e, after, "u"))
    return (time.process_time() - c0) / n * 1e6


def _memory_scale(rollouts: Sequence[int], repeats: int, batch: int = 100) -> dict[str, Any]:
    """Per-row cost of batch reservations as a memory ledger and its event log grow, with
    the garbage collector on as in a trainer: every rollout of a ledger of n reserved in
    batches of `batch`. Microseconds per row of CPU time (what the ledger costs, whatever
    else the machine runs) and of wall time, medians of `repeats`, the sizes interleaved,
    each next to `_plain_rows` at the same size (the same rows written by hand): how flat
    the heap itself stays."""
    cpu: dict[int, list[float]] = {n: [] for n in rollouts}
    wall: dict[int, list[float]] = {n: [] for n in rollouts}
    plain: dict[int, list[float]] = {n: [] for n in rollouts}
    was_on = gc.isenabled()
    gc.enable()
    try:
        for _ in range(repeats):
            for n in rollouts:
                entries = _entries(n)
                requests = [ReserveRequest(e.rollout_id, 0, STAMP) for e in entries]
                led = MemoryLedger.restore(entries)
                del entries
                gc.collect()
                t0, c0 = time.perf_counter(), time.process_time()
                for k in range(0, n, batch):
                    led.reserve_batch("u", requests[k : k + batch])
                wall[n].append((time.perf_counter() - t0) / n * 1e6)
                cpu[n].append((time.process_time() - c0) / n * 1e6)
                del led, requests
                gc.collect()
                plain[n].append(_plain_rows(n, batch))
                gc.collect()
    finally:
        if not was_on:
            gc.disable()
    small, large = min(rollouts), max(rollouts)
    cpu_us = {n: statistics.median(v) for n, v in cpu.items()}
    wall_us = {n: statistics.median(v) for n, v in wall.items()}
    plain_us = {n: statistics.median(v) for n, v in plain.items()}
    return {
        "batch_size": batch,
        "repeats": repeats,
        "gc": "on",
        "cpu_us_per_row": {str(n): round(v, 2) for n, v in cpu_us.items()},
        "wall_us_per_row": {str(n): round(v, 2) for n, v in wall_us.items()},
        "plain_cpu_us_per_row": {str(n): round(v, 2) for n, v in plain_us.items()},
        "ratios": {
            "cpu_largest_vs_smallest": round(cpu_us[large] / cpu_us[small], 3),
            "wall_largest_vs_smallest": round(wall_us[large] / wall_us[small], 3),
            # flat means every size, not only the two ends: the most / the least per-row cost
            "cpu_max_vs_min": round(max(cpu_us.values()) / min(cpu_us.values()), 3),
            "wall_max_vs_min": round(max(wall_us.values()) / min(wall_us.values()), 3),
            "plain_cpu_max_vs_min": round(max(plain_us.values()) / min(plain_us.values()), 3),
        },
    }


def _race(backend: str, folder: Path, n: int, workers: int) -> dict[str, Any]:
    """`workers` threads race to reserve every rollout (read, then compare-and-set)."""
    entries = _entries(n)
    ids = [e.rollout_id for e in entries]
    with _ledger(backend, folder, entries) as led:
        wins = [0] * workers
        losses = [0] * workers
        start = threading.Barrier(workers)

        def run(w: int) -> None:
            order = list(ids)
            random.Random(w).shuffle(order)
            start.wait()
            for rid in order:
                e = led.find(rid)
                if e is None or e.state != "rewarded":
                    continue
                out = led.reserve(rid, e.revision, f"u{w}", STAMP)
                if out.reserved:
                    wins[w] += 1
                else:
                    losses[w] += 1

        threads = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        elapsed = time.perf_counter() - t0
    return {
        "workers": workers,
        "rollouts": n,
        "wins": sum(wins),
        "lost_cas": sum(losses),
        "elapsed_s": round(elapsed, 3),
        "wins_per_s": round(sum(wins) / elapsed, 1),
    }


def _commit_rates(
    backend: str, folder: Path, sizes: tuple[int, int], repeats: int, per_update: int = 10
) -> dict[str, float]:
    """Commits per second of small updates in ledgers of two sizes, the two in turn."""
    best: dict[int, float] = {}
    ledgers = {}
    with contextlib.ExitStack() as stack:
        for size in sizes:
            ledgers[size] = stack.enter_context(_ledger(backend, folder, _entries(size)))
        next_id = dict.fromkeys(sizes, 0)
        for _ in range(repeats):
            for size in sizes:
                led = ledgers[size]
                updates = min(20, (size - next_id[size]) // per_update)
                if updates < 1:
                    continue
                spent = 0.0
                for _u in range(updates):
                    first = next_id[size]
                    next_id[size] += per_update
                    ids = [f"r{first + k}" for k in range(per_update)]
                    u = f"u{first}"
                    led.reserve_batch(u, [ReserveRequest(r, 0, STAMP) for r in ids])
                    t0 = time.perf_counter()
                    led.commit(u, ids)
                    spent += time.perf_counter() - t0
                best[size] = max(best.get(size, 0.0), updates / spent)
    return {str(k): round(v, 1) for k, v in best.items()}


_PLAIN_DDL = (
    "CREATE TABLE rollouts (rollout_id TEXT PRIMARY KEY, state TEXT NOT NULL, "
    "revision INTEGER NOT NULL, reserved_by TEXT, lease_expires_at REAL, "
    "behavior_version INTEGER NOT NULL, entry TEXT NOT NULL) WITHOUT ROWID;"
    "CREATE INDEX rollouts_owner ON rollouts(reserved_by) WHERE reserved_by IS NOT NULL;"
    "CREATE INDEX rollouts_lease ON rollouts(lease_expires_at) WHERE reserved_by IS NOT NULL;"
    "CREATE INDEX rollouts_version ON rollouts(behavior_version, state);"
    # the ledger's events table (model.sqlite_common), for the baseline that also appends
    # each write's event row as the ledger does
    "CREATE TABLE events (seq INTEGER PRIMARY KEY, txn INTEGER NOT NULL, "
    "kind TEXT NOT NULL, subject TEXT NOT NULL, payload TEXT NOT NULL, prev_hash BLOB, "
    "hash BLOB);"
    "CREATE INDEX events_subject ON events(kind, subject);"
)
_PLAIN_EVENT = (
    "INSERT INTO events(seq, txn, kind, subject, payload, prev_hash, hash) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_PLAIN_UPDATE = (
    "UPDATE rollouts SET state = ?, revision = revision + 1, reserved_by = ?, "
    "lease_expires_at = ?, entry = ? WHERE rollout_id = ? AND revision = ?"
)


def _sqlite_synchronous(folder: Path) -> str:
    conn = connect(folder / "probe.db")
    try:
        level = conn.execute("PRAGMA synchronous").fetchone()[0]
    finally:
        conn.close()
    return {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}.get(level, str(level))


class _Plain:
    """A baseline store: `single(a, b)` writes rows a..b one statement each, `many(a, b)` in
    one transaction."""

    def single(self, a: int, b: int) -> None:
        raise NotImplementedError

    def many(self, a: int, b: int) -> None:
        raise NotImplementedError

    def many_with_events(self, a: int, b: int) -> None:
        """`many`, and the rows' event rows appended in the same transaction."""
        raise NotImplementedError


def _plain_sqlite(folder: Path, n: int) -> Callable[[], contextlib.AbstractContextManager[_Plain]]:
    """The same rows on a file with the ledger's table shape, connection settings (WAL,
    synchronous=FULL) and a reserved entry's JSON: one autocommit UPDATE per row, or an
    executemany per transaction."""
    entry = attrs.evolve(
        _entries(1)[0], state="reserved", revision=1, reserved_by="u", lease_expires_at=1e9
    )
    reserved = attrs.evolve(entry, admission=STAMP)
    payload = json.dumps(to_jsonable(reserved))
    args = [("reserved", "u", 1e9, payload, f"r{i}", 0) for i in range(n)]
    # the event row the ledger appends for each reservation: its stored payload (what the
    # reservation changed, as `stored_payload` writes it) and 32-byte chain hashes, made
    # before any timing
    before = _entries(1)[0]
    events = [
        (
            i + 1,
            1 + i // 1000,
            "entry",
            f"r{i}",
            stored_payload(
                EntryChanged(0, 0, 1e9, f"r{i}", "reserve", before, reserved, "u"), 1 + i // 1000
            ),
            bytes(32),
            bytes(32),
        )
        for i in range(n)
    ]

    class Plain(_Plain):
        def __init__(self, conn: sqlite3.Connection) -> None:
            self.conn = conn

        def single(self, a: int, b: int) -> None:
            for row in args[a:b]:
                self.conn.execute(_PLAIN_UPDATE, row)

        def many(self, a: int, b: int) -> None:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany(_PLAIN_UPDATE, args[a:b])
            self.conn.execute("COMMIT")

        def many_with_events(self, a: int, b: int) -> None:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany(_PLAIN_UPDATE, args[a:b])
            self.conn.executemany(_PLAIN_EVENT, events[a:b])
            self.conn.execute("COMMIT")

    @contextlib.contextmanager
    def fresh() -> Iterator[_Plain]:
        conn = connect(folder / f"plain{random.getrandbits(40):x}.db")
        try:
            conn.executescript(_PLAIN_DDL)
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT INTO rollouts VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(f"r{i}", "rewarded", 0, None, None, 0, payload) for i in range(n)],
            )
            conn.execute("COMMIT")
            yield Plain(conn)
        finally:
            conn.close()

    return fresh


def _plain_memory(n: int) -> Callable[[], contextlib.AbstractContextManager[_Plain]]:
    """A dict write under a lock per row, or per batch: the memory floor."""
    entry = attrs.evolve(_entries(1)[0], state="reserved", revision=1, reserved_by="u")
    keys = [f"r{i}" for i in range(n)]

    class Plain(_Plain):
        def __init__(self) -> None:
            self.d: dict[str, LedgerEntry] = {}
            self.lock = threading.Lock()

        def single(self, a: int, b: int) -> None:
            for k in keys[a:b]:
                with self.lock:
                    self.d[k] = entry

        def many(self, a: int, b: int) -> None:
            with self.lock:
                for k in keys[a:b]:
                    self.d[k] = entry

    @contextlib.contextmanager
    def fresh() -> Iterator[_Plain]:
        yield Plain()

    return fresh


TMPFS = Path("/dev/shm")


def _tmpfs_single(n: int, repeats: int, progress: Progress) -> dict[str, Any]:
    """The SQLite single CAS next to its autocommit UPDATE on tmpfs, where a commit's fsync
    costs next to nothing, so the ratio shows what the ledger adds in CPU; or why it was
    not measured."""
    if not TMPFS.is_dir() or not os.access(TMPFS, os.W_OK | os.X_OK):
        return {"folder": str(TMPFS), "measured": False, "why": f"{TMPFS} is missing here"}
    load = load1()
    progress(f"ledger sqlite: single reservations on tmpfs ({TMPFS}, {n} rollouts, load {load})")
    with tempfile.TemporaryDirectory(prefix="rl-bench-", dir=TMPFS) as tmp:
        rates, baseline = _reserve_rates("sqlite", Path(tmp), n, 1, repeats, batches=False)
    return {"folder": str(TMPFS), "measured": True, **rates, "baseline": baseline, "load1": load}


def bench_ledgers(sizes: Sizes, progress: Progress = _nothing) -> dict[str, Any]:
    """Reservation and commit rates per backend, with their plain baselines."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rl-bench-") as tmp:
        folder = Path(tmp)
        for backend in ("memory", "sqlite"):
            n = sizes.rollouts if backend == "memory" else sizes.sqlite_rollouts
            batch = 100 if backend == "memory" else 1000
            load = load1()
            progress(f"ledger {backend}: single and batch reservations ({n} rollouts, load {load})")
            rates, baseline = _reserve_rates(backend, folder, n, batch, sizes.ledger_repeats)
            races = []
            for w in sizes.racers:
                progress(f"ledger {backend}: {w} racing threads")
                races.append(_race(backend, folder, sizes.race_rollouts, w))
            small, large = sizes.commit_sizes if backend == "memory" else sizes.sqlite_commit_sizes
            progress(f"ledger {backend}: commits at {small} and {large} rollouts")
            commits = _commit_rates(backend, folder, (small, large), sizes.ledger_repeats)
            single = rates["single_per_s"]
            one = next((r["wins_per_s"] for r in races if r["workers"] == 1), None)
            most = max(races, key=lambda r: int(r["workers"])) if races else None
            ratios = {
                "batch_vs_single": _ratio(rates["batch_per_s"], single),
                "commit_large_vs_small": _ratio(commits[str(small)], commits[str(large)]),
                f"racing_{most['workers'] if most else 0}_vs_1": _ratio(
                    most["wins_per_s"] if most else None, one
                ),
            }
            if backend == "sqlite":
                ratios["batch_vs_executemany"] = _ratio(
                    rates["batch_per_s"], baseline[f"executemany_{batch}_per_s"]
                )
                ratios["batch_vs_executemany_with_events"] = _ratio(
                    rates["batch_per_s"], baseline[f"executemany_with_events_{batch}_per_s"]
                )
                ratios["single_vs_autocommit_update"] = _ratio(
                    single, baseline["autocommit_update_per_s"]
                )
                tmpfs = _tmpfs_single(n, sizes.ledger_repeats, progress)
                ratios["single_vs_autocommit_update_tmpfs"] = (
                    _ratio(tmpfs["single_per_s"], tmpfs["baseline"]["autocommit_update_per_s"])
                    if tmpfs["measured"]
                    else None
                )
                extra: dict[str, Any] = {"tmpfs": tmpfs}
            else:
                progress(f"ledger memory: per-row cost at {sizes.scale_rollouts} rollouts, gc on")
                extra = {"scale": _memory_scale(sizes.scale_rollouts, sizes.scale_repeats)}
            out[backend] = {
                **extra,
                "load1": load,
                "rollouts": n,
                "batch_size": batch,
                **rates,
                "racing": races,
                "commits_per_s": commits,
                "commit_update_size": 10,
                "baseline": baseline,
                "ratios": {k: None if v is None else round(v, 3) for k, v in ratios.items()},
            }
    return out


# ---- 3. checkers ------------------------------------------------------------------------------


def bench_checkers(sizes: Sizes, progress: Progress = _nothing) -> dict[str, Any]:
    """Fuzz steps per second (the campaign runner) and explorer states per second."""
    from rollout_lifecycle.spec.bounds import EXPLORER_MODELS
    from rollout_lifecycle.spec.explorer import explore
    from rollout_lifecycle.stateful_tests.runner import MACHINES, run_campaign

    fuzz: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rl-bench-fuzz-") as tmp:
        for backend in sizes.fuzz_backends:
            progress(f"fuzz on {backend}: {sizes.fuzz_examples} examples per machine")
            report = run_campaign(
                list(MACHINES),
                backend,
                examples=sizes.fuzz_examples,
                seed=0,
                profile="ci",
                workdir=Path(tmp) / backend,
            )
            fuzz[backend] = {
                name: {
                    "examples": run.examples,
                    "steps": run.steps,
                    "elapsed_s": round(run.elapsed_s, 3),
                    "steps_per_s": round(run.steps_per_s, 1),
                    "failed": run.failure is not None,
                }
                for name, run in report.runs.items()
            }
    models: dict[str, Any] = {}
    for name, (factory, _about) in EXPLORER_MODELS.items():
        progress(f"explore {name}")
        t0 = time.perf_counter()
        res = explore(factory(), max_states=sizes.explore_max_states)
        dt = time.perf_counter() - t0
        models[name] = {
            "distinct_states": res.distinct_states,
            "complete": sizes.explore_max_states is None
            or res.distinct_states < sizes.explore_max_states,
            "elapsed_s": round(dt, 3),
            "states_per_s": round(res.distinct_states / dt, 1) if dt > 0 else None,
        }
    return {"fuzz": fuzz, "explore": models}


# ---- goals ---------------------------------------------------------------------------------


def _goal(what: str, value: float | None, target: str, load: float | None = None) -> dict[str, Any]:
    """One goal: `target` is '<= x' or '>= x'; `met` is None when nothing was measured;
    `load` the 1-minute load average when it was measured, where known."""
    op, bound = target.split()
    met = (
        None if value is None else (value <= float(bound) if op == "<=" else value >= float(bound))
    )
    return {
        "goal": what,
        "measured": None if value is None else round(value, 3),
        "target": target,
        "met": met,
        "load1": load,
    }


def goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 13's goals, each with the ratio this run measured, met or not."""
    out: list[dict[str, Any]] = []
    for row in report.get("admission", {}).get("rows", []):
        if row["T"] != 4096 or row["B"] not in (1024, 4096):
            continue
        g = functools.partial(_goal, load=row.get("load1"))
        case = f"{row['library']} B={row['B']} T={row['T']}"
        r = row["ratios"]
        out += [
            g(f"{case}: gate time / bare expression", r["arrays_vs_bare"], "<= 1"),
            g(f"{case}: gate time / read-once bound", r["arrays_vs_read_once"], "<= 2"),
            g(f"{case}: verl seq_mean_k1 time / gate", r["verl_vs_arrays"], ">= 5"),
            g(
                f"{case}: peak extra memory / inputs",
                row["peak_extra_vs_inputs"]["gate_arrays"],
                "<= 0.25",
            ),
            g(f"{case}: records path / array path", r["records_vs_arrays"], "<= 1.5"),
        ]
    ledgers = report.get("ledgers", {})
    if "memory" in ledgers:
        mem = ledgers["memory"]
        g = functools.partial(_goal, load=mem.get("load1"))
        small, large = sorted(mem["commits_per_s"], key=int)
        out += [
            g("memory: batch / single reservation rate", mem["ratios"]["batch_vs_single"], ">= 3"),
            g(
                f"memory: commit time at {large} / at {small} rollouts",
                mem["ratios"]["commit_large_vs_small"],
                "<= 1.5",
            ),
        ]
        scale = mem.get("scale")
        if scale:
            sizes = sorted(scale["cpu_us_per_row"], key=int)
            out.append(
                g(
                    "memory: batch reservation CPU per row, most / least over "
                    f"{sizes[0]}..{sizes[-1]} rollouts, gc on",
                    scale["ratios"]["cpu_max_vs_min"],
                    "<= 1.2",
                )
            )
    if "sqlite" in ledgers:
        sq = ledgers["sqlite"]
        g = functools.partial(_goal, load=sq.get("load1"))
        r = sq["ratios"]
        vs_update = r.get("single_vs_autocommit_update")
        wins = {x["workers"]: x["wins_per_s"] for x in sq["racing"]}
        out += [
            g(
                "sqlite: batch reservation / executemany rate",
                r.get("batch_vs_executemany"),
                ">= 0.5",
            ),
            g(
                "sqlite: single CAS time / autocommit UPDATE time",
                None if not vs_update else 1 / vs_update,
                "<= 1.5",
            ),
            g(
                "sqlite: 8 racing threads / 1 thread (wins per s)",
                _ratio(wins.get(8), wins.get(1)),
                ">= 0.5",
            ),
            g(
                f"sqlite: commit time at {max(sq['commits_per_s'], key=int)} / at "
                f"{min(sq['commits_per_s'], key=int)} rollouts",
                r["commit_large_vs_small"],
                "<= 1.5",
            ),
        ]
    if "pacing" in report:
        from rollout_lifecycle.cli import pacing_sim

        out += pacing_sim.goals(report["pacing"], _goal)
    from rollout_lifecycle.cli import bench_speed  # issue 22's goals

    out += bench_speed.goals(report, _goal)
    if report.get("fleet"):  # issue 36's fleet part (cli/bench_fleet.py)
        from rollout_lifecycle.cli import bench_fleet

        out += bench_fleet.goals(report, _goal)
    return out


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    torch = _optional_torch()
    _, verl_version = _verl_rejection() if torch is not None else (None, None)
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "torch": None if torch is None else str(torch.__version__),
        "verl": verl_version,
        "sqlite": sqlite3.sqlite_version,
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def run(
    sizes: Sizes,
    *,
    parts: Sequence[str] = ("admission", "ledgers", "checkers"),
    progress: Progress = _nothing,
    fleet: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole report: machine, each part, and the goals with their measured ratios."""
    t0 = time.perf_counter()
    report: dict[str, Any] = {"schema": SCHEMA, "quick": sizes is QUICK, "machine": machine()}
    if "admission" in parts:
        report["admission"] = bench_admission(sizes, progress)
    if "ledgers" in parts:
        report["ledgers"] = bench_ledgers(sizes, progress)
    if "checkers" in parts:
        report["checkers"] = bench_checkers(sizes, progress)
    if "pacing" in parts:  # issue 21's simulation (cli/pacing_sim.py)
        from rollout_lifecycle.cli import pacing_sim

        config = pacing_sim.QUICK if sizes is QUICK else pacing_sim.FULL
        report["pacing"] = pacing_sim.bench_pacing(config, progress=progress)
    speed = [p for p in parts if p in ("gate", "admit", "startup", "ledger-check")]
    if speed:  # issue 22's parts (cli/bench_speed.py)
        from rollout_lifecycle.cli import bench_speed

        report.update(bench_speed.run(sizes is QUICK, speed, progress))
    if "fleet" in parts:  # issue 36's fleet (cli/bench_fleet.py): options in `fleet`
        from rollout_lifecycle.cli import bench_fleet

        opts = dict(fleet or {})
        base = bench_fleet.QUICK if sizes is QUICK else bench_fleet.FULL
        fsizes = attrs.evolve(
            base,
            seconds=opts.get("seconds") or base.seconds,
            rounds=opts.get("rounds") or base.rounds,
        )
        report["fleet"] = bench_fleet.bench_fleet(
            fsizes,
            folder=opts.get("folder"),
            postgres_url=opts.get("postgres_url"),
            progress=progress,
        )
    report["goals"] = goals(report)
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return report
