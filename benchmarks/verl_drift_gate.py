"""How many rows of one 1024 x 4096 batch each drift gate keeps, and what each costs.

    python benchmarks/verl_drift_gate.py [--json out.json]     (needs the [verl] extra)
    python benchmarks/verl_drift_gate.py --rows 16 --cols 64 --repeats 1   (a smoke run)

The batch (seeded, so every run builds the same one): B=1024 sequences, T=4096 positions,
response lengths uniform in [64, 4096]; per sequence a noise level sigma drawn log-uniformly
in [0.01, 1], and per token log(pi_train/pi_rollout) ~ N(0, sigma^2): zero-mean noise, the
way kernel and precision mismatches look, with some sequences far noisier than others.

Compared, at the same bound 0.2 on the log scale:
* this project's gate (`gpu_check.verl_adapter.admission_mask`): mean |log-ratio| <= 0.2;
* verl 0.9.1's `compute_rollout_rejection_mask(rollout_rs="seq_mean_k1")` with ratio bounds
  exp(-0.2)_exp(0.2): |signed mean log-ratio| <= 0.2;
* and, for scale, verl's `decoupled_seq_is_rs` preset: seq_sum_k1 at ratio bounds 0.5_2.0.
Times are the best of 5 on this machine, side by side; read the ratio, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

B, T, BOUND, SEED, REPEATS = 1024, 4096, 0.2, 20261201, 5


def best_of(fn: Callable[[], Any], repeats: int = REPEATS) -> float:
    """The best wall time (s) of `repeats` calls: the run least disturbed by the machine."""
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def batch(rows: int = B, cols: int = T) -> dict[str, Any]:
    """The seeded batch described in the module docstring (torch tensors)."""
    import torch

    rng = np.random.default_rng(SEED)
    lengths = rng.integers(min(64, cols), cols + 1, size=rows)
    sigma = np.exp(rng.uniform(math.log(0.01), math.log(1.0), size=rows))
    mask = (np.arange(cols)[None, :] < lengths[:, None]).astype(np.int64)
    behaviour = -rng.uniform(0.0, 3.0, size=(rows, cols)).astype(np.float32)
    log_ratio = (rng.standard_normal((rows, cols)) * sigma[:, None]).astype(np.float32)
    return {
        "rollout_log_probs": torch.from_numpy(behaviour),
        "old_log_probs": torch.from_numpy(behaviour + log_ratio),
        "response_mask": torch.from_numpy(mask),
        "min_global_steps": np.zeros(rows, dtype=np.int64),
        "sigma": sigma,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--rows", type=int, default=B, help=f"sequences B (default {B})")
    parser.add_argument("--cols", type=int, default=T, help=f"positions T (default {T})")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed calls per gate")
    args = parser.parse_args()
    if args.rows < 1 or args.cols < 1 or args.repeats < 1:
        parser.error("--rows, --cols and --repeats must be >= 1")
    import torch
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    from rollout_lifecycle.gpu_check.verl_adapter import admission_mask

    torch.set_num_threads(1)
    rows, cols, repeats = args.rows, args.cols, args.repeats
    b = batch(rows, cols)
    log_ratio = b["old_log_probs"] - b["rollout_log_probs"]
    mask = b["response_mask"]

    def ours() -> Any:
        return admission_mask(b, current_version=0, max_lag=0, max_drift=BOUND)

    def verl_at(threshold: str, option: str = "seq_mean_k1") -> Callable[[], Any]:
        def run() -> Any:
            return compute_rollout_rejection_mask(
                log_ratio, mask, rollout_rs=option, rollout_rs_threshold=threshold
            )[0]

        return run

    same = f"{math.exp(-BOUND)}_{math.exp(BOUND)}"
    ours_kept = int(ours().keep.sum())
    verl_same = int((verl_at(same)().sum(-1) > 0).sum())
    verl_preset = int((verl_at("0.5_2.0", "seq_sum_k1")().sum(-1) > 0).sum())
    mean_abs = (log_ratio.abs() * mask).sum(-1) / mask.sum(-1)
    signed = (log_ratio * mask).sum(-1) / mask.sum(-1)
    figures = {
        "batch": {"B": rows, "T": cols, "seed": SEED, "tokens": int(mask.sum())},
        "bound": BOUND,
        "kept": {
            "mean_abs_log_ratio<=0.2 (this gate)": ours_kept,
            f"verl seq_mean_k1 {same}": verl_same,
            "verl seq_sum_k1 0.5_2.0 (decoupled_seq_is_rs preset)": verl_preset,
        },
        "rows_with_mean_abs_over_bound": int((mean_abs > BOUND).sum()),
        "largest_abs_signed_mean": float(signed.abs().max()),
        f"seconds_best_of_{repeats}": {
            "this gate": best_of(ours, repeats),
            "verl seq_mean_k1": best_of(verl_at(same), repeats),
        },
        "torch": torch.__version__,
    }
    s = figures[f"seconds_best_of_{repeats}"]
    figures["ratio_verl_over_this_gate"] = s["verl seq_mean_k1"] / s["this gate"]
    print(json.dumps(figures, indent=2))
    if args.json is not None:
        from rollout_lifecycle.model.atomic import atomic_write

        atomic_write(args.json, json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
