"""The invariants of CONTRACT section 6, each written once as a named, pure predicate.

Three kinds, after stateright and TLA+:

* `always` invariants judge one `World` (a ledger + registry snapshot);
* `step` invariants judge one atomic step (the world before, the events of one transaction,
  the world after); together with `always` they are checked after every step;
* `rest` invariants hold whenever no call is in progress: a public call may pass through
  them between its own transactions (a failed activation is recorded, then its rollouts are
  quarantined), but never returns with them broken. Stateful tests and the explorer check
  them after every call; a trace replay can only check them at the end;
* `eventually` invariants are bounded liveness: they judge a world in which every message
  was delivered and no fault is pending (quiescence);
* `sometimes` properties are not invariants: they name interesting paths (a lost CAS, an
  abort, an activation failed on a stale ack) that a search must show it reached.

Every user of the spec (Hypothesis invariants, the explorer, backend conformance, the
real-run trace replay) calls `check_world`, `check_step`, `check_quiescent` or `check_trace`
from here, so "the same invariants" is literal.
"""

from __future__ import annotations

import math
import re
from collections import ChainMap, Counter
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Literal, TypeVar, cast

import attrs

from rollout_lifecycle.model.events import (
    ArtifactChanged,
    EntryChanged,
    MembershipChanged,
    PolicyChanged,
    RowRecorded,
    TraceEvent,
    UpdateChanged,
    WorkerReported,
)
from rollout_lifecycle.model.ledger import Ledger
from rollout_lifecycle.model.machines import ACTIVATION, LIFECYCLE
from rollout_lifecycle.model.records import (
    ActivePointer,
    AdmissionPolicy,
    ArtifactRecord,
    AttemptToken,
    LedgerEntry,
    UpdateRecord,
)
from rollout_lifecycle.model.registry import RegistryStore, WorkerReport

Kind = Literal["always", "step", "rest", "eventually"]

# state classes are read off the declared machines' rule tags, never retyped here; the
# rules themselves are stated below on their own, not imported from the write path's
# model.rules (a bug there must not blind the check)
REWARD_FAILURE_STATES = frozenset(LIFECYCLE.states_tagged("reward_failure"))
CARRIES_REWARD_STATES = frozenset(LIFECYCLE.states_tagged("carries_reward"))
ADMITTED_STATES = frozenset(LIFECYCLE.states_tagged("admitted"))
EVER_ACTIVE_STATES = frozenset(ACTIVATION.states_tagged("was_active"))
UNRESOLVED_ACTIVATION = frozenset(ACTIVATION.states_tagged("unresolved"))
FAILED_ACTIVATION = frozenset(ACTIVATION.states_tagged("failure"))
OPEN_STATES = frozenset(s for s in LIFECYCLE.states if s not in LIFECYCLE.terminal)
ENTRY_START_STATES = frozenset(LIFECYCLE.states_tagged("start"))
# the activation events that open a distribution attempt (and issue its tokens)
ATTEMPT_EVENTS = ("distribute", "retry")

TokenKey = tuple[int, str]  # (version, worker id)


def next_tokens(
    tokens: Mapping[TokenKey, AttemptToken], ev: TraceEvent, required: tuple[str, ...] | None
) -> Mapping[TokenKey, AttemptToken]:
    """The attempt tokens current after `ev` (`tokens` itself if `ev` leaves them alone), by
    the spec's own rule: a distribution attempt replaces every token of its version with the
    ones it issued; a membership change withdraws the leavers' tokens, adds the joiners';
    an ack stored echoing a current token spends it (it counts once)."""
    if isinstance(ev, WorkerReported):
        ack = ev.ack
        if ack is None or ack.token is None:
            return tokens
        key = (ack.version, ev.worker_id)
        held = tokens.get(key)
        if held is None or held.token != ack.token or held.spent:
            return tokens
        return {**tokens, key: attrs.evolve(held, spent=True)}
    if isinstance(ev, ArtifactChanged) and ev.event in ATTEMPT_EVENTS:
        out = {k: t for k, t in tokens.items() if k[0] != ev.version}
    elif isinstance(ev, MembershipChanged):
        gone = set(required or ()) - set(ev.after)
        out = {k: t for k, t in tokens.items() if k[1] not in gone}
    else:
        return tokens
    out.update(((t.version, t.worker_id), t) for t in ev.tokens or ())
    return out


def next_legacy(legacy: frozenset[int], ev: TraceEvent) -> frozenset[int]:
    """Versions whose current attempt was recorded before attempt tokens existed (its event
    carries no token field): such an attempt is judged by its attempt number, as it was."""
    if isinstance(ev, ArtifactChanged) and ev.event in ATTEMPT_EVENTS:
        return legacy | {ev.version} if ev.tokens is None else legacy - {ev.version}
    return legacy


def next_voided(
    voided: frozenset[str],
    ev: TraceEvent,
    required: tuple[str, ...] | None,
    workers: Mapping[str, WorkerReport],
) -> frozenset[str]:
    """Workers whose stored report predates a membership change that removed them: a change
    voids the leavers' acks; only a new report of the worker (a different ack) ends it."""
    if isinstance(ev, MembershipChanged):
        if ev.tokens is None:  # recorded before leaving voided anything
            return voided
        return voided | (set(required or ()) - set(ev.after))
    if isinstance(ev, WorkerReported) and ev.worker_id in voided:
        prev = workers.get(ev.worker_id)
        if ev.ack is not None and (prev is None or prev.ack != ev.ack):
            return voided - {ev.worker_id}
    return voided


def _lost_lease(ev: EntryChanged) -> str | None:
    """The update an `expire_lease` event took a rollout from (it is poisoned: it may have
    trained on a rollout another update will consume), or None. The spec holds it poisoned
    where the history records the update (a history written before update records existed
    is judged as it was then)."""
    if ev.event == "expire_lease" and ev.before is not None:
        return ev.before.reserved_by
    return None


def _live_voided(voided: frozenset[str], workers: Mapping[str, WorkerReport]) -> frozenset[str]:
    """The voided workers that still have a stored ack (the rest have nothing to void)."""
    return frozenset(w for w in voided if (r := workers.get(w)) is not None and r.ack is not None)


class PacingIndex:
    """The replayer's running tallies: for `dispatch_paced`, live entries per behaviour
    version and each chain's rollout ids; for `commit_takes_all_held`, the rollouts each
    update holds reserved. Kept in step with the replayed entries so judging a dispatch or
    a commit costs what its window, chain or update holds, not the size of the history.
    Built here from the events, apart from the ledger's own counting (model.pacing)."""

    def __init__(self, entries: Iterable[LedgerEntry] = ()) -> None:
        self.live: Counter[int] = Counter()
        self.chains: dict[str, list[str]] = {}
        self.held: dict[str, set[str]] = {}
        for e in entries:
            self.apply(None, e)

    def apply(self, before: LedgerEntry | None, after: LedgerEntry) -> None:
        """One replayed write: the entry was `before` (None: new) and is now `after`."""
        was = before.reserved_by if before is not None and before.state == "reserved" else None
        now = after.reserved_by if after.state == "reserved" else None
        if was != now:
            if was is not None:
                mine = self.held.get(was)
                if mine is not None:
                    mine.discard(after.rollout_id)
                    if not mine:
                        del self.held[was]
            if now is not None:
                self.held.setdefault(now, set()).add(after.rollout_id)
        if before is None and after.chain is not None:
            self.chains.setdefault(after.chain, []).append(after.rollout_id)
        if before is not None and before.state in OPEN_STATES:
            self.live[before.behavior_version] -= 1
        if after.state in OPEN_STATES:
            self.live[after.behavior_version] += 1

    def live_from(self, oldest: int) -> int:
        """Live entries whose behaviour version is >= `oldest`."""
        return sum(n for v, n in self.live.items() if v >= oldest)


@attrs.frozen
class World:
    """What the invariants look at: ledger entries, and (when known) the activation registry.

    `artifacts` None means the registry is not part of this check (a ledger on its own);
    activation invariants are then skipped rather than reported vacuously.
    """

    entries: Mapping[str, LedgerEntry] = attrs.field(factory=dict)
    artifacts: Mapping[int, ArtifactRecord] | None = None
    pointer: ActivePointer | None = None
    # the durable required worker set and each worker's stored report, as replayed
    required_workers: tuple[str, ...] | None = None
    workers: Mapping[str, WorkerReport] = attrs.field(factory=dict)
    # the deployment's recorded admission policy, as replayed (None: none recorded)
    policy: AdmissionPolicy | None = None
    # the token of each (version, worker) of its latest attempt (or of the worker's joining)
    tokens: Mapping[TokenKey, AttemptToken] = attrs.field(factory=dict)
    # workers whose stored ack predates a membership change that removed them (see
    # next_voided); between steps only those whose ack is still stored are listed
    voided: frozenset[str] = frozenset()
    # versions whose current attempt predates attempt tokens (see next_legacy)
    legacy: frozenset[int] = frozenset()
    # updates with a landed commit (a commit event that consumed a rollout), as replayed;
    # a replayer's views share its live set, so this is only read, never kept
    # (derived from the history, not a stored row: worlds compare equal without it)
    landed: AbstractSet[str] = attrs.field(default=frozenset(), eq=False)
    # updates the spec holds poisoned, derived from the history on its own: a lease of a
    # rollout it held expired, or the ledger recorded it poisoned (a refused commit writes
    # nothing else); like `landed`, derived, not a stored row
    poisoned: AbstractSet[str] = attrs.field(default=frozenset(), eq=False)
    # the ledger's update records, as replayed (a stored table: compared with the store)
    updates: Mapping[str, UpdateRecord] = attrs.field(factory=dict)
    # the replayer's tally of `entries` for dispatch_paced (None: count from `entries`)
    pacing: PacingIndex | None = attrs.field(default=None, eq=False)

    def apply(self, events: Iterable[TraceEvent]) -> World:
        """The world after `events` (replay: each event carries the record after it)."""
        entries = dict(self.entries)
        artifacts = None if self.artifacts is None else dict(self.artifacts)
        pointer = self.pointer
        required = self.required_workers
        workers = dict(self.workers)
        policy = self.policy
        tokens: Mapping[TokenKey, AttemptToken] = self.tokens
        voided, legacy = self.voided, self.legacy
        landed = set(self.landed)
        poisoned = set(self.poisoned)
        updates = dict(self.updates)
        for ev in events:
            if isinstance(ev, EntryChanged):
                entries[ev.rollout_id] = ev.after
                if ev.event == "commit" and ev.update_id is not None:
                    landed.add(ev.update_id)
                lost = _lost_lease(ev)
                if lost is not None and lost in updates:
                    poisoned.add(lost)
                continue
            if isinstance(ev, UpdateChanged):
                updates[ev.update_id] = ev.after
                if ev.after.status == "poisoned":
                    poisoned.add(ev.update_id)
                continue
            if isinstance(ev, RowRecorded):
                continue  # bookkeeping rows: spec.audit replays them against their tables
            if artifacts is None:
                artifacts = {}
            tokens = next_tokens(tokens, ev, required)
            voided = next_voided(voided, ev, required, workers)
            legacy = next_legacy(legacy, ev)
            if isinstance(ev, ArtifactChanged):
                artifacts[ev.version] = ev.after
                pointer = ev.pointer_after
            elif isinstance(ev, MembershipChanged):
                required = ev.after
            elif isinstance(ev, PolicyChanged):
                policy = ev.after
            else:
                workers[ev.worker_id] = WorkerReport(ev.worker_id, ev.floor, ev.ack)
        return World(
            entries=entries,
            artifacts=artifacts,
            pointer=pointer,
            required_workers=required,
            workers=workers,
            policy=policy,
            tokens=dict(tokens),
            voided=_live_voided(voided, workers),
            legacy=legacy,
            landed=frozenset(landed),
            poisoned=frozenset(poisoned),
            updates=updates,
        )

    @property
    def ever_active(self) -> frozenset[int]:
        """Versions that were the active pointer at some time (read off artifact states)."""
        if self.artifacts is None:
            return frozenset()
        return frozenset(v for v, a in self.artifacts.items() if a.state in EVER_ACTIVE_STATES)


