"""Per-step cost of the ledger-backed buffer against verl's own ReplayBufferAsync.

    python benchmarks/verl_v1_overhead.py [--steps 20] [--groups 8] [--n 4] [--json out.json]

Both buffers sample the same trajectories (same shapes, tags, tensors; fresh uids) from the
same real, in-process TransferQueue: each step writes `groups` GRPO groups of `n`
trajectories (64 response tokens) the way verl's agent loop does, samples `groups` groups,
and clears them as verl's `fit()` does. verl's buffer runs with max_off_policy_threshold 2;
ours against a SQLite ledger and registry (policy max_lag 1, pointer = step - 1), so its
time includes registering every trajectory, the lag gate, the CAS reservation of the batch
and committing the previous step. Wall times per `sample` call; read the difference, the
absolute seconds are this machine's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

T = 64


def _put_step(tq: Any, torch: Any, prefix: str, step: int, groups: int, n: int) -> None:
    for g in range(groups):
        uid = f"{prefix}{step}x{g}"
        keys = [f"{uid}_{s}_0" for s in range(n)]
        fields = torch.nn.utils.rnn.pad_sequence([torch.arange(T)] * n, batch_first=True)
        from tensordict import TensorDict

        td = TensorDict(
            {
                "responses": fields,
                "response_mask": torch.ones(n, T, dtype=torch.int64),
                "rollout_log_probs": torch.full((n, T), -0.5),
                "rm_scores": torch.zeros(n, T),
            },
            batch_size=[n],
        )
        tag = {"status": "success", "global_steps": step - 1, "seq_len": T + 8}
        tag.update(min_global_steps=step - 1, max_global_steps=step - 1)
        tq.kv_batch_put(keys=keys, partition_id="train", fields=td, tags=[dict(tag)] * n)
        tq.kv_put(
            key=uid,
            partition_id="train",
            tag={"is_prompt": True, "status": "finished", "global_steps": step - 1},
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import ray
    import torch
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

    from rollout_lifecycle.gpu_check.verl_v1 import LedgerReplayBuffer
    from rollout_lifecycle.model.backends import open_backend
    from rollout_lifecycle.model.coordinator import ActivationCoordinator
    from rollout_lifecycle.model.records import AdmissionPolicy, WorkerAck
    from rollout_lifecycle.model.registry import set_admission_policy

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    tmp = Path(tempfile.mkdtemp(prefix="verl-v1-bench-"))
    be = open_backend(f"sqlite:///{tmp / 'ledger.db'}")
    set_admission_policy(be.registry, AdmissionPolicy(1, 0.5), "set by the operator")
    coord = ActivationCoordinator(
        be.registry, ["rollout-0"], ledger=be.ledger, policy=AdmissionPolicy(1, 0.5)
    )

    def activate(v: int) -> None:
        h = f"{v:x}".rjust(64, "b")
        coord.prepare(v)
        coord.commit_artifact(v, h)
        coord.distribute(v)
        tok = coord.attempt_token("rollout-0", v)
        coord.record_ack(WorkerAck("rollout-0", v, h, token=tok))
        coord.try_activate(v)

    common: dict[str, Any] = dict(
        trainer_mode="separate_async",
        trainer_config={},
        max_off_policy_threshold=2,
        max_off_policy_strategy="drop",
        poll_interval=0.01,
        refill_fn=lambda k: k,
    )
    verl_buf = ReplayBufferAsync(sampler_kwargs={}, **common)
    ours = LedgerReplayBuffer(
        sampler_kwargs={
            "ledger_url": be.url,
            "run_id": "bench",
            "tokenizer_id": "tok",
            "temperature": 1.0,
            "response_length": T,
        },
        backend=be,
        **common,
    )
    times: dict[str, list[float]] = {"verl": [], "ledger": []}
    ledger_inner: list[float] = []
    for step in range(1, args.steps + 1):
        activate(step - 1)
        for name, buf, prefix in (("verl", verl_buf, "v"), ("ledger", ours, "l")):
            _put_step(tq, torch, prefix, step, args.groups, args.n)
            before = getattr(buf, "ledger_seconds", 0.0)
            t0 = time.perf_counter()
            meta, _m = buf.sample(global_steps=step, partition_id="train", batch_size=args.groups)
            times[name].append(time.perf_counter() - t0)
            if name == "ledger":
                ledger_inner.append(buf.ledger_seconds - before)
            assert len(meta.keys) == args.groups * args.n, len(meta.keys)
            tq.kv_clear(keys=meta.keys, partition_id="train")
    ours.finish(args.steps)
    warm = slice(2, None)  # the first steps include imports and connection set-up

    def ms(xs: list[float]) -> dict[str, float]:
        return {
            "median_ms": round(1000 * statistics.median(xs), 2),
            "mean_ms": round(1000 * statistics.fmean(xs), 2),
        }

    stats = be.ledger.statistics()
    result = {
        "steps": args.steps,
        "groups_per_step": args.groups,
        "trajectories_per_step": args.groups * args.n,
        "response_tokens": T,
        "verl_ReplayBufferAsync": ms(times["verl"][warm]),
        "LedgerReplayBuffer": ms(times["ledger"][warm]),
        "ledger_work_inside_sample": ms(ledger_inner[warm]),
        "overhead_per_step_ms": round(
            1000
            * (statistics.median(times["ledger"][warm]) - statistics.median(times["verl"][warm])),
            2,
        ),
        "ledger_backend": "sqlite",
        "consumed": sum(1 for e in be.ledger.snapshot().values() if e.state == "consumed"),
        "ledger_statistics": {
            k: v for k, v in attrs.asdict(stats).items() if isinstance(v, int | float)
        },
    }
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    be.close()
    tq.close()
    ray.shutdown()


if __name__ == "__main__":
    main()
