"""Generic explicit-state breadth-first model checker.

A model is a state machine described the way stateright and TLA+/TLC describe one:
``init_states()``, ``actions(state)``, ``next_state(state, action)`` and a list of named
properties.  The checker lives here, apart from any model, so every model in ``spec/`` is
checked by the same code and the counts it reports can be compared with TLC's.

Property kinds (``S`` is the state type):

* ``always``: the predicate holds in every reachable state (an invariant).  A state where
  it is false is a violation; because states are discovered in BFS order, the first one
  found has a shortest trace.
* ``sometimes``: the predicate holds in at least one reachable state (a reachability
  witness, stateright's ``sometimes``).  Not reaching it is *reported* in
  ``ExplorationResult.sometimes`` (value ``None``), never counted as a violation; when
  reached, the shortest witness trace is recorded.
* ``eventually``: bounded liveness.  The predicate holds in every reachable *quiescent*
  state: an expanded state none of whose enabled actions leads to a different (canonical)
  state.  Stuttering steps (an enabled action whose successor is the state itself) do not
  count as progress, matching TLA+, where a step that changes nothing is a stutter; without
  this a spec such as TwoPhase, whose receive actions stay enabled forever, would have no
  terminal state at all.  Only states whose successors were all computed are judged, so
  states outside ``within_boundary`` or cut off by ``max_states`` are never reported.  A
  violation's trace is a shortest path to a quiescent state where the predicate is false.
  This is weaker than TLA+ ``<>P`` under fairness: a cycle that never reaches quiescence
  (a livelock) is not detected, since that needs fairness and cycle detection.

Counting follows TLC so published numbers can be reproduced exactly:

* ``distinct_states``: unique canonical states found.
* ``generated_states``: initial states plus every successor computed, duplicates included.
* ``transitions``: enabled (state, action) successor computations (``next_state`` returned a
  state); ``generated_states == initial states + transitions``.
* ``max_depth``: the length of the longest shortest path, initial states having depth 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Generic, Literal, Protocol, TypeVar, cast

import attrs

__all__ = [
    "Counterexample",
    "ExplorationResult",
    "ExploreProgress",
    "ExplorerError",
    "Model",
    "Property",
    "PropertyKind",
    "Step",
    "explore",
]

S = TypeVar("S")
A = TypeVar("A")

PropertyKind = Literal["always", "sometimes", "eventually"]
_KINDS: frozenset[str] = frozenset({"always", "sometimes", "eventually"})


class ExplorerError(ValueError):
    """Raised for a misuse of the checker: bad bounds, a malformed model or property."""


def _check_kind(_instance: object, _attribute: object, value: Any) -> None:
    if value not in _KINDS:
        raise ExplorerError(f"property kind must be one of {sorted(_KINDS)}, got {value!r}")


def _check_name(_instance: object, _attribute: object, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ExplorerError(f"property name must be a non-empty string, got {value!r}")


@attrs.frozen
class Property(Generic[S]):
    """A named predicate over states, with the kind that says how it is judged."""

    name: str = attrs.field(validator=_check_name)
    kind: PropertyKind = attrs.field(validator=_check_kind)
    predicate: Callable[[S], bool]
    doc: str = ""


class Model(Protocol[S, A]):
    """What the checker needs from a model.

    Optional hooks, looked up with ``getattr`` so a model may leave them out:

    * ``canonical(state) -> Hashable``: the key under which a state is deduplicated, e.g.
      a symmetry-reduced form.  Default: the state itself, which must then be hashable.
      Properties must give the same answer for states with the same key.
    * ``action_label(action) -> str``: the name used in traces and ``action_counts``.
      Default: ``str(action)``.
    * ``within_boundary(state) -> bool``: states outside are recorded and checked against
      ``always``/``sometimes`` properties but not expanded.  Default: ``True``.
    """

    def init_states(self) -> Iterable[S]: ...

    def actions(self, state: S) -> Iterable[A]: ...

    def next_state(self, state: S, action: A) -> S | None:
        """The successor, or ``None`` when the action is disabled (not a transition)."""
        ...

    def properties(self) -> Sequence[Property[S]]: ...


@attrs.frozen
class Step(Generic[S]):
    """One trace entry: the action that led here (``None`` for an initial state)."""

    action: str | None
    state: S


@attrs.frozen
class Counterexample(Generic[S]):
    """A shortest trace from an initial state, for a violation or a sometimes-witness."""

    property_name: str
    kind: PropertyKind
    trace: tuple[Step[S], ...]

    @property
    def final_state(self) -> S:
        """The state the trace ends in: the one where the property was judged."""
        return self.trace[-1].state

    @property
    def actions(self) -> tuple[str, ...]:
        """The action labels of the trace, without the initial ``None``."""
        return tuple(step.action for step in self.trace if step.action is not None)

    def format(self, render: Callable[[S], str] = repr) -> str:
        """A human-readable multi-line rendering, one step per line."""
        lines = [f"{self.kind} property {self.property_name!r}: {len(self.trace)} states"]
        for i, step in enumerate(self.trace):
            head = "init" if step.action is None else step.action
            lines.append(f"  {i:>3} {head}: {render(step.state)}")
        return "\n".join(lines)

    def to_json(self, render: Callable[[S], object] = repr) -> dict[str, object]:
        """A JSON-able dict; ``render`` turns each state into something JSON can hold."""
        return {
            "property": self.property_name,
            "kind": self.kind,
            "trace": [{"action": s.action, "state": render(s.state)} for s in self.trace],
        }


@attrs.frozen
class ExploreProgress:
    """A snapshot passed to the progress callback, so long runs can be watched."""

    distinct_states: int
    generated_states: int
    queue_size: int
    depth: int
    elapsed_s: float
    final: bool = False


@attrs.frozen
class ExplorationResult(Generic[S]):
    """What one exploration found; the counts follow TLC's conventions (module docstring)."""

    distinct_states: int
    generated_states: int
    transitions: int
    max_depth: int
    complete: bool
    violations: tuple[Counterexample[S], ...]
    sometimes: dict[str, Counterexample[S] | None]
    action_counts: dict[str, int]
    elapsed_s: float

    @property
    def ok(self) -> bool:
        """No violation was found (check ``complete`` too before trusting it)."""
        return not self.violations

    def violation(self, name: str) -> Counterexample[S] | None:
        """The counterexample recorded for property ``name``, if it was violated."""
        for cex in self.violations:
            if cex.property_name == name:
                return cex
        return None

    def to_json(self, render: Callable[[S], object] = repr) -> dict[str, object]:
        """A JSON-able summary, including full traces rendered with ``render``."""
        return {
            "distinct_states": self.distinct_states,
            "generated_states": self.generated_states,
            "transitions": self.transitions,
            "max_depth": self.max_depth,
            "complete": self.complete,
            "elapsed_s": self.elapsed_s,
            "violations": [cex.to_json(render) for cex in self.violations],
            "sometimes": {
                name: None if cex is None else cex.to_json(render)
                for name, cex in self.sometimes.items()
            },
            "action_counts": dict(sorted(self.action_counts.items())),
        }

    summary = to_json