@attrs.frozen
class Violation:
    """A named invariant that failed, with what failed and where in the trace."""

    invariant: str
    message: str
    seq: int | None = None

    def __str__(self) -> str:
        where = f" (event #{self.seq})" if self.seq is not None else ""
        return f"{self.invariant}: {self.message}{where}"


WorldCheck = Callable[[World], list[str]]
StepCheck = Callable[[World, Sequence[TraceEvent], World], list[str]]
EntryCheck = Callable[[LedgerEntry, World], list[str]]
ArtifactCheck = Callable[[ArtifactRecord, World], list[str]]


@attrs.frozen
class Invariant:
    """One named invariant: its kind, its group, what it says, and its predicate."""

    name: str
    kind: Kind
    group: str
    doc: str
    world_check: WorldCheck | None = None
    step_check: StepCheck | None = None
    # record-local `always` checks: judged per entry / artifact, so a replay judges only
    # the records a step wrote (linear in the trace) and names each bad record once
    entry_check: EntryCheck | None = None
    artifact_check: ArtifactCheck | None = None

    def on_world(self, w: World) -> list[str]:
        """This invariant's findings on a whole world (every record, then the global part)."""
        out: list[str] = []
        if self.entry_check is not None:
            for e in w.entries.values():
                out.extend(self.entry_check(e, w))
        if self.artifact_check is not None and w.artifacts is not None:
            for a in w.artifacts.values():
                out.extend(self.artifact_check(a, w))
        if self.world_check is not None:
            out.extend(self.world_check(w))
        return out


K = TypeVar("K")
V = TypeVar("V")


def _overlay(base: Mapping[K, V]) -> ChainMap[K, V]:
    """A step-local view: writes stay local, reads fall through to `base` (no copy)."""
    return ChainMap({}, cast(MutableMapping[K, V], base))


# ---- always: ledger (the write paths enforce the same rules, stated apart in model.rules) --


def _exclusive_ownership(e: LedgerEntry, _w: World) -> list[str]:
    if (e.reserved_by is None) == (e.state == "reserved"):
        return [f"{e.rollout_id}: {e.state} with reserved_by {e.reserved_by!r}"]
    return []


def _reward_failures_clean(e: LedgerEntry, _w: World) -> list[str]:
    out = []
    if e.state in REWARD_FAILURE_STATES and e.reward is not None:
        out.append(f"{e.rollout_id}: reward failure {e.state} carries a reward value")
    if e.state in CARRIES_REWARD_STATES and e.reward is None:
        out.append(f"{e.rollout_id}: {e.state} has no reward value")
    if e.state in ADMITTED_STATES and e.disposition is not None:
        out.append(f"{e.rollout_id}: {e.state} yet recorded as failed ({e.disposition.cause})")
    return out


def _admitted_when_reserved(e: LedgerEntry, _w: World) -> list[str]:
    """What a reserved or consumed rollout's stamp must show: an accepted decision for this
    rollout's version, 0 <= lag <= its L_max, a finite drift within its D_max."""
    if e.state not in ADMITTED_STATES:
        return []
    a = e.admission
    if a is None:
        return [f"{e.rollout_id}: {e.state} without an admission stamp"]
    lag = a.current_version - a.behavior_version
    drift_ok = (
        isinstance(a.drift, int | float)
        and not isinstance(a.drift, bool)
        and math.isfinite(a.drift)
        and 0 <= a.drift <= a.max_drift
    )
    passed = (
        a.accepted is True
        and a.reason == "ok"
        and a.behavior_version == e.behavior_version
        and 0 <= lag <= a.max_lag
        and drift_ok
    )
    if passed:
        return []
    return [
        f"{e.rollout_id}: {e.state} on a stamp that did not pass (accepted={a.accepted!r}, "
        f"reason {a.reason!r}, v{a.behavior_version} for v{e.behavior_version}, lag {lag} "
        f"of {a.max_lag}, drift {a.drift} of {a.max_drift})"
    ]


def _entry_stage(e: LedgerEntry, _w: World) -> list[str]:
    stages = LIFECYCLE.stages(e.state)
    if stages and (e.disposition is None or e.disposition.stage not in stages):
        return [f"{e.rollout_id}: {e.state} without a cause recorded at {sorted(stages)}"]
    return []


def _artifact_stage(a: ArtifactRecord, _w: World) -> list[str]:
    stages = ACTIVATION.stages(a.state)
    if stages and (a.failure is None or a.failure.stage not in stages):
        return [f"artifact v{a.version}: {a.state} without a cause recorded at {sorted(stages)}"]
    return []


# ---- always: activation --------------------------------------------------------------------


def _pointer_names_active_artifact(w: World) -> list[str]:
    if w.artifacts is None:
        return []
    out = []
    active = sorted(v for v, a in w.artifacts.items() if a.state == "active")
    p = w.pointer
    if p is None:
        if active:
            out.append(f"no active pointer, yet artifact(s) {active} are active")
        return out
    art = w.artifacts.get(p.version)
    if art is None:
        return [f"pointer names v{p.version}, which is not registered"]
    if not art.committed:
        out.append(f"pointer names v{p.version}, whose artifact is not committed")
    if art.artifact_hash != p.artifact_hash:
        out.append(f"pointer hash {p.artifact_hash!r} differs from v{p.version}'s artifact hash")
    if active != [p.version]:
        out.append(f"pointer names v{p.version} but active artifacts are {active}")
    return out


def _never_active_not_consumed(e: LedgerEntry, w: World) -> list[str]:
    if w.artifacts is None or e.state not in ADMITTED_STATES:
        return []
    art = w.artifacts.get(e.behavior_version)
    if art is not None and art.state in EVER_ACTIVE_STATES:
        return []
    return [
        f"{e.rollout_id}: {e.state} although its version v{e.behavior_version} never became active"
    ]


# ---- step invariants -----------------------------------------------------------------------


def _declared_edges(before: World, events: Sequence[TraceEvent], _after: World) -> list[str]:
    out = []
    seen_entries: ChainMap[str, LedgerEntry] = _overlay(before.entries)
    seen_arts: ChainMap[int, ArtifactRecord] = _overlay(before.artifacts or {})
    for ev in events:
        if isinstance(ev, EntryChanged):
            prev = seen_entries.get(ev.rollout_id)
            if ev.before is None:
                if prev is not None:
                    out.append(f"{ev.rollout_id}: added again over an existing entry")
                elif ev.after.state not in ENTRY_START_STATES:
                    out.append(f"{ev.rollout_id}: created in state {ev.after.state!r}")
            else:
                if prev is not None and prev != ev.before:
                    out.append(f"{ev.rollout_id}: event's before-record is not the stored one")
                src, dst = ev.before.state, ev.after.state
                if not any(e.dest == dst for e in LIFECYCLE.candidates(src, ev.event)):
                    out.append(f"{ev.rollout_id}: {src} --{ev.event}--> {dst} is not declared")
            seen_entries[ev.rollout_id] = ev.after
        elif isinstance(ev, ArtifactChanged):
            prev_a = seen_arts.get(ev.version)
            if ev.before is None:
                if prev_a is not None:
                    out.append(f"artifact v{ev.version}: registered again")
                elif ev.after.state != ACTIVATION.initial:
                    out.append(f"artifact v{ev.version}: registered in state {ev.after.state!r}")
            else:
                src, dst = ev.before.state, ev.after.state
                if not any(e.dest == dst for e in ACTIVATION.candidates(src, ev.event)):
                    out.append(f"artifact v{ev.version}: {src} --{ev.event}--> {dst} not declared")
            seen_arts[ev.version] = ev.after
    return out


def _terminal_absorbing(before: World, events: Sequence[TraceEvent], _after: World) -> list[str]:
    out = []
    for ev in events:
        if not isinstance(ev, EntryChanged | ArtifactChanged) or ev.before is None:
            continue
        if isinstance(ev, EntryChanged) and ev.before.state in LIFECYCLE.terminal:
            out.append(f"{ev.rollout_id}: left terminal state {ev.before.state!r}")
        elif isinstance(ev, ArtifactChanged) and ev.before.state in ACTIVATION.terminal:
            out.append(f"artifact v{ev.version}: left terminal state {ev.before.state!r}")
    return out


