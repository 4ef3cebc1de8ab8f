"""Per-step cost of the ledger-backed buffer against verl's own ReplayBufferAsync, at
ledgers pre-filled with older rollouts.

    python benchmarks/verl_v1_overhead.py [--steps 20] [--groups 8] [--n 4]
        [--prefill 0 10000 100000] [--versions 0] [--ledger-dir DIR]
        [--commit-at publish|sample] [--land-at worker|sample] [--json out.json]

Both buffers sample the same trajectories (same shapes, tags, tensors; fresh uids) from the
same real, in-process TransferQueue: each step dispatches `groups` GRPO groups through the
ledger (`dispatch_many`, as LedgerAgentLoopManager does before verl generates; timed apart,
it is not in `sample`), writes them the way verl's agent loop and LedgerAgentLoopWorker
do (`n` trajectories of 64 response tokens, verl's tags plus the reward tag), lands each
finished group the way LedgerAgentLoopWorker does before verl marks it finished
(`land_finished_group`, one ledger step a group; timed apart, it is not in `sample`;
`--land-at sample` leaves it to the buffer's step), samples
`groups` groups, and clears them as verl's `fit()` does; then commits the step where the
ledger's checkpoint engine does, when verl publishes the step's weights (timed apart;
`--commit-at sample` leaves it to the buffer's next `sample`). verl's buffer runs with
max_off_policy_threshold 2; ours against a SQLite ledger and registry (policy max_lag 1,
pointer = step - 1), so its `sample` includes reading the premise, the lag gate, and
reserving the step's groups (landing them too, with `--land-at sample`) in one ledger
step. Before the steps, each ledger
is filled with `prefill` older group rollouts (consumed, with their events), so a per-step
cost that grows with the ledger shows, and `--versions N` activates N versions first, each
after landing one update of its own as a run's step does (a run N steps long: each
version's lineage claims its update), so a cost that grows with the run's length shows; the
activation of each
step's version (the weight sync: prepare, commit, distribute, ack, activate) is timed
apart (`activate_outside_sample`); the pre-fill sizes' streams take their steps in
turn, so a load spike on the shared machine falls on every size alike. `ledger_work` is
exactly the time inside the buffer's ledger and registry calls (LedgerReplayBuffer._call),
with their count per step. Wall times per `sample` call; read the ratios, the absolute
seconds are this machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

T = 64
BARS = {(8, 4): 2.0, (64, 8): 1.5}  # issue 34: ours / verl's per step, at most
FLAT = 0.20  # and within +-20% of the empty ledger's across the pre-fill sizes


def _put_step(tq: Any, torch: Any, prefix: str, step: int, groups: int, n: int) -> None:
    """`groups` finished groups as verl's agent loop writes them (and the reward tag)."""
    from tensordict import TensorDict

    from rollout_lifecycle.gpu_check.verl_v1 import REWARD_TAG

    for g in range(groups):
        uid = f"{prefix}{step}x{g}"
        keys = [f"{uid}_{s}_0" for s in range(n)]
        td = TensorDict(
            {
                "responses": torch.arange(T).repeat(n, 1),
                "response_mask": torch.ones(n, T, dtype=torch.int64),
                "rollout_log_probs": torch.full((n, T), -0.5),
                "rm_scores": torch.zeros(n, T),
            },
            batch_size=[n],
        )
        tag = {
            "status": "success",
            "prompt_len": 8,
            "response_len": T,
            "seq_len": T + 8,
            "global_steps": step - 1,
            "min_global_steps": step - 1,
            "max_global_steps": step - 1,
            REWARD_TAG: 0.0,
        }
        tq.kv_batch_put(keys=keys, partition_id="train", fields=td, tags=[dict(tag)] * n)
        tq.kv_put(
            key=uid,
            partition_id="train",
            tag={"is_prompt": True, "status": "finished", "global_steps": step - 1},
        )


def _prefill(be: Any, n: int, h: str) -> float:
    """`n` older group rollouts, consumed through the same calls a trainer makes."""
    from rollout_lifecycle.model.ledger import Landing
    from rollout_lifecycle.model.records import AdmissionStamp, Reward

    t0 = time.perf_counter()
    r = Reward("bench", "1", 0.0)
    stamp = AdmissionStamp(0, 0, 1, 0.5, 0.0, "fresh", "ok", True)
    chunk = 2000
    for c in range(0, n, chunk):
        ids = [f"old{i}" for i in range(c, min(c + chunk, n))]
        uid = f"prefill.s{c:08d}.m0"
        got = be.ledger.land_and_reserve(
            uid,
            [Landing(i, 0, h, reward=r, tokens=4 * T) for i in ids],
            reserve=dict.fromkeys(ids, stamp),
        )
        be.ledger.commit(uid, got.reserved)
    return time.perf_counter() - t0


