"""Hypothesis machine of the composition users run (spec/seams_model.py), on live objects.

The same actions as the explorer model (one implementation: `Composition`), but the
objects live across steps on a real backend: on SQLite (or PostgreSQL) the activator and
each learner open the state through `open_backend` separately, so every party has its own
connection, as separate processes would. After every step the new trace events are judged by the
spec (the same predicates), the ghost check of what workers really serve, and the at-rest
invariants of the stored state. Budgets are larger than the explorer's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rollout_lifecycle.model.backends import Backend, open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.errors import RolloutLifecycleError
from rollout_lifecycle.model.events import EventLog
from rollout_lifecycle.model.ledger import MemoryLedger
from rollout_lifecycle.model.records import WorkerAck
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.spec.invariants import Violation
from rollout_lifecycle.spec.seams_model import (
    POLICY,
    WORKERS,
    Act,
    Composition,
    LearnerState,
    SeamsModel,
    version_hash,
)
from rollout_lifecycle.stateful_tests.backends import (
    LogSource,
    bind_machine,
    durable_url,
    end_example,
    event_source,
)
from rollout_lifecycle.stateful_tests.recording import (
    Recorder,
    TraceChecker,
    check_snapshot,
    raise_violations,
    world_of,
)

MAX_VERSIONS = 4
MAX_ROLLOUTS = 6
LIES = 4
BAD_ADDS = 2
ROLLBACKS = 2  # operator rollbacks, retiring or keeping, between admission and reservation
INVARIANT_NAMES = ("spec_holds",)
# outcomes of the composition that the search must show it reached (spec SOMETIMES names)
SOMETIMES_OF = {
    "reserve:pointer_moved": "pointer_moved_refused",
    "old_distribution_refused": "old_distribution_refused",
    "partial_set_refused": "partial_set_refused",
}
picks = st.integers(min_value=0, max_value=3)
ACTION_KINDS = (
    "publish",
    "prepare",
    "distribute",
    "load",
    "activate",
    "fail",
    "generate",
    "bad_add",
    "admit",
    "lie",
    "reserve",
    "commit",
)


class SeamsMachine(RuleBasedStateMachine):
    """Activator, two coordinators, two workers, a generator and two learners."""

    backend: ClassVar[str] = "memory"
    recorder: ClassVar[Recorder]
    workdir: ClassVar[Path | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.recorder.start_example()
        self.tmp = Path(tempfile.mkdtemp(prefix="seams-machine-", dir=self.workdir))
        self.backends: list[Backend] = []
        if self.backend == "memory":
            b = open_backend("memory://")
            self.backends = [b]
            parties = [b, b, b]
            log = b.ledger.log if isinstance(b.ledger, MemoryLedger) else EventLog()
            self.source: Any = LogSource(log)
        else:
            url = durable_url(self.backend, self.tmp)
            parties = [open_backend(url) for _ in range(3)]  # one connection per party
            self.backends = parties
            self.source = event_source(url)
        self._bootstrap(parties[0])
        self.model = SeamsModel(
            learners=2,
            second_coordinator=True,
            max_versions=MAX_VERSIONS,
            max_rollouts=MAX_ROLLOUTS,
            lies=LIES,
            bad_adds=BAD_ADDS,
            rollbacks=ROLLBACKS,
        )
        self.budget = self.model.budget
        self.comp = Composition(
            [p.ledger for p in parties],
            [p.registry for p in parties],
            {w: (0, version_hash(0)) for w in WORKERS},
            [LearnerState("L0"), LearnerState("L1")],
        )
        self.checker = TraceChecker(self.recorder, with_registry=True)
        if self.comp.observed["partial_set_refused"]:
            self.recorder.reached("partial_set_refused")

    def _bootstrap(self, b: Backend) -> None:
        """v0 active on both workers, through the real coordinator."""
        set_admission_policy(b.registry, POLICY, "set by the operator")
        c = ActivationCoordinator(b.registry, WORKERS, ledger=b.ledger, policy=POLICY)
        c.prepare(0)
        c.commit_artifact(0, version_hash(0))
        c.distribute(0)
        for w in WORKERS:
            c.record_ack(WorkerAck(w, 0, version_hash(0), token=c.attempt_token(w, 0)))
        assert c.try_activate(0).activated

    def _enabled(self) -> list[Act]:
        b = self.backends[0]
        state = self.model._state(  # the explorer's own enabling rule, on live state
            b.registry, b.ledger, self.comp.truth, self.comp.learners, self.budget, ()
        )
        return list(self.model.actions(state))

    def _has(self, kind: str) -> bool:
        return any(a.kind == kind for a in self._enabled())

    def _do(self, kind: str, pick: int) -> None:
        """One party acts; every rule is enabled exactly when the explorer's action is."""
        enabled = [a for a in self._enabled() if a.kind == kind]
        action = enabled[pick % len(enabled)]
        rollouts, lies, bad, rollbacks = self.budget
        seen = {k: self.comp.observed[k] for k in SOMETIMES_OF}
        try:
            self.comp.run(action)
        except RolloutLifecycleError as exc:
            raise self.recorder.fail(
                f"{action}: the system refused its own step: {type(exc).__name__}: {exc}"
            ) from None
        if action.kind == "generate":
            rollouts -= 1
        elif action.kind == "lie":
            lies -= 1
        elif action.kind == "bad_add":
            bad -= 1
        elif action.kind == "rollback":
            rollbacks -= 1
        self.budget = (rollouts, lies, bad, rollbacks)
        self.recorder.fired(action.kind)
        for key, name in SOMETIMES_OF.items():
            if self.comp.observed[key] > seen[key]:
                self.recorder.reached(name)

    @rule(pick=picks)
    @precondition(lambda self: self._has("publish"))
    def publish(self, pick: int) -> None:
        """publish (see spec/seams_model.Composition)."""
        self._do("publish", pick)

    @rule(pick=picks)
    @precondition(lambda self: self._has("prepare"))
    def prepare(self, pick: int) -> None:
        """prepare (see spec/seams_model.Composition)."""
        self._do("prepare", pick)

    @rule(pick=picks)
    @precondition(lambda self: self._has("distribute"))
    def distribute(self, pick: int) -> None:
        """distribute (see spec/seams_model.Composition)."""
        self._do("distribute", pick)

    @rule(pick=picks)
    @precondition(lambda self: self._has("load"))
    def load(self, pick: int) -> None:
        """load (see spec/seams_model.Composition)."""
        self._do("load", pick)

    @rule(pick=picks)
    @precondition(lambda self: self._has("activate"))
    def activate(self, pick: int) -> None:
        """activate (see spec/seams_model.Composition)."""
        self._do("activate", pick)

    @rule(pick=picks)
    @precondition(lambda self: self._has("fail"))
    def fail(self, pick: int) -> None:
        """fail (see spec/seams_model.Composition)."""
        self._do("fail", pick)

    @rule(pick=picks)
    @precondition(lambda self: self._has("generate"))
    def generate(self, pick: int) -> None:
        """generate (see spec/seams_model.Composition)."""
        self._do("generate", pick)

    @rule(pick=picks)
    @precondition(lambda self: self._has("bad_add"))
    def bad_add(self, pick: int) -> None:
        """bad_add (see spec/seams_model.Composition)."""
        self._do("bad_add", pick)

    @rule(pick=picks)
    @precondition(lambda self: self._has("admit"))
    def admit(self, pick: int) -> None:
        """admit (see spec/seams_model.Composition)."""
        self._do("admit", pick)

    @rule(pick=picks)
    @precondition(lambda self: self._has("lie"))
    def lie(self, pick: int) -> None:
        """lie (see spec/seams_model.Composition)."""
        self._do("lie", pick)

    @rule(pick=picks)
    @precondition(lambda self: self._has("reserve"))
    def reserve(self, pick: int) -> None:
        """reserve (see spec/seams_model.Composition)."""
        self._do("reserve", pick)

    @rule(pick=picks)
    @precondition(lambda self: self._has("commit"))
    def commit(self, pick: int) -> None:
        """commit (see spec/seams_model.Composition)."""
        self._do("commit", pick)

    @rule(pick=picks)
    @precondition(lambda self: self._has("rollback"))
    def rollback(self, pick: int) -> None:
        """rollback (see spec/seams_model.Composition): between admissions and reservations."""
        self._do("rollback", pick)

    @rule()
    def settle(self) -> None:
        """Nothing left to do (budgets spent, nothing pending): the run stays at rest; without
        an always-enabled rule Hypothesis would refuse such a state."""
        self.recorder.fired("settle")

    @invariant()
    def spec_holds(self) -> None:
        """The spec on every new atomic step, the ghost, and the stored state at rest."""
        rec = self.recorder
        new = self.source.new_events()
        raise_violations(rec, "trace", self.checker.feed(new))
        if self.comp.problems:
            raise_violations(
                rec, "ghost", [Violation("ghost_truth", p) for p in self.comp.problems]
            )
        b = self.backends[0]
        world = world_of(
            b.ledger.snapshot(), b.registry.artifacts(), b.registry.pointer(), b.registry, b.ledger
        )
        raise_violations(rec, "stores", check_snapshot(rec, world))
        if self.checker.world != world:
            raise rec.fail("the trace's after-images differ from the stored records")

    def teardown(self) -> None:
        """Close every connection and delete the files; never raise over the real failure."""
        end_example(self.recorder, self.tmp, [self.source.close, *(b.close for b in self.backends)])


def make_seams_machine(
    backend: str = "memory",
    *,
    recorder: Recorder | None = None,
    workdir: Path | None = None,
) -> type[RuleBasedStateMachine]:
    """The composition machine on 'memory', 'sqlite' or PostgreSQL (a connection per party)."""
    return bind_machine(
        SeamsMachine,
        backend,
        machine="seams",
        recorder=recorder,
        recorder_name="seams",
        workdir=workdir,
    )
