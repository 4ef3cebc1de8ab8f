"""The experiment of CONTRACT section 7, through verl's worker path, as a real protocol run.

Per candidate group (`release_resume`: the generation side is released before the update
and resumed by the sync; `resident`: it stays resident, verl's `free_cache_engine=False`):

 1. verl builds the trainer (FSDP2 + LoRA r16 on q/v, seed 42) and our generation side
    (a separate model copy from dummy weights); the initial adapter hash is taken. The
    second group trains only if its hash equals the first's.
 2. v0 is published as an artifact (write, verify, commit, distribute), verl syncs it
    (`update_weights(global_steps=0, mode="naive")`), the generation side acks what it
    holds, the coordinator flips the pointer to v0.
 3. The 8 frozen rollouts are dispatched (stamped v0 in the ledger), sampled once by the
    generation side (the first group's are reused by the second), rewarded.
 4. The trainer scores them (`compute_log_prob`); the project's gate admits them on the
    generation side's behaviour log-probs against the trainer's; the update reserves what
    was admitted (compare-and-set, then an idempotent retry).
 5. ONE `update_actor` step of verl's supervised loss on the 4 supervised samples; the
    reservation is committed.
 6. v1 is published; verl syncs it; the generation side acks; the coordinator flips the
    pointer to v1, or records a failed distribution.
 7. Same-token log-probs before/after from both sides, generations before/after, and the
    group's event trace replayed through the spec's invariants.

Every figure is measured in the run; the checks are computed from the saved evidence by
`evidence.judge_result`, so a result file can be re-judged as it stands.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import resource
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from rollout_lifecycle.gpu_check import extra, tasks
from rollout_lifecycle.gpu_check.controls import CONTROLS, GROUPS, expected_failed_checks
from rollout_lifecycle.gpu_check.errors import ControlError, GpuCheckError, TechnicalFailure
from rollout_lifecycle.gpu_check.evidence import (
    SCHEMA_VERSION,
    CheckResult,
    EvidenceError,
    Tolerances,
    check_label,
    dump_trace,
    judge_result,
    result_path,
    save,
    trace_report,
)
from rollout_lifecycle.gpu_check.hashing import base_of, policy_files, tensors_sha256
from rollout_lifecycle.gpu_check.model_assets import (
    SMALL_MODEL_CONFIG,
    SMALL_MODEL_SEED,
    ModelAssets,
    build_small_model,
    inspect_model_dir,
    tokenizer_id,
)
from rollout_lifecycle.gpu_check.protocol import FrozenRollout, RunProtocol
from rollout_lifecycle.model.atomic import atomic_write
from rollout_lifecycle.model.gate import GatePolicy, assess_arrays
from rollout_lifecycle.model.records import GenerationConditions

Progress = Callable[[str], None]

DATASET = "arithmetic-frozen-8"
SMALL_RESPONSE_LENGTH = 8
REAL_RESPONSE_LENGTH = 32


@attrs.frozen
class RunConfig:
    """What one `gpu-check run` is asked to do."""

    run_label: str
    output_root: Path
    device: str = "auto"
    model_path: Path | None = None
    control: str | None = None
    response_length: int | None = None
    tolerances: Tolerances = attrs.field(factory=Tolerances)

    def __attrs_post_init__(self) -> None:
        check_label(self.run_label)
        if self.control is not None and self.control not in CONTROLS:
            raise ControlError(
                f"unknown negative control {self.control!r}; one of {', '.join(CONTROLS)}"
            )


@attrs.frozen
class RunOutcome:
    """The saved result and its verdict."""

    path: Path
    doc: dict[str, Any]
    technical: tuple[str, ...]
    checks: tuple[CheckResult, ...]


def _compare(a: Any, b: Any, mask: Any) -> dict[str, Any]:
    """max / mean |a - b| over the mask's positions (token counts included)."""
    m = np.asarray(mask.cpu().numpy() if hasattr(mask, "cpu") else mask).astype(bool)
    x = np.asarray(a.detach().cpu().numpy(), dtype=np.float64)
    y = np.asarray(b.detach().cpu().numpy(), dtype=np.float64)
    d = np.abs(x - y)[m]
    return {  # no token compared is no evidence: None makes the judge call it technical
        "max_abs_error": float(d.max()) if d.size else None,
        "mean_abs_error": float(d.mean()) if d.size else None,
        "tokens": int(d.size),
    }


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class _Phases:
    """Tags the generation side's events with the phase of the run they happened in."""

    def __init__(self, rollout: Any) -> None:
        self.rollout = rollout
        self.mark = 0
        self.tagged: list[dict[str, Any]] = []

    def close(self, phase: str) -> None:
        new = self.rollout.events[self.mark :]
        self.tagged += [{**e, "phase": phase} for e in new]
        self.mark = len(self.rollout.events)


