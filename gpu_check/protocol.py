"""The real run's use of the protocol: every ledger, registry and coordinator call in one place.

A run is a small deployment: one SQLite file holds the ledger and the registry
(`open_backend("sqlite:///...")`), one artifact store holds the policy versions, one
coordinator with one required worker (the generation side) flips the pointer, and the
project's admission gate decides what an update may reserve. Nothing here knows verl: the
experiment hands in hashes, files, token ids and log-probs.

Kept in one module on purpose, so a change of the model's API (who numbers acks, where the
required worker set lives) is adapted here and nowhere else.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from rollout_lifecycle.gpu_check.errors import TechnicalFailure
from rollout_lifecycle.model.artifacts import WEIGHTS_NAME, ArtifactStore, WorkerLoader
from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.coordinator import AckResult, ActivationCoordinator, ActivationResult
from rollout_lifecycle.model.errors import RolloutLifecycleError
from rollout_lifecycle.model.events import TraceEvent
from rollout_lifecycle.model.gate import (
    ROUTE_OFFLINE,
    ROUTE_QUARANTINE,
    AdmissionDecision,
    AdmissionDecisions,
    AdmissionGate,
    GatePolicy,
)
from rollout_lifecycle.model.ledger import ReserveRequest
from rollout_lifecycle.model.records import (
    ActionEvidence,
    ActivePointer,
    AdmissionPolicy,
    BehaviorPolicy,
    Disposition,
    GenerationConditions,
    LedgerEntry,
    Reward,
    Rollout,
    RolloutIdentity,
    WorkerAck,
)
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.spec.invariants import Violation, check_reservation

WORKER_ID = "generation-0"


@attrs.frozen
class Published:
    """A policy version written, verified on disk, committed and being distributed."""

    version: int
    artifact_hash: str
    path: str
    weights_sha256: str  # sha256 of the artifact's model.safetensors file

    def to_json(self) -> dict[str, Any]:
        """For the evidence's `protocol.artifacts`."""
        return attrs.asdict(self)


@attrs.frozen
class Reservation:
    """What one update reserved, and the per-call outcome invariants of its calls."""

    update_id: str
    reserved: tuple[str, ...]
    refused: dict[str, str]
    retry_reasons: dict[str, str]
    outcome_violations: tuple[Violation, ...]


@attrs.frozen
class FrozenRollout:
    """One rollout as the generation side produced it (token ids, mask, behaviour log-probs)."""

    rollout_id: str
    prompt_id: str
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]  # valid tokens only, EOS included when sampled
    behavior_log_probs: tuple[float, ...]
    served_version: int | None  # the version the generation side stamped (min_global_steps)
    text: str
    reward: float


