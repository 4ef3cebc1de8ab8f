"""Tests for the generic BFS explorer, calibrated against TLC on Lamport's classic specs."""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from rollout_lifecycle.spec.classic import (
    ALL_RMS_COMMITTED_AT_QUIESCENCE,
    Act,
    EagerCommitTwoPhase,
    SymmetricTwoPhase,
    TCommit,
    TCState,
    TPState,
    TwoPhase,
)
from rollout_lifecycle.spec.explorer import (
    Counterexample,
    ExplorationResult,
    ExploreProgress,
    ExplorerError,
    Model,
    Property,
    explore,
)

# --------------------------------------------------------------------------------------
# Toy models
# --------------------------------------------------------------------------------------

Counters = tuple[int, ...]


class CounterModel:
    """``n`` counters, each incremented up to ``limit``; interchangeable, so symmetric."""

    def __init__(
        self,
        n: int = 3,
        limit: int = 2,
        props: Sequence[Property[Counters]] = (),
        inits: Sequence[Counters] | None = None,
    ) -> None:
        self.n = n
        self.limit = limit
        self.props = tuple(props)
        self.inits = inits if inits is not None else [(0,) * n]

    def init_states(self) -> Iterator[Counters]:
        yield from self.inits

    def actions(self, state: Counters) -> Iterator[int]:
        yield from range(self.n)

    def next_state(self, state: Counters, action: int) -> Counters | None:
        if state[action] >= self.limit:
            return None
        return (*state[:action], state[action] + 1, *state[action + 1 :])

    def properties(self) -> Sequence[Property[Counters]]:
        return self.props


class SymmetricCounters(CounterModel):
    """The same counters, keyed by their multiset of values."""

    def canonical(self, state: Counters) -> Counters:
        return tuple(sorted(state))


class LabelledCounters(CounterModel):
    """The same counters, with spec-style action names."""

    def action_label(self, action: int) -> str:
        return f"Inc(c{action})"


class BoundedCounters(CounterModel):
    """Counters whose states with a total above 2 are recorded but not expanded."""

    def within_boundary(self, state: Counters) -> bool:
        return sum(state) <= 2


class StutterAtEnd:
    """A 0..3 counter whose last state can only step to itself (a stutter)."""

    def init_states(self) -> Iterator[int]:
        yield 0

    def actions(self, state: int) -> Iterator[str]:
        yield "step"

    def next_state(self, state: int, action: str) -> int | None:
        return min(state + 1, 3)

    def properties(self) -> Sequence[Property[int]]:
        return (Property("EndsAtThree", "eventually", lambda s: s == 3),)


def _replays(model: Model[TPState, Act], cex: Counterexample[TPState]) -> bool:
    """Whether each step of ``cex`` is a real transition of ``model`` from an initial state."""
    if cex.trace[0].action is not None or cex.trace[0].state not in set(model.init_states()):
        return False
    for prev, step in zip(cex.trace, cex.trace[1:], strict=False):
        successors = {str(a): model.next_state(prev.state, a) for a in model.actions(prev.state)}
        if step.action is None or successors.get(step.action) != step.state:
            return False
    return True


# --------------------------------------------------------------------------------------
# TLC calibration
# --------------------------------------------------------------------------------------


def _clean(result: ExplorationResult[Any]) -> None:
    assert result.complete
    assert result.violations == ()
    assert result.generated_states == 1 + result.transitions
    assert sum(result.action_counts.values()) == result.transitions


def test_tcommit_3_matches_tlc() -> None:
    """TCommit with 3 RMs: TLC's 34 distinct, 94 generated, depth 7."""
    r = explore(TCommit(3))
    assert (r.distinct_states, r.generated_states, r.max_depth) == (34, 94, 7)
    _clean(r)


def test_twophase_3_matches_tlc() -> None:
    """TwoPhase with 3 RMs: TLC's 288 distinct, 1146 generated, depth 11."""
    r = explore(TwoPhase(3))
    assert (r.distinct_states, r.generated_states, r.max_depth) == (288, 1146, 11)
    _clean(r)


def test_twophase_5_matches_tlc() -> None:
    """TwoPhase with 5 RMs: TLC's 8832 distinct states, explored in a few seconds."""
    t0 = time.perf_counter()
    r = explore(TwoPhase(5))
    elapsed = time.perf_counter() - t0
    assert r.distinct_states == 8832
    # Depth follows from the spec: 5 prepares, 5 receipts, commit, 5 commit receipts.
    assert r.max_depth == 17
    _clean(r)
    assert elapsed < 20


