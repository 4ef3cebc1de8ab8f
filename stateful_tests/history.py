"""Recording every call a process makes, for the linearizability check (issue 33).

Each call is one JSON object: the process, its sequence number there, the operation, its
arguments, its invocation and return times, and its outcome (a result, or an error's
type). Times come from `time.monotonic()`: CLOCK_MONOTONIC, one clock for the whole host
on Linux, so the calls of every process of a race share one time line. The schema is
docs/design.md's "A call history" (cli/schemas/call-history.schema.json); any checker can
read it. `spec/linearizability.py` is ours.

    log = CallLog("learner-0")
    ledger = RecordingLedger(backend.ledger, log)
    coord = RecordingCoordinator(ActivationCoordinator(backend.registry, ledger=ledger), log)
    ...
    write_history(path, [log], header=history_header())

The wrappers change nothing of what they wrap: every call goes through, its answer or its
exception comes back unchanged; they only write down what was asked and answered.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

from rollout_lifecycle.model.coordinator import (
    CURRENT_POINTER,
    AckResult,
    ActivationCoordinator,
    ActivationResult,
    Settled,
)
from rollout_lifecycle.model.errors import RolloutLifecycleError
from rollout_lifecycle.model.ledger import Ledger, LedgerStatistics, ReserveOutcome, ReserveRequest
from rollout_lifecycle.model.pacing import DispatchOutcome, identity_chain
from rollout_lifecycle.model.records import (
    ActivePointer,
    AdmissionPolicy,
    ArtifactRecord,
    LedgerEntry,
    Rollout,
    WorkerAck,
    to_jsonable,
)
from rollout_lifecycle.model.registry import RegistryStore, set_admission_policy

SCHEMA = "rollout-lifecycle/call-history/1"
T = TypeVar("T")
now = time.monotonic  # CLOCK_MONOTONIC: system-wide on Linux, shared by every process


def history_header(**extra: Any) -> dict[str, Any]:
    """The header line: the schema, the clock, and what the model needs to know (the
    recovery rule's max_releases, whether the ledger shares a registry)."""
    return {
        "schema": SCHEMA,
        "clock": "CLOCK_MONOTONIC",
        "max_releases": 3,
        "registry": True,
        **extra,
    }


def entry_json(e: LedgerEntry | None) -> dict[str, Any] | None:
    """A ledger entry as a history records it: id, state, revision, owner, version (and
    its lease, chain and attempt where it has them)."""
    if e is None:
        return None
    out: dict[str, Any] = {
        "id": e.rollout_id,
        "state": e.state,
        "rev": e.revision,
        "by": e.reserved_by,
        "v": e.behavior_version,
    }
    if e.lease_expires_at is not None:
        out["lease"] = e.lease_expires_at
    if e.chain is not None:
        out["chain"], out["attempt"] = e.chain, e.attempt
    return out


def new_entry_json(r: Rollout | LedgerEntry) -> dict[str, Any]:
    """What an add or a dispatch asks to create: id, state, version, artifact hash."""
    e = r.entry() if isinstance(r, Rollout) else r
    return {"id": e.rollout_id, "state": e.state, "v": e.behavior_version, "hash": e.artifact_hash}


def outcome_json(o: ReserveOutcome) -> dict[str, Any]:
    """A reservation's answer."""
    return {
        "id": o.rollout_id,
        "reserved": o.reserved,
        "reason": o.reason,
        "entry": entry_json(o.entry),
    }


def entries_json(es: Iterable[LedgerEntry]) -> list[dict[str, Any] | None]:
    """A list of entries."""
    return [entry_json(e) for e in es]


def pointer_json(p: ActivePointer | None) -> list[Any] | None:
    """The active pointer as [version, hash]."""
    return None if p is None else [p.version, p.artifact_hash]


def policy_json(p: AdmissionPolicy | None) -> dict[str, Any] | None:
    """An admission policy."""
    if p is None:
        return None
    return {
        "max_lag": p.max_lag,
        "max_drift": p.max_drift,
        "batch_size": p.batch_size,
        "max_attempts": p.max_attempts,
    }


def artifact_json(a: ArtifactRecord) -> dict[str, Any]:
    """An artifact record: version, state, hash, attempts."""
    return {"v": a.version, "state": a.state, "hash": a.artifact_hash, "attempts": a.attempts}


def error_json(exc: BaseException) -> dict[str, Any]:
    """An error as a history records it: its type, the project's classes it is an
    instance of (a subclass still answers for its base), the message, and the revision a
    RevisionConflict found."""
    types = [
        k.__name__
        for k in type(exc).__mro__
        if issubclass(k, RolloutLifecycleError) and k is not RolloutLifecycleError
    ]
    out: dict[str, Any] = {"type": type(exc).__name__, "types": types, "message": str(exc)[:300]}
    actual = getattr(exc, "actual", None)
    if isinstance(actual, int):
        out["actual"] = actual
    return out


class CallLog:
    """One process's calls, in the order it made them."""

    def __init__(self, proc: str) -> None:
        self.proc = proc
        self.calls: list[dict[str, Any]] = []

    def call(
        self,
        op: str,
        args: Mapping[str, Any],
        fn: Callable[[], T],
        encode: Callable[[T], Any] = lambda r: r,
    ) -> T:
        """Make the call `fn()` and record it (its exception too, raised again)."""
        inv = now()
        try:
            got = fn()
        except Exception as exc:
            ret = now()
            self.calls.append(self._line(op, args, inv, ret, error=error_json(exc)))
            raise
        ret = now()
        self.calls.append(self._line(op, args, inv, ret, result=encode(got)))
        return got

    def _line(
        self, op: str, args: Mapping[str, Any], inv: float, ret: float, **out: Any
    ) -> dict[str, Any]:
        return {
            "proc": self.proc,
            "seq": len(self.calls),
            "op": op,
            "args": dict(args),
            "inv": inv,
            "ret": ret,
            **out,
        }


def _request_json(r: ReserveRequest) -> dict[str, Any]:
    return {"id": r.rollout_id, "rev": r.expected_revision, "stamp": to_jsonable(r.admission)}


class RecordingLedger:
    """A ledger whose every call is recorded in `log` (anything else passes through)."""

    def __init__(self, ledger: Ledger, log: CallLog) -> None:
        self._ledger, self._log = ledger, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ledger, name)

    def add(self, rollout: Rollout | LedgerEntry) -> LedgerEntry:
        return self._log.call(
            "add",
            {"entries": [new_entry_json(rollout)]},
            lambda: self._ledger.add(rollout),
            lambda e: [entry_json(e)],
        )

    def add_many(self, rollouts: Sequence[Rollout | LedgerEntry]) -> list[LedgerEntry]:
        return self._log.call(
            "add_many",
            {"entries": [new_entry_json(r) for r in rollouts]},
            lambda: cast(Any, self._ledger).add_many(rollouts),
            entries_json,
        )

    def get(self, rollout_id: str) -> LedgerEntry:
        return self._log.call(
            "get", {"id": rollout_id}, lambda: self._ledger.get(rollout_id), entry_json
        )

    def find(self, rollout_id: str) -> LedgerEntry | None:
        return self._log.call(
            "find", {"id": rollout_id}, lambda: self._ledger.find(rollout_id), entry_json
        )

    def transition(
        self, rollout_id: str, event: str, expected_revision: int, **kw: Any
    ) -> LedgerEntry:
        return self._log.call(
            "transition",
            {"id": rollout_id, "event": event, "rev": expected_revision},
            lambda: self._ledger.transition(rollout_id, event, expected_revision, **kw),
            entry_json,
        )

    def reserve(
        self, rollout_id: str, expected_revision: int, update_id: str, admission: Any
    ) -> ReserveOutcome:
        return self._log.call(
            "reserve",
            {
                "id": rollout_id,
                "rev": expected_revision,
                "update": update_id,
                "stamp": to_jsonable(admission),
            },
            lambda: self._ledger.reserve(rollout_id, expected_revision, update_id, admission),
            outcome_json,
        )

    def reserve_batch(
        self, update_id: str, requests: Sequence[ReserveRequest]
    ) -> list[ReserveOutcome]:
        return self._log.call(
            "reserve_batch",
            {"update": update_id, "requests": [_request_json(r) for r in requests]},
            lambda: self._ledger.reserve_batch(update_id, requests),
            lambda outs: [outcome_json(o) for o in outs],
        )

    def commit(self, update_id: str, rollout_ids: Sequence[str]) -> list[LedgerEntry]:
        return self._log.call(
            "commit",
            {"update": update_id, "ids": list(rollout_ids)},
            lambda: self._ledger.commit(update_id, rollout_ids),
            entries_json,
        )

    def _of_update(
        self, op: str, update_id: str, fn: Callable[[], list[LedgerEntry]]
    ) -> list[LedgerEntry]:
        return self._log.call(op, {"update": update_id}, fn, entries_json)

    def abort(self, update_id: str) -> list[LedgerEntry]:
        return self._of_update("abort", update_id, lambda: self._ledger.abort(update_id))

    def fail_update(self, update_id: str, cause: str, detail: str = "") -> list[LedgerEntry]:
        return self._of_update(
            "fail_update", update_id, lambda: self._ledger.fail_update(update_id, cause, detail)
        )

    def renew_leases(self, update_id: str) -> list[LedgerEntry]:
        return self._of_update(
            "renew_leases", update_id, lambda: self._ledger.renew_leases(update_id)
        )

    def reserved_by(self, update_id: str) -> list[str]:
        return self._log.call(
            "reserved_by", {"update": update_id}, lambda: self._ledger.reserved_by(update_id), list
        )

    def expire_leases(self) -> list[LedgerEntry]:
        return self._log.call("expire_leases", {}, self._ledger.expire_leases, entries_json)

    def quarantine_version(self, version: int, reason: str) -> list[LedgerEntry]:
        return self._log.call(
            "quarantine_version",
            {"v": version},
            lambda: self._ledger.quarantine_version(version, reason),
            entries_json,
        )

    def clear_bad_version(self, version: int) -> None:
        self._log.call(
            "clear_bad_version", {"v": version}, lambda: self._ledger.clear_bad_version(version)
        )

    def dispatch(
        self, rollout: Rollout | LedgerEntry, *, chain: str | None = None
    ) -> DispatchOutcome:
        def encode(o: DispatchOutcome) -> dict[str, Any]:
            return {
                "id": o.rollout_id,
                "dispatched": o.dispatched,
                "reason": o.reason,
                "attempt": o.attempt,
                "entry": entry_json(o.entry),
            }

        return self._log.call(
            "dispatch",
            # the chain the deployment keys the attempt by: the caller's, else the one the
            # documented rule derives from the rollout's identity (model.pacing)
            {"entry": new_entry_json(rollout), "chain": _asked_chain(rollout, chain)},
            lambda: self._ledger.dispatch(rollout, chain=chain),
            encode,
        )

    def retire_stale(self) -> list[LedgerEntry]:
        return self._log.call("retire_stale", {}, self._ledger.retire_stale, entries_json)

    def oldest_admissible(self, limit: int) -> list[LedgerEntry]:
        return self._log.call(
            "oldest_admissible",
            {"limit": limit},
            lambda: self._ledger.oldest_admissible(limit),
            entries_json,
        )

    def statistics(self) -> LedgerStatistics:
        return self._log.call(
            "statistics", {}, self._ledger.statistics, lambda s: {"by_state": dict(s.by_state)}
        )


