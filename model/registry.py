"""The durable state of policy activation: artifact records, worker reports, the active pointer.

A coordinator step is planned and written inside ONE registry transaction (`transact`): the
plan reads the state under the write lock (a Python lock in memory, ``BEGIN IMMEDIATE`` in
SQLite), returns the changed records, pointer and worker reports, and the registry writes
them together with their `ArtifactChanged` events. Because the plan runs under the lock, two
coordinators on one SQLite file can never both act on the same stale read. The shared checks
in `check_step` (hash immutability, versions never reused, before-images match) run in both
backends, so a buggy plan is refused instead of written.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import attrs

from rollout_lifecycle.model import rules
from rollout_lifecycle.model.api import activate_policy_version
from rollout_lifecycle.model.clocks import sqlite_host_clock
from rollout_lifecycle.model.errors import ActivationError, StorageFull, brief
from rollout_lifecycle.model.events import (
    ArtifactChanged,
    EntryChanged,
    EventLog,
    MembershipChanged,
    PolicyChanged,
    RowRecorded,
    TraceEvent,
    WorkerReported,
)
from rollout_lifecycle.model.ledger import ActivationPremise, update_from_row
from rollout_lifecycle.model.lineage_index import (
    CLAIMS_TRIGGER,
    MARK_INDEX,
    UNCLAIMED_SQLITE,
    claims_sql,
    ensure_sqlite,
)
from rollout_lifecycle.model.machines import ACTIVATION
from rollout_lifecycle.model.records import (
    INT64_MAX,
    ActivePointer,
    AdmissionPolicy,
    ArtifactRecord,
    AttemptToken,
    Disposition,
    UpdateRecord,
    WorkerAck,
    from_jsonable,
    text_problem,
    to_jsonable,
)
from rollout_lifecycle.model.rules import WAS_ACTIVE_STATES, retired_versions
from rollout_lifecycle.model.sqlite_common import (
    append_events,
    connect,
    ensure_schema,
    has_component,
    read_events,
    sqlite_url,
    write_failed,
)
from rollout_lifecycle.model.sqlite_files import FileGuard, hand_back, read_file_id

R = TypeVar("R")

COMPONENT = "registry"
# 2: the durable required worker set (registry_membership); worker reports in the trace
# 3: the durable admission policy (registry_policy)
# 4: the policy's pacing bounds (batch_size, max_attempts)
# 5: the file's events are numbered without AUTOINCREMENT (sqlite_common.NEXT_COLUMNS): a
#    registry this version creates could not be appended to by an older program
# 6: the policy's lineage mode and attempt-chain key (issue 31)
# 7: an attempt's ack deadline (registry_artifacts.ack_deadline) and spent attempt tokens
#    (registry_attempt_tokens.spent) (issue 31)
SCHEMA_VERSION = 7
# 1 -> 2 only adds a table, which the DDL creates if missing; 2 -> 3 adds tables and the
# artifacts' lineage column
MIGRATIONS = {
    1: "",
    2: "ALTER TABLE registry_artifacts ADD COLUMN trained_by TEXT",
    3: "ALTER TABLE registry_policy ADD COLUMN batch_size INTEGER ;"
    "ALTER TABLE registry_policy ADD COLUMN max_attempts INTEGER ",
    4: "",
    5: "ALTER TABLE registry_policy ADD COLUMN lineage TEXT NOT NULL DEFAULT 'ledger' ;"
    "ALTER TABLE registry_policy ADD COLUMN chain_key TEXT NOT NULL DEFAULT 'identity' ",
    # a token some stored ack already echoed counted once: spent, as the history says
    6: "ALTER TABLE registry_artifacts ADD COLUMN ack_deadline REAL ;"
    "ALTER TABLE registry_attempt_tokens ADD COLUMN spent INTEGER NOT NULL DEFAULT 0 "
    "CHECK (spent IN (0, 1)) ;"
    "UPDATE registry_attempt_tokens SET spent = 1 WHERE EXISTS (SELECT 1 FROM events "
    "WHERE kind = 'worker' AND subject = registry_attempt_tokens.worker_id "
    "AND json_extract(payload, '$.ack.version') = registry_attempt_tokens.version "
    "AND json_extract(payload, '$.ack.token') = registry_attempt_tokens.token)",
}


@attrs.frozen
class WorkerReport:
    """A worker's latest counted ack, and the lowest incarnation whose acks still count.

    `floor` rises when the worker restarts: it lost its weights, so every ack from an
    earlier incarnation, including one still in flight, is void.
    """

    worker_id: str
    floor: int = 0
    ack: WorkerAck | None = None


@attrs.frozen
class ArtifactChange:
    """One artifact record written by a step, with the machine event that justifies it."""

    event: str
    before: ArtifactRecord | None
    after: ArtifactRecord
    acks: tuple[WorkerAck, ...] = ()
    required_workers: tuple[str, ...] = ()


class _Unchanged:
    """Marker type: the step leaves the pointer alone."""


UNCHANGED = _Unchanged()


@attrs.frozen
class RegistryStep:
    """Everything one coordinator step writes, atomically."""

    at: float
    artifacts: tuple[ArtifactChange, ...] = ()
    pointer: ActivePointer | _Unchanged | None = UNCHANGED
    workers: tuple[WorkerReport, ...] = ()
    membership: tuple[str, ...] | _Unchanged = UNCHANGED
    membership_reason: str = ""
    policy: AdmissionPolicy | _Unchanged = UNCHANGED
    policy_reason: str = ""
    # attempt tokens issued (each replaces the stored token of its version and worker), and
    # the workers whose every token is withdrawn (they left the worker set)
    tokens: tuple[AttemptToken, ...] = ()
    revoked: tuple[str, ...] = ()


@attrs.frozen
class ReadsWorkers(Generic[R]):
    """A plan that will read these workers' reports: a store may read them with the
    step's first read (PostgreSQL does, one round trip fewer); any other runs it as is."""

    plan: Callable[[RegistryView], tuple[RegistryStep, R]]
    workers: tuple[str, ...]

    def __call__(self, view: RegistryView) -> tuple[RegistryStep, R]:
        return self.plan(view)


class RegistryView(Protocol):
    """Read access inside a transaction (what a plan may look at)."""

    def artifact(self, version: int) -> ArtifactRecord | None: ...

    def artifacts(self) -> list[ArtifactRecord]: ...

    def pointer(self) -> ActivePointer | None: ...

    def worker(self, worker_id: str) -> WorkerReport | None: ...

    def workers(self) -> dict[str, WorkerReport]: ...

    def max_version(self) -> int | None: ...

    def required_workers(self) -> tuple[str, ...] | None: ...

    def policy(self) -> AdmissionPolicy | None: ...

    def updates(self, update_ids: Iterable[str]) -> dict[str, UpdateRecord]: ...

    def unclaimed_updates(self) -> list[str]: ...

    def claims(self, update_ids: Iterable[str]) -> dict[str, tuple[int, ...]]: ...

    def awaiting(self) -> list[ArtifactRecord]: ...

    def attempt_tokens(self, version: int | None = None) -> list[AttemptToken]: ...


@runtime_checkable
class RegistryStore(Protocol):
    """What the coordinator needs from a backend; every coordinator test runs on each one."""

    def transact(
        self, plan: Callable[[RegistryView], tuple[RegistryStep, R]]
    ) -> tuple[R, list[ArtifactChanged]]: ...

    def artifact(self, version: int) -> ArtifactRecord | None: ...

    def artifacts(self) -> list[ArtifactRecord]: ...

    def pointer(self) -> ActivePointer | None: ...

    def workers(self) -> dict[str, WorkerReport]: ...

    def max_version(self) -> int | None: ...

    def required_workers(self) -> tuple[str, ...] | None: ...

    def policy(self) -> AdmissionPolicy | None: ...

    def awaiting(self) -> list[ArtifactRecord]: ...

    def attempt_tokens(self, version: int | None = None) -> list[AttemptToken]: ...

    def history(self, version: int | None = None) -> list[ArtifactChanged]: ...

    def trace(self) -> list[TraceEvent]: ...

    def close(self) -> None: ...


