"""Every checker checked: known-bad histories each checker must flag, known-good ones it
must pass, and the enforcing rules compared with the spec that re-states them.

A checker that is never shown a bad history is not a checker: a spec invariant that stops
looking, a race judge that believes a claimed win, an audit that skips a column all pass
every correct run. This catalogue is the campaign's first stage (seconds) and the target of
the catalogue's checker mutants: break a checker and a known-bad case passes, which fails
the campaign. Cases:

* `spec:<invariant>`: hand-written bad histories, one or more per invariant, each a correct
  history (stateful_tests/histories.py) with one thing broken, named by that invariant; a
  bad state produced by the real code whose failure it models is marked `real_code` and
  never counts as the invariant's known-bad history (that code may already prevent the
  state: the real coordinator voids a restarted worker's ack, so only a hand-written trace
  shows `served_after_sync` an ack of a previous incarnation);
* `spec:generated`: random correct histories with one random, targeted corruption each;
* `race`: recorded reserve calls whose claimed outcome the trace contradicts;
* `linearizability`: call histories no single order explains, each beside a good twin, a
  search past its time limit (it must say 'unknown'), and generated sequential workloads
  through the real code with and without one answer changed;
* `audit`: stored rows edited behind the store's back (`ledger check`), the chain stripped,
  and tampering that keeps the sequence (every event replaced in place with the chain
  recomputed after it, the last included; payloads swapped; a forged head against an
  anchor taken before);
* `differential`: generated reservation premises (hostile stamps wrong in one figure,
  negative lags after rollbacks, NaN drift, retired versions), judged by the write path's
  model/rules.py and by the spec's own restatement: they must agree.
"""

from __future__ import annotations

import functools
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from rollout_lifecycle.model import rules
from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.events import (
    GENESIS,
    ArtifactChanged,
    EntryChanged,
    EventLog,
    MembershipChanged,
    PolicyChanged,
    StoredEvent,
    StoredRows,
    TraceEvent,
    UpdateChanged,
    WorkerReported,
    chain_hash,
)
from rollout_lifecycle.model.ledger import ManualClock, MemoryLedger
from rollout_lifecycle.model.records import (
    ActivePointer,
    AdmissionPolicy,
    AdmissionStamp,
    ArtifactRecord,
    Disposition,
    LedgerEntry,
    Reward,
    UpdateRecord,
    WorkerAck,
    to_jsonable,
)
from rollout_lifecycle.spec.audit import Anchor, audit
from rollout_lifecycle.spec.invariants import (
    INVARIANTS,
    World,
    check_quiescent,
    check_world,
)
from rollout_lifecycle.spec.linearizability import check_history
from rollout_lifecycle.stateful_tests import call_histories as H
from rollout_lifecycle.stateful_tests.histories import (
    POLICY,
    REWARD,
    WORKERS,
    HandRegistry,
    churned_history,
    correct_history,
    deadline_history,
    dispatched_event,
    flagged,
    forge,
    freshness,
    hash_mismatch_history,
    is_art,
    is_entry,
    is_report,
    issued,
    lineage_history,
    paced_history,
    random_history,
    recounted_history,
    reserved_after_rollback,
    restamped,
    rewarded,
    served_history,
    served_trace,
    stamp,
    tamper,
    token,
)
from rollout_lifecycle.stateful_tests.race import judge_calls

Run = Callable[[], set[str]]


@attrs.frozen
class CheckerCase:
    """One input to one checker: `expect` names what it must flag (None: a good input it
    must pass without a finding)."""

    checker: str
    name: str
    expect: str | None
    run: Run
    # the bad state was produced by the real code whose failure it models (which may
    # already prevent it): such a case never counts as the invariant's known-bad history
    real_code: bool = False

    def judge(self) -> tuple[bool, set[str]]:
        """(passed, what the checker flagged)."""
        got = self.run()
        return (not got if self.expect is None else self.expect in got), got


def _raises(exc: Exception) -> Run:
    """A case whose input could not be built: judging it raises what building it raised."""

    def run() -> set[str]:
        raise exc

    return run


def _world(w: World) -> Run:
    return lambda: {v.invariant for v in check_world(w)}


def _rest(w: World) -> Run:
    return lambda: {v.invariant for v in check_quiescent(w)}


def _trace(build: Callable[[], Sequence[TraceEvent]], **kw: Any) -> Run:
    return lambda: flagged(build(), **kw)


def _events() -> list[TraceEvent]:
    return correct_history()[0]


def _entry(ev_pred: Callable[[TraceEvent], bool]) -> EntryChanged:
    ev = next(e for e in _events() if ev_pred(e))
    assert isinstance(ev, EntryChanged)
    return ev


def _reserved(adm: AdmissionStamp | None, **kw: Any) -> World:
    fields: dict[str, Any] = {
        "rollout_id": "x",
        "behavior_version": 0,
        "artifact_hash": "h",
        "state": "reserved",
        "reserved_by": "u",
        "reward": REWARD,
        "admission": adm,
        "revision": 3,
    }
    fields.update(kw)
    return World(entries={"x": forge(LedgerEntry, **fields)})


