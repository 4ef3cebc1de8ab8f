"""`rollout-lifecycle gpu-check train`: verl's v1 trainer for real, killed, resumed, judged.

One run of `python -m verl.trainer.main_ppo` (trainer.use_v1, separate_async) with the
real-run check's small Qwen2 + LoRA, `LedgerReplayBuffer` as the sampler, the
`rollout_lifecycle` checkpoint engine for weight sync and, on a CPU, the `cpu_hf` replica
(`verl_cpu_replica`) with the CPU platform plug-in (`verl_v1_cpu`). Phases: the trainer
process (verl's TaskRunnerV1 actor) is killed with SIGKILL once a step's batch is reserved;
verl resumes from its own checkpoint while one rollout replica's server is killed with
SIGKILL; it resumes again until the planned steps are done. The verdict is read from the
durable ledger and registry only (`judge`), and the trace is replayed through the spec.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from rollout_lifecycle.gpu_check.errors import TechnicalFailure
from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.records import AdmissionPolicy
from rollout_lifecycle.model.registry import set_admission_policy

RUN_ID = "train"
TERMINAL_RETIRED = (
    "retired_stale",
    "quarantined",
    "generation_failed",
    "reward_timed_out",
    "reward_errored",
    "update_failed",
)


@attrs.frozen
class TrainPlan:
    """What one `gpu-check train` run does."""

    out: Path
    steps: int = 6
    replicas: int = 2
    max_lag: int = 2
    max_drift: float = 0.5
    device: str = "cpu"
    phase_timeout_s: float = 900.0
    kill_trainer_at: int = 3  # SIGKILL the trainer once step N's batch is reserved
    kill_replica_at: int = 5  # during the resume, SIGKILL one replica at step N

    @property
    def url(self) -> str:
        """The run's ledger + registry (one SQLite file every process opens)."""
        return f"sqlite:///{(self.out / 'ledger.db').resolve()}"


REWARD_SOURCE = """import zlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if solution_str.strip().split(" ")[0] == str(ground_truth):
        return 1.0
    return (zlib.crc32(solution_str.encode()) % 7) / 10.0
"""
REWARD_ID = ("arith-exact-or-crc-shaped", "1")


def build_assets(out: Path) -> Path:
    """The small Qwen2 (seed 42) with a tokenizer verl's Qwen chat handling accepts, and
    a tiny arithmetic dataset; returns the model folder."""
    pd: Any = importlib.import_module("pandas")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rollout_lifecycle.gpu_check.model_assets import (
        SMALL_MODEL_CONFIG,
        SPECIAL_TOKENS,
        SYMBOLS,
        build_small_model,
    )

    model = out / "model"
    if not (model / "model.safetensors").exists():
        build_small_model(model)
    # verl's QwenContinuousTokenBuilder (utils/tokenizer/continuous_token.py:558) needs
    # "\n" and "<|im_end|>" as single tokens: they replace the two highest numbers
    n = SMALL_MODEL_CONFIG["vocab_size"] - len(SPECIAL_TOKENS) - len(SYMBOLS) - 2
    words = [*SPECIAL_TOKENS, *SYMBOLS, *(str(i) for i in range(n)), "\n", "<|im_end|>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=False), pre_tokenizers.Punctuation("isolated")]
    )
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("\n", "<|im_end|>")]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}= {% endif %}"
    )
    fast.save_pretrained(str(model))
    rows = []
    for i in range(256):
        a, b = i % 9 + 1, (i * 7) % 9 + 1
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{a} + {b}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"index": i, "split": "train"},
            }
        )
    # a reward that varies within a GRPO group, so advantages (and so the weights) move:
    # 1.0 for the right answer, else a deterministic shaping term from the response text
    (out / "reward.py").write_text(REWARD_SOURCE)
    pd.DataFrame(rows).to_parquet(out / "train.parquet")
    pd.DataFrame(rows[:8]).to_parquet(out / "val.parquet")
    return model


