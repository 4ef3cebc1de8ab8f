"""What a machine run observed: rules fired, declared edges covered, checks run, paths reached.

Hypothesis builds a fresh machine object per example, so per-run facts cannot live on the
machine: each machine class carries one `Recorder` that every instance writes into, and the
campaign runner reads it afterwards. `TraceChecker` is the one place where new trace events
are judged by the spec (step + always invariants per atomic step) and mapped onto declared
edges, so the three machines cannot drift apart in how they read a trace.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar, cast

import attrs

from rollout_lifecycle.model.events import TraceEvent
from rollout_lifecycle.model.ledger import Ledger
from rollout_lifecycle.model.machines import ACTIVATION, LIFECYCLE, MachineSpec
from rollout_lifecycle.model.records import ActivePointer, ArtifactRecord, LedgerEntry
from rollout_lifecycle.model.registry import RegistryStore
from rollout_lifecycle.spec.coverage import edge_of
from rollout_lifecycle.spec.invariants import (
    OUTCOME_INVARIANTS,
    SOMETIMES,
    Replayer,
    Violation,
    World,
    check_at_rest,
    invariant_names,
    sometimes_from_events,
)

F = TypeVar("F", bound=Callable[..., Any])

# coverage keys: the diagram tool reads these names
DECLARED: dict[str, MachineSpec] = {"lifecycle": LIFECYCLE, "activation": ACTIVATION}


class SpecViolation(AssertionError):
    """A named invariant, reference-model or ghost check failed; the message says which."""


# the declared edge an event took: one reader for the fuzzer, the explorer and the diagrams
edge_key = edge_of


EVENTUALLY_NAMES = invariant_names(("rest", "eventually"), with_registry=True)
RESERVATION_NAMES = tuple(OUTCOME_INVARIANTS)


@attrs.define
class Recorder:
    """Counters shared by every instance of one machine class during a campaign."""

    machine: str
    examples: int = 0
    steps: int = 0
    rules: Counter[str] = attrs.field(factory=Counter)
    edges: dict[str, Counter[str]] = attrs.field(
        factory=lambda: {name: Counter() for name in DECLARED}
    )
    invariants: Counter[str] = attrs.field(factory=Counter)
    sometimes: Counter[str] = attrs.field(factory=Counter)
    notes: Counter[str] = attrs.field(factory=Counter)
    violations: int = 0
    first_failure_example: int | None = None
    # the example in which each edge / sometimes-property was first reached: what budget
    # reaches a goal (`campaign` names it when a smaller budget misses one)
    first_edge: dict[str, int] = attrs.field(factory=dict)
    first_sometimes: dict[str, int] = attrs.field(factory=dict)
    started: float = attrs.field(factory=time.perf_counter)
    on_example: Callable[[Recorder], None] | None = None

    def start_example(self) -> None:
        """A new machine instance: one more example (shrinking runs count too)."""
        self.examples += 1
        if self.on_example is not None:
            self.on_example(self)

    def fired(self, rule: str) -> None:
        """One rule ran: it is one step."""
        self.steps += 1
        self.rules[rule] += 1

    def checked(self, names: Iterable[str]) -> None:
        """These named checks ran once more."""
        self.invariants.update(names)

    def reached(self, name: str) -> None:
        """A sometimes-property was observed outside the trace (an outcome of a call)."""
        if name not in SOMETIMES:
            raise KeyError(f"{name!r} is not a sometimes-property in spec.invariants.SOMETIMES")
        self.sometimes[name] += 1
        self.first_sometimes.setdefault(name, self.examples)

    def note(self, name: str) -> None:
        """Something the model did that the machine tolerates but a person should look at."""
        self.notes[name] += 1

    def observe(self, events: Sequence[TraceEvent]) -> None:
        """Edges covered and sometimes-properties shown by new trace events."""
        for ev in events:
            key = edge_key(ev)
            if key is not None:
                self.edges[key[0]][key[1]] += 1
                self.first_edge.setdefault(f"{key[0]}: {key[1]}", self.examples)
        for name in sometimes_from_events(events):
            self.sometimes[name] += 1
            self.first_sometimes.setdefault(name, self.examples)

    def example_failed(self) -> None:
        """The running example raised; remember the first such example's number."""
        self.violations += 1
        if self.first_failure_example is None:
            self.first_failure_example = self.examples

    def fail(self, text: str) -> SpecViolation:
        """The exception to raise for a failed check (the caller raises it, so mypy sees it)."""
        return SpecViolation(f"[{self.machine}] {text}")


