"""Each spec invariant holds on a correct history and names itself on a crafted bad one."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from rollout_lifecycle.model.events import (
    ArtifactChanged,
    EntryChanged,
    MembershipChanged,
    PolicyChanged,
    TraceEvent,
    UpdateChanged,
    WorkerReported,
)
from rollout_lifecycle.model.records import (
    ActivePointer,
    ArtifactRecord,
    Disposition,
    LedgerEntry,
    Reward,
    UpdateRecord,
)
from rollout_lifecycle.spec.invariants import (
    BY_NAME,
    INVARIANTS,
    SOMETIMES,
    World,
    check,
    check_quiescent,
    check_reservation,
    check_trace,
    check_world,
    sometimes_from_events,
)
from rollout_lifecycle.stateful_tests.histories import (
    POLICY,
    REWARD,
    WORKERS,
    HandRegistry,
    churned_history,
    correct_history,
    deadline_history,
    flagged,
    forge,
    hash_mismatch_history,
    is_art,
    is_entry,
    issued,
    lineage_history,
    recounted_history,
    reserved_after_rollback,
    restamped,
    served_history,
    stamp,
    tamper,
    token,
)

Registry = HandRegistry
names = flagged


def test_correct_history_has_no_violation() -> None:
    """A correct run, checked step by step and at quiescence, violates nothing."""
    events, led, reg = correct_history()
    rep = check_trace(events, quiescent=True)
    assert rep.ok, [str(v) for v in rep.violations]
    assert rep.events == len(events) and rep.steps < rep.events
    assert set(rep.checked) == {inv.name for inv in INVARIANTS}
    assert rep.final.entries == led.snapshot()
    assert rep.final.pointer == reg.pointer
    world = World(entries=led.snapshot(), artifacts=reg.arts, pointer=reg.pointer)
    assert check(snapshot=world, trace=events, quiescent=True) == []


def test_every_sometimes_is_reachable_in_the_correct_history() -> None:
    """The correct history reaches the event-visible sometimes-properties."""
    events, _, _ = correct_history()
    hit = sometimes_from_events(events)
    assert hit >= {
        "abort_released",
        "lease_expired",
        "reward_timeout",
        "stale_retired",
        "activation_failed",
        "rollback",
        "activated",
    }
    assert hit <= set(SOMETIMES)


def test_declared_edges_violation() -> None:
    """A jump the machine does not declare (rewarded straight to consumed) is named."""
    events, _, _ = correct_history()
    ev = next(e for e in events if is_entry("r1", "reserve")(e))
    assert isinstance(ev, EntryChanged)
    bad = tamper(
        events,
        is_entry("r1", "reserve"),
        event="commit",
        after=attrs.evolve(ev.after, state="consumed", reserved_by=None),
    )
    assert "declared_edges" in names(bad)


def test_terminal_absorbing_violation() -> None:
    """Leaving a terminal state is named."""
    events, _, _ = correct_history()
    last = next(e for e in reversed(events) if is_entry("r1", "commit")(e))
    assert isinstance(last, EntryChanged)
    extra = EntryChanged(
        seq=999,
        txn=999,
        at=0.0,
        rollout_id="r1",
        event="abort",
        before=last.after,
        after=attrs.evolve(last.after, state="rewarded", revision=last.after.revision + 1),
    )
    assert "terminal_absorbing" in names([*events, extra])


def test_exactly_once_violation() -> None:
    """A commit by an update that did not reserve the rollout is named."""
    events, _, _ = correct_history()
    bad = tamper(events, is_entry("r1", "commit"), update_id="u-other")
    assert "exactly_once" in names(bad)


def test_commit_takes_all_held_violation() -> None:
    """A commit that consumes one rollout of its update while the update still holds another
    reserved (a reservation that landed after the commit read what the update held) is
    named; the correct commit of both is not."""
    events, _, _ = correct_history()
    assert "commit_takes_all_held" not in names(events)
    bad = [e for e in events if not is_entry("r2", "commit")(e)]
    assert "commit_takes_all_held" in names(bad)
    msg = next(
        v.message for v in check_trace(bad).violations if v.invariant == "commit_takes_all_held"
    )
    assert "'u1' committed ['r1'] while it also held ['r2']" in msg


def test_exclusive_ownership_violation() -> None:
    """A reserved entry without an owner (stored by a buggy backend) is named."""
    e = forge(
        LedgerEntry,
        rollout_id="x",
        behavior_version=0,
        artifact_hash="h",
        state="reserved",
        reserved_by=None,
        reward=REWARD,
        admission=stamp(0, 0),
    )
    assert "exclusive_ownership" in {v.invariant for v in check_world(World(entries={"x": e}))}


def test_revision_bump_violation() -> None:
    """A write that bumps the revision by two is named."""
    events, _, _ = correct_history()
    ev = next(e for e in events if is_entry("r2", "reserve")(e))
    assert isinstance(ev, EntryChanged)
    bad = tamper(
        events,
        is_entry("r2", "reserve"),
        after=attrs.evolve(ev.after, revision=ev.after.revision + 1),
    )
    assert "revision_bumps_by_one" in names(bad)


def test_reward_failure_with_value_violation() -> None:
    """A reward timeout stored with a reward of 0.0 (peer bug 2) is named."""
    e = LedgerEntry(
        rollout_id="x",
        behavior_version=0,
        artifact_hash="h",
        state="reward_timed_out",
        reward=Reward("rm", "1", 0.0),
        disposition=Disposition("reward", "timeout"),
    )
    got = {v.invariant for v in check_world(World(entries={"x": e}))}
    assert got == {"reward_failures_never_trained"}


def test_admitted_when_reserved_violation() -> None:
    """A reservation on a rejected or out-of-bounds admission is named (peer bugs 6 and 8)."""
    for adm in (
        attrs.evolve(stamp(0, 2, max_lag=1), freshness="stale"),
        attrs.evolve(stamp(0, 0), accepted=False, reason="policy_drift"),
        stamp(0, 0, drift=0.5),
        None,
    ):
        e = LedgerEntry(
            rollout_id="x",
            behavior_version=0,
            artifact_hash="h",
            state="reserved",
            reserved_by="u",
            reward=REWARD,
            admission=adm,
        )
        got = {v.invariant for v in check_world(World(entries={"x": e}))}
        assert got == {"admitted_when_reserved"}, adm


def test_reserved_against_current_version_violation() -> None:
    """A reservation whose lag, re-judged against the pointer of its own step, exceeds the
    bound is named, however self-consistent its stamp looks."""
    # admitted at v1 with max_lag 0 (fresh, lag 0 by its own figures)...
    ok = restamped("r4", "u3", attrs.evolve(stamp(0, 0, max_lag=0), current_version=0))
    # ...but v1 is active when it lands: lag 1 > 0
    assert "reserved_against_current_version" in names(ok)
    assert "admitted_when_reserved" not in names(ok)


def test_reservation_judged_against_the_recorded_policy() -> None:
    """A self-consistent stamp judged with a looser max_lag than the deployment's recorded
    policy, a reservation with no recorded policy, and one of a rolled-back version are
    each named: the premise is the replayed deployment state, never the stamp."""
    lax = restamped("r4", "u3", attrs.evolve(stamp(0, 1, max_lag=1000), max_drift=1e9))
    assert "reserved_against_current_version" in names(lax)
    assert "admitted_when_reserved" not in names(lax)  # the stamp agrees with itself
    no_policy = [e for e in correct_history()[0] if not isinstance(e, PolicyChanged)]
    assert "reserved_against_current_version" in names(no_policy)
    # a later reservation of a v1 rollout after v1 was rolled back (retired)
    retired = reserved_after_rollback(kept=False, admission=stamp(1, 0))
    found = [v.message for v in check_trace(retired).violations]
    assert any("rolled back (retired)" in m for m in found), found
    # the operator's explicit choice to keep the rollouts is honoured
    kept = [
        attrs.evolve(
            e,
            after=attrs.evolve(
                e.after, failure=Disposition("activation", "rolled_back_kept", "operator")
            ),
        )
        if isinstance(e, ArtifactChanged) and e.event == "roll_back"
        else e
        for e in retired
    ]
    found = [v.message for v in check_trace(kept).violations]
    assert not any("rolled back (retired)" in m for m in found), found


def test_policy_explicit_violation() -> None:
    """A policy change that does not start from the recorded one, or has no reason, or
    shares its step with other writes, is named."""
    events, _, _ = correct_history()
    is_pol = lambda e: isinstance(e, PolicyChanged)  # noqa: E731
    assert "policy_explicit" in names(tamper(events, is_pol, before=POLICY))
    assert "policy_explicit" in names(tamper(events, is_pol, reason=""))


def test_lineage_fenced_violation() -> None:
    """A version registered naming an update with no landed commit, or whose lineage
    changes later, is named; one naming an update that committed passes."""
    events, _, _ = correct_history()
    is_reg = lambda e: isinstance(e, ArtifactChanged) and e.event == "register"  # noqa: E731
    reg1 = next(e for e in events if is_reg(e) and e.version == 1)
    assert isinstance(reg1, ArtifactChanged)
    ghost = [
        attrs.evolve(e, after=attrs.evolve(e.after, trained_by=("ghost",))) if e is reg1 else e
        for e in events
    ]
    assert "lineage_fenced" in names(ghost)
    landed = [
        attrs.evolve(e, after=attrs.evolve(e.after, trained_by=("u1",))) if e is reg1 else e
        for e in events
    ]
    assert "lineage_fenced" in names(landed)  # v1's later events dropped the lineage
    consistent = [
        attrs.evolve(
            e,
            after=attrs.evolve(e.after, trained_by=("u1",)),
            before=None if e.before is None else attrs.evolve(e.before, trained_by=("u1",)),
        )
        if isinstance(e, ArtifactChanged) and e.version == 1
        else e
        for e in events
    ]
    assert "lineage_fenced" not in names(consistent)


def test_lineage_fenced_poisoned_and_claimed_violations() -> None:
    """Issue 31: a version naming an update poisoned after it landed (a refused commit),
    or an update already in another version's lineage, is named; one landed update per
    version passes; under the recorded opt-out (lineage 'off') neither is judged."""
    good = lineage_history([("u1",), ("u2",)])
    assert names(good) == set()
    assert "lineage_fenced" in names(lineage_history([("u1",)], poison="u1"))
    assert "lineage_fenced" in names(lineage_history([("u1",), ("u1", "u2")]))
    off = attrs.evolve(POLICY, lineage="off")
    is_pol = lambda e: isinstance(e, PolicyChanged)  # noqa: E731
    twice = tamper(lineage_history([("u1",), ("u1", "u2")]), is_pol, after=off)
    assert "lineage_fenced" not in names(twice)


def test_update_status_follows_violation() -> None:
    """A lost lease whose holder is not poisoned in the same step, a poisoned update moved
    back to landed, and a reservation of an update the ledger never recorded are named."""
    events, _, _ = correct_history()
    assert any(isinstance(e, UpdateChanged) for e in events)
    is_poison = lambda e: isinstance(e, UpdateChanged) and e.event == "poison"  # noqa: E731
    assert "update_status_follows" in names([e for e in events if not is_poison(e)])
    last = next(e for e in reversed(events) if is_poison(e))
    assert isinstance(last, UpdateChanged)
    back = UpdateChanged(999, 999, 0.0, "u3", "land", last.after, UpdateRecord("u3", "landed"))
    assert "update_status_follows" in names([*events, back])
    is_open = lambda e: isinstance(e, UpdateChanged) and e.update_id == "u3"  # noqa: E731
    unrecorded = [e for e in events if not is_open(e)]
    assert "update_status_follows" in names(unrecorded)


def test_poisoned_update_never_lands_violation() -> None:
    """An update that lost a lease reserving and committing again, and a commit of a
    rollout of a rolled-back version, are named."""
    events, _, _ = correct_history()
    r4 = next(e for e in reversed(events) if isinstance(e, EntryChanged) and e.rollout_id == "r4")
    held = attrs.evolve(
        r4.after,
        state="reserved",
        revision=r4.after.revision + 1,
        reserved_by="u3",
        lease_expires_at=1e3,
        admission=stamp(0, 0),
    )
    done = attrs.evolve(
        held, state="consumed", revision=held.revision + 1, reserved_by=None, lease_expires_at=None
    )
    again = [
        *events,
        EntryChanged(998, 998, 0.0, "r4", "reserve", r4.after, held, "u3"),
        EntryChanged(999, 999, 0.0, "r4", "commit", held, done, "u3"),
    ]
    assert "poisoned_update_never_lands" in names(again)
    late = reserved_after_rollback(kept=False, admission=stamp(1, 0))
    last = late[-1]
    assert isinstance(last, EntryChanged)
    spent = attrs.evolve(
        last.after,
        state="consumed",
        revision=last.after.revision + 1,
        reserved_by=None,
        lease_expires_at=None,
    )
    commit = EntryChanged(999, 999, 0.0, "late", "commit", last.after, spent, "u9")
    assert "poisoned_update_never_lands" in names([*late, commit])


def test_a_hash_the_version_never_had_is_named() -> None:
    """Issue 31 item 5: a reservation of a rollout stamped v0 with a hash v0 never had."""
    assert "reserved_against_current_version" in names(hash_mismatch_history())


def test_failures_have_stage_violation() -> None:
    """A failure recorded at the wrong stage, or with none, is named."""
    e1 = LedgerEntry(
        rollout_id="a",
        behavior_version=0,
        artifact_hash="h",
        state="update_failed",
        reward=REWARD,
        disposition=Disposition("reward", "timeout"),
    )
    e2 = LedgerEntry(
        rollout_id="b", behavior_version=0, artifact_hash="h", state="generation_failed"
    )
    vs = check_world(World(entries={"a": e1, "b": e2}))
    # b also ended without a cause: not accounted for (issue 21's invariant names it too)
    assert sorted(v.invariant for v in vs) == [
        "dispatched_accounted_for",
        "failures_have_stage",
        "failures_have_stage",
    ]


def test_pointer_names_active_artifact_violation() -> None:
    """A pointer naming an uncommitted artifact (peer bug 3) is named."""
    art = ArtifactRecord(version=1, artifact_hash=None)
    w = World(artifacts={1: art}, pointer=ActivePointer(1, "h1"))
    assert "pointer_names_active_artifact" in {v.invariant for v in check_world(w)}


def test_activation_needs_all_acks_violation() -> None:
    """Activation judged on the STORED reports and the durable worker set: a stale ack (peer
    bug 12), an ack of an earlier attempt, no recorded membership, each is named; what the
    activator claims in its own event does not count."""

    def is_report(w: str, v: int) -> Any:
        return lambda e: isinstance(e, WorkerReported) and e.worker_id == w and e.ack.version == v

    events, _, _ = correct_history()
    # w1's report of v1 never stored: it still reports v0 when v1 activates
    stale = [e for e in events if not is_report(WORKERS[1], 1)(e)]
    assert "activation_needs_all_acks" in names(stale)
    ev = next(e for e in events if is_report(WORKERS[0], 1)(e))
    assert isinstance(ev, WorkerReported) and ev.ack is not None
    old_attempt = tamper(
        events, is_report(WORKERS[0], 1), ack=attrs.evolve(ev.ack, token=token(1, 0, WORKERS[0]))
    )
    assert "activation_needs_all_acks" in names(old_attempt)
    no_token = tamper(events, is_report(WORKERS[0], 1), ack=attrs.evolve(ev.ack, token=None))
    assert "activation_needs_all_acks" in names(no_token)
    # the worker's ack of attempt 1 stays current only while the attempt does
    attempt_2 = tamper(events, is_art(1, "distribute"), tokens=issued(1, 2))
    assert "activation_needs_all_acks" in names(attempt_2)
    no_members = [e for e in events if not isinstance(e, MembershipChanged)]
    assert "activation_needs_all_acks" in names(no_members)
    # the activator's own claim of acks is not evidence
    claimed = tamper(events, is_art(1, "activate"), acks=())
    assert "activation_needs_all_acks" not in names(claimed)


def test_distributed_newer_than_active_violation() -> None:
    """Distributing a version no newer than the active one is named."""
    events, _, _ = correct_history()
    bad = tamper(events, is_art(2, "distribute"), pointer_before=ActivePointer(2, "h2"))
    assert "distributed_newer_than_active" in names(bad)


def test_membership_explicit_violation() -> None:
    """An empty worker set, or a change that does not start from the recorded one, is named."""
    events, _, _ = correct_history()
    empty = tamper(events, lambda e: isinstance(e, MembershipChanged), after=())
    assert "membership_explicit" in names(empty)
    unrecorded = tamper(events, lambda e: isinstance(e, MembershipChanged), before=("x",))
    assert "membership_explicit" in names(unrecorded)


def test_pointer_monotonic_violation() -> None:
    """A pointer that moves back without an explicit rollback is named."""
    events, _, _ = correct_history()
    ev = next(e for e in events if is_art(0, "reinstate")(e))
    bad = tamper(events, is_art(0, "reinstate"), event="activate")
    assert "pointer_monotonic" in names(bad)
    assert isinstance(ev, ArtifactChanged)


def test_failed_activation_keeps_pointer_violation() -> None:
    """A failed activation that moved the pointer is named."""
    events, _, _ = correct_history()
    bad = tamper(events, is_art(2, "fail_distribution"), pointer_after=ActivePointer(2, "h2"))
    assert "failed_activation_keeps_pointer" in names(bad)


def test_never_active_never_consumed_violation() -> None:
    """Consuming a rollout of a version that never became active (peer bugs 5, 11) is named."""
    e = LedgerEntry(
        rollout_id="x",
        behavior_version=2,
        artifact_hash="h2",
        state="consumed",
        reward=REWARD,
        admission=stamp(2, 2),
    )
    arts = {
        0: ArtifactRecord(version=0, artifact_hash="h0", state="active"),
        2: ArtifactRecord(
            version=2,
            artifact_hash="h2",
            state="distribution_failed",
            failure=Disposition("distribution", "missing_worker_ack"),
        ),
    }
    w = World(entries={"x": e}, artifacts=arts, pointer=ActivePointer(0, "h0"))
    assert {v.invariant for v in check_world(w)} == {"never_active_never_consumed"}


def test_artifact_immutable_violation() -> None:
    """A committed artifact whose hash changes, or a version registered twice, is named."""
    events, _, _ = correct_history()
    ev = next(e for e in events if is_art(1, "distribute")(e))
    assert isinstance(ev, ArtifactChanged)
    bad = tamper(
        events, is_art(1, "distribute"), after=attrs.evolve(ev.after, artifact_hash="other")
    )
    assert "artifact_immutable" in names(bad)
    again = next(e for e in events if is_art(1, "register")(e))
    assert "declared_edges" in names([*events, again])


def test_liveness_violations_at_quiescence() -> None:
    """A reservation or activation still pending at quiescence is named."""
    e = LedgerEntry(
        rollout_id="x",
        behavior_version=0,
        artifact_hash="h",
        state="reserved",
        reserved_by="u",
        reward=REWARD,
        admission=stamp(0, 0),
    )
    arts = {0: ArtifactRecord(version=0, artifact_hash="h0", state="awaiting_acks")}
    got = {v.invariant for v in check_quiescent(World(entries={"x": e}, artifacts=arts))}
    assert got == {"reservations_resolve", "activations_resolve"}


def test_failed_version_quarantined_violation() -> None:
    """A rollout of a version that failed activation, still open at quiescence (bug 5), is named."""
    e = LedgerEntry(
        rollout_id="x", behavior_version=2, artifact_hash="h2", state="rewarded", reward=REWARD
    )
    arts = {
        0: ArtifactRecord(version=0, artifact_hash="h0", state="active"),
        2: ArtifactRecord(
            version=2,
            artifact_hash="h2",
            state="distribution_failed",
            failure=Disposition("distribution", "timeout"),
        ),
    }
    w = World(entries={"x": e}, artifacts=arts, pointer=ActivePointer(0, "h0"))
    assert {v.invariant for v in check_quiescent(w)} == {"failed_version_quarantined"}
    assert check_world(w) == []


def test_retired_version_quarantined_violation() -> None:
    """A rollout of a rolled-back version still waiting at rest is named, unless the
    rollback recorded that the operator keeps them; a reserved one waits for its return."""
    e = LedgerEntry(
        rollout_id="x", behavior_version=2, artifact_hash="h2", state="rewarded", reward=REWARD
    )
    rolled = ArtifactRecord(
        version=2,
        artifact_hash="h2",
        state="rolled_back",
        rollback_version=1,
        failure=Disposition("activation", "rolled_back", "operator rollback"),
    )
    arts = {1: ArtifactRecord(version=1, artifact_hash="h1", state="active"), 2: rolled}
    w = World(entries={"x": e}, artifacts=arts, pointer=ActivePointer(1, "h1"))
    assert {v.invariant for v in check_quiescent(w)} == {"retired_version_quarantined"}
    kept = attrs.evolve(rolled, failure=Disposition("activation", "rolled_back_kept", "ok"))
    assert check_quiescent(attrs.evolve(w, artifacts={**arts, 2: kept})) == []
    quarantined = attrs.evolve(
        e, state="quarantined", reward=None, disposition=Disposition("activation", "retired")
    )
    assert check_quiescent(attrs.evolve(w, entries={"x": quarantined})) == []


def test_reservation_outcome_checks() -> None:
    """check_reservation names a lost idempotency, a failed CAS that wrote, and a bad success."""
    held = LedgerEntry(
        rollout_id="x",
        behavior_version=0,
        artifact_hash="h",
        state="reserved",
        revision=3,
        reserved_by="u1",
        reward=REWARD,
        admission=stamp(0, 0),
    )
    free = attrs.evolve(held, state="rewarded", reserved_by=None, revision=2, admission=None)
    assert check_reservation(held, "u1", True, "idempotent_retry", held) == []
    got = check_reservation(held, "u1", False, "revision_conflict", held)
    assert [v.invariant for v in got] == ["idempotent_retry"]
    bumped = attrs.evolve(held, revision=4)
    assert [v.invariant for v in check_reservation(held, "u1", True, "reserved", bumped)] == [
        "idempotent_retry"
    ]
    assert check_reservation(free, "u2", False, "revision_conflict", free) == []
    assert [
        v.invariant for v in check_reservation(free, "u2", False, "revision_conflict", held)
    ] == ["failed_cas_changes_nothing"]
    assert check_reservation(free, "u1", True, "reserved", held) == []
    twice = attrs.evolve(held, revision=4)
    assert [v.invariant for v in check_reservation(free, "u1", True, "reserved", twice)] == [
        "revision_bumps_by_one"
    ]


def test_ledger_only_trace_skips_activation_invariants() -> None:
    """Without registry events the activation invariants are not claimed as checked."""
    _, led, _ = correct_history()
    rep = check_trace(led.history())
    groups = {BY_NAME[n].group for n in rep.checked}
    assert "activation" not in groups and rep.ok


def test_check_needs_input() -> None:
    """check() with neither a snapshot nor a trace is a ValueError."""
    with pytest.raises(ValueError):
        check()


_churned_history = churned_history


def test_acks_bound_to_attempt_violation() -> None:
    """Tokens come from attempts and joins only, one fresh one per worker, and leaving voids
    a worker's ack: each way of breaking that is named."""
    events, _, _ = correct_history()
    assert "acks_bound_to_attempt" in names(tamper(events, is_art(1, "distribute"), tokens=()))
    partial = tamper(events, is_art(1, "distribute"), tokens=issued(1, 1, WORKERS[:1]))
    assert "acks_bound_to_attempt" in names(partial)
    shared = tuple(attrs.evolve(t, token="same") for t in issued(1, 1))
    assert "acks_bound_to_attempt" in names(tamper(events, is_art(1, "distribute"), tokens=shared))
    by_commit = tamper(events, is_art(1, "commit_artifact"), tokens=issued(1, 1))
    assert "acks_bound_to_attempt" in names(by_commit)

    def is_report(w: str, v: int) -> Any:
        return lambda e: isinstance(e, WorkerReported) and e.worker_id == w and e.ack.version == v

    ev = next(e for e in events if is_report(WORKERS[0], 1)(e))
    assert isinstance(ev, WorkerReported) and ev.ack is not None
    forged = tamper(events, is_report(WORKERS[0], 1), ack=attrs.evolve(ev.ack, token="forged"))
    assert "acks_bound_to_attempt" in names(forged)
    # the correct churn: w2's ack voided when it leaves, a fresh token when it re-joins; the
    # activation then lacks w2's fresh ack, which activation_needs_all_acks names
    ok = names(_churned_history(void=True, fresh=True))
    assert "acks_bound_to_attempt" not in ok and "activation_needs_all_acks" in ok
    assert "acks_bound_to_attempt" in names(_churned_history(void=False, fresh=True))


