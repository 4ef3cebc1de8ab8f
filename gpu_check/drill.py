"""The activation drill: atomic activation across real worker processes, under faults.

Why a drill: fuzzers, the explorer and the race exercise the coordinator with simulated
workers; peers shipped the failures this protocol exists for on real ones (weights not
atomic across workers, a recovered engine serving before it synced, a version published
after a failed load). Here N generation workers are Ray actors, each its own process with
its own copy of the small Qwen2 + LoRA model; the coordinator is a Ray actor too, so it can
be SIGKILLed and replaced. Each fault gets a version of its own: the attempt must fail with
the old pointer kept, its failure recorded with its cause, the rollouts stamped with the
failed version quarantined, and a clean retry must activate, while generation goes on with
the old version. The trace (ledger and registry) is then judged by the same audit as
`rollout-lifecycle ledger check` (spec.audit): the drill's verdict is the spec's.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from rollout_lifecycle.gpu_check.drill_actors import (
    ActivationOutcome,
    DrillCoordinator,
    DrillWorker,
    Generated,
    LoadOutcome,
    build_policy_model,
    conditions,
    lora_tensors,
    quiet_transformers,
    set_lora_tensors,
    store_path,
    token_log_probs,
)
from rollout_lifecycle.gpu_check.errors import ControlError, GpuCheckError, TechnicalFailure
from rollout_lifecycle.model.admission import admit_and_reserve
from rollout_lifecycle.model.artifacts import WEIGHTS_NAME, ArtifactStore, WorkerLoader
from rollout_lifecycle.model.backends import Backend, open_backend, redact_url
from rollout_lifecycle.model.coordinator import _change
from rollout_lifecycle.model.events import ArtifactChanged
from rollout_lifecycle.model.records import (
    ActivePointer,
    AdmissionPolicy,
    Reward,
)
from rollout_lifecycle.model.registry import (
    RegistryStep,
    RegistryView,
    counted_acks,
    set_admission_policy,
)
from rollout_lifecycle.spec.audit import audit
from rollout_lifecycle.spec.invariants import violated_names

SCHEMA = "rollout-lifecycle/activation-drill/1"
# each fault kind and the cause its failed attempt records (stage 'distribution')
FAULT_CAUSES: dict[str, str] = {
    "worker-killed-mid-load": "worker_died_mid_load",
    "corrupt-artifact": "artifact_corrupt",
    "ack-after-retry": "ack_missing_at_deadline",
    "previous-version-ack": "previous_version_acked",
    "slow-load": "load_deadline_exceeded",
    "restart-resync": "worker_restarted",
    "membership-change": "membership_changed",
    "coordinator-killed": "coordinator_restarted",
}
FAULT_KINDS = tuple(FAULT_CAUSES)
# each negative control and the invariant the spec must name for it
NEGATIVE_CONTROLS: dict[str, str] = {
    "majority-ack": "activation_needs_all_acks",
    "serve-before-resync": "served_after_sync",
}
POLICY = AdmissionPolicy(max_lag=1, max_drift=0.2)
REWARD_FN = ("drill-first-token", "1")


# Ray actors import torch and build a model each: minutes on a loaded 2-core machine
START_TIMEOUT_S = 900.0


class DrillError(GpuCheckError):
    """The drill could not run as planned (a worker or the coordinator misbehaved outside the
    injected faults, or an injected fault did not produce the failure it stands for)."""


@attrs.frozen
class DrillConfig:
    """What to run. `versions` counts the versions after v0; each fault takes one of them."""

    out: Path
    workers: int = 3
    versions: int | None = None
    faults: tuple[str, ...] = FAULT_KINDS
    backend_url: str | None = None
    seed: int = 0
    address: str | None = None
    negative_control: str | None = None
    deadline_s: float = 2.0
    rollouts_per_round: int = 1

    def total_versions(self) -> int:
        """Versions after v0: the faults plus at least one clean one (the default adds two)."""
        return self.versions if self.versions is not None else len(self.faults) + 2

    def check(self) -> None:
        """Refuse combinations that cannot run (ControlError: a usage error)."""
        if self.workers < 3:
            raise ControlError(f"--workers must be at least 3, got {self.workers}")
        unknown = [f for f in self.faults if f not in FAULT_CAUSES]
        if unknown:
            raise ControlError(f"unknown fault kind(s) {unknown}; known: {', '.join(FAULT_KINDS)}")
        if len(set(self.faults)) != len(self.faults):
            raise ControlError("each fault kind may be given once (each takes a version)")
        if self.total_versions() < len(self.faults):
            raise ControlError(
                f"--versions {self.versions} leaves no version for each of the "
                f"{len(self.faults)} faults; give at least {len(self.faults)}"
            )
        nc = self.negative_control
        if nc is not None and nc not in NEGATIVE_CONTROLS:
            raise ControlError(
                f"unknown negative control {nc!r}; known: {sorted(NEGATIVE_CONTROLS)}"
            )
        if nc == "majority-ack" and self.total_versions() <= len(self.faults):
            raise ControlError("--negative-control majority-ack needs one clean version")
        if nc == "serve-before-resync" and "restart-resync" not in self.faults:
            raise ControlError("--negative-control serve-before-resync needs restart-resync")
        if self.deadline_s <= 0:
            raise ControlError("the load deadline must be positive")


@attrs.define
class FaultRecord:
    """How one fault's version went: the attempt that failed, and the retry."""

    kind: str
    version: int
    stage: str | None = None
    cause: str | None = None
    failed_reason: str | None = None
    pointer_kept: bool = False
    quarantined: int = 0
    retry_activated: bool = False
    seconds_to_activate: float | None = None


