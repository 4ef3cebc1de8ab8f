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
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from rollout_lifecycle.gpu_check.errors import TechnicalFailure
from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.records import AdmissionPolicy
from rollout_lifecycle.model.registry import set_admission_policy

RUN_ID = "train"
PID_DIR_ENV = "ROLLOUT_LIFECYCLE_REPLICA_PIDS"
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
    # pacing: (max_lag + 1) x pace_batch = 6 live groups, fewer than verl's warm-up batch
    # and first step ask for (8), so the budget refuses and requeues inside verl's loop
    pace_batch: int = 2
    max_attempts: int = 3
    device: str = "cpu"
    phase_timeout_s: float = 900.0
    ack_timeout_s: float = 240.0  # the checkpoint engine's bound on every replica's ack
    kill_trainer_at: int = 3  # SIGKILL the trainer once step N's batch is reserved
    kill_replica_at: int = 5  # during the resume, SIGKILL one replica at step N
    kill_replica_rank: int = 1  # which replica's server (its pid file names it)

    @property
    def url(self) -> str:
        """The run's ledger + registry (one SQLite file every process opens)."""
        return f"sqlite:///{(self.out / 'ledger.db').resolve()}"

    @property
    def policy(self) -> AdmissionPolicy:
        """The deployment's admission and pacing policy (recorded before verl starts)."""
        return AdmissionPolicy(self.max_lag, self.max_drift, self.pace_batch, self.max_attempts)


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
    """The verl config: the config group's overrides (`rollout-lifecycle verl setup` prints
    the same) plus the small run's sizes and the CPU substitutions."""
    from rollout_lifecycle.cli.verl_cmd import overrides as ledger_overrides

    out = plan.out.resolve()
    cpu = plan.device == "cpu"
    keys = [
        *ledger_overrides(plan.url, RUN_ID, str(out / "artifacts")),
        # a resumed run's replicas make their first receive only after importing verl's
        # engines, over 60 s on 2 loaded cores: a 60 s bound failed the resumed trainer's
        # re-sent version with every replica "missing" (a survivor's ack never counted,
        # and its groups quarantined until their chains' attempts ran out)
        f"rollout_lifecycle.ack_timeout_s={plan.ack_timeout_s:g}",
        f"rollout_lifecycle.reward_fn_id={REWARD_ID[0]}",
        f"rollout_lifecycle.reward_fn_version={REWARD_ID[1]}",
        f"rollout_lifecycle.pacing_log={out / 'pacing.jsonl'}",
        "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.separate_async.parameter_sync_step=1",
        "trainer.v1.sampler.max_off_policy_threshold=3",
        "algorithm.adv_estimator=grpo",
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
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.nnodes=1",
        f"actor_rollout_ref.rollout.n_gpus_per_node={plan.replicas}",
        "actor_rollout_ref.hybrid_engine=false",
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
            # each CPU replica's server writes its pid here, so the run kills a known replica
            f"+ray_kwargs.ray_init.runtime_env.env_vars.{PID_DIR_ENV}={out / 'pids'}",
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


def replica_pid(plan: TrainPlan, rank: int) -> int | None:
    """The pid replica `rank`'s server wrote (None: not started yet)."""
    f = plan.out / "pids" / f"replica-{rank}.pid"
    try:
        return int(f.read_text().strip())
    except (OSError, ValueError):
        return None


def run_phase(
    plan: TrainPlan,
    name: str,
    cmd: list[str],
    kill: tuple[str, str, Callable[[list[int]], bool]] | None,
    progress: Callable[[str], None],
) -> Phase:
    """Run verl once; SIGKILL the process `kill[1]` names (a command-line fragment, or
    `replica:<rank>` for that replica's server) once `kill[2](reserved steps)` is true.
    Every process of the run is reaped after it."""
    shutil.rmtree(plan.out / "pids", ignore_errors=True)  # this phase's servers write anew
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
                    if kill[1].startswith("replica:"):
                        pid = replica_pid(plan, int(kill[1].split(":")[1]))
                        target = [pid] if pid is not None else []
                    else:
                        target = [pid for pid, c in _session_procs(sid) if kill[1] in c]
                    if target:
                        os.kill(target[0], signal.SIGKILL)
                        done_kill = {
                            "what": kill[0],
                            "at_step": max(steps),
                            "pid": target[0],
                            "target": kill[1],
                        }
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


def resume_needed(plan: TrainPlan, last: Phase) -> bool:
    """Resume as an operator would: until verl ends its fit (exit 0) with every step
    checkpointed. A process that died after checkpointing the last step (a replica killed
    late takes down the last weight sync) is resumed too: the resumed trainer publishes that
    step's weights at start-up, which commits the step's reservations; without it they were
    left reserved (settled only by the harness)."""
    return last_checkpoint(plan.out) < plan.steps or last.rc != 0


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


def pacing_log(plan: TrainPlan) -> list[dict[str, Any]]:
    """What the budget decided in verl's agent loop (LedgerAgentLoopManager's log)."""
    f = plan.out / "pacing.jsonl"
    if not f.exists():
        return []
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()]