def test_a_token_counted_again_after_a_later_report_is_named() -> None:
    """Issue 31 item 3: w0's v1 ack is counted, w0 then reports v0, and a network duplicate
    of the v1 ack is stored again (numbered by arrival, so "newer"): the token counted twice
    is named, and only then; the spec's replay marks the token spent, as the store does."""
    got = check_trace(recounted_history(recount=True)).violations
    msgs = [v.message for v in got if v.invariant == "acks_bound_to_attempt"]
    assert any("counted token" in m and "again" in m for m in msgs), [str(v) for v in got]
    assert check_trace(recounted_history(recount=False)).ok
    final = check_trace(recounted_history(recount=False)).final
    assert final.tokens[(1, WORKERS[0])].spent and final.tokens[(1, WORKERS[1])].spent


def test_ack_deadline_respected_violation() -> None:
    """An attempt failed for a passed deadline before its recorded deadline, or an attempt
    whose deadline is not after its own time, is named; failing at the deadline is fine."""
    assert "ack_deadline_respected" in names(deadline_history(failed_at=50.0))
    assert "ack_deadline_respected" in names(deadline_history(failed_at=150.0, deadline=5.0))
    assert "ack_deadline_respected" not in names(deadline_history(failed_at=100.0))
    assert check_trace(deadline_history(failed_at=100.0)).ok


