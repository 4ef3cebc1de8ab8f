"""Racing learners over one ledger, as a Hypothesis rule-based machine.

A learner reserves in TWO rules: `read` takes a snapshot of one rollout (revision, state)
into the `reads` bundle, and a later `cas` reserves with the revision read. Hypothesis thus
chooses the interleaving of racing learners and, on a failure, SHRINKS it (a blind-write
ledger shrinks to five steps: a rollout arrives, is admitted and reserved by the pipeline
learner, another learner reads it and writes); real threads find such a race by luck and
never shrink it. `advance` is the healthy pipeline, one call per step; it is the rule
Hypothesis tries first, so the search starts from working programs and adds faults.

Every step is judged three ways: a reference model kept in plain dicts here (state,
revision, owner per rollout; never the planners of model/ledger.py) must match the backend's
snapshot; the spec's step and always invariants run on the new trace events, atomic step by
atomic step; and `check_reservation` judges every reserve call from the entry before and
after. The backend comes from a factory, so the same machine is the conformance kit.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

import rollout_lifecycle.model.gate as gate_mod
from rollout_lifecycle.model.errors import CommitMismatch, IllegalTransition, RevisionConflict
from rollout_lifecycle.model.ledger import DIRECT_EVENTS, Ledger, ManualClock, RecoveryRule
from rollout_lifecycle.model.machines import LIFECYCLE
from rollout_lifecycle.model.records import AdmissionStamp, Disposition, LedgerEntry, Rollout
from rollout_lifecycle.spec.invariants import World, check_reservation
from rollout_lifecycle.stateful_tests.backends import LedgerFactory, reopener, resolve_factory
from rollout_lifecycle.stateful_tests.builders import (
    CONDITIONS,
    EVIDENCE_KINDS,
    REWARD,
    artifact_hash,
    corrupt_hash,
    current_log_probs,
    expected_reason,
    make_rollout,
)
from rollout_lifecycle.stateful_tests.recording import (
    RESERVATION_NAMES,
    Recorder,
    TraceChecker,
    check_snapshot,
    counted,
    raise_violations,
)

LEASE = 10.0
MAX_RELEASES = 1  # a second return of the same rollout quarantines it (poison rollout)
MAX_LAG = 1
MAX_DRIFT = 0.2
LEARNERS = 3
PIPELINE = LEARNERS - 1  # the learner `advance` drives; the others race it
MAX_LIVE = 6  # rollouts a rule can still move; with fewer, generate can always run
MAX_VERSION = 5
VERSION_SPACING = 8  # steps between version changes, so admitted stamps get used
INVARIANT_NAMES = ("spec_holds",)

picks = st.integers(min_value=0, max_value=7)
learner_ids = st.integers(min_value=0, max_value=LEARNERS - 1)


@attrs.define
class RefEntry:
    """The reference model's view of one rollout: plain values, moved by plain Python."""

    state: str
    revision: int
    owner: str | None
    version: int
    releases: int = 0
    lease: float | None = None
    renewed: bool = False  # the current lease was set by a heartbeat, not the reservation


@attrs.frozen
class Ticket:
    """What a learner read: the revision it will compare-and-set against."""

    learner: int
    update_id: str
    rollout_id: str
    revision: int
    state: str


@attrs.define
class Learner:
    """A learner's current update and what it believes it reserved."""

    name: str
    update_no: int = 0
    believed: set[str] = attrs.field(factory=set)

    @property
    def update_id(self) -> str:
        """Id of the update this learner works on now."""
        return f"{self.name}.u{self.update_no}"

    def next_update(self) -> None:
        """Finish (or lose) the current update and start a new one with nothing held."""
        self.update_no += 1
        self.believed = set()