def _revision_bumps_by_one(_b: World, events: Sequence[TraceEvent], _a: World) -> list[str]:
    out = []
    for ev in events:
        if not isinstance(ev, EntryChanged):
            continue
        if ev.before is None:
            if ev.after.revision != 0:
                out.append(f"{ev.rollout_id}: created at revision {ev.after.revision}, not 0")
        elif ev.after.revision != ev.before.revision + 1:
            out.append(
                f"{ev.rollout_id}: {ev.event} moved revision {ev.before.revision} -> "
                f"{ev.after.revision}"
            )
    return out


def _consumed_by_its_reserver(before: LedgerEntry, update_id: str | None) -> bool:
    """Only the update holding the reservation may consume the rollout."""
    return before.reserved_by is not None and before.reserved_by == update_id


def _exactly_once(before: World, events: Sequence[TraceEvent], _after: World) -> list[str]:
    out = []
    for ev in events:
        if (
            isinstance(ev, EntryChanged)
            and ev.before is not None
            and ev.before.state == ev.after.state == "reserved"
            and ev.before.reserved_by != ev.after.reserved_by
        ):
            out.append(
                f"{ev.rollout_id}: reservation passed from {ev.before.reserved_by!r} to "
                f"{ev.after.reserved_by!r} on {ev.event!r} without being returned"
            )
        if not isinstance(ev, EntryChanged) or ev.after.state != "consumed" or ev.before is None:
            continue
        if ev.before.state == "consumed":
            out.append(f"{ev.rollout_id}: consumed a second time")
        elif not _consumed_by_its_reserver(ev.before, ev.update_id):
            out.append(
                f"{ev.rollout_id}: consumed by {ev.update_id!r}, reserved by "
                f"{ev.before.reserved_by!r}"
            )
    return out


def _commit_takes_all_held(before: World, events: Sequence[TraceEvent], _after: World) -> list[str]:
    """Stated over the replayed history, apart from the ledger's commit_mismatch: a commit
    that consumes consumes EVERY rollout its update held reserved just before it (its ids
    must be exactly what the update holds at the commit's own moment). A reservation for
    the update recorded before the commit yet left reserved by it is an answer true at no
    instant (PostgreSQL's commit once read what the update held before taking its lock)."""
    consumed: dict[str, set[str]] = {}
    for ev in events:
        if (
            isinstance(ev, EntryChanged)
            and ev.event == "commit"
            and ev.update_id is not None
            and ev.after.state == "consumed"
        ):
            consumed.setdefault(ev.update_id, set()).add(ev.rollout_id)
    if not consumed:
        return []
    index = before.pacing if before.pacing is not None else PacingIndex(before.entries.values())
    out = []
    for u, took in sorted(consumed.items()):
        left = sorted(index.held.get(u, set()) - took)
        if left:
            out.append(
                f"update {u!r} committed {sorted(took)[:5]} while it also held {left[:5]} "
                "reserved: a commit takes exactly what its update holds at its moment"
            )
    return out


# the cause a rollback records on the rolled-back artifact when the operator keeps its
# rollouts (a recorded fact; the judgement below is not shared with the write path)
_ROLLBACK_KEPT = "rolled_back_kept"


def _retired(art: ArtifactRecord | None) -> bool:
    """A rolled-back version's rollouts are retired unless the rollback recorded 'kept'."""
    return (
        art is not None
        and art.state == "rolled_back"
        and (art.failure is None or art.failure.cause != _ROLLBACK_KEPT)
    )


def _reserved_against_current_version(
    before: World, events: Sequence[TraceEvent], _after: World
) -> list[str]:
    """A reservation, judged on the deployment's replayed state at its own step.

    Stated on its own (no call into the enforcing rules): the recorded admission policy of
    that moment bounds the stamp (never looser) and the lag from the pointer of that
    moment; the rollout's version and the version it was admitted against were active at
    some time, the rollout carries the hash the registry holds for its version, and the
    rollout's version was not retired by a rollback.
    """
    if before.artifacts is None:
        return []
    out = []
    pointer, policy = before.pointer, before.policy
    arts: ChainMap[int, ArtifactRecord] = _overlay(before.artifacts)
    for ev in events:
        if isinstance(ev, ArtifactChanged):
            pointer = ev.pointer_after
            arts[ev.version] = ev.after
            continue
        if isinstance(ev, PolicyChanged):
            policy = ev.after
            continue
        if not isinstance(ev, EntryChanged) or ev.event != "reserve":
            continue
        if ev.after.state != "reserved":
            continue
        rid, v, stamp = ev.rollout_id, ev.after.behavior_version, ev.after.admission

        def ever(version: int) -> bool:
            art = arts.get(version)
            return art is not None and art.state in EVER_ACTIVE_STATES

        if policy is None:
            out.append(f"{rid}: reserved while the deployment recorded no admission policy")
            continue
        if stamp is None:
            continue  # admitted_when_reserved names a missing stamp
        if stamp.max_lag > policy.max_lag or stamp.max_drift > policy.max_drift:
            out.append(
                f"{rid}: reserved on a stamp judged with max_lag {stamp.max_lag} / max_drift "
                f"{stamp.max_drift}, looser than the recorded policy {policy.max_lag} / "
                f"{policy.max_drift}"
            )
        if stamp.drift is None or not 0 <= stamp.drift <= policy.max_drift:
            out.append(f"{rid}: reserved with drift {stamp.drift} over {policy.max_drift}")
        if not ever(v):
            out.append(f"{rid}: reserved although v{v} never became the active version")
        elif _retired(arts.get(v)):
            out.append(f"{rid}: reserved although v{v} was rolled back (retired)")
        registered = arts.get(v)
        if (
            ever(v)
            and registered is not None
            and registered.artifact_hash != ev.after.artifact_hash
        ):
            out.append(
                f"{rid}: reserved stamped v{v} with hash {ev.after.artifact_hash!r}, but the "
                f"registry's v{v} is {registered.artifact_hash!r}"
            )
        if not ever(stamp.current_version):
            out.append(
                f"{rid}: admitted against v{stamp.current_version}, never the active version"
            )
        if pointer is None:
            out.append(f"{rid}: reserved while no version was active")
        elif not 0 <= pointer.version - v <= min(policy.max_lag, stamp.max_lag):
            out.append(
                f"{rid}: reserved at lag {pointer.version - v} from the active v"
                f"{pointer.version}, outside [0, {min(policy.max_lag, stamp.max_lag)}]"
            )
    return out


def _lineage_fenced(before: World, events: Sequence[TraceEvent], _after: World) -> list[str]:
    """A version names its lineage once; unless the recorded policy opts out (lineage
    'off'), it is registered, committed and activated only while every update of its
    lineage has a landed commit in the replayed history, was never poisoned (as the spec
    derives it: a lost lease, a recorded poisoning), and is in no other version's lineage
    (so every rollout that reached it was consumed, exactly once, by an update it names,
    and no rollout is in two versions' lineage)."""
    out = []
    arts: ChainMap[int, ArtifactRecord] = _overlay(before.artifacts or {})
    fenced = before.policy is None or before.policy.lineage != "off"
    for ev in events:
        if not isinstance(ev, ArtifactChanged):
            continue
        lineage = ev.after.trained_by
        prior = arts.get(ev.version)
        arts[ev.version] = ev.after
        if prior is not None and prior.trained_by != lineage:
            out.append(f"artifact v{ev.version}: lineage changed on {ev.event!r}")
        if not fenced or ev.event not in ("register", "commit_artifact", "activate"):
            continue
        missing = sorted(u for u in lineage if u not in before.landed)
        if missing:
            out.append(
                f"artifact v{ev.version}: {ev.event} although update(s) {missing} of its "
                "lineage have no landed commit"
            )
        poisoned = sorted(u for u in lineage if u in before.poisoned)
        if poisoned:
            out.append(
                f"artifact v{ev.version}: {ev.event} although update(s) {poisoned} of its "
                "lineage are poisoned"
            )
        twice = sorted(
            f"{u} (also v{v})"
            for v, a in arts.items()
            if v != ev.version
            for u in a.trained_by
            if u in lineage
        )
        if twice:
            out.append(
                f"artifact v{ev.version}: {ev.event} although update(s) {twice} are in "
                "another version's lineage"
            )
    return out


_UPDATE_MOVES = {
    # event -> (statuses it may start from (None: unrecorded), the status it leaves)
    "open": ((None,), "open"),
    "land": ((None, "open"), "landed"),
    "poison": ((None, "open", "landed"), "poisoned"),
}


def _update_status_follows(before: World, events: Sequence[TraceEvent], _after: World) -> list[str]:
    """An update's record changes only as the history says it must: recorded at its first
    reservation, landed by a commit that consumed rollouts, poisoned for good (a lost lease
    poisons its holder in the same step); never changed otherwise. Judged once the history
    records updates at all."""
    out: list[str] = []
    recs: ChainMap[str, UpdateRecord] = _overlay(before.updates)
    reserved: set[str] = set()
    committed: set[str] = set()
    lost: dict[str, list[str]] = {}
    tracked = bool(before.updates)
    for ev in events:
        if isinstance(ev, EntryChanged):
            owner = ev.after.reserved_by
            if ev.event == "reserve" and ev.after.state == "reserved" and owner is not None:
                reserved.add(owner)
            if ev.event == "commit" and ev.update_id is not None and ev.after.state == "consumed":
                committed.add(ev.update_id)
            holder = _lost_lease(ev)
            if holder is not None:
                lost.setdefault(holder, []).append(ev.rollout_id)
            continue
        if not isinstance(ev, UpdateChanged):
            continue
        tracked = True
        u, prev, a = ev.update_id, recs.get(ev.update_id), ev.after
        if ev.before != prev or a.update_id != u:
            out.append(f"update {u!r}: {ev.event} over a record that is not the replayed one")
        start, status = _UPDATE_MOVES.get(ev.event, ((), ""))
        was = None if prev is None else prev.status
        if was not in start or a.status != status:
            out.append(f"update {u!r}: {was} --{ev.event}--> {a.status} is not a legal move")
        if ev.event == "open" and u not in reserved:
            out.append(f"update {u!r}: recorded in a step where it reserved nothing")
        if ev.event == "land" and u not in committed:
            out.append(f"update {u!r}: landed in a step where it consumed nothing")
        recs[u] = a
    if not tracked:
        return out
    for u, rids in sorted(lost.items()):
        rec = recs.get(u)
        if rec is None or rec.status != "poisoned":
            out.append(f"update {u!r}: lost the lease of {rids[:3]} but is not poisoned")
    for u in sorted(committed):
        rec = recs.get(u)
        if rec is None or rec.status != "landed":
            out.append(f"update {u!r}: a commit of it landed but it is recorded {rec}")
    for u in sorted(reserved - recs.keys()):
        out.append(f"update {u!r}: reserved without the ledger recording it")
    return out