def test_twophase_refines_tcommit() -> None:
    """Every TwoPhase step, projected onto rmState, is a TCommit step or a stutter."""
    tp, tc = TwoPhase(3), TCommit(3)
    start = next(iter(tp.init_states()))
    seen, queue = {start}, deque([start])
    while queue:
        s = queue.popleft()
        for a in tp.actions(s):
            t = tp.next_state(s, a)
            if t is None:
                continue
            if t.rm_state != s.rm_state:
                before = TCState(s.rm_state)
                tc_succ = {tc.next_state(before, b) for b in tc.actions(before)}
                assert TCState(t.rm_state) in tc_succ, (s, a, t)
            if t not in seen:
                seen.add(t)
                queue.append(t)
    assert len(seen) == 288


# --------------------------------------------------------------------------------------
# Counterexamples and property kinds
# --------------------------------------------------------------------------------------


def test_broken_twophase_has_shortest_counterexample() -> None:
    """The eager-commit TwoPhase violates TCConsistent with a 5-step, replayable trace."""
    model = EagerCommitTwoPhase(3)
    r = explore(model)
    assert not r.complete
    assert [v.property_name for v in r.violations] == ["TCConsistent"]
    cex = r.violations[0]
    assert cex.kind == "always"
    assert len(cex.trace) == 6
    assert _replays(model, cex)
    rms = cex.final_state.rm_state
    assert "committed" in rms and "aborted" in rms
    assert "TMCommit" in cex.actions


def test_broken_twophase_counterexample_is_minimal() -> None:
    """No action sequence of 4 steps or fewer breaks TCConsistent (brute force, no explorer)."""
    model = EagerCommitTwoPhase(3)

    def violates_within(state: TPState, steps: int) -> bool:
        rms = state.rm_state
        if "committed" in rms and "aborted" in rms:
            return True
        if steps == 0:
            return False
        for a in model.actions(state):
            nxt = model.next_state(state, a)
            if nxt is not None and violates_within(nxt, steps - 1):
                return True
        return False

    init = next(iter(model.init_states()))
    assert not violates_within(init, 4)
    assert violates_within(init, 5)


def test_run_on_after_violation() -> None:
    """With stop_on_violation=False the search completes and reports each violation once."""
    r = explore(EagerCommitTwoPhase(3), stop_on_violation=False)
    assert r.complete
    assert [v.property_name for v in r.violations] == ["TCConsistent"]
    assert len(r.violations[0].trace) == 6
    assert r.violation("TCConsistent") is r.violations[0]
    assert r.violation("TPTypeOK") is None
    assert not r.ok


def test_sometimes_witness_is_shortest() -> None:
    """SomeRMCommitted is witnessed by the 8-step commit path; TCommit's by a 4-step one."""
    r = explore(TwoPhase(3))
    w = r.sometimes["SomeRMCommitted"]
    assert w is not None and w.kind == "sometimes"
    assert len(w.trace) == 9
    assert w.actions[-1].startswith("RMRcvCommitMsg")
    assert _replays(TwoPhase(3), w)
    tc = explore(TCommit(3)).sometimes["SomeRMCommitted"]
    assert tc is not None and len(tc.trace) == 5


def test_unreached_sometimes_is_reported_not_violated() -> None:
    """A sometimes-property never reached maps to None and is not a violation."""
    never = Property[Counters]("Reaches9", "sometimes", lambda s: 9 in s)
    r = explore(CounterModel(props=[never]))
    assert r.sometimes == {"Reaches9": None}
    assert r.ok and r.complete


def test_true_eventually_passes() -> None:
    """AllRMsDecided holds at every quiescent TwoPhase and TCommit state."""
    tp, tc = explore(TwoPhase(3)), explore(TCommit(3))
    assert tp.ok and tp.complete and tc.ok and tc.complete


def test_false_eventually_is_reported_with_shortest_trace() -> None:
    """A false eventually-property yields the shortest path to a bad quiescent state."""
    model = TwoPhase(3, extra_properties=[ALL_RMS_COMMITTED_AT_QUIESCENCE])
    r = explore(model, stop_on_violation=False)
    assert r.complete
    assert [v.property_name for v in r.violations] == ["AllRMsCommittedAtQuiescence"]
    cex = r.violations[0]
    assert cex.kind == "eventually"
    # TMAbort, then each of the 3 RMs aborts: 4 steps.
    assert len(cex.trace) == 5
    final = cex.final_state
    assert final.tm_state == "aborted" and set(final.rm_state) == {"aborted"}
    assert _replays(model, cex)


def test_eventually_treats_self_loops_as_quiescent() -> None:
    """A state whose only successor is itself counts as quiescent for eventually."""
    r = explore(StutterAtEnd())
    assert r.ok and r.distinct_states == 4 and r.transitions == 4
    bad = Property[int]("EndsAtTwo", "eventually", lambda s: s == 2)

    class Bad(StutterAtEnd):
        def properties(self) -> Sequence[Property[int]]:
            return (bad,)

    cex = explore(Bad()).violation("EndsAtTwo")
    assert cex is not None and [s.state for s in cex.trace] == [0, 1, 2, 3]


