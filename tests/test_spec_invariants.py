"""Each spec invariant holds on a correct history and names itself on a crafted bad one."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from rollout_lifecycle.model.events import (
    ArtifactChanged,
    EntryChanged,
    EventLog,
    MembershipChanged,
    TraceEvent,
    WorkerReported,
)
from rollout_lifecycle.model.ledger import ManualClock, MemoryLedger
from rollout_lifecycle.model.records import (
    ActivePointer,
    AdmissionStamp,
    ArtifactRecord,
    Disposition,
    LedgerEntry,
    Reward,
    WorkerAck,
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

WORKERS = ("w1", "w2")
REWARD = Reward("rm", "1", 0.5)


def stamp(bv: int, cv: int, max_lag: int = 1, drift: float = 0.01) -> AdmissionStamp:
    return AdmissionStamp(
        current_version=cv,
        behavior_version=bv,
        max_lag=max_lag,
        max_drift=0.2,
        drift=drift,
        freshness="fresh" if bv == cv else "tolerated",
        reason="ok",
        accepted=True,
    )


class Registry:
    """A hand-driven registry that emits correct ArtifactChanged events into a shared log."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.arts: dict[int, ArtifactRecord] = {}
        self.pointer: ActivePointer | None = None
        self.seq = 0
        self.log.record([MembershipChanged(0, 0, 0.0, None, WORKERS, "initial membership")])

    def report(self, v: int, h: str) -> None:
        """Every worker's ack of (v, h) for attempt 1, as the registry stores it."""
        self.seq += 1
        for w in WORKERS:
            self.log.record([WorkerReported(0, 0, 0.0, w, 0, WorkerAck(w, v, h, 0, self.seq, 1))])

    def _emit(
        self,
        changes: list[tuple[int, str, ArtifactRecord]],
        new_ptr: Any = "same",
        acks: tuple[WorkerAck, ...] = (),
    ) -> None:
        evs: list[TraceEvent] = []
        pb = self.pointer
        pa = pb if new_ptr == "same" else new_ptr
        for v, ev, after in changes:
            evs.append(
                ArtifactChanged(
                    seq=0,
                    txn=0,
                    at=0.0,
                    version=v,
                    event=ev,
                    before=self.arts.get(v),
                    after=after,
                    pointer_before=pb,
                    pointer_after=pa,
                    acks=acks,
                    required_workers=WORKERS,
                )
            )
            self.arts[v] = after
        self.pointer = pa
        self.log.record(evs)

    def activate(self, v: int) -> None:
        h = f"h{v}"
        rb = None if self.pointer is None else self.pointer.version
        self._emit(
            [(v, "register", ArtifactRecord(version=v, artifact_hash=None, rollback_version=rb))]
        )
        a = self.arts[v]
        self._emit([(v, "commit_artifact", attrs.evolve(a, state="committed", artifact_hash=h))])
        self._emit(
            [(v, "distribute", attrs.evolve(self.arts[v], state="awaiting_acks", attempts=1))]
        )
        self.report(v, h)
        acks = tuple(WorkerAck(w, v, h, 0, self.seq, 1) for w in WORKERS)
        changes = [(v, "activate", attrs.evolve(self.arts[v], state="active"))]
        if self.pointer is not None:
            old = self.pointer.version
            changes.append((old, "supersede", attrs.evolve(self.arts[old], state="superseded")))
        self._emit(changes, ActivePointer(v, h), acks)

    def rollback(self) -> None:
        assert self.pointer is not None
        cur = self.arts[self.pointer.version]
        assert cur.rollback_version is not None
        tgt = self.arts[cur.rollback_version]
        assert tgt.artifact_hash is not None
        self._emit(
            [
                (cur.version, "roll_back", attrs.evolve(cur, state="rolled_back")),
                (tgt.version, "reinstate", attrs.evolve(tgt, state="active")),
            ],
            ActivePointer(tgt.version, tgt.artifact_hash),
        )

    def fail(self, v: int) -> None:
        h = f"h{v}"
        self._emit([(v, "register", ArtifactRecord(version=v, artifact_hash=None))])
        self._emit(
            [(v, "commit_artifact", attrs.evolve(self.arts[v], state="committed", artifact_hash=h))]
        )
        self._emit([(v, "distribute", attrs.evolve(self.arts[v], state="awaiting_acks"))])
        self._emit(
            [
                (
                    v,
                    "fail_distribution",
                    attrs.evolve(
                        self.arts[v],
                        state="distribution_failed",
                        failure=Disposition("distribution", "missing_worker_ack"),
                    ),
                )
            ]
        )