def check_policy(policy: object) -> AdmissionPolicy:
    """An admission policy to record: an AdmissionPolicy (its fields are validated there)
    whose integers fit the signed 64-bit columns of every backend (PostgreSQL refuses a
    larger one, SQLite's driver overflows: refused here alike, before any write)."""
    if not isinstance(policy, AdmissionPolicy):
        raise ActivationError(
            f"an admission policy is an AdmissionPolicy(max_lag, max_drift), got {brief(policy)}"
        )
    for name in ("max_lag", "batch_size", "max_attempts"):
        value = getattr(policy, name)
        if value is not None and value > INT64_MAX:
            raise ActivationError(f"{name} must be at most 2**63 - 1, got {brief(value)}")
    return policy


def check_reason(reason: object, what: str = "reason") -> str:
    """Free text the registry stores (a reason, a path): non-empty, storable on every
    backend (no NUL: PostgreSQL text cannot hold one, and the JSON of an event would)."""
    problem = text_problem(reason, max_length=None)
    if problem is not None:
        raise ActivationError(f"{what} {problem}")
    assert isinstance(reason, str)
    return reason


def backend_url(store: object) -> str | None:
    """The backend URL an operator's `--backend` must name to reach `store`'s deployment
    (password masked), or None for a registry that has none (memory: one process)."""
    url = getattr(store, "backend_url", None)
    return url if isinstance(url, str) else None


def set_admission_policy(
    registry: RegistryStore, policy: AdmissionPolicy, reason: str, *, at: float | None = None
) -> AdmissionPolicy:
    """Record the deployment's admission policy: an explicit, recorded step of its own.

    Every reservation on a ledger that shares this registry is judged, inside its own
    atomic step, against the policy recorded at that moment; a learner's stamp may be
    stricter, never looser. Setting the same policy again writes nothing.
    """
    new = check_policy(policy)
    reason = check_reason(reason)
    clock = getattr(registry, "clock", time.time)
    now = clock() if at is None else at

    def plan(view: RegistryView) -> tuple[RegistryStep, AdmissionPolicy]:
        if view.policy() == new:
            return RegistryStep(now), new
        return RegistryStep(now, policy=new, policy_reason=reason), new

    return registry.transact(plan)[0]


def check_membership(workers: object) -> tuple[str, ...]:
    """A required worker set: a non-empty list of distinct, non-empty worker ids."""
    if isinstance(workers, str) or not isinstance(workers, Iterable):
        raise ActivationError(
            f"required workers must be a list of worker ids, got {brief(workers)} (a string would "
            "be split into letters)"
        )
    ws = tuple(workers)
    for w in ws:
        problem = text_problem(w)  # the records' one limit for ids, on every backend
        if problem is not None:
            raise ActivationError(f"worker id {problem}")
    if not ws:
        raise ActivationError(
            "at least one required worker is needed: with none, a checkpoint on disk alone "
            "would activate"
        )
    dups = sorted({w for w in ws if ws.count(w) > 1})
    if dups:
        raise ActivationError(f"required workers listed more than once: {dups}")
    return ws


def current_tokens(view: RegistryView, rec: ArtifactRecord) -> dict[str, AttemptToken]:
    """The token each worker was issued for `rec`'s current distribution attempt."""
    return {t.worker_id: t for t in view.attempt_tokens(rec.version) if t.attempt == rec.attempts}


def counted_acks(view: RegistryView, rec: ArtifactRecord) -> dict[str, WorkerAck]:
    """Each worker's latest stored report that can still speak for `rec`.

    A report of another version counts: it says the worker holds something else, so it can
    only block. A report of `rec`'s own version counts only if it echoes the token stored
    for that worker and `rec`'s current attempt: an ack of an earlier attempt, one without
    a token, or one from before the worker left and re-joined is missing, never a yes.
    """
    tokens = current_tokens(view, rec)
    out: dict[str, WorkerAck] = {}
    for w, r in view.workers().items():
        a = r.ack
        if a is None:
            continue
        t = tokens.get(w)
        if a.version != rec.version or (t is not None and a.token == t.token):
            out[w] = a
    return out


def required_set(view: RegistryView) -> tuple[str, ...]:
    """The durable required worker set an activation is judged against (never a caller's)."""
    required = view.required_workers()
    if not required:
        raise ActivationError(
            "the registry records no required workers; set them with "
            "ActivationCoordinator(registry, required_workers=[...]) first"
        )
    return required


def reconcile_membership(
    stored: tuple[str, ...] | None, wanted: tuple[str, ...] | None
) -> tuple[str, ...] | None:
    """The set a coordinator attaches with: the stored one; `wanted` only if none is stored.

    Returns the set to record as the initial membership (None: nothing to record). A
    coordinator asking for another set than the stored one is refused: it must call
    `change_membership` explicitly.
    """
    if stored is None:
        if wanted is None:
            raise ActivationError(
                "this registry records no required workers yet; pass required_workers=[...] "
                "to set them"
            )
        return wanted
    if wanted is not None and set(wanted) != set(stored):
        raise ActivationError(
            f"the registry requires workers {sorted(stored)}, this coordinator was given "
            f"{sorted(wanted)}; every coordinator of a deployment uses the registry's set: "
            "omit required_workers, or change it explicitly with change_membership()"
        )
    return None


def activation_decision(view: RegistryView, rec: ArtifactRecord) -> dict[str, Any]:
    """The contract's activation decision (`activate_policy_version`) on STORED state.

    The coordinator plans with it and every registry write re-checks a pointer switch with
    it, reading the durable required worker set and the stored acks of the same step.
    """
    required = required_set(view)
    pointer = view.pointer()
    reports = counted_acks(view, rec)
    return activate_policy_version(
        None if pointer is None else attrs.asdict(pointer),
        {"version": rec.version, "artifact_hash": rec.artifact_hash, "committed": rec.committed},
        {w: {"version": a.version, "artifact_hash": a.artifact_hash} for w, a in reports.items()},
        required,
    )


def distribution_refusal(view: RegistryView, version: int) -> str | None:
    """Why `version` may not be distributed now (None: it may): only a version newer than
    the active one can ever activate, so an older one would only hold the one slot."""
    pointer = view.pointer()
    if pointer is not None and version <= pointer.version:
        return (
            f"v{version} is not newer than the active v{pointer.version}; only a newer "
            "version can be distributed (use rollback() to go back)"
        )
    return None


def activated_hash(store: RegistryStore, version: int) -> str | None:
    """The hash of `version` if it ever became the active version, else None.

    The admission gate's registry lookup: a behaviour version that never became active is
    a registration error. Reading it needs no coordinator and no worker set.
    """
    rec = store.artifact(version)
    if rec is None or rec.state not in WAS_ACTIVE_STATES:
        return None
    return rec.artifact_hash


# a version's lineage is fenced when it is registered, committed and activated
LINEAGE_FENCED_EVENTS = frozenset({"register", "commit_artifact", "activate"})


def lineage_fenced(view: RegistryView) -> bool:
    """Whether the deployment fences versions by lineage: unless its recorded policy says
    `lineage="off"` (the operator's recorded opt-out), it does, with no policy too."""
    pol = view.policy()
    return pol is None or pol.lineage != "off"


def default_lineage(view: RegistryView) -> tuple[str, ...]:
    """What `prepare` records as a version's lineage when the learner names none: the
    ledger's landed updates that no version claims yet (each update is claimed by at most
    one version), read inside the registry's step."""
    return tuple(view.unclaimed_updates())


def lineage_refusal(view: RegistryView, rec: ArtifactRecord) -> str | None:
    """Why `rec`'s lineage may not be registered, committed or activated now (None: it
    may): every update it names must have landed in the ledger that shares this registry,
    never have been poisoned, and be claimed by no other version."""
    named = rec.trained_by
    found = view.updates(named)
    unlanded = sorted(u for u in named if u not in found or found[u].status == "open")
    poisoned = sorted(u for u in named if u in found and found[u].status == "poisoned")
    others = {
        u: max(other) for u, vs in view.claims(named).items() if (other := set(vs) - {rec.version})
    }
    claimed = sorted(f"{u} (v{others[u]})" for u in named if u in others)
    problems = []
    if unlanded:
        problems.append(
            f"update(s) {unlanded} have no landed commit in the ledger (a lost lease or a "
            "refused commit): their rollouts may have been consumed by another update"
        )
    if poisoned:
        causes = [f"{u}: {found[u].cause}" for u in poisoned]
        problems.append(f"update(s) {causes} are poisoned")
    if claimed:
        problems.append(f"update(s) {claimed} are already in another version's lineage")
    return "; ".join(problems) or None