class _Timer:
    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = round(time.perf_counter() - t0, 3)


class _Group:
    """One candidate group's run; `doc` fills up as the steps happen."""

    def __init__(
        self,
        ctx: _Context,
        name: str,
        free_cache_engine: bool,
        first: Mapping[str, Any] | None,
    ) -> None:
        self.ctx = ctx
        self.name = name
        self.free_cache_engine = free_cache_engine
        self.first = first
        self.time = _Timer()
        self.doc: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "run_label": ctx.config.run_label,
            "group": name,
            "mode": "release_resume" if free_cache_engine else "resident",
        }
        self.acks: list[dict[str, Any]] = []

    def run(self) -> None:
        """Build verl's worker, then (if the initial adapter matches) run the protocol."""
        from rollout_lifecycle.gpu_check import verl_driver
        from rollout_lifecycle.gpu_check.rollout import Fault

        self.v = verl_driver
        ctx = self.ctx
        self.spec = verl_driver.TrainerSpec(
            model_path=ctx.assets.path,
            response_length=ctx.response_length,
            free_cache_engine=self.free_cache_engine,
        )
        ctx.say(f"{self.name}: building verl's ActorRolloutRefWorker")
        with self.time("init"):
            self.trainer = verl_driver.Trainer(self.spec)
        self.rollout = self.trainer.rollout
        self.phases = _Phases(self.rollout)
        try:
            if not self._initialization():
                return
            if ctx.control is not None:
                self.rollout.faults = {1: Fault(CONTROLS[ctx.control].fault)}
            tol = ctx.config.tolerances
            self.proto = RunProtocol(
                ctx.run_dir / f"{self.name}.ledger.db",
                ctx.run_dir / f"{self.name}.artifacts",
                GatePolicy(max_lag=tol.max_lag, max_drift=tol.max_drift, conditions=ctx.conditions),
                dataset=DATASET,
            )
            try:
                self._protocol_run()
            finally:
                self._close_protocol()
        finally:
            self._release()

    def _release(self) -> None:
        """Let go of verl's worker and the generation copy before the next group is built."""
        self.trainer.close()
        del self.trainer, self.rollout, self.phases
        gc.collect()
        from verl.utils.device import get_torch_device

        get_torch_device().empty_cache()

    def _initialization(self) -> bool:
        spec, doc = self.spec, self.doc
        self.adapter0 = self.trainer.adapter()
        self.h0, self.b0 = tensors_sha256(self.adapter0), tensors_sha256(self.trainer.base())
        trained = self.first is None or self.h0 == self.first["initialization"]["adapter_sha256"]
        doc["initialization"] = {
            "seed": spec.seed,
            "adapter_sha256": self.h0,
            "base_sha256": self.b0,
            "lora": {
                "rank": spec.lora_rank,
                "alpha": spec.lora_alpha,
                "target_modules": list(spec.target_modules),
                "tensors": len(self.adapter0),
            },
            "trained": trained,
        }
        doc["trainer"] = {
            "worker": "verl.workers.engine_workers.ActorRolloutRefWorker(role='actor_rollout')",
            "loss": "verl.workers.utils.losses.sft_loss",
            "optimizer": {
                "name": "AdamW",
                "lr": spec.lr,
                "weight_decay": spec.weight_decay,
                "clip_grad": spec.clip_grad,
            },
            "overrides": spec.overrides(),
        }
        if not trained:
            doc["skipped"] = "initial adapter hash differs from the first group's; not trained"
        return trained

    def _close_protocol(self) -> None:
        doc, ctx = self.doc, self.ctx
        trace = self.proto.trace()
        trace_file = ctx.run_dir / f"{self.name}.trace.jsonl"
        atomic_write(trace_file, dump_trace(trace))
        doc["invariants"] = {**trace_report(trace), "trace_file": trace_file.name}
        prot = doc.setdefault("protocol", {})
        prot["ledger"] = f"{self.name}.ledger.db"
        prot["ledger_states"] = self.proto.states()
        self.proto.close()
        self.phases.close("after")
        doc["generation_side"] = {
            "class": f"{type(self.rollout).__module__}.{type(self.rollout).__qualname__}",
            "mode": doc["mode"],
            "faults": {str(k): f.value for k, f in self.rollout.faults.items()},
            "events": self.phases.tagged,
        }
        doc["timings_s"] = self.time.times

    def _protocol_run(self) -> None:
        ctx, doc, t = self.ctx, self.doc, self.time
        trainer, rollout, proto = self.trainer, self.rollout, self.proto
        tol = ctx.config.tolerances
        prot: dict[str, Any] = doc.setdefault("protocol", {})
        comparisons: dict[str, Any] = {}
        doc["decision"] = {"comparisons": comparisons, "tolerances": attrs.asdict(tol)}

        sft_prompts = [tasks.prompt_ids(ctx.tokenizer, q) for q in tasks.SUPERVISED]
        sft_responses = [tasks.supervised_response_ids(ctx.tokenizer, q) for q in tasks.SUPERVISED]
        sft_dp = self.v.rollout_batch(sft_prompts, sft_responses, ctx.pad_id)
        with t("before_first_sync"):
            comparisons["before_first_sync"] = _compare(
                rollout.compute_log_probs(sft_dp),
                trainer.log_probs(sft_dp),
                sft_dp.batch["response_mask"],
            )
        self.phases.close("init")

        # ---- v0: publish, sync, ack, activate ------------------------------------------
        ctx.say(f"{self.name}: v0 published, synced, acked")
        with t("sync_v0"):
            pub0 = proto.publish(0, policy_files(self.adapter0, self.b0), parent=None)
            trainer.sync(0)
        self._ack(0)
        act0 = proto.activate(0)
        self.phases.close("sync_v0")
        prot["artifacts"] = {"0": self._artifact_json(pub0)}
        if not act0.activated:
            raise TechnicalFailure(
                "activation", f"v0 was not activated ({act0.reason}); nothing to train on"
            )

        # ---- the frozen rollouts: dispatch at v0, sample once, reward --------------------
        with t("sampling"):
            ids = [f"r{i}" for i in range(len(tasks.FROZEN))]
            proto.dispatch(ids)
            if ctx.frozen is None:
                ctx.frozen = self._sample(ids)
            frozen = ctx.frozen
            proto.generated(frozen, tasks.REWARD_FUNCTION, tasks.REWARD_VERSION)
            doc["generation_before"] = self._greedy()
        self.phases.close("sampling")
        fro_dp = self.v.rollout_batch(
            [f.prompt_ids for f in frozen], [f.response_ids for f in frozen], ctx.pad_id
        )
        mask = fro_dp.batch["response_mask"]
        behaviour = mask.float() * 0.0
        for i, f in enumerate(frozen):
            behaviour[i, : len(f.behavior_log_probs)] = behaviour.new_tensor(f.behavior_log_probs)

        # ---- admission on the trainer's log-probs, reservation ---------------------------
        with t("admission"):
            lp_train0 = trainer.log_probs(fro_dp)
            comparisons["same_version_before"] = _compare(behaviour, lp_train0, mask)
            decisions = proto.admit(frozen, ctx.conditions, lp_train0)
            prot["routed"] = proto.route_rejected(decisions)
            update_id = f"{ctx.config.run_label}/{self.name}/update-1"
            reservation = proto.reserve(update_id, decisions)
        doc["decision"]["admission"] = [
            {
                "rollout": i,
                "rollout_id": d.rollout_id,
                "accepted": d.accepted,
                "reason": d.reason,
                "route": d.route,
                "drift": d.drift,
                "lag": d.lag,
                "freshness": d.freshness,
                "current_version": d.current_version,
                "behavior_version": d.behavior_version,
            }
            for i, d in enumerate(decisions)
        ]
        prot["reservation"] = {
            "update_id": update_id,
            "reserved": list(reservation.reserved),
            "refused": reservation.refused,
            "retry": reservation.retry_reasons,
            "outcome_violations": [str(v) for v in reservation.outcome_violations],
        }
        ctx.say(f"{self.name}: {len(reservation.reserved)}/{len(decisions)} admitted and reserved")

        # ---- the one update -----------------------------------------------------------
        with t("update"):
            if self.free_cache_engine:
                trainer.release_generation()
            try:
                metrics = trainer.sft_step(sft_prompts, sft_responses)
            except Exception as exc:
                proto.fail_update(update_id, "update_actor_failed", str(exc)[:200])
                raise TechnicalFailure("update", f"update_actor failed: {exc}") from None
            adapter1, b1 = trainer.adapter(), tensors_sha256(trainer.base())
            proto.commit(update_id, reservation.reserved)
        self.phases.close("update")
        doc["update"] = _update_json(self.adapter0, adapter1, self.b0, b1, metrics, self.spec)
        ctx.say(f"{self.name}: one update_actor step, grad_norm {doc['update']['grad_norm']:.4g}")

        # ---- v1: publish, sync, ack, activate ------------------------------------------
        with t("sync_v1"):
            pub1 = proto.publish(1, policy_files(adapter1, b1), parent=0)
            version_before = rollout.version
            trainer.sync(1)
            held_after = rollout.held_policy_hash()
        self._ack(1)
        act1 = proto.activate(1)
        self.phases.close("sync_v1")
        prot["artifacts"]["1"] = self._artifact_json(pub1)
        pointer = proto.pointer()
        prot["activation"] = {
            "version": 1,
            "activated": act1.activated,
            "reason": act1.reason,
            "missing_workers": list(act1.missing_workers),
            "mismatched_workers": list(act1.mismatched_workers),
        }
        prot["pointer_after"] = None if pointer is None else attrs.asdict(pointer)
        doc["sync_rpc_and_version"] = {
            "rpc": "ActorRolloutRefWorker.update_weights(global_steps=k, mode='naive')",
            "version_before": version_before,
            "version_after": rollout.version,
            "announcements": [
                {"version": e["version"], "held": e["held"]}
                for e in rollout.events
                if e["event"] == "announce"
            ],
            "acks": self.acks,
            "held_after_sync": held_after,
        }
        ctx.say(
            f"{self.name}: v1 "
            + ("activated" if act1.activated else f"NOT activated ({act1.reason})")
        )

        # ---- after: the same tokens on both sides ----------------------------------------
        with t("after"):
            lp_gen1 = rollout.compute_log_probs(fro_dp)
            lp_train1 = trainer.log_probs(fro_dp)
            comparisons["same_version_after"] = _compare(lp_gen1, lp_train1, mask)
            comparisons["version_shift"] = _compare(lp_train0, lp_train1, mask)
            cv = 0 if pointer is None else pointer.version
            after = assess_arrays(
                behaviour,
                lp_train1,
                mask.bool(),
                np.array([f.served_version or 0 for f in frozen], dtype=np.int64),
                cv,
                tol.max_lag,
                tol.max_drift,
            )
            doc["decision"]["admission_after_update"] = {
                "current_version": cv,
                "note": "the old (v0) rollouts judged against the trainer after the update; "
                "a decision only, nothing is reserved",
                "rows": [
                    {"rollout_id": f.rollout_id, **after.row(i)} for i, f in enumerate(frozen)
                ],
            }
            doc["generation_after"] = self._greedy()
        doc["logprobs"] = {
            "behaviour_v0": behaviour.tolist(),
            "trainer_v0": lp_train0.tolist(),
            "trainer_v1": lp_train1.tolist(),
            "generation_v1": lp_gen1.detach().cpu().tolist(),
            "response_mask": mask.tolist(),
        }

    # ---- helpers ---------------------------------------------------------------------

    def _ack(self, version: int) -> None:
        """The generation side acks; the harness reads back what it holds, independently."""
        sent = self.rollout.ack(version, self.proto.registered_hash(version))
        held = self.rollout.held_policy_hash()
        res = self.proto.ack(version, sent)
        self.acks.append(
            {"version": version, "artifact_hash": sent, "held_at_ack": held, "recorded": res.reason}
        )

    def _artifact_json(self, pub: Any) -> dict[str, Any]:
        """A published artifact, read back from disk the way a worker loader reads it."""
        adapter, files = self.proto.read_back(pub.version)
        return {
            **pub.to_json(),
            "path": os.path.relpath(pub.path, self.ctx.run_dir),
            "registered_hash": self.proto.registered_hash(pub.version),
            "read_back_adapter_sha256": tensors_sha256(adapter),
            "read_back_base_sha256": base_of(files),
        }

    def _generate(self, prompts: Sequence[Sequence[int]], do_sample: bool) -> Any:
        ctx = self.ctx
        meta = {
            "do_sample": do_sample,
            "seed": 42,
            "eos_token_id": ctx.eos_id,
            "pad_token_id": ctx.pad_id,
        }
        return self.rollout.generate_sequences(self.v.prompt_batch(prompts, ctx.pad_id, meta))

    def _sample(self, ids: Sequence[str]) -> list[FrozenRollout]:
        """The frozen rollouts: the first sample per question at v0, saved once."""
        ctx = self.ctx
        prompts = [tasks.prompt_ids(ctx.tokenizer, q) for q in tasks.FROZEN]
        out = self._generate(prompts, do_sample=True)
        resp = out.batch["responses"].cpu()
        mask = out.batch["response_mask"].cpu()
        lps = out.batch["rollout_log_probs"].cpu()
        served = out.non_tensor_batch["min_global_steps"]
        frozen = []
        for i, q in enumerate(tasks.FROZEN):
            n = int(mask[i].sum())
            rids = tuple(int(x) for x in resp[i, :n])
            text = tasks.decode(ctx.tokenizer, rids)
            frozen.append(
                FrozenRollout(
                    rollout_id=ids[i],
                    prompt_id=q.expression,
                    prompt_ids=tuple(prompts[i]),
                    response_ids=rids,
                    behavior_log_probs=tuple(float(x) for x in lps[i, :n]),
                    served_version=None if served[i] is None else int(served[i]),
                    text=text,
                    reward=tasks.reward(text, q),
                )
            )
        rows = [
            {**attrs.asdict(f), "ends_with_eos": bool(f.response_ids[-1:] == (ctx.eos_id,))}
            for f in frozen
        ]
        doc = {
            "sampled_by": self.name,
            "version": 0,
            "conditions": attrs.asdict(ctx.conditions),
            "rollouts": rows,
        }
        atomic_write(ctx.run_dir / "frozen-rollouts.json", json.dumps(doc, indent=2) + "\n")
        return frozen

    def _greedy(self) -> dict[str, Any]:
        """A greedy generation for the fixed prompt, from the generation side as it is now."""
        ctx = self.ctx
        q = tasks.FIXED_PROMPT
        out = self._generate([tasks.prompt_ids(ctx.tokenizer, q)], do_sample=False)
        n = int(out.batch["response_mask"][0].sum())
        ids = [int(x) for x in out.batch["responses"][0, :n]]
        return {
            "prompt": q.expression,
            "served_version": self.rollout.version,
            "token_ids": ids,
            "text": tasks.decode(ctx.tokenizer, ids),
        }


