"""The two protocols, declared once as `transitions` machines, and the one reader of their edges.

Everything else in the project (ledgers, the four functions, the coordinator, the explorer,
diagrams, trace checks, docs) asks `LIFECYCLE` or `ACTIVATION` for legal moves; nobody retypes
a transition table. The declarations below are the single source of truth.

Each state carries tags (`normal`, `failure`, `terminal`, `recovery`...) used to group it in
diagrams; each transition carries a `kind` (`normal`, `failure`, `recovery`) used to style it.
Guards are condition names: a guarded edge is taken only when its guard is true, and, as in
`transitions`, the first declared edge whose guards pass wins.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
from transitions import Machine, Transition
from transitions.extensions.states import Tags, add_state_features

from rollout_lifecycle.model.errors import IllegalTransition, brief

EDGE_KINDS = ("normal", "failure", "recovery")
# tags that say how a state is drawn and listed; every other tag is a rule tag
DISPLAY_TAGS = ("normal", "failure", "offline", "recovery", "terminal")


class KindedTransition(Transition):
    """A `transitions` edge that also records its kind, so diagrams style it from the machine."""

    def __init__(self, *args: Any, kind: str = "normal", **kwargs: Any) -> None:
        if kind not in EDGE_KINDS:
            raise ValueError(f"edge kind must be one of {EDGE_KINDS}, got {brief(kind)}")
        super().__init__(*args, **kwargs)
        self.kind = kind


@add_state_features(Tags)
class DeclaredMachine(Machine):
    """`transitions.Machine` with tagged states and kinded edges; never fires on a hot path."""

    transition_cls = KindedTransition


# --------------------------------------------------------------------------------------------
# Rollout lifecycle (CONTRACT sections 1-2)
# --------------------------------------------------------------------------------------------

LIFECYCLE_STATES: list[dict[str, Any]] = [
    # display tags: normal / failure / offline / terminal. Rule tags, read by model.rules (the
    # write path) and spec/ (the checkers): `start` (a new entry may begin here),
    # `carries_reward` (a real reward value is required), `admitted` (an admission stamp
    # that passed is required), `reward_failure`, and `stage:<s>` (where a failure is
    # recorded).
    {"name": "dispatched", "tags": ["normal", "start"]},
    {"name": "generated", "tags": ["normal", "start"]},
    {"name": "rewarded", "tags": ["normal", "start", "carries_reward"]},
    {"name": "reserved", "tags": ["normal", "carries_reward", "admitted"]},
    {"name": "consumed", "tags": ["normal", "terminal", "carries_reward", "admitted"]},
    {"name": "generation_failed", "tags": ["failure", "terminal", "stage:generation"]},
    {
        "name": "reward_timed_out",
        "tags": ["failure", "terminal", "reward_failure", "stage:reward"],
    },
    {"name": "reward_errored", "tags": ["failure", "terminal", "reward_failure", "stage:reward"]},
    {"name": "update_failed", "tags": ["failure", "terminal", "stage:update"]},
    {
        "name": "quarantined",
        "tags": ["failure", "terminal", "stage:admission", "stage:activation", "stage:recovery"],
    },
    {"name": "retired_stale", "tags": ["offline", "terminal", "stage:admission"]},
]

LIFECYCLE_TRANSITIONS: list[dict[str, Any]] = [
    # normal path; the record is created at dispatch so the version is stamped then (bug 7)
    {"trigger": "generation_done", "source": "dispatched", "dest": "generated"},
    {"trigger": "reward_ready", "source": "generated", "dest": "rewarded"},
    {"trigger": "reserve", "source": "rewarded", "dest": "reserved"},
    {"trigger": "commit", "source": "reserved", "dest": "consumed"},
    # a long update's heartbeat: the owner's lease runs from now again (the owner never changes)
    {"trigger": "renew_lease", "source": "reserved", "dest": "reserved"},
    # distinct failures, each with its own stage
    {
        "trigger": "generation_failed",
        "source": "dispatched",
        "dest": "generation_failed",
        "kind": "failure",
    },
    {
        "trigger": "reward_timeout",
        "source": "generated",
        "dest": "reward_timed_out",
        "kind": "failure",
    },
    {"trigger": "reward_error", "source": "generated", "dest": "reward_errored", "kind": "failure"},
    {"trigger": "update_failed", "source": "reserved", "dest": "update_failed", "kind": "failure"},
    {
        "trigger": "quarantine",
        "source": ["dispatched", "generated", "rewarded"],
        "dest": "quarantined",
        "kind": "failure",
    },
    {"trigger": "retire_stale", "source": "rewarded", "dest": "retired_stale", "kind": "failure"},
    # a returned reservation: the recovery rule decides between quarantine and release
    {
        "trigger": "abort",
        "source": "reserved",
        "dest": "quarantined",
        "conditions": "recovery_quarantines",
        "kind": "recovery",
    },
    {"trigger": "abort", "source": "reserved", "dest": "rewarded", "kind": "recovery"},
    {
        "trigger": "expire_lease",
        "source": "reserved",
        "dest": "quarantined",
        "conditions": "recovery_quarantines",
        "kind": "recovery",
    },
    {"trigger": "expire_lease", "source": "reserved", "dest": "rewarded", "kind": "recovery"},
]

# --------------------------------------------------------------------------------------------
# Policy activation, one machine per artifact version (CONTRACT section 4)
# --------------------------------------------------------------------------------------------

ACTIVATION_STATES: list[dict[str, Any]] = [
    # rule tags: `unresolved` (the attempt has not activated or failed yet), `was_active`
    # (the version was the active pointer at some time), `stage:<s>` (where a failure is
    # recorded); the rest are display tags
    {"name": "prepared", "tags": ["normal", "unresolved"]},
    {"name": "committed", "tags": ["normal", "unresolved"]},
    {"name": "awaiting_acks", "tags": ["normal", "unresolved"]},
    {"name": "active", "tags": ["normal", "was_active"]},
    {"name": "superseded", "tags": ["normal", "was_active"]},
    {"name": "commit_failed", "tags": ["failure", "terminal", "stage:artifact"]},
    {"name": "distribution_failed", "tags": ["failure", "stage:distribution"]},
    {
        "name": "abandoned",
        "tags": ["failure", "terminal", "stage:artifact", "stage:distribution"],
    },
    {"name": "rolled_back", "tags": ["recovery", "terminal", "was_active"]},
]

ACTIVATION_TRANSITIONS: list[dict[str, Any]] = [
    {"trigger": "commit_artifact", "source": "prepared", "dest": "committed"},
    {"trigger": "distribute", "source": "committed", "dest": "awaiting_acks"},
    # the pointer flips only with a committed artifact and every required ack matching
    {"trigger": "activate", "source": "awaiting_acks", "dest": "active", "conditions": "all_acked"},
    {"trigger": "supersede", "source": "active", "dest": "superseded"},
    {"trigger": "fail_commit", "source": "prepared", "dest": "commit_failed", "kind": "failure"},
    {
        "trigger": "fail_distribution",
        "source": "awaiting_acks",
        "dest": "distribution_failed",
        "kind": "failure",
    },
    {
        "trigger": "retry",
        "source": "distribution_failed",
        "dest": "awaiting_acks",
        "kind": "recovery",
    },
    {
        "trigger": "abandon",
        "source": ["committed", "distribution_failed"],
        "dest": "abandoned",
        "kind": "failure",
    },
    # explicit rollback: the active artifact steps down, the recorded pointer comes back
    {"trigger": "roll_back", "source": "active", "dest": "rolled_back", "kind": "recovery"},
    {"trigger": "reinstate", "source": "superseded", "dest": "active", "kind": "recovery"},
]


@attrs.frozen
class Edge:
    """One declared transition, as read off the machine."""

    source: str
    event: str
    dest: str
    conditions: tuple[str, ...]
    unless: tuple[str, ...]
    kind: str

    @property
    def guard(self) -> str:
        """Human-readable guard, e.g. ``recovery_quarantines`` or ``!all_acked``; '' if none."""
        parts = [*self.conditions, *(f"!{u}" for u in self.unless)]
        return " & ".join(parts)

    def passes(self, guards: Mapping[str, bool]) -> bool:
        """Whether this edge's guards allow it; an unspecified guard counts as False."""
        return all(guards.get(c, False) for c in self.conditions) and not any(
            guards.get(u, False) for u in self.unless
        )