def check_step(view: RegistryView, step: RegistryStep) -> None:
    """Refuse a step that would break a registry invariant, before anything is written.

    Before-images must equal the stored records (a plan built on a stale read is refused);
    a new version must exceed every version ever registered; a committed hash never changes;
    each version is changed at most once per step; a failure records its stage. The pointer
    moves only by an activation that `activation_decision` allows on the stored acks and the
    durable worker set, or by an explicit rollback to the recorded rollback pointer; a
    version no newer than the active one is never distributed.
    """
    seen: set[int] = set()
    top = view.max_version()
    pointer_before = view.pointer()
    if not isinstance(step.membership, _Unchanged):
        check_membership(step.membership)
        if step.artifacts or not isinstance(step.pointer, _Unchanged):
            raise ActivationError("a membership change is a step of its own")
    if not isinstance(step.policy, _Unchanged):
        check_policy(step.policy)
        if (
            step.artifacts
            or step.workers
            or not isinstance(step.pointer, _Unchanged)
            or not isinstance(step.membership, _Unchanged)
        ):
            raise ActivationError("an admission policy change is a step of its own")
        if not step.policy_reason:
            raise ActivationError("an admission policy change records its reason")
        check_reason(step.policy_reason)
    if not isinstance(step.membership, _Unchanged):
        check_reason(step.membership_reason, "membership reason")
    for ch in step.artifacts:
        v = ch.after.version
        if v in seen:
            raise ActivationError(f"one step changes artifact v{v} twice")
        if ch.after.path is not None:
            check_reason(ch.after.path, f"artifact v{v} path")
        seen.add(v)
        if ch.before is not None and ch.before.version != v:
            raise ActivationError(f"change of v{v} carries a before-image of v{ch.before.version}")
        current = view.artifact(v)
        if current != ch.before:
            raise ActivationError(
                f"artifact v{v} changed underneath this step (stored {current}, planned from "
                f"{ch.before}); re-read and retry"
            )
        if current is None and top is not None and v <= top:
            raise ActivationError(
                f"version {v} is not greater than every registered version (max {top}); "
                "versions are never reused"
            )
        if (
            current is not None
            and current.artifact_hash is not None
            and ch.after.artifact_hash != current.artifact_hash
        ):
            raise ActivationError(
                f"artifact v{v}: committed hash {current.artifact_hash} can never change"
            )
        problems = rules.artifact_stage_problems(ch.after)
        if problems:
            raise ActivationError("; ".join(problems))
        if current is not None and ch.after.trained_by != current.trained_by:
            raise ActivationError(f"artifact v{v}: its recorded lineage never changes")
        if ch.after.trained_by and ch.event in LINEAGE_FENCED_EVENTS and lineage_fenced(view):
            why = lineage_refusal(view, ch.after)
            if why is not None:
                raise ActivationError(
                    f"refusing to {ch.event} v{v}: {why} (the deployment's policy fences "
                    "versions by lineage; `deployment lineage` shows it)"
                )
        if ch.event in ("distribute", "retry"):
            why = distribution_refusal(view, v)
            if why is not None:
                raise ActivationError(why)
        if ch.event == "activate" and current is not None:
            decision = activation_decision(view, current)
            if not decision["activated"]:
                raise ActivationError(
                    f"refusing to activate v{v}: {decision['reason']} (missing "
                    f"{decision['missing_workers']}, mismatched {decision['mismatched_workers']})"
                )
            want = ActivePointer(v, decision["active_pointer"]["artifact_hash"])
            if step.pointer != want:
                raise ActivationError(f"activating v{v} must point at it, not at {step.pointer}")
    if not isinstance(step.pointer, _Unchanged) and step.pointer != pointer_before:
        _check_pointer_move(view, step, pointer_before)
    _check_tokens(view, step)


ATTEMPT_EVENTS = ("distribute", "retry")
# the state a distribution attempt leaves its artifact in, read off the activation machine
(AWAITING_ACKS,) = {e.dest for e in ACTIVATION.edges if e.event in ATTEMPT_EVENTS}


def _check_tokens(view: RegistryView, step: RegistryStep) -> None:
    """Acks stay bound to their attempt and to membership, whatever the plan says.

    Tokens are issued only by a distribution attempt (a fresh one to every required worker)
    or by a membership change (to a worker joining while a version awaits acks); a worker
    that leaves loses its tokens and its stored ack in that same step; a stored ack carries
    a token only if it is the current one of its worker, version and attempt, and only
    once: an ack echoing a spent token is never stored again.
    """
    required = view.required_workers() or ()
    issued: dict[tuple[int, str], AttemptToken] = {}
    stored: dict[int, dict[str, AttemptToken]] = {}
    for t in step.tokens:
        key = (t.version, t.worker_id)
        if t.spent:
            raise ActivationError(f"v{t.version}: a token is issued unspent ({t.worker_id!r})")
        if key in issued:
            raise ActivationError(f"one step issues v{t.version} two tokens for {t.worker_id!r}")
        issued[key] = t
        if t.version not in stored:
            stored[t.version] = {o.worker_id: o for o in view.attempt_tokens(t.version)}
        old = stored[t.version].get(t.worker_id)
        if old is not None and old.token == t.token:
            raise ActivationError(
                f"v{t.version}: the token of {t.worker_id!r} is reissued unchanged; every "
                "attempt issues a fresh one"
            )
    if len({t.token for t in step.tokens}) != len(step.tokens):
        raise ActivationError("one step issues the same token to two workers")
    if isinstance(step.membership, _Unchanged):
        if step.revoked:
            raise ActivationError("tokens are withdrawn only by a membership change")
        attempts = {
            ch.after.version: ch.after for ch in step.artifacts if ch.event in ATTEMPT_EVENTS
        }
        for t in step.tokens:
            rec = attempts.get(t.version)
            if rec is None or t.attempt != rec.attempts or t.worker_id not in required:
                raise ActivationError(
                    f"token for {t.worker_id!r} of v{t.version} attempt {t.attempt}: tokens are "
                    "issued to required workers by a distribution attempt of that version"
                )
        for v in attempts:
            missing = [w for w in required if (v, w) not in issued]
            if missing:
                raise ActivationError(
                    f"distribution attempt of v{v} issues no token to {missing}; every "
                    "required worker must get one"
                )
    else:
        _check_membership_tokens(view, step, required, issued)
    for w in step.workers:
        a = w.ack
        if a is None or a.token is None:
            continue
        before = view.worker(w.worker_id)
        if before is not None and before.ack == a:
            continue  # kept as it was (a restart that leaves the ack standing)
        rec = view.artifact(a.version)
        cur = None if rec is None else current_tokens(view, rec).get(w.worker_id)
        if (
            w.worker_id not in required
            or rec is None
            or rec.state != "awaiting_acks"
            or cur is None
            or cur.token != a.token
        ):
            raise ActivationError(
                f"{w.worker_id!r}'s ack of v{a.version} is stored with a token that is not the "
                "current attempt's; only an ack echoing it may be stored with one"
            )
        if cur.spent:
            raise ActivationError(
                f"{w.worker_id!r}'s ack of v{a.version} echoes a token already counted once; "
                "a token counts once (a later report voided that ack)"
            )


def _check_membership_tokens(
    view: RegistryView,
    step: RegistryStep,
    required: tuple[str, ...],
    issued: dict[tuple[int, str], AttemptToken],
) -> None:
    """A leaver's tokens and ack are voided; a joiner gets a token for the version awaiting."""
    assert not isinstance(step.membership, _Unchanged)
    new = set(step.membership)
    leavers, joiners = set(required) - new, new - set(required)
    awaiting = {a.version: a for a in view.awaiting()}
    for t in step.tokens:
        rec = awaiting.get(t.version)
        if t.worker_id not in joiners or rec is None or t.attempt != rec.attempts:
            raise ActivationError(
                f"a membership change issues tokens only to joining workers, for the current "
                f"attempt of the version awaiting acks (not {t.worker_id!r} v{t.version})"
            )
    for v in awaiting:
        missing = sorted(w for w in joiners if (v, w) not in issued)
        if missing:
            raise ActivationError(f"workers {missing} join while v{v} awaits acks without a token")
    if set(step.revoked) != leavers:
        raise ActivationError(
            f"a membership change withdraws the tokens of exactly the leaving workers "
            f"{sorted(leavers)}, not {sorted(step.revoked)}"
        )
    written = {w.worker_id: w for w in step.workers}
    for w in sorted(leavers):
        r = view.worker(w)
        if r is not None and r.ack is not None:
            out = written.get(w)
            if out is None or out.ack is not None:
                raise ActivationError(f"{w!r} leaves the worker set but its ack stays standing")


