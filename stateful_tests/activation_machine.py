"""Two-phase activation over a faulty network, as a Hypothesis rule-based machine.

The network is rules: a worker loads the version being distributed and puts its ack
(version, hash it really read, incarnation, seq, attempt, the attempt token it was sent)
into a bag; acks are delivered, dropped, duplicated or left in the bag (delay) in any order,
so acks of older versions and attempts arrive late. Workers load corrupt bytes, crash and
restart (the coordinator hears of the restart synchronously: a worker re-registers before it
does anything else, while its old acks may still be in the bag), report the active version
they restored (no token: a report, not an answer), send acks in the README's old form (no
token), leave and re-join the worker set with acks in flight, and generate rollouts with
whatever they loaded.

A reference model (plain dicts) predicts every coordinator answer: artifact states, the
pointer, how each ack is judged, whether an activation attempt succeeds and why not. The
ghost truth per worker checks that a version becomes active only when every required worker
truly holds it. Liveness is checked on a rebuilt copy (`quiescence.quiesce_copy`).
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import rollout_lifecycle.model.coordinator as coord_mod
import rollout_lifecycle.model.gate as gate_mod
from rollout_lifecycle.model.errors import ActivationError, IllegalTransition
from rollout_lifecycle.model.ledger import ManualClock, RecoveryRule
from rollout_lifecycle.model.machines import ACTIVATION
from rollout_lifecycle.model.records import AdmissionPolicy, Disposition, WorkerAck
from rollout_lifecycle.spec.invariants import Violation
from rollout_lifecycle.stateful_tests.backends import (
    Stack,
    bind_machine,
    close_stack,
    end_example,
    open_stack,
    reopen_stack,
)
from rollout_lifecycle.stateful_tests.builders import (
    CONDITIONS,
    REWARD,
    artifact_hash,
    corrupt_hash,
    current_log_probs,
    expected_reason,
    make_rollout,
)
from rollout_lifecycle.stateful_tests.quiescence import quiesce_copy
from rollout_lifecycle.stateful_tests.recording import (
    Recorder,
    TraceChecker,
    check_snapshot,
    counted,
    raise_violations,
    world_of,
)
from rollout_lifecycle.stateful_tests.workers import (
    STORED_REASONS,
    ReportRef,
    WorkerTruth,
    activation_ghost_violations,
)

WORKERS = ("w0", "w1")
MAX_VERSIONS = 12
MAX_BAG = 6
MAX_ROLLOUTS = 8
MAX_LAG = 1
MAX_DRIFT = 0.2
POLICY = AdmissionPolicy(MAX_LAG, MAX_DRIFT)  # the deployment's, recorded in the registry
LEASE = 10.0
RESTART_SPACING = 6
INVARIANT_NAMES = ("spec_holds",)
# events a probe may try on any version; the reference says whether they must be refused
PROBE_EVENTS = (
    "commit_artifact",
    "fail_commit",
    "distribute",
    "retry",
    "fail_distribution",
    "abandon",
    "prepare",
    "try_activate",
    "rollback",
)
ADVANCING = ("prepared", "committed", "awaiting_acks", "distribution_failed")
# the step `advance` takes from each pending state: (normal, failed)
NEXT_EVENT = {
    "prepared": ("commit_artifact", "fail_commit"),
    "committed": ("distribute", "abandon"),
    "awaiting_acks": ("activate", "fail_distribution"),
    "distribution_failed": ("retry", "abandon"),
}
FAILURE_EVENTS = ("fail_commit", "fail_distribution", "abandon")

picks = st.integers(min_value=0, max_value=7)
worker_ids = st.sampled_from(WORKERS)


@attrs.define
class RefArtifact:
    """The reference model of one artifact record."""

    state: str
    hash: str | None
    rollback: int | None
    attempts: int = 0


@attrs.define
class RefRollout:
    """The reference model of one ledger entry (the parts activation touches)."""

    state: str
    revision: int
    version: int


class ActivationMachine(RuleBasedStateMachine):
    """Coordinator, registry and ledger over one trace; workers and a network of acks."""

    backend: ClassVar[str] = "memory"
    recorder: ClassVar[Recorder]
    workdir: ClassVar[Path | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.recorder.start_example()
        self.step_no = 0
        self.tmp = Path(tempfile.mkdtemp(prefix="activation-machine-", dir=self.workdir))
        self.clock = ManualClock(0.0)
        self.options: dict[str, Any] = {
            "lease_seconds": LEASE,
            "recovery": RecoveryRule(),
        }
        self.stack: Stack = open_stack(
            self.backend, self.tmp, self.clock, WORKERS, policy=POLICY, **self.options
        )
        self.truth = {w: WorkerTruth() for w in WORKERS}
        self.reports = {w: ReportRef() for w in WORKERS}
        # the required worker set, and the token each member was sent for each version's
        # current attempt (read when the attempt opens: tokens are random, never predicted)
        self.members: list[str] = list(WORKERS)
        self.tokens: dict[int, dict[str, str]] = {}
        self.issued: set[str] = set()  # every token ever issued: a new one is never reused
        self.churned_at = 0
        self.bag: list[WorkerAck] = []
        self.arts: dict[int, RefArtifact] = {}
        self.pointer: tuple[int, str] | None = None
        self.rollouts: dict[str, RefRollout] = {}
        self.failed: set[int] = set()
        self.updates = 0
        self.reopened_at = 0
        self.restarted_at = 0
        self.delivered_since_try = False
        self.checker = TraceChecker(self.recorder, with_registry=True)
        self._bootstrap()

    @property
    def coord(self) -> coord_mod.ActivationCoordinator:
        """The live coordinator (a new one after each reopen)."""
        return self.stack.coordinator

    def _bootstrap(self) -> None:
        """v0 active on every worker, so the first rules already race a running system."""
        self._apply(0, "prepare")
        self._apply(0, "commit_artifact")
        self._apply(0, "distribute")
        for w in WORKERS:
            token = self.tokens[0][w]
            self._deliver(self.truth[w].ack(w, 0, artifact_hash(0), self.arts[0].attempts, token))
        self._try_activate(0)

    # ---- reference-model helpers ---------------------------------------------------------

    def _versions(self, *states: str) -> list[int]:
        return sorted(v for v, a in self.arts.items() if not states or a.state in states)

    def _pick(self, pick: int, *states: str) -> int:
        vs = self._versions(*states)
        return vs[pick % len(vs)]

    def _awaiting(self) -> int | None:
        vs = self._versions("awaiting_acks")
        return vs[0] if vs else None

    def _ever_active(self) -> dict[int, str]:
        return {
            v: a.hash
            for v, a in self.arts.items()
            if a.state in ("active", "superseded", "rolled_back") and a.hash is not None
        }

    def _expect(self, v: int, event: str) -> type[Exception] | None:
        """The refusal the coordinator must raise for `event` on `v`, or None if legal."""
        if event == "prepare":
            top = max(self.arts, default=None)
            return ActivationError if top is not None and v <= top else None
        a = self.arts.get(v)
        if a is None:
            return ActivationError
        # one distribution at a time: judged before the machine is asked about the event
        if event in ("distribute", "retry") and any(
            u != v for u in self._versions("awaiting_acks")
        ):
            return ActivationError
        if not ACTIVATION.is_legal(a.state, event):
            return IllegalTransition
        # a version no newer than the active one is never distributed (it could not activate)
        active = [u for u in self._versions("active")]
        if event in ("distribute", "retry") and active and v <= active[0]:
            return ActivationError
        return None

    def _ref_settle(self) -> list[int]:
        """What the coordinator's settle does first when an attempt awaiting acks would block
        a call: an attempt whose every ack is in activates (this machine's clock never
        reaches an ack deadline, so none is failed for one)."""
        done = []
        for u in self._versions("awaiting_acks"):
            if self._expect_activation(u) == "activated":
                self._ref_activated(u)
                done.append(u)
        return done

    def _apply(self, v: int, event: str) -> None:
        """Perform one coordinator call whose refusal (or success) the reference predicts."""
        if event in ("distribute", "retry") and any(
            u != v for u in self._versions("awaiting_acks")
        ):
            self._ref_settle()
        want = self._expect(v, event)
        try:
            self._call(v, event)
        except (ActivationError, IllegalTransition) as exc:
            if want is None or not isinstance(exc, want):
                raise self.recorder.fail(
                    f"{event}(v{v}) raised {type(exc).__name__}: {exc}; the reference "
                    f"expects {'success' if want is None else want.__name__}"
                ) from None
            return
        if want is not None:
            raise self.recorder.fail(f"{event}(v{v}) succeeded; expected {want.__name__}")
        self._ref_apply(v, event)

    def _call(self, v: int, event: str) -> None:
        c = self.coord
        if event == "prepare":
            c.prepare(v)
        elif event == "commit_artifact":
            c.commit_artifact(v, artifact_hash(v))
        elif event == "fail_commit":
            c.fail_commit(v, "write_failed")
        elif event == "distribute":
            c.distribute(v)
        elif event == "retry":
            c.retry(v)
        elif event == "fail_distribution":
            c.fail_distribution(v, "ack_timeout")
        elif event == "abandon":
            c.abandon(v, "operator")
        else:
            raise ValueError(f"no coordinator call for {event!r}")

    def _ref_apply(self, v: int, event: str) -> None:
        if event == "prepare":
            self.arts[v] = RefArtifact(
                "prepared", None, None if self.pointer is None else self.pointer[0]
            )
            return
        a = self.arts[v]
        a.state = ACTIVATION.next_state(a.state, event)
        if event == "commit_artifact":
            a.hash = artifact_hash(v)
        elif event in ("distribute", "retry"):
            a.attempts += 1
            self._record_tokens(v)
        elif event in FAILURE_EVENTS:
            self.failed.add(v)
            for r in self.rollouts.values():
                if r.version == v and r.state in ("generated", "rewarded"):
                    r.state, r.revision = "quarantined", r.revision + 1

    def _record_tokens(self, v: int) -> None:
        """A distribution attempt opened: every member must have a fresh token of its own."""
        got = self.coord.attempt_tokens(v)
        old = self.tokens.get(v, {})
        self.recorder.checked(["attempt_tokens_fresh"])
        if sorted(got) != sorted(self.members) or len(set(got.values())) != len(got):
            raise self.recorder.fail(
                f"attempt of v{v} issued tokens {got}; expected one per member {self.members}"
            )
        if any(old.get(w) == t or t in self.issued for w, t in got.items()):
            raise self.recorder.fail(f"attempt of v{v} reissued a previous token: {got}")
        self.tokens[v] = dict(got)
        self.issued.update(got.values())

    def _deliver(self, ack: WorkerAck) -> None:
        ref = self.reports[ack.worker_id]
        art = self.arts.get(ack.version)
        member = ack.worker_id in self.members
        awaiting = art is not None and art.state == "awaiting_acks"
        sent = self.tokens.get(ack.version, {}) if awaiting else {}
        want = ref.expect(
            ack,
            member=member,
            awaiting=awaiting,
            token=sent.get(ack.worker_id),
            others=frozenset(t for w, t in sent.items() if w != ack.worker_id),
        )
        if (
            art is not None
            and art.state == "awaiting_acks"
            and ack.attempt is not None
            and ack.attempt < art.attempts
        ):
            # an ack of an earlier attempt of this version, delayed across the retry: it is
            # stored as the worker's report but must not count toward this attempt
            self.recorder.reached("late_attempt_ack")
        got = self.coord.record_ack(ack)
        self.recorder.checked(["ack_judged_as_reference"])
        if (
            got.reason != want
            or got.counted != (want == "counted")
            or got.recorded != (want in STORED_REASONS)
        ):
            raise self.recorder.fail(
                f"ack {ack} judged ({got.counted}, {got.reason!r}, recorded {got.recorded}); "
                f"reference: {want!r} (floor {ref.floor}, latest {ref.latest})"
            )
        if want in STORED_REASONS:
            # only an answer to the current attempt keeps its token: a report never counts
            if want == "counted":
                ref.counted(ack)
            else:
                ref.latest = attrs.evolve(ack, token=None)
            if want == "not_required":
                self.recorder.reached("non_member_report_recorded")
        elif want == "stale_incarnation":
            self.recorder.reached("restart_ack_refused")
        elif want in ("stale_attempt_token", "foreign_attempt_token", "spent_attempt_token"):
            self.recorder.reached("stale_token_refused")
        elif want == "missing_attempt_token":
            self.recorder.reached("missing_token_refused")
        else:  # a duplicate, an older report after a newer one, or a conflicting one
            self.recorder.reached("stale_ack_refused")

    def _try_activate(self, v: int) -> None:
        reason = self._expect_activation(v)
        res = self.coord.try_activate(v)
        self.recorder.checked(["activation_as_reference"])
        if res.activated != (reason == "activated") or res.reason != reason:
            raise self.recorder.fail(
                f"try_activate(v{v}) gave ({res.activated}, {res.reason!r}); the reference "
                f"expects {reason!r} (acks {self._latest_summary()})"
            )
        if res.activated:
            self._ref_activated(v)
        elif reason == "worker_mismatch" and any(
            (r := self.reports[w].latest) is not None and r.version < v for w in self.members
        ):
            self.recorder.reached("stale_ack_refused")

    def _ref_activated(self, v: int) -> None:
        a = self.arts[v]
        if self.pointer is not None:
            self.arts[self.pointer[0]].state = "superseded"
        a.state = "active"
        # a version that failed once and activated on a retry is good from now on: its
        # late rollouts are no longer quarantined on arrival (the coordinator lifts the
        # ledger's mark in the same call)
        self.failed.discard(v)
        assert a.hash is not None
        self.pointer = (v, a.hash)
        for t in self.truth.values():
            t.serving = t.loaded

    def _expect_activation(self, v: int) -> str:
        a = self.arts[v]
        if a.state != "awaiting_acks":
            return "artifact_not_committed" if a.hash is None else "not_awaiting_acks"
        if self.pointer is not None and v <= self.pointer[0]:
            return "non_monotonic_version"
        # a report of another version blocks; one of v counts only with v's current token
        sent = self.tokens.get(v, {})
        counted = {
            w: r.latest
            for w in self.members
            if (r := self.reports[w]).latest is not None
            and (r.latest.version != v or r.latest.token == sent.get(w))
        }
        if any(w not in counted for w in self.members):
            return "missing_worker_ack"
        if any((ack.version, ack.artifact_hash) != (v, a.hash) for ack in counted.values()):
            return "worker_mismatch"
        return "activated"

    def _latest_summary(self) -> str:
        return ", ".join(
            f"{w}: {None if r.latest is None else (r.latest.version, r.latest.token)}"
            for w, r in self.reports.items()
        )

    # ---- the artifact's life ---------------------------------------------------------------

    @rule(gap=st.sampled_from([1, 2]))
    @precondition(
        lambda self: (
            len(self.arts) < MAX_VERSIONS
            and len(self._versions("prepared", "committed", "awaiting_acks")) < 2
        )
    )
    @counted
    def prepare(self, gap: int) -> None:
        """A new, higher version (maybe skipping a number) while another may be pending."""
        self._apply(max(self.arts) + gap, "prepare")

    @rule()
    @precondition(lambda self: bool(self._versions(*ADVANCING)) or len(self.arts) < MAX_VERSIONS)
    @counted
    def advance(self) -> None:
        """The healthy system takes its next step: the happy path, one call at a time.

        While a version awaits acks, the learner keeps working: it prepares its next
        version if none is pending and commits that artifact (it waits, committed, for its
        turn to be distributed). Otherwise the next worker that has not answered this attempt
        loads and acks, else the oldest ack in flight is delivered, and activation is tried
        after each delivery (so a worker still reporting the previous version is refused on
        the happy path). With nothing awaiting, the oldest pending version moves on
        (distribute, commit, retry) or a new one is prepared; a newer version goes ahead of a
        failed older one, which is how a retried version ends up older than the pointer.
        This is the first rule Hypothesis tries, so its simplest programs are whole
        activations and faults are what the search adds.
        """
        v = self._awaiting()
        idle_learner = not self._versions(*ADVANCING[:2], "distribution_failed")
        if v is not None and idle_learner and self._room():
            # the learner keeps training while weights are distributed: next version
            self._apply(max(self.arts) + 1, "prepare")
            return
        if v is not None and self._versions("prepared"):
            self._apply(self._versions("prepared")[0], "commit_artifact")
            return
        if v is not None:
            asked = self.tokens.get(v, {})
            for w in self.members:
                sent = self.truth[w].last_sent
                answered = sent is not None and (sent.version, sent.token) == (v, asked.get(w))
                if not answered and len(self.bag) < MAX_BAG:
                    self._load(w, v, corrupt=False)
                    return
            if self.bag and not self.delivered_since_try:
                self._deliver(self.bag.pop(0))
                self.delivered_since_try = True
            else:  # the coordinator tries to activate after each ack it receives
                self.delivered_since_try = False
                self._try_activate(v)
            return
        for state in ("committed", "prepared", "distribution_failed"):
            pending = self._versions(state)
            if pending:
                self._apply(pending[0], NEXT_EVENT[state][False])
                return
        self._apply(max(self.arts) + 1, "prepare")

    def _room(self) -> bool:
        return len(self.arts) < MAX_VERSIONS

    @rule(pick=picks)
    @precondition(lambda self: bool(self._versions(*ADVANCING)) and self.step_no % 3 == 0)
    @counted
    def fail(self, pick: int) -> None:
        """The next step of a pending version fails: its write, its distribution, or the
        operator gives it up (a committed or failed version is abandoned). Only on every
        third step: faults should interrupt activations, not prevent every one of them."""
        v = self._pick(pick, *ADVANCING)
        self._apply(v, NEXT_EVENT[self.arts[v].state][True])

    @rule(pick=picks, event=st.sampled_from(PROBE_EVENTS))
    @counted
    def probe(self, pick: int, event: str) -> None:
        """A request the reference predicts the answer to, on any version: refusals mostly.

        Illegal events must raise and change nothing; 'prepare' reuses an old version number;
        'try_activate' on a version not awaiting acks must refuse; 'rollback' without a
        superseded target must refuse. Legal events are left to `advance`.
        """
        v = self._pick(pick)
        if event == "prepare":
            self._apply(v, "prepare")
        elif event == "try_activate":  # early: before every worker answered, if one awaits
            awaiting = self._awaiting()
            self._try_activate(v if awaiting is None else awaiting)
        elif event == "rollback":
            self._rollback()
        elif self._expect(v, event) is not None:
            self._apply(v, event)

    # ---- workers and the network -------------------------------------------------------------

    @rule(
        worker=worker_ids,
        corrupt=st.sampled_from([False] * 5 + [True]),
        echo=st.sampled_from([True] * 3 + [False]),
    )
    @precondition(lambda self: self._awaiting() is not None and len(self.bag) < MAX_BAG)
    @counted
    def load(self, worker: str, corrupt: bool, echo: bool) -> None:
        """The worker answers the distribution: loads (maybe corrupt bytes), acks into the
        bag echoing the token it was sent (a worker outside the set was sent none). Now and
        then a worker on the README's old form sends no token at all."""
        v = self._awaiting()
        assert v is not None
        self._load(worker, v, corrupt=corrupt, echo=echo)

    def _load(self, worker: str, v: int, *, corrupt: bool, echo: bool = True) -> None:
        token = self.tokens.get(v, {}).get(worker) if echo and worker in self.members else None
        ack = self.truth[worker].answer(
            worker,
            v,
            artifact_hash(v),
            corrupt_hash(v),
            self.arts[v].attempts,
            token,
            corrupt=corrupt,
        )
        self.bag.append(ack)

    @rule(pick=picks)
    @precondition(lambda self: bool(self.bag) and len(self.bag) < MAX_BAG)
    @counted
    def garble(self, pick: int) -> None:
        """A copy of an ack in flight with the same (incarnation, seq) but other content
        (a hash no version has): whichever copy arrives second conflicts and never counts."""
        ack = self.bag[pick % len(self.bag)]
        other = hashlib.sha256(f"garbled-{ack.artifact_hash}".encode()).hexdigest()
        self.bag.append(attrs.evolve(ack, artifact_hash=other))

    @rule(worker=worker_ids)
    @precondition(lambda self: self.pointer is not None)
    @counted
    def restore_active(self, worker: str) -> None:
        """The worker reloads the active version (after a failed attempt, being drained) and
        reports what it holds: no attempt asked for it, so the report carries no token. It
        says so before it drops what it held (like a restart's re-registration): weights
        swapped behind an ack that still counts are a fault no coordinator can see."""
        assert self.pointer is not None
        v, h = self.pointer
        self._deliver(self.truth[worker].ack(worker, v, h))

    @rule(worker=worker_ids)
    @precondition(lambda self: self.step_no - self.churned_at >= 2)
    @counted
    def churn(self, worker: str) -> None:
        """Membership churn with acks in flight: the worker leaves the required set (if
        another member remains), or re-joins it. Leaving voids its stored ack and tokens;
        re-joining while a version awaits acks issues it a fresh token, so it acks afresh."""
        self.churned_at = self.step_no
        leaving = worker in self.members
        if leaving and len(self.members) == 1:
            return
        new = [w for w in WORKERS if (w in self.members) != (w == worker)]
        self.coord.change_membership(new, f"{worker} {'drained' if leaving else 'back'}")
        self.members = new
        v = self._awaiting()
        if leaving:
            self.reports[worker].latest = None
            for sent in self.tokens.values():
                sent.pop(worker, None)
            if worker in self.coord.reports():
                raise self.recorder.fail(f"{worker} left the worker set, its ack still stands")
        elif v is not None:
            fresh = self.coord.attempt_token(worker, v)
            if fresh in self.issued:
                raise self.recorder.fail(f"{worker} re-joined with a token already issued")
            self.tokens[v][worker] = fresh
            self.issued.add(fresh)
        self.recorder.reached("membership_churn")

    @rule(pick=picks)
    @precondition(lambda self: bool(self.bag))
    @counted
    def deliver(self, pick: int) -> None:
        """An ack in flight arrives (any one: the network reorders; the rest are delayed)."""
        self._deliver(self.bag.pop(pick % len(self.bag)))

    def _late_acks(self) -> list[int]:
        """Bag positions of acks from an earlier attempt of a version being retried."""
        return [
            i
            for i, a in enumerate(self.bag)
            if (art := self.arts.get(a.version)) is not None
            and art.state == "awaiting_acks"
            and a.attempt is not None
            and a.attempt < art.attempts
        ]

    @rule()
    @precondition(
        lambda self: (
            self._awaiting() is not None and any(a.version == self._awaiting() for a in self.bag)
        )
    )
    @counted
    def timeout_and_retry(self) -> None:
        """The distribution times out while acks are still in flight and is retried at once:
        those acks, of the failed attempt, may now arrive during the retry."""
        v = self._awaiting()
        assert v is not None
        self._apply(v, "fail_distribution")
        if self.arts[v].state == "distribution_failed" and self._expect(v, "retry") is None:
            self._apply(v, "retry")

    @rule()
    @precondition(lambda self: self._awaiting() is not None and self.step_no % 5 == 2)
    @counted
    def activator_dies(self) -> None:
        """The activator is killed mid-distribution and its ack deadline passes: the next
        coordinator's `settle` activates the attempt if every ack is in (it died after
        them), else fails it ('ack_deadline_passed', its rollouts quarantined)."""
        v = self._awaiting()
        assert v is not None
        self.clock.advance(coord_mod.DEFAULT_ACK_TIMEOUT)
        activates = self._expect_activation(v) == "activated"
        got = self.coord.settle()
        self.recorder.checked(["settled_as_reference"])
        want = ((v,), ()) if activates else ((), (v,))
        if (got.activated, got.failed) != want or got.awaiting:
            raise self.recorder.fail(f"settle at v{v}'s deadline gave {got}; expected {want}")
        if activates:
            self._ref_activated(v)
            return
        failure = self.coord.artifact(v).failure
        if failure is None or failure.cause != coord_mod.ACK_DEADLINE_PASSED:
            raise self.recorder.fail(f"v{v} failed at its deadline with {failure}")
        self._ref_apply(v, "fail_distribution")

    @rule(pick=picks)
    @precondition(lambda self: bool(self._late_acks()))
    @counted
    def deliver_late(self, pick: int) -> None:
        """An ack sent during a failed attempt arrives during the retry (a slow network)."""
        late = self._late_acks()
        self._deliver(self.bag.pop(late[pick % len(late)]))

    @rule(pick=picks, duplicate=st.booleans())
    @precondition(lambda self: bool(self.bag))
    @counted
    def network_fault(self, pick: int, duplicate: bool) -> None:
        """The network drops an ack, or will deliver it twice."""
        i = pick % len(self.bag)
        if duplicate and len(self.bag) < MAX_BAG:
            self.bag.append(self.bag[i])
        else:
            self.bag.pop(i)

    @rule(worker=worker_ids)
    @precondition(lambda self: self.step_no - self.restarted_at >= RESTART_SPACING)
    @counted
    def restart(self, worker: str) -> None:
        """The worker crashes and comes back empty; it re-registers before anything else."""
        self.restarted_at = self.step_no
        t = self.truth[worker]
        t.restart()
        report = self.coord.worker_restarted(worker, t.incarnation)
        ref = self.reports[worker]
        ref.restarted(t.incarnation)
        if (report.floor, report.ack) != (ref.floor, ref.latest):
            raise self.recorder.fail(
                f"worker_restarted({worker}, {t.incarnation}) left floor {report.floor}, ack "
                f"{report.ack}; the reference expects floor {ref.floor}, ack {ref.latest}"
            )

    @rule(worker=worker_ids)
    @precondition(
        lambda self: self._awaiting() is not None and not any(t.broken for t in self.truth.values())
    )
    @counted
    def break_worker(self, worker: str) -> None:
        """A fault starts: this worker's loads come out corrupt until it restarts."""
        self.truth[worker].broken = True

    # ---- rollback ------------------------------------------------------------------------------

    @rule()
    @precondition(lambda self: self._can_roll_back())
    @counted
    def rollback(self) -> None:
        """An explicit rollback to the active version's recorded rollback pointer."""
        self._rollback()

    def _can_roll_back(self) -> bool:
        if self.pointer is None:
            return False
        if any(a.state == "awaiting_acks" for a in self.arts.values()):
            return False  # refused while a distribution awaits acks (see coordinator.rollback)
        target = self.arts[self.pointer[0]].rollback
        return target is not None and self.arts[target].state == "superseded"

    def _rollback(self) -> None:
        """Roll back, or (with no superseded target) check the refusal changes nothing.

        A distribution awaiting acks is settled first; if that activated it, the rollback
        is refused (the active version is no longer the one the caller meant)."""
        if self._versions("awaiting_acks") and self._ref_settle():
            try:
                self.coord.rollback()
            except ActivationError:
                return
            raise self.recorder.fail("rollback succeeded after settling activated a version")
        if not self._can_roll_back():
            try:
                self.coord.rollback()
            except ActivationError:
                return
            raise self.recorder.fail("rollback succeeded without a superseded rollback target")
        assert self.pointer is not None
        cur = self.arts[self.pointer[0]]
        assert cur.rollback is not None
        target = self.arts[cur.rollback]
        got = self.coord.rollback()
        cur.state = "rolled_back"
        target.state = "active"
        # the rolled-back version is retired: its open rollouts are quarantined now, late
        # ones on arrival, none is reserved again (coordinator.rollback, keep_rollouts=False)
        rolled = self.pointer[0]
        self.failed.add(rolled)
        for r in self.rollouts.values():
            if r.version == rolled and r.state in ("generated", "rewarded"):
                r.state, r.revision = "quarantined", r.revision + 1
        assert target.hash is not None
        self.pointer = (cur.rollback, target.hash)
        if (got.version, got.artifact_hash) != self.pointer:
            raise self.recorder.fail(f"rollback returned {got}; expected {self.pointer}")
        # the operator did not keep the rollouts: the record must say so (a cause that says
        # 'kept' would let a later reader, or a later premise, treat them as trainable)
        cause = self.coord.artifact(rolled).failure
        if cause is None or (cause.stage, cause.cause) != ("activation", "rolled_back"):
            raise self.recorder.fail(
                f"v{rolled} rolled back without keeping its rollouts, but its record says {cause}"
            )
        self.recorder.reached("rollback")

    # ---- rollouts generated on whatever a worker loaded ------------------------------------

    @rule(worker=worker_ids)
    @precondition(
        lambda self: (
            len(self.rollouts) < MAX_ROLLOUTS
            and any(t.loaded is not None for t in self.truth.values())
        )
    )
    @counted
    def generate(self, worker: str) -> None:
        """A worker generates with what it loaded (maybe a version still being distributed);
        the rollout waits for its reward, so a failed version catches it in `generated`."""
        t = self.truth[worker]
        if t.loaded is None:
            t = next(x for x in self.truth.values() if x.loaded is not None)
        assert t.loaded is not None
        v, h = t.loaded
        rid = f"r{len(self.rollouts)}"
        entry = make_rollout(rid, len(self.rollouts), v, h).entry()
        entry = attrs.evolve(entry, state="generated")
        got = self.stack.ledger.add(entry)
        want = RefRollout("generated", 0, v)
        if v in self.failed:  # late arrival of a failed version: quarantined on add
            want = RefRollout("quarantined", 1, v)
        if (got.state, got.revision) != (want.state, want.revision):
            raise self.recorder.fail(f"add({rid}) of v{v} gave {got.state}; expected {want}")
        self.rollouts[rid] = want

    @rule(pick=picks)
    @precondition(
        lambda self: any(r.state in ("generated", "rewarded") for r in self.rollouts.values())
    )
    @counted
    def train(self, pick: int) -> None:
        """Reward a rollout if needed, admit it against the active version, then reserve and
        commit it, or route it where the gate says."""
        ids = sorted(
            rid for rid, r in self.rollouts.items() if r.state in ("generated", "rewarded")
        )
        rid = ids[pick % len(ids)]
        ref = self.rollouts[rid]
        led = self.stack.ledger
        entry = led.get(rid)
        if entry.state == "generated":
            entry = led.transition(rid, "reward_ready", entry.revision, reward=REWARD)
            ref.state, ref.revision = "rewarded", ref.revision + 1
        rollout = make_rollout(rid, int(rid[1:]), entry.behavior_version, entry.artifact_hash)
        assert self.pointer is not None
        current = self.pointer[0]
        gate = gate_mod.AdmissionGate(
            gate_mod.GatePolicy(MAX_LAG, MAX_DRIFT, CONDITIONS), registry=self.coord.activated_hash
        )
        decision = gate.assess(
            rollout, current_log_probs(rollout, current, "ok"), current, entry=entry
        )
        want = expected_reason(rollout, "ok", current, self._ever_active(), MAX_LAG, MAX_DRIFT)
        self.recorder.checked(["gate_matches_contract"])
        if decision.reason != want:
            raise self.recorder.fail(
                f"gate judged {rid} (v{entry.behavior_version} at v{current}) "
                f"{decision.reason!r}; the contract says {want!r}"
            )
        if decision.route == gate_mod.ROUTE_QUARANTINE:
            led.transition(
                rid,
                "quarantine",
                entry.revision,
                disposition=Disposition("admission", decision.reason),
            )
            ref.state, ref.revision = "quarantined", ref.revision + 1
        elif decision.route == gate_mod.ROUTE_OFFLINE:
            led.transition(
                rid, "retire_stale", entry.revision, disposition=Disposition("admission", "stale")
            )
            ref.state, ref.revision = "retired_stale", ref.revision + 1
        elif decision.accepted:
            self.updates += 1
            update = f"u{self.updates}"
            out = led.reserve(rid, entry.revision, update, decision.stamp())
            if not out.reserved:
                raise self.recorder.fail(f"admitted {rid} could not be reserved: {out.reason}")
            led.commit(update, [rid])
            ref.state, ref.revision = "consumed", ref.revision + 2

    # ---- time, durability, liveness -------------------------------------------------------

    @rule()
    @precondition(lambda self: self.stack.durable and self.step_no - self.reopened_at >= 8)
    @counted
    def reopen(self) -> None:
        """Restart the coordinator process on the same file; `resume` must change nothing."""
        self.stack = reopen_stack(
            self.stack,
            self.tmp,
            self.clock,
            tuple(self.members),
            policy=POLICY,
            **self.options,
        )
        self.reopened_at = self.step_no
        self._ref_settle()  # resume settles: an attempt whose every ack is in activates
        self.coord.resume()

    @rule()
    @precondition(lambda self: self._pending_work())
    @counted
    def quiesce(self) -> None:
        """Liveness on a copy: deliver everything, load and ack, resolve every attempt."""
        problems = quiesce_copy(
            self.recorder,
            self.stack.ledger,
            self.stack.registry,
            self.truth,
            self.bag,
            now=self.clock.now,
            lease_seconds=LEASE,
            recovery=self.options["recovery"],
            true_hash=artifact_hash,
            corrupt_hash=corrupt_hash,
        )
        if problems:
            raise self.recorder.fail("; ".join(problems[:6]))

    def _pending_work(self) -> bool:
        return bool(self.bag) or bool(self._versions("prepared", "committed", "awaiting_acks"))

    @invariant()
    def spec_holds(self) -> None:
        """Spec invariants on new trace steps and the stores; reference, ghost, stores agree."""
        rec = self.recorder
        new = self.stack.source.new_events()
        raise_violations(rec, "trace", self.checker.feed(new))
        raise_violations(rec, "ghost", _as_violations(activation_ghost_violations(new, self.truth)))
        led, reg = self.stack.ledger, self.stack.registry
        snap = led.snapshot()
        arts = reg.artifacts()
        pointer = reg.pointer()
        world = world_of(snap, arts, pointer, reg, led)
        raise_violations(rec, "stores", check_snapshot(rec, world))
        rec.checked(["trace_matches_store", "reference_model", "ghost_truth"])
        if self.checker.world != world:
            raise rec.fail("the trace's after-images differ from the stored records")
        got_arts = {
            a.version: (a.state, a.artifact_hash, a.rollback_version, a.attempts) for a in arts
        }
        want_arts = {v: (a.state, a.hash, a.rollback, a.attempts) for v, a in self.arts.items()}
        if got_arts != want_arts:
            raise rec.fail(f"registry {got_arts} differs from the reference {want_arts}")
        got_pointer = None if pointer is None else (pointer.version, pointer.artifact_hash)
        if got_pointer != self.pointer:
            raise rec.fail(f"pointer {got_pointer}, reference {self.pointer}")
        got_entries = {rid: (e.state, e.revision) for rid, e in snap.items()}
        want_entries = {rid: (r.state, r.revision) for rid, r in self.rollouts.items()}
        if got_entries != want_entries:
            raise rec.fail(f"ledger {got_entries} differs from the reference {want_entries}")
        if reg.required_workers() != tuple(self.members):
            raise rec.fail(f"worker set {reg.required_workers()}, reference {self.members}")
        v = self._awaiting()
        if v is not None and self.coord.attempt_tokens(v) != self.tokens[v]:
            raise rec.fail(f"v{v}'s stored attempt tokens differ from the ones sent")

    def teardown(self) -> None:
        """Close the stores and delete the files; never raise over the real failure."""
        end_example(self.recorder, self.tmp, [lambda: close_stack(self.stack)])


def _as_violations(texts: list[str]) -> list[Violation]:
    return [Violation("ghost_truth", t) for t in texts]


def make_activation_machine(
    backend: str = "memory",
    *,
    recorder: Recorder | None = None,
    workdir: Path | None = None,
) -> type[RuleBasedStateMachine]:
    """The activation machine on 'memory' (one EventLog), 'sqlite' (one file) or PostgreSQL
    ('postgresql' or a postgresql:// URL: one schema)."""
    return bind_machine(
        ActivationMachine,
        backend,
        machine="activation",
        recorder=recorder,
        recorder_name="activation",
        workdir=workdir,
    )