def chain_outcomes(
    states: Mapping[str, Sequence[str]], log: Sequence[Mapping[str, Any]]
) -> tuple[set[str], set[str], set[str], list[str]]:
    """Each prompt chain's outcome from its tries' ledger states and the pacing log:
    (trained, open, held at the end, ended without training).

    Trained: a try was consumed. Open: a try is not retired. Held: every try was retired,
    but the budget was holding the prompt in verl's loop when the run ended (its last
    pacing record is a refusal): verl still holds it, as it holds prompts never dispatched
    at all, so it has not ended. Anything else ended untrained (the verdict's failure).
    """
    last: dict[str, Mapping[str, Any]] = {}
    for x in sorted(log, key=lambda x: float(x["t"])):
        if x.get("chain") is not None:
            last[str(x["chain"])] = x
    trained = {c for c, ss in states.items() if "consumed" in ss}
    open_ = {c for c, ss in states.items() if c not in trained and set(ss) - set(TERMINAL_RETIRED)}
    ended = set(states) - trained - open_
    held = {c for c in ended if last.get(c, {}).get("what") in ("no_capacity", "chain_live")}
    return trained, open_, held, sorted(ended - held)


def _listed(detail: str) -> set[str]:
    """Workers named in a distribution failure's detail ("missing [..], mismatched [..]")."""
    return set(re.findall(r"'([^']+)'", detail))