def _names(callbacks: Iterable[Any]) -> tuple[str, ...]:
    names = []
    for cb in callbacks:
        func = cb.func
        if not isinstance(func, str):
            raise TypeError("declared guards must be named (strings), so they can be read back")
        names.append(func)
    return tuple(names)


class MachineSpec:
    """The legal edges of one declared machine, read once off a built `transitions` Machine.

    Lookups are plain dict reads (about 0.1 us) instead of firing a trigger (about 12 us), and
    the table is never retyped: `edges` comes from `machine.events[...].transitions`.
    """

    def __init__(
        self,
        name: str,
        states: list[dict[str, Any]],
        transitions: list[dict[str, Any]],
        initial: str,
    ) -> None:
        self.name = name
        self.machine = self.build(states, transitions, initial)
        self.initial: str = self.machine.initial
        self.states: tuple[str, ...] = tuple(self.machine.states)
        self.tags: dict[str, tuple[str, ...]] = {
            s: tuple(self.machine.get_state(s).tags) for s in self.states
        }
        self._stages: dict[str, frozenset[str]] = {
            s: frozenset(t.split(":", 1)[1] for t in tags if t.startswith("stage:"))
            for s, tags in self.tags.items()
        }
        edges: list[Edge] = []
        for event_name, event in self.machine.events.items():
            for source, trans_list in event.transitions.items():
                for t in trans_list:
                    # `transitions` keeps `unless` as conditions whose target is False
                    edges.append(
                        Edge(
                            source=source,
                            event=event_name,
                            dest=t.dest,
                            conditions=_names(c for c in t.conditions if c.target),
                            unless=_names(c for c in t.conditions if not c.target),
                            kind=t.kind,
                        )
                    )
        self.edges: tuple[Edge, ...] = tuple(edges)
        self.events: tuple[str, ...] = tuple(dict.fromkeys(e.event for e in self.edges))
        self._by_key: dict[tuple[str, str], tuple[Edge, ...]] = {}
        for e in self.edges:
            self._by_key[(e.source, e.event)] = (*self._by_key.get((e.source, e.event), ()), e)
        outgoing = {e.source for e in self.edges}
        self.terminal: frozenset[str] = frozenset(s for s in self.states if s not in outgoing)
        self.guards: tuple[str, ...] = tuple(
            dict.fromkeys(g for e in self.edges for g in (*e.conditions, *e.unless))
        )
        self._check_declaration()

    @staticmethod
    def build(states: list[dict[str, Any]], transitions: list[dict[str, Any]], initial: str) -> Any:
        """Build the declared machine (model-less, `auto_transitions` off, no queued events)."""
        return DeclaredMachine(
            model=None,
            states=[dict(s) for s in states],
            transitions=[dict(t) for t in transitions],
            initial=initial,
            auto_transitions=False,
            ignore_invalid_triggers=False,
        )

    def _check_declaration(self) -> None:
        tagged = {s for s, tags in self.tags.items() if "terminal" in tags}
        if tagged != set(self.terminal):
            raise ValueError(
                f"{self.name}: states tagged terminal {sorted(tagged)} differ from states "
                f"without outgoing edges {sorted(self.terminal)}"
            )
        for e in self.edges:
            if e.dest is None or e.dest == "":
                raise ValueError(f"{self.name}: internal transition {e} is not allowed")

    # ---- queries -----------------------------------------------------------------------

    def candidates(self, state: str, event: str) -> tuple[Edge, ...]:
        """Declared edges for (state, event), in declaration order; () if none."""
        return self._by_key.get((state, event), ())

    def is_legal(self, state: str, event: str) -> bool:
        """Whether some declared edge leaves `state` on `event` (for some guard values)."""
        return (state, event) in self._by_key

    def resolve(self, state: str, event: str, guards: Mapping[str, bool] | None = None) -> Edge:
        """The edge taken from `state` on `event` under `guards` (unspecified guards: False).

        Raises IllegalTransition when no edge is declared, or when every declared edge is
        blocked by its guard (the machine would refuse the trigger).
        """
        if state not in self.tags:
            raise IllegalTransition(self.name, state, event, f"unknown state {brief(state)}")
        cands = self._by_key.get((state, event))
        if not cands:
            if event not in self.events:
                raise IllegalTransition(self.name, state, event, f"unknown event {brief(event)}")
            raise IllegalTransition(self.name, state, event, "no such edge")
        g = guards or {}
        for e in cands:
            if e.passes(g):
                return e
        raise IllegalTransition(
            self.name, state, event, f"guard refused ({', '.join(c.guard for c in cands)})"
        )

    def next_state(self, state: str, event: str, guards: Mapping[str, bool] | None = None) -> str:
        """Destination of `event` from `state` under `guards`; see `resolve`."""
        return self.resolve(state, event, guards).dest

    def outgoing(self, state: str) -> tuple[Edge, ...]:
        """Every declared edge leaving `state`."""
        return tuple(e for e in self.edges if e.source == state)

    def edge_id(self, edge: Edge) -> str:
        """Stable label for coverage counts: ``source --event[guard]--> dest``."""
        guard = f"[{edge.guard}]" if edge.guard else ""
        return f"{edge.source} --{edge.event}{guard}--> {edge.dest}"

    def states_tagged(self, tag: str) -> tuple[str, ...]:
        """States carrying `tag`, in declaration order."""
        return tuple(s for s in self.states if tag in self.tags[s])

    def display_tags(self, state: str) -> tuple[str, ...]:
        """The tags that say how `state` is drawn (normal, failure, terminal...)."""
        return tuple(t for t in self.tags[state] if t in DISPLAY_TAGS)

    def stages(self, state: str) -> frozenset[str]:
        """Stages a failure in `state` may be recorded at (its `stage:` tags); empty if none."""
        return self._stages[state]  # read off the tags once (every write's check asks)


LIFECYCLE = MachineSpec("lifecycle", LIFECYCLE_STATES, LIFECYCLE_TRANSITIONS, initial="dispatched")
ACTIVATION = MachineSpec(
    "activation", ACTIVATION_STATES, ACTIVATION_TRANSITIONS, initial="prepared"
)
MACHINES: dict[str, MachineSpec] = {"lifecycle": LIFECYCLE, "activation": ACTIVATION}
