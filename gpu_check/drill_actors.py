"""The activation drill's processes: generation workers and the coordinator, as plain classes.

`gpu_check.drill` wraps them in `ray.remote`, so each runs in a process of its own (and, with
`--address`, on any node of a Ray cluster). They are plain classes so that nothing here needs
Ray to import, and so what runs in the actor is ordinary, typed code.

A worker holds its own copy of the small Qwen2 + LoRA model, loads an artifact through
`WorkerLoader` (read, hash, parse: the ack names the hash of the very bytes it parsed), copies
the tensors into its model and reads them back, and writes the rollouts it generates into the
ledger itself, stamped with what it holds. Its rollout ids name the worker and its
incarnation (`<worker>@<incarnation>/<n>`), the provenance the spec's `served_after_sync`
invariant reads. The coordinator is `ActivationCoordinator` over the durable registry plus
the artifact store; it keeps no state of its own, so a new one resumes where a killed one
stopped.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from rollout_lifecycle.model.artifacts import WEIGHTS_NAME, ArtifactStore, WorkerLoader
from rollout_lifecycle.model.backends import Backend, open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.errors import ArtifactError, RolloutLifecycleError
from rollout_lifecycle.model.records import (
    ActionEvidence,
    AdmissionPolicy,
    BehaviorPolicy,
    GenerationConditions,
    Rollout,
    RolloutIdentity,
    WorkerAck,
)

LORA_RANK = 4
LORA_TARGETS = ("q_proj", "v_proj")
RESPONSE_TOKENS = 4
PROMPT_TEMPLATE = "{a} + {b} = ?"
DATASET = "drill-arith"


@attrs.frozen
class LoadOutcome:
    """What one load attempt did on a worker: the ack it built, or why it built none."""

    worker_id: str
    version: int
    ack: WorkerAck | None
    error: str | None
    seconds: float


@attrs.frozen
class Generated:
    """A rollout as written to the ledger, with its prompt tokens (the learner re-scores it)."""

    rollout: Rollout
    prompt: tuple[int, ...]
    response: tuple[int, ...]


@attrs.frozen
class ActivationOutcome:
    """`try_activate`'s answer, in plain fields that travel between processes."""

    activated: bool
    reason: str
    missing: tuple[str, ...]
    mismatched: tuple[str, ...]


def conditions(tokenizer_id: str) -> GenerationConditions:
    """The drill's sampling contract (every worker and the learner use the same one)."""
    return GenerationConditions(tokenizer_id, 1.0, 1.0, -1, RESPONSE_TOKENS, seed=None)


def quiet_transformers() -> None:
    """No progress bars or advisories from transformers: the drill's output is its own."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def build_policy_model(model_dir: str) -> Any:
    """The small Qwen2 with LoRA on q/v, in eval mode, on the CPU, one thread."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2ForCausalLM

    quiet_transformers()
    torch.set_num_threads(1)
    base = Qwen2ForCausalLM.from_pretrained(model_dir)
    cfg = LoraConfig(
        r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=list(LORA_TARGETS), lora_dropout=0.0
    )
    model = get_peft_model(base, cfg)
    model.eval()
    return model


def lora_tensors(model: Any) -> dict[str, npt.NDArray[np.float32]]:
    """The LoRA parameters the artifacts carry, by parameter name, as float32 numpy."""
    return {
        n: p.detach().cpu().numpy().astype(np.float32).copy()
        for n, p in model.named_parameters()
        if "lora_" in n
    }


def set_lora_tensors(model: Any, tensors: dict[str, npt.NDArray[Any]]) -> None:
    """Copy `tensors` into the model, then read them back: a partial copy is an error."""
    import torch

    params = {n: p for n, p in model.named_parameters() if "lora_" in n}
    if set(params) != set(tensors):
        raise ArtifactError(
            f"artifact tensors {sorted(set(tensors) ^ set(params))[:3]} do not match the model"
        )
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(torch.from_numpy(np.ascontiguousarray(tensors[n])))
    for n, p in params.items():
        if not np.array_equal(p.detach().numpy(), tensors[n]):
            raise ArtifactError(f"tensor {n} reads back different from what was loaded")


def token_log_probs(model: Any, prompt: list[int], response: list[int]) -> list[float]:
    """log pi(a_t | s_t) of each response token under `model` (one forward pass)."""
    import torch

    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return [float(logp[start + i, t]) for i, t in enumerate(response)]


