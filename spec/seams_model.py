"""The composition users run: activation racing admission + reservation, two coordinators.

The README's pattern, exactly as it is printed: a learner reads the active pointer, admits
a batch with the real `AdmissionGate` over records built from the ledger, reserves with
the stamps, and commits; meanwhile an activator publishes new versions, workers load and
ack them, and a SECOND coordinator on the same registry distributes and activates too. A
generator adds rollouts made by whatever weights a worker really holds. Hostile clients
are part of the model: one stamps a stale rollout as accepted, one adds a rewarded rollout
without a reward, the second coordinator asks for a smaller worker set.

`Composition` runs one action on live objects; the explorer model (`SeamsModel`) rebuilds
the real MemoryLedger/MemoryRegistry from each state and runs the same actions, and the
Hypothesis machine (stateful_tests/seams_machine.py) keeps live objects on a real backend,
each learner on its own connection. Both judge every step with the spec's invariants and
a ghost check of what workers really hold; with the fixes of issue 9 reverted (the
mutants), both find: stale reservations after a pointer move, activation on a partial
worker set, records the spec rejects, older-than-active distributions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from rollout_lifecycle.model import coordinator as coord_mod
from rollout_lifecycle.model import gate as gate_mod
from rollout_lifecycle.model import ledger as ledger_mod
from rollout_lifecycle.model import registry as registry_mod
from rollout_lifecycle.model.errors import ActivationError, RolloutLifecycleError, UpdatePoisoned
from rollout_lifecycle.model.events import ArtifactChanged, EventLog, TraceEvent
from rollout_lifecycle.model.records import (
    ActionEvidence,
    ActivePointer,
    AdmissionPolicy,
    AdmissionStamp,
    ArtifactRecord,
    AttemptToken,
    BehaviorPolicy,
    GenerationConditions,
    LedgerEntry,
    Reward,
    Rollout,
    RolloutIdentity,
    WorkerAck,
)
from rollout_lifecycle.model.registry import WorkerReport
from rollout_lifecycle.spec.activation_model import attempt_token
from rollout_lifecycle.spec.coverage import count_edges
from rollout_lifecycle.spec.explorer import Property
from rollout_lifecycle.spec.invariants import World, check_at_rest, replay

WORKERS = ("g0", "g1")
PARTIAL = ("g0",)  # what the second coordinator asks for (a partial worker set)
MAX_LAG = 1
MAX_DRIFT = 0.2
POLICY = AdmissionPolicy(MAX_LAG, MAX_DRIFT)  # the deployment's, recorded in the registry
REWARD = Reward("rm", "1", 1.0)
CONDITIONS = GenerationConditions("tok", 1.0, 1.0, -1, 4)
EVIDENCE = ActionEvidence((1, 2), (True, True), (-0.5, -0.5))
CURRENT_LP = np.full((1, 2), -0.5)


def version_hash(v: int) -> str:
    """The artifact hash of version v in this model."""
    return f"{v:x}".rjust(64, "e")


LIAR = AdmissionStamp(
    current_version=9,
    behavior_version=0,
    max_lag=MAX_LAG,
    max_drift=MAX_DRIFT,
    drift=5.0,
    freshness="stale",
    reason="stale_policy",
    accepted=True,
)


@attrs.frozen
class LearnerState:
    """A learner between calls: what it admitted (stamps) and what it holds."""

    name: str
    update: int = 0
    pending: tuple[tuple[str, int, AdmissionStamp], ...] = ()
    held: tuple[str, ...] = ()

    @property
    def update_id(self) -> str:
        """This learner's current update id."""
        return f"{self.name}.u{self.update}"


@attrs.frozen
class Act:
    """One action of the composition."""

    kind: str
    who: int = 0

    def __str__(self) -> str:
        return f"{self.kind} {self.who}" if self.kind not in _NO_WHO else self.kind


_NO_WHO = frozenset({"prepare", "publish", "bad_add", "fail"})
# one figure of an otherwise honest stamp is wrong: what a subtly misconfigured or buggy
# learner sends (each must be refused on its own; a stamp wrong everywhere is the LIAR)
ONE_FIGURE_LIES = ("max_lag", "max_drift", "drift", "current_version", "behavior_version")


