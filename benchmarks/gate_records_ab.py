"""The gate's records path against another version of it, next to the array path.

    git archive <base> | tar -x -C /tmp/base      (the version to compare with)
    python benchmarks/gate_records_ab.py /tmp/base/model/gate.py [--repeats 7] [--cases 256x1024]

On the data of `rollout-lifecycle bench --part gate` (cli/bench_speed.py: float32 B x T log-probs,
ragged lengths T/2..T, Rollout records holding each row's arrays, CPU tensors as the current
log-probs), for each case and 1 and 2 torch threads, it runs in turn, `--repeats` times:
`assess_arrays` on the tensors (the array path), `AdmissionGate.assess_batch` of the given file
("old") and of this checkout ("new"), and "new" with every decision read (its decisions are
built when read), and a floor: the array path plus one C-level pass per record field that the
record checks read (statuses, states, ids, versions, hashes, conditions, evidence, its three
arrays and their lengths), no check, no gather, no decision: what any records path that keeps
the checks costs at least. It prints medians of wall and CPU time (time.process_time, which
other work on a shared machine inflates less), the records / arrays ratios (floor / arrays
too), and whether old and new give the same decisions, figures included, to the bit.
"""

from __future__ import annotations

import argparse
import importlib.util
import operator
from collections.abc import Callable
from typing import Any

import torch

from rollout_lifecycle.cli import benchmarks as B
from rollout_lifecycle.cli.bench_speed import interleaved_wall_cpu
from rollout_lifecycle.model import gate as new

CASES = [(b, t) for b in (256, 1024, 4096) for t in (1024, 4096)]


def load_gate(path: str) -> Any:
    """Another version's model/gate.py, imported from its file as module `gate_old`."""
    spec = importlib.util.spec_from_file_location("gate_old", path)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    return old


def parse_cases(text: str | None) -> list[tuple[int, int]]:
    """--cases "256x1024,4096x4096" as (B, T) pairs; None: the bench's six."""
    if not text:
        return CASES
    return [(int(c.split("x")[0]), int(c.split("x")[1])) for c in text.split(",")]


def _fields(decisions: Any) -> list[tuple[Any, ...]]:
    return [
        (d.rollout_id, d.accepted, d.reason, d.route, d.freshness, d.drift, d.lag)
        for d in decisions
    ]


_GET = {
    k: operator.attrgetter(k)
    for k in (
        "status",
        "state",
        "rollout_id",
        "behavior_version",
        "artifact_hash",
        "conditions",
        "evidence",
        "behavior_log_probs",
        "action_mask",
        "response_token_ids",
    )
}


def _read_fields(ros: list[Any]) -> None:
    """Every field the record checks read, one C-level pass each (the floor's reads)."""
    g = _GET
    statuses = list(map(g["status"], ros))
    for k in ("state", "rollout_id", "behavior_version", "artifact_hash"):
        list(map(g[k], statuses))
    list(map(g["conditions"], ros))
    evidence = list(map(g["evidence"], ros))
    for k in ("behavior_log_probs", "action_mask", "response_token_ids"):
        list(map(len, map(g[k], evidence)))


def _variants(
    g_old: Any, g_new: Any, arrays: tuple[Any, ...], ros: list[Any]
) -> dict[str, Callable[[], Any]]:
    o, c, m, bvs = arrays

    def floor() -> None:
        _read_fields(ros)
        new.assess_arrays(o, c, m, bvs, B.CURRENT, B.MAX_LAG, B.MAX_DRIFT)

    return {
        "floor": floor,
        "arrays": lambda: new.assess_arrays(o, c, m, bvs, B.CURRENT, B.MAX_LAG, B.MAX_DRIFT),
        "old": lambda: g_old.assess_batch(ros, c, B.CURRENT),
        "new": lambda: g_new.assess_batch(ros, c, B.CURRENT),
        "new+read": lambda: list(g_new.assess_batch(ros, c, B.CURRENT)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old_gate", help="path of the gate.py to compare with")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cases", help="e.g. 256x1024,4096x4096 (default: the bench's six)")
    args = ap.parse_args()
    old = load_gate(args.old_gate)
    cases = parse_cases(args.cases)
    policy = (B.MAX_LAG, B.MAX_DRIFT, B.CONDITIONS)
    g_new = new.AdmissionGate(new.GatePolicy(*policy), registry=B.REGISTRY)
    g_old = old.AdmissionGate(old.GatePolicy(*policy), registry=B.REGISTRY)
    before = torch.get_num_threads()
    try:
        for b, t in cases:
            data = B._batch(b, t)
            ros = B._records(data)
            o, c, m = (torch.from_numpy(data[k]) for k in ("old", "cur", "mask"))
            bvs = data["bvs"]
            for threads in (1, 2):
                torch.set_num_threads(threads)
                variants = _variants(g_old, g_new, (o, c, m, bvs), ros)
                same = _fields(variants["old"]()) == _fields(variants["new"]())
                for fn in variants.values():  # warm up
                    fn()
                wall, cpu = interleaved_wall_cpu(variants, args.repeats)
                mw = {k: v * 1e3 for k, v in wall.items()}
                mc = {k: v * 1e3 for k, v in cpu.items()}
                print(
                    f"B={b:5d} T={t:5d} threads={threads} same={same} | wall ms: arrays "
                    f"{mw['arrays']:.2f} old {mw['old']:.2f} new {mw['new']:.2f} new+read "
                    f"{mw['new+read']:.2f}; records/arrays {mw['old'] / mw['arrays']:.2f} -> "
                    f"{mw['new'] / mw['arrays']:.2f}, floor {mw['floor'] / mw['arrays']:.2f} | "
                    f"cpu ms: arrays {mc['arrays']:.2f} old "
                    f"{mc['old']:.2f} new {mc['new']:.2f} new+read {mc['new+read']:.2f}; "
                    f"records/arrays {mc['old'] / mc['arrays']:.2f} -> "
                    f"{mc['new'] / mc['arrays']:.2f}, floor {mc['floor'] / mc['arrays']:.2f}",
                    flush=True,
                )
    finally:
        torch.set_num_threads(before)


if __name__ == "__main__":
    main()