class LedgerRaceMachine(RuleBasedStateMachine):
    """Learners, generators, a reward service and an admission gate racing on one ledger."""

    factory: ClassVar[LedgerFactory]
    backend_label: ClassVar[str] = "memory"
    recorder: ClassVar[Recorder]
    workdir: ClassVar[Path | None] = None

    rollouts = Bundle("rollouts")
    reads = Bundle("reads")

    def __init__(self) -> None:
        super().__init__()
        self.recorder.start_example()
        self.tmp = Path(tempfile.mkdtemp(prefix="ledger-machine-", dir=self.workdir))
        self.clock = ManualClock(0.0)
        self.options: dict[str, Any] = {
            "lease_seconds": LEASE,
            "recovery": RecoveryRule(max_releases=MAX_RELEASES),
        }
        self.ledger: Ledger = type(self).factory(self.tmp, self.clock, **self.options)
        self.reopen_fn = reopener(type(self).factory)
        self.ref: dict[str, RefEntry] = {}
        self.records: dict[str, Rollout] = {}
        self.evidence: dict[str, str] = {}
        self.learners = [Learner(f"L{i}") for i in range(LEARNERS)]
        self.version = 0
        self.pending = 1
        self.registered: dict[int, str] = {0: artifact_hash(0)}
        self.skipped: list[int] = []
        self.bad: set[int] = set()
        # updates the reference holds poisoned (issue 31): a lost lease, a refused commit
        self.poisoned: set[str] = set()
        self.stamps: dict[str, AdmissionStamp] = {}
        self.judged: dict[str, int] = {}  # rollout -> version it was last judged against
        self.checker = TraceChecker(self.recorder, with_registry=False)
        self.seen = 0
        self.reopened_at = 0
        self.version_step = 0
        self.step_no = 0

    # ---- reference-model helpers ---------------------------------------------------------

    def _in_state(self, state: str) -> list[str]:
        return sorted(rid for rid, r in self.ref.items() if r.state == state)

    def _pick(self, state: str, pick: int) -> str:
        ids = self._in_state(state)
        return ids[pick % len(ids)]

    def _owned(self, update_id: str) -> set[str]:
        return {
            rid for rid, r in self.ref.items() if r.state == "reserved" and r.owner == update_id
        }

    def _live_count(self) -> int:
        """Rollouts some rule can still move (a rejected one waits for a new version)."""
        return sum(
            1
            for rid, r in self.ref.items()
            if r.state not in LIFECYCLE.terminal
            and not (
                r.state == "rewarded"
                and self.judged.get(rid) == self.version
                and rid not in self.stamps
            )
        )

    def _unjudged(self) -> list[str]:
        """Rewarded rollouts with no admission against the current version yet."""
        return sorted(
            rid
            for rid, r in self.ref.items()
            if r.state == "rewarded" and self.judged.get(rid) != self.version
        )

    def _wanted(self) -> list[str]:
        """What learners race for: admitted rollouts, and reserved ones (a stale read)."""
        return sorted(
            rid
            for rid, r in self.ref.items()
            if (r.state == "rewarded" and rid in self.stamps) or r.state == "reserved"
        )

    def _busy_learners(self) -> list[int]:
        return [i for i, ln in enumerate(self.learners) if ln.believed or self._owned(ln.update_id)]

    def _move(self, rid: str, event: str, **guards: bool) -> None:
        r = self.ref[rid]
        r.state = LIFECYCLE.next_state(r.state, event, guards)
        r.revision += 1

    def _release(self, rid: str, event: str) -> None:
        """A returned reservation: quarantine a bad version's or a poison rollout, else release."""
        r = self.ref[rid]
        quarantine = r.version in self.bad or r.releases >= MAX_RELEASES
        self._move(rid, event, recovery_quarantines=quarantine)
        if not quarantine:
            r.releases += 1
        r.owner = None
        r.lease = None

    def _expect_reserve(
        self, rid: str, revision: int, update_id: str, stamp: AdmissionStamp | None
    ) -> str:
        """CONTRACT section 5's order: missing, owner retry, revision, state, admission."""
        r = self.ref.get(rid)
        if r is None:
            return "missing_rollout"
        if r.state == "reserved" and r.owner == update_id:
            return "idempotent_retry"
        if r.revision != revision:
            return "revision_conflict"
        if r.state != "rewarded":
            return "not_rewarded"
        if update_id in self.poisoned:
            return "update_poisoned"
        if stamp is None or not stamp.accepted or stamp.behavior_version != r.version:
            return "not_admitted"
        return "reserved"

    def _same_ids(self, what: str, got: list[LedgerEntry], want: set[str]) -> None:
        ids = sorted(e.rollout_id for e in got)
        if ids != sorted(want):
            raise self.recorder.fail(f"{what} returned {ids}, the reference expects {sorted(want)}")

    # ---- shared moves ----------------------------------------------------------------------

    def _direct(self, rid: str, event: str, *, stale: bool = False, **kw: Any) -> None:
        """Fire a direct event; the reference says whether it must succeed or be refused."""
        r = self.ref[rid]
        expected_rev = r.revision + 1 if stale else r.revision
        legal = LIFECYCLE.is_legal(r.state, event)
        reward = REWARD if event == "reward_ready" else None
        try:
            got = self.ledger.transition(rid, event, expected_rev, reward=reward, **kw)
        except RevisionConflict:
            if not stale:
                raise self.recorder.fail(
                    f"{event} on {rid} at its current revision {r.revision} lost a CAS"
                ) from None
            return
        except IllegalTransition:
            if legal and not stale:
                raise self.recorder.fail(
                    f"{event} from {r.state} is declared legal, but {rid} refused it"
                ) from None
            return
        if stale or not legal:
            why = "a stale revision" if stale else f"an illegal event from {r.state}"
            raise self.recorder.fail(f"{event} on {rid} with {why} was accepted: {got}")
        self._move(rid, event)

    def _reserve(self, ticket_learner: int, rid: str, revision: int, update_id: str) -> None:
        stamp = self.stamps.get(rid)
        want = self._expect_reserve(rid, revision, update_id, stamp)
        before = self.ledger.find(rid)
        out = self.ledger.reserve(rid, revision, update_id, stamp)
        after = self.ledger.find(rid)
        self.recorder.checked(RESERVATION_NAMES)
        raise_violations(
            self.recorder,
            f"reserve {rid} by {update_id}",
            check_reservation(before, update_id, out.reserved, out.reason, after),
        )
        ok = want in ("reserved", "idempotent_retry")
        if out.reason != want or out.reserved != ok:
            raise self.recorder.fail(
                f"reserve {rid} by {update_id} at revision {revision} returned "
                f"({out.reserved}, {out.reason!r}); the reference expects ({ok}, {want!r})"
            )
        if want == "revision_conflict":
            self.recorder.reached("cas_lost")
        elif want == "idempotent_retry":
            self.recorder.reached("idempotent_retry")
        elif want == "reserved":
            r = self.ref[rid]
            self._move(rid, "reserve")
            r.owner = update_id
            r.lease = self.clock.now + LEASE
            r.renewed = False
        ln = self.learners[ticket_learner]
        if ok and ln.update_id == update_id:
            ln.believed.add(rid)

    # ---- the healthy pipeline ---------------------------------------------------------------

    def _next_move(self) -> tuple[str, str] | None:
        """The healthy system's next step, oldest rollout first (None: nothing to do)."""
        for state, move in (("dispatched", "generation_done"), ("generated", "reward_ready")):
            ids = self._in_state(state)
            if ids:
                return move, ids[0]
        unjudged = self._unjudged()
        if unjudged:
            return "admit", unjudged[0]
        first = self.learners[PIPELINE]
        admitted = [rid for rid in self._wanted() if self.ref[rid].state == "rewarded"]
        if admitted:
            return "reserve", admitted[0]
        if first.believed:
            return "finish", first.update_id
        return None

    @rule()
    @precondition(lambda self: self._next_move() is not None)
    @counted
    def advance(self) -> None:
        """The healthy pipeline's next step: generation done, reward ready, admission, then
        the pipeline learner (the last one) reserves, reading and CAS at once, and commits
        what it holds. The other learners race it through `read` and `cas`; learner 0 is
        the simplest choice Hypothesis makes, so a shrunk race uses the fewest steps.

        Hypothesis tries the first rule first, so its simplest programs run the happy path;
        races and faults are what the search adds to them.
        """
        move = self._next_move()
        assert move is not None
        kind, subject = move
        if kind in ("generation_done", "reward_ready"):
            self._direct(subject, kind)
        elif kind == "admit":
            self._admit(subject)
        elif kind == "reserve":
            ln = self.learners[PIPELINE]
            self._reserve(PIPELINE, subject, self.ledger.get(subject).revision, ln.update_id)
        else:
            ln = self.learners[PIPELINE]
            if ln.believed == self._owned(ln.update_id):
                self._commit(ln, exact=True)
            else:  # a lease ran out under it: give back what is left
                self._abort(ln)

    # ---- generators and the reward service --------------------------------------------------

    @rule(
        target=rollouts,
        kind=st.sampled_from(["current"] * 8 + ["preparing", "bad_hash", "unregistered"]),
        evidence=st.sampled_from(["ok"] * 10 + list(EVIDENCE_KINDS[1:])),
        stage=st.sampled_from(["dispatched", "dispatched", "rewarded"]),
    )
    @precondition(lambda self: self._live_count() < MAX_LIVE)
    @counted
    def generate(self, kind: str, evidence: str, stage: str) -> str:
        """A generator dispatches a rollout, stamped with the version it runs (or a fault).

        `stage` 'rewarded' is a rollout that arrives already scored (re-imported after a
        restart, or from another ledger); it also lets a shrunk race skip the pipeline.
        """
        n = len(self.ref)
        rid = f"r{n}"
        version, h = self.version, self.registered[self.version]
        if kind == "preparing":  # sampled by a version that is still being prepared
            version, h = self.pending, artifact_hash(self.pending)
        elif kind == "bad_hash":
            h = corrupt_hash(version)
        elif kind == "unregistered" and self.skipped:
            version = self.skipped[-1]
            h = artifact_hash(version)
        rollout = make_rollout(rid, n, version, h, evidence)
        entry = rollout.entry()
        if stage == "rewarded":
            entry = attrs.evolve(entry, state="rewarded", reward=REWARD)
        got = self.ledger.add(entry)
        # a rollout of a version whose activation failed is quarantined on arrival
        want = RefEntry(stage, 0, None, version)
        if version in self.bad:
            want = RefEntry("quarantined", 1, None, version)
        if (got.rollout_id, got.state, got.revision, got.behavior_version) != (
            rid,
            want.state,
            want.revision,
            version,
        ):
            raise self.recorder.fail(f"add({rid}) of v{version} returned {got}; expected {want}")
        self.ref[rid] = want
        self.records[rid] = rollout
        self.evidence[rid] = evidence
        return rid

    @rule(pick=picks, failed=st.sampled_from([False] * 3 + [True]))
    @precondition(lambda self: any(r.state == "dispatched" for r in self.ref.values()))
    @counted
    def finish_generation(self, pick: int, failed: bool) -> None:
        """Generation ends: done, or failed at its own stage."""
        rid = self._pick("dispatched", pick)
        self._direct(rid, "generation_failed" if failed else "generation_done")

    @rule(
        pick=picks,
        outcome=st.sampled_from(["reward_ready"] * 4 + ["reward_timeout", "reward_error"]),
    )
    @precondition(lambda self: any(r.state == "generated" for r in self.ref.values()))
    @counted
    def score(self, pick: int, outcome: str) -> None:
        """The reward service answers: a reward, a timeout or a crash (never a reward of 0)."""
        self._direct(self._pick("generated", pick), outcome)

    @rule(rid=rollouts, event=st.sampled_from(sorted(DIRECT_EVENTS)), stale=st.booleans())
    @counted
    def fire(self, rid: str, event: str, stale: bool) -> None:
        """A deliberately refused write: an illegal event, or a legal one on a stale revision.

        Legal moves have their own rules; this one only probes refusals, so it never
        destroys the rollouts the other rules are working on.
        """
        legal = LIFECYCLE.is_legal(self.ref[rid].state, event)
        self._direct(rid, event, stale=stale or legal)

    # ---- admission -------------------------------------------------------------------------

    @rule(pick=picks)
    @precondition(lambda self: bool(self._unjudged()))
    @counted
    def admit(self, pick: int) -> None:
        """Judge a rewarded rollout against the current version; route what is refused."""
        unjudged = self._unjudged()
        self._admit(unjudged[pick % len(unjudged)])

    def _admit(self, rid: str) -> None:
        rollout = self.records[rid]
        kind = self.evidence[rid]
        gate = gate_mod.AdmissionGate(
            gate_mod.GatePolicy(MAX_LAG, MAX_DRIFT, CONDITIONS), registry=dict(self.registered)
        )
        current = current_log_probs(rollout, self.version, kind)
        decision = gate.assess(rollout, current, self.version, entry=self.ledger.get(rid))
        want = expected_reason(rollout, kind, self.version, self.registered, MAX_LAG, MAX_DRIFT)
        self.recorder.checked(["gate_matches_contract"])
        if decision.reason != want or decision.accepted != (want == "ok"):
            raise self.recorder.fail(
                f"gate judged {rid} (v{rollout.behavior.version} at current v{self.version}, "
                f"evidence {kind}) {decision.reason!r}/{decision.accepted}; contract says {want!r}"
            )
        self.stamps.pop(rid, None)
        self.judged[rid] = self.version
        if decision.route == gate_mod.ROUTE_ADMIT:
            self.stamps[rid] = decision.stamp()
        elif decision.route == gate_mod.ROUTE_OFFLINE:
            self._direct(rid, "retire_stale", disposition=Disposition("admission", "stale"))
        elif decision.route == gate_mod.ROUTE_QUARANTINE:
            self._direct(rid, "quarantine", disposition=Disposition("admission", decision.reason))

    # ---- learners: read, then compare-and-set ----------------------------------------------

    @rule(target=reads, learner=learner_ids, pick=picks)
    @precondition(lambda self: bool(self._wanted()))
    @counted
    def read(self, learner: int, pick: int) -> Ticket:
        """A learner reads a rollout it may want (admitted, or held by a racer) from the backend."""
        wanted = self._wanted()
        rid = wanted[pick % len(wanted)]
        e = self.ledger.get(rid)
        return Ticket(learner, self.learners[learner].update_id, rid, e.revision, e.state)

    @rule(target=reads, learner=learner_ids, rid=rollouts)
    @counted
    def read_any(self, learner: int, rid: str) -> Ticket:
        """A learner reads any rollout, terminal ones included (its CAS must then be refused)."""
        e = self.ledger.get(rid)
        return Ticket(learner, self.learners[learner].update_id, rid, e.revision, e.state)

    @rule(ticket=consumes(reads))
    @counted
    def cas(self, ticket: Ticket) -> None:
        """Reserve with the revision read earlier (a crashed learner's zombie may still do it)."""
        self._reserve(ticket.learner, ticket.rollout_id, ticket.revision, ticket.update_id)

    @rule(pick=picks)
    @precondition(lambda self: any(self._owned(ln.update_id) for ln in self.learners))
    @counted
    def retry(self, pick: int) -> None:
        """The owner reserves again with a stale revision: idempotent, no second write."""
        holders = [i for i, ln in enumerate(self.learners) if self._owned(ln.update_id)]
        i = holders[pick % len(holders)]
        ln = self.learners[i]
        rid = sorted(self._owned(ln.update_id))[0]
        self._reserve(i, rid, 0, ln.update_id)

    # ---- learners: finishing an update --------------------------------------------------------

    @rule(pick=picks, exact=st.booleans())
    @precondition(lambda self: bool(self._busy_learners()))
    @counted
    def commit(self, pick: int, exact: bool) -> None:
        """Commit what the learner believes it holds (or a wrong set): all or nothing."""
        busy = self._busy_learners()
        self._commit(self.learners[busy[pick % len(busy)]], exact)

    def _commit(self, ln: Learner, exact: bool) -> None:
        ids = set(ln.believed)
        if not exact:
            others = sorted(set(self.ref) - ids)
            ids = set(sorted(ids)[1:]) if ids else {others[0]} if others else {"r-none"}
        owned = self._owned(ln.update_id)
        poisoned = ln.update_id in self.poisoned
        try:
            got = self.ledger.commit(ln.update_id, sorted(ids))
        except CommitMismatch:
            if ids == owned and not poisoned:
                raise self.recorder.fail(
                    f"commit of exactly what {ln.update_id} reserved {sorted(ids)} was refused"
                ) from None
            if ids == owned:
                self.recorder.note("poisoned_commit_refused")
            self.poisoned.add(ln.update_id)  # a refused commit poisons its update
            return
        if poisoned:
            raise self.recorder.fail(f"commit by {ln.update_id}, a poisoned update, landed")
        if ids != owned:
            raise self.recorder.fail(
                f"commit by {ln.update_id} of {sorted(ids)} succeeded, but it holds {sorted(owned)}"
            )
        self._same_ids(f"commit by {ln.update_id}", got, owned)
        for rid in owned:
            self._move(rid, "commit")
            self.ref[rid].owner = None
            self.ref[rid].lease = None
        ln.next_update()

    @rule(pick=picks)
    @precondition(lambda self: bool(self._busy_learners()))
    @counted
    def abort(self, pick: int) -> None:
        """Return every reservation of the update under the recovery rule."""
        busy = self._busy_learners()
        self._abort(self.learners[busy[pick % len(busy)]])

    def _poison_holders(self) -> list[int]:
        """Learners holding a rollout that was already returned once."""
        return [
            i
            for i, ln in enumerate(self.learners)
            if any(self.ref[r].releases >= MAX_RELEASES for r in self._owned(ln.update_id))
        ]

    @rule(pick=picks)
    @precondition(lambda self: bool(self._poison_holders()))
    @counted
    def abort_poison(self, pick: int) -> None:
        """A learner holding a rollout already returned once gives it back again: the
        recovery rule quarantines it (a poison rollout), the edge a small budget misses."""
        holders = self._poison_holders()
        self._abort(self.learners[holders[pick % len(holders)]])

    def _abort(self, ln: Learner) -> None:
        owned = self._owned(ln.update_id)
        got = self.ledger.abort(ln.update_id)
        self._same_ids(f"abort of {ln.update_id}", got, owned)
        for rid in owned:
            self._release(rid, "abort")
        ln.next_update()

    @rule(pick=picks)
    @precondition(lambda self: bool(self._busy_learners()))
    @counted
    def fail_update(self, pick: int) -> None:
        """The update itself failed: its rollouts end in update_failed, at stage 'update'."""
        busy = self._busy_learners()
        ln = self.learners[busy[pick % len(busy)]]
        owned = self._owned(ln.update_id)
        got = self.ledger.fail_update(ln.update_id, "nan_loss")
        self._same_ids(f"fail_update of {ln.update_id}", got, owned)
        for rid in owned:
            self._move(rid, "update_failed")
            self.ref[rid].owner = None
            self.ref[rid].lease = None
        ln.next_update()

    @rule(pick=picks)
    @precondition(lambda self: bool(self._busy_learners()))
    @counted
    def renew(self, pick: int) -> None:
        """A long update's heartbeat: every lease it holds runs a full lease from now."""
        busy = self._busy_learners()
        self._renew(self.learners[busy[pick % len(busy)]])

    def _renew(self, ln: Learner) -> None:
        owned = self._owned(ln.update_id)
        got = self.ledger.renew_leases(ln.update_id)
        self._same_ids(f"renew_leases of {ln.update_id}", got, owned)
        for e in got:
            if e.lease_expires_at != self.clock.now + LEASE or e.reserved_by != ln.update_id:
                raise self.recorder.fail(
                    f"renewed {e.rollout_id}: lease {e.lease_expires_at}, owner "
                    f"{e.reserved_by!r}; expected {self.clock.now + LEASE}, {ln.update_id!r}"
                )
        for rid in owned:
            self._move(rid, "renew_lease")
            self.ref[rid].lease = self.clock.now + LEASE
            self.ref[rid].renewed = True

    def _holders(self) -> list[int]:
        """Learners whose current update holds a reservation."""
        return [i for i, ln in enumerate(self.learners) if self._owned(ln.update_id)]

    @rule(pick=picks)
    @precondition(lambda self: bool(self._holders()))
    @counted
    def outlive_renewal(self, pick: int) -> None:
        """A heartbeat, then the update goes quiet: half a lease passes and it renews, an
        expiry pass runs at the OLD deadline (nothing of it is due: the renewal moved it),
        and another expiry pass runs at the renewed deadline, which returns it. A store
        that forgot the renewed deadline (an index still keyed by the old one) expires
        nothing at the second pass; one that kept the old one expires too early at the
        first. Every renewal is thus followed, in some run, by time passing its deadline."""
        holders = self._holders()
        ln = self.learners[holders[pick % len(holders)]]
        self.clock.advance(LEASE / 2)
        self._renew(ln)
        self.clock.advance(LEASE / 2)  # the reservation's own deadline, or later
        self._expire()
        self.clock.advance(LEASE / 2)  # exactly the renewed deadline
        self._expire()

    @rule(pick=picks)
    @precondition(lambda self: bool(self._busy_learners()))
    @counted
    def crash(self, pick: int) -> None:
        """The learner dies: it forgets its update; its reservations wait for their lease."""
        busy = self._busy_learners()
        self.learners[busy[pick % len(busy)]].next_update()

    # ---- time ---------------------------------------------------------------------------------

    @rule(seconds=st.sampled_from([1.0, LEASE / 2, LEASE, 0.0]))
    @precondition(lambda self: any(r.state == "reserved" for r in self.ref.values()))
    @counted
    def tick(self, seconds: float) -> None:
        """Time passes (a ManualClock: expiry is deterministic and replayable); 0.0 means
        exactly to the next lease deadline, the boundary an off-by-one expiry gets wrong."""
        if seconds == 0.0:
            leases = [r.lease for r in self.ref.values() if r.state == "reserved" and r.lease]
            seconds = max(0.0, min(leases) - self.clock.now) if leases else 1.0
        self.clock.advance(seconds)

    def _due(self) -> set[str]:
        now = self.clock.now
        return {
            rid
            for rid, r in self.ref.items()
            if r.state == "reserved" and r.lease is not None and r.lease <= now
        }

    @rule()
    @precondition(lambda self: bool(self._due()))
    @counted
    def expire_leases(self) -> None:
        """Return every reservation whose lease ran out."""
        self._expire()

    def _expire(self) -> None:
        due = self._due()
        got = self.ledger.expire_leases()
        self._same_ids("expire_leases", got, due)
        if any(self.ref[rid].renewed for rid in due):
            self.recorder.reached("renewed_then_expired")
        for rid in due:
            self.ref[rid].renewed = False
            owner = self.ref[rid].owner
            if owner is not None:  # it may have trained on it: poisoned (issue 31)
                self.poisoned.add(owner)
            self._release(rid, "expire_lease")

    # ---- policy versions ---------------------------------------------------------------------

    def _open_versions(self) -> list[int]:
        """Older versions that still have open rollouts (revoking the current one would
        only stall generation)."""
        return sorted(
            {r.version for r in self.ref.values() if r.state not in LIFECYCLE.terminal}
            - self.bad
            - {self.version}
        )

    @rule(pick=picks)
    @precondition(lambda self: bool(self._open_versions()))
    @counted
    def revoke_version(self, pick: int) -> None:
        """An older version is found bad after the fact: quarantine_version. Its open
        rollouts are quarantined now, its reserved ones when they come back."""
        versions = self._open_versions()
        self._quarantine_version(versions[pick % len(versions)], "revoked")

    @rule(activated=st.booleans())
    @precondition(
        lambda self: (
            self.pending <= MAX_VERSION
            and bool(self.ref)
            and self.step_no - self.version_step >= VERSION_SPACING
        )
    )
    @counted
    def new_version(self, activated: bool) -> None:
        """The version being prepared activates, or fails and is quarantined in the ledger."""
        v = self.pending
        self.pending += 1
        self.version_step = self.step_no
        if activated:
            self.stamps.clear()  # admission is always against the current version
            self.version = v
            self.registered[v] = artifact_hash(v)
            return
        self.skipped.append(v)
        self._quarantine_version(v, f"activation of v{v} failed")

    def _quarantine_version(self, v: int, reason: str) -> None:
        self.bad.add(v)
        due = {
            rid
            for rid, r in self.ref.items()
            if r.version == v and LIFECYCLE.is_legal(r.state, "quarantine")
        }
        got = self.ledger.quarantine_version(v, reason)
        self._same_ids(f"quarantine_version({v})", got, due)
        for rid in due:
            self._move(rid, "quarantine")

    # ---- durability ------------------------------------------------------------------------

    @rule()
    @precondition(lambda self: self.reopen_fn is not None and self.step_no - self.reopened_at >= 8)
    @counted
    def reopen(self) -> None:
        """Close the durable ledger and open its file again: nothing may be lost or changed."""
        assert self.reopen_fn is not None
        self.ledger = self.reopen_fn(self.ledger, self.tmp, self.clock, **self.options)
        self.reopened_at = self.step_no

    # ---- checks after every step -------------------------------------------------------------

    @invariant()
    def spec_holds(self) -> None:
        """Spec invariants on the new trace steps and the snapshot; reference == backend."""
        rec = self.recorder
        events = self.ledger.history()
        new = events[self.seen :]
        self.seen = len(events)
        raise_violations(rec, "trace", self.checker.feed(new))
        snap = self.ledger.snapshot()
        raise_violations(rec, "snapshot", check_snapshot(rec, World(entries=snap)))
        rec.checked(["trace_matches_store", "reference_model"])
        if dict(self.checker.world.entries) != snap:
            diff = sorted(
                rid
                for rid in set(snap) | set(self.checker.world.entries)
                if snap.get(rid) != self.checker.world.entries.get(rid)
            )
            raise rec.fail(f"the trace's after-images differ from the stored entries {diff}")
        if set(snap) != set(self.ref):
            raise rec.fail(f"backend holds {sorted(snap)}, reference {sorted(self.ref)}")
        for rid, r in self.ref.items():
            e = snap[rid]
            if (e.state, e.revision, e.reserved_by) != (r.state, r.revision, r.owner):
                raise rec.fail(
                    f"{rid}: backend has ({e.state}, rev {e.revision}, owner {e.reserved_by}), "
                    f"reference ({r.state}, rev {r.revision}, owner {r.owner})"
                )

    def teardown(self) -> None:
        """Close and delete the backend's files; never raise over the real failure."""
        if sys.exc_info()[1] is not None:
            self.recorder.example_failed()
        with contextlib.suppress(Exception):
            self.ledger.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def make_ledger_machine(
    factory: str | LedgerFactory,
    *,
    recorder: Recorder | None = None,
    workdir: Path | None = None,
) -> type[RuleBasedStateMachine]:
    """The ledger race machine bound to one backend ('memory', 'sqlite' or a factory)."""
    label, fn = resolve_factory(factory)
    attrs_: dict[str, Any] = {
        "factory": staticmethod(fn),
        "backend_label": label,
        "recorder": recorder or Recorder("ledger"),
        "workdir": workdir,
        "__module__": __name__,
    }
    cls = type("LedgerRaceMachine", (LedgerRaceMachine,), attrs_)
    return cls