def _check_pointer_move(
    view: RegistryView, step: RegistryStep, pointer_before: ActivePointer | None
) -> None:
    """The pointer moves only with an activation of its target, or an explicit rollback."""
    events = {ch.event: ch for ch in step.artifacts}
    new = step.pointer
    if new is None or isinstance(new, _Unchanged):
        raise ActivationError("the active pointer is never cleared")
    act = events.get("activate")
    if act is not None and act.after.version == new.version:
        return  # judged above by activation_decision
    back, up = events.get("roll_back"), events.get("reinstate")
    if (
        back is not None
        and up is not None
        and pointer_before is not None
        and back.before is not None
        and back.after.version == pointer_before.version
        and back.before.rollback_version == new.version
        and up.after.version == new.version
        and up.after.artifact_hash == new.artifact_hash
    ):
        return
    raise ActivationError(
        f"the pointer may move only by an activation or an explicit rollback to the recorded "
        f"rollback pointer (asked: {pointer_before} -> {new})"
    )


def make_events(
    step: RegistryStep,
    pointer_before: ActivePointer | None,
    membership_before: tuple[str, ...] | None = None,
    policy_before: AdmissionPolicy | None = None,
) -> list[TraceEvent]:
    """The step's events, unstamped (seq/txn 0): the backend's log stamps them."""
    after = pointer_before if isinstance(step.pointer, _Unchanged) else step.pointer
    out: list[TraceEvent] = []
    if not isinstance(step.policy, _Unchanged):
        out.append(
            PolicyChanged(
                seq=0,
                txn=0,
                at=step.at,
                before=policy_before,
                after=step.policy,
                reason=step.policy_reason,
            )
        )
    if not isinstance(step.membership, _Unchanged):
        out.append(
            MembershipChanged(
                seq=0,
                txn=0,
                at=step.at,
                before=membership_before,
                after=step.membership,
                reason=step.membership_reason,
                tokens=step.tokens,
            )
        )
    out.extend(
        ArtifactChanged(
            seq=0,
            txn=0,
            at=step.at,
            version=ch.after.version,
            event=ch.event,
            before=ch.before,
            after=ch.after,
            pointer_before=pointer_before,
            pointer_after=after,
            acks=ch.acks,
            required_workers=ch.required_workers,
            tokens=tuple(t for t in step.tokens if t.version == ch.after.version),
        )
        for ch in step.artifacts
    )
    out.extend(
        WorkerReported(seq=0, txn=0, at=step.at, worker_id=w.worker_id, floor=w.floor, ack=w.ack)
        for w in step.workers
    )
    return out


def _artifact_events(events: Sequence[TraceEvent]) -> list[ArtifactChanged]:
    return [e for e in events if isinstance(e, ArtifactChanged)]


# ---- memory --------------------------------------------------------------------------------


class _ReadsViews(Protocol):
    """What `ViewReads` needs of its store: a read of the store's view, the store's own
    way (under its lock, or in a transaction of its server)."""

    def _view_read(self, fn: Callable[[RegistryView], R], what: str) -> R: ...


class ViewReads:
    """The registry's read methods, once for every store: each store gives `_view_read`
    (`_ReadsViews`)."""

    def artifact(self: _ReadsViews, version: int) -> ArtifactRecord | None:
        """The record of `version`, or None."""
        return self._view_read(lambda v: v.artifact(version), "artifact")

    def artifacts(self: _ReadsViews) -> list[ArtifactRecord]:
        """Every record, by version."""
        return self._view_read(lambda v: v.artifacts(), "artifacts")

    def pointer(self: _ReadsViews) -> ActivePointer | None:
        """The active pointer (None before the first activation)."""
        return self._view_read(lambda v: v.pointer(), "pointer")

    def workers(self: _ReadsViews) -> dict[str, WorkerReport]:
        """Latest report per worker."""
        return self._view_read(lambda v: v.workers(), "workers")

    def max_version(self: _ReadsViews) -> int | None:
        """Highest version ever registered."""
        return self._view_read(lambda v: v.max_version(), "max_version")

    def required_workers(self: _ReadsViews) -> tuple[str, ...] | None:
        """The deployment's durable required worker set (None until first set)."""
        return self._view_read(lambda v: v.required_workers(), "required_workers")

    def policy(self: _ReadsViews) -> AdmissionPolicy | None:
        """The deployment's recorded admission policy (None until first set)."""
        return self._view_read(lambda v: v.policy(), "policy")

    def awaiting(self: _ReadsViews) -> list[ArtifactRecord]:
        """The records awaiting acks, by version (one at most, unless written otherwise):
        read alone, so a step's cost does not grow with the versions ever registered."""
        return self._view_read(lambda v: v.awaiting(), "awaiting")

    def attempt_tokens(self: _ReadsViews, version: int | None = None) -> list[AttemptToken]:
        """The stored attempt tokens (of one version), by version and worker."""
        return self._view_read(lambda v: v.attempt_tokens(version), "attempt_tokens")


class _LockedReads(ViewReads):
    """Reads of a view held in this process, under the store's lock."""

    _lock: contextlib.AbstractContextManager[Any]
    _view: RegistryView

    def _view_read(self, fn: Callable[[RegistryView], R], what: str) -> R:
        with self._lock:
            return fn(self._view)


class _MemoryView:
    def __init__(self, reg: MemoryRegistry) -> None:
        self._reg = reg

    def artifact(self, version: int) -> ArtifactRecord | None:
        return self._reg._artifacts.get(version)

    def artifacts(self) -> list[ArtifactRecord]:
        return [self._reg._artifacts[v] for v in sorted(self._reg._artifacts)]

    def pointer(self) -> ActivePointer | None:
        return self._reg._pointer

    def worker(self, worker_id: str) -> WorkerReport | None:
        return self._reg._workers.get(worker_id)

    def workers(self) -> dict[str, WorkerReport]:
        return dict(self._reg._workers)

    def max_version(self) -> int | None:
        return max(self._reg._artifacts, default=None)

    def required_workers(self) -> tuple[str, ...] | None:
        return self._reg._membership

    def policy(self) -> AdmissionPolicy | None:
        return self._reg._policy

    def updates(self, update_ids: Iterable[str]) -> dict[str, UpdateRecord]:
        # the ledger attached to this registry keeps its records here (see ledger_updates)
        got = self._reg.ledger_updates.get
        return {u: r for u in update_ids if (r := got(u)) is not None}

    def unclaimed_updates(self) -> list[str]:
        claimed = self._reg._claims
        landed = self._reg.ledger_updates.items()
        return sorted(u for u, r in landed if r.status == "landed" and u not in claimed)

    def claims(self, update_ids: Iterable[str]) -> dict[str, tuple[int, ...]]:
        got = self._reg._claims.get
        return {u: vs for u in sorted(set(update_ids)) if (vs := got(u))}

    def awaiting(self) -> list[ArtifactRecord]:
        arts = self._reg._artifacts
        return [arts[v] for v in sorted(arts) if arts[v].state == AWAITING_ACKS]

    def attempt_tokens(self, version: int | None = None) -> list[AttemptToken]:
        return [
            t
            for _, t in sorted(self._reg._tokens.items())
            if version is None or t.version == version
        ]