def spec_cases() -> list[CheckerCase]:
    """Hand-written known-bad histories, at least one per spec invariant, and the good ones."""
    evs = _events
    c: list[CheckerCase] = []

    def add(expect: str | None, name: str, run: Run, real_code: bool = False) -> None:
        c.append(CheckerCase(f"spec:{expect or 'good'}", name, expect, run, real_code))

    add(None, "correct history, quiescent", _trace(evs, quiescent=True))
    add(None, "legacy history without attempt tokens", _trace(lambda: _legacy(evs())))
    r1 = _entry(is_entry("r1", "reserve"))
    add(
        "declared_edges",
        "rewarded straight to consumed",
        _trace(
            lambda: tamper(
                evs(),
                is_entry("r1", "reserve"),
                event="commit",
                after=attrs.evolve(r1.after, state="consumed", reserved_by=None),
            )
        ),
    )
    add(
        "declared_edges",
        "a version registered twice",
        _trace(lambda: [*evs(), *[e for e in evs() if is_art(1, "register")(e)]]),
    )
    last = _entry(is_entry("r1", "commit"))
    add(
        "terminal_absorbing",
        "a consumed rollout returned",
        _trace(
            lambda: [
                *evs(),
                EntryChanged(
                    999,
                    999,
                    0.0,
                    "r1",
                    "abort",
                    last.after,
                    attrs.evolve(last.after, state="rewarded", revision=last.after.revision + 1),
                ),
            ]
        ),
    )
    add(
        "exactly_once",
        "consumed by an update that did not reserve it",
        _trace(lambda: tamper(evs(), is_entry("r1", "commit"), update_id="u-other")),
    )
    add("exactly_once", "consumed a second time", _trace(lambda: _consumed_twice(evs())))
    add(
        "exactly_once",
        "a reservation passed to another update",
        _trace(lambda: _passed_on(evs())),
    )
    add(
        "commit_takes_all_held",
        "a commit leaving one of its update's reservations reserved",
        _trace(lambda: [e for e in evs() if not is_entry("r2", "commit")(e)]),
    )
    add(
        "exclusive_ownership",
        "reserved without an owner",
        _world(_reserved(stamp(0, 0), reserved_by=None)),
    )
    r2 = _entry(is_entry("r2", "reserve"))
    add(
        "revision_bumps_by_one",
        "a write bumping the revision by two",
        _trace(
            lambda: tamper(
                evs(),
                is_entry("r2", "reserve"),
                after=attrs.evolve(r2.after, revision=r2.after.revision + 1),
            )
        ),
    )
    timeout = LedgerEntry(
        rollout_id="x",
        behavior_version=0,
        artifact_hash="h",
        state="reward_timed_out",
        reward=Reward("rm", "1", 0.0),
        disposition=Disposition("reward", "timeout"),
    )
    add(
        "reward_failures_never_trained",
        "a timeout stored as reward 0.0",
        _world(World(entries={"x": timeout})),
    )
    for label, adm in (
        ("stale by its own lag", attrs.evolve(stamp(0, 2, max_lag=1), freshness="stale")),
        ("a rejected decision", attrs.evolve(stamp(0, 0), accepted=False, reason="policy_drift")),
        ("drift over its bound", stamp(0, 0, drift=0.5)),
        ("no stamp", None),
        ("NaN drift", forge(AdmissionStamp, **{**attrs.asdict(stamp(0, 0)), "drift": math.nan})),
        ("no drift figure", forge(AdmissionStamp, **{**attrs.asdict(stamp(0, 0)), "drift": None})),
        (
            "negative lag (a future version)",
            forge(
                AdmissionStamp,
                **{**attrs.asdict(stamp(0, 0)), "current_version": 0, "behavior_version": 1},
            ),
        ),
    ):
        w = _reserved(adm)
        if label == "negative lag (a future version)":
            w = _reserved(adm, behavior_version=1)
        add("admitted_when_reserved", label, _world(w))
    tight = attrs.evolve(stamp(0, 0, max_lag=0), current_version=0)
    add(
        "reserved_against_current_version",
        "lag 1 at its own step, stamp says 0",
        _trace(lambda: restamped("r4", "u3", tight)),
    )
    loose = attrs.evolve(stamp(0, 1, max_lag=1000), max_drift=1e9)
    add(
        "reserved_against_current_version",
        "stamp looser than the recorded policy",
        _trace(lambda: restamped("r4", "u3", loose)),
    )
    one_off = attrs.evolve(stamp(0, 1), max_drift=0.3)
    add(
        "reserved_against_current_version",
        "stamp looser in max_drift only",
        _trace(lambda: restamped("r4", "u3", one_off)),
    )
    add(
        "reserved_against_current_version",
        "no recorded policy",
        _trace(lambda: [e for e in evs() if not isinstance(e, PolicyChanged)]),
    )
    add(
        "reserved_against_current_version",
        "a rolled-back version reserved",
        _trace(lambda: reserved_after_rollback(kept=False, admission=stamp(1, 0))),
    )
    add(
        "reserved_against_current_version",
        "negative lag after a kept rollback",
        _trace(
            lambda: reserved_after_rollback(
                kept=True, admission=attrs.evolve(stamp(1, 1), current_version=1)
            )
        ),
    )
    is_pol: Callable[[TraceEvent], bool] = lambda e: isinstance(e, PolicyChanged)  # noqa: E731
    add(
        "policy_explicit",
        "a change from a policy never recorded",
        _trace(lambda: tamper(evs(), is_pol, before=POLICY)),
    )
    add(
        "policy_explicit",
        "a change without a reason",
        _trace(lambda: tamper(evs(), is_pol, reason="")),
    )
    add(
        "lineage_fenced",
        "lineage names an update that never landed",
        _trace(lambda: _lineage(evs(), ("ghost",))),
    )
    add(
        "lineage_fenced",
        "lineage dropped after registration",
        _trace(lambda: _lineage(evs(), ("u1",))),
    )
    add(
        None,
        "two landed updates, one version's lineage each",
        _trace(lambda: lineage_history([("u1",), ("u2",)])),
    )
    add(
        "lineage_fenced",
        "lineage names an update poisoned after it landed",
        _trace(lambda: lineage_history([("u1",)], poison="u1")),
    )
    add(
        "lineage_fenced",
        "one update in two versions' lineage",
        _trace(lambda: lineage_history([("u1",), ("u1", "u2")])),
    )
    add(
        "update_status_follows",
        "a lost lease that leaves its holder unpoisoned",
        _trace(lambda: [e for e in evs() if not _poisons(e, "u3")]),
    )
    add(
        "update_status_follows",
        "a poisoned update landed again",
        _trace(lambda: _relanded(evs(), "u3")),
    )
    add(
        "poisoned_update_never_lands",
        "an update reserves and commits after it lost a lease",
        _trace(lambda: _after_loss(evs(), "r4", "u3")),
    )
    add(
        "poisoned_update_never_lands",
        "a rollout of a retired version consumed",
        _trace(lambda: _consumed(reserved_after_rollback(kept=False, admission=stamp(1, 0)))),
    )
    add(
        "reserved_against_current_version",
        "stamped with a hash its version never had",
        _trace(hash_mismatch_history),
    )
    bad_stage = LedgerEntry(
        rollout_id="a",
        behavior_version=0,
        artifact_hash="h",
        state="update_failed",
        reward=REWARD,
        disposition=Disposition("reward", "timeout"),
    )
    add(
        "failures_have_stage",
        "a failure at the wrong stage",
        _world(World(entries={"a": bad_stage})),
    )
    add(
        "pointer_names_active_artifact",
        "pointer at an uncommitted artifact",
        _world(
            World(
                artifacts={1: ArtifactRecord(version=1, artifact_hash=None)},
                pointer=ActivePointer(1, "h1"),
            )
        ),
    )
    add(
        "activation_needs_all_acks",
        "one worker's ack never stored",
        _trace(lambda: [e for e in evs() if not is_report(WORKERS[1], 1)(e)]),
    )
    add(
        "activation_needs_all_acks",
        "an ack echoing an old attempt's token",
        _trace(lambda: _reack(evs(), token=token(1, 0, WORKERS[0]))),
    )
    add(
        "activation_needs_all_acks",
        "an ack of another hash",
        _trace(lambda: _reack(evs(), artifact_hash="h-other")),
    )
    add(
        "activation_needs_all_acks",
        "a retry after the acks",
        _trace(lambda: tamper(evs(), is_art(1, "distribute"), tokens=issued(1, 2))),
    )
    add(
        "activation_needs_all_acks",
        "no recorded membership",
        _trace(lambda: [e for e in evs() if not isinstance(e, MembershipChanged)]),
    )
    add(
        "activation_needs_all_acks",
        "an ack from before leaving the set",
        _trace(lambda: churned_history(void=False, fresh=False)),
    )
    add(
        "acks_bound_to_attempt",
        "a distribution issuing no tokens",
        _trace(lambda: tamper(evs(), is_art(1, "distribute"), tokens=())),
    )
    add(
        "acks_bound_to_attempt",
        "one token shared by two workers",
        _trace(
            lambda: tamper(
                evs(),
                is_art(1, "distribute"),
                tokens=tuple(attrs.evolve(t, token="same") for t in issued(1, 1)),
            )
        ),
    )
    add(
        "acks_bound_to_attempt",
        "an ack with a forged token",
        _trace(lambda: _reack(evs(), token="forged")),
    )
    add(
        "acks_bound_to_attempt",
        "leaving the set voids nothing",
        _trace(lambda: churned_history(void=False, fresh=True)),
    )
    add(
        "acks_bound_to_attempt",
        "a duplicate of a voided ack counted again",
        _trace(lambda: recounted_history(recount=True)),
    )
    add(
        None,
        "an ack voided by a later report, not counted again",
        _trace(lambda: recounted_history(recount=False)),
    )
    add(
        "ack_deadline_respected",
        "an attempt failed for its deadline before the deadline",
        _trace(lambda: deadline_history(failed_at=50.0)),
    )
    add(
        "ack_deadline_respected",
        "an attempt whose deadline is before the attempt",
        _trace(lambda: deadline_history(failed_at=150.0, deadline=5.0)),
    )
    add(
        None,
        "an attempt failed once its deadline passed",
        _trace(lambda: deadline_history(failed_at=100.0)),
    )
    add(
        "distributed_newer_than_active",
        "a version no newer than the active one",
        _trace(
            lambda: tamper(evs(), is_art(2, "distribute"), pointer_before=ActivePointer(2, "h2"))
        ),
    )
    is_mem: Callable[[TraceEvent], bool] = lambda e: isinstance(e, MembershipChanged)  # noqa: E731
    add(
        "membership_explicit",
        "an empty worker set",
        _trace(lambda: tamper(evs(), is_mem, after=())),
    )
    add(
        "membership_explicit",
        "a change from a set never recorded",
        _trace(lambda: tamper(evs(), is_mem, before=("x",))),
    )
    add(
        "pointer_monotonic",
        "moved back without a rollback",
        _trace(lambda: tamper(evs(), is_art(0, "reinstate"), event="activate")),
    )
    add(
        "failed_activation_keeps_pointer",
        "a failure that moved the pointer",
        _trace(
            lambda: tamper(
                evs(), is_art(2, "fail_distribution"), pointer_after=ActivePointer(2, "h2")
            )
        ),
    )
    add("artifact_immutable", "a committed hash changed", _trace(lambda: _rehash(evs())))
    consumed = LedgerEntry(
        rollout_id="x",
        behavior_version=2,
        artifact_hash="h2",
        state="consumed",
        reward=REWARD,
        admission=stamp(2, 2),
    )
    failed_arts = {
        0: ArtifactRecord(version=0, artifact_hash="h0", state="active"),
        2: ArtifactRecord(
            version=2,
            artifact_hash="h2",
            state="distribution_failed",
            failure=Disposition("distribution", "missing_worker_ack"),
        ),
    }
    add(
        "never_active_never_consumed",
        "a rollout of a failed version consumed",
        _world(
            World(entries={"x": consumed}, artifacts=failed_arts, pointer=ActivePointer(0, "h0"))
        ),
    )
    add(None, "a worker serving what it acked", _trace(lambda: served_history(False)))
    # built through the real coordinator, which voids a restarted worker's ack: it shows
    # the checker only the state the code already prevents (nothing stored at all), so the
    # hand-written traces below carry the states it must flag on its own
    add(
        "served_after_sync",
        "a restarted worker serving before it resynced (real coordinator)",
        _trace(lambda: served_history(True)),
        real_code=True,
    )
    add(
        None, "a restarted worker serving after it resynced", _trace(lambda: served_trace("synced"))
    )
    for case, label in (
        ("stale_ack_kept", "an ack of a previous incarnation served after a restart"),
        ("no_restart_recorded", "a new incarnation serving on its previous one's ack"),
        ("other_version", "a worker serving a version it never acked"),
    ):
        add("served_after_sync", label, _trace(functools.partial(served_trace, case)))
    pending = _reserved(stamp(0, 0)).entries
    add("reservations_resolve", "a reservation left at quiescence", _rest(World(entries=pending)))
    add(
        "activations_resolve",
        "an activation left awaiting acks",
        _rest(
            World(
                artifacts={0: ArtifactRecord(version=0, artifact_hash="h0", state="awaiting_acks")}
            )
        ),
    )
    waiting = LedgerEntry(
        rollout_id="x", behavior_version=2, artifact_hash="h2", state="rewarded", reward=REWARD
    )
    add(
        "failed_version_quarantined",
        "a failed version's rollout still open",
        _rest(World(entries={"x": waiting}, artifacts=failed_arts, pointer=ActivePointer(0, "h0"))),
    )
    rolled = ArtifactRecord(
        version=2,
        artifact_hash="h2",
        state="rolled_back",
        rollback_version=1,
        failure=Disposition("activation", "rolled_back", "operator rollback"),
    )
    add(
        "retired_version_quarantined",
        "a rolled-back version's rollout still waiting",
        _rest(
            World(
                entries={"x": waiting},
                artifacts={
                    1: ArtifactRecord(version=1, artifact_hash="h1", state="active"),
                    2: rolled,
                },
                pointer=ActivePointer(1, "h1"),
            )
        ),
    )
    c.extend(_pacing_cases())
    return c


