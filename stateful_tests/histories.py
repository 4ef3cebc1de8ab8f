"""Hand-built and generated protocol histories: the known-good and known-bad inputs that
every checker must pass and flag.

A correct history is written through the real MemoryLedger (so its entry events are what a
ledger emits) and a hand-driven registry that emits exactly the activation events a correct
coordinator would (so a bad one can be crafted event by event, with no coordinator in the
way). Bad histories are correct ones with one event tampered: the checker must name the
rule the tampering breaks. The spec's unit tests and the campaign's checker stage both use
these, so a checker is never trusted on good input alone.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from rollout_lifecycle.model.errors import CommitMismatch
from rollout_lifecycle.model.events import (
    ArtifactChanged,
    EntryChanged,
    EventLog,
    MembershipChanged,
    PolicyChanged,
    TraceEvent,
    WorkerReported,
)
from rollout_lifecycle.model.ledger import ManualClock, MemoryLedger
from rollout_lifecycle.model.records import (
    ActivePointer,
    AdmissionPolicy,
    AdmissionStamp,
    ArtifactRecord,
    AttemptToken,
    BehaviorPolicy,
    Disposition,
    GenerationConditions,
    LedgerEntry,
    Reward,
    Rollout,
    RolloutIdentity,
    WorkerAck,
)
from rollout_lifecycle.spec.invariants import check_trace

WORKERS = ("w1", "w2")
POLICY = AdmissionPolicy(max_lag=1, max_drift=0.2)
REWARD = Reward("rm", "1", 0.5)

Pred = Callable[[TraceEvent], bool]


def freshness(lag: int, max_lag: int) -> str:
    """The freshness class CONTRACT section 3 gives a lag (for building stamps)."""
    return (
        "future" if lag < 0 else "fresh" if lag == 0 else "tolerated" if lag <= max_lag else "stale"
    )


def stamp(bv: int, cv: int, max_lag: int = 1, drift: float = 0.01) -> AdmissionStamp:
    """An accepted stamp for a rollout of v`bv` judged while v`cv` was active."""
    lag = cv - bv
    return AdmissionStamp(
        current_version=cv,
        behavior_version=bv,
        max_lag=max_lag,
        max_drift=0.2,
        drift=drift,
        freshness="fresh" if lag == 0 else "tolerated",
        reason="ok",
        accepted=True,
    )


def token(v: int, attempt: int, w: str) -> str:
    """The attempt token the hand-driven registry issues to `w` (distinct per attempt)."""
    return f"t{v}.{attempt}.{w}"


def issued(v: int, attempt: int, workers: tuple[str, ...] = WORKERS) -> tuple[AttemptToken, ...]:
    """The tokens a distribution attempt of `v` issues, one per worker."""
    return tuple(AttemptToken(v, w, attempt, token(v, attempt, w)) for w in workers)


class HandRegistry:
    """A hand-driven registry that emits correct activation events into a shared log."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.arts: dict[int, ArtifactRecord] = {}
        self.pointer: ActivePointer | None = None
        self.seq = 0
        self.log.record([MembershipChanged(0, 0, 0.0, None, WORKERS, "initial membership")])
        self.log.record([PolicyChanged(0, 0, 0.0, None, POLICY, "initial policy")])

    def report(self, v: int, h: str) -> None:
        """Every worker's ack of (v, h) for attempt 1, echoing its token, as stored."""
        self.seq += 1
        for w in WORKERS:
            ack = WorkerAck(w, v, h, 0, self.seq, 1, token(v, 1, w))
            self.log.record([WorkerReported(0, 0, 0.0, w, 0, ack)])

    def emit(
        self,
        changes: list[tuple[int, str, ArtifactRecord]],
        new_ptr: Any = "same",
        acks: tuple[WorkerAck, ...] = (),
        tokens: tuple[AttemptToken, ...] = (),
        at: float = 0.0,
    ) -> None:
        """One registry step at time `at`: these artifact changes, and the pointer after it."""
        evs: list[TraceEvent] = []
        pb = self.pointer
        pa = pb if new_ptr == "same" else new_ptr
        for v, ev, after in changes:
            evs.append(
                ArtifactChanged(
                    seq=0,
                    txn=0,
                    at=at,
                    version=v,
                    event=ev,
                    before=self.arts.get(v),
                    after=after,
                    pointer_before=pb,
                    pointer_after=pa,
                    acks=acks,
                    required_workers=WORKERS,
                    tokens=tokens,
                )
            )
            self.arts[v] = after
        self.pointer = pa
        self.log.record(evs)

    def stage(self, v: int, trained_by: tuple[str, ...] = ()) -> None:
        """Register (with lineage `trained_by`), commit and distribute v (attempt 1): it
        awaits acks."""
        rb = None if self.pointer is None else self.pointer.version
        rec = ArtifactRecord(
            version=v, artifact_hash=None, rollback_version=rb, trained_by=trained_by
        )
        self.emit([(v, "register", rec)])
        a = self.arts[v]
        self.emit(
            [(v, "commit_artifact", attrs.evolve(a, state="committed", artifact_hash=f"h{v}"))]
        )
        self.emit(
            [(v, "distribute", attrs.evolve(self.arts[v], state="awaiting_acks", attempts=1))],
            tokens=issued(v, 1),
        )

    def activate(self, v: int, trained_by: tuple[str, ...] = ()) -> None:
        """Take v through register, commit, distribute, every ack, activate."""
        h = f"h{v}"
        self.stage(v, trained_by)
        self.report(v, h)
        acks = tuple(WorkerAck(w, v, h, 0, self.seq, 1, token(v, 1, w)) for w in WORKERS)
        changes = [(v, "activate", attrs.evolve(self.arts[v], state="active"))]
        if self.pointer is not None:
            old = self.pointer.version
            changes.append((old, "supersede", attrs.evolve(self.arts[old], state="superseded")))
        self.emit(changes, ActivePointer(v, h), acks)

    def rollback(self, kept: bool = False) -> None:
        """Roll the active version back to its recorded rollback version."""
        assert self.pointer is not None
        cur = self.arts[self.pointer.version]
        assert cur.rollback_version is not None
        tgt = self.arts[cur.rollback_version]
        assert tgt.artifact_hash is not None
        cause = "rolled_back_kept" if kept else "rolled_back"
        self.emit(
            [
                (
                    cur.version,
                    "roll_back",
                    attrs.evolve(
                        cur,
                        state="rolled_back",
                        failure=Disposition("activation", cause, "operator rollback"),
                    ),
                ),
                (tgt.version, "reinstate", attrs.evolve(tgt, state="active")),
            ],
            ActivePointer(tgt.version, tgt.artifact_hash),
        )

    def fail(self, v: int) -> None:
        """Stage v, then fail its distribution: no ack arrived."""
        self.stage(v)
        failed = attrs.evolve(
            self.arts[v],
            state="distribution_failed",
            failure=Disposition("distribution", "missing_worker_ack"),
        )
        self.emit([(v, "fail_distribution", failed)])