class MemoryRegistry(_LockedReads):
    """In-process registry; share `event_log` with a MemoryLedger for one global trace."""

    _lock: threading.RLock

    def __init__(self, event_log: EventLog | None = None) -> None:
        self._lock = threading.RLock()
        self._artifacts: dict[int, ArtifactRecord] = {}
        self._pointer: ActivePointer | None = None
        self._workers: dict[str, WorkerReport] = {}
        self._membership: tuple[str, ...] | None = None
        self._policy: AdmissionPolicy | None = None
        self._tokens: dict[tuple[int, str], AttemptToken] = {}
        # update id -> the versions whose lineage names it, ascending: the lineage index
        # (model.lineage_index) kept with the artifacts, so no step walks every version
        self._claims: dict[str, tuple[int, ...]] = {}
        self.log = event_log if event_log is not None else EventLog()
        # the update records of the MemoryLedger attached to this registry (it shares them,
        # and this lock): what lineage is read from, as the SQL registries read the table
        self.ledger_updates: dict[str, UpdateRecord] = {}
        self._view = _MemoryView(self)

    @property
    def lock(self) -> threading.RLock:
        """The one lock of this registry's steps; an attached MemoryLedger shares it."""
        return self._lock

    def premise(self, versions: Collection[int] | None = None) -> ActivationPremise:
        """The pointer, the recorded policy, and which of `versions` (None: of all) were
        ever active or are retired, with their hashes (caller holds `lock`): a step looks
        up the versions it judges rather than walking every artifact the run published."""
        arts = self._artifacts
        of = arts.values() if versions is None else [arts[v] for v in versions if v in arts]
        was = {a.version: a for a in of if a.state in WAS_ACTIVE_STATES}
        return ActivationPremise(
            None if self._pointer is None else self._pointer.version,
            frozenset(was),
            self._policy,
            retired_versions(of),
            {v: a.artifact_hash for v, a in was.items() if a.artifact_hash is not None},
        )

    @classmethod
    def restore(
        cls,
        artifacts: Iterable[ArtifactRecord],
        pointer: ActivePointer | None,
        workers: Iterable[WorkerReport],
        event_log: EventLog | None = None,
        membership: Iterable[str] | None = None,
        policy: AdmissionPolicy | None = None,
        tokens: Iterable[AttemptToken] = (),
    ) -> MemoryRegistry:
        """A registry holding exactly these records, without their history.

        The explorer rebuilds a real registry from each state it expands, so the coordinator
        it checks is the production one, not a retyped copy.
        """
        reg = cls(event_log)
        reg._artifacts = {a.version: a for a in artifacts}
        for v in sorted(reg._artifacts):
            reg._claim(reg._artifacts[v])
        reg._pointer = pointer
        reg._workers = {w.worker_id: w for w in workers}
        reg._membership = None if membership is None else check_membership(membership)
        reg._policy = policy
        reg._tokens = {(t.version, t.worker_id): t for t in tokens}
        return reg

    def transact(
        self, plan: Callable[[RegistryView], tuple[RegistryStep, R]]
    ) -> tuple[R, list[ArtifactChanged]]:
        """Plan and apply one step under the lock; a raising plan changes nothing."""
        with self._lock:
            step, result = plan(self._view)
            check_step(self._view, step)
            events = make_events(step, self._pointer, self._membership, self._policy)
            for ch in step.artifacts:
                self._artifacts[ch.after.version] = ch.after
                if ch.before is None or ch.before.trained_by != ch.after.trained_by:
                    self._claim(ch.after, ch.before)
            if not isinstance(step.pointer, _Unchanged):
                self._pointer = step.pointer
            for w in step.workers:
                self._workers[w.worker_id] = w
            if not isinstance(step.membership, _Unchanged):
                self._membership = step.membership
            if not isinstance(step.policy, _Unchanged):
                self._policy = step.policy
            for key in [k for k in self._tokens if k[1] in step.revoked]:
                del self._tokens[key]
            for t in step.tokens:
                self._tokens[(t.version, t.worker_id)] = t
            for v, worker, token in spent_by(step):
                held = self._tokens.get((v, worker))
                if held is not None and held.token == token:
                    self._tokens[(v, worker)] = attrs.evolve(held, spent=True)
            stamped = self.log.record(events) if events else []
            return result, _artifact_events(stamped)

    def _claim(self, rec: ArtifactRecord, before: ArtifactRecord | None = None) -> None:
        """Keep the claims index equal to the artifacts' lineages after `rec` is stored."""
        if before is not None:
            for u in before.trained_by:
                left = tuple(v for v in self._claims.get(u, ()) if v != before.version)
                if left:
                    self._claims[u] = left
                else:
                    self._claims.pop(u, None)
        for u in rec.trained_by:
            self._claims[u] = tuple(sorted({*self._claims.get(u, ()), rec.version}))

    def history(self, version: int | None = None) -> list[ArtifactChanged]:
        """Artifact events in global order, optionally of one version."""
        return [
            e
            for e in self.log.events()
            if isinstance(e, ArtifactChanged) and (version is None or e.version == version)
        ]

    def trace(self) -> list[TraceEvent]:
        """Every registry event (artifacts, membership, worker reports) in global order
        (the rows recorded for `ledger check`, RowRecorded, are not registry events)."""
        return [e for e in self.log.events() if not isinstance(e, EntryChanged | RowRecorded)]

    def close(self) -> None:
        """Nothing to release; protocol parity with SQLite."""


# ---- SQLite --------------------------------------------------------------------------------

_DDL = """
CREATE TABLE IF NOT EXISTS registry_artifacts (
    version          INTEGER PRIMARY KEY CHECK (version >= 0),
    artifact_hash    TEXT,
    parent_version   INTEGER,
    rollback_version INTEGER,
    state            TEXT NOT NULL,
    path             TEXT,
    failure          TEXT,
    attempts         INTEGER NOT NULL CHECK (attempts >= 0),
    trained_by       TEXT,
    ack_deadline     REAL
);
CREATE TABLE IF NOT EXISTS registry_pointer (
    id            INTEGER PRIMARY KEY CHECK (id = 1),
    version       INTEGER NOT NULL,
    artifact_hash TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS registry_workers (
    worker_id TEXT PRIMARY KEY,
    floor     INTEGER NOT NULL,
    ack       TEXT
);
CREATE TABLE IF NOT EXISTS registry_membership (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    workers TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS registry_policy (
    id        INTEGER PRIMARY KEY CHECK (id = 1),
    max_lag   INTEGER NOT NULL CHECK (max_lag >= 0),
    max_drift REAL NOT NULL CHECK (max_drift >= 0),
    batch_size   INTEGER,
    max_attempts INTEGER,
    lineage   TEXT NOT NULL DEFAULT 'ledger',
    chain_key TEXT NOT NULL DEFAULT 'identity'
);
CREATE TABLE IF NOT EXISTS registry_attempt_tokens (
    version   INTEGER NOT NULL CHECK (version >= 0),
    worker_id TEXT NOT NULL,
    attempt   INTEGER NOT NULL CHECK (attempt >= 0),
    token     TEXT NOT NULL CHECK (token != ''),
    spent     INTEGER NOT NULL DEFAULT 0 CHECK (spent IN (0, 1)),
    PRIMARY KEY (version, worker_id)
);
-- the version awaiting acks is read at every weight sync (`awaiting`): by this index, not by
-- a scan of every version the run ever registered (an index only: older programs read on)
CREATE INDEX IF NOT EXISTS registry_artifacts_state ON registry_artifacts(state)
"""

# ensure_schema splits its DDL on ';', so triggers (whose bodies contain ';') go here; they
# hold the two write-once rules even against a writer that bypasses this module
_TRIGGERS = (
    """CREATE TRIGGER IF NOT EXISTS registry_hash_write_once
       BEFORE UPDATE OF artifact_hash ON registry_artifacts
       WHEN OLD.artifact_hash IS NOT NULL AND NEW.artifact_hash IS NOT OLD.artifact_hash
       BEGIN SELECT RAISE(ABORT, 'a committed artifact hash never changes'); END""",
    """CREATE TRIGGER IF NOT EXISTS registry_version_forward
       BEFORE INSERT ON registry_artifacts
       WHEN NEW.version <= (SELECT MAX(version) FROM registry_artifacts)
       BEGIN SELECT RAISE(ABORT, 'artifact versions are never reused'); END""",
)

_ART_COLS = (
    "version, artifact_hash, parent_version, rollback_version, state, path, failure, attempts, "
    "trained_by, ack_deadline"
)
# the columns a schema-5 (or older) registry lacks, read as NULL / false by a read-only open
_LATER_COLUMNS = {("registry_artifacts", "ack_deadline"), ("registry_attempt_tokens", "spent")}


def _int(x: object) -> int:
    if not isinstance(x, int):
        raise ActivationError(f"registry database holds {brief(x)} where an integer belongs")
    return x


def _float(x: object) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise ActivationError(f"registry database holds {brief(x)} where a number belongs")
    return float(x)


def _opt_int(x: object) -> int | None:
    return None if x is None else _int(x)


def _opt_str(x: object) -> str | None:
    return None if x is None else str(x)