class RecordingRegistry:
    """A registry whose reads are recorded (its steps are the coordinator's, recorded there)."""

    def __init__(self, registry: RegistryStore, log: CallLog) -> None:
        self._registry, self._log = registry, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._registry, name)

    def pointer(self) -> ActivePointer | None:
        return self._log.call("pointer", {}, self._registry.pointer, pointer_json)

    def policy(self) -> AdmissionPolicy | None:
        return self._log.call("policy", {}, self._registry.policy, policy_json)

    def max_version(self) -> int | None:
        return self._log.call("max_version", {}, self._registry.max_version)

    def required_workers(self) -> tuple[str, ...] | None:
        return self._log.call(
            "required_workers",
            {},
            self._registry.required_workers,
            lambda w: None if w is None else list(w),
        )


def operator_sets_policy(
    log: CallLog, registry: Any, policy: AdmissionPolicy, reason: str
) -> AdmissionPolicy:
    """The operator records the deployment's policy (`set_admission_policy`), as one
    recorded 'set_policy' call."""
    return log.call(
        "set_policy",
        {"policy": policy_json(policy)},
        lambda: set_admission_policy(registry, policy, reason),
        policy_json,
    )


def attach(
    log: CallLog,
    registry: Any,
    required_workers: Sequence[str] | None = None,
    **kwargs: Any,
) -> RecordingCoordinator:
    """`ActivationCoordinator(registry, required_workers, **kwargs)`, its attaching steps
    recorded as one 'attach' call, and every later call through the returned recorder."""
    policy = kwargs.get("policy")
    coord = log.call(
        "attach",
        {
            "workers": None if required_workers is None else list(required_workers),
            "policy": policy_json(policy),
        },
        lambda: ActivationCoordinator(registry, required_workers, **kwargs),
        lambda _c: None,
    )
    return RecordingCoordinator(coord, log)