def _poisoned_update_never_lands(
    before: World, events: Sequence[TraceEvent], _after: World
) -> list[str]:
    """No poisoned update (as the spec derives it) reserves or consumes anything, and no
    commit consumes a rollout of a version retired by a rollback at that moment."""
    out: list[str] = []
    arts: ChainMap[int, ArtifactRecord] = _overlay(before.artifacts or {})
    for ev in events:
        if isinstance(ev, ArtifactChanged):
            arts[ev.version] = ev.after
            continue
        if not isinstance(ev, EntryChanged) or ev.before is None:
            continue
        owner = ev.after.reserved_by
        if ev.event == "reserve" and ev.after.state == "reserved" and owner in before.poisoned:
            out.append(f"{ev.rollout_id}: reserved by {owner!r}, a poisoned update")
        if ev.event != "commit" or ev.after.state != "consumed":
            continue
        if ev.update_id in before.poisoned:
            out.append(f"{ev.rollout_id}: consumed by {ev.update_id!r}, a poisoned update")
        v = ev.after.behavior_version
        if before.artifacts is not None and _retired(arts.get(v)):
            out.append(f"{ev.rollout_id}: consumed although v{v} was rolled back (retired)")
    return out


def _policy_explicit(before: World, events: Sequence[TraceEvent], _after: World) -> list[str]:
    out = []
    for ev in events:
        if not isinstance(ev, PolicyChanged):
            continue
        if ev.before != before.policy:
            out.append(
                f"policy change from {ev.before} does not start from the recorded {before.policy}"
            )
        if not ev.reason:
            out.append("admission policy changed without a recorded reason")
        if len(events) > 1:
            out.append("a policy change shares its atomic step with other writes")
    return out


def _activation_needs_all_acks(
    before: World, events: Sequence[TraceEvent], _after: World
) -> list[str]:
    """Judged on replayed, durable state: the required set recorded by explicit membership
    changes, the acks the registry really stored and the tokens the attempts issued (as
    replayed by the spec's own rule), never on what the activator claims it used."""
    out = []
    required = before.required_workers
    reports: ChainMap[str, WorkerReport] = _overlay(before.workers)
    arts: ChainMap[int, ArtifactRecord] = _overlay(before.artifacts or {})
    tokens: Mapping[TokenKey, AttemptToken] = before.tokens
    voided, legacy = before.voided, before.legacy
    for ev in events:
        tokens = next_tokens(tokens, ev, required)
        voided = next_voided(voided, ev, required, reports)
        legacy = next_legacy(legacy, ev)
        if isinstance(ev, MembershipChanged):
            required = ev.after
            continue
        if isinstance(ev, WorkerReported):
            reports[ev.worker_id] = WorkerReport(ev.worker_id, ev.floor, ev.ack)
            continue
        if not isinstance(ev, ArtifactChanged):
            continue
        prior = arts.get(ev.version, ev.before)
        arts[ev.version] = ev.after
        if ev.after.state != "active" or ev.event != "activate":
            continue
        art = ev.after
        if not art.committed or art.artifact_hash is None:
            out.append(f"artifact v{ev.version}: activated without a committed artifact")
            continue
        if not required:
            out.append(f"artifact v{ev.version}: activated with no required worker set recorded")
            continue
        attempt = art.attempts if prior is None else prior.attempts
        for w in required:
            r = reports.get(w)
            a = None if r is None else r.ack
            t = tokens.get((ev.version, w))
            if a is None:
                out.append(f"artifact v{ev.version}: activated without an ack from {w!r}")
            elif a.version != ev.version or a.artifact_hash != art.artifact_hash:
                out.append(
                    f"artifact v{ev.version}: activated on {w!r}'s ack of v{a.version} "
                    f"hash {a.artifact_hash[:12]}"
                )
            elif ev.version in legacy:
                if a.attempt != attempt:  # recorded before tokens: the attempt number rule
                    out.append(
                        f"artifact v{ev.version}: activated on {w!r}'s ack of attempt "
                        f"{a.attempt}, not the current attempt {attempt}"
                    )
            elif t is None or t.attempt != attempt or a.token != t.token:
                out.append(
                    f"artifact v{ev.version}: activated on {w!r}'s ack echoing token "
                    f"{a.token!r}, not the token of the current attempt {attempt}"
                )
            elif w in voided:
                out.append(
                    f"artifact v{ev.version}: activated on {w!r}'s ack stored before a "
                    "membership change removed it (leaving voids a worker's acks)"
                )
        p = ev.pointer_after
        if p is None or p.version != ev.version or p.artifact_hash != art.artifact_hash:
            out.append(f"artifact v{ev.version}: activated but the pointer is {p}")
    return out


def _membership_explicit(before: World, events: Sequence[TraceEvent], _after: World) -> list[str]:
    out = []
    for ev in events:
        if not isinstance(ev, MembershipChanged):
            continue
        if not ev.after or len(set(ev.after)) != len(ev.after):
            out.append(f"required worker set changed to {list(ev.after)}")
        if ev.before != before.required_workers:
            out.append(
                f"membership change from {ev.before} does not start from the recorded "
                f"{before.required_workers}"
            )
        if not ev.reason:
            out.append("membership changed without a recorded reason")
        leavers = set(before.required_workers or ()) - set(ev.after)
        # the one companion it may have: voiding a leaver's ack (see acks_bound_to_attempt)
        others = [
            e
            for e in events
            if e is not ev
            and not (isinstance(e, WorkerReported) and e.worker_id in leavers and e.ack is None)
        ]
        if others:
            out.append("a membership change shares its atomic step with other writes")
    return out


def _acks_bound_to_attempt(before: World, events: Sequence[TraceEvent], after: World) -> list[str]:
    """Tokens come from attempts and joins only; leaving voids; a stored token is current
    and counts once.

    Every distribution attempt issues one fresh token per required worker, for its own
    attempt number; a membership change issues tokens only to joiners, for the version
    awaiting acks, and leaves no leaver's ack standing; an ack is stored with a token only
    if it echoes the current token of its worker and version, awaiting acks; and a token
    stored once is never stored again after the worker's report moved on (a later report
    voids it: a duplicate of the voided ack must not count).
    """
    out: list[str] = []
    required = before.required_workers
    tokens = before.tokens
    reports: ChainMap[str, WorkerReport] = _overlay(before.workers)
    arts: ChainMap[int, ArtifactRecord] = _overlay(before.artifacts or {})
    for ev in events:
        if isinstance(ev, ArtifactChanged):
            arts[ev.version] = ev.after
            if ev.event in ATTEMPT_EVENTS and ev.tokens is not None:
                out.extend(_attempt_issue_problems(ev, required, tokens))
            elif ev.tokens:
                out.append(f"artifact v{ev.version}: {ev.event!r} issues attempt tokens")
        elif isinstance(ev, MembershipChanged) and ev.tokens is not None:
            joiners = set(ev.after) - set(required or ())
            awaiting = {v: a for v, a in arts.items() if a.state == "awaiting_acks"}
            got = {(t.version, t.worker_id) for t in ev.tokens}
            for t in ev.tokens:
                rec = awaiting.get(t.version)
                if t.worker_id not in joiners or rec is None or t.attempt != rec.attempts:
                    out.append(
                        f"membership change issues {t.worker_id!r} a token for v{t.version} "
                        f"attempt {t.attempt}: only joiners get one, for the version awaiting acks"
                    )
            for v in awaiting:
                for w in sorted(joiners):
                    if (v, w) not in got:
                        out.append(f"{w!r} joins while v{v} awaits acks without a token")
            for w in sorted(set(required or ()) - set(ev.after)):
                r = after.workers.get(w)
                if r is not None and r.ack is not None:
                    out.append(f"{w!r} left the worker set but its ack still stands")
        elif isinstance(ev, WorkerReported):
            ack = ev.ack
            prev = reports.get(ev.worker_id)
            reports[ev.worker_id] = WorkerReport(ev.worker_id, ev.floor, ack)
            if ack is None or ack.token is None or (prev is not None and prev.ack == ack):
                continue
            art = arts.get(ack.version)
            cur = tokens.get((ack.version, ev.worker_id))
            if (
                ev.worker_id not in (required or ())
                or art is None
                or art.state != "awaiting_acks"
                or cur is None
                or cur.attempt != art.attempts
                or cur.token != ack.token
            ):
                out.append(
                    f"{ev.worker_id!r}'s ack of v{ack.version} stored with token {ack.token!r}, "
                    "which is not its current attempt token"
                )
            elif cur.spent and (prev is None or prev.ack is None or prev.ack.token != ack.token):
                out.append(
                    f"{ev.worker_id!r}'s ack of v{ack.version} counted token {ack.token!r} "
                    "again after a later report voided it (an attempt token counts once)"
                )
        tokens = next_tokens(tokens, ev, required)
        if isinstance(ev, MembershipChanged):
            required = ev.after
    return out


