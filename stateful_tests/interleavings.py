"""Scripted interleavings of two connections: the races a random schedule rarely hits.

A single reservation reads its row (SQLite: `find`; PostgreSQL: `peek`, the row with the
premise) before the atomic step that writes it. Each scenario here runs the OTHER
connection's calls in exactly that gap, through a hook on the learner's store, and then
compares the answer with the one the documented order gives at the instant of the step
(docs/trust-boundary.md: missing, idempotent retry, revision, state, then the premise). The
expected answers are written here by hand from that order; nothing is computed by the code
under test.

Issue 33's shape: the pointer moves v0 -> v1 (lag 1, still admissible), another learner
reserves and aborts the rollout (revision 0 -> 2), the pointer moves to v2 (lag 2). No
instant of the call makes `pointer_moved` true: while the row was at revision 0 the answer
was `reserved`, once the pointer reached v2 the row was at revision 2 (`revision_conflict`).

    problems = run_interleavings("sqlite", workdir)   # {scenario: []} when all are right
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from rollout_lifecycle.model.backends import Backend, open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.ledger import GuardedStore, ReserveRequest
from rollout_lifecycle.model.records import (
    AdmissionPolicy,
    AdmissionStamp,
    LedgerEntry,
    Reward,
    WorkerAck,
)
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.stateful_tests.backends import DB_NAME, durable_url

WORKERS = ("w0",)
POLICY = AdmissionPolicy(max_lag=1, max_drift=0.2)
REWARD = Reward("interleave-rm", "1", 1.0)


def version_hash(v: int) -> str:
    """The artifact hash of version v in these scenarios."""
    return f"{v:x}".rjust(64, "e")


def stamp(behavior: int, current: int, max_lag: int = 1) -> AdmissionStamp:
    """An honest accepted stamp of a rollout of v`behavior` admitted against v`current`."""
    return AdmissionStamp(
        current_version=current,
        behavior_version=behavior,
        max_lag=max_lag,
        max_drift=0.2,
        drift=0.01,
        freshness="fresh" if current == behavior else "tolerated",
        reason="ok",
        accepted=True,
    )


def activate(coord: ActivationCoordinator, v: int) -> None:
    """Publish v through the whole two-phase protocol (one worker acks)."""
    coord.prepare(v)
    coord.commit_artifact(v, version_hash(v))
    coord.distribute(v)
    for w, token in coord.attempt_tokens(v).items():
        coord.record_ack(WorkerAck(w, v, version_hash(v), token=token))
    if not coord.try_activate(v).activated:
        raise AssertionError(f"v{v} did not activate in a scripted interleaving")


@contextlib.contextmanager
def gap_after_read(b: Backend, gap: Callable[[], None]) -> Iterator[None]:
    """Run `gap` right after the learner's reservation read its row (before its step).

    A hook on the learner's store object only: the store the ledger reads through
    (`peek` on a guarded store, else `find_with_update`: the row with its update's record)
    runs the gap once, after its own read."""
    store: Any = b.ledger.store  # type: ignore[attr-defined]
    name = "peek" if isinstance(store, GuardedStore) else "find_with_update"
    real = getattr(store, name)
    pending = [gap]

    def read_then_gap(*args: Any) -> Any:
        got = real(*args)
        if pending:
            pending.pop()()
        return got

    setattr(store, name, read_then_gap)
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError):
            delattr(store, name)


class _GapView:
    """A store view whose premise read runs the gap right after it (the rows come next)."""

    def __init__(self, view: Any, pending: list[Callable[[], None]]) -> None:
        self._view, self._pending = view, pending

    def read_premise(self, versions: Any = None) -> Any:
        got = self._view.read_premise(versions)
        if self._pending:
            self._pending.pop()()
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)


@contextlib.contextmanager
def gap_after_premise(b: Backend, gap: Callable[[], None]) -> Iterator[None]:
    """Run `gap` right after a read-only view of the learner's store read the premise,
    before it reads the rows (`oldest_admissible`)."""
    store: Any = b.ledger.store  # type: ignore[attr-defined]
    real = store.view
    pending = [gap]

    def view(body: Callable[[Any], Any], what: str) -> Any:
        return real(lambda v: body(_GapView(v, pending)), what)

    store.view = view
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError):
            del store.view


Answer = tuple[Any, ...]


def _reserve(b: Backend) -> Answer:
    got = b.ledger.reserve("r", 0, "learner", stamp(0, 0))
    return (got.reserved, got.reason)


def _oldest(b: Backend) -> Answer:
    return tuple(e.rollout_id for e in b.ledger.oldest_admissible(10))


@attrs.frozen
class Scenario:
    """One scripted interleaving and the answer the documented order gives."""

    name: str
    # (other backend, other coordinator) -> None, run in the learner's gap
    gap: Callable[[Backend, ActivationCoordinator], None]
    expected: Answer
    call: Callable[[Backend], Answer] = _reserve
    # where the gap goes: after the single reservation's read of its row, or after a
    # read-only view's premise read
    hook: Callable[[Backend, Callable[[], None]], contextlib.AbstractContextManager[None]] = (
        gap_after_read
    )
    # the rollout 'r' of v0 starts reserved by 'holder' (else rewarded)
    held: bool = False
    # versions active before the call (the last one is the pointer)
    active: tuple[int, ...] = (0,)


def _move_reserve_abort_move(other: Backend, coord: ActivationCoordinator) -> None:
    activate(coord, 1)  # lag 1: still admissible
    (won,) = other.ledger.reserve_batch("other", [ReserveRequest("r", 0, stamp(0, 1))])
    assert won.reserved, won
    other.ledger.abort("other")  # revision 0 -> 2, rewarded again
    activate(coord, 2)  # lag 2: outside the bound


def _reserve_then_move(other: Backend, coord: ActivationCoordinator) -> None:
    other.ledger.reserve_batch("other", [ReserveRequest("r", 0, stamp(0, 0))])
    activate(coord, 1)
    activate(coord, 2)


def _same_update_then_move(other: Backend, coord: ActivationCoordinator) -> None:
    other.ledger.reserve_batch("learner", [ReserveRequest("r", 0, stamp(0, 0))])
    activate(coord, 1)
    activate(coord, 2)


def _move_only(other: Backend, coord: ActivationCoordinator) -> None:
    activate(coord, 1)
    activate(coord, 2)


def _release_then_move(other: Backend, coord: ActivationCoordinator) -> None:
    other.ledger.abort("holder")  # 'r' is rewarded again ...
    activate(coord, 2)  # ... and out of the window [1, 2]


SCENARIOS = (
    # issue 33: the row moved on and back to 'rewarded' at a new revision
    Scenario("stale_row_pointer_moved", _move_reserve_abort_move, (False, "revision_conflict")),
    # another update holds it at the step: the revision is checked before the premise
    Scenario("held_row_pointer_moved", _reserve_then_move, (False, "revision_conflict")),
    # this same update reserved it meanwhile (a batch): the idempotent retry comes first
    Scenario("own_row_pointer_moved", _same_update_then_move, (True, "idempotent_retry")),
    # the row did not move: the premise's refusal is the true answer
    Scenario("premise_only_pointer_moved", _move_only, (False, "pointer_moved")),
    # a read of the window (pointer v1: [0, 1]) and of the rows: 'r' was reserved while
    # the window held v0 and out of the window once it was rewarded again, so no instant
    # has it waiting; only one snapshot for both reads answers that
    Scenario(
        "window_and_rows_one_snapshot",
        _release_then_move,
        (),
        call=_oldest,
        hook=gap_after_premise,
        held=True,
        active=(0, 1),
    ),
)


def run_scenario(url: str, scenario: Scenario) -> list[str]:
    """Run one scenario on fresh state at `url` (two opens: two connections); problems."""
    with open_backend(url) as learner, open_backend(url) as other:
        set_admission_policy(other.registry, POLICY, "set by the operator")
        coord = ActivationCoordinator(other.registry, WORKERS, ledger=other.ledger, policy=POLICY)
        activate(coord, 0)
        learner.ledger.add(
            LedgerEntry(
                rollout_id="r",
                behavior_version=0,
                artifact_hash=version_hash(0),
                state="rewarded",
                reward=REWARD,
            )
        )
        if scenario.held:
            (won,) = other.ledger.reserve_batch("holder", [ReserveRequest("r", 0, stamp(0, 0))])
            assert won.reserved, won
        for v in scenario.active[1:]:
            activate(coord, v)
        with scenario.hook(learner, lambda: scenario.gap(other, coord)):
            got = scenario.call(learner)
        if got != scenario.expected:
            return [
                f"{scenario.name}: answered {got}, the documented semantics give "
                f"{scenario.expected} at the instant of the step"
            ]
        return []


def run_interleavings(backend: str, workdir: Path) -> dict[str, list[str]]:
    """Every scenario on `backend` ('sqlite' or PostgreSQL), each on fresh state under
    `workdir`: the problems, by scenario (all empty when every answer was right)."""
    out = {}
    for s in SCENARIOS:
        where = workdir / s.name
        where.mkdir(parents=True, exist_ok=True)
        for old in where.glob(f"{DB_NAME}*"):
            old.unlink()  # an earlier run's file
        out[s.name] = run_scenario(durable_url(backend, where), s)
    return out