def _row_to_record(row: Sequence[object]) -> ArtifactRecord:
    version, h, parent, rollback, state, path, failure, attempts, trained_by, deadline = row
    return ArtifactRecord(
        version=_int(version),
        artifact_hash=_opt_str(h),
        parent_version=_opt_int(parent),
        rollback_version=_opt_int(rollback),
        state=str(state),
        path=_opt_str(path),
        failure=None if failure is None else from_jsonable(Disposition, json.loads(str(failure))),
        attempts=_int(attempts),
        trained_by=() if trained_by is None else tuple(json.loads(str(trained_by))),
        ack_deadline=None if deadline is None else _float(deadline),
    )


def _record_to_row(r: ArtifactRecord) -> tuple[object, ...]:
    failure = None if r.failure is None else json.dumps(to_jsonable(r.failure))
    return (
        r.version,
        r.artifact_hash,
        r.parent_version,
        r.rollback_version,
        r.state,
        r.path,
        failure,
        r.attempts,
        json.dumps(list(r.trained_by)) if r.trained_by else None,
        r.ack_deadline,
    )


# the policy row's upsert (the same on SQLite and PostgreSQL, up to the parameter marker)
POLICY_UPSERT = (
    "INSERT INTO registry_policy(id, max_lag, max_drift, batch_size, max_attempts, lineage, "
    "chain_key) VALUES (1, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT(id) DO UPDATE SET max_lag=excluded.max_lag, max_drift=excluded.max_drift, "
    "batch_size=excluded.batch_size, max_attempts=excluded.max_attempts, "
    "lineage=excluded.lineage, chain_key=excluded.chain_key"
)


def policy_row(p: AdmissionPolicy) -> tuple[object, ...]:
    """The policy's columns for `POLICY_UPSERT`."""
    return (p.max_lag, p.max_drift, p.batch_size, p.max_attempts, p.lineage, p.chain_key)


def policy_from_row(row: dict[str, Any]) -> AdmissionPolicy:
    """The policy from its stored row, by column name (absent newer columns: defaults)."""
    return AdmissionPolicy(
        _int(row["max_lag"]),
        float(row["max_drift"]),
        _opt_int(row.get("batch_size")),
        _opt_int(row.get("max_attempts")),
        str(row.get("lineage") or "ledger"),
        str(row.get("chain_key") or "identity"),
    )


def _row_to_token(row: Sequence[object]) -> AttemptToken:
    version, worker, attempt, token, spent = row
    return AttemptToken(_int(version), str(worker), _int(attempt), str(token), bool(spent))


def _row_to_worker(row: Sequence[object]) -> WorkerReport:
    wid, floor, ack = row
    return WorkerReport(
        worker_id=str(wid),
        floor=_int(floor),
        ack=None if ack is None else from_jsonable(WorkerAck, json.loads(str(ack))),
    )


class SqlView:
    """What a registry plan may read, on the step's own connection (inside its transaction).

    One class for every SQL store: the queries are the same, only the DB-API parameter
    marker differs (`PARAM`: '?' for sqlite3, '%s' for psycopg).
    """

    PARAM = "?"
    COLUMN_SQL = "SELECT 1 FROM pragma_table_info(?) WHERE name = ?"

    def __init__(
        self,
        conn: Any,
        columns: dict[tuple[str, str], bool] | None = None,
        tables: set[str] | None = None,
    ) -> None:
        self._conn = conn
        # tables known to exist (a table, once created, never goes away): the caller may
        # keep the set across views, so each is asked about once per store
        self._tables: set[str] = set() if tables is None else tables
        # which later columns the stored schema has (a read-only open of an older registry
        # lacks them; a writer migrated them in): asked once per store, kept by the caller
        self._columns = {} if columns is None else columns

    def _column(self, table: str, column: str, default: str) -> str:
        """`column`, or a literal `default` where an older schema opened read-only lacks it."""
        key = (table, column)
        if key not in _LATER_COLUMNS:
            return column
        if key not in self._columns:
            found = self._conn.execute(self.COLUMN_SQL, key).fetchone()
            self._columns[key] = found is not None
        return column if self._columns[key] else f"{default} AS {column}"

    def _art_cols(self) -> str:
        deadline = self._column("registry_artifacts", "ack_deadline", "NULL")
        return _ART_COLS.replace("ack_deadline", deadline)

    def artifact(self, version: int) -> ArtifactRecord | None:
        row = self._conn.execute(
            f"SELECT {self._art_cols()} FROM registry_artifacts WHERE version = {self.PARAM}",
            (version,),
        ).fetchone()
        return None if row is None else _row_to_record(row)

    def artifacts(self) -> list[ArtifactRecord]:
        rows = self._conn.execute(
            f"SELECT {self._art_cols()} FROM registry_artifacts ORDER BY version"
        ).fetchall()
        return [_row_to_record(r) for r in rows]

    def pointer(self) -> ActivePointer | None:
        row = self._conn.execute(
            "SELECT version, artifact_hash FROM registry_pointer WHERE id = 1"
        ).fetchone()
        return None if row is None else ActivePointer(int(row[0]), str(row[1]))

    def worker(self, worker_id: str) -> WorkerReport | None:
        row = self._conn.execute(
            f"SELECT worker_id, floor, ack FROM registry_workers WHERE worker_id = {self.PARAM}",
            (worker_id,),
        ).fetchone()
        return None if row is None else _row_to_worker(row)

    def workers(self) -> dict[str, WorkerReport]:
        rows = self._conn.execute(
            "SELECT worker_id, floor, ack FROM registry_workers ORDER BY worker_id"
        ).fetchall()
        return {str(r[0]): _row_to_worker(r) for r in rows}

    def max_version(self) -> int | None:
        row = self._conn.execute("SELECT MAX(version) FROM registry_artifacts").fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def required_workers(self) -> tuple[str, ...] | None:
        row = self._conn.execute("SELECT workers FROM registry_membership WHERE id = 1").fetchone()
        return None if row is None else tuple(str(w) for w in json.loads(str(row[0])))

    def policy(self) -> AdmissionPolicy | None:
        # by name: a registry read before its migration to the newer columns reads them as
        # their defaults
        cur = self._conn.execute("SELECT * FROM registry_policy WHERE id = 1")
        row = cur.fetchone()
        if row is None:
            return None
        return policy_from_row(dict(zip([d[0] for d in cur.description], row, strict=True)))

    def updates(self, update_ids: Iterable[str]) -> dict[str, UpdateRecord]:
        """The records of these updates in the ledger that shares this database (none
        where it holds no ledger)."""
        want = sorted(set(update_ids))
        if not want or not self._has_table("ledger_updates"):
            return {}
        marks = ", ".join([self.PARAM] * len(want))
        rows = self._conn.execute(
            f"SELECT update_id, status, cause, detail FROM ledger_updates "
            f"WHERE update_id IN ({marks})",
            want,
        ).fetchall()
        return {str(r[0]): update_from_row(r) for r in rows}

    # each (version, update id) a version's lineage names, in SQL (the JSON is the store's)
    LINEAGE_SQL = (
        "SELECT a.version, j.value FROM registry_artifacts a, json_each(a.trained_by) j "
        "WHERE a.trained_by IS NOT NULL"
    )

    def unclaimed_updates(self) -> list[str]:
        """The ids of the ledger's landed updates that no version's lineage names, sorted:
        from the lineage index (model.lineage_index) where the store has it, so the cost
        follows the unclaimed updates, not the run; from every version's JSON where not (a
        file no writer of this version opened, read-only)."""
        if not self._has_table("ledger_updates"):
            return []
        claims_whole, marked = self._lineage_index()
        if claims_whole and marked:
            rows = self._conn.execute(self.UNCLAIMED_SQL).fetchall()
        else:
            rows = self._conn.execute(
                "SELECT update_id FROM ledger_updates WHERE status = 'landed' AND update_id "
                f"NOT IN (SELECT value FROM ({self.LINEAGE_SQL}) AS c) ORDER BY update_id"
            ).fetchall()
        return [str(r[0]) for r in rows]

    def claims(self, update_ids: Iterable[str]) -> dict[str, tuple[int, ...]]:
        """The versions whose lineage names each of these updates, ascending (one, unless
        the file was written otherwise): by the claims index where the store has it."""
        want = sorted(set(update_ids))
        if not want:
            return {}
        marks = ", ".join([self.PARAM] * len(want))
        if self._lineage_index()[0]:
            sql = claims_sql(marks)
        else:
            sql = (
                f"SELECT version, value FROM ({self.LINEAGE_SQL}) AS c WHERE value IN ({marks}) "
                "ORDER BY version"
            )
        rows = self._conn.execute(sql, want).fetchall()
        found = defaultdict[str, tuple[int, ...]](tuple)
        for v, u in rows:
            found[str(u)] += (_int(v),)
        return dict(found)

    # what says the lineage index is there: the claims' trigger (made with the filled table
    # in one transaction) and the marks' partial index (made with their trigger)
    INDEX_OBJECTS = (CLAIMS_TRIGGER, MARK_INDEX)
    UNCLAIMED_SQL = UNCLAIMED_SQLITE
    OBJECT_SQL = "SELECT 1 FROM sqlite_master WHERE name = ? AND type IN ('trigger', 'index')"

    def _lineage_index(self) -> tuple[bool, bool]:
        """(the claims index is whole, the marks are kept), each asked once per store."""
        claims, marks = self.INDEX_OBJECTS
        return self._has_object(claims), self._has_object(marks)

    def _has_object(self, name: str) -> bool:
        """Whether the schema holds `name`; a yes is kept (this program never drops one)."""
        key = f"object:{name}"
        if key in self._tables:
            return True
        if self._conn.execute(self.OBJECT_SQL, (name,)).fetchone() is None:
            return False
        self._tables.add(key)
        return True

    def awaiting(self) -> list[ArtifactRecord]:
        rows = self._conn.execute(
            f"SELECT {self._art_cols()} FROM registry_artifacts "
            f"WHERE state = {self.PARAM} ORDER BY version",
            (AWAITING_ACKS,),
        ).fetchall()
        return [_row_to_record(r) for r in rows]

    def _has_table(self, name: str) -> bool:
        if name in self._tables:
            return True
        if self._conn.execute(self.TOKENS_TABLE_SQL, (name,)).fetchone() is None:
            return False
        self._tables.add(name)  # a table, once created, never goes away
        return True

    TOKENS_TABLE_SQL = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"

    def attempt_tokens(self, version: int | None = None) -> list[AttemptToken]:
        # a database written before attempt tokens existed, opened read-only, has no such table
        if not self._has_table("registry_attempt_tokens"):
            return []
        spent = self._column("registry_attempt_tokens", "spent", "0")
        sql = f"SELECT version, worker_id, attempt, token, {spent} FROM registry_attempt_tokens"
        args: tuple[object, ...] = ()
        if version is not None:
            sql += f" WHERE version = {self.PARAM}"
            args = (version,)
        rows = self._conn.execute(sql + " ORDER BY version, worker_id", args).fetchall()
        return [_row_to_token(r) for r in rows]