def _pacing_cases() -> list[CheckerCase]:
    """The paced history (good) and one tampering per rule of `dispatch_paced`, plus a
    rollout that ended without a cause (`dispatched_accounted_for`)."""
    paced = paced_history

    def case(expect: str | None, name: str, run: Run) -> CheckerCase:
        return CheckerCase(f"spec:{expect or 'good'}", name, expect, run)

    def p(name: str, extra: Callable[[], list[TraceEvent]]) -> CheckerCase:
        return case("dispatch_paced", name, _trace(extra))

    ended = forge(
        LedgerEntry,
        rollout_id="x",
        behavior_version=0,
        artifact_hash="h",
        state="retired_stale",
        disposition=None,
    )
    return [
        case(None, "a paced run: budget, retirement, a second attempt", _trace(paced)),
        p(
            "a dispatch past the full budget",
            lambda: [*paced(), dispatched_event("d1", 2, "p4", 1)],
        ),
        p(
            "a second live attempt of one chain",
            lambda: [*paced(), dispatched_event("b3", 2, "p2", 3)],
        ),
        p(
            "a chain dispatched again after it trained",
            lambda: [*paced(), dispatched_event("a2", 2, "p1", 2)],
        ),
        p(
            "an add past the full budget, without its prompt's chain",
            lambda: [
                *paced(),
                EntryChanged(
                    10_000,
                    10_000,
                    0.0,
                    "z1",
                    "add",
                    None,
                    LedgerEntry("z1", 2, f"{2:x}".rjust(64, "c")),
                ),
            ],
        ),
        p(
            "an attempt numbered out of order",
            lambda: tamper(
                paced(),
                lambda ev: (
                    isinstance(ev, EntryChanged) and ev.rollout_id == "c1" and ev.before is None
                ),
                after=attrs.evolve(
                    next(
                        ev.after
                        for ev in paced()
                        if isinstance(ev, EntryChanged) and ev.rollout_id == "c1"
                    ),
                    attempt=2,
                ),
            ),
        ),
        p(
            "a dispatch on a version already too old for the pointer",
            lambda: [
                *(
                    ev
                    for ev in paced()
                    if not (isinstance(ev, EntryChanged) and ev.rollout_id == "c1")
                ),
                dispatched_event("c1", 0, "p3", 1),
            ],
        ),
        case(
            "dispatched_accounted_for",
            "a rollout ended without a cause",
            _world(World(entries={"x": ended})),
        ),
    ]


def _legacy(events: Sequence[TraceEvent]) -> list[TraceEvent]:
    """The history as stored before attempt tokens existed (no `tokens` fields)."""
    from rollout_lifecycle.model.events import event_from_jsonable, event_to_jsonable

    out = []
    for ev in events:
        data = event_to_jsonable(ev)
        data.pop("tokens", None)
        if data.get("ack"):
            data["ack"].pop("token", None)
        for a in data.get("acks", ()):
            a.pop("token", None)
        out.append(event_from_jsonable(data))
    return out