def overrides(plan: TrainPlan, model: Path) -> list[str]:
    """The verl config: the documented keys of docs/verl-v1.md plus the small run's sizes."""
    out = plan.out.resolve()
    url = plan.url
    cpu = plan.device == "cpu"
    keys = [
        "trainer.use_v1=true",
        "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.separate_async.parameter_sync_step=1",
        "algorithm.adv_estimator=grpo",
        # the buffer stamps drift by verl's bypass semantics (docs/verl-v1.md)
        "algorithm.rollout_correction.bypass_mode=true",
        f"data.train_files={out / 'train.parquet'}",
        f"data.val_files={out / 'val.parquet'}",
        "data.train_batch_size=4",
        "data.max_prompt_length=16",
        "data.max_response_length=8",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.lora_rank=16",
        "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
        "++actor_rollout_ref.model.lora.merge=true",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.use_dynamic_bsz=false",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        f"actor_rollout_ref.rollout.name={'cpu_hf' if cpu else 'vllm'}",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.nnodes=1",
        f"actor_rollout_ref.rollout.n_gpus_per_node={plan.replicas}",
        "actor_rollout_ref.hybrid_engine=false",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=rollout_lifecycle",
        "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module="
        "rollout_lifecycle.gpu_check.verl_v1",
        "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rollout_lifecycle."
        f"ledger_url={url}",
        "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rollout_lifecycle."
        f"artifact_root={out / 'artifacts'}",
        "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rollout_lifecycle."
        "ack_timeout_s=60",
        "trainer.v1.sampler.custom_sampler.path=pkg://rollout_lifecycle.gpu_check.verl_v1",
        "trainer.v1.sampler.custom_sampler.name=LedgerReplayBuffer",
        "trainer.v1.sampler.max_off_policy_threshold=3",
        f"+trainer.v1.sampler.sampler_kwargs.ledger_url={url}",
        f"+trainer.v1.sampler.sampler_kwargs.run_id={RUN_ID}",
        "+trainer.v1.sampler.sampler_kwargs.owns_ledger=true",
        f"+trainer.v1.sampler.sampler_kwargs.tokenizer_id={model}",
        "+trainer.v1.sampler.sampler_kwargs.temperature=${actor_rollout_ref.rollout.temperature}",
        "+trainer.v1.sampler.sampler_kwargs.response_length="
        "${actor_rollout_ref.rollout.response_length}",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={plan.steps}",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={out / 'ckpt'}",
        "trainer.resume_mode=auto",
        "critic.enable=false",
        f"reward.custom_reward_function.path={out / 'reward.py'}",
        "reward.custom_reward_function.name=compute_score",
        f"+trainer.v1.sampler.sampler_kwargs.reward_fn_id={REWARD_ID[0]}",
        f"+trainer.v1.sampler.sampler_kwargs.reward_fn_version={REWARD_ID[1]}",
        "actor_rollout_ref.actor.optim.lr=1e-2",
    ]
    if cpu:
        keys += [
            "trainer.device=cpu",
            "+ray_kwargs.ray_init.num_cpus=16",
            f"+ray_kwargs.ray_init.num_gpus={plan.replicas + 2}",
            "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES="
            "rollout_lifecycle.gpu_check.verl_v1_cpu",
            "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_DEVICE=cuda",
            # verl bug: trainer_separate_async.py:181 passes flush=True to logger.info
            "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_LOGGING_LEVEL=WARN",
        ]
    return keys


def _session_procs(sid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process in session `sid` (the run we started)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getsid(int(d.name)) != sid:
                continue
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ProcessLookupError):
            continue
        found.append((int(d.name), cmd))
    return found


def reserved_steps(url: str) -> list[int]:
    """Steps whose batch the ledger has reserved so far (from the reserve events)."""
    from rollout_lifecycle.gpu_check.verl_v1 import step_of

    try:
        be = open_backend(url, create=False)
    except Exception:  # the file may not exist yet
        return []
    try:
        steps = set()
        for ev in be.ledger.history():
            if ev.event == "reserve" and ev.update_id:
                s = step_of(ev.update_id, RUN_ID)
                if s is not None:
                    steps.add(s)
        return sorted(steps)
    finally:
        be.close()


@attrs.frozen
class Phase:
    """One process run of the trainer."""

    name: str
    rc: int | None
    wall_s: float
    kill: dict[str, Any] | None