class StepReads:
    """A step's reads, each asked of its store once.

    Inside one step's transaction, under the registry lock, nothing the step reads changes
    until it writes, so the plan, `check_step` and `make_events` can share one answer per
    question: on PostgreSQL each was a round trip (16-28 a step, the pointer read four
    times). `known` holds answers read ahead (PostgreSQL's `step_reads`); an answer is the
    one the store gives, copied where it is a list or a dict the caller may change.
    """

    def __init__(self, view: RegistryView, known: dict[tuple[Any, ...], Any] | None = None):
        self._view = view
        self._known: dict[tuple[Any, ...], Any] = {} if known is None else known

    def _ask(self, key: tuple[Any, ...], read: Callable[[], Any]) -> Any:
        if key not in self._known:
            self._known[key] = read()
        return self._known[key]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)  # what only some views have (PostgreSQL's `now`)

    def artifact(self, version: int) -> ArtifactRecord | None:
        every = self._known.get(("artifacts",))
        if every is not None:
            return next((a for a in every if a.version == version), None)
        found: ArtifactRecord | None = self._ask(
            ("artifact", version), lambda: self._view.artifact(version)
        )
        return found

    def artifacts(self) -> list[ArtifactRecord]:
        return list(self._ask(("artifacts",), self._view.artifacts))

    def pointer(self) -> ActivePointer | None:
        found: ActivePointer | None = self._ask(("pointer",), self._view.pointer)
        return found

    def worker(self, worker_id: str) -> WorkerReport | None:
        every = self._known.get(("workers",))
        if every is not None:
            return every.get(worker_id)  # type: ignore[no-any-return]
        found: WorkerReport | None = self._ask(
            ("worker", worker_id), lambda: self._view.worker(worker_id)
        )
        return found

    def workers(self) -> dict[str, WorkerReport]:
        return dict(self._ask(("workers",), self._view.workers))

    def max_version(self) -> int | None:
        found: int | None = self._ask(("max_version",), self._view.max_version)
        return found

    def required_workers(self) -> tuple[str, ...] | None:
        found: tuple[str, ...] | None = self._ask(("membership",), self._view.required_workers)
        return found

    def policy(self) -> AdmissionPolicy | None:
        found: AdmissionPolicy | None = self._ask(("policy",), self._view.policy)
        return found

    def updates(self, update_ids: Iterable[str]) -> dict[str, UpdateRecord]:
        ids = tuple(sorted(set(update_ids)))
        return dict(self._ask(("updates", ids), lambda: self._view.updates(ids)))

    def unclaimed_updates(self) -> list[str]:
        return list(self._ask(("unclaimed",), self._view.unclaimed_updates))

    def claims(self, update_ids: Iterable[str]) -> dict[str, tuple[int, ...]]:
        ids = tuple(sorted(set(update_ids)))
        return dict(self._ask(("claims", ids), lambda: self._view.claims(ids)))

    def awaiting(self) -> list[ArtifactRecord]:
        every = self._known.get(("artifacts",))
        if every is not None:
            return [a for a in every if a.state == AWAITING_ACKS]
        return list(self._ask(("awaiting",), self._view.awaiting))

    def attempt_tokens(self, version: int | None = None) -> list[AttemptToken]:
        return list(self._ask(("tokens", version), lambda: self._view.attempt_tokens(version)))


def spent_by(step: RegistryStep) -> list[tuple[int, str, str]]:
    """(version, worker, token) of every ack a checked step stores with a token: that token
    is spent from now on (it counts once; storing a kept ack again changes nothing)."""
    return [
        (a.version, w.worker_id, a.token)
        for w in step.workers
        if (a := w.ack) is not None and a.token is not None
    ]


def token_statements(step: RegistryStep, param: str) -> list[tuple[str, tuple[object, ...]]]:
    """The SQL that writes a checked step's attempt tokens (the same on SQLite and PostgreSQL,
    up to the parameter marker): withdraw the leavers' tokens, store the issued ones, then
    mark spent the tokens the step's stored acks echo."""
    out: list[tuple[str, tuple[object, ...]]] = [
        (f"DELETE FROM registry_attempt_tokens WHERE worker_id = {param}", (w,))
        for w in step.revoked
    ]
    marks = ", ".join([param] * 5)
    out.extend(
        (
            "INSERT INTO registry_attempt_tokens(version, worker_id, attempt, token, spent) "
            f"VALUES ({marks}) ON CONFLICT (version, worker_id) DO UPDATE SET "
            "attempt = excluded.attempt, token = excluded.token, spent = excluded.spent",
            (t.version, t.worker_id, t.attempt, t.token, t.spent),
        )
        for t in step.tokens
    )
    out.extend(
        (
            f"UPDATE registry_attempt_tokens SET spent = {param} WHERE version = {param} "
            f"AND worker_id = {param} AND token = {param}",
            (True, v, w, token),
        )
        for v, w, token in spent_by(step)
    )
    return out


class _EmptyView:
    """A file with no registry tables, read without creating them: nothing registered."""

    def artifact(self, version: int) -> ArtifactRecord | None:
        return None

    def artifacts(self) -> list[ArtifactRecord]:
        return []

    def pointer(self) -> ActivePointer | None:
        return None

    def worker(self, worker_id: str) -> WorkerReport | None:
        return None

    def workers(self) -> dict[str, WorkerReport]:
        return {}

    def max_version(self) -> int | None:
        return None

    def required_workers(self) -> tuple[str, ...] | None:
        return None

    def policy(self) -> AdmissionPolicy | None:
        return None

    def updates(self, update_ids: Iterable[str]) -> dict[str, UpdateRecord]:
        return {}

    def unclaimed_updates(self) -> list[str]:
        return []

    def claims(self, update_ids: Iterable[str]) -> dict[str, tuple[int, ...]]:
        return {}

    def awaiting(self) -> list[ArtifactRecord]:
        return []

    def attempt_tokens(self, version: int | None = None) -> list[AttemptToken]:
        return []