def _consumed_twice(events: Sequence[TraceEvent]) -> list[TraceEvent]:
    ev = next(e for e in events if is_entry("r1", "commit")(e))
    assert isinstance(ev, EntryChanged)
    again = attrs.evolve(
        ev,
        seq=9999,
        txn=9999,
        before=ev.after,
        after=attrs.evolve(ev.after, revision=ev.after.revision + 1),
    )
    return [*events, again]


def _passed_on(events: Sequence[TraceEvent]) -> list[TraceEvent]:
    """u1's reservation of r2 handed to u9 in place (no release, no re-reserve)."""
    ev = next(e for e in events if is_entry("r2", "reserve")(e))
    assert isinstance(ev, EntryChanged)
    after = ev.after
    moved = attrs.evolve(after, reserved_by="u9", revision=after.revision + 1)
    step = EntryChanged(0, ev.txn, ev.at, "r2", "renew_lease", after, moved, "u9")
    out = list(events)
    i = out.index(ev)
    out.insert(i + 1, attrs.evolve(step, seq=ev.seq, txn=ev.txn))
    # later events of r2 continue from the handed-over record
    return [
        attrs.evolve(e, before=moved)
        if isinstance(e, EntryChanged)
        and e.rollout_id == "r2"
        and e.before == after
        and e is not out[i + 1]
        else e
        for e in out
    ]


def _poisons(ev: TraceEvent, update: str) -> bool:
    return isinstance(ev, UpdateChanged) and ev.update_id == update and ev.event == "poison"


def _relanded(events: Sequence[TraceEvent], update: str) -> list[TraceEvent]:
    """The history, then `update`'s record moved from poisoned back to landed."""
    last = next(e for e in reversed(events) if _poisons(e, update))
    assert isinstance(last, UpdateChanged)
    landed = UpdateRecord(update, "landed")
    return [*events, UpdateChanged(999, 999, 0.0, update, "land", last.after, landed)]


def _after_loss(events: Sequence[TraceEvent], rid: str, update: str) -> list[TraceEvent]:
    """The history, then `update` (which lost a lease) reserves `rid` again and commits it,
    as a write path that forgot the poisoning would record it."""
    cur = next(e for e in reversed(events) if isinstance(e, EntryChanged) and e.rollout_id == rid)
    held = attrs.evolve(
        cur.after,
        state="reserved",
        revision=cur.after.revision + 1,
        reserved_by=update,
        lease_expires_at=100.0,
        admission=stamp(0, 0),
    )
    done = attrs.evolve(
        held, state="consumed", revision=held.revision + 1, reserved_by=None, lease_expires_at=None
    )
    return [
        *events,
        EntryChanged(998, 998, 0.0, rid, "reserve", cur.after, held, update),
        EntryChanged(999, 999, 0.0, rid, "commit", held, done, update),
    ]


def _consumed(events: Sequence[TraceEvent]) -> list[TraceEvent]:
    """The history, then its last reservation committed by its holder."""
    last = next(e for e in reversed(events) if isinstance(e, EntryChanged))
    held = last.after
    done = attrs.evolve(
        held, state="consumed", revision=held.revision + 1, reserved_by=None, lease_expires_at=None
    )
    return [
        *events,
        EntryChanged(999, 999, 0.0, held.rollout_id, "commit", held, done, last.update_id),
    ]


def _lineage(events: Sequence[TraceEvent], lineage: tuple[str, ...]) -> list[TraceEvent]:
    reg1 = next(e for e in events if is_art(1, "register")(e))
    assert isinstance(reg1, ArtifactChanged)
    return [
        attrs.evolve(e, after=attrs.evolve(e.after, trained_by=lineage)) if e is reg1 else e
        for e in events
    ]


def _reack(events: Sequence[TraceEvent], **changes: Any) -> list[TraceEvent]:
    ev = next(e for e in events if is_report(WORKERS[0], 1)(e))
    assert isinstance(ev, WorkerReported) and ev.ack is not None
    return tamper(events, is_report(WORKERS[0], 1), ack=attrs.evolve(ev.ack, **changes))


def _rehash(events: Sequence[TraceEvent]) -> list[TraceEvent]:
    ev = next(e for e in events if is_art(1, "distribute")(e))
    assert isinstance(ev, ArtifactChanged)
    return tamper(
        events, is_art(1, "distribute"), after=attrs.evolve(ev.after, artifact_hash="other")
    )


# ---- generated corruptions ---------------------------------------------------------------


Corruption = Callable[[list[TraceEvent], random.Random], "list[TraceEvent] | None"]


def _pick(
    events: Sequence[TraceEvent], rng: random.Random, pred: Callable[[TraceEvent], bool]
) -> int | None:
    idx = [i for i, e in enumerate(events) if pred(e)]
    return rng.choice(idx) if idx else None


def _c_consumer(evs: list[TraceEvent], rng: random.Random) -> list[TraceEvent] | None:
    i = _pick(evs, rng, lambda e: isinstance(e, EntryChanged) and e.event == "commit")
    if i is None:
        return None
    ev = evs[i]
    assert isinstance(ev, EntryChanged)
    evs[i] = attrs.evolve(ev, update_id="intruder")
    return evs


def _c_revision(evs: list[TraceEvent], rng: random.Random) -> list[TraceEvent] | None:
    i = _pick(evs, rng, lambda e: isinstance(e, EntryChanged) and e.before is not None)
    if i is None:
        return None
    ev = evs[i]
    assert isinstance(ev, EntryChanged)
    evs[i] = attrs.evolve(
        ev, after=attrs.evolve(ev.after, revision=ev.after.revision + rng.choice((2, 5)))
    )
    return evs


def _c_loose_stamp(evs: list[TraceEvent], rng: random.Random) -> list[TraceEvent] | None:
    i = _pick(evs, rng, lambda e: isinstance(e, EntryChanged) and e.event == "reserve")
    if i is None:
        return None
    ev = evs[i]
    assert isinstance(ev, EntryChanged) and ev.after.admission is not None
    a = ev.after.admission
    field = rng.choice(("max_lag", "max_drift"))
    looser = (
        attrs.evolve(a, max_lag=a.max_lag + 5)
        if field == "max_lag"
        else attrs.evolve(a, max_drift=a.max_drift + 1.0)
    )
    evs[i] = attrs.evolve(ev, after=attrs.evolve(ev.after, admission=looser))
    return evs


def _c_drop_ack(evs: list[TraceEvent], rng: random.Random) -> list[TraceEvent] | None:
    acts = [
        e.version
        for e in evs
        if isinstance(e, ArtifactChanged) and e.event == "activate" and e.version > 0
    ]
    if not acts:
        return None
    v = rng.choice(acts)
    w = rng.choice(WORKERS)
    return [e for e in evs if not is_report(w, v)(e)]


def _c_fail_moves(evs: list[TraceEvent], rng: random.Random) -> list[TraceEvent] | None:
    i = _pick(evs, rng, lambda e: isinstance(e, ArtifactChanged) and e.event == "fail_distribution")
    if i is None:
        return None
    ev = evs[i]
    assert isinstance(ev, ArtifactChanged)
    evs[i] = attrs.evolve(ev, pointer_after=ActivePointer(ev.version, f"h{ev.version}"))
    return evs


