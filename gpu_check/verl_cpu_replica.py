"""A small CPU rollout replica for verl's v1 trainer: Hugging Face generate behind verl's
server interface, registered as rollout name `cpu_hf` where vLLM and SGLang cannot run.

verl drives it like any replica: `RolloutReplicaRegistry` builds `HFReplica`, whose
`launch_servers` starts one `HFServer` Ray actor (token-in/token-out `generate`, returning
the version it holds as `extra_fields["global_steps"]`, the field verl turns into a
trajectory's min/max global steps); verl's `CheckpointEngineWorker` holds an
`HFServerAdapter` that pushes every received tensor into that server before asking the
checkpoint engine for the next one, so the engine's ack (sent when the stream ends) comes
after the server applied every tensor. Use merged LoRA (`actor_rollout_ref.model.lora.
merge=true`) so the tensors carry Hugging Face names.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import ray
from verl.workers.rollout.base import _ROLLOUT_REGISTRY, BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

NAME = "cpu_hf"


def server_name(replica_rank: int) -> str:
    """The Ray actor name of replica `replica_rank`'s server."""
    return f"rollout_lifecycle_cpu_hf_server_{replica_rank}"


class HFServer:
    """One replica's model and its generate loop (fp32, eager attention, one thread)."""

    def __init__(self, model_path: str, replica_rank: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        pids = os.environ.get("ROLLOUT_LIFECYCLE_REPLICA_PIDS")
        if pids:  # the `gpu-check train` harness kills a named replica by this pid
            Path(pids).mkdir(parents=True, exist_ok=True)
            (Path(pids) / f"replica-{replica_rank}.pid").write_text(str(os.getpid()))
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, attn_implementation="eager", dtype=torch.float32
        ).eval()
        self.params = dict(self.model.named_parameters())
        self.version: int | None = None
        self.pending: int | None = None
        self.paused = False
        self.rank = replica_rank
        self.served = 0

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """Sample a response; log-probs are the sampling distribution's (after temperature)."""
        import torch

        while self.paused:
            await asyncio.sleep(0.02)
        temp = float(sampling_params.get("temperature", 1.0))
        max_new = int(
            sampling_params.get("max_tokens") or sampling_params.get("max_new_tokens") or 16
        )
        top_p = float(sampling_params.get("top_p", 1.0))
        top_k = int(sampling_params.get("top_k", -1))
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        version = self.version
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=temp > 0,
                temperature=temp if temp > 0 else None,
                top_p=top_p,
                top_k=top_k if top_k > 0 else 0,
                max_new_tokens=max(max_new, 1),
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=self.model.generation_config.pad_token_id,
            )
        new = out.sequences[0, ids.shape[1] :]
        logits = torch.stack(out.logits, dim=1)[0].float() / max(temp, 1e-6)
        lp = torch.log_softmax(logits, dim=-1).gather(-1, new[:, None]).squeeze(-1)
        self.served += 1
        return TokenOutput(
            token_ids=new.tolist(),
            log_probs=lp.tolist(),
            stop_reason="completed",
            extra_fields={"global_steps": version},
        )

    def load_tensor(self, name: str, tensor: Any) -> bool:
        """Copy one received tensor into the model; False for a name the model lacks."""
        import torch

        p = self.params.get(name)
        if p is None:
            return False
        with torch.no_grad():
            p.copy_(tensor.to(p.dtype))
        return True

    def set_version(self, global_steps: int | None) -> int | None:
        """Every tensor of `global_steps` is applied: serve it from now on."""
        self.version = global_steps
        return self.version

    def info(self) -> dict[str, Any]:
        """What the server holds (for the run's evidence)."""
        return {"rank": self.rank, "version": self.version, "served": self.served}

    async def wake_up(self) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        self.paused = True

    async def resume_generation(self) -> None:
        self.paused = False

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


class HFReplica(RolloutReplica):  # type: ignore[misc]
    """verl's replica contract around one HFServer actor."""

    async def launch_servers(self) -> None:
        """Start the server actor (named, so the weight-sync worker can find it)."""
        actor: Any = ray.remote(HFServer).options(
            name=server_name(self.replica_rank), num_cpus=0.5, max_concurrency=64
        )
        mc = self.model_config
        path = mc.get("local_path") or mc.get("path") if hasattr(mc, "get") else mc.local_path
        server: Any = actor.remote(str(path), self.replica_rank)
        await server.info.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"cpu-hf-{self.replica_rank}"


class HFServerAdapter(BaseRollout):  # type: ignore[misc]
    """The rollout side of verl's CheckpointEngineWorker for an HFServer."""

    def __init__(self, *args: Any, replica_rank: int = 0, **kwargs: Any) -> None:
        kwargs.pop("device_mesh", None)
        super().__init__(kwargs.pop("config"), kwargs.pop("model_config"), None)
        self.replica_rank = replica_rank
        self.is_leader_rank = True

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(
        self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any
    ) -> None:
        """Apply each tensor before pulling the next; then serve the new version."""
        server = ray.get_actor(server_name(self.replica_rank))
        if hasattr(weights, "__aiter__"):
            async for name, t in weights:
                await server.load_tensor.remote(name, t.detach().cpu())
        else:
            for name, t in weights:
                await server.load_tensor.remote(name, t.detach().cpu())
        await server.set_version.remote(kwargs.get("global_steps"))


def register() -> None:
    """Make `actor_rollout_ref.rollout.name=cpu_hf` resolvable in this process."""
    RolloutReplicaRegistry.register(NAME, lambda: HFReplica)
    _ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.HFServerAdapter"


register()