@attrs.define
class _Worker:
    handle: Any
    incarnation: int


def _p50(xs: Sequence[float]) -> float | None:
    return None if not xs else round(float(statistics.median(xs)), 3)


def _max(xs: Sequence[float]) -> float | None:
    return None if not xs else round(max(xs), 3)


@contextlib.contextmanager
def _ray_session(address: str | None, log: Path) -> Iterator[Any]:
    """ray.init (local and small by default, or joining `address`), shut down in finally.

    Ray's driver prints the raylet's error notices (a worker process that died, which the
    drill causes on purpose) on stdout from a thread of its own; they go to `log` instead,
    so stdout stays the command's (and `--json` stays JSON).
    """
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    try:
        import ray
    except ImportError as exc:
        from rollout_lifecycle.gpu_check.extra import INSTALL_HINT

        raise TechnicalFailure(
            "ray", f"not importable ({exc}); the drill needs the [verl] extra: {INSTALL_HINT}"
        ) from None
    try:
        if address:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        else:
            ray.init(
                num_cpus=2,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
                object_store_memory=128 * 1024 * 1024,
            )
    except Exception as exc:  # ray raises ConnectionError, RuntimeError, ValueError...
        hint = ""
        if address and isinstance(exc, ConnectionError) and "RAY_AUTH_MODE" not in os.environ:
            hint = (
                " (a cluster started with token authentication also needs RAY_AUTH_MODE=token "
                "and its token, ~/.ray/auth_token or RAY_AUTH_TOKEN, on this machine)"
            )
        raise TechnicalFailure("ray.init", f"{type(exc).__name__}: {exc}{hint}") from None
    names = sys.modules["ray._private.worker"].__dict__
    printer = names["print_to_stdstream"]

    def to_log(data: dict[str, Any], ignore_prefix: bool = False) -> None:
        del ignore_prefix
        with log.open("a", encoding="utf-8") as fh:
            for line in data.get("lines", ()):
                fh.write(f"[{data.get('pid', '?')}] {line}\n")

    names["print_to_stdstream"] = to_log
    try:
        yield ray
    finally:
        ray.shutdown()
        names["print_to_stdstream"] = printer