def _c_owner(evs: list[TraceEvent], rng: random.Random) -> list[TraceEvent] | None:
    i = _pick(evs, rng, lambda e: isinstance(e, EntryChanged) and e.event == "reserve")
    if i is None:
        return None
    ev = evs[i]
    assert isinstance(ev, EntryChanged)
    evs[i] = attrs.evolve(
        ev,
        after=forge(LedgerEntry, **{**attrs.asdict(ev.after, recurse=False), "reserved_by": None}),
    )
    return evs


CORRUPTIONS: dict[str, tuple[str, Corruption]] = {
    "commit by another update": ("exactly_once", _c_consumer),
    "revision jumps": ("revision_bumps_by_one", _c_revision),
    "stamp looser than policy in one bound": ("reserved_against_current_version", _c_loose_stamp),
    "an activation missing one ack": ("activation_needs_all_acks", _c_drop_ack),
    "a failed activation moves the pointer": ("failed_activation_keeps_pointer", _c_fail_moves),
    "a reservation without an owner": ("exclusive_ownership", _c_owner),
}


def _const(events: list[TraceEvent]) -> Callable[[], list[TraceEvent]]:
    return lambda: events


def generated_cases(seed: int, n: int) -> Iterator[CheckerCase]:
    """n random correct histories (must pass) and one targeted corruption of each."""
    rng = random.Random(seed)
    names = sorted(CORRUPTIONS)
    for k in range(n):
        good = random_history(random.Random(rng.randrange(2**32)), steps=rng.randint(10, 60))
        yield CheckerCase(
            "spec:generated",
            f"random history #{k}",
            None,
            _trace(_const(good), quiescent=False),
        )
        for j in range(len(names)):
            label = names[(k + j) % len(names)]
            expect, corrupt = CORRUPTIONS[label]
            bad = corrupt(list(good), random.Random(rng.randrange(2**32)))
            if bad is not None:
                yield CheckerCase("spec:generated", f"#{k}: {label}", expect, _trace(_const(bad)))
                break


# ---- the race's history judge -------------------------------------------------------------


def _race_trace() -> tuple[list[TraceEvent], dict[str, float]]:
    """u1 reserves r1 (revision 2) at t=1, u2 is refused; u1 commits at t=3."""
    log = EventLog()
    clock = ManualClock()
    led = MemoryLedger(clock=clock, lease_seconds=100, event_log=log)
    reg = HandRegistry(log)
    reg.activate(0)
    rewarded(led, "r1", 0)
    rewarded(led, "r2", 0)
    clock.advance(1.0)
    assert led.reserve("r1", 2, "u1", stamp(0, 0)).reserved
    clock.advance(2.0)
    led.commit("u1", ["r1"])
    return log.events(), {"reserve": 1.0, "commit": 3.0}


def _call(
    update: str, start: float, end: float, asked: list[tuple[str, int]], got: list[tuple[str, str]]
) -> dict[str, Any]:
    return {
        "update_id": update,
        "start": start,
        "end": end,
        "asked": [[rid, rev, to_jsonable(stamp(0, 0))] for rid, rev in asked],
        "got": [list(g) for g in got],
    }


def race_cases() -> list[CheckerCase]:
    """Reserve calls whose claimed outcome the trace confirms (good) or contradicts (bad)."""
    trace, _ = _race_trace()
    name = "call_outcome_linearizable"

    def judged(calls: list[dict[str, Any]]) -> Run:
        return lambda: {v.invariant for v in judge_calls(trace, calls)}

    win = _call("u1", 0.9, 1.1, [("r1", 2)], [("r1", "reserved")])
    lost = _call("u2", 0.9, 1.1, [("r1", 2)], [("r1", "revision_conflict")])
    retry = _call("u1", 1.5, 1.6, [("r1", 2)], [("r1", "idempotent_retry")])
    return [
        CheckerCase(
            "race", "a win, a lost race and the owner's retry", None, judged([win, lost, retry])
        ),
        CheckerCase(
            "race",
            "a win over another revision",
            name,
            judged([_call("u1", 0.9, 1.1, [("r1", 1)], [("r1", "reserved")])]),
        ),
        CheckerCase(
            "race",
            "a win the trace never wrote",
            name,
            judged([_call("u2", 0.9, 1.1, [("r2", 2)], [("r2", "reserved")])]),
        ),
        CheckerCase(
            "race",
            "a win outside the call's window",
            name,
            judged([_call("u1", 2.0, 2.5, [("r1", 2)], [("r1", "reserved")])]),
        ),
        CheckerCase(
            "race",
            "an idempotent retry claimed by a non-owner",
            name,
            judged([_call("u2", 1.5, 1.6, [("r1", 2)], [("r1", "idempotent_retry")])]),
        ),
        CheckerCase(
            "race",
            "an idempotent retry of a row nobody held",
            name,
            judged([_call("u2", 0.2, 0.5, [("r2", 2)], [("r2", "idempotent_retry")])]),
        ),
        CheckerCase(
            "race",
            "a conflict that never was",
            name,
            judged([_call("u2", 0.2, 0.5, [("r2", 2)], [("r2", "revision_conflict")])]),
        ),
        CheckerCase(
            "race",
            "refused although the trace shows it won",
            name,
            judged([_call("u1", 0.9, 1.1, [("r1", 2)], [("r1", "revision_conflict")])]),
        ),
    ]


# ---- the linearizability check of recorded call histories -----------------------------------


def _lin(lines: Sequence[dict[str, Any]], time_limit: float = 5.0) -> Run:
    """What the linearizability check flags: 'linearizable' on a violation,
    'linearizable:unknown' when it ran out of time (never a pass)."""

    def run() -> set[str]:
        got = check_history(lines, time_limit=time_limit)
        if got.verdict == "violation":
            return {"linearizable"}
        return {"linearizable:unknown"} if got.verdict == "unknown" else set()

    return run


def linearizability_cases(seed: int, generated: int) -> list[CheckerCase]:
    """Histories no single order explains (issue 33's stale-row refusal, a double
    reservation, a lost commit, a retry answered differently, a batch half applied, a
    pointer that goes back, a settle that activates before the ack or fails what was not
    awaiting acks), each beside its good twin; a search too big for its time
    limit ('unknown', never 'ok'); sequential workloads through the real code (the model
    must explain every answer) and the same with one answer changed."""
    name = "linearizable"
    pairs: list[tuple[str, Callable[..., Any], Any, Any]] = [
        ("stale-row refusal (issue 33)", H.stale_row_refusal, "pointer_moved", "revision_conflict"),
        ("a refusal for another reason", H.refusal_reason, "pointer_moved", "revision_conflict"),
        ("double reservation", H.double_reserve, "reserved", "revision_conflict"),
        ("lost commit", H.lost_commit, "reserved", "consumed"),
        (
            "retry answered differently",
            H.retry_answered_differently,
            "revision_conflict",
            "idempotent_retry",
        ),
        ("batch half applied", H.batch_half_applied, "rewarded", "reserved"),
        ("pointer goes back", H.pointer_goes_back, 0, 1),
        ("a settle that activates before the ack", H.settle_before_the_ack, True, False),
        ("a settle that fails what was not awaiting", H.settle_fails_what_was_not_awaiting, 0, 1),
        (
            "a policy change and an activation at once",
            H.policy_and_activation_at_once,
            0.95,
            2.0,
        ),
        (
            "a sweep after a rollback",
            H.sweep_after_a_rollback,
            "retired_stale",
            "quarantined",
        ),
    ]
    cases = []
    for what, build, bad, good in pairs:
        cases.append(CheckerCase("linearizability", what, name, _lin(build(bad))))
        cases.append(CheckerCase("linearizability", f"{what}: good twin", None, _lin(build(good))))
    cases.append(
        CheckerCase(
            "linearizability",
            "a search past its time limit",
            "linearizable:unknown",
            _lin(H.many_reads_one_impossible(40), time_limit=0.05),
        )
    )
    rng = random.Random(seed)
    for i in range(generated):
        try:
            lines = H.generated_history(seed * 1000 + i, steps=120)
        except Exception as exc:  # the write path refused the workload (under a mutant)
            crash = _raises(exc)  # a crash, reported as one: no checker's verdict
            cases.append(CheckerCase("linearizability:generated", f"workload {i}", None, crash))
            continue
        cases.append(CheckerCase("linearizability:generated", f"workload {i}", None, _lin(lines)))
        bad_lines = H.corrupted(lines, rng)
        if bad_lines is not None:
            cases.append(
                CheckerCase(
                    "linearizability:generated",
                    f"workload {i}, one answer changed",
                    name,
                    _lin(bad_lines),
                )
            )
    return cases


