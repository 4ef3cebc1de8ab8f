"""verl 0.9.1's own worker path, driven in one process: the system under test.

`ActorRolloutRefWorker(role="actor_rollout")` is built from verl's own hydra config
(`ppo_trainer.yaml`) with the overrides the CPU needs and the GPU accepts: FSDP2, eager
attention, fp32 mixed precision, no torch.compile, rollout tensor parallel 1, and our
generation side registered in `_ROLLOUT_REGISTRY` (`rollout.name=rollout_lifecycle_hf`).
Then:

* `compute_log_prob(TensorDict)` scores tokens, as `RayPPOTrainer._compute_old_log_prob`
  does (left_right_2_no_padding -> worker -> no_padding_2_padding);
* `update_actor(TensorDict)` runs ONE optimizer step (mini-batch = the whole batch) with
  verl's supervised loss `verl.workers.utils.losses.sft_loss` set through `set_loss_fn`;
* `update_weights(global_steps=k, mode="naive")` pushes the weights into the generation
  side, which owns a separate copy.

Import this module only after `gpu_check.platform.prepare` (verl caches the device name).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import torch
import verl
from hydra import compose, initialize_config_dir
from peft.utils import get_peft_model_state_dict
from tensordict import TensorDict
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.model import compute_position_id_with_mask
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout import base as rollout_base
from verl.workers.utils.losses import sft_loss
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from rollout_lifecycle.gpu_check.errors import TechnicalFailure
from rollout_lifecycle.gpu_check.rollout import ROLLOUT_NAME, SeparateCopyRollout, base_weights

ROLLOUT_CLASS = f"{SeparateCopyRollout.__module__}.{SeparateCopyRollout.__qualname__}"


@attrs.frozen
class TrainerSpec:
    """Everything the worker is built from; recorded in the evidence as is."""

    model_path: Path
    response_length: int
    free_cache_engine: bool  # False: the generation side stays resident (no resume calls)
    seed: int = 42
    lora_rank: int = 16
    lora_alpha: int = 32
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    lr: float = 1e-3
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    micro_batch: int = 4
    temperature: float = 1.0

    def overrides(self) -> list[str]:
        """Hydra overrides on verl's ppo_trainer config."""
        a, r, m = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.model"
        return [
            f"{m}.path={self.model_path}",
            f"{m}.lora_rank={self.lora_rank}",
            f"{m}.lora_alpha={self.lora_alpha}",
            f"{m}.target_modules=[{','.join(self.target_modules)}]",
            f"+{m}.override_config.attn_implementation=eager",
            f"{m}.use_remove_padding=False",
            f"{m}.enable_gradient_checkpointing=False",
            f"{a}.strategy=fsdp2",
            f"{a}.fsdp_config.strategy=fsdp2",
            f"+{a}.fsdp_config.mixed_precision="
            "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
            f"{a}.fsdp_config.use_torch_compile=False",
            f"{a}.use_torch_compile=False",
            f"{a}.fsdp_config.seed={self.seed}",
            f"{a}.ppo_mini_batch_size={self.micro_batch}",
            f"{a}.ppo_micro_batch_size_per_gpu={self.micro_batch}",
            f"{a}.optim.lr={self.lr}",
            f"{a}.optim.weight_decay={self.weight_decay}",
            f"{a}.optim.clip_grad={self.clip_grad}",
            f"{a}.optim.total_training_steps=1",
            f"{r}.name={ROLLOUT_NAME}",
            f"{r}.mode=async",
            f"{r}.tensor_model_parallel_size=1",
            f"{r}.log_prob_micro_batch_size_per_gpu={self.micro_batch}",
            f"{r}.load_format=dummy",
            f"{r}.free_cache_engine={self.free_cache_engine}",
            f"{r}.response_length={self.response_length}",
            f"{r}.prompt_length=256",
            f"{r}.temperature={self.temperature}",
            f"{r}.top_k=-1",
            f"{r}.top_p=1.0",
            f"{r}.seed={self.seed}",
            f"{r}.calculate_log_probs=True",
            "trainer.n_gpus_per_node=1",
        ]


def compose_config(spec: TrainerSpec) -> Any:
    """verl's ppo_trainer config with the spec's overrides (hydra, as verl's trainer does)."""
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            return compose(config_name="ppo_trainer", overrides=spec.overrides())
    except Exception as exc:  # hydra raises several untyped errors
        raise TechnicalFailure(
            "config", f"verl's ppo_trainer config did not compose: {exc}"
        ) from None


def register_rollout() -> None:
    """Put our generation side into verl's rollout registry (name, async mode)."""
    rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = ROLLOUT_CLASS


def _full(t: Any) -> torch.Tensor:
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    out: torch.Tensor = t.detach().to("cpu", copy=True)
    return out