def run_phase(
    plan: TrainPlan,
    name: str,
    cmd: list[str],
    kill: tuple[str, str, Callable[[list[int]], bool]] | None,
    progress: Callable[[str], None],
) -> Phase:
    """Run verl once; SIGKILL the process whose command line holds `kill[1]` once
    `kill[2](reserved steps)` is true. Every process of the run is reaped after it."""
    log = (plan.out / f"{name}.log").open("w")
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    sid = p.pid
    done_kill: dict[str, Any] | None = None
    try:
        while p.poll() is None:
            if time.monotonic() - t0 > plan.phase_timeout_s:
                progress(f"{name}: over {plan.phase_timeout_s:.0f} s, stopped")
                break
            if kill is not None and done_kill is None:
                steps = reserved_steps(plan.url)
                if kill[2](steps):
                    target = [pid for pid, c in _session_procs(sid) if kill[1] in c]
                    if target:
                        os.kill(target[0], signal.SIGKILL)
                        done_kill = {"what": kill[0], "at_step": max(steps), "pid": target[0]}
                        progress(
                            f"{name}: SIGKILL {kill[0]} (pid {target[0]}) at step {max(steps)}"
                        )
            time.sleep(1.0)
    finally:
        wall = time.monotonic() - t0
        for pid, _c in _session_procs(sid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        p.wait()
        log.close()
    return Phase(name, p.returncode, round(wall, 1), done_kill)


def last_checkpoint(out: Path) -> int:
    """The step of verl's latest checkpoint (0: none)."""
    f = out / "ckpt" / "latest_checkpointed_iteration.txt"
    return int(f.read_text().strip()) if f.exists() else 0


def settle_run(url: str, next_step: int) -> dict[str, int]:
    """After the last process: commit what verl's checkpoint holds, release the rest."""
    from rollout_lifecycle.gpu_check.verl_v1 import step_of

    be = open_backend(url)
    try:
        by_update: dict[str, int] = {}
        for e in be.ledger.snapshot().values():
            if e.state == "reserved" and e.reserved_by is not None:
                s = step_of(e.reserved_by, RUN_ID)
                if s is not None:
                    by_update[e.reserved_by] = s
        out = Counter[str]()
        for uid, s in sorted(by_update.items()):
            if s < next_step:
                out["committed"] += len(be.ledger.commit(uid, be.ledger.reserved_by(uid)))
            else:
                out["released"] += len(be.ledger.abort(uid))
        return dict(out)
    finally:
        be.close()


def judge(plan: TrainPlan) -> dict[str, Any]:
    """The verdict, from the durable ledger and registry alone."""
    import verl

    from rollout_lifecycle.spec.invariants import check_trace

    be = open_backend(plan.url, create=False)
    try:
        snap = be.ledger.snapshot()
        states = Counter(e.state for e in snap.values())
        history = be.ledger.history()
        commits = Counter(ev.rollout_id for ev in history if ev.event == "commit")
        lags = [e.admission.lag for e in snap.values() if e.state == "consumed" and e.admission]
        arts = be.registry.artifacts()
        art_events = Counter(ev.event for ev in be.registry.history())
        report = check_trace(be.trace())
        consumed = states.get("consumed", 0)
        retired = sum(states.get(s, 0) for s in TERMINAL_RETIRED)
        live = sum(states.get(s, 0) for s in ("dispatched", "generated", "rewarded"))
        reserved = states.get("reserved", 0)
        causes = Counter(f"{e.state}:{e.disposition.cause}" for e in snap.values() if e.disposition)
        return {
            "verl_version": verl.__version__,
            "trainer_mode": "separate_async",
            "steps": plan.steps,
            "rollout_replicas": plan.replicas,
            "trajectories": {
                "dispatched": len(snap),
                "consumed": consumed,
                "retired": retired,
                "live": live,
                "lost": len(snap) - consumed - retired - live,
                "left_reserved": reserved,
                "trained_twice": sum(1 for n in commits.values() if n > 1),
                "retired_causes": dict(causes),
            },
            "max_lag_trained": max(lags, default=0),
            "lag_histogram": dict(Counter(lags)),
            "policy": {"max_lag": plan.max_lag, "max_drift": plan.max_drift},
            "activations": {
                "attempted": sum(a.attempts for a in arts),
                "activated": sum(1 for a in arts if a.state in ("active", "superseded")),
                "failed": art_events.get("fail_distribution", 0) + art_events.get("fail_commit", 0),
                "by_state": dict(Counter(a.state for a in arts)),
                "pointer": None if be.registry.pointer() is None else be.registry.pointer().version,  # type: ignore[union-attr]
            },
            "spec": {
                "invariants": len(report.checked),
                "violations": len(report.violations),
                "first_violations": [str(v) for v in report.violations[:5]],
                "events": report.events,
            },
        }
    finally:
        be.close()


def run_train(plan: TrainPlan, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Build, run with both kills, resume until done, judge; writes `result.json`."""
    plan.out.mkdir(parents=True, exist_ok=True)
    if (plan.out / "ledger.db").exists():
        raise TechnicalFailure("train", f"{plan.out} already holds a run; use a new --output")
    model = build_assets(plan.out)
    be = open_backend(plan.url)
    set_admission_policy(
        be.registry, AdmissionPolicy(plan.max_lag, plan.max_drift), "gpu-check train", at=None
    )
    be.close()
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides(plan, model)]
    (plan.out / "command.json").write_text(json.dumps(cmd, indent=1) + "\n")
    phases = [
        run_phase(
            plan,
            "run",
            cmd,
            ("trainer", "TaskRunnerV1", lambda s: bool(s) and max(s) >= plan.kill_trainer_at),
            progress,
        )
    ]
    resumed_at = last_checkpoint(plan.out)
    phases.append(
        run_phase(
            plan,
            "resume-1",
            cmd,
            (
                "rollout_replica",
                "HFServer",
                lambda s: bool(s) and max(s) >= max(plan.kill_replica_at, resumed_at + 1),
            ),
            progress,
        )
    )
    n = 2
    while last_checkpoint(plan.out) < plan.steps and n <= 4:
        phases.append(run_phase(plan, f"resume-{n}", cmd, None, progress))
        n += 1
    (plan.out / "phases.json").write_text(json.dumps([attrs.asdict(p) for p in phases]) + "\n")
    return finish_train(plan, phases)


def finish_train(plan: TrainPlan, phases: list[Phase]) -> dict[str, Any]:
    """Settle what verl's last checkpoint holds, judge, and write `result.json`."""
    settled = settle_run(plan.url, last_checkpoint(plan.out) + 1)
    result = judge(plan)
    result["kills"] = [
        {"what": p.kill["what"], "at_step": p.kill["at_step"]} for p in phases if p.kill
    ]
    result["phases"] = [attrs.asdict(p) for p in phases]
    result["checkpoint_step"] = last_checkpoint(plan.out)
    result["settled_after_run"] = settled
    result["device"] = plan.device
    result["command"] = "rollout-lifecycle gpu-check train"
    (plan.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