# ---- ledger check (the audit of stored rows) ----------------------------------------------


@functools.cache
def _stored() -> StoredRows:
    """The rows a memory backend stores after a short correct run through the real API
    (built once per `run_checker_checks`, under whatever patch that run is in: every
    audit case edits a copy, never these rows)."""
    from rollout_lifecycle.model.coordinator import ActivationCoordinator
    from rollout_lifecycle.model.registry import set_admission_policy

    b = open_backend("memory://")
    set_admission_policy(b.registry, AdmissionPolicy(1, 0.2), "set by the operator")
    coord = ActivationCoordinator(
        b.registry, WORKERS, ledger=b.ledger, policy=AdmissionPolicy(1, 0.2)
    )
    coord.prepare(0)
    coord.commit_artifact(0, "h0")
    coord.distribute(0)
    for w in WORKERS:
        coord.record_ack(WorkerAck(w, 0, "h0", token=coord.attempt_token(w, 0)))
    coord.try_activate(0)
    rewarded(b.ledger, "r1", 0)  # type: ignore[arg-type]
    b.ledger.reserve("r1", 2, "u1", stamp(0, 0))
    b.ledger.commit("u1", ["r1"])
    return b.stored_rows()


def _edit_table(rows: StoredRows, table: str, column: str, value: Any) -> StoredRows:
    t = [dict(r) for r in rows.tables[table]]
    t[0][column] = value
    return attrs.evolve(rows, tables={**rows.tables, table: t})


def audit_cases() -> list[CheckerCase]:
    """`ledger check` on untouched rows (must pass) and on rows edited behind its back."""

    def audited(edit: Callable[[StoredRows], StoredRows]) -> Run:
        return lambda: {v.invariant for v in audit(edit(_stored())).violations}

    def anchored(
        edit: Callable[[StoredRows], StoredRows], anchors: Callable[[StoredRows], list[Anchor]]
    ) -> Run:
        """The audit of the edited rows against anchors taken from the rows before the edit."""

        def run() -> set[str]:
            rows = _stored()
            return {v.invariant for v in audit(edit(rows), anchors=anchors(rows)).violations}

        return run

    def drop(i: int) -> Callable[[StoredRows], StoredRows]:
        return lambda r: attrs.evolve(r, events=[e for k, e in enumerate(r.events) if k != i])

    def edit_payload(r: StoredRows) -> StoredRows:
        evs = list(r.events)
        i = max(k for k, e in enumerate(evs) if e.kind == "entry")  # the commit's event
        evs[i] = attrs.evolve(evs[i], payload=evs[i].payload.replace('"consumed"', '"rewarded"'))
        return attrs.evolve(r, events=evs)

    return [
        CheckerCase("audit", "the rows as stored", None, audited(lambda r: r)),
        CheckerCase(
            "audit",
            "a rollout's state column edited",
            "stored_matches_trace",
            audited(lambda r: _edit_table(r, "rollouts", "state", "rewarded")),
        ),
        CheckerCase(
            "audit",
            "a rollout's revision column edited",
            "stored_matches_trace",
            audited(lambda r: _edit_table(r, "rollouts", "revision", 99)),
        ),
        CheckerCase(
            "audit",
            "the pointer row edited",
            "stored_matches_trace",
            audited(lambda r: _edit_table(r, "registry_pointer", "version", 7)),
        ),
        CheckerCase(
            "audit",
            "a landed update's record set back to open",
            "stored_matches_trace",
            audited(lambda r: _edit_table(r, "ledger_updates", "status", "open")),
        ),
        CheckerCase("audit", "an event deleted mid-chain", "history_deleted", audited(drop(3))),
        CheckerCase(
            "audit",
            "the last event cut off",
            "history_truncated",
            audited(lambda r: attrs.evolve(r, events=list(r.events)[:-1])),
        ),
        CheckerCase("audit", "an event's payload edited", "history_edited", audited(edit_payload)),
        CheckerCase(
            "audit",
            "the head deleted with every hash",
            "history_missing",
            audited(lambda r: attrs.evolve(r, head=None, events=_stripped(r.events))),
        ),
        CheckerCase(
            "audit",
            "a bad-version mark inserted by hand",
            "stored_matches_trace",
            audited(lambda r: _with_rows(r, "ledger_bad_versions", [{"version": 9}])),
        ),
        CheckerCase(
            "audit",
            "an anchor of the head as stored",
            None,
            anchored(lambda r: r, lambda r: [_anchor_of(r, len(r.events) - 1)]),
        ),
        *_sequence_keeping_cases(audited, anchored),
    ]


# ---- tampering that keeps the sequence (issue 37): no seq is cut, added or moved ------------


def _stripped(events: Sequence[StoredEvent]) -> list[StoredEvent]:
    return [attrs.evolve(ev, prev_hash=None, hash=None) for ev in events]


def _with_rows(rows: StoredRows, table: str, extra: list[dict[str, Any]]) -> StoredRows:
    return attrs.evolve(rows, tables={**rows.tables, table: [*rows.tables.get(table, ()), *extra]})


def _anchor_of(rows: StoredRows, i: int) -> Anchor:
    ev = rows.events[i]
    assert ev.hash is not None
    return Anchor(ev.seq, ev.hash, line=1)


def _later(payload: str) -> str:
    """The same event one second later: a payload edit that changes no replayed record, so
    the chain (its hashes and head, or an anchor) is all that can see it."""
    data = json.loads(payload)
    data["at"] = float(data["at"]) + 1.0
    return json.dumps(data, separators=(",", ":"))


def _rechained(events: Sequence[StoredEvent], start: int) -> list[StoredEvent]:
    """The events with every hash from `start` on computed again, as a forger does (the
    head left as stored unless the caller moves it too)."""
    out = list(events[:start])
    prev = out[-1].hash if out else GENESIS
    for ev in events[start:]:
        assert prev is not None
        h = chain_hash(prev, ev.seq, ev.txn, ev.kind, ev.subject, ev.payload)
        out.append(attrs.evolve(ev, prev_hash=prev, hash=h))
        prev = h
    return out