class RunProtocol:
    """The ledger, registry, artifact store, coordinator and gate of one candidate group."""

    def __init__(
        self,
        db_path: Path,
        artifact_root: Path,
        policy: GatePolicy,
        *,
        dataset: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        path = Path(db_path).resolve()
        self.url = f"sqlite:///{path}"
        self.backend = open_backend(self.url, clock=clock)
        self.store = ArtifactStore(artifact_root)
        recorded = AdmissionPolicy(policy.max_lag, policy.max_drift)
        # this group's own deployment: its operator records the policy the gate uses
        set_admission_policy(self.backend.registry, recorded, "gpu-check group", at=clock())
        self.coordinator = ActivationCoordinator(
            self.backend.registry,
            [WORKER_ID],
            ledger=self.backend.ledger,
            clock=clock,
            policy=recorded,
        )
        self.policy = policy
        self.gate = AdmissionGate(policy, registry=self.coordinator.activated_hash)
        self.dataset = dataset

    @property
    def ledger(self) -> Any:
        """The group's ledger (SQLite)."""
        return self.backend.ledger

    # ---- activation --------------------------------------------------------------------

    def publish(self, version: int, files: Mapping[str, bytes], parent: int | None) -> Published:
        """Register, write (atomically, immutably), verify, commit and start distributing."""
        self.coordinator.prepare(version, parent_version=parent)
        try:
            stored = self.store.write(version, files=dict(files), label=f"policy-v{version}")
            self.store.verify(version, stored.artifact_hash)
        except RolloutLifecycleError as exc:
            self.coordinator.fail_commit(version, "artifact_write_failed", str(exc))
            raise TechnicalFailure("artifact", str(exc)) from None
        self.coordinator.commit_artifact(version, stored.artifact_hash, str(stored.path))
        self.coordinator.distribute(version)
        manifest = self.store.read_manifest(version)
        weights = next(f.sha256 for f in manifest.files if f.name == WEIGHTS_NAME)
        return Published(version, stored.artifact_hash, str(stored.path), weights)

    def read_back(self, version: int) -> tuple[dict[str, Any], dict[str, bytes]]:
        """The committed artifact as a worker loader reads it: (tensors, other files)."""
        rec = self.coordinator.artifact(version)
        if rec.artifact_hash is None:
            raise TechnicalFailure("artifact", f"v{version} has no committed hash")
        loaded, _ack = WorkerLoader(self.store, "gpu-check-verifier").load(
            version, rec.artifact_hash, attempt=rec.attempts
        )
        return dict(loaded.tensors), dict(loaded.files)

    def registered_hash(self, version: int) -> str:
        """The hash the registry holds for `version` (what a lying ack would echo)."""
        h = self.coordinator.artifact(version).artifact_hash
        if h is None:
            raise TechnicalFailure("artifact", f"v{version} is not committed")
        return h

    def ack(self, version: int, artifact_hash: str) -> AckResult:
        """Record the generation side's report of what it loaded for the current attempt."""
        rec = self.coordinator.artifact(version)
        # the worker says what it loaded and echoes the token of the distribution attempt it
        # answered (sent with the weights); the coordinator numbers the report. Outside an
        # attempt it is a plain report of what the worker holds, with no token to echo.
        token = (
            self.coordinator.attempt_token(WORKER_ID, version)
            if rec.state == "awaiting_acks"
            else None
        )
        ack = WorkerAck(WORKER_ID, version, artifact_hash, attempt=rec.attempts, token=token)
        return self.coordinator.record_ack(ack)

    def activate(self, version: int) -> ActivationResult:
        """Flip the pointer if every required worker acked; otherwise record the failure."""
        res = self.coordinator.try_activate(version)
        if not res.activated:
            self.coordinator.fail_distribution(
                version,
                res.reason,
                f"missing {list(res.missing_workers)}, mismatched {list(res.mismatched_workers)}",
            )
        return res

    def pointer(self) -> ActivePointer | None:
        """The active pointer now."""
        return self.coordinator.pointer()

    # ---- rollouts ----------------------------------------------------------------------

    def dispatch(self, rollout_ids: Sequence[str]) -> ActivePointer:
        """Stamp new rollouts with the version active now, before anything is generated."""
        pointer = self.pointer()
        if pointer is None:
            raise TechnicalFailure("dispatch", "no version is active; activate v0 first")
        for rid in rollout_ids:
            self.ledger.add(LedgerEntry(rid, pointer.version, pointer.artifact_hash))
        return pointer

    def generated(
        self, rollouts: Sequence[FrozenRollout], reward_fn: str, reward_version: str
    ) -> None:
        """Generation and reward done: generation_done, then reward_ready with its value.

        A rollout whose tokens were served by another version than it was stamped with at
        dispatch is quarantined (its stamp would lie about the policy that produced it).
        """
        for ro in rollouts:
            e = self.ledger.get(ro.rollout_id)
            if ro.served_version != e.behavior_version:
                self.ledger.transition(
                    ro.rollout_id,
                    "quarantine",
                    e.revision,
                    disposition=Disposition(
                        "admission",
                        "version_mismatch",
                        f"stamped v{e.behavior_version}, served by v{ro.served_version}",
                    ),
                )
                continue
            e = self.ledger.transition(ro.rollout_id, "generation_done", e.revision)
            self.ledger.transition(
                ro.rollout_id,
                "reward_ready",
                e.revision,
                reward=Reward(reward_fn, reward_version, ro.reward),
            )

    def records(
        self, rollouts: Sequence[FrozenRollout], conditions: GenerationConditions
    ) -> list[Rollout]:
        """The gate's view of each rollout, with its ledger entry as it is now."""
        out = []
        for i, ro in enumerate(rollouts):
            e = self.ledger.get(ro.rollout_id)
            out.append(
                Rollout(
                    identity=RolloutIdentity(ro.rollout_id, ro.prompt_id, self.dataset, i),
                    behavior=BehaviorPolicy(e.behavior_version, e.artifact_hash),
                    conditions=conditions,
                    evidence=ActionEvidence(
                        ro.response_ids, [True] * len(ro.response_ids), ro.behavior_log_probs
                    ),
                    status=e,
                )
            )
        return out

    def admit(
        self,
        rollouts: Sequence[FrozenRollout],
        conditions: GenerationConditions,
        current_log_probs: Any,
    ) -> AdmissionDecisions:
        """The project's gate against the version active now (B x T current log-probs)."""
        pointer = self.pointer()
        if pointer is None:
            raise TechnicalFailure("admission", "no version is active")
        recs = self.records(rollouts, conditions)
        return self.gate.assess_batch(
            recs, current_log_probs, pointer.version, [r.status for r in recs]
        )

    def route_rejected(self, decisions: Sequence[AdmissionDecision]) -> dict[str, str]:
        """Stale rollouts retire to the offline buffer, contradictions are quarantined."""
        done = {}
        for d in decisions:
            if d.accepted or d.route not in (ROUTE_OFFLINE, ROUTE_QUARANTINE):
                continue
            e = self.ledger.get(d.rollout_id)
            event = "retire_stale" if d.route == ROUTE_OFFLINE else "quarantine"
            stage = "admission"
            self.ledger.transition(
                d.rollout_id, event, e.revision, disposition=Disposition(stage, d.reason)
            )
            done[d.rollout_id] = event
        return done

    def reserve(self, update_id: str, decisions: Sequence[AdmissionDecision]) -> Reservation:
        """Compare-and-set the admitted rollouts for `update_id`, then retry once (idempotent).

        Each call's outcome is judged by the spec's per-call invariants (a failed CAS
        changes nothing, the owner's retry writes nothing).
        """
        admitted = [d for d in decisions if d.accepted]
        before = {d.rollout_id: self.ledger.get(d.rollout_id) for d in admitted}
        requests = [
            ReserveRequest(d.rollout_id, before[d.rollout_id].revision, d.stamp()) for d in admitted
        ]
        outcomes = self.ledger.reserve_batch(update_id, requests) if requests else []
        mid = {d.rollout_id: self.ledger.get(d.rollout_id) for d in admitted}
        retry = self.ledger.reserve_batch(update_id, requests) if requests else []
        violations: list[Violation] = []
        for o in outcomes:
            violations += check_reservation(
                before[o.rollout_id], update_id, o.reserved, o.reason, mid[o.rollout_id]
            )
        for o in retry:
            after = self.ledger.get(o.rollout_id)
            violations += check_reservation(
                mid[o.rollout_id], update_id, o.reserved, o.reason, after
            )
        return Reservation(
            update_id=update_id,
            reserved=tuple(o.rollout_id for o in outcomes if o.reserved),
            refused={o.rollout_id: o.reason for o in outcomes if not o.reserved},
            retry_reasons={o.rollout_id: o.reason for o in retry},
            outcome_violations=tuple(violations),
        )

    def commit(self, update_id: str, rollout_ids: Sequence[str]) -> None:
        """The update succeeded: consume exactly what it reserved."""
        self.ledger.commit(update_id, list(rollout_ids))

    def fail_update(self, update_id: str, cause: str, detail: str) -> None:
        """The update failed with this data: its rollouts end in update_failed (stage update)."""
        self.ledger.fail_update(update_id, cause, detail)

    # ---- reading -----------------------------------------------------------------------

    def states(self) -> dict[str, str]:
        """Lifecycle state of every rollout."""
        return {rid: e.state for rid, e in sorted(self.ledger.snapshot().items())}

    def trace(self) -> list[TraceEvent]:
        """Ledger and registry events in their one global order."""
        return self.backend.trace()

    def close(self) -> None:
        """Release the SQLite connections."""
        self.backend.close()