def rewarded(led: MemoryLedger, rid: str, v: int) -> None:
    """Add a rollout of v and take it to rewarded."""
    led.add(LedgerEntry(rollout_id=rid, behavior_version=v, artifact_hash=f"h{v}"))
    led.transition(rid, "generation_done", 0)
    led.transition(rid, "reward_ready", 1, reward=REWARD)


def correct_history() -> tuple[list[TraceEvent], MemoryLedger, HandRegistry]:
    """A run touching every protocol path, written through the real MemoryLedger."""
    log = EventLog()
    clock = ManualClock()
    led = MemoryLedger(clock=clock, lease_seconds=10, event_log=log)
    reg = HandRegistry(log)
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


def lineage_history(
    lineages: Sequence[tuple[str, ...]], *, poison: str | None = None
) -> list[TraceEvent]:
    """u1 and u2 each reserve and commit one rollout of v0 through the real MemoryLedger
    (both land); `poison`'s next commit names a rollout it never reserved (CommitMismatch:
    the ledger records it poisoned); then versions 1, 2, ... are activated by hand, each
    recording the lineage given for it."""
    log = EventLog()
    led = MemoryLedger(clock=ManualClock(), event_log=log)
    reg = HandRegistry(log)
    reg.activate(0)
    for rid, uid in (("a", "u1"), ("b", "u2")):
        rewarded(led, rid, 0)
        assert led.reserve(rid, 2, uid, stamp(0, 0)).reserved
        led.commit(uid, [rid])
    if poison is not None:
        try:
            led.commit(poison, ["never-reserved"])
        except CommitMismatch:
            pass
        else:  # pragma: no cover - the ledger must refuse it
            raise AssertionError("a commit of an unreserved rollout landed")
    for v, lineage in enumerate(lineages, 1):
        reg.activate(v, lineage)
    return log.events()


