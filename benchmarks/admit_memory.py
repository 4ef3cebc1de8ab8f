"""Peak memory of `rollout-lifecycle admit` against input size, with a length outlier.

    python benchmarks/admit_memory.py            # 1,023 rollouts of 256 tokens + 1 outlier

For each outlier length (0 = none, 100k, 500k tokens) it writes the JSONL, runs the real
command in a subprocess, and reports the child's peak RSS next to the input size and next
to the peak RSS of the interpreter with the package imported (`admit --help`), measured in
the same run. Ratios, not absolute figures, are what to compare across machines.
"""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

CONDITIONS = {
    "tokenizer_id": "tok",
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_tokens": 600_000,
}
SHORT, N_SHORT = 256, 1023


def rollout(i: int, n: int, rng: random.Random) -> dict[str, object]:
    old = [round(-rng.random() * 3, 4) for _ in range(n)]
    return {
        "rollout_id": f"r{i}",
        "prompt_id": "p",
        "dataset": "d",
        "sample_index": 0,
        "behavior_version": 3,
        "artifact_hash": "a" * 64,
        "conditions": CONDITIONS,
        "response_token_ids": [1] * n,
        "action_mask": [True] * n,
        "behavior_log_probs": old,
        "current_log_probs": [o + 0.01 for o in old],
    }


def peak_rss_mb(args: list[str]) -> tuple[float, int]:
    """Peak RSS of one child run (MB) and its exit code (ru_maxrss is per child here)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    res = subprocess.run(args, capture_output=True, text=True, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if res.returncode != 0:
        print(res.stderr[-2000:], file=sys.stderr)
    return max(after, before) / 1024, res.returncode


def main() -> None:
    cli = str(Path(sys.executable).parent / "rollout-lifecycle")
    rng = random.Random(0)
    # each measurement in its own process tree, so ru_maxrss of earlier children cannot hide it
    base, _ = peak_rss_mb(
        [
            sys.executable,
            "-c",
            "import subprocess,sys; subprocess.run([sys.argv[1], 'admit', '--help'],"
            " capture_output=True)",
            cli,
        ]
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for outlier in (0, 100_000, 500_000):
            inp = Path(tmp) / f"in-{outlier}.jsonl"
            with inp.open("w") as f:
                for i in range(N_SHORT):
                    f.write(json.dumps(rollout(i, SHORT, rng)) + "\n")
                if outlier:
                    f.write(json.dumps(rollout(N_SHORT, outlier, rng)) + "\n")
            out = Path(tmp) / f"out-{outlier}.jsonl"
            probe = (
                "import subprocess,sys; r=subprocess.run(sys.argv[1:], capture_output=True);"
                "sys.exit(r.returncode)"
            )
            peak, rc = peak_rss_mb(
                [
                    sys.executable,
                    "-c",
                    probe,
                    cli,
                    "admit",
                    str(inp),
                    "--out",
                    str(out),
                    "--current-version",
                    "3",
                    "--max-lag",
                    "1",
                    "--max-drift",
                    "0.2",
                    "--quiet",
                ]
            )
            size_mb = inp.stat().st_size / 2**20
            rows.append(
                {
                    "outlier_tokens": outlier,
                    "input_mb": round(size_mb, 1),
                    "peak_rss_mb": round(peak, 1),
                    "exit": rc,
                    "rss_over_baseline_mb": round(peak - base, 1),
                    "extra_rss_per_input_mb": round((peak - base) / size_mb, 2),
                }
            )
    print(json.dumps({"baseline_rss_mb": round(base, 1), "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
