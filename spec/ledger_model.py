"""Exhaustive model of racing learners over the real ledger, for the BFS explorer.

Every state is a plain frozen value; every step rebuilds a real `MemoryLedger` from it
(`MemoryLedger.restore`), calls the same method production code calls, and reads the entries
and the events back. Nothing about the lifecycle is retyped here: legality, the revision
compare-and-set, the recovery rule and commit exactness all come from model/. Each step's
events are judged by the spec's step invariants; each state by its always invariants; each
quiescent state by its eventually invariants.

Learners reserve in two separate actions (read a snapshot; later compare-and-set against the
revision read), so the explorer enumerates every interleaving of racing reservers.

With `pacing` (issue 21) the ledger is attached to a fixed registry (v0 active, that pacing
policy recorded) and a generator may `dispatch` new attempts on prompt chains, a bounded
number of times: against the budget, after an attempt failed or was retired (a requeue),
and past the attempt bound. The spec then judges every dispatch with the registry in view
(`dispatch_paced`), and each refusal is checked against the model's own reading of the rule.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import attrs

from rollout_lifecycle.model import ledger as ledger_mod
from rollout_lifecycle.model.errors import CommitMismatch, UpdatePoisoned
from rollout_lifecycle.model.events import EventLog
from rollout_lifecycle.model.ledger import ManualClock, RecoveryRule, WriteRefused
from rollout_lifecycle.model.machines import LIFECYCLE
from rollout_lifecycle.model.records import (
    ActivePointer,
    AdmissionPolicy,
    AdmissionStamp,
    ArtifactRecord,
    BehaviorPolicy,
    Disposition,
    GenerationConditions,
    LedgerEntry,
    Reward,
    Rollout,
    RolloutIdentity,
    UpdateRecord,
)
from rollout_lifecycle.spec.coverage import count_edges
from rollout_lifecycle.spec.explorer import Property
from rollout_lifecycle.spec.invariants import (
    OPEN_STATES,
    Violation,
    World,
    check_quiescent,
    check_reservation,
    check_world,
    replay,
    sometimes_from_events,
)

VERSION = 0
HASH = "h0"
REWARD = Reward("rm", "1", 1.0)
STAMP = AdmissionStamp(
    current_version=VERSION,
    behavior_version=VERSION,
    max_lag=0,
    max_drift=0.2,
    drift=0.0,
    freshness="fresh",
    reason="ok",
    accepted=True,
)
LEASE = 10.0
CONDITIONS = GenerationConditions("tok", 1.0, 1.0, -1, 8)


def prompt_chain(prompt: str) -> str:
    """The attempt chain of prompt `prompt`'s sample 0 in dataset 'd', written out as the
    ledger keys a rollout identity (the model's own reading, not the ledger's function)."""
    return f'["d", "{prompt}", 0]'


# what the budget counts: the lifecycle's non-terminal states, read off the machine
LIVE = OPEN_STATES


@attrs.frozen
class FixedRegistry:
    """The registry a paced ledger reads: v0 active for good, `policy` recorded."""

    policy: AdmissionPolicy
    lock: threading.RLock = attrs.field(factory=threading.RLock, eq=False)

    def premise(self, versions: Collection[int] | None = None) -> ledger_mod.ActivationPremise:
        """Pointer v0 (hash h0), ever active {v0}, the recorded policy (whatever `versions`
        a step asks about: the one version's facts are the whole premise)."""
        return ledger_mod.ActivationPremise(
            VERSION, frozenset({VERSION}), self.policy, hashes={VERSION: HASH}
        )

    def world(
        self,
        entries: dict[str, LedgerEntry],
        updates: dict[str, UpdateRecord] | None = None,
        poisoned: frozenset[str] = frozenset(),
    ) -> World:
        """The spec's view: these entries (and update records) and the same registry."""
        art = ArtifactRecord(version=VERSION, artifact_hash=HASH, state="active", attempts=1)
        return World(
            entries=entries,
            artifacts={VERSION: art},
            pointer=ActivePointer(VERSION, HASH),
            policy=self.policy,
            updates=updates or {},
            poisoned=poisoned,
        )


def expected_dispatch(
    entries: Iterable[LedgerEntry], chain: str, policy: AdmissionPolicy
) -> tuple[str, int]:
    """The model's own reading of the dispatch rule at v0 (reason, attempt)."""
    entries = list(entries)
    states = [e.state for e in entries if e.chain == chain]
    attempt = len(states) + 1
    if "consumed" in states:
        return "chain_done", attempt
    if any(s in LIVE for s in states):
        return "chain_live", attempt
    if policy.max_attempts is not None and attempt > policy.max_attempts:
        return "attempts_exhausted", attempt
    live = sum(1 for e in entries if e.state in LIVE)
    if policy.batch_size is not None and live >= (policy.max_lag + 1) * policy.batch_size:
        return "no_capacity", attempt
    return "dispatched", attempt


@attrs.frozen
class Learner:
    """One learner: its current update id, the snapshot it read, and what it holds."""

    name: str
    update_no: int = 0
    phase: str = "idle"  # idle | planning (has a snapshot) | crashed
    snapshot: tuple[tuple[str, int], ...] = ()  # (rollout_id, revision) of rewarded rollouts
    held: tuple[str, ...] = ()
    # one heartbeat in a learner's life is enough to exercise renewal (each one bumps a
    # revision, so more would multiply the states without reaching anything new)
    renewed: bool = False

    @property
    def update_id(self) -> str:
        """The id of the update this learner is working on now."""
        return f"{self.name}.{self.update_no}"


@attrs.frozen
class LedgerState:
    """Entries (leases normalised, see `_normalise`), the ledger's update records, and the
    learners."""

    entries: tuple[LedgerEntry, ...]
    learners: tuple[Learner, ...]
    step_violations: tuple[str, ...] = ()
    # the ledger's records of the updates (issue 31): a poisoned update stays poisoned
    updates: tuple[UpdateRecord, ...] = ()


@attrs.frozen
class Act:
    """One action: its kind and its arguments (learner index, rollout id, outcome)."""

    kind: str
    learner: int = -1
    rollout: str = ""
    outcome: str = ""

    def __str__(self) -> str:
        who = f" L{self.learner}" if self.learner >= 0 else ""
        what = f" {self.rollout}" if self.rollout else ""
        how = f" {self.outcome}" if self.outcome else ""
        return f"{self.kind}{who}{what}{how}"


class LedgerRaceModel:
    """N rollouts, K learners, bounded updates per learner; see the module docstring.

    `start` is the lifecycle state rollouts start in (dispatched covers generation failures).
    `max_releases` feeds the real RecoveryRule so the quarantine-on-return branch is reached.
    """

    def __init__(
        self,
        n_rollouts: int = 3,
        n_learners: int = 2,
        *,
        max_updates: int = 2,
        start: str = "dispatched",
        max_releases: int = 1,
        allow_crash: bool = True,
        allow_failures: bool = True,
        allow_renew: bool = False,
        pacing: AdmissionPolicy | None = None,
        dispatches: int = 0,
        chains: int = 1,
    ) -> None:
        if n_rollouts < 1 or n_learners < 1 or max_updates < 1:
            raise ValueError("bounds must be >= 1")
        if start not in ("dispatched", "generated", "rewarded"):
            raise ValueError("rollouts start in dispatched, generated or rewarded")
        self.n_rollouts, self.n_learners, self.max_updates = n_rollouts, n_learners, max_updates
        self.start = start
        self.recovery = RecoveryRule(max_releases=max_releases)
        self.allow_crash = allow_crash
        self.allow_renew = allow_renew  # learner 0's one heartbeat (the renew_lease edge)
        self.allow_failures = allow_failures
        # paced dispatch: at most `dispatches` attempts land, on `chains` prompt chains
        self.registry = None if pacing is None else FixedRegistry(pacing)
        self.dispatches = dispatches if pacing is not None else 0
        self.chains = chains
        self.observed: Counter[str] = Counter()
        self.edges: Counter[tuple[str, str]] = Counter()

    # ---- explorer protocol ---------------------------------------------------------------

    def init_states(self) -> Iterable[LedgerState]:
        """All rollouts in `start`, all learners idle."""
        entries = []
        for i in range(self.n_rollouts):
            e = LedgerEntry(rollout_id=f"r{i + 1}", behavior_version=VERSION, artifact_hash=HASH)
            if self.start != "dispatched":
                e = attrs.evolve(e, state=self.start)
            if self.start == "rewarded":
                e = attrs.evolve(e, reward=REWARD)
            entries.append(e)
        learners = tuple(Learner(f"L{k}") for k in range(self.n_learners))
        yield LedgerState(entries=tuple(entries), learners=learners)

    def actions(self, state: LedgerState) -> Iterable[Act]:
        """Every action enabled in `state` (guards on learner phase and entry state)."""
        for e in state.entries:
            if self.allow_failures and LIFECYCLE.is_legal(e.state, "quarantine"):
                yield Act("quarantine", rollout=e.rollout_id)
            if e.state == "dispatched":
                yield Act("generation_done", rollout=e.rollout_id)
                if self.allow_failures:
                    yield Act("generation_failed", rollout=e.rollout_id)
            elif e.state == "generated":
                yield Act("reward", rollout=e.rollout_id, outcome="ready")
                if self.allow_failures:
                    yield Act("reward", rollout=e.rollout_id, outcome="timeout")
                    yield Act("reward", rollout=e.rollout_id, outcome="error")
            elif e.state == "rewarded" and self.allow_failures:
                yield Act("retire_stale", rollout=e.rollout_id)
        if sum(1 for e in state.entries if e.chain is not None) < self.dispatches:
            for c in range(self.chains):
                yield Act("dispatch", outcome=f"p{c}")
        any_reserved = any(e.state == "reserved" for e in state.entries)
        if any_reserved:
            yield Act("expire_leases")
        any_rewarded = any(e.state == "rewarded" for e in state.entries)
        for k, ln in enumerate(state.learners):
            if ln.phase == "crashed" or ln.update_no >= self.max_updates:
                continue
            if any_rewarded:
                yield Act("read", learner=k)
            for rid, _rev in ln.snapshot:
                if rid not in ln.held:
                    yield Act("cas", learner=k, rollout=rid)
            for e in state.entries:
                if e.state != "rewarded" and e.reserved_by != ln.update_id:
                    yield Act("cas_any", learner=k, rollout=e.rollout_id)
            if ln.held:
                # one retry per learner is enough to exercise idempotency
                yield Act("retry", learner=k, rollout=ln.held[0])
                yield Act("commit", learner=k)
                yield Act("abort", learner=k)
                if self.allow_renew and k == 0 and not ln.renewed:
                    yield Act("renew", learner=k)
                if self.allow_failures:
                    yield Act("update_failed", learner=k)
                if self.allow_crash:
                    yield Act("crash", learner=k)

    def next_state(self, state: LedgerState, action: Act) -> LedgerState | None:
        """Run `action` on a real MemoryLedger rebuilt from `state`; None if it changes nothing."""
        if state.step_violations:
            return None  # a violating state is a dead end: its trace is the counterexample
        clock = ManualClock(0.0)
        log = EventLog()
        led = ledger_mod.MemoryLedger.restore(
            state.entries,
            updates=state.updates,
            clock=clock,
            lease_seconds=LEASE,
            recovery=self.recovery,
            event_log=log,
            activation=self.registry,
        )
        learners = list(state.learners)
        outcome_viol: list[Violation] = []
        k = action.learner
        ln = learners[k] if k >= 0 else None
        kind = action.kind
        try:
            if kind == "generation_done":
                e = led.get(action.rollout)
                led.transition(e.rollout_id, "generation_done", e.revision)
            elif kind == "generation_failed":
                e = led.get(action.rollout)
                led.transition(e.rollout_id, "generation_failed", e.revision)
            elif kind == "reward":
                e = led.get(action.rollout)
                if action.outcome == "ready":
                    led.transition(e.rollout_id, "reward_ready", e.revision, reward=REWARD)
                elif action.outcome == "timeout":
                    led.transition(e.rollout_id, "reward_timeout", e.revision)
                else:
                    led.transition(e.rollout_id, "reward_error", e.revision)
            elif kind == "retire_stale":
                e = led.get(action.rollout)
                led.transition(
                    e.rollout_id,
                    "retire_stale",
                    e.revision,
                    disposition=Disposition("admission", "stale"),
                )
            elif kind == "quarantine":
                e = led.get(action.rollout)
                led.transition(
                    e.rollout_id,
                    "quarantine",
                    e.revision,
                    disposition=Disposition("admission", "artifact_hash_mismatch"),
                )
            elif kind == "dispatch" and self.registry is not None:
                n = sum(1 for e in state.entries if e.chain is not None)
                rid = f"d{n + 1}"
                chain = prompt_chain(action.outcome)
                want = expected_dispatch(state.entries, chain, self.registry.policy)
                identity = RolloutIdentity(rid, action.outcome, "d", 0)
                paced = led.dispatch(Rollout(identity, BehaviorPolicy(VERSION, HASH), CONDITIONS))
                self.observed[f"dispatch:{paced.reason}"] += 1
                if (paced.reason, paced.attempt) != want:
                    outcome_viol.append(
                        Violation(
                            "dispatch_outcome",
                            f"dispatch of {rid} on {action.outcome}: ({paced.reason!r}, "
                            f"attempt {paced.attempt}), the rule says {want}",
                        )
                    )
            elif kind == "expire_leases":
                clock.advance(LEASE)
                returned = {e.rollout_id for e in led.expire_leases()}
                # a heartbeat's lease outlived: learner 0 renewed what it held, and time
                # passed the renewed deadline (every lease is due at the next expiry)
                renewer = state.learners[0]
                if renewer.renewed and returned & set(renewer.held):
                    self.observed["lease_expired_after_renewal"] += 1
            elif ln is not None and kind == "read":
                snap = tuple(
                    (e.rollout_id, e.revision)
                    for e in led.snapshot().values()
                    if e.state == "rewarded"
                )
                learners[k] = attrs.evolve(ln, phase="planning", snapshot=snap)
            elif ln is not None and kind == "cas_any":
                # a learner that misjudged availability tries a rollout that is not rewarded, with
                # its current revision: the ledger must refuse and change nothing
                e = led.get(action.rollout)
                out = led.reserve(action.rollout, e.revision, ln.update_id, STAMP)
                outcome_viol.extend(
                    check_reservation(e, ln.update_id, out.reserved, out.reason, out.entry)
                )
                if out.reserved:
                    learners[k] = attrs.evolve(ln, held=(*ln.held, action.rollout))
            elif ln is not None and kind == "cas":
                rev = dict(ln.snapshot)[action.rollout]
                seen = led.find(action.rollout)
                out = led.reserve(action.rollout, rev, ln.update_id, STAMP)
                outcome_viol.extend(
                    check_reservation(seen, ln.update_id, out.reserved, out.reason, out.entry)
                )
                self.observed[f"reserve:{out.reason}"] += 1
                if out.reason == ledger_mod.CONFLICT:
                    self.observed["cas_lost"] += 1
                snap = tuple(p for p in ln.snapshot if p[0] != action.rollout)
                held = ln.held + ((action.rollout,) if out.reserved else ())
                learners[k] = attrs.evolve(ln, snapshot=snap, held=held)
            elif ln is not None and kind == "retry":
                seen = led.find(action.rollout)
                out = led.reserve(action.rollout, 0, ln.update_id, STAMP)
                outcome_viol.extend(
                    check_reservation(seen, ln.update_id, out.reserved, out.reason, out.entry)
                )
                self.observed[f"reserve:{out.reason}"] += 1
                if out.reason == ledger_mod.IDEMPOTENT:
                    self.observed["idempotent_retry"] += 1
                if not out.reserved:
                    learners[k] = attrs.evolve(
                        ln, held=tuple(r for r in ln.held if r != action.rollout)
                    )
            elif ln is not None and kind in ("commit", "abort", "update_failed"):
                if kind == "commit":
                    try:
                        led.commit(ln.update_id, ln.held)
                        self.observed["commit"] += 1
                    except UpdatePoisoned:
                        # the lost lease poisoned it: nothing of it lands, return the rest
                        self.observed["commit_refused"] += 1
                        self.observed["poisoned_commit_refused"] += 1
                        led.abort(ln.update_id)
                    except CommitMismatch:
                        # a lease ran out under us: return what is still ours
                        self.observed["commit_refused"] += 1
                        led.abort(ln.update_id)
                elif kind == "abort":
                    led.abort(ln.update_id)
                else:
                    led.fail_update(ln.update_id, "nan_loss")
                learners[k] = Learner(ln.name, ln.update_no + 1, renewed=ln.renewed)
            elif ln is not None and kind == "renew":
                renewed = led.renew_leases(ln.update_id)
                self.observed["lease_renewed"] += len(renewed)
                learners[k] = attrs.evolve(ln, renewed=True)
            elif ln is not None and kind == "crash":
                learners[k] = attrs.evolve(ln, phase="crashed", snapshot=(), held=())
            else:
                raise ValueError(f"unknown action {action}")
        except WriteRefused as exc:
            # a correct ledger never plans a write its own rules refuse: a refusal here is
            # a bug the write path caught (fail closed), and the model reports it
            outcome_viol.append(Violation("write_refused", f"{kind}: {exc}"))
        events = log.events()
        count_edges(events, self.edges)
        self.observed.update(sometimes_from_events(events))
        entries = tuple(
            _normalise(e) for e in sorted(led.snapshot().values(), key=lambda e: e.rollout_id)
        )
        _, step_viol, _ = replay(self._world(state), events)
        viol = tuple(str(v) for v in [*outcome_viol, *step_viol])
        new = LedgerState(
            entries=entries,
            learners=tuple(learners),
            step_violations=viol,
            updates=tuple(led.updates().values()),
        )
        if new == state:
            return None
        return new

    def _world(self, state: LedgerState) -> World:
        """The spec's view of a state: the entries and the update records (those poisoned
        as the spec holds them: the state keeps no history to derive it from), and the
        fixed registry when paced."""
        entries = _entry_map(state)
        updates = {u.update_id: u for u in state.updates}
        poisoned = frozenset(u.update_id for u in state.updates if u.status == "poisoned")
        if self.registry is None:
            return World(entries=entries, updates=updates, poisoned=poisoned)
        return self.registry.world(entries, updates, poisoned)

    def canonical(self, state: LedgerState) -> Any:
        """States are stored normalised (see `_normalise`), so they are their own canonical form."""
        return state

    def action_label(self, action: Act) -> str:
        """Labels like `cas L0 r1`."""
        return str(action)

    def properties(self) -> Sequence[Property[LedgerState]]:
        """The spec's invariants: step (recorded on the state), always, eventually."""
        props: list[Property[LedgerState]] = [
            Property(
                "spec_step_invariants",
                "always",
                lambda s: not s.step_violations,
                "every step satisfies the spec's step invariants",
            ),
            Property(
                "spec_always_invariants",
                "always",
                lambda s: not check_world(self._world(s)),
                "every state satisfies the spec's always invariants",
            ),
            Property(
                "spec_eventually_invariants",
                "eventually",
                lambda s: not check_quiescent(self._world(s)),
                "at quiescence nothing is left reserved",
            ),
            Property(
                "some_rollout_consumed",
                "sometimes",
                lambda s: any(e.state == "consumed" for e in s.entries),
            ),
            Property(
                "some_update_poisoned",
                "sometimes",
                lambda s: any(u.status == "poisoned" for u in s.updates),
            ),
        ]
        if self.n_learners >= 2:  # a witness one learner cannot give
            props.append(
                Property(
                    "two_learners_hold_reservations",
                    "sometimes",
                    lambda s: sum(1 for ln in s.learners if ln.held) >= 2,
                )
            )
        if self.dispatches:
            props.append(
                Property(
                    "requeued_attempt_dispatched",
                    "sometimes",
                    lambda s: any(e.attempt >= 2 for e in s.entries),
                )
            )
        return props

    def violations_of(self, state: LedgerState) -> list[str]:
        """Human-readable list of what is wrong in `state` (for counterexample reports)."""
        out = list(state.step_violations)
        out.extend(str(v) for v in check_world(self._world(state)))
        return out


def _normalise(e: LedgerEntry) -> LedgerEntry:
    """Pin every lease to time 0: each lease is due at the next expiry action, which advances
    the clock by a whole lease, so absolute times never change what can happen next."""
    if e.lease_expires_at is None or e.lease_expires_at == 0.0:
        return e
    return attrs.evolve(e, lease_expires_at=0.0)


def _entry_map(s: LedgerState) -> dict[str, LedgerEntry]:
    return {e.rollout_id: e for e in s.entries}
