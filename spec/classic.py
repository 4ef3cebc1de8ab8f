"""Lamport's TCommit and TwoPhase TLA+ specs, transcribed as explorer models.

They are here to calibrate ``spec.explorer``: TLC's published numbers for these specs
(TCommit, 3 RMs: 34 distinct / 94 generated / depth 7; TwoPhase, 3 RMs: 288 / 1146 / 11;
TwoPhase, 5 RMs: 8832 distinct) pin down both the transcription and the counting
convention, so an explorer that reproduces them counts the way TLC does.

Transcription notes:

* Resource managers are indexed ``0..n-1`` and shown as ``rm1..rmN``.
* Each disjunct of a TLA+ next-state action that can yield its own successor is a separate
  explorer action, because TLC computes (and counts) one successor per disjunct: TCommit's
  ``Decide(rm)`` becomes ``Decide(rm)[commit]`` and ``Decide(rm)[abort]``.
* Actions the spec leaves unguarded stay unguarded: ``RMRcvCommitMsg(rm)`` is enabled for an
  RM that is already committed, giving a stuttering successor that TLC also generates.
* A message is ``Message("Prepared", rm)``, ``Message("Commit")`` or ``Message("Abort")``;
  ``msgs`` is a set, as in the spec, so sending a message twice changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs

from rollout_lifecycle.spec.explorer import Property

__all__ = [
    "ALL_RMS_COMMITTED_AT_QUIESCENCE",
    "RM_STATES",
    "TM_STATES",
    "Act",
    "EagerCommitTwoPhase",
    "Message",
    "SymmetricTwoPhase",
    "TCState",
    "TCommit",
    "TPState",
    "TwoPhase",
    "rm_name",
]

RM_STATES: frozenset[str] = frozenset({"working", "prepared", "committed", "aborted"})
TM_STATES: frozenset[str] = frozenset({"init", "committed", "aborted"})


def rm_name(rm: int) -> str:
    """The spec-style name of resource manager ``rm`` (0-based index)."""
    return f"rm{rm + 1}"


def _check_n_rms(n_rms: int) -> None:
    if n_rms < 1:
        raise ValueError(f"need at least one resource manager, got {n_rms}")


@attrs.frozen
class Act:
    """An action instance: the spec's action name, its RM argument and, if any, a branch."""

    name: str
    rm: int | None = None
    branch: str | None = None

    def __str__(self) -> str:
        text = self.name if self.rm is None else f"{self.name}({rm_name(self.rm)})"
        return text if self.branch is None else f"{text}[{self.branch}]"


def _consistent(rm_state: tuple[str, ...]) -> bool:
    """TCConsistent: no RM has committed while another has aborted."""
    return not ("committed" in rm_state and "aborted" in rm_state)


def _all_decided(rm_state: tuple[str, ...]) -> bool:
    return all(s in ("committed", "aborted") for s in rm_state)


def _replace(rm_state: tuple[str, ...], rm: int, value: str) -> tuple[str, ...]:
    """``[rmState EXCEPT ![rm] = value]``."""
    return (*rm_state[:rm], value, *rm_state[rm + 1 :])


# --------------------------------------------------------------------------------------
# TCommit
# --------------------------------------------------------------------------------------


@attrs.frozen
class TCState:
    """TCommit's only variable, ``rmState``, as a tuple indexed by RM."""

    rm_state: tuple[str, ...]