def _attempt_issue_problems(
    ev: ArtifactChanged,
    required: tuple[str, ...] | None,
    tokens: Mapping[TokenKey, AttemptToken],
) -> list[str]:
    """What is wrong with the tokens one distribution attempt issued."""
    out = []
    issued = ev.tokens or ()
    by_worker = {t.worker_id: t for t in issued}
    if sorted(by_worker) != sorted(required or ()) or len(by_worker) != len(issued):
        out.append(
            f"artifact v{ev.version}: {ev.event} issues tokens to {sorted(by_worker)}, not one "
            f"to each required worker {sorted(required or ())}"
        )
    if len({t.token for t in issued}) != len(issued):
        out.append(f"artifact v{ev.version}: {ev.event} issues one token to two workers")
    for t in issued:
        old = tokens.get((ev.version, t.worker_id))
        if t.version != ev.version or t.attempt != ev.after.attempts:
            out.append(
                f"artifact v{ev.version}: {ev.event} issues a token for v{t.version} attempt "
                f"{t.attempt}, not for its own attempt {ev.after.attempts}"
            )
        elif old is not None and old.token == t.token:
            out.append(
                f"artifact v{ev.version}: {ev.event} reissues {t.worker_id!r}'s previous token"
            )
    return out


# the cause of a distribution attempt failed at its ack deadline (model.coordinator states it
# too; stated here on its own, as the trace records it)
_ACK_DEADLINE_PASSED = "ack_deadline_passed"


def _ack_deadline_respected(
    before: World, events: Sequence[TraceEvent], _after: World
) -> list[str]:
    """A distribution attempt records a deadline after its own time; an attempt is failed
    for a passed deadline only once the deadline it recorded has passed, on the step's own
    clock (a record written before deadlines existed carries none and is not judged)."""
    out = []
    arts: ChainMap[int, ArtifactRecord] = _overlay(before.artifacts or {})
    for ev in events:
        if not isinstance(ev, ArtifactChanged):
            continue
        prior = arts.get(ev.version, ev.before)
        arts[ev.version] = ev.after
        deadline = ev.after.ack_deadline
        if ev.event in ATTEMPT_EVENTS and deadline is not None and not deadline > ev.at:
            out.append(
                f"artifact v{ev.version}: {ev.event} at {ev.at!r} records ack deadline "
                f"{deadline!r}, not after the attempt itself"
            )
        failure = ev.after.failure
        if (
            ev.event == "fail_distribution"
            and failure is not None
            and failure.cause == _ACK_DEADLINE_PASSED
        ):
            due = None if prior is None else prior.ack_deadline
            if due is None or ev.at < due:
                out.append(
                    f"artifact v{ev.version}: failed for a passed ack deadline at {ev.at!r}, "
                    f"before the attempt's recorded deadline {due!r}"
                )
    return out


def _pointer_monotonic(before: World, events: Sequence[TraceEvent], _after: World) -> list[str]:
    out = []
    arts: ChainMap[int, ArtifactRecord] = _overlay(before.artifacts or {})
    for ev in events:
        if not isinstance(ev, ArtifactChanged):
            continue
        pb, pa = ev.pointer_before, ev.pointer_after
        if pb != pa and pa is not None and pb is not None and pa.version <= pb.version:
            rolled = arts.get(pb.version)
            legal = (
                ev.event in ("roll_back", "reinstate")
                and rolled is not None
                and rolled.rollback_version == pa.version
            )
            if not legal:
                out.append(
                    f"pointer moved back v{pb.version} -> v{pa.version} on {ev.event!r} "
                    "(only an explicit rollback to the recorded pointer may)"
                )
        if pb != pa and pa is None:
            out.append(f"pointer cleared on {ev.event!r}")
        arts[ev.version] = ev.after
    return out


def _distributed_newer_than_active(
    before: World, events: Sequence[TraceEvent], _after: World
) -> list[str]:
    return [
        f"artifact v{ev.version}: {ev.event} while v{ev.pointer_before.version} is active "
        "(an older or equal version can never activate and would hold the distribution slot)"
        for ev in events
        if isinstance(ev, ArtifactChanged)
        and ev.event in ("distribute", "retry")
        and ev.pointer_before is not None
        and ev.version <= ev.pointer_before.version
    ]


def _failure_keeps_pointer(_b: World, events: Sequence[TraceEvent], _a: World) -> list[str]:
    return [
        f"artifact v{ev.version}: {ev.event} moved the pointer {ev.pointer_before} -> "
        f"{ev.pointer_after}"
        for ev in events
        if isinstance(ev, ArtifactChanged)
        and ev.after.state in FAILED_ACTIVATION
        and ev.pointer_before != ev.pointer_after
    ]


def _artifact_immutable(before: World, events: Sequence[TraceEvent], _after: World) -> list[str]:
    out = []
    for ev in events:
        if not isinstance(ev, ArtifactChanged) or ev.before is None:
            continue
        if (
            ev.before.artifact_hash is not None
            and ev.after.artifact_hash != ev.before.artifact_hash
        ):
            out.append(
                f"artifact v{ev.version}: hash changed {ev.before.artifact_hash[:12]} -> "
                f"{(ev.after.artifact_hash or '')[:12]}"
            )
    return out


# ---- eventually (at quiescence) ------------------------------------------------------------


def _activations_resolve(w: World) -> list[str]:
    return [
        f"artifact v{v}: still {a.state} with nothing pending"
        for v, a in (w.artifacts or {}).items()
        if a.state in UNRESOLVED_ACTIVATION
    ]


def _failed_version_quarantined(w: World) -> list[str]:
    if w.artifacts is None:
        return []
    failed = {
        v for v, a in w.artifacts.items() if a.state in FAILED_ACTIVATION and v not in w.ever_active
    }
    return [
        f"{e.rollout_id}: still {e.state} although its version v{e.behavior_version} failed "
        "activation (rollouts from partially loaded weights must be quarantined)"
        for e in w.entries.values()
        if e.behavior_version in failed and e.state in OPEN_STATES
    ]


def _retired_version_quarantined(w: World) -> list[str]:
    if w.artifacts is None:
        return []
    retired = {v for v, a in w.artifacts.items() if _retired(a)}
    return [
        f"{e.rollout_id}: still {e.state} although its version v{e.behavior_version} was "
        "rolled back (its rollouts are retired unless the operator kept them)"
        for e in w.entries.values()
        if e.behavior_version in retired and e.state in OPEN_STATES and e.state != "reserved"
    ]


def _reservations_resolve(w: World) -> list[str]:
    return [
        f"{e.rollout_id}: still reserved by {e.reserved_by!r} with nothing pending"
        for e in w.entries.values()
        if e.state == "reserved"
    ]


# ---- step: serving (a generator that names itself in its rollout ids) -----------------------

# Rollout ids of the form "<worker>@<incarnation>/<anything>" name the generation worker and
# its incarnation (the activation drill writes them so; docs/activation-drill.md). Ids of
# any other form say nothing about who generated them and are not judged here.
_SERVED_BY = re.compile(r"^(?P<worker>[^@/\s]+)@(?P<incarnation>[0-9]+)/")


def _creations(events: Sequence[TraceEvent]) -> list[tuple[LedgerEntry, LedgerEntry]]:
    """The entries a step created, each with the entry it is at the end of the step (one
    quarantined on arrival is not live)."""
    last: dict[str, LedgerEntry] = {}
    born: list[LedgerEntry] = []
    for ev in events:
        if isinstance(ev, EntryChanged):
            if ev.before is None:
                born.append(ev.after)
            last[ev.rollout_id] = ev.after
    return [(e, last[e.rollout_id]) for e in born]


def _paced_dispatch(before: World, events: Sequence[TraceEvent], _after: World) -> list[str]:
    """Stated over the replayed history, apart from model.pacing: at each dispatch (a new
    entry with an attempt chain) the deployment's pointer and policy of that moment bound
    the version (active or was, not rolled back, within max_lag), the chain and its
    attempts; with a budget recorded, every new entry that is live (dispatched or added)
    counts against the live rollouts that can still be trained; and under the policy's
    chain_key 'identity', every new entry of a paced deployment is counted on a chain."""
    new = _creations(events)
    if not new:
        return []
    out: list[str] = []
    index = before.pacing if before.pacing is not None else PacingIndex(before.entries.values())
    chains: dict[str, list[LedgerEntry]] = {}
    for e, _ in new:
        if e.chain is not None and e.chain not in chains:
            chains[e.chain] = [before.entries[r] for r in index.chains.get(e.chain, ())]
    pol, ptr = before.policy, before.pointer
    paced = before.artifacts is not None and pol is not None and ptr is not None
    arts = before.artifacts or {}
    live = 0
    if paced and pol is not None and ptr is not None and pol.batch_size is not None:
        live = index.live_from(ptr.version - pol.max_lag)
    for e, end in new:
        if e.chain is not None:
            earlier = chains.setdefault(e.chain, [])
            if e.attempt != len(earlier) + 1:
                out.append(
                    f"{e.rollout_id}: attempt {e.attempt} of chain {e.chain!r}, which had "
                    f"{len(earlier)} attempt(s) before"
                )
            busy = [
                x.rollout_id for x in earlier if x.state in OPEN_STATES or x.state == "consumed"
            ]
            if busy:
                out.append(
                    f"{e.rollout_id}: dispatched while chain {e.chain!r} had a live or trained "
                    f"attempt ({', '.join(busy[:3])})"
                )
            earlier.append(e)
        if not paced or pol is None or ptr is None:
            continue
        v, p = e.behavior_version, ptr.version
        if e.chain is not None:
            if v > p or v not in before.ever_active or p - v > pol.max_lag:
                out.append(
                    f"{e.rollout_id}: dispatched on v{v} with the pointer at v{p} "
                    f"(max_lag {pol.max_lag}): not a version that can still be trained"
                )
            elif _retired(arts.get(v)):
                out.append(f"{e.rollout_id}: dispatched on v{v}, which was rolled back")
            if pol.max_attempts is not None and e.attempt > pol.max_attempts:
                out.append(
                    f"{e.rollout_id}: attempt {e.attempt} of chain {e.chain!r} exceeds "
                    f"max_attempts {pol.max_attempts}"
                )
        elif pol.chain_key == "identity" and (
            pol.batch_size is not None or pol.max_attempts is not None
        ):
            out.append(
                f"{e.rollout_id}: entered a paced deployment on no attempt chain (its "
                "prompt's attempts go uncounted)"
            )
        if pol.batch_size is not None and end.state in OPEN_STATES and v >= p - pol.max_lag:
            budget = (pol.max_lag + 1) * pol.batch_size
            if live >= budget:
                out.append(
                    f"{e.rollout_id}: entered with {live} live rollouts within max_lag of "
                    f"v{p}, the budget being {budget}"
                )
            live += 1
    return out