def _replaced(i: int, *, head: bool) -> Callable[[StoredRows], StoredRows]:
    """Event i edited in place and the chain recomputed after it; with `head`, the head
    moved to the forged last hash as well (then only an anchor can tell)."""

    def edit(r: StoredRows) -> StoredRows:
        evs = list(r.events)
        evs[i] = attrs.evolve(evs[i], payload=_later(evs[i].payload))
        evs = _rechained(evs, i)
        new_head, forged = r.head, evs[-1].hash
        if head and new_head is not None and forged is not None:
            new_head = attrs.evolve(new_head, last_hash=forged)
        return attrs.evolve(r, events=evs, head=new_head)

    return edit


def _swapped(i: int, j: int, *, rechain: bool) -> Callable[[StoredRows], StoredRows]:
    """Events i and j with their payloads swapped (seqs, kinds and subjects kept), the chain
    recomputed after them when `rechain`."""

    def edit(r: StoredRows) -> StoredRows:
        evs = list(r.events)
        a, b = evs[i], evs[j]
        evs[i], evs[j] = attrs.evolve(a, payload=b.payload), attrs.evolve(b, payload=a.payload)
        return attrs.evolve(r, events=_rechained(evs, min(i, j)) if rechain else evs)

    return edit


def _sequence_keeping_cases(
    audited: Callable[[Callable[[StoredRows], StoredRows]], Run],
    anchored: Callable[
        [Callable[[StoredRows], StoredRows], Callable[[StoredRows], list[Anchor]]], Run
    ],
) -> list[CheckerCase]:
    """For EVERY position, the last included (a head compared by seq only misses it): the
    event replaced in place with the chain recomputed after it (the head's hash names the
    forgery), and the same with the head moved too, against an anchor taken before (the
    anchor names it). Then two events' payloads swapped, as stored and re-chained."""
    n = len(_stored().events)
    out = []
    for i in range(n):
        where = "the last" if i == n - 1 else f"#{i}"
        out.append(
            CheckerCase(
                "audit",
                f"{where} event replaced in place, the chain recomputed after it",
                "history_rewritten",
                audited(_replaced(i, head=False)),
            )
        )
        out.append(
            CheckerCase(
                "audit",
                f"{where} event replaced, chain and head recomputed, an older anchor given",
                "history_anchor",
                anchored(_replaced(i, head=True), lambda r: [_anchor_of(r, n - 1)]),
            )
        )
    first, last = 0, n - 1
    out += [
        CheckerCase(
            "audit",
            "two events' payloads swapped",
            "history_edited",
            audited(_swapped(first, last, rechain=False)),
        ),
        CheckerCase(
            "audit",
            "two events' payloads swapped, the chain recomputed",
            "history_rewritten",
            audited(_swapped(first, last, rechain=True)),
        ),
    ]
    return out


# the audited tables whose every column the replayed trace determines (the counters: the
# counts of recorded writes)
_AUDITED = (
    "ledger_counters",
    "rollouts",
    "ledger_updates",
    "registry_artifacts",
    "registry_workers",
    "registry_attempt_tokens",
    "registry_pointer",
    "registry_membership",
    "registry_policy",
)


# counters the history fixes exactly (commits and aborts count calls: a commit of nothing
# counts and writes nothing, so the history only bounds them from below)
_EXACT_COUNTERS = ("writes", "reservations", "expirations")


def _edited(value: Any, rng: random.Random) -> Any:
    if isinstance(value, bool):  # True == 1: an edit to 1 would read the same
        return rng.choice((not value, "x"))
    if value is None:
        return rng.choice((1, "x"))
    if isinstance(value, int | float):
        return value + rng.choice((1, 2, -1))
    return str(value) + "x"  # never whitespace: a JSON column would read the same


def _audited_after(edit: Callable[[StoredRows], StoredRows]) -> Run:
    return lambda: {v.invariant for v in audit(edit(_stored())).violations}


def audit_generated_cases(seed: int, n: int) -> list[CheckerCase]:
    """n random single-cell edits of audited rows: each must be named."""
    rng = random.Random(seed)
    rows = _stored()
    out = []
    for k in range(n):
        table = rng.choice([t for t in _AUDITED if rows.tables.get(t)])
        if table == "ledger_counters":  # the counts of recorded writes, which are exact
            cells = rows.tables[table]
            row = rng.choice([i for i, c in enumerate(cells) if c["name"] in _EXACT_COUNTERS])
            column = "n"
        else:
            row = rng.randrange(len(rows.tables[table]))
            column = rng.choice(sorted(rows.tables[table][row]))
        value = _edited(rows.tables[table][row][column], rng)

        def edit(
            r: StoredRows, t: str = table, i: int = row, c: str = column, v: Any = value
        ) -> StoredRows:
            cells = [dict(x) for x in r.tables[t]]
            cells[i][c] = v
            return attrs.evolve(r, tables={**r.tables, t: cells})

        out.append(
            CheckerCase(
                "audit",
                f"#{k}: {table}[{row}].{column} edited",
                "stored_matches_trace",
                _audited_after(edit),
            )
        )
    return out


# ---- differential: the write path's rules against the spec's restatement ------------------


@attrs.frozen
class Premise:
    """One reservation's premise: what the write path reads in its atomic step."""

    stamp: AdmissionStamp | None
    behavior_version: int
    pointer: int | None
    was_active: frozenset[int]
    policy: AdmissionPolicy | None
    retired: frozenset[int]
    kept: frozenset[int]
    # the hash the rollout is stamped with (its version's is f"h{version}")
    artifact_hash: str | None = None


def _gen_premise(rng: random.Random) -> Premise:
    """A premise near the boundaries: lags -1..3, bounds at and around the policy, one
    figure of an otherwise good stamp wrong, NaN or missing drift, retired or kept
    versions, a version never active."""
    pv = rng.randint(0, 4)
    bv = max(0, pv - rng.choice((-1, 0, 0, 0, 1, 1, 2)))
    policy = (
        None
        if rng.random() < 0.05
        else AdmissionPolicy(rng.choice((0, 1, 1, 2)), rng.choice((0.1, 0.2, 0.5)))
    )
    cv = pv if rng.random() < 0.8 else max(0, pv - 1)
    max_lag = policy.max_lag if policy else 1
    max_drift = policy.max_drift if policy else 0.2
    good = dict(
        current_version=cv,
        behavior_version=bv,
        max_lag=max_lag,
        max_drift=max_drift,
        drift=round(rng.uniform(0, max_drift), 3),
        freshness=freshness(cv - bv, max_lag),
        reason="ok",
        accepted=True,
    )
    wrong = rng.choice(
        (
            "none",
            "none",
            "max_lag",
            "max_drift",
            "drift",
            "behavior_version",
            "accepted",
            "current_version",
        )
    )
    if wrong == "max_lag":
        good["max_lag"] = max_lag + rng.choice((-1, 1, 1000))
    elif wrong == "max_drift":
        good["max_drift"] = max_drift + rng.choice((0.05, 1e9))
    elif wrong == "drift":
        good["drift"] = rng.choice((math.nan, None, max_drift + 0.01, -0.1, math.inf))
    elif wrong == "behavior_version":
        good["behavior_version"] = bv + rng.choice((-1, 1))
    elif wrong == "accepted":
        good["accepted"], good["reason"] = False, "policy_drift"
    elif wrong == "current_version":
        good["current_version"] = cv + rng.choice((-1, 1, 5))
    if isinstance(good["max_lag"], int) and good["max_lag"] >= 0:
        lag = int(str(good["current_version"])) - int(str(good["behavior_version"]))
        ml = int(str(good["max_lag"]))
        good["freshness"] = freshness(lag, ml)
    st = None if rng.random() < 0.03 else forge(AdmissionStamp, **good)
    if rng.random() < 0.1:  # admitted while bv was active, then the operator rolled it back
        bv, kept_back = pv + 1, rng.random() < 0.5
        st = forge(
            AdmissionStamp,
            **{
                **good,
                "current_version": bv,
                "behavior_version": bv,
                "freshness": "fresh",
                "accepted": True,
                "reason": "ok",
            },
        )
        ever = frozenset(range(pv + 2))
        return Premise(
            st,
            bv,
            pv,
            ever,
            policy,
            frozenset() if kept_back else frozenset({bv}),
            frozenset({bv}) if kept_back else frozenset(),
        )
    ever = frozenset(v for v in range(pv + 1) if rng.random() < 0.9 or v == pv)
    if rng.random() < 0.2:
        ever = ever | {pv + 1}  # a newer version that was active, then rolled back
    rolled = frozenset(v for v in ever if v > pv)
    kept = frozenset(v for v in rolled if rng.random() < 0.4)
    digest = f"h{bv}" if rng.random() < 0.9 else "h-never"  # a hash its version never had
    return Premise(st, bv, pv, ever, policy, rolled - kept, kept, digest)