class TCommit:
    """The transaction-commit spec: what any commit protocol must achieve."""

    def __init__(self, n_rms: int) -> None:
        _check_n_rms(n_rms)
        self.n_rms = n_rms

    def init_states(self) -> Iterator[TCState]:
        """TCInit: every RM is working."""
        yield TCState(("working",) * self.n_rms)

    def actions(self, state: TCState) -> Iterator[Act]:
        """TCNext's disjuncts for every RM; guards are evaluated in ``next_state``."""
        for rm in range(self.n_rms):
            yield Act("Prepare", rm)
            yield Act("Decide", rm, "commit")
            yield Act("Decide", rm, "abort")

    def next_state(self, state: TCState, action: Act) -> TCState | None:
        rms = state.rm_state
        rm = action.rm
        assert rm is not None
        if action.name == "Prepare":
            if rms[rm] != "working":
                return None
            return TCState(_replace(rms, rm, "prepared"))
        if action.branch == "commit":
            # rmState[rm] = "prepared" /\ canCommit
            can_commit = all(s in ("prepared", "committed") for s in rms)
            if rms[rm] != "prepared" or not can_commit:
                return None
            return TCState(_replace(rms, rm, "committed"))
        # rmState[rm] \in {"working", "prepared"} /\ notCommitted
        not_committed = all(s != "committed" for s in rms)
        if rms[rm] not in ("working", "prepared") or not not_committed:
            return None
        return TCState(_replace(rms, rm, "aborted"))

    def properties(self) -> Sequence[Property[TCState]]:
        return (
            Property(
                "TCTypeOK",
                "always",
                lambda s: len(s.rm_state) == self.n_rms and set(s.rm_state) <= RM_STATES,
                "rmState \\in [RM -> {working, prepared, committed, aborted}]",
            ),
            Property(
                "TCConsistent",
                "always",
                lambda s: _consistent(s.rm_state),
                "no RM committed while another aborted",
            ),
            Property(
                "SomeRMCommitted",
                "sometimes",
                lambda s: "committed" in s.rm_state,
                "the commit outcome is reachable at all",
            ),
            Property(
                "AllRMsDecided",
                "eventually",
                lambda s: _all_decided(s.rm_state),
                "when nothing more can happen, every RM has committed or aborted",
            ),
        )


# --------------------------------------------------------------------------------------
# TwoPhase
# --------------------------------------------------------------------------------------


@attrs.frozen
class Message:
    """``[type |-> "Prepared", rm |-> rm]``, ``[type |-> "Commit"]`` or ``[type |-> "Abort"]``."""

    type: str
    rm: int | None = None

    def __repr__(self) -> str:
        return self.type if self.rm is None else f"{self.type}({rm_name(self.rm)})"


COMMIT_MSG = Message("Commit")
ABORT_MSG = Message("Abort")


@attrs.frozen(cache_hash=True)
class TPState:
    """TwoPhase's variables ``rmState``, ``tmState``, ``tmPrepared`` and ``msgs``."""

    rm_state: tuple[str, ...]
    tm_state: str
    tm_prepared: frozenset[int]
    msgs: frozenset[Message]


def _tp_type_ok(state: TPState, n_rms: int) -> bool:
    rms = range(n_rms)
    return (
        len(state.rm_state) == n_rms
        and set(state.rm_state) <= RM_STATES
        and state.tm_state in TM_STATES
        and state.tm_prepared <= frozenset(rms)
        and all(
            (m.type == "Prepared" and m.rm in rms)
            or (m.type in ("Commit", "Abort") and m.rm is None)
            for m in state.msgs
        )
    )


ALL_RMS_COMMITTED_AT_QUIESCENCE: Property[TPState] = Property(
    "AllRMsCommittedAtQuiescence",
    "eventually",
    lambda s: all(r == "committed" for r in s.rm_state),
    "deliberately false: the TM may abort, so some runs end with every RM aborted",
)