class _Stop(Exception):
    """Internal: unwinds the search loop when a bound or a violation ends it."""


def _check_bound(name: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ExplorerError(f"{name} must be an int or None, got {value!r}")
    if value < 1:
        raise ExplorerError(f"{name} must be at least 1, got {value}")


def explore(
    model: Model[S, A],
    *,
    max_states: int | None = None,
    max_depth: int | None = None,
    stop_on_violation: bool = True,
    progress: Callable[[ExploreProgress], None] | None = None,
    progress_every: int = 10_000,
) -> ExplorationResult[S]:
    """Explore ``model`` breadth-first and judge its properties.

    ``max_states`` caps the number of distinct states: the search stops as soon as one more
    would be added.  ``max_depth`` (TLC depth, initial states = 1) keeps states deeper than
    it out: successors of states at that depth are computed and counted, so those states
    are still judged, but new ones are not recorded, and ``complete`` is ``False`` only if
    such a new state existed.  With
    ``stop_on_violation`` the search ends at the first violation (``complete`` is then
    ``False``); otherwise it runs on and records one shortest counterexample per violated
    property.  ``progress`` is called after every ``progress_every`` expanded states and
    once more at the end with ``final=True``.
    """
    _check_bound("max_states", max_states)
    _check_bound("max_depth", max_depth)
    _check_bound("progress_every", progress_every)

    props = list(model.properties())
    names = [p.name for p in props]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ExplorerError(f"duplicate property names: {duplicates}")
    for p in props:
        if not isinstance(p, Property):
            raise ExplorerError(f"properties() must return Property objects, got {p!r}")
    always = [p for p in props if p.kind == "always"]
    eventually = [p for p in props if p.kind == "eventually"]
    pending_sometimes = [p for p in props if p.kind == "sometimes"]

    canonical_hook = getattr(model, "canonical", None)
    label_hook = getattr(model, "action_label", None)
    boundary_hook = getattr(model, "within_boundary", None)
    key_of = cast(Callable[[S], Hashable], canonical_hook) if canonical_hook else None
    label_of = cast(Callable[[Any], str], label_hook) if label_hook else str
    within = cast(Callable[[S], bool], boundary_hook) if boundary_hook else None

    start = time.perf_counter()
    # One slot per distinct state, in discovery (= BFS) order: the state itself, the index
    # of the state it was first reached from, and the label of that step.  Traces are
    # rebuilt from these parent pointers, so no path is ever stored whole.
    states: list[S] = []
    parents: list[int] = []
    labels: list[str | None] = []
    seen: dict[Hashable, int] = {}

    violations: list[Counterexample[S]] = []
    violated: set[str] = set()
    witnesses: dict[str, Counterexample[S] | None] = {p.name: None for p in pending_sometimes}
    action_counts: dict[str, int] = {}
    generated = 0
    transitions = 0
    complete = True
    depth = 1
    level_end = 0  # index one past the last state of the current BFS level

    def trace(index: int) -> tuple[Step[S], ...]:
        steps: list[Step[S]] = []
        while index >= 0:
            steps.append(Step(labels[index], states[index]))
            index = parents[index]
        steps.reverse()
        return tuple(steps)

    def report(prop: Property[S], index: int) -> None:
        violated.add(prop.name)
        violations.append(Counterexample(prop.name, prop.kind, trace(index)))
        if stop_on_violation:
            raise _Stop

    def add(key: Hashable, state: S, parent: int, label: str | None) -> None:
        """Record a newly discovered state, then judge the always/sometimes properties."""
        nonlocal complete
        if max_states is not None and len(states) >= max_states:
            complete = False
            raise _Stop
        index = len(states)
        seen[key] = index
        states.append(state)
        parents.append(parent)
        labels.append(label)
        for prop in always:
            if prop.name not in violated and not prop.predicate(state):
                report(prop, index)
        if pending_sometimes:
            for prop in list(pending_sometimes):
                if prop.predicate(state):
                    witnesses[prop.name] = Counterexample(prop.name, prop.kind, trace(index))
                    pending_sometimes.remove(prop)

    def emit(final: bool) -> None:
        if progress is not None:
            progress(
                ExploreProgress(
                    distinct_states=len(states),
                    generated_states=generated,
                    queue_size=len(states) - expanded,
                    depth=depth,
                    elapsed_s=time.perf_counter() - start,
                    final=final,
                )
            )

    expanded = 0
    stopped = False
    try:
        for init in model.init_states():
            generated += 1
            key = init if key_of is None else key_of(init)
            if key not in seen:
                add(key, init, -1, None)
        if generated == 0:
            raise ExplorerError("model.init_states() produced no state")
        level_end = len(states)

        while expanded < len(states):
            index = expanded
            if index == level_end:
                depth += 1
                level_end = len(states)
            expanded += 1
            if expanded % progress_every == 0:
                emit(final=False)
            state = states[index]
            if within is not None and not within(state):
                continue
            # At the depth bound successors are still computed (so quiescence is judged and
            # completeness is exact) but new ones are dropped instead of recorded.
            at_limit = max_depth is not None and depth >= max_depth
            progressed = False
            for action in model.actions(state):
                succ = model.next_state(state, action)
                if succ is None:
                    continue
                generated += 1
                transitions += 1
                label = label_of(action)
                action_counts[label] = action_counts.get(label, 0) + 1
                key = succ if key_of is None else key_of(succ)
                found = seen.get(key)
                if found is None:
                    progressed = True
                    if at_limit:
                        complete = False
                    else:
                        add(key, succ, index, label)
                elif found != index:
                    progressed = True
            if not progressed:
                for prop in eventually:
                    if prop.name not in violated and not prop.predicate(state):
                        report(prop, index)
    except _Stop:
        stopped = True
    if stopped:
        complete = False

    # BFS records states in non-decreasing depth, so the last one is a deepest one.
    max_seen_depth = 0
    i = len(states) - 1
    while i >= 0:
        max_seen_depth += 1
        i = parents[i]

    emit(final=True)
    return ExplorationResult(
        distinct_states=len(states),
        generated_states=generated,
        transitions=transitions,
        max_depth=max_seen_depth,
        complete=complete,
        violations=tuple(violations),
        sometimes=witnesses,
        action_counts=action_counts,
        elapsed_s=time.perf_counter() - start,
    )