class Stream:
    """One pre-fill size: its ledger, verl's buffer and ours, stepped in turn with the other
    sizes' streams so a load spike on the shared machine falls on every size alike."""

    def __init__(self, args: argparse.Namespace, prefill: int) -> None:
        from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

        from rollout_lifecycle.gpu_check.verl_v1 import LedgerReplayBuffer, book_for
        from rollout_lifecycle.model.backends import open_backend
        from rollout_lifecycle.model.coordinator import ActivationCoordinator
        from rollout_lifecycle.model.records import AdmissionPolicy
        from rollout_lifecycle.model.registry import set_admission_policy

        self.args, self.prefill = args, prefill
        self.tmp = tmp = Path(tempfile.mkdtemp(prefix="verl-v1-bench-", dir=args.ledger_dir))
        self.be = open_backend(f"sqlite:///{tmp / 'ledger.db'}")
        set_admission_policy(self.be.registry, AdmissionPolicy(1, 0.5), "set by the operator")
        self.coord = ActivationCoordinator(
            self.be.registry, ["rollout-0"], ledger=self.be.ledger, policy=AdmissionPolicy(1, 0.5)
        )
        self.activate(0)
        self.prefill_s = _prefill(self.be, prefill, self.hash(0))
        self.base = args.versions  # the run's steps so far: versions 0..base are active
        for v in range(1, self.base + 1):
            self._trained(v)
            self.activate(v)
        common: dict[str, Any] = dict(
            trainer_mode="separate_async",
            trainer_config={},
            max_off_policy_threshold=2,
            max_off_policy_strategy="drop",
            poll_interval=0.01,
            refill_fn=lambda k: k,
        )
        self.verl = ReplayBufferAsync(sampler_kwargs={}, **common)
        self.run_id = f"bench{prefill}"
        self.ours = LedgerReplayBuffer(
            sampler_kwargs={"ledger_url": self.be.url, "run_id": self.run_id},
            backend=self.be,
            **common,
        )
        self.book = book_for(self.be.url, self.run_id)
        self.times: dict[str, list[float]] = {
            "verl": [],
            "ledger": [],
            "dispatch": [],
            "commit": [],
            "activate": [],
            "land": [],
        }
        self.inner: list[float] = []
        self.calls: list[Counter[str]] = []

    @staticmethod
    def hash(v: int) -> str:
        return f"{v:x}".rjust(64, "b")

    def activate(self, v: int) -> None:
        from rollout_lifecycle.model.records import WorkerAck

        c, h = self.coord, self.hash(v)
        c.prepare(v)
        c.commit_artifact(v, h)
        c.distribute(v)
        c.record_ack(WorkerAck("rollout-0", v, h, token=c.attempt_token("rollout-0", v)))
        c.try_activate(v)

    def _trained(self, v: int) -> None:
        """The update a run's step v lands before v's weights are published (one group,
        reserved and committed): v's default lineage claims it, as verl's weight sync does."""
        from rollout_lifecycle.model.ledger import Landing
        from rollout_lifecycle.model.records import AdmissionStamp, Reward

        rid, uid = f"hist{v}", f"hist.s{v:08d}.m0"
        stamp = AdmissionStamp(v - 1, v - 1, 1, 0.5, 0.0, "fresh", "ok", True)
        got = self.be.ledger.land_and_reserve(
            uid,
            [Landing(rid, v - 1, self.hash(v - 1), reward=Reward("bench", "1", 0.0), tokens=T)],
            reserve={rid: stamp},
        )
        self.be.ledger.commit(uid, got.reserved)

    def land(self, uids: list[str], h: str) -> None:
        """Each finished group landed as LedgerAgentLoopWorker lands it when its last
        session is postprocessed (one ledger step a group, in the worker; timed apart)."""
        from rollout_lifecycle.gpu_check.verl_v1_pacing import land_finished_group

        identity = self.ours.settings.reward  # the identity the buffer records
        t0 = time.perf_counter()
        for uid in uids:
            landed = land_finished_group(
                self.be.ledger, uid, [0.0] * self.args.n, self.args.n * T, identity
            )
            assert landed, uid
        self.times["land"].append(time.perf_counter() - t0)

    def step(self, step: int, tq: Any, torch: Any) -> None:
        from rollout_lifecycle.gpu_check.verl_v1 import commit_step
        from rollout_lifecycle.model.records import LedgerEntry

        args, ours = self.args, self.ours
        local, step = step, self.base + step  # verl's global step, the run's versions on
        if local > 1:
            t0 = time.perf_counter()
            self.activate(step - 1)
            self.times["activate"].append(time.perf_counter() - t0)
        h = self.hash(step - 1)
        uids = [f"p{self.prefill}l{step}x{g}" for g in range(args.groups)]
        t0 = time.perf_counter()
        outs = self.be.ledger.dispatch_many(  # type: ignore[attr-defined]
            [(LedgerEntry(u, step - 1, h), f"{self.run_id}/{u}") for u in uids]
        )
        self.book.record(o.entry for o in outs if o.entry is not None)
        self.times["dispatch"].append(time.perf_counter() - t0)
        pair = [("verl", self.verl, f"p{self.prefill}v"), ("ledger", ours, f"p{self.prefill}l")]
        for name, buf, prefix in pair if local % 2 else pair[::-1]:  # each goes first in turn
            if name == "ledger" and args.land_at == "worker":
                self.land(uids, h)  # the worker lands a group before verl marks it finished
            _put_step(tq, torch, prefix, step, args.groups, args.n)
            before_s, before_c = ours.ledger_seconds, Counter(ours.ledger_calls)
            t0 = time.perf_counter()
            meta, _m = buf.sample(global_steps=step, partition_id="train", batch_size=args.groups)
            self.times[name].append(time.perf_counter() - t0)
            if name == "ledger":
                self.inner.append(ours.ledger_seconds - before_s)
                self.calls.append(Counter(ours.ledger_calls) - before_c)
            assert len(meta.keys) == args.groups * args.n, len(meta.keys)
            tq.kv_clear(keys=meta.keys, partition_id="train")
        if args.commit_at == "publish":  # verl's on_step_end: update_weights(global_steps=step)
            t0 = time.perf_counter()
            commit_step(self.be.ledger, self.run_id, step)
            self.times["commit"].append(time.perf_counter() - t0)

    def result(self) -> dict[str, Any]:
        self.ours.finish(self.base + self.args.steps)
        warm = slice(2, None)  # the first steps include connection set-up and the resume probe

        def ms(xs: list[float]) -> dict[str, float]:
            return {
                "median_ms": round(1000 * statistics.median(xs), 2),
                "mean_ms": round(1000 * statistics.fmean(xs), 2),
            }

        consumed = self.be.ledger.statistics().by_state["consumed"]
        self.be.close()
        t = self.times
        per_step_calls = Counter[str]()
        for c in self.calls[warm]:
            per_step_calls.update(c)
        n_warm = len(self.calls[warm])
        return {
            "prefill": self.prefill,
            "prefill_seconds": round(self.prefill_s, 1),
            "verl_ReplayBufferAsync": ms(t["verl"][warm]),
            "LedgerReplayBuffer": ms(t["ledger"][warm]),
            "ratio": round(
                statistics.median(t["ledger"][warm]) / statistics.median(t["verl"][warm]), 2
            ),
            "ledger_work_inside_sample": ms(self.inner[warm]),
            "ledger_calls_per_step": {k: v / n_warm for k, v in sorted(per_step_calls.items())},
            "dispatch_outside_sample": ms(t["dispatch"][warm]),
            "commit_outside_sample": ms(t["commit"][warm]) if t["commit"] else None,
            "activate_outside_sample": ms(t["activate"][warm]),
            # the groups' landing, in verl's agent-loop worker (--land-at worker)
            "land_outside_sample": ms(t["land"][warm]) if t["land"] else None,
            "consumed": consumed,
        }


