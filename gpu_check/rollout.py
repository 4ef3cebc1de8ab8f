"""The generation side: a verl `BaseRollout` that owns a separate model copy.

verl 0.9.1's worker builds its rollout through `_ROLLOUT_REGISTRY` exactly as it builds
vLLM's `ServerAdapter` (`rollout.name=rollout_lifecycle_hf`), and then drives it with
`update_weights(mode="naive")`: `resume(["weights"])`, the base weights once (the copy
starts from dummy weights, as vLLM's `load_format=dummy` does), the LoRA adapter on every
sync, `resume(["kv_cache"])`. The copy is a plain Hugging Face model: nothing is shared
with the trainer's FSDP module; every tensor that arrives is copied in.

What a weight sync must prove is observed here, not assumed: each event is recorded with
the hash of the policy the copy holds at that moment (`held_policy_hash`, computed from its
own parameters), the version is announced (`global_steps`, vLLM's `set_global_steps`)
after the load, and `ack` reports the hash of what the copy holds. Faults of the negative
controls are switched on per version by the harness (`faults`); they are the only way the
behaviour differs.

Replacing this class with verl's vLLM rollout means providing the same few methods
(`generate_sequences`, `compute_log_probs`, `held_policy_hash`, `ack`, `events`) over
vLLM's server; that replacement has not been run here.
"""

from __future__ import annotations

import enum
from collections.abc import Generator, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM
from verl import DataProto
from verl.utils.device import get_device_name
from verl.utils.torch_functional import logprobs_from_logits
from verl.workers.rollout.base import BaseRollout

from rollout_lifecycle.gpu_check.errors import TechnicalFailure
from rollout_lifecycle.gpu_check.hashing import policy_hash, tensors_sha256

ROLLOUT_NAME = "rollout_lifecycle_hf"
DUMMY_SEED = 1234  # the copy's own random start (load_format=dummy), never the trainer's


class Fault(enum.Enum):
    """What a negative control breaks in one weight sync (see docs/gpu-check.md)."""

    NONE = "none"
    STALE_COPY = "stale_copy"  # tensors arrive, nothing is written into the copy
    VERSION_BEFORE_LOAD = "version_before_load"  # the version is announced, then loaded
    ACK_REGISTERED_HASH = "ack_registered_hash"  # one tensor lost, ack echoes the registry


def base_name(name: str) -> str | None:
    """A base weight's plain Hugging Face name on either side; None for a LoRA tensor.

    The trainer's PEFT module says `base_model.model.model.layers.0.self_attn.q_proj.
    base_layer.weight`, verl's first sync says `model.layers.0...q_proj.base_layer.weight`
    (vLLM's LoRA naming); both become `model.layers.0.self_attn.q_proj.weight`.
    """
    if "lora_" in name:
        return None
    if name.startswith("base_model.model."):
        name = name[len("base_model.model.") :]
    return name.replace(".base_layer.", ".")