def _accounted_for(e: LedgerEntry, _w: World) -> list[str]:
    if e.state in OPEN_STATES or e.state == "consumed":
        return []
    if e.disposition is None or not e.disposition.cause:
        return [f"{e.rollout_id}: ended {e.state} without a recorded cause"]
    return []


def _holds(rep: WorkerReport, incarnation: int, e: LedgerEntry) -> bool:
    """Whether a worker's stored report says that this incarnation of it holds what `e` was
    generated with: an ack of this same incarnation, not below the restart floor, of the
    rollout's (version, hash)."""
    ack = rep.ack
    return (
        ack is not None
        and incarnation >= rep.floor
        and ack.incarnation == incarnation
        and (ack.version, ack.artifact_hash) == (e.behavior_version, e.artifact_hash)
    )


def _served_after_sync(before: World, events: Sequence[TraceEvent], _after: World) -> list[str]:
    """A worker serves only what it reported holding in its current incarnation: a rollout
    it adds must carry the (version, hash) of its stored report, of that same incarnation,
    not below its restart floor. A restarted worker that serves before it resynced (a load
    reported after the restart) has no such report."""
    if before.artifacts is None:
        return []
    out = []
    for ev in events:
        if not isinstance(ev, EntryChanged) or ev.before is not None:
            continue
        m = _SERVED_BY.match(ev.rollout_id)
        if m is None:
            continue
        worker, inc = m.group("worker"), int(m.group("incarnation"))
        rep = before.workers.get(worker)
        ack = None if rep is None else rep.ack
        e = ev.after
        if rep is not None and _holds(rep, inc, e):
            continue
        held = "nothing" if ack is None else f"v{ack.version} (incarnation {ack.incarnation})"
        floor = 0 if rep is None else rep.floor
        out.append(
            f"{e.rollout_id}: {worker} incarnation {inc} served v{e.behavior_version} but its "
            f"stored report holds {held}, restart floor {floor}: it served before it synced"
        )
    return out


INVARIANTS: tuple[Invariant, ...] = (
    Invariant(
        "declared_edges",
        "step",
        "ledger",
        "Every state change is an edge of the declared machine.",
        step_check=_declared_edges,
    ),
    Invariant(
        "terminal_absorbing",
        "step",
        "ledger",
        "Terminal states are absorbing.",
        step_check=_terminal_absorbing,
    ),
    Invariant(
        "exactly_once",
        "step",
        "ledger",
        "A rollout is consumed at most once, only by the update that reserved it.",
        step_check=_exactly_once,
    ),
    Invariant(
        "commit_takes_all_held",
        "step",
        "ledger",
        "A commit that consumes consumes every rollout its update holds reserved at that "
        "moment: none it held before the commit is left reserved by it.",
        step_check=_commit_takes_all_held,
    ),
    Invariant(
        "exclusive_ownership",
        "always",
        "ledger",
        "reserved_by is set if and only if the state is reserved.",
        entry_check=_exclusive_ownership,
    ),
    Invariant(
        "revision_bumps_by_one",
        "step",
        "ledger",
        "Every successful write bumps the revision by exactly one.",
        step_check=_revision_bumps_by_one,
    ),
    Invariant(
        "reward_failures_never_trained",
        "always",
        "ledger",
        "No reward failure is reserved or carries a reward value; whatever is reserved or "
        "consumed has a real reward.",
        entry_check=_reward_failures_clean,
    ),
    Invariant(
        "admitted_when_reserved",
        "always",
        "ledger",
        "Every reserved or consumed rollout passed admission: 0 <= lag <= L_max and "
        "drift <= D_max.",
        entry_check=_admitted_when_reserved,
    ),
    Invariant(
        "reserved_against_current_version",
        "step",
        "ledger",
        "A reservation was judged against the deployment's state of its own moment: the "
        "recorded admission policy (a stamp never looser), the lag from the active version, "
        "a version that was active and not retired by a rollback.",
        step_check=_reserved_against_current_version,
    ),
    Invariant(
        "lineage_fenced",
        "step",
        "activation",
        "A version is registered, committed and activated only while every update it "
        "records as its lineage has a landed commit, was never poisoned and is in no other "
        "version's lineage (unless the recorded policy turns lineage off); its lineage "
        "never changes.",
        step_check=_lineage_fenced,
    ),
    Invariant(
        "update_status_follows",
        "step",
        "ledger",
        "An update is recorded at its first reservation, landed by a commit that consumed "
        "rollouts, poisoned for good (a lost lease poisons its holder in the same step), "
        "and its record changes no other way.",
        step_check=_update_status_follows,
    ),
    Invariant(
        "poisoned_update_never_lands",
        "step",
        "ledger",
        "A poisoned update (a refused commit, a lost lease) never reserves or consumes "
        "again, and no commit consumes a rollout of a version retired by a rollback.",
        step_check=_poisoned_update_never_lands,
    ),
    Invariant(
        "policy_explicit",
        "step",
        "ledger",
        "The admission policy is durable deployment state, changed only by an explicit, "
        "recorded step of its own.",
        step_check=_policy_explicit,
    ),
    Invariant(
        "failures_have_stage",
        "always",
        "ledger",
        "Every failure is recorded with its own stage.",
        entry_check=_entry_stage,
        artifact_check=_artifact_stage,
    ),
    Invariant(
        "pointer_names_active_artifact",
        "always",
        "activation",
        "The active pointer names the one active, committed artifact, hash for hash.",
        world_check=_pointer_names_active_artifact,
    ),
    Invariant(
        "activation_needs_all_acks",
        "step",
        "activation",
        "A version becomes active only with a committed artifact and every required "
        "worker's ack of the same version and hash, echoing that worker's token of the "
        "attempt current at activation, stored after the worker last left the worker set.",
        step_check=_activation_needs_all_acks,
    ),
    Invariant(
        "acks_bound_to_attempt",
        "step",
        "activation",
        "Each distribution attempt issues every required worker a fresh token; a joiner gets "
        "one for the version awaiting acks; leaving the worker set voids a worker's ack; an "
        "ack is stored with a token only if it echoes its worker's current one, and a token "
        "counts once: after a later report voided its ack, it is never stored again.",
        step_check=_acks_bound_to_attempt,
    ),
    Invariant(
        "ack_deadline_respected",
        "step",
        "activation",
        "Each distribution attempt records an ack deadline after its own time; an attempt "
        "is failed for a passed deadline ('ack_deadline_passed') only at or after the "
        "deadline it recorded.",
        step_check=_ack_deadline_respected,
    ),
    Invariant(
        "membership_explicit",
        "step",
        "activation",
        "The required worker set is durable, non-empty, and changed only by an explicit, "
        "recorded membership change of its own.",
        step_check=_membership_explicit,
    ),
    Invariant(
        "pointer_monotonic",
        "step",
        "activation",
        "The active version only increases, except an explicit rollback to the recorded "
        "rollback pointer.",
        step_check=_pointer_monotonic,
    ),
    Invariant(
        "distributed_newer_than_active",
        "step",
        "activation",
        "Only a version newer than the active one is ever distributed (versions only move "
        "forward).",
        step_check=_distributed_newer_than_active,
    ),
    Invariant(
        "failed_activation_keeps_pointer",
        "step",
        "activation",
        "A failed activation leaves the pointer exactly as it was.",
        step_check=_failure_keeps_pointer,
    ),
    Invariant(
        "never_active_never_consumed",
        "always",
        "activation",
        "No rollout of a version that never became active is reserved or consumed.",
        entry_check=_never_active_not_consumed,
    ),
    Invariant(
        "artifact_immutable",
        "step",
        "activation",
        "A committed artifact's hash never changes; a version is registered once.",
        step_check=_artifact_immutable,
    ),
    Invariant(
        "activations_resolve",
        "eventually",
        "liveness",
        "Once everything is delivered, every activation attempt is activated or failed.",
        world_check=_activations_resolve,
    ),
    Invariant(
        "failed_version_quarantined",
        "rest",
        "activation",
        "Between calls, no rollout of a version that failed activation (and never became "
        "active) is open: failure quarantines them, and late arrivals are quarantined on add.",
        world_check=_failed_version_quarantined,
    ),
    Invariant(
        "retired_version_quarantined",
        "rest",
        "activation",
        "Between calls, no rollout of a rolled-back version waits to be trained (it is "
        "quarantined, now or on arrival) unless the rollback recorded the operator's choice "
        "to keep them; one reserved at the rollback is quarantined when returned.",
        world_check=_retired_version_quarantined,
    ),
    Invariant(
        "reservations_resolve",
        "eventually",
        "liveness",
        "Once everything is delivered, every reservation is committed, released or expired.",
        world_check=_reservations_resolve,
    ),
    Invariant(
        "dispatch_paced",
        "step",
        "ledger",
        "A rollout is dispatched only on a version that can still be trained (active or "
        "was, not rolled back, within max_lag of the pointer), as its chain's next attempt "
        "(numbered 1, 2, ...), with no live or trained attempt of the chain, at most "
        "max_attempts; every new live rollout (dispatched or added) enters while fewer "
        "than (max_lag + 1) x batch_size live rollouts can still be trained; under "
        "chain_key 'identity' every new entry of a paced deployment is on a chain.",
        step_check=_paced_dispatch,
    ),
    Invariant(
        "dispatched_accounted_for",
        "always",
        "ledger",
        "Every dispatched rollout is consumed, live, or ended with a recorded cause.",
        entry_check=_accounted_for,
    ),
    Invariant(
        "served_after_sync",
        "step",
        "activation",
        "A generation worker that names itself in its rollout ids serves only the version "
        "and hash it reported holding in its current incarnation: after a restart, not "
        "before it resynced.",
        step_check=_served_after_sync,
    ),
)

BY_NAME: dict[str, Invariant] = {inv.name: inv for inv in INVARIANTS}
_STEP = tuple(inv for inv in INVARIANTS if inv.kind == "step" and inv.step_check is not None)
_ALWAYS = tuple(inv for inv in INVARIANTS if inv.kind == "always")