class DrillWorker:
    """One generation worker: its own model copy, its loader, its ledger connection."""

    def __init__(
        self,
        worker_id: str,
        incarnation: int,
        model_dir: str,
        store_root: str,
        backend_url: str,
        seed: int,
        tokenizer_id: str,
    ) -> None:
        import torch

        self.worker_id = worker_id
        self.incarnation = incarnation
        self.model = build_policy_model(model_dir)
        self.loader = WorkerLoader(ArtifactStore(store_root, create=False), worker_id, incarnation)
        self.backend: Backend = open_backend(backend_url)
        self.conditions = conditions(tokenizer_id)
        self.holding: tuple[int, str] | None = None  # (version, hash) of its last verified load
        self.remembered: tuple[int, str] | None = None  # what a buggy restart claims it holds
        self.serial = 0
        self.gen = torch.Generator().manual_seed(seed * 1009 + incarnation * 97 + len(worker_id))
        self.rng = np.random.default_rng(seed + incarnation)

    def where(self) -> str:
        """host/pid of this worker's process (each worker is a process of its own)."""
        return f"{socket.gethostname()}/{os.getpid()}"

    def remember(self, holding: tuple[int, str] | None) -> None:
        """Negative control only: a restarted engine that restores its version label from
        before the crash (but not its weights) and would serve under it."""
        self.remembered = holding

    def load(
        self, version: int, expected_hash: str, token: str | None, fault: str | None = None
    ) -> LoadOutcome:
        """Load `version` from storage into the model; the ack echoes `token`.

        `fault`: 'die' reads the artifact and then kills this process before it acks (a
        worker dying mid-load); 'slow:<seconds>' loads, then stalls before answering.
        """
        started = time.perf_counter()
        if fault == "die":
            self.loader.store.read_bytes(version, WEIGHTS_NAME)
            sys.stdout.flush()
            os._exit(17)  # the actor process dies mid-load: no ack, no cleanup
        try:
            loaded, ack = self.loader.load(version, expected_hash, token=token)
            set_lora_tensors(self.model, dict(loaded.tensors))
        except ArtifactError as exc:
            return LoadOutcome(
                self.worker_id, version, None, str(exc), time.perf_counter() - started
            )
        self.holding = (version, loaded.artifact_hash)
        if fault is not None and fault.startswith("slow:"):
            time.sleep(float(fault.partition(":")[2]))
        return LoadOutcome(self.worker_id, version, ack, None, time.perf_counter() - started)

    def holds(self) -> tuple[int, str] | None:
        """The (version, hash) this worker loaded last, None before its first load."""
        return self.holding

    def generate(self, n: int) -> list[Generated]:
        """Sample `n` rollouts with the weights held, stamp them, write them to the ledger.

        A worker that loaded nothing since it (re)started refuses to serve, unless the
        negative control made it remember a version from before its restart.
        """
        import torch

        stamp = self.holding or self.remembered
        if stamp is None:
            raise RolloutLifecycleError(
                f"{self.worker_id}@{self.incarnation} holds no loaded version: resync first"
            )
        out: list[Generated] = []
        for _ in range(n):
            a, b = (int(x) for x in self.rng.integers(0, 50, 2))
            prompt = [int(t) for t in self._encode(PROMPT_TEMPLATE.format(a=a, b=b))]
            ids = list(prompt)
            response: list[int] = []
            logps: list[float] = []
            with torch.no_grad():
                for _t in range(RESPONSE_TOKENS):
                    logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                    logp = torch.log_softmax(logits, dim=-1)
                    tok = int(torch.multinomial(logp.exp(), 1, generator=self.gen))
                    response.append(tok)
                    logps.append(float(logp[tok]))
                    ids.append(tok)
            rid = f"{self.worker_id}@{self.incarnation}/{self.serial}"
            self.serial += 1
            ro = Rollout(
                RolloutIdentity(rid, f"{a}+{b}", DATASET, 0),
                BehaviorPolicy(stamp[0], stamp[1]),
                self.conditions,
                ActionEvidence(response, [True] * len(response), logps),
            )
            entry = self.backend.ledger.add(ro)
            if entry.state == "dispatched":  # a failed version's rollout is quarantined on add
                self.backend.ledger.transition(rid, "generation_done", entry.revision)
            out.append(Generated(ro, tuple(prompt), tuple(response)))
        return out

    def _encode(self, text: str) -> list[int]:
        from rollout_lifecycle.gpu_check.model_assets import small_tokenizer

        if not hasattr(self, "_tok"):
            self._tok = small_tokenizer()
        return list(self._tok(text)["input_ids"])

    def close(self) -> None:
        """Close the ledger connection (a retired worker)."""
        self.backend.close()