def base_weights(named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """The base (non-LoRA) tensors under their plain names."""
    out: dict[str, Any] = {}
    for n, t in named:
        b = base_name(n)
        if b is not None:
            out[b] = t
    return out


def lora_config_from(peft_config: Mapping[str, Any]) -> LoraConfig:
    """A LoraConfig from the dict verl sends (`peft_config.to_dict()`), unknown keys dropped."""
    fields = set(LoraConfig.__dataclass_fields__)
    return LoraConfig(**{k: v for k, v in peft_config.items() if k in fields})


class SeparateCopyRollout(BaseRollout):  # type: ignore[misc]
    """verl BaseRollout over its own Hugging Face model copy, instrumented for the check."""

    def __init__(
        self, config: Any, model_config: Any, device_mesh: Any, *args: Any, **kwargs: Any
    ) -> None:
        super().__init__(config, model_config, device_mesh)
        self.device = torch.device(get_device_name())
        path = self.model_config.local_path
        hf_config = AutoConfig.from_pretrained(path)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(DUMMY_SEED)
            if "dummy" in self.config.load_format:
                model = AutoModelForCausalLM.from_config(
                    hf_config, attn_implementation="eager", dtype=torch.float32
                )
            else:
                model = AutoModelForCausalLM.from_pretrained(
                    path, attn_implementation="eager", dtype=torch.float32
                )
        self.model: Any = model.to(self.device).eval()
        self.version: int | None = None
        self.state = "resident"  # resident | released | weights_resumed
        self.events: list[dict[str, Any]] = []
        self.faults: dict[int, Fault] = {}
        self._stash: dict[str, torch.Tensor] | None = None

    # ---- what the copy holds -----------------------------------------------------------

    @property
    def has_adapter(self) -> bool:
        """Whether the copy has been wrapped with the LoRA adapter it was sent."""
        return hasattr(self.model, "peft_config")

    def held_adapter(self) -> dict[str, torch.Tensor]:
        """The LoRA tensors the copy holds (empty before the first adapter sync)."""
        if not self.has_adapter:
            return {}
        return dict(get_peft_model_state_dict(self.model))

    def held_base(self) -> dict[str, torch.Tensor]:
        """The base weights the copy holds, under plain names."""
        return base_weights(self.model.state_dict().items())

    def held_policy_hash(self) -> str | None:
        """Artifact hash of the policy the copy holds now; None while its weights are released."""
        if self.state == "released":
            return None
        return policy_hash(self.held_adapter(), tensors_sha256(self.held_base()))

    def _record(self, event: str, **fields: Any) -> None:
        self.events.append({"event": event, **fields, "held": self.held_policy_hash()})

    def _fault(self, version: int | None) -> Fault:
        return self.faults.get(-1 if version is None else version, Fault.NONE)

    # ---- BaseRollout -------------------------------------------------------------------

    async def release(self) -> None:
        """Offload the weights to host memory and free them on the device (vLLM sleep)."""
        if self.state == "released":
            return
        self._stash = {}
        for name, p in self.model.named_parameters():
            self._stash[name] = p.data.to("cpu", copy=True)
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self.state = "released"
        self._record("release")

    async def resume(self, tags: list[str]) -> None:
        """Bring the weights (from host memory) and/or the KV cache back."""
        if "weights" in tags and self.state == "released":
            assert self._stash is not None
            for name, p in self.model.named_parameters():
                p.data = self._stash[name].to(self.device)
            self._stash = None
            self.state = "weights_resumed"
        if "kv_cache" in tags and self.state == "weights_resumed":
            self.state = "resident"
        self._record("resume", tags=list(tags))

    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ) -> None:
        """Copy the tensors that arrive into this model; announce the version afterwards."""
        if wire_format != "named_tensors":
            raise TechnicalFailure(
                "sync", f"wire format {wire_format!r} is not supported by {ROLLOUT_NAME}"
            )
        if self.state == "released":
            raise TechnicalFailure("sync", "weights arrived while the copy's weights are released")
        version = kwargs.get("global_steps")
        base_sync_done = bool(kwargs.get("base_sync_done", True))
        peft_config = kwargs.get("peft_config")
        received = [(n, t.detach().to(self.device, copy=True)) for n, t in weights]
        fault = self._fault(version)
        if fault is Fault.VERSION_BEFORE_LOAD:
            self.announce(version)
        loaded = 0
        if fault is not Fault.STALE_COPY:
            loaded = self._load(received, base_sync_done, peft_config, fault)
        self._record(
            "update_weights",
            global_steps=version,
            base_sync_done=base_sync_done,
            kind="base" if not base_sync_done else ("adapter" if peft_config else "full"),
            tensors=len(received),
            loaded=loaded,
            received_sha256=tensors_sha256(received),
        )
        if fault is not Fault.VERSION_BEFORE_LOAD and base_sync_done:
            self.announce(version)

    def _load(
        self,
        received: Sequence[tuple[str, torch.Tensor]],
        base_sync_done: bool,
        peft_config: Mapping[str, Any] | None,
        fault: Fault,
    ) -> int:
        if not base_sync_done or peft_config is None:
            target = self.model.get_base_model() if self.has_adapter else self.model
            sd = base_weights(received)
            missing, unexpected = target.load_state_dict(sd, strict=False)
            tied = bool(getattr(target.config, "tie_word_embeddings", False))
            missing = [
                m for m in missing if "lora_" not in m and not (tied and m == "lm_head.weight")
            ]
            if missing or unexpected:
                raise TechnicalFailure(
                    "sync",
                    f"base weights do not fit the copy: missing {missing[:3]}, "
                    f"unexpected {list(unexpected)[:3]}",
                )
            return len(sd)
        if not self.has_adapter:
            with torch.random.fork_rng(devices=[]):  # LoRA init draws; it is overwritten below
                self.model = get_peft_model(self.model, lora_config_from(peft_config)).eval()
        tensors = dict(received)
        if fault is Fault.ACK_REGISTERED_HASH:
            tensors.pop(sorted(tensors)[-1])  # a transfer error, swallowed
        result = set_peft_model_state_dict(self.model, tensors)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise TechnicalFailure(
                "sync", f"adapter tensors the copy has no slot for: {unexpected[:3]}"
            )
        return len(tensors)

    def announce(self, version: int | None) -> None:
        """The version this copy now serves (vLLM's `set_global_steps`); stamped on samples."""
        self.version = version
        self._record("announce", version=version)

    def ack(self, version: int, registered_hash: str) -> str:
        """The hash reported for `version`: that of what the copy holds (a control lies)."""
        held = self.held_policy_hash()
        sent = registered_hash if self._fault(version) is Fault.ACK_REGISTERED_HASH else held
        if sent is None:
            raise TechnicalFailure("ack", "asked to ack while the copy's weights are released")
        self._record("ack", version=version, artifact_hash=sent)
        return sent

    # ---- generation and scoring --------------------------------------------------------

    def _require_ready(self) -> None:
        if self.state != "resident":
            raise TechnicalFailure("generate", f"the copy is {self.state}; resume it first")

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """verl's sync generation API: left-padded prompts in, a rollout batch out.

        meta_info: do_sample (bool), seed (int), eos_token_id, pad_token_id. The batch that
        comes back carries `responses`, `response_mask` (1 up to and including EOS),
        `rollout_log_probs` (the sampling-time log-probs of the sampled tokens) and, per
        sample, `min_global_steps` / `max_global_steps`, the version that produced it.
        """
        self._require_ready()
        ids = prompts.batch["input_ids"].to(self.device)
        am = prompts.batch["attention_mask"].to(self.device)
        meta = prompts.meta_info
        do_sample = bool(meta.get("do_sample", self.config.do_sample))
        eos = int(meta["eos_token_id"])
        pad = int(meta["pad_token_id"])
        temperature = float(self.config.temperature) if do_sample else 1.0
        gen = torch.Generator(device=self.device).manual_seed(
            int(meta.get("seed", self.config.seed))
        )
        b = ids.shape[0]
        pos = (am.long().cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1, :]
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        toks, masks, lps = [], [], []
        next_pos = pos[:, -1:] + 1
        for _ in range(int(self.config.response_length)):
            logp = F.log_softmax(logits.float() / temperature, dim=-1)
            if do_sample:
                tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
            else:
                tok = logp.argmax(-1)
            lp = logp.gather(-1, tok[:, None]).squeeze(-1)
            live = ~done
            toks.append(torch.where(live, tok, torch.full_like(tok, pad)))
            masks.append(live.long())
            lps.append(torch.where(live, lp, torch.zeros_like(lp)))
            done = done | (tok == eos)
            if bool(done.all()):
                break
            am = torch.cat([am, live.long()[:, None].to(am.dtype)], dim=1)
            out = self.model(
                input_ids=toks[-1][:, None],
                attention_mask=am,
                position_ids=next_pos,
                past_key_values=past,
                use_cache=True,
            )
            past, logits = out.past_key_values, out.logits[:, -1, :]
            next_pos = next_pos + 1
        responses = torch.stack(toks, 1)
        response_mask = torch.stack(masks, 1)
        prompt_mask = prompts.batch["attention_mask"].to(self.device)
        attention_mask = torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], 1)
        seq = torch.cat([ids, responses], 1)
        version = np.array([self.version] * b, dtype=object)
        return DataProto.from_dict(
            tensors={
                "prompts": ids,
                "responses": responses,
                "input_ids": seq,
                "attention_mask": attention_mask,
                "position_ids": (attention_mask.long().cumsum(-1) - 1).clamp(min=0),
                "response_mask": response_mask,
                "rollout_log_probs": torch.stack(lps, 1),
            },
            non_tensors={"min_global_steps": version, "max_global_steps": version.copy()},
            meta_info={"temperature": temperature},
        )

    @torch.no_grad()
    def compute_log_probs(self, batch: DataProto) -> torch.Tensor:
        """Per-token log-probs of `responses` under the copy (B x R), verl's own function."""
        self._require_ready()
        ids = batch.batch["input_ids"].to(self.device)
        am = batch.batch["attention_mask"].to(self.device)
        pos = batch.batch["position_ids"].to(self.device)
        r = batch.batch["responses"].shape[1]
        logits = self.model(input_ids=ids, attention_mask=am, position_ids=pos).logits
        lp: torch.Tensor = logprobs_from_logits(logits[:, -r - 1 : -1, :].float(), ids[:, -r:])
        masked: torch.Tensor = lp * batch.batch["response_mask"].to(lp.device)
        return masked