def test_always_on_initial_state() -> None:
    """An invariant false in an initial state yields a one-state trace."""
    prop = Property[Counters]("NonZero", "always", lambda s: sum(s) > 0)
    r = explore(CounterModel(props=[prop]))
    cex = r.violation("NonZero")
    assert cex is not None and len(cex.trace) == 1 and cex.trace[0].action is None
    assert "NonZero" in cex.format()


# --------------------------------------------------------------------------------------
# Arguments, bounds and hooks
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_states": -1},
        {"max_states": 0},
        {"max_depth": -3},
        {"max_depth": 0},
        {"progress_every": 0},
    ],
)
def test_bad_bounds_raise(kwargs: dict[str, int]) -> None:
    """Non-positive bounds are rejected with ExplorerError."""
    with pytest.raises(ExplorerError):
        explore(TCommit(2), **kwargs)  # type: ignore[arg-type]


def test_duplicate_property_names_raise() -> None:
    """Two properties with one name are rejected."""
    p = Property[Counters]("Same", "always", lambda s: True)
    q = Property[Counters]("Same", "sometimes", lambda s: True)
    with pytest.raises(ExplorerError, match="duplicate"):
        explore(CounterModel(props=[p, q]))


def test_empty_init_raises() -> None:
    """A model without initial states is rejected."""
    with pytest.raises(ExplorerError, match="init_states"):
        explore(CounterModel(inits=[]))


def test_bad_property_kind_raises() -> None:
    """An unknown property kind or an empty name is rejected at construction."""
    with pytest.raises(ExplorerError):
        Property[Counters]("X", "never", lambda s: True)  # type: ignore[arg-type]
    with pytest.raises(ExplorerError):
        Property[Counters]("", "always", lambda s: True)


def test_max_states_cuts_search() -> None:
    """max_states caps distinct states and marks the result incomplete."""
    r = explore(TwoPhase(3), max_states=50)
    assert r.distinct_states == 50 and not r.complete
    exact = explore(TwoPhase(3), max_states=288)
    assert exact.distinct_states == 288 and exact.complete


def test_max_depth_cuts_search() -> None:
    """max_depth stops at that TLC depth; complete only if nothing lies beyond it."""
    r = explore(TwoPhase(3), max_depth=3)
    assert r.max_depth == 3 and not r.complete
    assert r.distinct_states < 288
    full = explore(TwoPhase(3), max_depth=11)
    assert full.complete and full.distinct_states == 288


def test_progress_callback() -> None:
    """Progress is reported periodically and once at the end with final counts."""
    seen: list[ExploreProgress] = []
    r = explore(TwoPhase(3), progress=seen.append, progress_every=50)
    assert len(seen) == 288 // 50 + 1
    assert all(not p.final for p in seen[:-1])
    last = seen[-1]
    assert last.final and last.distinct_states == 288 and last.generated_states == 1146
    assert last.queue_size == 0 and r.distinct_states == 288


def test_canonical_symmetry_reduction() -> None:
    """canonical() merges permuted states: 27 counter states shrink to 10 multisets."""
    plain = explore(CounterModel(n=3, limit=2))
    sym = explore(SymmetricCounters(n=3, limit=2))
    assert (plain.distinct_states, sym.distinct_states) == (27, 10)
    assert plain.max_depth == sym.max_depth == 7
    assert plain.complete and sym.complete


def test_twophase_symmetry_reduction() -> None:
    """Symmetric TwoPhase keeps results while exploring far fewer states."""
    r = explore(SymmetricTwoPhase(3))
    assert r.ok and r.complete
    assert r.distinct_states < 288 and r.max_depth == 11
    w = r.sometimes["SomeRMCommitted"]
    assert w is not None and len(w.trace) == 9


def test_action_label_and_counts() -> None:
    """action_label names actions in counts and traces; counts sum to transitions."""
    r = explore(LabelledCounters(n=2, limit=1))
    assert r.action_counts == {"Inc(c0)": 2, "Inc(c1)": 2}
    assert r.transitions == 4 and r.generated_states == 5 and r.distinct_states == 4


def test_within_boundary_stops_expansion() -> None:
    """States outside the boundary are recorded but not expanded."""
    r = explore(BoundedCounters(n=3, limit=2))
    assert r.complete
    # Totals 0..3 reachable; total-3 states are recorded, never expanded.
    assert r.distinct_states == sum(
        1 for a in range(3) for b in range(3) for c in range(3) if a + b + c <= 3
    )
    assert r.max_depth == 4


def test_to_json_is_json_serialisable() -> None:
    """to_json gives plain data that json.dumps accepts, traces included."""
    r = explore(EagerCommitTwoPhase(2), stop_on_violation=False)
    data = r.to_json()
    text = json.dumps(data)
    assert "TCConsistent" in text
    assert data["distinct_states"] == r.distinct_states
    assert r.summary() == data