def _sqlite_cause(exc: sqlite3.Error) -> str:
    text = str(exc)
    if "disk is full" in text or "SQLITE_FULL" in text:
        return f"{text}: no space left on the device"
    if "readonly" in text:
        return f"{text}: the file or its folder cannot be written"
    return text


def _unusable(path: Path, exc: Exception) -> ActivationError:
    return ActivationError(
        f"{path} is not a usable registry database ({exc}); give a new file, or the file "
        "this project's ledger and registry share"
    )


class _FileCheckedLock:
    """The SQLite registry's lock. Every read and every step of the registry takes it
    first, so checking the file here makes each of them fail closed (FileReplaced) once the
    path stops naming the opened file, read methods added later included."""

    def __init__(self, guard: FileGuard) -> None:
        self.rlock = threading.RLock()
        self._guard = guard

    def __enter__(self) -> None:
        self.rlock.acquire()
        try:
            self._guard.check()
        except BaseException:
            with contextlib.suppress(Exception):
                # a step held the lock when the file was found gone: fold back, close now
                self._guard.on_lost(True)
            self.rlock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        self.rlock.release()


class SQLiteRegistry(_LockedReads):
    """The registry in a SQLite file, beside the ledger's tables (component "registry").

    Each step is one ``BEGIN IMMEDIATE ... COMMIT`` holding the record writes, the pointer
    and the events (appended to the shared `events` table), so a crash leaves either all
    of a step or none of it, and ledger and registry events share one global order.
    """

    _lock: _FileCheckedLock

    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        """Open (creating the tables on first use) or, with `read_only`, only read: a file
        that holds no registry then reads as an empty one and nothing is ever created."""
        self.path = Path(path)
        self.read_only = read_only
        try:
            self._conn = connect(self.path, read_only=read_only)
        except sqlite3.Error as exc:
            raise _unusable(self.path, exc) from None
        # a writer migrates every later column in; a reader asks once which ones it has
        known = None if read_only else dict.fromkeys(_LATER_COLUMNS, True)
        view: RegistryView = SqlView(self._conn, known)
        try:
            if read_only:
                version = has_component(self._conn, COMPONENT)
                if version is None:
                    view = _EmptyView()
                elif version > SCHEMA_VERSION:
                    raise ActivationError(
                        f"database has registry schema version {version}, this program "
                        f"expects {SCHEMA_VERSION}: written by a newer rollout-lifecycle; upgrade"
                    )
            else:
                ensure_schema(self._conn, COMPONENT, SCHEMA_VERSION, _DDL, migrations=MIGRATIONS)
                for trig in _TRIGGERS:
                    self._conn.execute(trig)
                ensure_sqlite(self._conn, registry=True)  # the lineage index (model.lineage_index)
            guard = FileGuard(
                self.path, "registry", read_file_id(self._conn), self._lost, writer=not read_only
            )
        except sqlite3.Error as exc:
            self._conn.close()
            raise _unusable(self.path, exc) from None
        except BaseException:
            self._conn.close()
            raise
        self._guard = guard
        self._lock = _FileCheckedLock(guard)
        self._view = view
        self._pid = os.getpid()
        # steps are dated by the ledger file's clock, like the ledger's events (model.clocks)
        self.clock = sqlite_host_clock(self._conn, read_only=read_only)

    @property
    def backend_url(self) -> str:
        """This file as the backend URL (absolute) an operator's command names."""
        return sqlite_url(self.path)

    def _lost(self, give_back: bool) -> bool:
        """The file is gone (see sqlite_files.lose_file): if asked, fold its -wal back into
        it, then close the connection; True if folded. Unless another thread's step holds
        the connection: that step fails at its own check and closes it then."""
        if self._pid != os.getpid() or not self._lock.rlock.acquire(blocking=False):
            return False  # a forked child never touches the parent's connection
        try:
            # holding the lock, any transaction open on the connection is this thread's own
            folded = give_back and hand_back(self._conn, own=True)
            self._conn.close()
        finally:
            self._lock.rlock.release()
        return folded

    def transact(
        self, plan: Callable[[RegistryView], tuple[RegistryStep, R]]
    ) -> tuple[R, list[ArtifactChanged]]:
        """Plan and write one step inside BEGIN IMMEDIATE; any exception rolls it all back."""
        if self.read_only:
            raise ActivationError(f"registry {self.path} was opened read-only; nothing written")
        with self._lock:
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                self._guard.check()  # again under the write lock: the file may have just gone
                view = StepReads(self._view)
                step, result = plan(view)
                check_step(view, step)
                events = make_events(step, view.pointer(), view.required_workers(), view.policy())
                for ch in step.artifacts:
                    row = _record_to_row(ch.after)
                    if ch.before is None:
                        conn.execute(
                            f"INSERT INTO registry_artifacts({_ART_COLS}) "
                            "VALUES (?,?,?,?,?,?,?,?,?,?)",
                            row,
                        )
                    else:
                        conn.execute(
                            "UPDATE registry_artifacts SET artifact_hash=?, parent_version=?, "
                            "rollback_version=?, state=?, path=?, failure=?, attempts=?, "
                            "trained_by=?, ack_deadline=? WHERE version=?",
                            (*row[1:], row[0]),
                        )
                if not isinstance(step.pointer, _Unchanged):
                    if step.pointer is None:
                        conn.execute("DELETE FROM registry_pointer")
                    else:
                        conn.execute(
                            "INSERT INTO registry_pointer(id, version, artifact_hash) "
                            "VALUES (1, ?, ?) ON CONFLICT(id) DO UPDATE SET "
                            "version=excluded.version, artifact_hash=excluded.artifact_hash",
                            (step.pointer.version, step.pointer.artifact_hash),
                        )
                for w in step.workers:
                    ack = None if w.ack is None else json.dumps(to_jsonable(w.ack))
                    conn.execute(
                        "INSERT INTO registry_workers(worker_id, floor, ack) VALUES (?,?,?) "
                        "ON CONFLICT(worker_id) DO UPDATE SET floor=excluded.floor, "
                        "ack=excluded.ack",
                        (w.worker_id, w.floor, ack),
                    )
                for sql, args in token_statements(step, "?"):
                    conn.execute(sql, args)
                if not isinstance(step.membership, _Unchanged):
                    conn.execute(
                        "INSERT INTO registry_membership(id, workers) VALUES (1, ?) "
                        "ON CONFLICT(id) DO UPDATE SET workers=excluded.workers",
                        (json.dumps(list(step.membership)),),
                    )
                if not isinstance(step.policy, _Unchanged):
                    conn.execute(POLICY_UPSERT, policy_row(step.policy))
                stamped = append_events(conn, events)
                conn.execute("COMMIT")
            except BaseException as exc:
                # SQLite may already have rolled back (a full disk does): a failing ROLLBACK
                # must not hide the real cause
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    failed = write_failed(f"registry {self.path}", exc)
                    if isinstance(failed, StorageFull):  # the ledger's error for a full disk
                        raise failed from exc
                    raise ActivationError(
                        f"registry {self.path}: write failed, nothing written "
                        f"({_sqlite_cause(exc)})"
                    ) from exc
                raise
            return result, _artifact_events(stamped)

    def history(self, version: int | None = None) -> list[ArtifactChanged]:
        """Artifact events in global order (shared with the ledger's), optionally of one version."""
        with self._lock:
            evs = read_events(
                self._conn, kind="artifact", subject=None if version is None else str(version)
            )
        return [e for e in evs if isinstance(e, ArtifactChanged)]

    def trace(self) -> list[TraceEvent]:
        """Every registry event (artifacts, membership, worker reports) in global order
        (the rows recorded for `ledger check`, RowRecorded, are not registry events)."""
        with self._lock:
            evs = read_events(self._conn, exclude_kind="entry")
        return [e for e in evs if not isinstance(e, EntryChanged | RowRecorded)]

    def close(self) -> None:
        """Close the connection; the file stays for the next coordinator."""
        with self._lock.rlock:
            self._conn.close()
        self._guard.release()  # after the connection: see sqlite_files._OpenFile