class Composition:
    """The live parties of one deployment, and the action that each one takes.

    `ledgers`/`registries` hold one handle per party: index 0 is the activator's, 1 and 2
    the learners'. On a real backend each is its own connection; in memory they may be one
    object. `truth[w]` is the (version, hash) worker w really serves (ghost state).
    """

    def __init__(
        self,
        ledgers: Sequence[ledger_mod.Ledger],
        registries: Sequence[registry_mod.RegistryStore],
        truth: dict[str, tuple[int, str]],
        learners: list[LearnerState],
        *,
        observed: Counter[str] | None = None,
        new_token: coord_mod.TokenSource = coord_mod.random_token,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.ledgers = list(ledgers)
        self.registries = list(registries)
        self.truth = truth
        self.learners = learners
        self.observed: Counter[str] = observed if observed is not None else Counter()
        self.problems: list[str] = []
        self.new_token = new_token
        # None: the deployment's clock; the explorer fixes it, so an attempt's recorded ack
        # deadline is the same in every state that is otherwise the same
        self.clock = clock
        self.coord_a = coord_mod.ActivationCoordinator(
            self.registries[0], ledger=self.ledgers[0], new_token=new_token, clock=clock
        )
        self.coord_b = self._second_coordinator()

    def _second_coordinator(self) -> coord_mod.ActivationCoordinator:
        """The other process's coordinator: it asks for a partial set, which the durable
        registry refuses, so it attaches with the registry's own set."""
        try:
            c = coord_mod.ActivationCoordinator(
                self.registries[-1], PARTIAL, new_token=self.new_token, clock=self.clock
            )
            self.observed["partial_set_accepted"] += 1
            return c
        except ActivationError:
            self.observed["partial_set_refused"] += 1
            return coord_mod.ActivationCoordinator(
                self.registries[-1], new_token=self.new_token, clock=self.clock
            )

    def coordinator(self, who: int) -> coord_mod.ActivationCoordinator:
        """Coordinator 0 (the trainer's) or 1 (the second one)."""
        return self.coord_a if who == 0 else self.coord_b

    # ---- actions ---------------------------------------------------------------------

    def run(self, act: Act) -> None:
        """Take `act`; a refusal by the protocol is an outcome, not a failure."""
        try:
            getattr(self, f"_{act.kind}")(act.who)
        except ActivationError as exc:
            self.observed[f"refused:{act.kind}"] += 1
            if "not newer than the active" in str(exc):
                self.observed["old_distribution_refused"] += 1

    def _prepare(self, _who: int) -> None:
        top = self.coord_a.registry.max_version()
        v = 0 if top is None else top + 1
        self.coord_a.prepare(v)
        self.coord_a.commit_artifact(v, version_hash(v))

    def _publish(self, _who: int) -> None:
        """The trainer publishes its next version in one go: prepare, commit, distribute,
        every worker loads and acks, activate (a fast activator racing the learners)."""
        self._prepare(0)
        self._distribute(0)
        for w in range(len(WORKERS)):
            self._load(w)
        self._activate(0)

    def _distribute(self, who: int) -> None:
        """The trainer's coordinator distributes its newest version; the second one, lagging
        behind, the oldest it knows of (which may be older than the active one)."""
        c = self.coordinator(who)
        committed = [a.version for a in c.artifacts() if a.state == "committed"]
        if committed:
            c.distribute(max(committed) if who == 0 else min(committed))

    def _load(self, w: int) -> None:
        worker = WORKERS[w]
        awaiting = [a for a in self.coord_a.artifacts() if a.state == "awaiting_acks"]
        if not awaiting:
            return
        rec = awaiting[0]
        assert rec.artifact_hash is not None
        self.truth[worker] = (rec.version, rec.artifact_hash)
        token = self.coord_a.attempt_token(worker, rec.version)  # sent with the weights
        res = self.coord_a.record_ack(
            WorkerAck(worker, rec.version, rec.artifact_hash, attempt=rec.attempts, token=token)
        )
        self.observed[f"ack:{res.reason}"] += 1

    def _activate(self, who: int) -> None:
        c = self.coordinator(who)
        awaiting = [a.version for a in c.artifacts() if a.state == "awaiting_acks"]
        if not awaiting:
            return
        before = len(c.trace())
        res = c.try_activate(awaiting[0])
        self.observed[f"activate:{res.reason}"] += 1
        if res.activated:
            self.observed["activated"] += 1
            self._ghost(c.trace()[before:])

    def _ghost(self, events: Sequence[TraceEvent]) -> None:
        """At the moment of activation every worker of the deployment really holds it."""
        for ev in events:
            if isinstance(ev, ArtifactChanged) and ev.event == "activate":
                want = (ev.version, ev.after.artifact_hash)
                for w in WORKERS:
                    if self.truth.get(w) != want:
                        self.problems.append(
                            f"ghost: v{ev.version} activated while {w} really serves "
                            f"{self.truth.get(w)}"
                        )

    def _rollback(self, keep: int) -> None:
        """The operator rolls the active version back (1: keeping its rollouts), possibly
        between a learner's admission and its reservation."""
        rolled = self.coord_a.pointer()
        self.coord_a.rollback(keep_rollouts=bool(keep), reason="seams rollback")
        self.observed["rolled_back_kept" if keep else "rolled_back"] += 1
        # read back the recorded choice: the cause is what later premises and readers go by
        assert rolled is not None  # rollback refuses with nothing active
        got = self.coord_a.artifact(rolled.version).failure
        want = ("activation", "rolled_back_kept" if keep else "rolled_back", "seams rollback")
        if got is None or (got.stage, got.cause, got.detail) != want:
            self.problems.append(
                f"recorded choice: v{rolled.version} rolled back with keep={bool(keep)}, but its "
                f"record says {got}"
            )

    def _fail(self, _who: int) -> None:
        awaiting = [a.version for a in self.coord_a.artifacts() if a.state == "awaiting_acks"]
        if awaiting:
            self.coord_a.fail_distribution(awaiting[0], "ack_timeout")

    def _generate(self, w: int) -> None:
        held = self.truth.get(WORKERS[w])
        if held is None:
            return
        led = self.ledgers[0]
        rid = f"r{led.statistics().entries}"
        led.add(
            LedgerEntry(
                rollout_id=rid,
                behavior_version=held[0],
                artifact_hash=held[1],
                state="rewarded",
                reward=REWARD,
            )
        )

    def _bad_add(self, _who: int) -> None:
        """A buggy client adds a rewarded rollout without a reward value."""
        led = self.ledgers[0]
        held = self.truth.get(WORKERS[0]) or (0, version_hash(0))
        try:
            led.add(
                LedgerEntry(
                    rollout_id=f"r{led.statistics().entries}",
                    behavior_version=held[0],
                    artifact_hash=held[1],
                    state="rewarded",
                )
            )
            self.observed["bad_add_accepted"] += 1
        except ledger_mod.WriteRefused:
            self.observed["bad_add_refused"] += 1

    def _learner(self, k: int) -> tuple[LearnerState, ledger_mod.Ledger, Any]:
        return self.learners[k], self.ledgers[1 + k], self.registries[1 + k]

    def _admit(self, k: int) -> None:
        """The README pattern: pointer -> assess_batch over ledger records -> keep stamps."""
        ln, led, reg = self._learner(k)
        pointer = reg.pointer()
        if pointer is None:
            return
        entries = [e for e in led.snapshot().values() if e.state == "rewarded"]
        entries = [e for e in entries if e.rollout_id not in {p[0] for p in ln.pending}][:2]
        if not entries:
            return
        gate = gate_mod.AdmissionGate(
            gate_mod.GatePolicy(max_lag=MAX_LAG, max_drift=MAX_DRIFT),
            registry=lambda v: registry_mod.activated_hash(reg, v),
        )
        rollouts = [
            Rollout(
                identity=RolloutIdentity(e.rollout_id, "p", "d", 0),
                behavior=BehaviorPolicy(e.behavior_version, e.artifact_hash),
                conditions=CONDITIONS,
                evidence=EVIDENCE,
                status=e,
            )
            for e in entries
        ]
        decisions = gate.assess_batch(
            rollouts, np.repeat(CURRENT_LP, len(rollouts), axis=0), pointer.version
        )
        keep = tuple(
            (d.rollout_id, e.revision, d.stamp())
            for d, e in zip(decisions, entries, strict=True)
            if d.accepted
        )
        for d in decisions:
            self.observed[f"admission:{d.reason}"] += 1
        self.learners[k] = attrs.evolve(ln, pending=ln.pending + keep)

    def _lie(self, k: int) -> None:
        """A hostile learner: learner 0 marks a rollout accepted whatever its own figures
        say, or (every other rollout) sends an honest stamp with exactly one figure wrong;
        learner 1 is misconfigured, its stamps agree with themselves but are judged with
        bounds far looser than the deployment's recorded policy."""
        ln, led, reg = self._learner(k)
        pointer = reg.pointer()
        for e in led.snapshot().values():
            if e.state == "rewarded" and e.rollout_id not in {p[0] for p in ln.pending}:
                stamp = attrs.evolve(
                    LIAR,
                    behavior_version=e.behavior_version,
                    current_version=e.behavior_version + 9,
                )
                honest = pointer is not None and pointer.version >= e.behavior_version
                if k % 2 == 1 and honest:
                    assert pointer is not None
                    lag = pointer.version - e.behavior_version
                    stamp = AdmissionStamp(
                        current_version=pointer.version,
                        behavior_version=e.behavior_version,
                        max_lag=1000,
                        max_drift=1e9,
                        drift=0.0,
                        freshness="fresh" if lag == 0 else "tolerated",
                        reason="ok",
                        accepted=True,
                    )
                elif honest and int(e.rollout_id[1:]) % 2 == 1:
                    assert pointer is not None
                    stamp = _one_figure_lie(e, pointer.version, int(e.rollout_id[1:]) // 2)
                self.learners[k] = attrs.evolve(
                    ln, pending=(*ln.pending, (e.rollout_id, e.revision, stamp))
                )
                return

    def _reserve(self, k: int) -> None:
        ln, led, _reg = self._learner(k)
        if not ln.pending:
            return
        outs = led.reserve_batch(
            ln.update_id,
            [ledger_mod.ReserveRequest(rid, rev, stamp) for rid, rev, stamp in ln.pending],
        )
        for o in outs:
            self.observed[f"reserve:{o.reason}"] += 1
        won = tuple(o.rollout_id for o in outs if o.reserved)
        self.learners[k] = attrs.evolve(ln, pending=(), held=tuple(sorted({*ln.held, *won})))

    def _commit(self, k: int) -> None:
        ln, led, _reg = self._learner(k)
        if not ln.held:
            return
        try:
            led.commit(ln.update_id, list(ln.held))
            self.observed["commit"] += 1
        except UpdatePoisoned:  # a rollback retired what it held: the commit cannot land
            self.observed["commit_refused_retired"] += 1
            led.abort(ln.update_id)
        self.learners[k] = LearnerState(ln.name, ln.update + 1)


def _one_figure_lie(e: LedgerEntry, pointer: int, n: int) -> AdmissionStamp:
    """An honest stamp of `e` at `pointer` with only figure ONE_FIGURE_LIES[n % 5] wrong."""
    lag = pointer - e.behavior_version
    fields = dict(
        current_version=pointer,
        behavior_version=e.behavior_version,
        max_lag=MAX_LAG,
        max_drift=MAX_DRIFT,
        drift=0.0,
        freshness="fresh" if lag == 0 else "tolerated" if lag <= MAX_LAG else "stale",
        reason="ok",
        accepted=True,
    )
    which = ONE_FIGURE_LIES[n % len(ONE_FIGURE_LIES)]
    if which == "max_lag":
        fields["max_lag"] = MAX_LAG + 1
    elif which == "max_drift":
        fields["max_drift"], fields["drift"] = MAX_DRIFT * 10, MAX_DRIFT * 2
    elif which == "drift":
        fields["drift"] = MAX_DRIFT * 2
    elif which == "current_version":
        fields["current_version"] = pointer + 1
    else:
        fields["behavior_version"] = e.behavior_version + 1
    lag = int(str(fields["current_version"])) - int(str(fields["behavior_version"]))
    ml = int(str(fields["max_lag"]))
    fields["freshness"] = (
        "future" if lag < 0 else "fresh" if lag == 0 else "tolerated" if lag <= ml else "stale"
    )
    try:
        return AdmissionStamp(**fields)  # type: ignore[arg-type]
    except RolloutLifecycleError:  # the record itself refuses it: send it anyway, forged
        stamp = object.__new__(AdmissionStamp)
        for k, v in fields.items():
            object.__setattr__(stamp, k, v)
        return stamp


@attrs.frozen
class SeamsState:
    """Everything the composition holds between actions (hashable for the explorer)."""

    artifacts: tuple[ArtifactRecord, ...]
    pointer: ActivePointer | None
    reports: tuple[WorkerReport, ...]
    membership: tuple[str, ...]
    entries: tuple[LedgerEntry, ...]
    bad_versions: frozenset[int]
    truth: tuple[tuple[str, tuple[int, str] | None], ...]
    learners: tuple[LearnerState, ...]
    budget: tuple[int, int, int, int]  # rollouts, lies, bad adds, rollbacks still allowed
    step_violations: tuple[str, ...] = ()
    tokens: tuple[AttemptToken, ...] = ()  # the registry's attempt tokens


class SeamsModel:
    """Explorer model of the composition over the real memory ledger and registry."""

    def __init__(
        self,
        *,
        learners: int = 2,
        second_coordinator: bool = True,
        max_versions: int = 2,
        max_rollouts: int = 1,
        lies: int = 0,
        bad_adds: int = 0,
        rollbacks: int = 0,
    ) -> None:
        self.n_learners = learners
        self.second = second_coordinator
        self.max_versions = max_versions
        self.budget = (max_rollouts, lies, bad_adds, rollbacks)
        self.observed: Counter[str] = Counter()
        self.edges: Counter[tuple[str, str]] = Counter()

    def _stack(self, s: SeamsState) -> tuple[Composition, EventLog, Any, Any]:
        log = EventLog()
        reg = registry_mod.MemoryRegistry.restore(
            s.artifacts,
            s.pointer,
            s.reports,
            log,
            membership=s.membership,
            policy=POLICY,
            tokens=s.tokens,
        )
        led = ledger_mod.MemoryLedger.restore(
            s.entries, s.bad_versions, event_log=log, clock=lambda: 0.0, activation=reg
        )
        truth = {w: h for w, h in s.truth if h is not None}
        comp = Composition(
            [led, led, led],
            [reg, reg, reg],
            truth,
            list(s.learners),
            observed=self.observed,
            new_token=attempt_token,
            clock=lambda: 0.0,
        )
        return comp, log, led, reg

    def init_states(self) -> Iterable[SeamsState]:
        """v0 active on both workers; two idle learners; nothing in the ledger."""
        log = EventLog()
        reg = registry_mod.MemoryRegistry(log)
        led = ledger_mod.MemoryLedger(event_log=log, clock=lambda: 0.0, activation=reg)
        registry_mod.set_admission_policy(reg, POLICY, "the operator's", at=0.0)
        c = coord_mod.ActivationCoordinator(
            reg, WORKERS, ledger=led, policy=POLICY, new_token=attempt_token, clock=lambda: 0.0
        )
        c.prepare(0)
        c.commit_artifact(0, version_hash(0))
        c.distribute(0)
        for w in WORKERS:
            c.record_ack(WorkerAck(w, 0, version_hash(0), token=c.attempt_token(w, 0)))
        assert c.try_activate(0).activated
        yield self._state(
            reg,
            led,
            {w: (0, version_hash(0)) for w in WORKERS},
            tuple(LearnerState(f"L{k}") for k in range(self.n_learners)),
            self.budget,
            (),
        )

    def _state(
        self,
        reg: Any,
        led: Any,
        truth: dict[str, tuple[int, str]],
        learners: Sequence[LearnerState],
        budget: tuple[int, int, int, int],
        violations: Sequence[str],
    ) -> SeamsState:
        return SeamsState(
            artifacts=tuple(sorted(reg.artifacts(), key=lambda a: a.version)),
            pointer=reg.pointer(),
            reports=tuple(sorted(reg.workers().values(), key=lambda r: r.worker_id)),
            membership=reg.required_workers(),
            entries=tuple(sorted(led.snapshot().values(), key=lambda e: e.rollout_id)),
            bad_versions=led.bad_versions,
            truth=tuple((w, truth.get(w)) for w in WORKERS),
            learners=tuple(learners),
            budget=budget,
            step_violations=tuple(violations),
            tokens=tuple(reg.attempt_tokens()),
        )

    def actions(self, s: SeamsState) -> Iterable[Act]:
        """Every enabled action (a budget bounds generation and the hostile clients)."""
        rollouts, lies, bad, rollbacks = s.budget
        states = {a.state for a in s.artifacts}
        if len(s.artifacts) <= self.max_versions:
            yield Act("prepare")
            if "awaiting_acks" not in states:
                yield Act("publish")  # an older committed version may stay behind
        coordinators = (0, 1) if self.second else (0,)
        if "committed" in states:
            for c in coordinators:
                yield Act("distribute", c)
        if "awaiting_acks" in states:
            rec = next(a for a in s.artifacts if a.state == "awaiting_acks")
            truth, reports = dict(s.truth), {r.worker_id: r for r in s.reports}
            tokens = {(t.version, t.worker_id): t.token for t in s.tokens}
            for w, name in enumerate(WORKERS):
                r = reports.get(name)
                token = tokens.get((rec.version, name))
                fresh = r is not None and r.ack is not None and r.ack.token == token
                if truth.get(name) != (rec.version, rec.artifact_hash) or not fresh:
                    yield Act("load", w)  # a worker loads what it does not hold yet
            for c in coordinators:
                yield Act("activate", c)
            yield Act("fail")
        if rollouts:
            yield Act("generate", 0)
            yield Act("generate", 1)
        if bad:
            yield Act("bad_add")
        if rollbacks and s.pointer is not None and "awaiting_acks" not in states:
            active = next(a for a in s.artifacts if a.version == s.pointer.version)
            if active.rollback_version is not None:
                yield Act("rollback", 0)  # retire its rollouts
                yield Act("rollback", 1)  # the operator keeps them
        for k, ln in enumerate(s.learners):
            if any(e.state == "rewarded" for e in s.entries):
                yield Act("admit", k)
                if lies:
                    yield Act("lie", k)
            if ln.pending:
                yield Act("reserve", k)
            if ln.held:
                yield Act("commit", k)

    def next_state(self, s: SeamsState, act: Act) -> SeamsState | None:
        """Run `act` on real objects rebuilt from `s`; None when nothing changed."""
        comp, log, led, reg = self._stack(s)
        rollouts, lies, bad, rollbacks = s.budget
        extra: list[str] = []
        try:
            comp.run(act)
        except RolloutLifecycleError as exc:
            extra.append(f"{act}: the system refused its own step: {type(exc).__name__}: {exc}")
        if act.kind == "generate":
            rollouts -= 1
        elif act.kind == "lie":
            lies -= 1
        elif act.kind == "bad_add":
            bad -= 1
        elif act.kind == "rollback":
            rollbacks -= 1
        events = log.events()
        count_edges(events, self.edges)
        _, viol, _ = replay(self.world(s), events)
        problems = [*comp.problems, *extra, *(str(v) for v in viol)]
        new = self._state(
            reg, led, comp.truth, comp.learners, (rollouts, lies, bad, rollbacks), problems
        )
        return None if new == s else new

    def world(self, s: SeamsState) -> World:
        """The spec's view of a state."""
        return World(
            entries={e.rollout_id: e for e in s.entries},
            artifacts={a.version: a for a in s.artifacts},
            pointer=s.pointer,
            required_workers=s.membership,
            workers={r.worker_id: r for r in s.reports},
            policy=POLICY,
            tokens={(t.version, t.worker_id): t for t in s.tokens},
        )

    def action_label(self, act: Act) -> str:
        """Action names in traces."""
        return str(act)

    def properties(self) -> Sequence[Property[SeamsState]]:
        """The spec on every step (and the ghost), at rest, plus reachability witnesses."""
        return [
            Property(
                "spec_step_invariants_and_ghost",
                "always",
                lambda s: not s.step_violations,
                "every step satisfies the spec's step/always invariants and the ghost check",
            ),
            Property(
                "spec_rest_invariants",
                "always",
                lambda s: not check_at_rest(self.world(s)),
            ),
            Property(
                "consumed_after_pointer_moved",
                "sometimes",
                lambda s: any(
                    e.state == "consumed"
                    and s.pointer is not None
                    and e.admission is not None
                    and e.admission.current_version < s.pointer.version
                    for e in s.entries
                ),
                "a rollout admitted under an older pointer was trained within its bound",
            ),
            Property(
                "new_version_active",
                "sometimes",
                lambda s: s.pointer is not None and s.pointer.version > 0,
            ),
        ]

    def violations_of(self, s: SeamsState) -> list[str]:
        """What is wrong in `s`, for counterexample reports."""
        return [*s.step_violations, *(str(v) for v in check_at_rest(self.world(s)))]
