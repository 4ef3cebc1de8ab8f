"""The campaign's verl-v1 stage: verl's v1 replay buffer, on a real in-process TransferQueue.

`gpu_check.verl_v1.LedgerReplayBuffer` is what verl's v1 trainer samples through when the
protocol is switched on; its unit tests ran it, the campaign never did, so a bug in how a
resumed trainer settles the step it redoes showed up only as a hang of one test. This
stage drives it the way verl's trainer does (the agent loop writes GRPO groups into
TransferQueue, `sample` evicts and reserves, the trainer clears what it trained), over a
deployment whose pointer moves one version a step:

1. step 1 takes a fresh group; step 2 takes a tolerated one (lag 1) and a fresh one, while a
   failed group is evicted (quarantined, cause group_failure) and refilled;
2. step 3 evicts a stale group (lag 2, retired with its cause) and refills, takes a fresh
   group, and the trainer process dies before its update lands;
3. a resumed trainer (a new buffer on its own connection, TransferQueue restored from the
   step-2 checkpoint) redoes step 3: its first settle must RELEASE the dead process's
   step-3 reservations (never commit them: that update never landed), then it takes the
   same group again; step 4 lands step 3 and the run finishes.

Judged three ways: the spec on the ledger's whole trace (every invariant, the registry's
included); what the scenario knows (each sample's keys and owner, the causes of every
eviction, one refill per evicted group, the redone step's rollouts released before they
are consumed, every group accounted for); and a watchdog on each `sample`, which in
verl polls until enough groups are sampleable: a sample that does not return is reported
as a hang, named, instead of blocking the campaign.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_lifecycle.model.backends import Backend, open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.events import EntryChanged
from rollout_lifecycle.model.records import AdmissionPolicy, WorkerAck
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.spec.invariants import check_trace
from rollout_lifecycle.stateful_tests.backends import durable_url
from rollout_lifecycle.stateful_tests.stages import (
    StageContext,
    StageReport,
    backend_kind,
    entered,
)

STAGE = "verl-v1"
RUN = "campaign"
WORKER = "rollout-0"
POLICY = AdmissionPolicy(max_lag=1, max_drift=0.5)
GROUP = 2  # trajectories per GRPO group (the ledger holds one rollout per group)
SAMPLE_TIMEOUT_S = 60.0  # a sample that takes longer waits for groups it can never take
HINT = (
    "the verl-v1 stage needs the [verl-v1] extra (verl 0.9.1 with TransferQueue and Ray): "
    "pip install torch==2.13.0 (or your CUDA build) first, then pip install -e '.[verl-v1]'"
)


def version_hash(v: int) -> str:
    """The artifact hash of version v in this stage."""
    return f"{v:x}".rjust(64, "c")


class Hang(Exception):
    """A call that did not return within its watchdog."""


def _within(seconds: float, what: str, fn: Callable[[], Any]) -> Any:
    """`fn()` in a watchdog thread: its result, its exception, or Hang after `seconds`
    (the thread is left to die with the TransferQueue it polls, at the stage's end)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    t = threading.Thread(target=run, name=f"verl-v1 {what}", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise Hang(f"{what} did not return within {seconds:.0f}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_verl_v1_stage(ctx: StageContext) -> StageReport:
    """Start Ray and TransferQueue in this process, run the scenario, shut them down."""
    try:
        import ray
        import transfer_queue
        from omegaconf import OmegaConf

        from rollout_lifecycle.gpu_check import verl_v1  # noqa: F401  (verl, torch)
    except ImportError as exc:
        return StageReport(STAGE, ctx.backend, ran=False, skipped=f"{HINT} ({exc})")
    started = not ray.is_initialized()
    if started:
        ctx.say("starting Ray and TransferQueue (in this process)")
        # verl's own tests: the default init hangs on 2 cores; 4 logical CPUs do
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        transfer_queue.init(
            OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
        )
    try:
        with entered(ctx.mutant):
            failures, facts = _scenario(ctx, transfer_queue)
    finally:
        if started:
            transfer_queue.close()
            ray.shutdown()
    return StageReport(STAGE, ctx.backend, ran=True, failures=tuple(failures), facts=facts)


def _open(ctx: StageContext) -> tuple[str, Callable[[], Backend]]:
    """The deployment's URL and how each 'process' opens it (memory: one shared backend)."""
    if backend_kind(ctx.backend) == "memory":
        be = open_backend("memory://")
        return be.url, lambda: be
    url = durable_url(
        "sqlite" if backend_kind(ctx.backend) == "sqlite" else ctx.backend, ctx.workdir
    )
    if url.startswith("sqlite:"):
        for old in Path(ctx.workdir).glob("state.db*"):
            old.unlink()
    return url, lambda: open_backend(url)


def _put_group(tq: Any, uid: str, version: int, status: str = "finished") -> list[str]:
    """A GRPO group as verl's agent loop writes it: GROUP trajectories, then the prompt key."""
    import torch

    keys = []
    for s in range(GROUP):
        key = f"{uid}_{s}_0"
        tq.kv_put(
            key=key,
            partition_id="train",
            fields={
                "responses": torch.tensor([5, 6, 7]),
                "response_mask": torch.tensor([1, 1, 1]),
                "rollout_log_probs": torch.tensor([-0.5, -0.25, -1.0]),
                "rm_scores": torch.tensor([0.0, 0.0, float(s)]),
            },
            tag={
                "status": "success",
                "global_steps": version,
                "min_global_steps": version,
                "max_global_steps": version,
                "seq_len": 6,
            },
        )
        keys.append(key)
    _prompt(tq, uid, version, status)
    return keys


def _prompt(tq: Any, uid: str, version: int, status: str = "finished") -> None:
    tq.kv_put(
        key=uid,
        partition_id="train",
        tag={"is_prompt": True, "status": status, "global_steps": version},
    )


def _buffer(be: Backend, refills: list[int]) -> Any:
    """The buffer as verl's trainer builds it from `trainer.v1.sampler.custom_sampler`."""
    from verl.utils.import_utils import load_extern_type

    from rollout_lifecycle.gpu_check import verl_v1

    with warnings.catch_warnings():  # verl 0.9.1 deprecates the loader its trainer calls
        warnings.simplefilter("ignore", FutureWarning)
        cls = load_extern_type(verl_v1.SAMPLER_PATH, verl_v1.SAMPLER_NAME)
    return cls(
        trainer_mode="separate_async",
        trainer_config={},
        max_off_policy_threshold=None,
        max_off_policy_strategy="drop",
        sampler_kwargs={
            "ledger_url": be.url,
            "run_id": RUN,
            "tokenizer_id": "tok",
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "response_length": 8,
            "reward_fn_id": "campaign-rule",
            "reward_fn_version": "1",
        },
        poll_interval=0.05,
        refill_fn=refills.append,
        backend=be,
    )


def _scenario(ctx: StageContext, tq: Any) -> tuple[list[str], dict[str, Any]]:
    from rollout_lifecycle.gpu_check.verl_v1 import update_id_for

    failures: list[str] = []
    url, opener = _open(ctx)
    opened: list[Backend] = []

    def connect() -> Backend:
        opened.append(opener())
        return opened[-1]

    admin = connect()
    set_admission_policy(admin.registry, POLICY, "set by the operator")
    coord = ActivationCoordinator(admin.registry, [WORKER], ledger=admin.ledger, policy=POLICY)

    def activate(v: int) -> None:
        coord.prepare(v)
        coord.commit_artifact(v, version_hash(v))
        coord.distribute(v)
        token = coord.attempt_token(WORKER, v)
        coord.record_ack(WorkerAck(WORKER, v, version_hash(v), token=token))
        if not coord.try_activate(v).activated:
            raise AssertionError(f"v{v} did not activate")

    leftover = (tq.kv_list("train") or {}).get("train", {})
    if leftover:
        tq.kv_clear(keys=list(leftover), partition_id="train")
    refills: list[int] = []
    written: dict[str, list[str]] = {}
    samples: list[str] = []

    def sample(buf: Any, step: int, n: int, want: list[str], who: str) -> bool:
        """One `sample` under its watchdog; its keys and owner checked. False: stop here."""
        what = f"{who}'s sample at step {step}"
        try:
            meta, _metrics = _within(
                SAMPLE_TIMEOUT_S,
                what,
                lambda: buf.sample(global_steps=step, partition_id="train", batch_size=n),
            )
        except Hang as exc:
            failures.append(
                f"hang: {exc}: the buffer waits for groups it can never take (a redone "
                "step's reservations left held or consumed?)"
            )
            return False
        samples.append(what)
        keys = sorted(k for g in want for k in written[g])
        if sorted(meta.keys) != keys:
            failures.append(f"{what} returned {sorted(meta.keys)}, expected {keys}")
        uid = update_id_for(RUN, step, 0)
        for g in want:  # one ledger rollout per GRPO group (verl's uid)
            e = admin.ledger.find(g)
            if e is None or e.state != "reserved" or e.reserved_by != uid:
                failures.append(f"{what}: {g} is {e and (e.state, e.reserved_by)}, not {uid}'s")
        return True

    def trained(groups: list[str]) -> None:
        """The trainer is done with these trajectories: verl clears them from TransferQueue."""
        tq.kv_clear(keys=[k for g in groups for k in written[g]], partition_id="train")

    activate(0)
    a = _buffer(connect(), refills)
    written["ga"] = _put_group(tq, "ga", 0)
    ok = sample(a, 1, 1, ["ga"], "trainer A")
    if ok:
        trained(["ga"])
        activate(1)
        written["gb"] = _put_group(tq, "gb", 1)
        written["gc"] = _put_group(tq, "gc", 0)  # lag 1: tolerated
        written["gfail"] = _put_group(tq, "gfail", 1, status="failure")
        ok = sample(a, 2, 2, ["gc", "gb"], "trainer A")
    if ok:
        trained(["gb", "gc"])
        activate(2)
        written["gstale"] = _put_group(tq, "gstale", 0)  # lag 2 > max_lag 1
        written["gd"] = _put_group(tq, "gd", 2)
        ok = sample(a, 3, 1, ["gd"], "trainer A")
        # SIGKILL: trainer A dies before step 3's update lands (no finish, no settle)
    dead = update_id_for(RUN, 3, 0)
    if ok:
        # verl resumes from its step-2 checkpoint: TransferQueue holds gd's prompt key again
        _prompt(tq, "gd", 2)
        b = _buffer(connect(), refills)
        settled = b.settle(3)  # what the resumed trainer's first sample does first
        e = admin.ledger.get("gd")
        if e.state != "rewarded" or e.releases != 1:
            failures.append(
                f"resumed at step 3: gd (reserved by the dead process's {dead}) is "
                f"{e.state} (releases {e.releases}); a step being redone never landed, its "
                "reservations must be released, not kept or consumed"
            )
        if settled != {"committed": 0, "released": 1}:
            failures.append(
                f"resumed settle(3) returned {settled}, expected 0 committed, 1 group released"
            )
        ok = not failures and sample(b, 3, 1, ["gd"], "resumed trainer B")
        if ok:
            trained(["gd"])
            activate(3)
            written["ge"] = _put_group(tq, "ge", 3)
            ok = sample(b, 4, 1, ["ge"], "resumed trainer B")
        if ok:
            trained(["ge"])
            b.finish(4)
    failures.extend(_judge(admin, written, refills, dead, done=ok))
    facts = {
        "backend": url.split("://")[0],
        "samples": len(samples),
        "groups_written": len(written),
        "trajectories": sum(len(v) for v in written.values()),
        "refill_calls": len(refills),
        "events": len(admin.trace()),
    }
    for be in reversed(opened):
        be.close()
    return failures, facts


def _judge(
    be: Backend, written: dict[str, list[str]], refills: list[int], dead: str, *, done: bool
) -> list[str]:
    """The spec on the whole trace, then what the scenario knows must hold."""
    out: list[str] = []
    trace = be.trace()
    report = check_trace(trace, with_registry=True)
    out.extend(f"spec: {v}" for v in report.violations)
    # the redone step: its group was returned (abort) after the dead process reserved it
    # and before anything consumed it
    if "gd" in written:
        evs = [e.event for e in trace if isinstance(e, EntryChanged) and e.rollout_id == "gd"]
        if "commit" in evs and "abort" not in evs[: evs.index("commit")]:
            out.append(
                f"gd: consumed without being released after {dead}'s process died "
                f"(its events: {evs}): an update that never landed was committed"
            )
    if not done:
        return out
    want = {  # one ledger rollout per GRPO group, named by verl's uid
        **{g: ("consumed", None) for g in ("ga", "gb", "gc", "gd", "ge")},
        "gfail": ("quarantined", "group_failure"),
        "gstale": ("retired_stale", "lag_2_over_1"),
    }
    for k, (state, cause) in sorted(want.items()):
        e = be.ledger.find(k)
        got = None if e is None else (e.state, e.disposition and e.disposition.cause)
        if got != (state, cause):
            out.append(f"{k}: {got}, expected ({state}, {cause})")
    if sum(refills) != 2:  # one failed group, one stale group: verl's refill_fn for each
        out.append(f"refill_fn asked for {sum(refills)} groups ({refills}), expected 2")
    return out


__all__ = ["run_verl_v1_stage"]