class Trainer:
    """One ActorRolloutRefWorker and the handful of worker calls the experiment makes."""

    def __init__(self, spec: TrainerSpec) -> None:
        self.spec = spec
        register_rollout()
        self.config = compose_config(spec)
        torch.manual_seed(spec.seed)  # LoRA A is drawn from the global RNG right after this
        self.worker = ActorRolloutRefWorker(self.config.actor_rollout_ref, role="actor_rollout")
        self.worker.init_model()
        rollout = self.worker.rollout
        if not isinstance(rollout, SeparateCopyRollout):
            raise TechnicalFailure("init", f"verl built {type(rollout).__name__}, not our rollout")
        self.rollout: SeparateCopyRollout = rollout
        actor_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        self.worker.set_loss_fn(partial(sft_loss, config=actor_config))

    @property
    def module(self) -> Any:
        """The trainer's FSDP2-wrapped PEFT module."""
        return self.worker.actor.engine.module

    def adapter(self) -> dict[str, torch.Tensor]:
        """The trainer's LoRA tensors, gathered to full host tensors."""
        return {n: _full(t) for n, t in get_peft_model_state_dict(self.module).items()}

    def base(self) -> dict[str, torch.Tensor]:
        """The trainer's frozen base weights, gathered, under plain names."""
        return {n: _full(t) for n, t in base_weights(self.module.state_dict().items()).items()}

    def log_probs(self, batch: DataProto) -> torch.Tensor:
        """Per-token log-probs of the batch's responses under the trainer (B x R, masked 0)."""
        td = left_right_2_no_padding(batch.to_tensordict())
        tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
        out = self.worker.compute_log_prob(td)
        lp: torch.Tensor = no_padding_2_padding(tu.get(out, "log_probs"), td)
        masked: torch.Tensor = lp.float() * batch.batch["response_mask"].to(lp.device)
        return masked

    def sft_step(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> dict[str, float]:
        """One `update_actor` step of verl's supervised loss over these samples."""
        td = sft_batch(prompts, responses)
        tu.assign_non_tensor(
            td,
            mini_batch_size=len(prompts),
            epochs=1,
            seed=self.spec.seed,
            dataloader_kwargs={"shuffle": False},
            temperature=1.0,
            global_batch_size=len(prompts),
            pad_mode="no_padding",
            max_seq_len=max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True)),
        )
        out = self.worker.update_actor(td)
        metrics = tu.get(out, "metrics")
        return {k: float(v[0] if isinstance(v, list) else v) for k, v in metrics.items()}

    def sync(self, version: int) -> None:
        """verl's colocated weight sync into the generation side, stamped `global_steps`."""
        asyncio.run(self.worker.update_weights(global_steps=version, mode="naive"))

    def release_generation(self) -> None:
        """Put the generation side to sleep (weights offloaded) before the update."""
        asyncio.run(self.rollout.release())

    def close(self) -> None:
        """Drop the worker (its engine and the generation copy) before the next group."""
        del self.rollout
        del self.worker


def _left_pad(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(list(r), dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids, mask


def _right_pad(
    rows: Sequence[Sequence[int]], pad: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows) if width is None else width
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def prompt_batch(prompts: Sequence[Sequence[int]], pad: int, meta: dict[str, Any]) -> DataProto:
    """Left-padded prompts, as verl hands them to a rollout."""
    ids, mask = _left_pad(prompts, pad)
    return DataProto.from_dict(
        tensors={
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": compute_position_id_with_mask(mask),
        },
        meta_info=meta,
    )


def rollout_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad: int
) -> DataProto:
    """prompts (left-padded) + responses (right-padded), verl's rollout batch layout."""
    pid, pm = _left_pad(prompts, pad)
    rid, rm = _right_pad(responses, pad)
    am = torch.cat([pm, rm], 1)
    return DataProto.from_dict(
        tensors={
            "prompts": pid,
            "responses": rid,
            "input_ids": torch.cat([pid, rid], 1),
            "attention_mask": am,
            "position_ids": compute_position_id_with_mask(am),
            "response_mask": rm,
        },
        meta_info={"temperature": 1.0},
    )


def sft_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> TensorDict:
    """verl's no-padding SFT layout: jagged sequences, loss_mask 1 on response tokens."""
    seqs, masks, pos = [], [], []
    for p, r in zip(prompts, responses, strict=True):
        seqs.append(torch.tensor([*p, *r], dtype=torch.long))
        masks.append(torch.tensor([0] * len(p) + [1] * len(r), dtype=torch.long))
        pos.append(torch.arange(len(p) + len(r), dtype=torch.long))

    def nested(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.nested.as_nested_tensor(xs, layout=torch.jagged)

    return TensorDict(
        {"input_ids": nested(seqs), "loss_mask": nested(masks), "position_ids": nested(pos)},
        batch_size=len(seqs),
    )
