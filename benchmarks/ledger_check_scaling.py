"""How `ledger check` scales: build ledgers of N rollouts through the public API, time the
check, report seconds per event (flat = linear). Ratios within one run; not a timed test.

    python benchmarks/ledger_check_scaling.py 1000 2000 4000 100000

Each rollout is added rewarded, reserved in a batch by one of several updates and
committed: three events per rollout plus the registry's activation of v0.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rollout_lifecycle.cli.bench_speed import build_ledger as build  # also `bench` uses it


def main(sizes: list[int]) -> None:
    """Build and check each size; print one JSON line per size."""
    cli = Path(sys.executable).parent / "rollout-lifecycle"
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            db = Path(tmp) / "ledger.db"
            t0 = time.perf_counter()
            build(db, n)
            built = time.perf_counter() - t0
            t1 = time.perf_counter()
            res = subprocess.run(
                [str(cli), "ledger", "check", "--backend", f"sqlite:///{db}", "--json", "--quiet"],
                capture_output=True,
                text=True,
                check=False,
            )
            wall = time.perf_counter() - t1
            data = json.loads(res.stdout)
            print(
                json.dumps(
                    {
                        "rollouts": n,
                        "events": data["events"],
                        "exit": res.returncode,
                        "violations": data["violation_count"],
                        "check_wall_s": round(wall, 2),
                        "check_internal_s": data["elapsed_s"],
                        "us_per_event": round(1e6 * data["elapsed_s"] / data["events"], 1),
                        # the check's own CPU: flat even when other work slows the wall clock
                        "cpu_us_per_event": round(1e6 * data["cpu_s"] / data["events"], 1),
                        "build_s": round(built, 1),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1000, 2000, 4000])