def hash_mismatch_history() -> list[TraceEvent]:
    """v0 (hash h0) active; a rollout stamped v0 with a hash v0 never had is added and
    reserved through a MemoryLedger that sees no registry (so nothing refuses it)."""
    log = EventLog()
    led = MemoryLedger(clock=ManualClock(), event_log=log)
    reg = HandRegistry(log)
    reg.activate(0)
    led.add(LedgerEntry(rollout_id="x", behavior_version=0, artifact_hash="h-never"))
    led.transition("x", "generation_done", 0)
    led.transition("x", "reward_ready", 1, reward=REWARD)
    assert led.reserve("x", 2, "u1", stamp(0, 0)).reserved
    return log.events()


def restamped(rid: str, update: str, admission: AdmissionStamp) -> list[TraceEvent]:
    """The correct history with the stamp stored by `update`'s reservation of `rid`
    replaced (a reservation judged against another premise than the one it claims)."""
    events = correct_history()[0]
    ev = next(
        e
        for e in events
        if isinstance(e, EntryChanged) and is_entry(rid, "reserve")(e) and e.update_id == update
    )
    new = attrs.evolve(ev, after=attrs.evolve(ev.after, admission=admission))
    return [new if e is ev else e for e in events]


def reserved_after_rollback(*, kept: bool, admission: AdmissionStamp) -> list[TraceEvent]:
    """v0 then v1 activate, a v1 rollout is rewarded, v1 is rolled back (retiring its
    rollouts, or `kept`), then the rollout is reserved with `admission`, forged past the
    ledger as a buggy write path would store it."""
    log = EventLog()
    led = MemoryLedger(clock=ManualClock(), event_log=log)
    reg = HandRegistry(log)
    reg.activate(0)
    reg.activate(1)
    rewarded(led, "late", 1)
    reg.rollback(kept=kept)
    before = led.get("late")
    fields = attrs.asdict(before, recurse=False)
    fields.update(state="reserved", revision=3, reserved_by="u9", admission=admission)
    log.record(
        [EntryChanged(0, 0, 0.0, "late", "reserve", before, forge(LedgerEntry, **fields), "u9")]
    )
    return log.events()


def random_history(rng: random.Random, steps: int = 40) -> list[TraceEvent]:
    """A correct history of random shape: rollouts of the active version are added and
    rewarded, reserved by updates (single or several), committed or aborted, leases
    expire, new versions activate or fail, the active version is rolled back."""
    log = EventLog()
    clock = ManualClock()
    led = MemoryLedger(clock=clock, lease_seconds=10, event_log=log)
    reg = HandRegistry(log)
    reg.activate(0)
    next_v, n, u = 1, 0, 0
    held: dict[str, list[str]] = {}
    for _ in range(steps):
        assert reg.pointer is not None
        pv = reg.pointer.version
        op = rng.choice(("add", "add", "reserve", "reserve", "settle", "version", "other"))
        if op == "add":
            rid = f"r{n}"
            n += 1
            rewarded(led, rid, pv)
        elif op == "reserve":
            ready = [
                e
                for e in led.snapshot().values()
                if e.state == "rewarded"
                and reg.arts[e.behavior_version].state in ("active", "superseded")
                and 0 <= pv - e.behavior_version <= POLICY.max_lag
                and reg.arts[e.behavior_version].state != "rolled_back"
            ]
            if ready:
                uid = f"u{u}"
                u += 1
                for e in rng.sample(ready, min(len(ready), rng.randint(1, 3))):
                    if led.reserve(
                        e.rollout_id, e.revision, uid, stamp(e.behavior_version, pv)
                    ).reserved:
                        held.setdefault(uid, []).append(e.rollout_id)
        elif op == "settle" and held:
            uid = rng.choice(sorted(held))
            rids = held.pop(uid)
            if rng.random() < 0.7:
                led.commit(uid, rids)
            else:
                led.abort(uid)
        elif op == "version":
            v = next_v
            next_v += 1
            if rng.random() < 0.75:
                reg.activate(v)
            else:
                reg.fail(v)
                led.quarantine_version(v, "distribution failed")
        else:
            choice = rng.random()
            if choice < 0.4:
                clock.advance(11)
                expired = {e.rollout_id for e in led.expire_leases()}
                for uid in list(held):
                    if any(r in expired for r in held[uid]):  # poisoned: return the rest
                        led.abort(uid)
                        del held[uid]
            elif choice < 0.6 and reg.arts[pv].rollback_version is not None and not held:
                reg.rollback(kept=rng.random() < 0.3)
                failure = reg.arts[pv].failure
                if failure is not None and failure.cause == "rolled_back":
                    led.quarantine_version(pv, "rolled back")
            else:
                open_ = [e for e in led.snapshot().values() if e.state == "rewarded"]
                if open_:
                    e = rng.choice(open_)
                    led.transition(
                        e.rollout_id,
                        "retire_stale",
                        e.revision,
                        disposition=Disposition("admission", "stale"),
                    )
    for uid, rids in sorted(held.items()):
        led.commit(uid, rids)
    return log.events()