def check_world(world: World) -> list[Violation]:
    """Every `always` invariant on one world."""
    out: list[Violation] = []
    for inv in INVARIANTS:
        if inv.kind == "always":
            out.extend(Violation(inv.name, m) for m in inv.on_world(world))
    return out


def check_step(before: World, events: Sequence[TraceEvent], after: World) -> list[Violation]:
    """Every `step` invariant on one atomic step, then every `always` one on the world after."""
    out: list[Violation] = []
    seq = events[0].seq if events else None
    for inv in INVARIANTS:
        if inv.kind == "step" and inv.step_check is not None:
            out.extend(Violation(inv.name, m, seq) for m in inv.step_check(before, events, after))
    out.extend(attrs.evolve(v, seq=seq) for v in check_world(after))
    return out


def check_at_rest(world: World) -> list[Violation]:
    """Every `always` and `rest` invariant: call this between calls, never inside one."""
    out = check_world(world)
    for inv in INVARIANTS:
        if inv.kind == "rest" and inv.world_check is not None:
            out.extend(Violation(inv.name, m) for m in inv.world_check(world))
    return out


def check_quiescent(world: World) -> list[Violation]:
    """Every `rest` and `eventually` invariant, on a world where nothing is pending any more."""
    out: list[Violation] = []
    for inv in INVARIANTS:
        if inv.kind in ("rest", "eventually") and inv.world_check is not None:
            out.extend(Violation(inv.name, m) for m in inv.world_check(world))
    return out


@attrs.frozen
class TraceReport:
    """Outcome of replaying a trace: violations, how many steps and events, the final world."""

    violations: tuple[Violation, ...]
    steps: int
    events: int
    final: World
    checked: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """True when no invariant was violated."""
        return not self.violations


def group_by_txn(events: Iterable[TraceEvent]) -> list[list[TraceEvent]]:
    """Consecutive events sharing a txn number form one atomic step."""
    steps: list[list[TraceEvent]] = []
    for ev in events:
        if steps and steps[-1][-1].txn == ev.txn:
            steps[-1].append(ev)
        else:
            steps.append([ev])
    return steps


class Replayer:
    """Replays a trace one atomic step (txn) at a time against the spec, in linear time.

    The replayed state is kept in mutable maps; each step is judged on a no-copy overlay
    (before / after), the `always` invariants only on the records the step wrote (plus the
    registry-wide ones when the registry changed), and each bad record is reported once,
    when it goes bad, not again at every later step. Every checker that judges new events
    (trace replay, `ledger check`, explorer models, stateful machines) uses this.
    """

    def __init__(self, world: World | None = None, *, with_registry: bool = True) -> None:
        w = world or World(artifacts={} if with_registry else None)
        self.entries: dict[str, LedgerEntry] = dict(w.entries)
        self.artifacts: dict[int, ArtifactRecord] | None = (
            None if w.artifacts is None else dict(w.artifacts)
        )
        self.pointer = w.pointer
        self.required = w.required_workers
        self.workers: dict[str, WorkerReport] = dict(w.workers)
        self.policy = w.policy
        self.tokens: Mapping[TokenKey, AttemptToken] = dict(w.tokens)
        self.voided = w.voided
        self.legacy = w.legacy
        self.landed: set[str] = set(w.landed)
        self.poisoned: set[str] = set(w.poisoned)
        self.updates: dict[str, UpdateRecord] = dict(w.updates)
        self.pacing = PacingIndex(self.entries.values())
        self.steps = 0
        self.events = 0
        self._open: set[tuple[str, str]] = set()

    def view(self) -> World:
        """The replayed state as a World sharing this replayer's maps (do not keep it)."""
        return World(
            entries=self.entries,
            artifacts=self.artifacts,
            pointer=self.pointer,
            required_workers=self.required,
            workers=self.workers,
            policy=self.policy,
            tokens=self.tokens,
            voided=self.voided,
            legacy=self.legacy,
            landed=self.landed,
            poisoned=self.poisoned,
            updates=self.updates,
            pacing=self.pacing,
        )

    def world(self) -> World:
        """A copy of the replayed state."""
        return World(
            entries=dict(self.entries),
            artifacts=None if self.artifacts is None else dict(self.artifacts),
            pointer=self.pointer,
            required_workers=self.required,
            workers=dict(self.workers),
            policy=self.policy,
            tokens=dict(self.tokens),
            voided=self.voided,
            legacy=self.legacy,
            landed=frozenset(self.landed),
            poisoned=frozenset(self.poisoned),
            updates=dict(self.updates),
        )

    def feed(self, events: Iterable[TraceEvent]) -> list[Violation]:
        """Judge and apply `events`, one atomic step at a time; returns new violations."""
        out: list[Violation] = []
        for step in group_by_txn(events):
            out.extend(self._step(step))
        return out

    def _step(self, step: Sequence[TraceEvent]) -> list[Violation]:
        before = self.view()
        e_ch: dict[str, LedgerEntry] = {}
        a_ch: dict[int, ArtifactRecord] = {}
        w_ch: dict[str, WorkerReport] = {}
        pointer, required, policy, registry = self.pointer, self.required, self.policy, False
        tokens, voided, legacy = self.tokens, self.voided, self.legacy
        commits: list[str] = []
        u_ch: dict[str, UpdateRecord] = {}
        poisons: list[str] = []
        for ev in step:
            if isinstance(ev, EntryChanged):
                e_ch[ev.rollout_id] = ev.after
                if ev.event == "commit" and ev.update_id is not None:
                    commits.append(ev.update_id)
                lost = _lost_lease(ev)
                if lost is not None and (lost in self.updates or lost in u_ch):
                    poisons.append(lost)
                continue
            if isinstance(ev, UpdateChanged):
                u_ch[ev.update_id] = ev.after
                if ev.after.status == "poisoned":
                    poisons.append(ev.update_id)
                continue
            if isinstance(ev, RowRecorded):
                continue  # bookkeeping rows: spec.audit replays them against their tables
            registry = True
            tokens = next_tokens(tokens, ev, required)
            voided = next_voided(voided, ev, required, ChainMap(w_ch, self.workers))
            legacy = next_legacy(legacy, ev)
            if isinstance(ev, ArtifactChanged):
                a_ch[ev.version] = ev.after
                pointer = ev.pointer_after
            elif isinstance(ev, MembershipChanged):
                required = ev.after
            elif isinstance(ev, PolicyChanged):
                policy = ev.after
            else:
                w_ch[ev.worker_id] = WorkerReport(ev.worker_id, ev.floor, ev.ack)
        arts: Mapping[int, ArtifactRecord] | None = None
        if self.artifacts is not None or registry:
            arts = ChainMap(a_ch, self.artifacts if self.artifacts is not None else {})
        workers_after = ChainMap(w_ch, self.workers)
        voided = _live_voided(voided, workers_after)
        after = World(
            entries=ChainMap(e_ch, self.entries),
            artifacts=arts,
            pointer=pointer,
            required_workers=required,
            workers=workers_after,
            policy=policy,
            tokens=tokens,
            voided=voided,
            legacy=legacy,
            landed=self.landed.union(commits) if commits else self.landed,
            poisoned=self.poisoned.union(poisons) if poisons else self.poisoned,
            updates=ChainMap(u_ch, self.updates) if u_ch else self.updates,
        )
        seq = step[0].seq if step else None
        out = [
            Violation(inv.name, m, seq)
            for inv in _STEP
            for m in inv.step_check(before, step, after)  # type: ignore[misc]
        ]
        for rid, e in e_ch.items():
            self.pacing.apply(self.entries.get(rid), e)
        self.entries.update(e_ch)
        self.landed.update(commits)
        self.poisoned.update(poisons)
        self.updates.update(u_ch)
        if registry:
            if self.artifacts is None:
                self.artifacts = {}
            self.artifacts.update(a_ch)
            self.workers.update(w_ch)
            self.pointer, self.required, self.policy = pointer, required, policy
            self.tokens, self.voided, self.legacy = tokens, voided, legacy
        now = self.view()
        for inv in _ALWAYS:
            if inv.entry_check is not None:
                for e in e_ch.values():
                    self._judge(inv.name, e.rollout_id, inv.entry_check(e, now), seq, out)
            if inv.artifact_check is not None and now.artifacts is not None:
                for a in a_ch.values():
                    self._judge(inv.name, f"v{a.version}", inv.artifact_check(a, now), seq, out)
            if inv.world_check is not None and registry:
                self._judge(inv.name, "*", inv.world_check(now), seq, out)
        self.steps += 1
        self.events += len(step)
        return out

    def _judge(
        self, name: str, subject: str, found: list[str], seq: int | None, out: list[Violation]
    ) -> None:
        key = (name, subject)
        if found:
            if key not in self._open:  # named when it goes bad, not at every later step
                self._open.add(key)
                out.extend(Violation(name, m, seq) for m in found)
        else:
            self._open.discard(key)


def replay(world: World, events: Iterable[TraceEvent]) -> tuple[World, list[Violation], int]:
    """Apply `events` to `world` one atomic step (txn) at a time, checking each step.

    Returns the world after, the violations, and how many steps were judged (see Replayer).
    """
    r = Replayer(world, with_registry=world.artifacts is not None)
    out = r.feed(events)
    return r.world(), out, r.steps


STORE_INVARIANTS: dict[str, str] = {
    "stored_matches_trace": "The stored rows are exactly what replaying the trace gives: no "
    "row missing, extra or different (a deleted or reverted row is a violation).",
}


def stored_world(ledger: Ledger, registry: RegistryStore | None = None) -> World:
    """The stored rows as a World: the ledger's entries and update records, and the
    registry's durable state."""
    if registry is None:
        return World(entries=ledger.snapshot(), updates=ledger.updates())
    return World(
        entries=ledger.snapshot(),
        updates=ledger.updates(),
        artifacts={a.version: a for a in registry.artifacts()},
        pointer=registry.pointer(),
        required_workers=registry.required_workers(),
        workers=registry.workers(),
        policy=registry.policy(),
        tokens={(t.version, t.worker_id): t for t in registry.attempt_tokens()},
    )


