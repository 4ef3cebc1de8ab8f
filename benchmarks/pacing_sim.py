"""Issue 21's simulation: discard-and-requeue, AReaL's capacity rule and pacing, side by side.

    python benchmarks/pacing_sim.py [--quick] [--seed N] [--requeue-after N] [--json out.json]

The simulation lives in rollout_lifecycle/cli/pacing_sim.py (its docstring says what is
modelled and why); `rollout-lifecycle bench --part pacing` runs the same thing inside the
bench report. This script prints the table and the strict-pacing frontier.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_lifecycle.cli import pacing_sim


def main(argv: list[str] | None = None) -> int:
    """Run every strategy at every lag and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the CI-sized pool (seconds)")
    ap.add_argument("--seed", type=int, default=None, help="another pool of prompts")
    ap.add_argument(
        "--requeue-after",
        type=int,
        default=None,
        help="retry a prompt behind this many queued ones (default: behind the whole pool)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = ap.parse_args(argv)
    config = pacing_sim.QUICK if args.quick else pacing_sim.FULL
    if args.seed is not None:
        config = attrs.evolve(config, seed=args.seed)
    if args.requeue_after is not None:
        config = attrs.evolve(config, requeue_after=args.requeue_after)
    report = pacing_sim.bench_pacing(config, progress=lambda m: print(m, file=sys.stderr))
    print("\n".join(pacing_sim.markdown(report)))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