def forge(cls: type[Any], **fields: Any) -> Any:
    """Build a record WITHOUT its validators, to craft states a buggy backend might store."""
    obj = object.__new__(cls)
    base = {
        f.name: f.default
        for f in attrs.fields(cls)
        if f.default is not attrs.NOTHING and not isinstance(f.default, attrs.Factory)  # type: ignore[arg-type]
    }
    base.update(fields)
    for k, v in base.items():
        object.__setattr__(obj, k, v)
    return obj


def flagged(events: Sequence[TraceEvent], **kw: Any) -> set[str]:
    """The names of the invariants the spec says the trace violates."""
    return {v.invariant for v in check_trace(events, **kw).violations}


def tamper(events: Sequence[TraceEvent], pred: Pred, **changes: Any) -> list[TraceEvent]:
    """Replace the first event matching `pred` by a copy with `changes`."""
    out = list(events)
    for i, ev in enumerate(out):
        if pred(ev):
            out[i] = attrs.evolve(ev, **changes)
            return out
    raise AssertionError("no event matched")


def is_entry(rid: str, event: str) -> Pred:
    """Matches the rollout's entry event of this name."""
    return lambda e: isinstance(e, EntryChanged) and e.rollout_id == rid and e.event == event


def is_art(v: int, event: str) -> Pred:
    """Matches the version's artifact event of this name."""
    return lambda e: isinstance(e, ArtifactChanged) and e.version == v and e.event == event


def is_report(w: str, v: int) -> Pred:
    """Matches the worker's stored report of an ack of v."""
    return lambda e: (
        isinstance(e, WorkerReported)
        and e.worker_id == w
        and e.ack is not None
        and e.ack.version == v
    )


def churned_history(void: bool, fresh: bool) -> list[TraceEvent]:
    """v1 distributed, both workers ack it; w2 leaves and re-joins; v1 activates.

    `void`: the leave step voids w2's ack (as it must); `fresh`: w2's re-join token is new.
    """
    log = EventLog()
    reg = HandRegistry(log)
    reg.activate(0)
    reg.stage(1)
    reg.report(1, "h1")
    w2 = WORKERS[1]
    leave: list[TraceEvent] = [MembershipChanged(0, 0, 0.0, WORKERS, WORKERS[:1], "drain")]
    if void:
        leave.append(WorkerReported(0, 0, 0.0, w2, 0, None))
    log.record(leave)
    again = AttemptToken(1, w2, 1, token(1, 1, w2) + ("-new" if fresh else ""))
    log.record([MembershipChanged(0, 0, 0.0, WORKERS[:1], WORKERS, "back", tokens=(again,))])
    acks = tuple(WorkerAck(w, 1, "h1", 0, reg.seq, 1, token(1, 1, w)) for w in WORKERS)
    changes = [
        (1, "activate", attrs.evolve(reg.arts[1], state="active")),
        (0, "supersede", attrs.evolve(reg.arts[0], state="superseded")),
    ]
    reg.emit(changes, ActivePointer(1, "h1"), acks)
    return log.events()