def rewarded(led: MemoryLedger, rid: str, v: int) -> None:
    led.add(LedgerEntry(rollout_id=rid, behavior_version=v, artifact_hash=f"h{v}"))
    led.transition(rid, "generation_done", 0)
    led.transition(rid, "reward_ready", 1, reward=REWARD)


def correct_history() -> tuple[list[TraceEvent], MemoryLedger, Registry]:
    """A run touching every protocol path, written through the real MemoryLedger."""
    log = EventLog()
    clock = ManualClock()
    led = MemoryLedger(clock=clock, lease_seconds=10, event_log=log)
    reg = Registry(log)
    reg.activate(0)
    for rid in ("r1", "r2", "r4", "r5"):
        rewarded(led, rid, 0)
    led.add(LedgerEntry(rollout_id="r3", behavior_version=0, artifact_hash="h0"))
    led.transition("r3", "generation_done", 0)
    led.transition("r3", "reward_timeout", 1)
    assert led.reserve("r1", 2, "u1", stamp(0, 0)).reserved
    assert led.reserve("r2", 2, "u1", stamp(0, 0)).reserved
    led.commit("u1", ["r1", "r2"])
    assert led.reserve("r4", 2, "u2", stamp(0, 0)).reserved
    led.abort("u2")
    reg.activate(1)
    assert led.reserve("r4", 4, "u3", stamp(0, 1)).reserved
    clock.advance(11)
    led.expire_leases()
    led.transition("r5", "retire_stale", 2, disposition=Disposition("admission", "stale"))
    reg.fail(2)
    led.add(LedgerEntry(rollout_id="r6", behavior_version=2, artifact_hash="h2"))
    led.quarantine_version(2, "distribution failed")
    reg.rollback()
    return log.events(), led, reg


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


def forge(cls: type[Any], **fields: Any) -> Any:
    """Build a record WITHOUT its validators, to craft states a buggy backend might store."""
    obj = object.__new__(cls)
    base = {
        f.name: f.default
        for f in attrs.fields(cls)
        if f.default is not attrs.NOTHING and not isinstance(f.default, attrs.Factory)
    }
    base.update(fields)
    for k, v in base.items():
        object.__setattr__(obj, k, v)
    return obj


def names(events: list[TraceEvent], **kw: Any) -> set[str]:
    return {v.invariant for v in check_trace(events, **kw).violations}


def tamper(events: list[TraceEvent], pred: Any, **changes: Any) -> list[TraceEvent]:
    """Replace the first event matching `pred` by a copy with `changes`."""
    out = list(events)
    for i, ev in enumerate(out):
        if pred(ev):
            out[i] = attrs.evolve(ev, **changes)
            return out
    raise AssertionError("no event matched")


def is_entry(rid: str, event: str) -> Any:
    return lambda e: isinstance(e, EntryChanged) and e.rollout_id == rid and e.event == event


def is_art(v: int, event: str) -> Any:
    return lambda e: isinstance(e, ArtifactChanged) and e.version == v and e.event == event


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
    events, _, _ = correct_history()
    ev = next(e for e in events if is_entry("r4", "reserve")(e) and e.update_id == "u3")
    assert isinstance(ev, EntryChanged)
    # admitted at v1 with max_lag 0 (fresh, lag 0 by its own figures)...
    fresh = attrs.evolve(stamp(0, 0, max_lag=0), current_version=0)
    ok = [
        attrs.evolve(e, after=attrs.evolve(ev.after, admission=fresh)) if e is ev else e
        for e in events
    ]
    # ...but v1 is active when it lands: lag 1 > 0
    assert "reserved_against_current_version" in names(ok)
    assert "admitted_when_reserved" not in names(ok)


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
    assert [v.invariant for v in vs] == ["failures_have_stage"] * 2


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
    old_attempt = tamper(events, is_report(WORKERS[0], 1), ack=attrs.evolve(ev.ack, attempt=0))
    assert "activation_needs_all_acks" in names(old_attempt)
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


def test_every_invariant_has_a_negative_test() -> None:
    """Each named invariant in the spec is exercised by a violation test in this module."""
    import pathlib

    src = pathlib.Path(__file__).read_text()
    for inv in INVARIANTS:
        assert f'"{inv.name}"' in src.split("def test_every_invariant_has_a_negative_test")[0], (
            inv.name
        )