class RecordingCoordinator:
    """An activation coordinator whose every call is recorded (reads included)."""

    def __init__(self, coord: ActivationCoordinator, log: CallLog) -> None:
        self._coord, self._log = coord, log
        self.registry = RecordingRegistry(coord.registry, log)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._coord, name)

    def prepare(
        self,
        version: int,
        parent_version: int | None = None,
        rollback_version: Any = CURRENT_POINTER,
        *,
        trained_by: Iterable[str] = (),
    ) -> ArtifactRecord:
        lineage = list(trained_by)
        doc: dict[str, Any] = {
            "v": version,
            "parent": parent_version,
            "rollback": "current" if rollback_version is CURRENT_POINTER else rollback_version,
            "trained_by": lineage,
        }
        return self._log.call(
            "prepare",
            doc,
            lambda: self._coord.prepare(
                version, parent_version, rollback_version, trained_by=lineage
            ),
            artifact_json,
        )

    def commit_artifact(
        self, version: int, artifact_hash: str, path: str | None = None
    ) -> ArtifactRecord:
        return self._log.call(
            "commit_artifact",
            {"v": version, "hash": artifact_hash},
            lambda: self._coord.commit_artifact(version, artifact_hash, path),
            artifact_json,
        )

    def settle(self) -> Settled:
        """`settle`, recorded with what it activated (version, hash) and failed."""

        def encode(s: Settled) -> dict[str, Any]:
            hashes = {v: self._coord.artifact(v).artifact_hash for v in s.activated}
            return {"activated": [[v, h] for v, h in hashes.items()], "failed": list(s.failed)}

        return self._log.call("settle", {}, self._coord.settle, encode)

    def _settle_first(self, version: int | None = None) -> None:
        """What distribute, retry, rollback and try_activate of another version do first
        (the coordinator's own settle), as a recorded call of its own, so the history says
        what it resolved; the call's own settle then finds nothing left (one activator)."""
        if any(
            a.state == "awaiting_acks" and a.version != version
            for a in self._coord.registry.artifacts()
        ):
            self.settle()

    def distribute(self, version: int) -> ArtifactRecord:
        self._settle_first(version)
        return self._log.call(
            "distribute", {"v": version}, lambda: self._coord.distribute(version), artifact_json
        )

    def retry(self, version: int) -> ArtifactRecord:
        self._settle_first(version)
        return self._log.call(
            "retry", {"v": version}, lambda: self._coord.retry(version), artifact_json
        )

    def fail_distribution(self, version: int, cause: str, detail: str = "") -> ArtifactRecord:
        return self._log.call(
            "fail_distribution",
            {"v": version},
            lambda: self._coord.fail_distribution(version, cause, detail),
            artifact_json,
        )

    def abandon(self, version: int, cause: str, detail: str = "") -> ArtifactRecord:
        return self._log.call(
            "abandon",
            {"v": version},
            lambda: self._coord.abandon(version, cause, detail),
            artifact_json,
        )

    def attempt_tokens(self, version: int) -> dict[str, str]:
        return self._log.call(
            "attempt_tokens", {"v": version}, lambda: self._coord.attempt_tokens(version), dict
        )

    def record_ack(self, ack: WorkerAck) -> AckResult:
        doc = {
            "worker": ack.worker_id,
            "v": ack.version,
            "hash": ack.artifact_hash,
            "token": ack.token,
            "incarnation": ack.incarnation,
            "seq": ack.seq,
        }
        return self._log.call(
            "record_ack",
            doc,
            lambda: self._coord.record_ack(ack),
            lambda r: {"counted": r.counted, "reason": r.reason, "recorded": r.recorded},
        )

    def try_activate(self, version: int) -> ActivationResult:
        def encode(r: ActivationResult) -> dict[str, Any]:
            return {
                "activated": r.activated,
                "reason": r.reason,
                "pointer": pointer_json(r.active_pointer),
                "missing": list(r.missing_workers),
                "mismatched": list(r.mismatched_workers),
            }

        self._settle_first(version)
        return self._log.call(
            "try_activate", {"v": version}, lambda: self._coord.try_activate(version), encode
        )

    def rollback(
        self, *, keep_rollouts: bool = False, reason: str = "operator rollback"
    ) -> ActivePointer:
        self._settle_first()
        return self._log.call(
            "rollback",
            {"keep": keep_rollouts},
            lambda: self._coord.rollback(keep_rollouts=keep_rollouts, reason=reason),
            pointer_json,
        )

    def change_membership(self, workers: Iterable[str], reason: str) -> tuple[str, ...]:
        ws = list(workers)
        return self._log.call(
            "change_membership",
            {"workers": ws},
            lambda: self._coord.change_membership(ws, reason),
            list,
        )

    def set_policy(self, policy: AdmissionPolicy, reason: str) -> AdmissionPolicy:
        """The operator's step, taken by this process (coordinators never write the policy:
        `set_admission_policy` on the coordinator's registry), recorded as 'set_policy'."""
        return operator_sets_policy(self._log, self._coord.registry, policy, reason)

    def policy(self) -> AdmissionPolicy | None:
        return self._log.call("policy", {}, self._coord.policy, policy_json)

    def pointer(self) -> ActivePointer | None:
        return self._log.call("pointer", {}, self._coord.pointer, pointer_json)

    @property
    def required_workers(self) -> tuple[str, ...]:
        return self._log.call("required_workers", {}, lambda: self._coord.required_workers, list)


def write_history(
    path: Path, calls: Iterable[Mapping[str, Any]], header: Mapping[str, Any] | None = None
) -> int:
    """Write a history file: the header line, then every call by invocation time (a line
    per call, JSON). Returns how many calls it wrote."""
    ordered = sorted(calls, key=lambda c: (c["inv"], c["proc"], c["seq"]))
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(dict(header or history_header())) + "\n")
        for c in ordered:
            f.write(json.dumps(c, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
    return len(ordered)


def _asked_chain(rollout: Rollout | LedgerEntry, chain: str | None) -> str | None:
    """The chain a dispatch is judged on: the caller's key, else its identity's."""
    if chain is not None or not isinstance(rollout, Rollout):
        return chain
    return identity_chain(rollout.identity)