def recounted_history(recount: bool) -> list[TraceEvent]:
    """v1 distributed; both workers ack it (w0's ack counted, its token spent); w0 then
    reports it restored v0; with `recount` a network duplicate of w0's v1 ack is stored
    again (counted a second time) and v1 activates on it while w0 holds v0."""
    log = EventLog()
    reg = HandRegistry(log)
    reg.activate(0)
    reg.stage(1)
    reg.report(1, "h1")
    w0 = WORKERS[0]
    first = WorkerAck(w0, 1, "h1", 0, reg.seq, 1, token(1, 1, w0))
    log.record([WorkerReported(0, 0, 0.0, w0, 0, WorkerAck(w0, 0, "h0", 0, reg.seq + 1))])
    if recount:
        again = attrs.evolve(first, seq=reg.seq + 2)  # numbered by arrival: a "newer" report
        log.record([WorkerReported(0, 0, 0.0, w0, 0, again)])
        acks = (again, *(WorkerAck(w, 1, "h1", 0, reg.seq, 1, token(1, 1, w)) for w in WORKERS[1:]))
        changes = [
            (1, "activate", attrs.evolve(reg.arts[1], state="active")),
            (0, "supersede", attrs.evolve(reg.arts[0], state="superseded")),
        ]
        reg.emit(changes, ActivePointer(1, "h1"), acks)
    return log.events()


def deadline_history(*, failed_at: float, deadline: float = 100.0) -> list[TraceEvent]:
    """v1 distributed at time 10 with ack deadline `deadline`; no ack arrives; the attempt
    is failed for a passed deadline ('ack_deadline_passed') at `failed_at`."""
    log = EventLog()
    reg = HandRegistry(log)
    reg.activate(0)
    reg.emit([(1, "register", ArtifactRecord(version=1, artifact_hash=None, rollback_version=0))])
    reg.emit(
        [(1, "commit_artifact", attrs.evolve(reg.arts[1], state="committed", artifact_hash="h1"))]
    )
    staged = attrs.evolve(reg.arts[1], state="awaiting_acks", attempts=1, ack_deadline=deadline)
    reg.emit([(1, "distribute", staged)], tokens=issued(1, 1), at=10.0)
    failure = Disposition("distribution", "ack_deadline_passed", "no ack by the deadline")
    failed = attrs.evolve(reg.arts[1], state="distribution_failed", failure=failure)
    reg.emit([(1, "fail_distribution", failed)], at=failed_at)
    return log.events()


def served_history(restart_first: bool) -> list[TraceEvent]:
    """A worker naming itself in its rollout ids (`<worker>@<incarnation>/<n>`, as the
    activation drill writes them) serves v0 after acking it; with `restart_first` it
    restarts (a new incarnation) and serves before it resynced: `served_after_sync`."""
    from rollout_lifecycle.model.backends import open_backend
    from rollout_lifecycle.model.coordinator import ActivationCoordinator
    from rollout_lifecycle.model.records import (
        BehaviorPolicy,
        GenerationConditions,
        Rollout,
        RolloutIdentity,
    )
    from rollout_lifecycle.model.registry import set_admission_policy

    h = "ab" * 32

    def ro(rid: str) -> Rollout:
        cond = GenerationConditions("tok", 1.0, 1.0, -1, 2)
        return Rollout(RolloutIdentity(rid, "p", "d", 0), BehaviorPolicy(0, h), cond)

    with open_backend("memory://") as be:
        set_admission_policy(be.registry, POLICY, "set by the operator")
        coord = ActivationCoordinator(be.registry, WORKERS, ledger=be.ledger, policy=POLICY)
        coord.prepare(0)
        coord.commit_artifact(0, h)
        coord.distribute(0)
        for w in WORKERS:
            coord.record_ack(WorkerAck(w, 0, h, token=coord.attempt_token(w, 0)))
        assert coord.try_activate(0).activated
        be.ledger.add(ro(f"{WORKERS[0]}@0/0"))
        if restart_first:
            coord.worker_restarted(WORKERS[0], 1)
            be.ledger.add(ro(f"{WORKERS[0]}@1/0"))
        return be.trace()


SERVED_CASES = ("synced", "stale_ack_kept", "no_restart_recorded", "other_version")