def judge(plan: TrainPlan, killed_replicas: Sequence[str] = ()) -> dict[str, Any]:
    """The verdict, from the durable ledger and registry (and the pacing log for what the
    budget refused, which by design writes nothing to the ledger)."""
    import verl

    from rollout_lifecycle.spec.invariants import check_trace

    be = open_backend(plan.url, create=False)
    try:
        snap = be.ledger.snapshot()
        states = Counter(e.state for e in snap.values())
        history = be.ledger.history()
        commits = Counter(ev.rollout_id for ev in history if ev.event == "commit")
        # groups LedgerAgentLoopWorker landed: rewarded in a step of their own, before the
        # trainer's sample reserved them (else the buffer's step landed them)
        reserved_in: dict[str, int] = {}
        for ev in history:
            if ev.event == "reserve":
                reserved_in.setdefault(ev.rollout_id, ev.txn)  # its first reservation
        landed_apart = {
            ev.rollout_id
            for ev in history
            if ev.event == "reward_ready" and reserved_in.get(ev.rollout_id, ev.txn) != ev.txn
        }
        lags = [e.admission.lag for e in snap.values() if e.state == "consumed" and e.admission]
        arts = be.registry.artifacts()
        art_events = Counter(ev.event for ev in be.registry.history())
        report = check_trace(be.trace())
        consumed = states.get("consumed", 0)
        retired = sum(states.get(s, 0) for s in TERMINAL_RETIRED)
        live = sum(states.get(s, 0) for s in ("dispatched", "generated", "rewarded"))
        reserved = states.get("reserved", 0)
        causes = Counter(f"{e.state}:{e.disposition.cause}" for e in snap.values() if e.disposition)
        chains: dict[str, list[Any]] = {}
        for e in snap.values():
            if e.chain is not None:
                chains.setdefault(e.chain, []).append(e)
        attempts = Counter(max(e.attempt for e in es) for es in chains.values())
        log = pacing_log(plan)
        trained, open_, held, never = chain_outcomes(
            {c: [e.state for e in es] for c, es in chains.items()}, log
        )
        refusals = Counter(x["what"] for x in log if x["what"] in ("no_capacity", "chain_live"))
        refused_at: dict[str, float] = {}
        requeued: set[str] = set()
        for x in log:
            if x["what"] in ("no_capacity", "chain_live"):
                refused_at.setdefault(x["uid"], x["t"])
            elif x["what"] in ("dispatched", "already_dispatched") and x["uid"] in refused_at:
                requeued.add(x["uid"])
        survivors = [
            w for w in (be.registry.required_workers() or ()) if w not in set(killed_replicas)
        ]
        uncounted = [
            {"version": a.version, "worker": w, "detail": a.failure.detail}
            for a in arts
            if a.failure is not None and a.failure.stage == "distribution"
            for w in survivors
            if w in _listed(a.failure.detail)
        ]
        return {
            "verl_version": verl.__version__,
            "trainer_mode": "separate_async",
            "steps": plan.steps,
            "rollout_replicas": plan.replicas,
            "unit": "GRPO group (verl uid): one ledger rollout per group",
            "trajectories": {
                "dispatched": len(snap),
                "consumed": consumed,
                "retired": retired,
                "live": live,
                "lost": len(snap) - consumed - retired - live - reserved,
                "left_reserved": reserved,
                "trained_twice": sum(1 for n in commits.values() if n > 1),
                "landed_by_worker": len(landed_apart),
                "retired_causes": dict(causes),
            },
            "max_lag_trained": max(lags, default=0),
            "lag_histogram": dict(Counter(lags)),
            "policy": {
                "max_lag": plan.max_lag,
                "max_drift": plan.max_drift,
                "batch_size": plan.pace_batch,
                "max_attempts": plan.max_attempts,
            },
            "pacing": {
                "chains": len(chains),
                "chains_trained": len(trained),
                "chains_open": len(open_),
                "chains_held_at_end": len(held),
                "never_trained": len(never),
                "never_trained_chains": never[:5],
                # how each such chain ended: (attempt, state, cause, behaviour version) per try
                "never_trained_detail": {
                    c: [
                        [
                            e.attempt,
                            e.state,
                            e.disposition.cause if e.disposition else None,
                            e.behavior_version,
                        ]
                        for e in sorted(chains[c], key=lambda e: e.attempt)
                    ]
                    for c in never[:5]
                },
                "attempts_histogram": dict(sorted(attempts.items())),
                "max_attempts": max(attempts, default=0),
                "dispatch_refusals": sum(refusals.values()),
                "refusals_by_reason": dict(refusals),
                # refused, then dispatched later: offered again by the same process, or
                # re-issued by verl after a resume (its in-flight prompts include held ones)
                "requeued": len(requeued),
                "requeued_in_process": sum(1 for x in log if x.get("requeued")),
                "dropped": sum(1 for x in log if str(x["what"]).startswith("dropped")),
            },
            "activations": {
                "attempted": sum(a.attempts for a in arts),
                "activated": sum(1 for a in arts if a.state in ("active", "superseded")),
                "failed": art_events.get("fail_distribution", 0) + art_events.get("fail_commit", 0),
                "by_state": dict(Counter(a.state for a in arts)),
                "pointer": None if be.registry.pointer() is None else be.registry.pointer().version,  # type: ignore[union-attr]
                "failures": [
                    {"version": a.version, "cause": a.failure.cause, "detail": a.failure.detail}
                    for a in arts
                    if a.failure is not None
                ],
                "killed_replicas": list(killed_replicas),
                "survivor_acks_not_counted": uncounted,
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
    set_admission_policy(be.registry, plan.policy, "gpu-check train", at=None)
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
                f"replica:{plan.kill_replica_rank}",
                lambda s: bool(s) and max(s) >= max(plan.kill_replica_at, resumed_at + 1),
            ),
            progress,
        )
    )
    n = 2
    while resume_needed(plan, phases[-1]) and n <= 4:
        phases.append(run_phase(plan, f"resume-{n}", cmd, None, progress))
        n += 1
    (plan.out / "phases.json").write_text(json.dumps([attrs.asdict(p) for p in phases]) + "\n")
    return finish_train(plan, phases)


def finish_train(plan: TrainPlan, phases: list[Phase]) -> dict[str, Any]:
    """Settle what verl's last checkpoint holds, judge, and write `result.json`."""
    be = open_backend(plan.url, create=False)
    try:  # what verl's own end of fit left reserved (the last step's publication commits it)
        left = sum(1 for e in be.ledger.snapshot().values() if e.state == "reserved")
    finally:
        be.close()
    settled = settle_run(plan.url, last_checkpoint(plan.out) + 1)
    killed = [
        f"rollout-{p.kill['target'].split(':')[1]}"
        for p in phases
        if p.kill and str(p.kill.get("target", "")).startswith("replica:")
    ]
    result = judge(plan, killed)
    result["kills"] = [
        {"what": p.kill["what"], "at_step": p.kill["at_step"]} for p in phases if p.kill
    ]
    result["phases"] = [attrs.asdict(p) for p in phases]
    result["checkpoint_step"] = last_checkpoint(plan.out)
    result["settled_after_run"] = settled
    result["reserved_when_verl_ended"] = left
    result["device"] = plan.device
    result["command"] = "rollout-lifecycle gpu-check train"
    (plan.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