def test_activation_on_an_ack_from_before_leaving_is_named() -> None:
    """Even if the leave step kept w2's ack and its re-join reissued the same token (so the
    token matches), the spec knows the ack predates a membership change that voided it."""
    got = check_trace(_churned_history(void=False, fresh=False)).violations
    msgs = [v.message for v in got if v.invariant == "activation_needs_all_acks"]
    assert any("membership change removed it" in m for m in msgs), msgs


def test_history_from_before_attempt_tokens_is_judged_by_attempt_number() -> None:
    """Events stored before attempt tokens existed (no `tokens` field) are read as such: the
    activation is judged by the attempt number its acks echo, as it was then."""
    from rollout_lifecycle.model.events import event_from_jsonable, event_to_jsonable

    def legacy(ev: TraceEvent) -> TraceEvent:
        data = event_to_jsonable(ev)
        data.pop("tokens", None)
        if data.get("ack"):
            data["ack"].pop("token", None)
        for a in data.get("acks", ()):
            a.pop("token", None)
        return event_from_jsonable(data)

    events, _, _ = correct_history()
    old = [legacy(e) for e in events]
    assert all(e.tokens is None for e in old if isinstance(e, ArtifactChanged | MembershipChanged))
    rep = check_trace(old)
    assert rep.ok, [str(v) for v in rep.violations]

    def is_report(w: str, v: int) -> Any:
        return lambda e: isinstance(e, WorkerReported) and e.worker_id == w and e.ack.version == v

    ev = next(e for e in old if is_report(WORKERS[0], 1)(e))
    assert isinstance(ev, WorkerReported) and ev.ack is not None
    wrong = tamper(old, is_report(WORKERS[0], 1), ack=attrs.evolve(ev.ack, attempt=0))
    assert "activation_needs_all_acks" in names(wrong)