def served_trace(case: str) -> list[TraceEvent]:
    """A serving history written event by event, no coordinator in the way: v0 active, w1
    (naming itself `w1@<incarnation>/<n>` in its rollout ids) acked v0 as incarnation 0,
    then restarted as incarnation 1 and adds a rollout of v0.

    `synced`: after the restart w1 reloaded v0 and acked it as incarnation 1 (good).
    `stale_ack_kept`: the restart raised w1's floor to 1 but its stored ack is still the
    incarnation-0 ack (a coordinator that forgot to void it; the real one always does):
    incarnation 1 serves on an ack of a previous incarnation. `no_restart_recorded`: the
    restart was never reported, the incarnation-0 ack is stored, incarnation 1 serves.
    `other_version`: incarnation 0 serves v1, a version it never acked.
    """
    if case not in SERVED_CASES:
        raise ValueError(f"case must be one of {SERVED_CASES}, got {case!r}")
    log = EventLog()
    reg = HandRegistry(log)
    reg.activate(0)
    w1 = WORKERS[0]
    old = WorkerAck(w1, 0, "h0", 0, reg.seq, 1, token(0, 1, w1))
    if case == "synced":
        log.record([WorkerReported(0, 0, 0.0, w1, 1, None)])
        log.record([WorkerReported(0, 0, 0.0, w1, 1, WorkerAck(w1, 0, "h0", 1, reg.seq + 1))])
    elif case == "stale_ack_kept":
        log.record([WorkerReported(0, 0, 0.0, w1, 1, old)])
    inc, v = (0, 1) if case == "other_version" else (1, 0)
    added = LedgerEntry(rollout_id=f"{w1}@{inc}/0", behavior_version=v, artifact_hash=f"h{v}")
    log.record([EntryChanged(0, 0, 0.0, added.rollout_id, "add", None, added)])
    return log.events()


PACED = AdmissionPolicy(max_lag=1, max_drift=0.2, batch_size=1, max_attempts=2)


def paced_history() -> list[TraceEvent]:
    """A correct paced run through the real memory backend: policy (max_lag 1, batch 1,
    at most 2 attempts per chain), v0 active; chain p1 dispatched, trained; chain p2's first
    attempt goes stale after v1 and v2 and is retired with its cause, its second attempt
    runs on v2; the budget of (1 + 1) x 1 live rollouts is full at the end."""
    from rollout_lifecycle.model.backends import open_backend
    from rollout_lifecycle.model.coordinator import ActivationCoordinator
    from rollout_lifecycle.model.registry import set_admission_policy

    def activate(coord: ActivationCoordinator, v: int) -> None:
        h = f"{v:x}".rjust(64, "c")
        coord.prepare(v)
        coord.commit_artifact(v, h)
        coord.distribute(v)
        for w in WORKERS:
            coord.record_ack(WorkerAck(w, v, h, token=coord.attempt_token(w, v)))
        assert coord.try_activate(v).activated

    def ro(rid: str, v: int, prompt: str) -> Rollout:
        return Rollout(
            RolloutIdentity(rid, prompt, "d", 0),
            BehaviorPolicy(v, f"{v:x}".rjust(64, "c")),
            GenerationConditions("tok", 1.0, 1.0, -1, 8),
        )

    with open_backend("memory://") as be:
        led = be.ledger
        set_admission_policy(be.registry, PACED, "set by the operator")
        coord = ActivationCoordinator(be.registry, WORKERS, ledger=led, policy=PACED)
        activate(coord, 0)
        for rid, chain in (("a1", "p1"), ("b1", "p2")):
            assert led.dispatch(ro(rid, 0, chain)).dispatched
            led.transition(rid, "generation_done", 0, tokens=5 if rid == "a1" else 40)
            led.transition(rid, "reward_ready", 1, reward=REWARD)
        assert led.reserve("a1", 2, "u1", stamp(0, 0)).reserved
        led.commit("u1", ["a1"])
        activate(coord, 1)
        activate(coord, 2)
        assert [e.rollout_id for e in led.retire_stale()] == ["b1"]
        assert led.dispatch(ro("b2", 2, "p2")).attempt == 2
        assert led.dispatch(ro("c1", 2, "p3")).dispatched
        assert led.dispatch(ro("d1", 2, "p4")).reason == "no_capacity"
        return be.trace()


def prompt_chain(prompt: str) -> str:
    """The attempt chain the paced history's prompt `prompt` is counted on: its identity's
    (dataset 'd', sample 0), written out here as the ledger keys it (a JSON list)."""
    return f'["d", "{prompt}", 0]'


def dispatched_event(rid: str, v: int, prompt: str, attempt: int) -> EntryChanged:
    """A dispatch of `prompt` as a ledger would record it, for appending to a history by
    hand."""
    after = LedgerEntry(
        rollout_id=rid,
        behavior_version=v,
        artifact_hash=f"{v:x}".rjust(64, "c"),
        chain=prompt_chain(prompt),
        attempt=attempt,
    )
    return EntryChanged(10_000, 10_000, 0.0, rid, "add", None, after)