def force_majority_activation(backend: Backend, version: int) -> None:
    """NEGATIVE CONTROL: activate `version` on whatever acks are counted, bypassing the
    registry's own all-acks check, as a coordinator that counts a majority would.

    The step is written through the registry's transaction with its guard (`check_step`)
    switched off for this one call, so the bad activation lands in the durable trace and the
    spec, not the write path, has to catch it.
    """
    registry = backend.registry
    module = sys.modules[type(registry).__module__]
    names = module.__dict__
    guard = names["check_step"]
    clock: Callable[[], float] = getattr(registry, "clock", time.time)

    def plan(view: RegistryView) -> tuple[RegistryStep, None]:
        rec = view.artifact(version)
        assert rec is not None and rec.artifact_hash is not None
        acks = counted_acks(view, rec)
        required = view.required_workers() or ()
        used = tuple(acks[w] for w in required if w in acks)
        changes = [
            _change(rec, "activate", {"all_acked": True}, acks=used, required_workers=required)
        ]
        old = view.pointer()
        if old is not None:
            prev = view.artifact(old.version)
            assert prev is not None
            changes.append(_change(prev, "supersede"))
        pointer = ActivePointer(version, rec.artifact_hash)
        return RegistryStep(clock(), tuple(changes), pointer=pointer), None

    names["check_step"] = lambda _view, _step: None
    try:
        registry.transact(plan)
    finally:
        names["check_step"] = guard
    backend.ledger.clear_bad_version(version)


