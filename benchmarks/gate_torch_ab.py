"""The torch gate (assess_arrays on CPU tensors) of this checkout against another version of
it, each next to the bare torch expression.

    git archive <base> model/gate.py | tar -x -C /tmp/base   (the version to compare with)
    python benchmarks/gate_torch_ab.py /tmp/base/model/gate.py [--repeats 15]
        [--cases 256x1024,1024x1024] [--dtypes float32,bfloat16] [--threads 1,2]

On the data of `rollout-lifecycle bench --part gate` (cli/bench_speed.py), for each case,
thread count (torch.set_num_threads) and dtype it runs in turn, `--repeats` times, the order
rotating each round as in the bench: the given file's gate ("old"), this checkout's gate
("new") and the bare expression. It prints medians of wall and CPU time (time.process_time:
all threads, so torch's spinning workers count too), each gate over the bare expression,
and whether old and new give the same reasons and the largest relative difference of their
drifts.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

# run as a script, this folder is on sys.path: the records A/B's loader and case parser
from gate_records_ab import load_gate, parse_cases

from rollout_lifecycle.cli import benchmarks as B
from rollout_lifecycle.cli.bench_speed import bare_expression, interleaved_wall_cpu
from rollout_lifecycle.model import gate as new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old_gate", help="path of the gate.py to compare with")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--cases", help="e.g. 256x1024,4096x4096 (default: the bench's six)")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    old = load_gate(args.old_gate)
    cases = parse_cases(args.cases)
    before = torch.get_num_threads()
    try:
        for b, t in cases:
            data = B._batch(b, t)
            for threads in (int(x) for x in args.threads.split(",")):
                torch.set_num_threads(threads)
                for dtype in args.dtypes.split(","):
                    _case(old, data, b, t, threads, dtype, args.repeats)
    finally:
        torch.set_num_threads(before)


def _case(old: Any, data: dict[str, Any], b: int, t: int, threads: int, dtype: str, n: int) -> None:
    o, c = (torch.from_numpy(data[k]).to(getattr(torch, dtype)) for k in ("old", "cur"))
    m = torch.from_numpy(data["mask"])
    args = (o, c, m, data["bvs"], B.CURRENT, B.MAX_LAG, B.MAX_DRIFT)
    variants: dict[str, Callable[[], Any]] = {
        "old": lambda: old.assess_arrays(*args),
        "new": lambda: new.assess_arrays(*args),
        "bare": lambda: bare_expression(o, c, m),
    }
    r_old, r_new = variants["old"](), variants["new"]()
    same = r_old.reasons == r_new.reasons
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.nanmax(np.abs(r_new.drift - r_old.drift) / np.abs(r_old.drift))
    for fn in variants.values():  # warm up
        fn()
    wall, cpu = interleaved_wall_cpu(variants, n)
    mw = {k: v * 1e3 for k, v in wall.items()}
    mc = {k: v * 1e3 for k, v in cpu.items()}
    print(
        f"{dtype:8s} B={b:4d} T={t:4d} threads={threads} same={same} drift_rel_diff={rel:.1e} | "
        f"wall ms old {mw['old']:.3f} new {mw['new']:.3f} bare {mw['bare']:.3f}; gate/bare "
        f"{mw['old'] / mw['bare']:.2f} -> {mw['new'] / mw['bare']:.2f} | cpu ms old "
        f"{mc['old']:.2f} new {mc['new']:.2f} bare {mc['bare']:.2f}; gate/bare "
        f"{mc['old'] / mc['bare']:.2f} -> {mc['new'] / mc['bare']:.2f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