def doc_table(results: list[dict[str, Any]]) -> str:
    """The markdown table docs/verl-v1.md shows, from result files (a test compares them)."""
    rows = [
        "| groups x trajectories | older rollouts | verl `sample` | ours `sample` | ours / verl "
        "| ledger work in `sample` | commit at publish | dispatch | landing in the worker |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for r in res["runs"]:
            rows.append(
                f"| {_shape(res)} | {r['prefill']:,} | {_sampled(r)} "
                f"| {_ms(r.get('commit_outside_sample'))} "
                f"| {r['dispatch_outside_sample']['median_ms']} ms "
                f"| {_ms(r.get('land_outside_sample'))} |"
            )
    return "\n".join(rows)


def _ms(cell: dict[str, Any] | None) -> str:
    """A timed-apart figure's median, '-' where the run did not time it."""
    return "-" if cell is None else f"{cell['median_ms']} ms"


def _shape(res: dict[str, Any]) -> str:
    groups = res["groups_per_step"]
    return f"{groups} x {res['trajectories_per_step'] // groups}"


def _sampled(r: dict[str, Any]) -> str:
    """A run's `sample` cells: verl's, ours, the ratio, the ledger's work inside."""
    return (
        f"{r['verl_ReplayBufferAsync']['median_ms']} ms "
        f"| {r['LedgerReplayBuffer']['median_ms']} ms | {r['ratio']} "
        f"| {r['ledger_work_inside_sample']['median_ms']} ms"
    )


def versions_table(results: list[dict[str, Any]]) -> str:
    """The markdown table of runs that differ in the versions activated before them (a
    test compares it with the result files)."""
    rows = [
        "| groups x trajectories | versions before | verl `sample` | ours `sample` | ours / verl "
        "| ledger work in `sample` | weight sync (activate) | commit at publish | dispatch "
        "| landing in the worker |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for r in res["runs"]:
            rows.append(
                f"| {_shape(res)} | {res['versions_before']:,} | {_sampled(r)} "
                f"| {r['activate_outside_sample']['median_ms']} ms "
                f"| {_ms(r.get('commit_outside_sample'))} "
                f"| {r['dispatch_outside_sample']['median_ms']} ms "
                f"| {_ms(r.get('land_outside_sample'))} |"
            )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prefill", type=int, nargs="+", default=[0, 10_000, 100_000])
    ap.add_argument(
        "--versions",
        type=int,
        default=0,
        help="versions activated before the measured steps (a run that many steps long)",
    )
    ap.add_argument("--ledger-dir", default=None, help="where the SQLite ledgers go (a disk)")
    ap.add_argument(
        "--commit-at",
        choices=["publish", "sample"],
        default="publish",
        help="publish: step N is committed where the ledger's checkpoint engine commits it, "
        "when verl publishes N's weights (outside sample, timed apart); sample: by the "
        "buffer's fallback at the next sample",
    )
    ap.add_argument(
        "--land-at",
        choices=["worker", "sample"],
        default="worker",
        help="worker: each finished group is landed as LedgerAgentLoopWorker lands it, before "
        "verl marks it finished (outside sample, timed apart); sample: by the buffer's own "
        "step, for a worker that lands nothing",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import ray
    import torch
    import transfer_queue as tq
    from omegaconf import OmegaConf

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    load_start = os.getloadavg()
    streams: list[Stream] = []
    try:
        for p in args.prefill:
            streams.append(Stream(args, p))
        for step in range(1, args.steps + 1):
            for st in streams:
                st.step(step, tq, torch)
        runs = [st.result() for st in streams]
    finally:
        tq.close()
        ray.shutdown()
        # a pre-filled ledger is up to a few hundred MB (held in RAM on tmpfs): none is
        # left behind, whether the run ended or failed
        for st in streams:
            shutil.rmtree(st.tmp, ignore_errors=True)
    base = runs[0]["LedgerReplayBuffer"]["median_ms"]
    bar = BARS.get((args.groups, args.n))
    result = {
        "command": "python benchmarks/verl_v1_overhead.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "groups_per_step": args.groups,
        "trajectories_per_step": args.groups * args.n,
        "response_tokens": T,
        "versions_before": args.versions,
        "ledger_backend": "sqlite (synchronous=FULL)",
        "ledger_dir": args.ledger_dir or tempfile.gettempdir(),
        "commit_at": args.commit_at,
        "land_at": args.land_at,
        "runs": runs,
        "bar_ratio": bar,
        "ratios": [r["ratio"] for r in runs],
        "within_bar": None if bar is None else all(r["ratio"] <= bar for r in runs),
        "flat": all(abs(r["LedgerReplayBuffer"]["median_ms"] - base) <= FLAT * base for r in runs),
        # the machine's 1/5/15-minute load when the run started and ended (a shared machine)
        "load": {
            "start": [round(x, 2) for x in load_start],
            "end": [round(x, 2) for x in os.getloadavg()],
        },
    }
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