class ActivationDrill:
    """One run of the drill; `run()` returns the result document (a JSON-able dict)."""

    def __init__(self, cfg: DrillConfig, ray: Any, say: Callable[[str], None]) -> None:
        from rollout_lifecycle.gpu_check.model_assets import (
            build_small_model,
            inspect_model_dir,
            tokenizer_id,
        )

        self.cfg, self.ray, self.say = cfg, ray, say
        quiet_transformers()
        self.rng = np.random.default_rng(cfg.seed)
        out = cfg.out
        model_dir = out / "model"
        if (model_dir / "config.json").is_file():
            inspect_model_dir(model_dir)
        else:
            build_small_model(model_dir)
        self.model_dir = str(model_dir.resolve())
        self.tokenizer_id = tokenizer_id(model_dir)
        self.store_root = store_path(out / "artifacts")
        ArtifactStore(self.store_root)
        self.url = cfg.backend_url or f"sqlite:///{(out / 'drill.db').resolve()}"
        # on a cluster, spread the workers over the nodes: atomicity across machines
        spread = {"scheduling_strategy": "SPREAD"} if cfg.address else {}
        self.worker_cls = ray.remote(num_cpus=0, max_restarts=0, **spread)(DrillWorker)
        self.coord_cls = ray.remote(num_cpus=0, max_restarts=0)(DrillCoordinator)
        self.workers: dict[str, _Worker] = {}
        self.retired: list[str] = []
        self.next_id = 0
        self.hashes: dict[int, str] = {}
        self.generated: dict[str, Generated] = {}
        self.acks: Counter[str] = Counter()
        self.activation_s: dict[int, float] = {}
        self.faults: list[FaultRecord] = []
        self.updates = 0
        self.coordinator_procs: list[str] = []
        self.worker_procs: dict[str, str] = {}
        self.learner = build_policy_model(self.model_dir)
        self.weights = lora_tensors(self.learner)
        self.learner_loader = WorkerLoader(ArtifactStore(self.store_root), "learner")
        self.learner_version: int | None = None
        self.backend = open_backend(self.url)
        self.coord: Any = None
        self.majority_version = -1  # the clean version the majority-ack control forces

    # ---- plumbing ------------------------------------------------------------------------

    def get(self, ref: Any, what: str, timeout: float = 300.0) -> Any:
        """ray.get, with a worker's or coordinator's failure turned into a DrillError."""
        try:
            return self.ray.get(ref, timeout=timeout)
        except GpuCheckError:
            raise
        except Exception as exc:
            raise DrillError(f"{what}: {type(exc).__name__}: {_first_line(exc)}") from None

    def start_coordinator(self, first: bool) -> None:
        workers = [f"gen-{i}" for i in range(self.cfg.workers)] if first else None
        if first:  # the operator records the deployment's policy; coordinators only check it
            set_admission_policy(self.backend.registry, POLICY, "drill: set by the operator")
        self.coord = self.coord_cls.remote(self.url, self.store_root, workers, POLICY)
        self.coordinator_procs.append(self.get(self.coord.where.remote(), "coordinator start"))

    def start_worker(self, wid: str, incarnation: int) -> Any:
        h = self.worker_cls.remote(
            wid,
            incarnation,
            self.model_dir,
            self.store_root,
            self.url,
            self.cfg.seed,
            self.tokenizer_id,
        )
        self.workers[wid] = _Worker(h, incarnation)
        return h

    def start_workers(self, ids: Sequence[str]) -> None:
        handles = {w: self.start_worker(w, 0) for w in ids}
        pids = self.get(
            [h.where.remote() for h in handles.values()],
            f"{len(handles)} workers did not all start within {START_TIMEOUT_S:.0f} s (each "
            "process imports torch and builds its model; a machine this loaded is too slow)",
            timeout=START_TIMEOUT_S,
        )
        self.worker_procs.update(dict(zip(handles, pids, strict=True)))

    def restart_worker(self, wid: str) -> None:
        """Kill the worker's process and start its next incarnation (weights lost)."""
        old = self.workers[wid]
        self.ray.kill(old.handle, no_restart=True)
        h = self.start_worker(wid, old.incarnation + 1)
        self.worker_procs[f"{wid}@{old.incarnation + 1}"] = self.get(
            h.where.remote(), f"{wid} restart"
        )
        self.get(self.coord.worker_restarted.remote(wid, old.incarnation + 1), "worker_restarted")

    def c(self, method: str, *args: Any) -> Any:
        """One coordinator call (a protocol step in the coordinator's process)."""
        return self.get(getattr(self.coord, method).remote(*args), f"coordinator.{method}")

    def pointer(self) -> tuple[int, str] | None:
        p = self.backend.registry.pointer()
        return None if p is None else (p.version, p.artifact_hash)

    def members(self) -> tuple[str, ...]:
        return tuple(self.backend.registry.required_workers() or ())

    def forward(self, outcome: LoadOutcome) -> str:
        """Deliver one worker's ack to the coordinator; count the verdict."""
        if outcome.ack is None:
            self.acks["no_ack (load failed)"] += 1
            return "no_ack"
        reason: str = self.c("record_ack", outcome.ack)
        self.acks[reason] += 1
        return reason

    def serve(self, wids: Sequence[str], what: str) -> None:
        """Each worker generates with the weights it holds; rollouts go to the ledger."""
        refs = [self.workers[w].handle.generate.remote(self.cfg.rollouts_per_round) for w in wids]
        for batch in self.get(refs, what):
            for g in batch:
                self.generated[g.rollout.rollout_id] = g

    def serving(self) -> list[str]:
        return [w for w in self.workers if w not in self.retired]

    def resync(self, wids: Sequence[str]) -> None:
        """Load the active version (no token: a report of what it holds), then it may serve."""
        p = self.pointer()
        assert p is not None
        refs = [self.workers[w].handle.load.remote(p[0], p[1], None) for w in wids]
        for o in self.get(refs, "resync"):
            if o.ack is None:
                raise DrillError(f"{o.worker_id} could not resync to v{p[0]}: {o.error}")
            self.forward(o)

    # ---- versions ------------------------------------------------------------------------

    def next_weights(self, version: int) -> dict[str, npt.NDArray[np.float32]]:
        """The learner's new weights: a small seeded step from the previous version's."""
        r = np.random.default_rng([self.cfg.seed, version])
        scale = 0.02 if version == 0 else 0.004
        self.weights = {
            k: (v + r.normal(0.0, scale, v.shape)).astype(np.float32)
            for k, v in self.weights.items()
        }
        return self.weights

    def publish(self, version: int) -> None:
        parent = None if version == 0 else version - 1
        self.hashes[version] = self.c("publish", version, self.next_weights(version), parent)

    def load_all(
        self, version: int, tokens: dict[str, str], wids: Sequence[str], fault: dict[str, str]
    ) -> list[Any]:
        h = self.hashes[version]
        return [
            self.workers[w].handle.load.remote(version, h, tokens[w], fault.get(w)) for w in wids
        ]

    def ack_and_serve(self, outcomes: Sequence[LoadOutcome]) -> None:
        """Forward each ack; a worker whose ack was stored serves what it loaded."""
        stored = [o.worker_id for o in outcomes if self.forward(o) in ("counted", "reported")]
        self.serve(stored, "generation on the candidate")

    def clean_attempt(self, version: int, tokens: dict[str, str]) -> ActivationOutcome:
        members = self.members()
        outcomes = self.get(self.load_all(version, tokens, members, {}), f"loading v{version}")
        self.ack_and_serve(outcomes)
        outcome: ActivationOutcome = self.c("try_activate", version)
        return outcome

    def activate(self, version: int, fault: str | None) -> None:
        """Publish `version` and drive it to activation, through its fault if it has one."""
        before = self.pointer()
        self.publish(version)
        started = time.perf_counter()
        tokens: dict[str, str] = self.c("distribute", version)
        if before is not None:
            self.serve(self.serving(), "generation on the old version")
        if fault is None:
            if self.cfg.negative_control == "majority-ack" and version == self.majority_version:
                self.majority(version, tokens)
            else:
                r = self.clean_attempt(version, tokens)
                if not r.activated:
                    raise DrillError(f"clean v{version} did not activate: {r.reason}")
        else:
            self.fault_round(version, fault, tokens, before)
        self.activation_s[version] = time.perf_counter() - started
        ptr = self.pointer()
        self.say(
            f"v{version}{'' if fault is None else f' [{fault}]'}: active after "
            f"{self.activation_s[version]:.2f}s (pointer v{ptr[0] if ptr else None})"
        )
        self.learn()

    def fault_round(
        self, version: int, kind: str, tokens: dict[str, str], before: tuple[int, str] | None
    ) -> None:
        rec = FaultRecord(kind, version)
        self.faults.append(rec)
        after_retry = getattr(self, "_" + kind.replace("-", "_"))(version, tokens)
        art = self.backend.registry.artifact(version)
        if art is None or art.state != "distribution_failed" or art.failure is None:
            raise DrillError(f"fault {kind} on v{version} did not fail the attempt ({art})")
        rec.stage, rec.cause = art.failure.stage, art.failure.cause
        rec.failed_reason = art.failure.detail
        rec.pointer_kept = self.pointer() == before
        holding = self.get([self.workers[w].handle.holds.remote() for w in self.serving()], "holds")
        stale = [
            w
            for w, held in zip(self.serving(), holding, strict=True)
            if held is None or held[0] == version
        ]
        self.resync(stale)
        self.serve(self.serving(), "generation on the old version after the failure")
        tokens = self.c("retry", version)
        if after_retry is not None:
            after_retry()
        r = self.clean_attempt(version, tokens)
        rec.retry_activated = r.activated
        if not r.activated:
            raise DrillError(f"the clean retry of v{version} ({kind}) did not activate: {r.reason}")

    def fail(self, version: int, kind: str, detail: str) -> None:
        r: ActivationOutcome = self.c("try_activate", version)
        if r.activated:
            raise DrillError(f"fault {kind}: v{version} activated although it should not")
        why = f"{detail}; try_activate: {r.reason} (missing {list(r.missing)}, mismatched "
        why += f"{list(r.mismatched)})"
        self.c("fail", version, FAULT_CAUSES[kind], why)

    def victim(self) -> str:
        members = self.members()
        return members[int(self.rng.integers(0, len(members)))]

    # ---- the faults (each returns what must happen right after the retry opens) -----------

    def _worker_killed_mid_load(self, version: int, tokens: dict[str, str]) -> None:
        v = self.victim()
        refs = self.load_all(version, tokens, self.members(), {v: "die"})
        outcomes = []
        for w, ref in zip(self.members(), refs, strict=True):
            try:
                outcomes.append(self.ray.get(ref, timeout=120))
            except Exception as exc:  # the actor process died: ActorDiedError
                if w != v:
                    raise DrillError(f"{w} failed loading v{version}: {_first_line(exc)}") from None
        self.ack_and_serve(outcomes)
        self.fail(version, "worker-killed-mid-load", f"{v}'s process died while loading")
        self.restart_worker(v)
        self.say(f"  {v} died mid-load; restarted as incarnation {self.workers[v].incarnation}")

    def _corrupt_artifact(self, version: int, tokens: dict[str, str]) -> None:
        members = self.members()
        first = self.get(self.load_all(version, tokens, members[:1], {}), "load")
        self.ack_and_serve(first)
        path = Path(self.store_root) / f"v{version:012d}" / WEIGHTS_NAME
        data = bytearray(path.read_bytes())
        mid = len(data) // 2
        data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
        os.chmod(path, 0o644)
        path.write_bytes(bytes(data))
        rest = self.get(self.load_all(version, tokens, members[1:], {}), "load")
        bad = [o.worker_id for o in rest if o.ack is None]
        if not bad:
            raise DrillError("the corrupted artifact was acked")
        self.ack_and_serve(rest)
        self.fail(version, "corrupt-artifact", f"{bad} refused v{version}: hash mismatch")
        self.c("repair", version)
        self.say(f"  v{version} corrupted on storage after {members[0]} loaded it; repaired")

    def _ack_after_retry(self, version: int, tokens: dict[str, str]) -> Callable[[], None]:
        v = self.victim()
        outcomes = self.get(self.load_all(version, tokens, self.members(), {}), "load")
        held = next(o for o in outcomes if o.worker_id == v)
        self.ack_and_serve([o for o in outcomes if o.worker_id != v])
        self.fail(version, "ack-after-retry", f"{v}'s ack did not arrive before the deadline")

        def deliver() -> None:
            reason = self.forward(held)
            self.say(f"  {v}'s ack of the failed attempt arrived after the retry: {reason}")

        return deliver

    def _previous_version_ack(self, version: int, tokens: dict[str, str]) -> None:
        v = self.victim()
        prev = self.pointer()
        assert prev is not None
        refs = [
            self.workers[w].handle.load.remote(
                *(prev if w == v else (version, self.hashes[version])), tokens[w]
            )
            for w in self.members()
        ]
        outcomes = self.get(refs, "load")
        self.ack_and_serve(outcomes)
        self.fail(version, "previous-version-ack", f"{v} loaded and acked v{prev[0]}")

    def _slow_load(self, version: int, tokens: dict[str, str]) -> Callable[[], None]:
        v = self.victim()
        slow = f"slow:{self.cfg.deadline_s + 1.0}"
        members = self.members()
        refs = self.load_all(version, tokens, members, {v: slow})
        ready, pending = self.ray.wait(refs, num_returns=len(refs), timeout=self.cfg.deadline_s)
        late = next(r for r, w in zip(refs, members, strict=True) if w == v)
        if late not in pending:
            raise DrillError(f"{v}'s slow load finished within the deadline")
        self.ack_and_serve(self.get(ready, "load"))
        self.fail(version, "slow-load", f"{v} did not load within {self.cfg.deadline_s}s")

        def deliver() -> None:
            reason = self.forward(self.get(late, "slow load"))
            self.say(f"  {v}'s slow load answered after the retry: {reason}")

        return deliver

    def _restart_resync(self, version: int, tokens: dict[str, str]) -> None:
        v = self.victim()
        outcomes = self.get(self.load_all(version, tokens, self.members(), {}), "load")
        self.ack_and_serve(outcomes)
        active = self.pointer()
        self.restart_worker(v)
        if self.cfg.negative_control == "serve-before-resync":
            # the bug: the recovered engine restores its version label, not its weights,
            # and serves under it before it loaded anything
            self.get(self.workers[v].handle.remember.remote(active), "remember")
            self.serve([v], "NEGATIVE CONTROL: serving before resync")
            self.say(f"  NEGATIVE CONTROL: restarted {v} served before it resynced")
        self.fail(version, "restart-resync", f"{v} restarted after acking; its ack is void")
        self.say(f"  {v} restarted mid-activation; it resyncs before it serves")

    def _membership_change(self, version: int, tokens: dict[str, str]) -> None:
        members = self.members()
        v = self.victim()
        outcomes = self.get(self.load_all(version, tokens, members, {}), "load")
        self.ack_and_serve(outcomes)
        shrunk = [w for w in members if w != v]
        self.c("change_membership", shrunk, f"{v} drained mid-activation of v{version}")
        self.ray.kill(self.workers[v].handle, no_restart=True)
        self.retired.append(v)
        joiner = f"gen-{self.cfg.workers + self.next_id}"
        self.next_id += 1
        self.start_workers([joiner])
        self.c("change_membership", [*shrunk, joiner], f"{joiner} joined mid-activation")
        self.fail(version, "membership-change", f"{v} left, {joiner} joined and has not loaded")
        self.say(f"  membership: {v} left, {joiner} joined during v{version}")

    def _coordinator_killed(self, version: int, tokens: dict[str, str]) -> Callable[[], None]:
        members = self.members()
        outcomes = self.get(self.load_all(version, tokens, members, {}), "load")
        self.ack_and_serve(outcomes[:-1])
        old_pid = self.coordinator_procs[-1]
        with contextlib.suppress(Exception):  # the call never returns: its process is gone
            self.ray.get(self.coord.crash.remote(), timeout=60)
        self.start_coordinator(first=False)
        pending = self.c("resume")
        if pending != [version]:
            raise DrillError(
                f"the resumed coordinator sees {pending} awaiting acks, not v{version}"
            )
        self.say(
            f"  coordinator {old_pid} SIGKILLed mid-activation; "
            f"{self.coordinator_procs[-1]} resumed v{version} from the registry"
        )
        self.c(
            "fail",
            version,
            FAULT_CAUSES["coordinator-killed"],
            f"coordinator {old_pid} was killed with the attempt open; resumed by "
            f"{self.coordinator_procs[-1]}",
        )
        held = outcomes[-1]

        def deliver() -> None:
            reason = self.forward(held)
            self.say(f"  {held.worker_id}'s ack to the dead coordinator, delivered now: {reason}")

        return deliver

    # ---- the negative control: a majority of acks ----------------------------------------

    def majority(self, version: int, tokens: dict[str, str]) -> None:
        members = self.members()
        outcomes = self.get(self.load_all(version, tokens, members, {}), "load")
        k = len(members) // 2 + 1
        self.ack_and_serve(outcomes[:k])
        force_majority_activation(self.backend, version)
        self.say(f"  NEGATIVE CONTROL: v{version} activated on {k} of {len(members)} acks")
        self.ack_and_serve(outcomes[k:])

    # ---- the learner ---------------------------------------------------------------------

    def learn(self) -> None:
        """Reward what was generated, admit from evidence against the recorded policy and the
        pointer, reserve, and commit; stale rollouts are retired."""
        p = self.pointer()
        assert p is not None
        if self.learner_version != p[0]:
            loaded, _ack = self.learner_loader.load(p[0], p[1])
            set_lora_tensors(self.learner, dict(loaded.tensors))
            self.learner_version = p[0]
        ledger = self.backend.ledger
        snap = ledger.snapshot()
        for rid, e in snap.items():
            if e.state == "generated" and rid in self.generated:
                # a stand-in reward service (the parity of the first token): the drill
                # judges activation and admission, not learning
                value = float(self.generated[rid].response[0] % 2)
                ledger.transition(rid, "reward_ready", e.revision, reward=Reward(*REWARD_FN, value))
        snap = ledger.snapshot()
        ready = [
            self.generated[r]
            for r, e in snap.items()
            if e.state == "rewarded" and r in self.generated
        ]
        if not ready:
            return
        current = np.zeros((len(ready), max(len(g.response) for g in ready)))
        for i, g in enumerate(ready):
            lp = token_log_probs(self.learner, list(g.prompt), list(g.response))
            current[i, : len(lp)] = lp
        self.updates += 1
        update = f"update-{self.updates}"
        got = admit_and_reserve(
            ledger,
            self.backend.registry,
            update,
            [g.rollout for g in ready],
            current,
            conditions=conditions(self.tokenizer_id),
        )
        if got.reserved:
            ledger.commit(update, got.reserved)
        for rid, why in got.refused.items():
            e = ledger.get(rid)
            if why == "stale_policy" and e.state == "rewarded":
                ledger.transition(rid, "retire_stale", e.revision)

    # ---- the run -------------------------------------------------------------------------

    def schedule(self) -> list[tuple[int, str | None]]:
        k = self.cfg.total_versions()
        order = list(self.cfg.faults)
        self.rng.shuffle(order)
        slots = sorted(
            int(x) for x in self.rng.choice(np.arange(1, k + 1), len(order), replace=False)
        )
        plan: list[tuple[int, str | None]] = [(v, None) for v in range(1, k + 1)]
        for slot, kind in zip(slots, order, strict=True):
            plan[slot - 1] = (slot, kind)
        clean = [v for v, f in plan if f is None]
        self.majority_version = clean[0] if clean else -1
        return plan

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        plan = self.schedule()
        self.say(
            f"drill: {self.cfg.workers} workers, v0 + {len(plan)} versions, faults: "
            + (", ".join(f"v{v} {f}" for v, f in plan if f is not None) or "none")
        )
        self.start_coordinator(first=True)
        self.start_workers([f"gen-{i}" for i in range(self.cfg.workers)])
        self.say(
            f"coordinator {self.coordinator_procs[0]}; workers "
            + ", ".join(f"{w} {p}" for w, p in self.worker_procs.items())
        )
        self.activate(0, None)
        for version, fault in plan:
            self.activate(version, fault)
        self.serve(self.serving(), "generation after the last activation")
        self.learn()
        for w in self.serving():
            with contextlib.suppress(Exception):
                self.ray.get(self.workers[w].handle.close.remote(), timeout=30)
        with contextlib.suppress(Exception):
            self.ray.get(self.coord.close.remote(), timeout=30)
        wall = time.perf_counter() - started
        return self.report(wall)

    def report(self, wall: float) -> dict[str, Any]:
        stored = self.backend.stored_rows()
        result = audit(stored, quiescent=True)
        violations = result.violations
        snap = self.backend.ledger.snapshot()
        per_version: dict[int, Counter[str]] = {}
        for e in snap.values():
            per_version.setdefault(e.behavior_version, Counter())[e.state] += 1
        for rec in self.faults:
            rec.quarantined = per_version.get(rec.version, Counter())["quarantined"]
            rec.seconds_to_activate = round(self.activation_s[rec.version], 3)
        arts = self.backend.registry.artifacts()
        failed = Counter(
            f"{ev.after.failure.stage}:{ev.after.failure.cause}"
            for ev in self.backend.registry.history()
            if isinstance(ev, ArtifactChanged)
            and ev.event == "fail_distribution"
            and ev.after.failure is not None
        )
        fault_versions = {f.version for f in self.faults}
        clean_s = [s for v, s in self.activation_s.items() if v not in fault_versions]
        fault_s = [s for v, s in self.activation_s.items() if v in fault_versions]
        return {
            "schema": SCHEMA,
            "workers": self.cfg.workers,
            "seed": self.cfg.seed,
            "backend": "sqlite (default file)"
            if self.cfg.backend_url is None
            else redact_url(self.url),
            "ray_address": self.cfg.address or "local",
            "negative_control": self.cfg.negative_control,
            "deadline_s": self.cfg.deadline_s,
            "coordinator_processes": self.coordinator_procs,
            "worker_processes": self.worker_procs,
            "nodes": len(
                {p.split("/")[0] for p in [*self.worker_procs.values(), *self.coordinator_procs]}
            ),
            "versions": {
                "attempted": len(arts),
                "activated": sum(1 for a in arts if a.state in ("active", "superseded")),
                "failed_attempts_by_stage": dict(sorted(failed.items())),
            },
            "activations": sum(1 for a in arts if a.state in ("active", "superseded")),
            "faults": [attrs.asdict(f) for f in self.faults],
            "acks": dict(sorted(self.acks.items())),
            "rollouts": {f"v{v}": dict(sorted(c.items())) for v, c in sorted(per_version.items())},
            "rollouts_total": len(snap),
            "quarantined": sum(c["quarantined"] for c in per_version.values()),
            "time_to_activate_s": {
                "per_version": {f"v{v}": round(s, 3) for v, s in sorted(self.activation_s.items())},
                "clean": {"p50": _p50(clean_s), "max": _max(clean_s)},
                "faults": {"p50": _p50(fault_s), "max": _max(fault_s)},
                "per_fault": {f.kind: f.seconds_to_activate for f in self.faults},
            },
            "spec": {
                "events": result.trace.events,
                "steps": result.trace.steps,
                "invariants": len(result.checked),
                "violations": len(violations),
                "first_violations": [str(v) for v in violations[:50]],
                "by_invariant": dict(violated_names(violations)),
            },
            "wall_s": round(wall, 1),
        }

    def close(self) -> None:
        self.backend.close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


def run_drill(cfg: DrillConfig, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the drill end to end; the result document (see docs/activation-drill.md)."""
    cfg.check()
    cfg.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with _ray_session(cfg.address, cfg.out / "ray-notices.log") as ray:
        drill = ActivationDrill(cfg, ray, say)
        try:
            doc = drill.run()
        finally:
            drill.close()
    # wall_s is the drill itself; total_s adds ray.init, the model build and the shutdown
    doc["total_s"] = round(time.perf_counter() - started, 1)
    return doc
