"""The benchmark suite: `python benchmarks/run.py [options]` is `rollout-lifecycle bench`.

The measurements live in rollout_lifecycle/cli/benchmarks.py (installed with the package, so
the command works from a wheel too); this script only forwards its arguments. See
`rollout-lifecycle bench --help` and docs/benchmarks/README.md for the last full run.
"""

from __future__ import annotations

import sys

from rollout_lifecycle.cli.main import run

if __name__ == "__main__":
    sys.exit(run(["bench", *sys.argv[1:]]))