def counted(fn: F) -> F:
    """Count a rule's firing on the recorder and on the machine (`step_no`) before running it."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.recorder.fired(name)
        self.step_no += 1
        return fn(self, *args, **kwargs)

    return cast(F, wrapper)


def world_of(
    entries: Mapping[str, LedgerEntry],
    artifacts: Iterable[ArtifactRecord] | None = None,
    pointer: ActivePointer | None = None,
    registry: RegistryStore | None = None,
    ledger: Ledger | None = None,
) -> World:
    """A spec World from a ledger snapshot and (optionally) the registry's records; with
    `registry`, its durable worker set, stored worker reports and attempt tokens too; with
    `ledger`, its update records."""
    arts = None if artifacts is None else {a.version: a for a in artifacts}
    updates = {} if ledger is None else dict(ledger.updates())
    # a world read from stores has no history to derive these from: the records say them
    landed = frozenset(u for u, r in updates.items() if r.status == "landed")
    poisoned = frozenset(u for u, r in updates.items() if r.status == "poisoned")
    if registry is None:
        return World(
            entries=dict(entries),
            artifacts=arts,
            pointer=pointer,
            updates=updates,
            landed=landed,
            poisoned=poisoned,
        )
    return World(
        entries=dict(entries),
        artifacts=arts,
        pointer=pointer,
        required_workers=registry.required_workers(),
        workers=registry.workers(),
        policy=registry.policy(),
        tokens={(t.version, t.worker_id): t for t in registry.attempt_tokens()},
        updates=updates,
        landed=landed,
        poisoned=poisoned,
    )


class TraceChecker:
    """Replays new trace events step by step (one txn = one atomic step) against the spec.

    Keeps the replayed world, so the caller can also compare it with the stored state: a
    trace whose after-images disagree with the store would make every trace check a lie.
    """

    def __init__(self, recorder: Recorder, *, with_registry: bool, world: World | None = None):
        self.recorder = recorder
        self.with_registry = with_registry
        self._replayer = Replayer(
            world or World(artifacts={} if with_registry else None), with_registry=with_registry
        )
        self._names = invariant_names(("step", "always"), with_registry=with_registry)

    @property
    def world(self) -> World:
        """The replayed world so far (a copy)."""
        return self._replayer.world()

    def feed(self, events: Sequence[TraceEvent], *, observe: bool = True) -> list[Violation]:
        """Check each atomic step in `events`; record edges and sometimes when `observe`."""
        before = self._replayer.steps
        out = self._replayer.feed(events)
        for _ in range(self._replayer.steps - before):
            self.recorder.checked(self._names)
        if observe:
            self.recorder.observe(events)
        return out


def check_snapshot(recorder: Recorder, world: World) -> list[Violation]:
    """The spec's always and rest invariants on a stored snapshot (not the replayed world).

    Machines call this between rules, i.e. between calls, which is when `rest` invariants
    must hold; a spec without `check_at_rest` falls back to the always invariants.
    """
    recorder.checked(invariant_names(("always", "rest"), with_registry=world.artifacts is not None))
    return check_at_rest(world)


def raise_violations(recorder: Recorder, where: str, violations: Sequence[Violation]) -> None:
    """Fail with every violation's text, so the report names the invariant."""
    if violations:
        text = "; ".join(str(v) for v in violations[:8])
        more = f" (+{len(violations) - 8} more)" if len(violations) > 8 else ""
        raise recorder.fail(f"{where}: {text}{more}")