def _update_json(
    a0: Mapping[str, Any],
    a1: Mapping[str, Any],
    b0: str,
    b1: str,
    metrics: Mapping[str, float],
    spec: Any,
) -> dict[str, Any]:
    """The update's figures, with every LoRA tensor's change attributed.

    LoRA B starts at zero, so on the first step the gradient of every A is zero and AdamW
    moves A only by its decoupled weight decay, A1 = A0 * (1 - lr * wd): such a tensor is
    "weight_decay"; one that moved otherwise is "gradient".
    """
    decay = 1.0 - spec.lr * spec.weight_decay
    tensors: dict[str, Any] = {}
    sq = {"gradient": 0.0, "weight_decay": 0.0, "none": 0.0}
    for name in sorted(a0):
        x0, x1 = a0[name].double(), a1[name].double()
        d = x1 - x0
        dl2 = float(d.norm())
        wd_residual = float((a1[name] - a0[name] * decay).abs().max())
        atol = 1e-6 * max(1.0, float(x0.abs().max()))
        if float(d.abs().max()) == 0.0:
            change = "none"
        elif wd_residual <= atol:
            change = "weight_decay"
        else:
            change = "gradient"
        sq[change] += dl2**2
        role = "lora_A" if ".lora_A." in name else "lora_B" if ".lora_B." in name else "other"
        tensors[name] = {
            "role": role,
            "change": change,
            "delta_l2": dl2,
            "weight_decay_residual_max": wd_residual,
        }
    count = {c: sum(v["change"] == c for v in tensors.values()) for c in sq}
    return {
        "after_sha256": tensors_sha256(a1),
        "grad_norm": metrics["grad_norm"],
        "loss": metrics["loss"],
        "lr": metrics.get("lr"),
        "delta_l2": math.sqrt(sum(sq.values())),
        "changed_tensors": count["gradient"] + count["weight_decay"],
        "tensors_total": len(tensors),
        "gradient_changed_tensors": count["gradient"],
        "weight_decay_only_tensors": count["weight_decay"],
        "gradient_delta_l2": math.sqrt(sq["gradient"]),
        "weight_decay_delta_l2": math.sqrt(sq["weight_decay"]),
        "base_weights_unchanged": b0 == b1,
        "tensors": tensors,
        "metrics": dict(metrics),
    }