class DrillCoordinator:
    """The activation coordinator's process: the protocol over the durable registry.

    Every method is one protocol step; nothing is kept here between calls that the registry
    does not hold, so `resume` in a fresh process sees exactly what a killed one left.
    """

    def __init__(
        self,
        backend_url: str,
        store_root: str,
        workers: list[str] | None,
        policy: AdmissionPolicy | None,
    ) -> None:
        self.backend: Backend = open_backend(backend_url)
        self.store = ArtifactStore(store_root)
        self.coord = ActivationCoordinator(
            self.backend.registry, workers, ledger=self.backend.ledger, policy=policy
        )
        self.written: dict[int, bytes] = {}

    def where(self) -> str:
        """host/pid of this coordinator's process."""
        return f"{socket.gethostname()}/{os.getpid()}"

    def crash(self) -> None:
        """SIGKILL this process: no finally block, no flush, no goodbye."""
        os.kill(os.getpid(), signal.SIGKILL)

    def publish(
        self, version: int, tensors: dict[str, npt.NDArray[np.float32]], parent: int | None
    ) -> str:
        """Write the artifact (safetensors, hashed), verify it from disk, prepare and commit."""
        stored = self.store.write(version, tensors=tensors, label=f"drill-v{version}")
        self.written[version] = (stored.path / WEIGHTS_NAME).read_bytes()
        self.coord.prepare(version, parent_version=parent)
        self.store.verify(version, stored.artifact_hash)
        self.coord.commit_artifact(version, stored.artifact_hash, str(stored.path))
        return stored.artifact_hash

    def repair(self, version: int) -> None:
        """Put the committed bytes back after storage corrupted them (same hash, same file)."""
        data = self.written.get(version)
        if data is None:
            raise ArtifactError(f"this coordinator did not write v{version}; cannot repair it")
        path = self.store.path_for(version) / WEIGHTS_NAME
        tmp = path.with_name(path.name + ".repair")
        tmp.write_bytes(data)
        os.chmod(tmp, 0o444)
        os.replace(tmp, path)
        h = self.coord.artifact(version).artifact_hash
        assert h is not None
        self.store.verify(version, h)

    def distribute(self, version: int) -> dict[str, str]:
        """Open the first distribution attempt; each required worker's token."""
        self.coord.distribute(version)
        return self.coord.attempt_tokens(version)

    def retry(self, version: int) -> dict[str, str]:
        """Open a new attempt after a failure; the old attempt's tokens stop counting."""
        self.coord.retry(version)
        return self.coord.attempt_tokens(version)

    def tokens(self, version: int) -> dict[str, str]:
        """The current attempt's tokens (a worker that joined mid-attempt has one too)."""
        return self.coord.attempt_tokens(version)

    def record_ack(self, ack: WorkerAck) -> str:
        """Judge one ack; its reason ('counted', 'reported', or why it was refused)."""
        return self.coord.record_ack(ack).reason

    def try_activate(self, version: int) -> ActivationOutcome:
        """Move the pointer iff every required worker acked this attempt with the hash."""
        r = self.coord.try_activate(version)
        return ActivationOutcome(r.activated, r.reason, r.missing_workers, r.mismatched_workers)

    def fail(self, version: int, cause: str, detail: str) -> None:
        """Record the failed attempt at stage 'distribution' with its cause; quarantine."""
        self.coord.fail_distribution(version, cause, detail)

    def worker_restarted(self, worker_id: str, incarnation: int) -> None:
        """The worker lost its weights: its earlier incarnation's acks stop counting."""
        self.coord.worker_restarted(worker_id, incarnation)

    def change_membership(self, workers: list[str], reason: str) -> tuple[str, ...]:
        """A recorded membership change (leavers' acks voided, joiners issued tokens)."""
        return self.coord.change_membership(workers, reason)

    def resume(self) -> list[int]:
        """After a restart: re-apply quarantines; the versions still awaiting acks."""
        return [a.version for a in self.coord.resume().awaiting_acks]

    def pointer(self) -> tuple[int, str] | None:
        """The active (version, hash)."""
        p = self.coord.pointer()
        return None if p is None else (p.version, p.artifact_hash)

    def required(self) -> tuple[str, ...]:
        """The durable required worker set."""
        return self.coord.required_workers

    def close(self) -> None:
        """Close the backend."""
        self.backend.close()


def store_path(root: Path) -> str:
    """The artifact root as a string every process can open."""
    return str(root.resolve())
