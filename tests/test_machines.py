"""The declared machines, and the table every other part reads off them."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from transitions import Machine

from rollout_lifecycle.model.errors import IllegalTransition
from rollout_lifecycle.model.machines import (
    ACTIVATION,
    ACTIVATION_STATES,
    ACTIVATION_TRANSITIONS,
    LIFECYCLE,
    LIFECYCLE_STATES,
    LIFECYCLE_TRANSITIONS,
    MachineSpec,
)

SPECS = [
    (LIFECYCLE, LIFECYCLE_STATES, LIFECYCLE_TRANSITIONS),
    (ACTIVATION, ACTIVATION_STATES, ACTIVATION_TRANSITIONS),
]


class GuardModel:
    """A model whose guard methods answer from a dict, so every guard valuation can be fired."""

    def __init__(self, guards: dict[str, bool]) -> None:
        self.guards = guards

    def __getattr__(self, name: str) -> Any:
        if name in ("guards",) or name.startswith("_"):
            raise AttributeError(name)
        if name in self.__dict__.get("guards", {}):
            return lambda *a, **k: self.guards[name]
        raise AttributeError(name)


def fire(
    states: list[dict[str, Any]],
    transitions: list[dict[str, Any]],
    state: str,
    event: str,
    guards: dict[str, bool],
) -> str | None:
    """Fire `event` on a freshly built real `transitions` machine; None when it refuses."""
    model = GuardModel(guards)
    clean = [{k: v for k, v in t.items() if k != "kind"} for t in transitions]
    Machine(
        model=model,
        states=[s["name"] for s in states],
        transitions=clean,
        initial=state,
        auto_transitions=False,
    )
    try:
        ok = model.trigger(event)  # type: ignore[attr-defined]
    except Exception:
        return None
    return model.state if ok else None  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize(("spec", "states", "transitions"), SPECS, ids=["lifecycle", "activation"])
def test_table_equals_declared_machine(
    spec: MachineSpec, states: list[dict[str, Any]], transitions: list[dict[str, Any]]
) -> None:
    """For every state, event and guard valuation, the table answers what the real machine does."""
    for state, event in itertools.product(spec.states, spec.events):
        for values in itertools.product([False, True], repeat=len(spec.guards)):
            guards = dict(zip(spec.guards, values, strict=True))
            expected = fire(states, transitions, state, event, guards)
            try:
                got: str | None = spec.next_state(state, event, guards)
            except IllegalTransition:
                got = None
            assert got == expected, (state, event, guards)


@pytest.mark.parametrize(("spec", "states", "transitions"), SPECS, ids=["lifecycle", "activation"])
def test_edges_are_the_declared_transitions(
    spec: MachineSpec, states: list[dict[str, Any]], transitions: list[dict[str, Any]]
) -> None:
    """The edge list has one entry per (declared transition, source), nothing more."""
    declared = set()
    for t in transitions:
        sources = t["source"] if isinstance(t["source"], list) else [t["source"]]
        conds = t.get("conditions", ())
        conds = (conds,) if isinstance(conds, str) else tuple(conds)
        for s in sources:
            declared.add((s, t["trigger"], t["dest"], conds, t.get("kind", "normal")))
    got = {(e.source, e.event, e.dest, e.conditions, e.kind) for e in spec.edges}
    assert got == declared
    assert len(spec.edges) == len(declared)
    assert spec.states == tuple(s["name"] for s in states)


def test_auto_transitions_are_off() -> None:
    """No `to_<state>` shortcut exists: only declared events move a machine."""
    for spec in (LIFECYCLE, ACTIVATION):
        assert not any(ev.startswith("to_") for ev in spec.machine.events)


def test_terminal_states_absorb() -> None:
    """Terminal states have no outgoing edge, and they are exactly the ones tagged terminal."""
    assert LIFECYCLE.terminal == {
        "consumed",
        "generation_failed",
        "reward_timed_out",
        "reward_errored",
        "update_failed",
        "quarantined",
        "retired_stale",
    }
    for spec in (LIFECYCLE, ACTIVATION):
        for s in spec.terminal:
            assert spec.outgoing(s) == ()
            for ev in spec.events:
                with pytest.raises(IllegalTransition):
                    spec.resolve(s, ev)


def test_failure_states_are_distinct() -> None:
    """Generation, reward timeout, reward error, update failure, quarantine and stale retirement
    are separate states, not one generic failure."""
    failures = set(LIFECYCLE.states_tagged("failure")) | set(LIFECYCLE.states_tagged("offline"))
    assert failures == {
        "generation_failed",
        "reward_timed_out",
        "reward_errored",
        "update_failed",
        "quarantined",
        "retired_stale",
    }


def test_guard_chooses_between_quarantine_and_release() -> None:
    """abort and expire_lease release by default and quarantine when the recovery rule says so."""
    for ev in ("abort", "expire_lease"):
        assert LIFECYCLE.next_state("reserved", ev) == "rewarded"
        assert LIFECYCLE.next_state("reserved", ev, {"recovery_quarantines": True}) == "quarantined"


def test_activate_needs_all_acked_guard() -> None:
    """The pointer edge is refused while the all_acked guard is false."""
    with pytest.raises(IllegalTransition, match="guard refused"):
        ACTIVATION.resolve("awaiting_acks", "activate")
    assert ACTIVATION.next_state("awaiting_acks", "activate", {"all_acked": True}) == "active"


def test_unknown_state_and_event_are_named() -> None:
    """An unknown state or event is refused with a message naming it."""
    with pytest.raises(IllegalTransition, match="unknown state 'nope'"):
        LIFECYCLE.resolve("nope", "reserve")
    with pytest.raises(IllegalTransition, match="unknown event 'nope'"):
        LIFECYCLE.resolve("rewarded", "nope")


def test_bad_declaration_is_refused() -> None:
    """A state tagged terminal that has an outgoing edge is a declaration error."""
    with pytest.raises(ValueError, match="tagged terminal"):
        MachineSpec(
            "bad",
            [{"name": "a", "tags": ["terminal"]}, {"name": "b", "tags": []}],
            [{"trigger": "go", "source": "a", "dest": "b"}],
            initial="a",
        )


def test_edge_ids_are_unique() -> None:
    """Coverage keys identify edges one to one."""
    for spec in (LIFECYCLE, ACTIVATION):
        ids = [spec.edge_id(e) for e in spec.edges]
        assert len(ids) == len(set(ids))