@attrs.define
class _Context:
    config: RunConfig
    run_dir: Path
    say: Progress
    assets: ModelAssets
    tokenizer: Any
    pad_id: int
    eos_id: int
    response_length: int
    conditions: GenerationConditions
    control: str | None
    frozen: list[FrozenRollout] | None = None


def reserve_label(root: Path, label: str) -> Path:
    """Claim `label` under `root` before any work: its run folder, created exclusively."""
    final = result_path(root, label)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    run_dir = root / label
    if final.exists():
        raise EvidenceError(
            f"a result for run_label {label!r} already exists at {final}; a new run needs a "
            "new label"
        )
    try:
        run_dir.mkdir()
    except FileExistsError:
        raise EvidenceError(
            f"{run_dir} already exists (another run used label {label!r}); a new run needs a "
            "new label"
        ) from None
    return run_dir


def _setup(
    config: RunConfig, assets: ModelAssets | None, run_dir: Path, say: Progress, tmp: Path
) -> _Context:
    """Tokenizer, model (built here when none was given) and the generation conditions."""
    from transformers import AutoTokenizer

    if assets is None:
        say("building the small Qwen2 model (seed 42) and its tokenizer")
        assets = build_small_model(tmp)
    tokenizer = AutoTokenizer.from_pretrained(str(assets.path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    r = config.response_length or (
        SMALL_RESPONSE_LENGTH if assets.built_here else REAL_RESPONSE_LENGTH
    )
    return _Context(
        config=config,
        run_dir=run_dir,
        say=say,
        assets=assets,
        tokenizer=tokenizer,
        pad_id=int(tokenizer.pad_token_id),
        eos_id=int(tokenizer.eos_token_id),
        response_length=r,
        conditions=GenerationConditions(
            tokenizer_id=tokenizer_id(assets.path),
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
            max_tokens=r,
            seed=42,
        ),
        control=config.control,
    )


# what a failing library call may raise; anything else is a bug and propagates
_TECHNICAL = (GpuCheckError, RuntimeError, ValueError, AssertionError, OSError, ImportError)


def run_experiment(config: RunConfig, progress: Progress | None = None) -> RunOutcome:
    """Run both groups, save the result beside its run folder, and judge it.

    Refused before anything is written (typed errors): the extra missing, an unusable
    model folder, a device that is not there, a label already used. After the label is
    claimed, every failure is a technical failure recorded IN the result.
    """
    say = progress or (lambda _msg: None)
    extra.require_extra()
    assets = inspect_model_dir(config.model_path) if config.model_path is not None else None
    from rollout_lifecycle.gpu_check import platform

    platform.resolve_device(config.device)
    run_dir = reserve_label(config.output_root, config.run_label)
    started, created = time.perf_counter(), _now()
    technical: list[dict[str, str]] = []
    groups: list[dict[str, Any]] = []
    device_info: platform.DeviceInfo | None = None
    timings: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        log = Path(tmp) / "verl.log"
        try:
            with platform.output_to(str(log)):
                try:
                    device_info = platform.prepare(config.device)
                    ctx = _setup(config, assets, run_dir, say, Path(tmp) / "model")
                    assets = ctx.assets
                except _TECHNICAL as exc:
                    technical.append(_technical("setup", exc))
                else:
                    timings["setup"] = round(time.perf_counter() - started, 3)
                    first: dict[str, Any] | None = None
                    for name in GROUPS:
                        g = _Group(ctx, name, name == "release_resume", first)
                        try:
                            g.run()
                        except _TECHNICAL as exc:
                            technical.append({"group": name, **_technical("verl", exc)})
                        groups.append(g.doc)
                        if technical:
                            break
                        first = first or g.doc
        finally:
            if log.exists():
                atomic_write(run_dir / "verl.log", log.read_bytes())
    timings["total"] = round(time.perf_counter() - started, 3)
    timings["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
    doc = _result_doc(config, created, device_info, assets, groups, technical, timings, run_dir)
    tech, checks = judge_result(doc)
    doc["checks"] = [c.to_json() for c in checks]
    doc["failed_checks"] = [c.name for c in checks if not c.passed]
    doc["passed"] = not tech and bool(checks) and not doc["failed_checks"]
    if config.control is not None:
        want = expected_failed_checks(config.control)
        doc["negative_control"]["observed_failures"] = sorted(doc["failed_checks"])
        doc["negative_control"]["as_expected"] = not tech and set(doc["failed_checks"]) == want
    path = save(config.output_root, doc, require_seed_paths="incomplete" not in doc)
    return RunOutcome(path, doc, tuple(tech), tuple(checks))


def _technical(default_stage: str, exc: BaseException) -> dict[str, str]:
    traceback.print_exc()  # into the run's verl.log (stderr is redirected there)
    stage = exc.stage if isinstance(exc, TechnicalFailure) else default_stage
    return {"stage": stage, "message": f"{type(exc).__name__}: {exc}"}


def _result_doc(
    config: RunConfig,
    created: str,
    device: Any,
    assets: ModelAssets | None,
    groups: Sequence[dict[str, Any]],
    technical: Sequence[dict[str, str]],
    timings: Mapping[str, float],
    run_dir: Path,
) -> dict[str, Any]:
    """The result: the seed's paths (from the first group that trained), then everything."""
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "run_label": config.run_label,
        "kind": "rollout-lifecycle gpu-check result",
        "created_at": created,
        "device": None if device is None else attrs.asdict(device),
        "model": None
        if assets is None
        else {
            **assets.to_json(),
            **(
                {
                    "path": "(built here from small_model_config, removed after the run)",
                    "small_model_config": {**SMALL_MODEL_CONFIG, "seed": SMALL_MODEL_SEED},
                }
                if assets.built_here
                else {}
            ),
        },
        "environment": extra.versions(),
        "tolerances": attrs.asdict(config.tolerances),
        "negative_control": None
        if config.control is None
        else {
            "name": config.control,
            "breaks": CONTROLS[config.control].breaks,
            "expected_failures": sorted(expected_failed_checks(config.control)),
        },
        "run_folder": run_dir.name,
        "groups": list(groups),
        "technical": list(technical),
        "timings_s": dict(timings),
    }
    seed_source = next((g for g in groups if "update" in g), None)
    for key in (
        "initialization",
        "update",
        "decision",
        "sync_rpc_and_version",
        "generation_before",
        "generation_after",
    ):
        if seed_source is not None and key in seed_source:
            doc[key] = seed_source[key]
    if seed_source is None:
        doc["incomplete"] = "no group reached the update: the seed's fields are absent"
    return doc