def _spec_refuses(p: Premise) -> bool:
    """Whether the spec flags a reservation on this premise (replayed as one step)."""
    arts: dict[int, ArtifactRecord] = {}
    top = max([p.behavior_version, p.pointer or 0, *p.was_active]) + 1
    for v in range(top + 1):
        if v == p.pointer:
            state = "active"
        elif v in p.retired or v in p.kept:
            state = "rolled_back"
        elif v in p.was_active:
            state = "superseded"
        else:
            state = "distribution_failed"
        failure = None
        if state == "rolled_back":
            failure = Disposition(
                "activation", "rolled_back_kept" if v in p.kept else "rolled_back"
            )
        elif state == "distribution_failed":
            failure = Disposition("distribution", "timeout")
        arts[v] = forge(
            ArtifactRecord,
            version=v,
            artifact_hash=f"h{v}",
            state=state,
            failure=failure,
        )
    before = LedgerEntry(
        rollout_id="x",
        behavior_version=p.behavior_version,
        artifact_hash=p.artifact_hash or f"h{p.behavior_version}",
        state="rewarded",
        revision=2,
        reward=REWARD,
    )
    after = forge(
        LedgerEntry,
        **{
            **attrs.asdict(before, recurse=False),
            "state": "reserved",
            "reserved_by": "u",
            "revision": 3,
            "admission": p.stamp,
        },
    )
    pointer = None if p.pointer is None else ActivePointer(p.pointer, f"h{p.pointer}")
    world = World(
        entries={"x": before},
        artifacts=arts,
        pointer=pointer,
        policy=p.policy,
        required_workers=WORKERS,
    )
    step: list[TraceEvent] = [EntryChanged(1, 1, 0.0, "x", "reserve", before, after, "u")]
    from rollout_lifecycle.spec.invariants import Replayer

    r = Replayer(world)
    found = {v.invariant for v in r.feed(step)}
    return bool(
        found
        & {
            "admitted_when_reserved",
            "reserved_against_current_version",
            "never_active_never_consumed",
        }
    )


def _rules_refuse(p: Premise) -> bool:
    return (
        rules.reservation_refusal(
            p.stamp,
            p.behavior_version,
            p.pointer,
            p.was_active,
            p.policy,
            p.retired,
            p.artifact_hash or f"h{p.behavior_version}",
            {v: f"h{v}" for v in p.was_active},
        )
        is not None
    )


def differential_cases(seed: int, n: int) -> list[CheckerCase]:
    """n generated premises; each a case that fails when the two judgements disagree."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        p = _gen_premise(rng)

        def run(p: Premise = p) -> set[str]:
            a, b = _rules_refuse(p), _spec_refuses(p)
            if a == b:
                return set()
            return {"rules_refuse_spec_admits" if a else "rules_admit_spec_refuses"}

        out.append(CheckerCase("differential", f"premise #{k}", None, run))
    return out


# ---- the stage ---------------------------------------------------------------------------


@attrs.frozen
class CaseFailure:
    """A case the checker got wrong: a bad input passed, or a good one flagged."""

    checker: str
    name: str
    expect: str | None
    got: tuple[str, ...]

    def __str__(self) -> str:
        if self.expect is None:
            return f"{self.checker}: good input '{self.name}' flagged {list(self.got)}"
        return (
            f"{self.checker}: bad input '{self.name}' not flagged as {self.expect} "
            f"(got {list(self.got)})"
        )


@attrs.frozen
class CheckerReport:
    """How many cases each checker was shown, and the ones it got wrong."""

    cases: dict[str, int]
    bad_cases: int
    good_cases: int
    failures: tuple[CaseFailure, ...]
    elapsed_s: float

    @property
    def ok(self) -> bool:
        """Every checker flagged every bad case and passed every good one."""
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        """JSON-able summary."""
        return {
            "cases": dict(self.cases),
            "bad_cases": self.bad_cases,
            "good_cases": self.good_cases,
            "failures": [str(f) for f in self.failures],
            "elapsed_s": round(self.elapsed_s, 2),
        }


def all_cases(seed: int = 0, generated: int = 30, differential: int = 400) -> list[CheckerCase]:
    """The whole catalogue: hand-written, generated, race, audit, differential."""
    return [
        *spec_cases(),
        *generated_cases(seed, generated),
        *race_cases(),
        *linearizability_cases(seed, max(generated // 5, 1) if generated else 0),
        *audit_cases(),
        *audit_generated_cases(seed, max(generated // 2, 1) if generated else 0),
        *differential_cases(seed, differential),
    ]


def run_checker_checks(
    seed: int = 0, generated: int = 30, differential: int = 400
) -> CheckerReport:
    """Show every checker its known-bad and known-good inputs; collect what it got wrong."""
    t0 = time.perf_counter()
    _stored.cache_clear()  # rows of an earlier run may have been built under a mutant
    cases = all_cases(seed, generated, differential)
    per: Counter[str] = Counter(c.checker.split(":")[0] for c in cases)
    failures = []
    for case in cases:
        try:
            ok, got = case.judge()
        except Exception as exc:  # a checker that crashes on an input got it wrong
            ok, got = False, {f"crashed: {exc!r}"[:200]}
        if not ok:
            failures.append(CaseFailure(case.checker, case.name, case.expect, tuple(sorted(got))))
    _stored.cache_clear()
    bad = sum(1 for c in cases if c.expect is not None)
    return CheckerReport(
        dict(per), bad, len(cases) - bad, tuple(failures), time.perf_counter() - t0
    )


def invariants_without_bad_case() -> list[str]:
    """Spec invariants the hand-written catalogue never shows a bad history of its own: a
    case whose bad state the real code produced (`real_code`) does not count, since that
    code may already prevent the very state the checker must flag."""
    covered = {c.expect for c in spec_cases() if not c.real_code}
    return [inv.name for inv in INVARIANTS if inv.name not in covered]


__all__ = [
    "CheckerCase",
    "CheckerReport",
    "all_cases",
    "invariants_without_bad_case",
    "run_checker_checks",
]