def test_served_after_sync_violation() -> None:
    """A worker naming itself in its rollout ids (`<worker>@<incarnation>/...`, the
    activation drill) serves only what it reported holding in that incarnation: a restarted
    worker serving before it resynced is named. (tests/test_activation_drill.py has more.)"""
    assert check_trace(served_history(False)).ok
    got = check_trace(served_history(True))
    assert {v.invariant for v in got.violations} == {"served_after_sync"}


def test_dispatch_paced_violations() -> None:
    """A paced run is clean; a dispatch past the full budget, a second live attempt of a
    chain, an attempt past max_attempts or a chain redone after it trained are named."""
    from rollout_lifecycle.stateful_tests.histories import dispatched_event, paced_history

    good = paced_history()
    assert check_trace(good).ok
    for extra in (
        dispatched_event("d1", 2, "p4", 1),  # budget (1 + 1) x 1 already full
        dispatched_event("b3", 2, "p2", 3),  # p2's second attempt is live; 3 > max 2
        dispatched_event("a2", 2, "p1", 2),  # p1 trained already
    ):
        got = {v.invariant for v in check_trace([*good, extra]).violations}
        assert got == {"dispatch_paced"}, (extra.rollout_id, got)


def test_dispatched_accounted_for_violation() -> None:
    """A rollout that ended (not consumed) without a recorded cause is named."""
    from rollout_lifecycle.stateful_tests.histories import forge

    gone = forge(
        LedgerEntry,
        rollout_id="x",
        behavior_version=0,
        artifact_hash="h",
        state="retired_stale",
        disposition=forge(Disposition, stage="admission", cause="", detail=""),
    )
    assert "dispatched_accounted_for" in {
        v.invariant for v in check_world(World(entries={"x": gone}))
    }


def test_every_invariant_has_a_negative_test() -> None:
    """Each named invariant in the spec is exercised by a violation test in this module."""
    import pathlib

    src = pathlib.Path(__file__).read_text()
    for inv in INVARIANTS:
        assert f'"{inv.name}"' in src.split("def test_every_invariant_has_a_negative_test")[0], (
            inv.name
        )