def compare_with_store(replayed: World, stored: World) -> list[Violation]:
    """Rows missing from, extra in, or different in the store, against the replayed trace."""
    name = "stored_matches_trace"
    out: list[Violation] = []
    for rid in sorted(set(replayed.entries) | set(stored.entries)):
        want, got = replayed.entries.get(rid), stored.entries.get(rid)
        if want == got:
            continue
        if want is not None and got is None:
            out.append(Violation(name, f"{rid}: in the trace ({want.state}) but not stored"))
        elif want is None and got is not None:
            out.append(Violation(name, f"{rid}: stored ({got.state}) but no trace event wrote it"))
        elif want is not None and got is not None:
            out.append(
                Violation(
                    name,
                    f"{rid}: stored {got.state} rev {got.revision}, the trace says {want.state} "
                    f"rev {want.revision}",
                )
            )
    if dict(replayed.updates) != dict(stored.updates):
        diff = sorted(
            u
            for u in set(replayed.updates) | set(stored.updates)
            if replayed.updates.get(u) != stored.updates.get(u)
        )
        out.append(Violation(name, f"update records: stored differ from the trace at {diff[:5]}"))
    if stored.artifacts is not None:
        want_a = replayed.artifacts or {}
        for v in sorted(set(want_a) | set(stored.artifacts)):
            if want_a.get(v) != stored.artifacts.get(v):
                out.append(Violation(name, f"artifact v{v}: stored record differs from the trace"))
        if replayed.pointer != stored.pointer:
            out.append(
                Violation(
                    name, f"pointer: stored {stored.pointer}, the trace says {replayed.pointer}"
                )
            )
        if replayed.required_workers != stored.required_workers:
            out.append(
                Violation(
                    name,
                    f"required workers: stored {stored.required_workers}, the trace says "
                    f"{replayed.required_workers}",
                )
            )
        if dict(replayed.workers) != dict(stored.workers):
            out.append(Violation(name, "worker reports: stored reports differ from the trace"))
        if replayed.policy != stored.policy:
            out.append(
                Violation(
                    name,
                    f"admission policy: stored {stored.policy}, the trace says {replayed.policy}",
                )
            )
        if dict(replayed.tokens) != dict(stored.tokens):
            diff = sorted(
                f"v{k[0]}:{k[1]}"
                for k in set(replayed.tokens) | set(stored.tokens)
                if replayed.tokens.get(k) != stored.tokens.get(k)
            )
            out.append(Violation(name, f"attempt tokens: stored differ from the trace at {diff}"))
    return out


def invariant_names(kinds: Iterable[str], *, with_registry: bool) -> tuple[str, ...]:
    """Names of the invariants of these kinds that apply (activation ones need a registry)."""
    want = set(kinds)
    return tuple(
        inv.name
        for inv in INVARIANTS
        if inv.kind in want and (with_registry or inv.group != "activation")
    )


def check_trace(
    events: Iterable[TraceEvent],
    *,
    initial: World | None = None,
    with_registry: bool | None = None,
    quiescent: bool = False,
) -> TraceReport:
    """Replay a trace step by step, checking step and always invariants after each step.

    `with_registry` says whether activation invariants apply; by default they do when the
    trace holds any artifact event. With `quiescent`, the final world must also satisfy the
    eventually invariants (the run ended with nothing pending).
    """
    evs = list(events)
    if with_registry is None:
        with_registry = any(
            not isinstance(e, EntryChanged | RowRecorded | UpdateChanged) for e in evs
        )
    world = initial or World(artifacts={} if with_registry else None)
    if with_registry and world.artifacts is None:
        world = attrs.evolve(world, artifacts={})
    r = Replayer(world, with_registry=with_registry)
    out = r.feed(evs)
    final = r.world()
    kinds = ["always", "step"] + (["rest", "eventually"] if quiescent else [])
    if quiescent:
        out.extend(check_quiescent(final))
    checked = invariant_names(kinds, with_registry=with_registry)
    return TraceReport(tuple(out), r.steps, len(evs), final, checked)


def check(
    snapshot: World | None = None,
    trace: Iterable[TraceEvent] | None = None,
    *,
    quiescent: bool = False,
) -> list[Violation]:
    """One entry point: check a snapshot, a whole trace, or both; returns named violations."""
    if snapshot is None and trace is None:
        raise ValueError("give a snapshot, a trace, or both")
    out: list[Violation] = []
    if trace is not None:
        out.extend(check_trace(trace, quiescent=quiescent).violations)
    if snapshot is not None:
        out.extend(check_world(snapshot))
        if quiescent:
            out.extend(check_quiescent(snapshot))
    return out


def check_reservation(
    before: LedgerEntry | None,
    update_id: str,
    reserved: bool,
    reason: str,
    after: LedgerEntry | None,
) -> list[Violation]:
    """Outcome-level invariants of one reserve call, judged from the entry before and after.

    A failed compare-and-set changes nothing; the owner's repeated reserve succeeds without a
    write (idempotent retry); a success writes exactly one revision and names the owner.
    """
    out: list[Violation] = []
    owner_retry = (
        before is not None and before.state == "reserved" and before.reserved_by == update_id
    )
    if owner_retry:
        if not reserved or reason != "idempotent_retry" or after != before:
            wrote = "a write" if after != before else "no write"
            out.append(
                Violation(
                    "idempotent_retry",
                    f"{update_id!r} re-reserving its own rollout got ({reserved}, {reason!r}) "
                    f"and {wrote}",
                )
            )
        return out
    if not reserved:
        if after != before:
            out.append(
                Violation(
                    "failed_cas_changes_nothing",
                    f"reserve refused ({reason!r}) yet the record changed",
                )
            )
        return out
    if before is None or after is None:
        out.append(Violation("failed_cas_changes_nothing", "reserved a rollout that is absent"))
        return out
    if (
        after.state != "reserved"
        or after.reserved_by != update_id
        or after.revision != before.revision + 1
    ):
        out.append(
            Violation(
                "revision_bumps_by_one",
                f"{after.rollout_id}: reserve by {update_id!r} wrote state {after.state!r}, "
                f"owner {after.reserved_by!r}, revision {before.revision} -> {after.revision}",
            )
        )
    return out


# invariants judged per call rather than per event (see check_reservation)
OUTCOME_INVARIANTS: dict[str, str] = {
    "idempotent_retry": "The owner's repeated reserve succeeds without a write.",
    "failed_cas_changes_nothing": "A failed compare-and-set changes nothing.",
}


def violated_names(violations: Iterable[Violation]) -> Counter[str]:
    """How often each invariant was violated."""
    return Counter(v.invariant for v in violations)


# ---- sometimes -----------------------------------------------------------------------------

SOMETIMES: dict[str, str] = {
    "cas_lost": "a compare-and-set lost to a concurrent writer (revision_conflict)",
    "idempotent_retry": "an update retried its own reservation without a second write",
    "abort_released": "an aborted update returned a rollout to rewarded",
    "abort_quarantined": "the recovery rule quarantined a returned reservation",
    "lease_expired": "a lease ran out and the reservation was returned",
    "renewed_then_expired": "a lease renewed by a heartbeat ran out later, after time passed "
    "its old deadline and then the renewed one, and the reservation was returned",
    "reward_timeout": "a reward timeout was recorded as its own failure",
    "stale_retired": "a stale rollout was retired into the offline buffer",
    "activation_failed": "an activation attempt failed and kept the old pointer",
    "stale_ack_refused": "an ack for another version or hash did not count toward activation",
    "restart_ack_refused": "an ack from before a worker restart did not count",
    "rollback": "an explicit rollback restored the recorded pointer",
    "activated": "a new version became active with all acks",
    "pointer_moved_refused": "a reservation was refused because the pointer moved past the "
    "stamp's lag bound after admission",
    "old_distribution_refused": "a coordinator's distribution of a version older than the "
    "active one was refused",
    "partial_set_refused": "a coordinator asking for a partial worker set was refused",
    "artifact_damaged": "a published artifact's files were damaged on disk (truncated, a "
    "byte flipped, or swapped with another version's)",
    "damaged_load_refused": "a worker's loader read damaged bytes and refused to ack them",
    "late_attempt_ack": "an ack of an earlier distribution attempt arrived during a retry "
    "of the same version (it never counts toward the new attempt)",
    "stale_token_refused": "an ack echoing a token that is not its worker's token of the "
    "current attempt (an earlier attempt's, one from before a re-join, another worker's) was "
    "refused",
    "missing_token_refused": "an ack of the version awaiting acks without any attempt token "
    "(the README's old form) was refused",
    "membership_churn": "the required worker set changed after it was first recorded (a "
    "worker left or re-joined), with acks in flight",
    "non_member_report_recorded": "a report from a worker outside the required set was "
    "recorded as what it holds, and counted for nothing",
    "update_poisoned": "an update was poisoned (a lease of its rollout expired, or a commit "
    "of it was refused): no later commit of it lands",
}


def sometimes_from_events(events: Iterable[TraceEvent]) -> set[str]:
    """The sometimes-properties that a sequence of trace events shows were reached."""
    hit: set[str] = set()
    for ev in events:
        if isinstance(ev, EntryChanged):
            if _lost_lease(ev) is not None:
                hit.add("update_poisoned")
            if ev.event in ("abort", "expire_lease"):
                if ev.after.state == "rewarded":
                    hit.add("abort_released" if ev.event == "abort" else "lease_expired")
                else:
                    hit.add("abort_quarantined")
                    if ev.event == "expire_lease":
                        hit.add("lease_expired")
            elif ev.event == "reward_timeout":
                hit.add("reward_timeout")
            elif ev.event == "retire_stale":
                hit.add("stale_retired")
        elif isinstance(ev, ArtifactChanged):
            if ev.after.state in FAILED_ACTIVATION:
                hit.add("activation_failed")
            elif ev.event == "roll_back":
                hit.add("rollback")
            elif ev.event == "activate":
                hit.add("activated")
        elif isinstance(ev, MembershipChanged) and ev.before is not None:
            hit.add("membership_churn")
        elif isinstance(ev, UpdateChanged) and ev.after.status == "poisoned":
            hit.add("update_poisoned")
    return hit