class TwoPhase:
    """The two-phase commit protocol, which implements TCommit.

    ``extra_properties`` lets a test add properties (such as the deliberately false
    ``ALL_RMS_COMMITTED_AT_QUIESCENCE``) without changing the spec's own list.
    """

    def __init__(self, n_rms: int, *, extra_properties: Sequence[Property[TPState]] = ()) -> None:
        _check_n_rms(n_rms)
        self.n_rms = n_rms
        self.extra_properties = tuple(extra_properties)
        self._all_rms = frozenset(range(n_rms))

    def init_states(self) -> Iterator[TPState]:
        """TPInit: RMs working, TM in init, nothing prepared, no messages."""
        yield TPState(("working",) * self.n_rms, "init", frozenset(), frozenset())

    def actions(self, state: TPState) -> Iterator[Act]:
        """TPNext's disjuncts; guards are evaluated in ``next_state``."""
        yield Act("TMCommit")
        yield Act("TMAbort")
        for rm in range(self.n_rms):
            yield Act("TMRcvPrepared", rm)
            yield Act("RMPrepare", rm)
            yield Act("RMChooseToAbort", rm)
            yield Act("RMRcvCommitMsg", rm)
            yield Act("RMRcvAbortMsg", rm)

    def tm_can_commit(self, state: TPState) -> bool:
        """TMCommit's guard on ``tmPrepared``: every RM's Prepared has been received."""
        return state.tm_prepared == self._all_rms

    def next_state(self, state: TPState, action: Act) -> TPState | None:
        name, rm = action.name, action.rm
        if name == "TMCommit":
            if state.tm_state != "init" or not self.tm_can_commit(state):
                return None
            return attrs.evolve(state, tm_state="committed", msgs=state.msgs | {COMMIT_MSG})
        if name == "TMAbort":
            if state.tm_state != "init":
                return None
            return attrs.evolve(state, tm_state="aborted", msgs=state.msgs | {ABORT_MSG})
        assert rm is not None
        if name == "TMRcvPrepared":
            if state.tm_state != "init" or Message("Prepared", rm) not in state.msgs:
                return None
            return attrs.evolve(state, tm_prepared=state.tm_prepared | {rm})
        if name == "RMPrepare":
            if state.rm_state[rm] != "working":
                return None
            return attrs.evolve(
                state,
                rm_state=_replace(state.rm_state, rm, "prepared"),
                msgs=state.msgs | {Message("Prepared", rm)},
            )
        if name == "RMChooseToAbort":
            if state.rm_state[rm] != "working":
                return None
            return attrs.evolve(state, rm_state=_replace(state.rm_state, rm, "aborted"))
        if name == "RMRcvCommitMsg":
            if COMMIT_MSG not in state.msgs:
                return None
            return attrs.evolve(state, rm_state=_replace(state.rm_state, rm, "committed"))
        if name == "RMRcvAbortMsg":
            if ABORT_MSG not in state.msgs:
                return None
            return attrs.evolve(state, rm_state=_replace(state.rm_state, rm, "aborted"))
        raise ValueError(f"unknown TwoPhase action {action}")

    def properties(self) -> Sequence[Property[TPState]]:
        return (
            Property(
                "TPTypeOK",
                "always",
                lambda s: _tp_type_ok(s, self.n_rms),
                "every variable stays within its declared type",
            ),
            Property(
                "TCConsistent",
                "always",
                lambda s: _consistent(s.rm_state),
                "TwoPhase implements TCommit's safety: never one committed, one aborted",
            ),
            Property(
                "SomeRMCommitted",
                "sometimes",
                lambda s: "committed" in s.rm_state,
                "the protocol can actually commit (it is not trivially safe)",
            ),
            Property(
                "AllRMsDecided",
                "eventually",
                lambda s: _all_decided(s.rm_state),
                "when nothing more can happen, every RM has committed or aborted",
            ),
            *self.extra_properties,
        )


class EagerCommitTwoPhase(TwoPhase):
    """A deliberately broken TwoPhase: the TM commits once any one RM has prepared.

    Another RM may meanwhile choose to abort, so TCConsistent fails; the shortest
    counterexample is RMPrepare(a), TMRcvPrepared(a), TMCommit, RMChooseToAbort(b),
    RMRcvCommitMsg(a): five steps after the initial state.
    """

    def tm_can_commit(self, state: TPState) -> bool:
        return bool(state.tm_prepared)


class SymmetricTwoPhase(TwoPhase):
    """TwoPhase with symmetry reduction over RMs (TLC's ``SYMMETRY Permutations(RM)``).

    RMs are interchangeable, so a state is keyed by the multiset of per-RM facts (its
    state, whether the TM has its Prepared, whether its Prepared message is out) plus the
    RM-independent parts.  This is a complete canonical form: two states share a key iff
    one is a permutation of the other.
    """

    def canonical(self, state: TPState) -> tuple[object, ...]:
        per_rm = sorted(
            (state.rm_state[rm], rm in state.tm_prepared, Message("Prepared", rm) in state.msgs)
            for rm in range(self.n_rms)
        )
        return (
            state.tm_state,
            COMMIT_MSG in state.msgs,
            ABORT_MSG in state.msgs,
            tuple(per_rm),
        )
