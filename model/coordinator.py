"""Two-phase policy activation (CONTRACT section 4), driven through the declared ACTIVATION machine.

One artifact version moves ``prepared -> committed -> awaiting_acks -> active -> superseded``
(or into a failure state); every move is `ACTIVATION.resolve(state, event, guards)` and is
written as ONE registry transaction together with its `ArtifactChanged` events. The switch
decision is `model.api.activate_policy_version` itself, fed from the registry, so the small
API and the coordinator cannot disagree on when a pointer may flip.

Worker reports are ordered by (incarnation, seq): a late or duplicated ack never replaces a
newer one, and a restart voids everything the previous incarnation said (bugs 11 and 12 of
the field notes). Each distribution attempt issues every required worker a random token
(`attempt_token`); an ack of the version awaiting acks counts only if it echoes its
worker's token of the CURRENT attempt, so a delayed ack of a failed attempt, or one sent
before the worker left and re-joined the worker set, is refused with a typed reason instead
of counted by arrival. Leaving the worker set voids a worker's ack and tokens; a worker that
joins while a version awaits acks is issued a token of its own and must ack afresh. Reports
of a version not awaiting acks ("I restored v0"), and every report of a non-member, are
stored as what the worker holds: they can block an activation, never help one. A token
counts once, so a network duplicate of an ack the worker has since replaced never counts,
even when `seq` is numbered by arrival.

A failed activation quarantines that version's rollouts in the ledger after the registry
step commits; `resume` re-applies it, so a crash in between is healed. Each distribution
attempt has an ack deadline on the deployment's clock; `settle` (run first by distribute,
retry, rollback, try_activate of another version and resume) activates an attempt whose
acks are all in and fails one past its deadline, so a killed activator never stalls the
deployment.

The admission policy is never written here: `policy=` is an expectation checked at
construction (the operator records it: `deployment set-policy`, `set_admission_policy`).
"""

from __future__ import annotations

import enum
import math
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

import attrs

from rollout_lifecycle.model.errors import ActivationError, InvalidRecord, brief
from rollout_lifecycle.model.events import ArtifactChanged, TraceEvent
from rollout_lifecycle.model.ledger import Ledger
from rollout_lifecycle.model.machines import ACTIVATION
from rollout_lifecycle.model.records import (
    MAX_ID_LENGTH,
    ActivePointer,
    AdmissionPolicy,
    ArtifactRecord,
    AttemptToken,
    Disposition,
    WorkerAck,
    check_int64,
    text_problem,
)
from rollout_lifecycle.model.registry import (
    ATTEMPT_EVENTS,
    ArtifactChange,
    ReadsWorkers,
    RegistryStep,
    RegistryStore,
    RegistryView,
    WorkerReport,
    activated_hash,
    activation_decision,
    backend_url,
    check_membership,
    check_policy,
    counted_acks,
    current_tokens,
    default_lineage,
    distribution_refusal,
    lineage_fenced,
    reconcile_membership,
    required_set,
)
from rollout_lifecycle.model.rules import (
    ROLLBACK_KEPT,
    ROLLBACK_RETIRED,
    retired_versions,
    set_policy_command,
)

R = TypeVar("R")

# AckResult reasons
COUNTED = "counted"  # an ack of the current attempt, echoing its token: stored, counts
REPORTED = "reported"  # a member's report of a version not awaiting acks: stored, blocks only
NOT_REQUIRED = "not_required"  # a non-member's report: stored, never counts
DUPLICATE = "duplicate"
OUT_OF_ORDER = "out_of_order"
CONFLICTING = "conflicting_report"
STALE_INCARNATION = "stale_incarnation"
MISSING_ATTEMPT_TOKEN = "missing_attempt_token"  # acks a version awaiting acks, no token
STALE_ATTEMPT_TOKEN = "stale_attempt_token"  # a token of an earlier attempt (or membership)
FOREIGN_ATTEMPT_TOKEN = "foreign_attempt_token"  # another worker's token of this attempt
SPENT_ATTEMPT_TOKEN = "spent_attempt_token"  # a token that counted once already (its ack was
# since replaced by a later report of the worker): a network duplicate, never counted again

# the cause a distribution attempt fails with when its ack deadline passed unanswered
ACK_DEADLINE_PASSED = "ack_deadline_passed"
# how long a distribution attempt waits for acks by default (seconds, deployment clock)
DEFAULT_ACK_TIMEOUT = 600.0

# ActivationResult reasons beyond those of activate_policy_version
NOT_COMMITTED = "artifact_not_committed"
NOT_AWAITING = "not_awaiting_acks"

# failure states whose rollouts must stay quarantined (the version never became active)
QUARANTINE_STATES = ("commit_failed", "distribution_failed", "abandoned")


class _Default(enum.Enum):
    CURRENT_POINTER = "current pointer"


CURRENT_POINTER = _Default.CURRENT_POINTER


@attrs.frozen
class AckResult:
    """How a worker's report was taken: `counted` (an ack of the current attempt that counts
    toward activation), `recorded` (stored as the worker's latest report, counted or not),
    and the reason (COUNTED, REPORTED, NOT_REQUIRED, or why it was refused)."""

    counted: bool
    reason: str
    recorded: bool = False


def random_token(version: int, attempt: int, worker_id: str) -> str:
    """A fresh attempt token: 128 random bits, unrelated to anything a worker could replay."""
    del version, attempt, worker_id  # the arguments serve deterministic sources (explorer)
    return secrets.token_hex(16)


TokenSource = Callable[[int, int, str], str]


@attrs.frozen
class ActivationResult:
    """The outcome of one activation attempt; on refusal the pointer is the unchanged one."""

    activated: bool
    reason: str
    active_pointer: ActivePointer | None
    missing_workers: tuple[str, ...] = ()
    mismatched_workers: tuple[str, ...] = ()


@attrs.frozen
class Settled:
    """What `settle` resolved: versions activated (every ack was in), versions failed at
    their ack deadline, and (version, deadline) of each attempt still awaiting acks."""

    activated: tuple[int, ...]
    failed: tuple[int, ...]
    awaiting: tuple[tuple[int, float | None], ...]


@attrs.frozen
class PendingWork:
    """What a restarted caller must still drive: distribute, retry, fail or abandon."""

    pointer: ActivePointer | None
    prepared: tuple[ArtifactRecord, ...]
    committed: tuple[ArtifactRecord, ...]
    awaiting_acks: tuple[ArtifactRecord, ...]
    distribution_failed: tuple[ArtifactRecord, ...]
    quarantined_versions: tuple[int, ...]


@attrs.frozen
class CoordinatorStatistics:
    """Durable state counts plus this coordinator object's own counters."""

    artifacts: int
    by_state: dict[str, int]
    pointer: ActivePointer | None
    max_version: int | None
    required_workers: tuple[str, ...]
    workers_in_sync: tuple[str, ...]
    workers_out_of_sync: tuple[str, ...]
    acks: dict[str, int]
    activation_attempts: dict[str, int]


def judge_ack(report: WorkerReport, ack: WorkerAck) -> str:
    """Where `ack` stands against the worker's stored report: COUNTED or why it is ignored.

    The same report delivered twice is a DUPLICATE even if one copy was stored without its
    token (it arrived when its version no longer awaited acks): tokens bind an ack to an
    attempt, they do not make it a different report.
    """
    if ack.incarnation < report.floor:
        return STALE_INCARNATION
    latest = report.ack
    if latest is None:
        return COUNTED
    key, latest_key = (ack.incarnation, ack.seq), (latest.incarnation, latest.seq)
    if key == latest_key:
        same = attrs.evolve(ack, token=None) == attrs.evolve(latest, token=None)
        return DUPLICATE if same else CONFLICTING
    return COUNTED if key > latest_key else OUT_OF_ORDER


def judge_spent(
    view: RegistryView, rec: ArtifactRecord, report: WorkerReport, ack: WorkerAck
) -> str | None:
    """Why an ack that echoes its current token and passed the ordering judgement may still
    not count: a token counts once. When an ack echoing it was counted already, a copy of
    that ack still standing as the worker's report is a DUPLICATE; any other ack echoing it
    is SPENT_ATTEMPT_TOKEN (the worker reported something else since, or restarted: this is
    a network duplicate of a voided ack, or an ack the attempt can no longer take; a retry
    issues fresh tokens). Judged without `seq`, so it holds in the README's form, where seq
    is numbered by arrival."""
    mine = current_tokens(view, rec).get(ack.worker_id)
    if mine is None or not mine.spent:
        return None
    standing = report.ack
    if standing is not None and attrs.evolve(ack, seq=None) == attrs.evolve(standing, seq=None):
        return DUPLICATE
    return SPENT_ATTEMPT_TOKEN


def number_ack(report: WorkerReport, ack: WorkerAck) -> WorkerAck:
    """The ack with `seq` filled in if the worker left it out: one past the worker's latest
    report of the same incarnation (arrival order). A seq the worker gave stands.

    Only the ordering of one worker's reports is numbered here: which attempt an ack answers
    is never inferred from its arrival (that is what let a late ack count); it is the token
    the worker echoes (`judge_token`).
    """
    if ack.seq is not None:
        return ack
    latest = report.ack
    same = latest is not None and latest.incarnation == ack.incarnation
    seq = (latest.seq or 0) + 1 if same and latest is not None else 0
    return attrs.evolve(ack, seq=seq)


def judge_token(view: RegistryView, rec: ArtifactRecord, ack: WorkerAck) -> str | None:
    """Why an ack of `rec` (awaiting acks) does not answer its current attempt; None if it does."""
    if ack.token is None:
        return MISSING_ATTEMPT_TOKEN
    tokens = current_tokens(view, rec)
    mine = tokens.get(ack.worker_id)
    if mine is not None and mine.token == ack.token:
        return None
    if any(t.token == ack.token for w, t in tokens.items() if w != ack.worker_id):
        return FOREIGN_ATTEMPT_TOKEN
    return STALE_ATTEMPT_TOKEN


def membership_step(
    view: RegistryView, new: tuple[str, ...], reason: str, at: float, new_token: TokenSource
) -> RegistryStep:
    """Record `new` as the worker set: leavers lose their ack and tokens in the same step (an
    ack said what a member held; a worker that left may load anything before it re-joins),
    and a joiner is issued a fresh token for the version awaiting acks, if any."""
    old = view.required_workers() or ()
    leavers = tuple(w for w in old if w not in new)
    joiners = [w for w in new if w not in old]
    voided = tuple(
        WorkerReport(w, r.floor, None)
        for w in leavers
        if (r := view.worker(w)) is not None and r.ack is not None
    )
    tokens = tuple(
        AttemptToken(a.version, w, a.attempts, new_token(a.version, a.attempts, w))
        for a in view.awaiting()
        for w in joiners
    )
    return RegistryStep(
        at,
        membership=new,
        membership_reason=reason,
        workers=voided,
        tokens=tokens,
        revoked=leavers,
    )


def _change(
    rec: ArtifactRecord,
    event: str,
    guards: dict[str, bool] | None = None,
    *,
    acks: tuple[WorkerAck, ...] = (),
    required_workers: tuple[str, ...] = (),
    **fields: Any,
) -> ArtifactChange:
    """The record after `event`, per the declared machine (IllegalTransition if refused)."""
    edge = ACTIVATION.resolve(rec.state, event, guards)
    after = attrs.evolve(rec, state=edge.dest, **fields)
    return ArtifactChange(event, rec, after, acks, required_workers)


def _version(v: object, what: str = "version") -> int:
    """A version under the records' one limit (a signed 64-bit column on every backend)."""
    try:
        return check_int64(v, what)
    except InvalidRecord as exc:
        raise ActivationError(str(exc)) from None


def _text(v: object, what: str, *, free: bool = False) -> str:
    """An id (worker, hash, token) under the records' one limit for ids; `free` text (a
    reason, a cause) has no length limit but must be storable all the same."""
    problem = text_problem(v, max_length=None if free else MAX_ID_LENGTH)
    if problem is not None:
        raise ActivationError(f"{what} {problem}")
    assert isinstance(v, str)
    return v


def check_expected_policy(registry: RegistryStore, expected: AdmissionPolicy) -> None:
    """Refuse (ActivationError) unless `registry` records exactly `expected`; the message
    gives the operator's command that records it, naming this registry's database."""
    stored = registry.policy()
    if stored == expected:
        return
    command = set_policy_command(backend_url(registry), expected)
    if stored is None:
        raise ActivationError(
            f"the registry records no admission policy, and a coordinator never sets it "
            f"(this one expects {expected!r}): the policy is the operator's. If that is the "
            f"deployment's policy, the operator records it first with: {command}"
        )
    raise ActivationError(
        f"the registry records admission policy {stored!r}; this coordinator expects "
        f"{expected!r}. Run it with the deployment's policy (or without policy=); if the "
        f"deployment's policy must change, the operator records it with: {command}"
    )


def _detail(v: object) -> str:
    """A failure's detail: free text, or empty (refused typed like every other text)."""
    return "" if v == "" else _text(v, "detail", free=True)


def _activation(
    view: RegistryView, rec: ArtifactRecord, now: float
) -> tuple[RegistryStep, ActivationResult]:
    """The step that activates `rec` (awaiting acks) if activate_policy_version says so on
    the stored state, with the decision; a step that writes nothing otherwise."""
    pointer = view.pointer()
    decision = activation_decision(view, rec)
    reports = counted_acks(view, rec)
    required = required_set(view)
    p = decision["active_pointer"]
    result = ActivationResult(
        activated=decision["activated"],
        reason=decision["reason"],
        active_pointer=None if p is None else ActivePointer(**p),
        missing_workers=tuple(decision["missing_workers"]),
        mismatched_workers=tuple(decision["mismatched_workers"]),
    )
    if not result.activated:
        return RegistryStep(now), result
    # only acks that exist are recorded: the spec, not a KeyError, must judge a bad decision
    used = tuple(reports[w] for w in required if w in reports)
    changes = [_change(rec, "activate", {"all_acked": True}, acks=used, required_workers=required)]
    if pointer is not None:
        changes.append(_change(_get(view, pointer.version), "supersede"))
    return RegistryStep(now, tuple(changes), pointer=result.active_pointer), result


def _awaiting(rec: ArtifactRecord, now: float) -> str:
    """'v3 is still awaiting acks (...)', saying when its attempt's deadline passes."""
    if rec.ack_deadline is None:
        when = "its attempt records no ack deadline (written before deadlines existed)"
    elif now >= rec.ack_deadline:
        when = f"its ack deadline passed {now - rec.ack_deadline:.0f} s ago"
    else:
        when = (
            f"its ack deadline passes in {rec.ack_deadline - now:.0f} s; then any "
            "coordinator's next distribute, retry, rollback, resume or settle fails it"
        )
    return f"v{rec.version} is still awaiting acks ({when})"


def _timeout(v: object) -> float:
    """An ack timeout: a finite number of seconds > 0."""
    try:
        ok = not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v) and v > 0
    except OverflowError:
        ok = False
    if not ok:
        raise ActivationError(f"ack_timeout must be a finite number of seconds > 0, got {brief(v)}")
    assert isinstance(v, int | float)
    return float(v)


def _get(view: RegistryView, version: int) -> ArtifactRecord:
    rec = view.artifact(_version(version))
    if rec is None:
        raise ActivationError(f"artifact v{version} is not registered; call prepare first")
    return rec


class ActivationCoordinator:
    """Drives each artifact version through the ACTIVATION machine over a RegistryStore."""

    def __init__(
        self,
        registry: RegistryStore,
        required_workers: Iterable[str] | None = None,
        *,
        ledger: Ledger | None = None,
        clock: Callable[[], float] | None = None,
        policy: AdmissionPolicy | None = None,
        new_token: TokenSource = random_token,
        ack_timeout: float = DEFAULT_ACK_TIMEOUT,
    ) -> None:
        """Attach to `registry`, whose durable required worker set every coordinator shares.

        On a registry without one, `required_workers` sets it (a recorded membership
        change). On a registry that has one, `required_workers` may be omitted, and if
        given must equal it: a second coordinator with another set is refused, so it can
        never move the pointer on a partial worker set. Change the set explicitly with
        `change_membership`.

        `policy` is what this coordinator EXPECTS the deployment's admission policy to be;
        it is never written (the policy is the operator's alone: `rollout-lifecycle
        deployment set-policy`, or `set_admission_policy`). When the registry records no
        policy, or another one, construction is refused with ActivationError naming the
        command that records it on this very database, so a misconfigured process that
        starts first can neither set the deployment's policy nor run under another one.
        `new_token(version, attempt, worker_id)` makes attempt tokens: random by default; a
        deterministic source is for exhaustive exploration only.

        `ack_timeout` (seconds, > 0) is how long each distribution attempt waits for acks:
        its deadline is recorded on the artifact from the deployment's clock (PostgreSQL's
        server clock, the SQLite file's host clock), and once it has passed the next
        coordinator action that a pending attempt would block fails it (see `settle`).
        """
        self.registry = registry
        self.ledger = ledger
        self.ack_timeout = _timeout(ack_timeout)
        self._injected_clock = clock is not None
        # steps are dated by the registry's clock where it has one (the SQLite file's host
        # clock), so ledger and registry events of one trace share one time line
        self.clock: Callable[[], float] = (
            clock if clock is not None else getattr(registry, "clock", time.time)
        )
        self.new_token = new_token
        wanted = None if required_workers is None else check_membership(required_workers)
        expected = None if policy is None else check_policy(policy)
        if expected is not None:  # before any write: a refused coordinator records nothing
            check_expected_policy(registry, expected)

        def plan(view: RegistryView) -> tuple[RegistryStep, None]:
            initial = reconcile_membership(view.required_workers(), wanted)
            if initial is None:
                return RegistryStep(self.clock()), None
            step = membership_step(
                view, initial, "initial membership", self.clock(), self.new_token
            )
            return step, None

        self._step(plan)
        self._acks: Counter[str] = Counter()
        self._attempts: Counter[str] = Counter()
        self._counter_lock = threading.Lock()

    @property
    def required_workers(self) -> tuple[str, ...]:
        """The deployment's required workers, read from the durable registry."""
        stored = self.registry.required_workers()
        if stored is None:
            raise ActivationError("the registry records no required workers")
        return stored

    def change_membership(self, workers: Iterable[str], reason: str) -> tuple[str, ...]:
        """Replace the required worker set: an explicit, recorded step of its own.

        Activations after it wait for every worker of the new set. The reason is kept in
        the trace (who decided, why), so a membership change is never silent. A worker that
        leaves loses its stored ack and its attempt tokens in this step: whatever it acks
        before re-joining never counts. A worker that joins while a version awaits acks is
        issued a fresh token for that version's current attempt (read it with
        `attempt_token`); its stored report, if any, stands until it acks with that token.
        """
        new = check_membership(workers)
        why = _text(reason, "reason", free=True)

        def plan(view: RegistryView) -> tuple[RegistryStep, tuple[str, ...]]:
            if view.required_workers() == new:
                return RegistryStep(self.clock()), new
            return membership_step(view, new, why, self.clock(), self.new_token), new

        return self._step(plan)[0]

    # ---- plumbing ----------------------------------------------------------------------

    def _step(
        self, plan: Callable[[RegistryView], tuple[RegistryStep, R]]
    ) -> tuple[R, list[ArtifactChanged]]:
        return self.registry.transact(plan)

    def _now(self, view: RegistryView) -> float:
        """The deployment's time for a step: read inside the step where the store keeps the
        clock (PostgreSQL's server clock), else the registry's (the SQLite file's host
        clock) or this process's; an injected `clock` (tests, simulations) wins."""
        if not self._injected_clock:
            read = getattr(view, "now", None)
            if callable(read):
                return float(read())
        return self.clock()

    def _move(
        self,
        version: int,
        event: str,
        fields: Callable[[ArtifactRecord], dict[str, Any]],
        *,
        exclusive: bool = False,
    ) -> ArtifactRecord:
        """One plain machine event on one artifact, as one atomic step.

        `exclusive` refuses the step while another version awaits acks: a worker's report
        says what it loaded at that moment, so two distributions in flight let a worker ack
        one version and then load the other, and the first could activate on an ack that no
        longer holds (the explorer found this with two workers and two versions). It also
        refuses a version no newer than the active one: it could never activate, and it
        would hold the single distribution slot. A distribution attempt (distribute, retry)
        issues every required worker a fresh token in the same step.
        """
        _version(version)

        def plan(view: RegistryView) -> tuple[RegistryStep, ArtifactRecord]:
            rec = _get(view, version)
            now = self._now(view)
            if exclusive:
                busy = [a for a in view.awaiting() if a.version != version]
                if busy:
                    raise ActivationError(
                        f"{_awaiting(busy[0], now)}; activate, fail or abandon it before "
                        f"distributing v{version} (one distribution at a time)"
                    )
            changed = fields(rec)
            if event in ATTEMPT_EVENTS:  # the attempt waits for acks until its deadline
                changed["ack_deadline"] = now + self.ack_timeout
            ch = _change(rec, event, **changed)  # the machine refuses illegal moves
            why = distribution_refusal(view, version) if exclusive else None
            if why is not None:
                raise ActivationError(why)
            tokens: tuple[AttemptToken, ...] = ()
            if event in ATTEMPT_EVENTS:
                n = ch.after.attempts
                tokens = tuple(
                    AttemptToken(version, w, n, self.new_token(version, n, w))
                    for w in required_set(view)
                )
            return RegistryStep(now, (ch,), tokens=tokens), ch.after

        return self._step(plan)[0]

    def _count(self, counter: Counter[str], key: str) -> None:
        with self._counter_lock:
            counter[key] += 1

    def _quarantine(self, version: int, reason: str) -> None:
        if self.ledger is not None:
            self.ledger.quarantine_version(version, reason)

    # ---- the protocol ------------------------------------------------------------------

    def prepare(
        self,
        version: int,
        parent_version: int | None = None,
        rollback_version: int | Literal[_Default.CURRENT_POINTER] | None = CURRENT_POINTER,
        *,
        trained_by: Iterable[str] | None = None,
    ) -> ArtifactRecord:
        """Register a new version in 'prepared'; it must exceed every version ever registered.

        The rollback pointer defaults to the version active now, so an explicit rollback
        later returns exactly there; pass None to record that there is none. The version's
        lineage (the updates whose gradients it contains) is read from the ledger that
        shares the registry, inside this step: its landed updates that no version claims
        yet (each is claimed by at most one). `trained_by` names them instead; each must
        have landed, never been poisoned (a refused commit, a lost lease, a retired
        version) and be claimed by no other version, here, at commit and at activation.
        A deployment whose recorded policy says `lineage="off"` records only what it is
        given, unfenced.
        """
        named: tuple[str, ...] | None = None
        if trained_by is not None:
            if isinstance(trained_by, str) or not isinstance(trained_by, Iterable):
                raise ActivationError(
                    f"trained_by must be a list of update ids, got {brief(trained_by)}"
                )
            try:
                named = ArtifactRecord(0, None, trained_by=tuple(trained_by)).trained_by
            except InvalidRecord as exc:
                raise ActivationError(str(exc)) from None
        _version(version)
        if parent_version is not None:
            _version(parent_version, "parent_version")
            if parent_version >= version:
                raise ActivationError(f"parent v{parent_version} must be older than v{version}")

        def plan(view: RegistryView) -> tuple[RegistryStep, ArtifactRecord]:
            existing = view.artifact(version)
            if existing is not None:
                raise ActivationError(
                    f"version {version} is already registered ({existing.state}); versions are "
                    "never reused: prepare a new, higher version"
                )
            top = view.max_version()
            if top is not None and version <= top:
                raise ActivationError(
                    f"version {version} is not greater than the highest registered version "
                    f"{top}; versions only move forward"
                )
            if rollback_version is CURRENT_POINTER:
                p = view.pointer()
                rb = None if p is None else p.version
            else:
                rb = rollback_version
            if rb is not None and (
                _version(rb, "rollback_version") >= version or view.artifact(rb) is None
            ):
                raise ActivationError(
                    f"rollback pointer v{rb} must be a registered version older than v{version}"
                )
            if named is not None:
                lineage = named
            else:
                lineage = default_lineage(view) if lineage_fenced(view) else ()
            rec = ArtifactRecord(
                version=version,
                artifact_hash=None,
                parent_version=parent_version,
                rollback_version=rb,
                trained_by=lineage,
            )
            ch = ArtifactChange("register", None, rec)
            return RegistryStep(self.clock(), (ch,)), rec

        return self._step(plan)[0]

    def commit_artifact(
        self, version: int, artifact_hash: str, path: str | None = None
    ) -> ArtifactRecord:
        """All files are written and hashed: record the hash, once and for good."""
        _text(artifact_hash, "artifact_hash")
        return self._move(
            version, "commit_artifact", lambda _r: {"artifact_hash": artifact_hash, "path": path}
        )

    def fail_commit(self, version: int, cause: str, detail: str = "") -> ArtifactRecord:
        """The artifact never became complete: stage 'artifact'; its rollouts are quarantined."""
        d = Disposition("artifact", _text(cause, "cause", free=True), _detail(detail))
        rec = self._move(version, "fail_commit", lambda _r: {"failure": d})
        self._quarantine(version, f"artifact v{version} failed to commit: {cause}")
        return rec

    def distribute(self, version: int) -> ArtifactRecord:
        """Weights are being sent: acks are awaited from now on (one more attempt).

        The attempt issues each required worker a fresh token: send it with the weights
        (`attempt_token` / `attempt_tokens`); only an ack echoing it counts, once. Its ack
        deadline is now + `ack_timeout`. Another version's attempt awaiting acks is settled
        first (see `settle`); if it still awaits, this is refused (one at a time).
        """
        self._settle_others(version)
        return self._move(
            version, "distribute", lambda r: {"attempts": r.attempts + 1}, exclusive=True
        )

    def retry(self, version: int) -> ArtifactRecord:
        """Distribute again after a failure; the last failure stays recorded on the record.

        New tokens replace the failed attempt's: an ack of that attempt, however late it
        arrives, is refused ('stale_attempt_token') and never counts for this one. Another
        version's attempt awaiting acks is settled first, as for `distribute`.
        """
        self._settle_others(version)
        return self._move(version, "retry", lambda r: {"attempts": r.attempts + 1}, exclusive=True)

    def fail_distribution(self, version: int, cause: str, detail: str = "") -> ArtifactRecord:
        """Loading failed on some worker: stage 'distribution', pointer unchanged, quarantine."""
        d = Disposition("distribution", _text(cause, "cause", free=True), _detail(detail))
        rec = self._move(version, "fail_distribution", lambda _r: {"failure": d})
        self._quarantine(version, f"distribution of v{version} failed: {cause}")
        return rec

    def abandon(self, version: int, cause: str, detail: str = "") -> ArtifactRecord:
        """Give the version up for good (stage 'distribution': it never got to all workers)."""
        d = Disposition("distribution", _text(cause, "cause", free=True), _detail(detail))
        rec = self._move(version, "abandon", lambda _r: {"failure": d})
        self._quarantine(version, f"v{version} abandoned: {cause}")
        return rec

    def record_ack(self, ack: WorkerAck) -> AckResult:
        """Judge a worker's report and, unless refused, store it as the worker's latest.

        An ack of the version awaiting acks, from a required worker, must echo the token
        that worker was issued for the CURRENT attempt: without one it is refused
        ('missing_attempt_token'), with an earlier attempt's (or a pre-membership-change)
        token 'stale_attempt_token', with another worker's 'foreign_attempt_token'; refused
        acks are not stored and never count. Any other report (a version not awaiting acks,
        or a worker outside the required set) is stored without its token as what the
        worker holds ('reported', 'not_required'): it can block an activation, never help.
        Reports are ordered by (incarnation, seq); `seq` may be left unset (numbered by
        arrival), and a report older than the stored one is refused. A token counts once:
        counting an ack spends its token in the same step, and a later ack echoing it is a
        'duplicate' while the counted one still stands, else 'spent_attempt_token' (the
        worker reported something else since: a duplicate of a voided ack never counts).
        """

        if not isinstance(ack, WorkerAck):
            raise ActivationError(f"record_ack takes a WorkerAck, got {type(ack).__name__}")

        def plan(view: RegistryView) -> tuple[RegistryStep, AckResult]:
            now = self.clock()
            member = ack.worker_id in (view.required_workers() or ())
            rec = view.artifact(ack.version)
            answers = member and rec is not None and rec.state == "awaiting_acks"
            if answers:
                assert rec is not None
                refused = judge_token(view, rec, ack)
                if refused is not None:
                    return RegistryStep(now), AckResult(False, refused)
                stored = ack
            else:
                stored = attrs.evolve(ack, token=None)  # what it holds, never an answer
            report = view.worker(ack.worker_id) or WorkerReport(ack.worker_id)
            numbered = number_ack(report, stored)
            reason = judge_ack(report, numbered)
            if reason == COUNTED and answers:
                assert rec is not None
                reason = judge_spent(view, rec, report, numbered) or COUNTED
            if reason != COUNTED:
                return RegistryStep(now), AckResult(False, reason)
            new = attrs.evolve(report, ack=numbered)
            if answers:
                result = AckResult(True, COUNTED, recorded=True)
            else:
                result = AckResult(False, REPORTED if member else NOT_REQUIRED, recorded=True)
            return RegistryStep(now, workers=(new,)), result

        result = self._step(ReadsWorkers(plan, (ack.worker_id,)))[0]
        self._count(self._acks, result.reason)
        return result

    def worker_restarted(self, worker_id: str, incarnation: int) -> WorkerReport:
        """The worker lost its weights: acks below `incarnation` no longer count, even late ones."""
        _text(worker_id, "worker_id")
        _version(incarnation, "incarnation")

        def plan(view: RegistryView) -> tuple[RegistryStep, WorkerReport]:
            report = view.worker(worker_id) or WorkerReport(worker_id)
            floor = max(report.floor, incarnation)
            ack = report.ack if report.ack is not None and report.ack.incarnation >= floor else None
            new = WorkerReport(worker_id, floor, ack)
            if new == report:
                return RegistryStep(self.clock()), report
            return RegistryStep(self.clock(), workers=(new,)), new

        return self._step(plan)[0]

    def try_activate(self, version: int) -> ActivationResult:
        """Switch the pointer to `version` iff activate_policy_version says so; else change nothing.

        On success one step moves the artifact awaiting_acks -> active (the event carries the
        acks used and the required workers) and the previously active one -> superseded.
        Another version awaiting acks is settled first (see `settle`).
        """
        _version(version)
        self._settle_others(version)

        def plan(view: RegistryView) -> tuple[RegistryStep, ActivationResult]:
            rec = _get(view, version)
            now = self.clock()
            if rec.state != "awaiting_acks":
                reason = NOT_COMMITTED if not rec.committed else NOT_AWAITING
                return RegistryStep(now), ActivationResult(False, reason, view.pointer())
            return _activation(view, rec, now)

        result = self._step(plan)[0]
        self._activated(version, result)
        return result

    def _activated(self, version: int, result: ActivationResult) -> None:
        """Count an activation attempt; lift the ledger's mark of a version that activated."""
        self._count(self._attempts, result.reason)
        if result.activated and self.ledger is not None:
            # a version that failed once and then activated on a retry is good from now on
            self.ledger.clear_bad_version(version)

    def settle(self) -> Settled:
        """Resolve every distribution attempt awaiting acks: the janitor of activation.

        An attempt whose every required worker's counted ack is in is activated (its
        activator died after the acks, or never called try_activate); one whose ack deadline
        has passed (on the deployment's clock) is failed, stage 'distribution', cause
        'ack_deadline_passed', and its version's rollouts are quarantined through the ledger
        as `fail_distribution` does; any other is left alone, never failed before its
        deadline. Each resolution is one atomic step judged on what that step reads, so
        coordinators settling at once resolve each attempt once. `distribute`, `retry`,
        `rollback`, `try_activate` of another version and `resume` settle first, so a
        coordinator killed mid-activation never stalls the deployment for longer than the
        deadline; call it from a loop of your own to resolve sooner.
        """
        activated: list[int] = []
        failed: list[int] = []
        for rec in self.registry.awaiting():  # which to look at; each step reads again
            outcome = self._settle_one(rec.version)
            if outcome == "activated":
                activated.append(rec.version)
            elif outcome == "failed":
                failed.append(rec.version)
        waiting = tuple((a.version, a.ack_deadline) for a in self.registry.awaiting())
        return Settled(tuple(activated), tuple(failed), waiting)

    def _settle_one(self, version: int) -> str:
        """Resolve `version`'s attempt if it can be: 'activated', 'failed' or 'waiting'."""

        def plan(view: RegistryView) -> tuple[RegistryStep, tuple[str, ActivationResult | None]]:
            rec = _get(view, version)
            now = self._now(view)
            if rec.state != "awaiting_acks":
                return RegistryStep(now), ("waiting", None)
            step, result = _activation(view, rec, now)
            if result.activated:
                return step, ("activated", result)
            if rec.ack_deadline is None or now < rec.ack_deadline:
                return RegistryStep(now), ("waiting", None)
            missing = sorted({*result.missing_workers, *result.mismatched_workers})
            d = Disposition(
                "distribution",
                ACK_DEADLINE_PASSED,
                f"attempt {rec.attempts}: no matching ack of the current attempt from "
                f"{missing} by its deadline {rec.ack_deadline!r} (settled at {now!r})",
            )
            return RegistryStep(now, (_change(rec, "fail_distribution", failure=d),)), (
                "failed",
                None,
            )

        outcome, result = self._step(plan)[0]
        if result is not None:
            self._activated(version, result)
        if outcome == "failed":
            self._quarantine(version, f"distribution of v{version} failed: {ACK_DEADLINE_PASSED}")
        return outcome

    def _settle_others(self, version: int | None = None) -> Settled | None:
        """Settle first when a version other than `version` awaits acks (it would block)."""
        if any(a.version != version for a in self.registry.awaiting()):
            return self.settle()
        return None

    def policy(self) -> AdmissionPolicy | None:
        """The deployment's recorded admission policy (None until one is set)."""
        return self.registry.policy()

    def rollback(
        self, *, keep_rollouts: bool = False, reason: str = "operator rollback"
    ) -> ActivePointer:
        """Return to the active artifact's recorded rollback pointer, in one atomic step.

        The rolled-back version is retired: the step records it on the artifact (cause
        'rolled_back'), every later reservation of its rollouts is refused inside the
        reservation's own step, and the attached ledger quarantines its open rollouts and
        every late arrival. `keep_rollouts=True` is the operator's explicit choice to keep
        them trainable; it is recorded too (cause 'rolled_back_kept', with `reason`).

        Refused with ActivationError (nothing changed) when nothing is active, no rollback
        pointer was recorded, that version is not 'superseded', or a distribution awaits
        acks (workers reload the rollback target, so an ack collected before the rollback
        would no longer say what they hold: the stateful machines found that race). Workers
        still hold the rolled-back weights until they reload: see
        `statistics().workers_out_of_sync`. A distribution awaiting acks is settled first
        (see `settle`); if settling activated it, the active version is no longer the one
        the caller meant to roll back, so the call is refused: call it again to roll back
        the version that is active now.
        """

        def plan(view: RegistryView) -> tuple[RegistryStep, tuple[ActivePointer, int]]:
            busy = view.awaiting()
            if busy:
                raise ActivationError(
                    f"{_awaiting(busy[0], self.clock())}; activate, fail or abandon it before "
                    "a rollback"
                )
            pointer = view.pointer()
            if pointer is None:
                raise ActivationError("no version is active, so there is nothing to roll back")
            current = _get(view, pointer.version)
            target_v = current.rollback_version
            if target_v is None:
                raise ActivationError(f"v{current.version} has no recorded rollback pointer")
            target = view.artifact(target_v)
            if target is None or target.state != "superseded" or target.artifact_hash is None:
                state = None if target is None else target.state
                raise ActivationError(
                    f"rollback target v{target_v} is {state}, not 'superseded'; refusing"
                )
            new = ActivePointer(target.version, target.artifact_hash)
            d = Disposition("activation", ROLLBACK_KEPT if keep else ROLLBACK_RETIRED, why)
            changes = (_change(current, "roll_back", failure=d), _change(target, "reinstate"))
            return RegistryStep(self.clock(), changes, pointer=new), (new, current.version)

        if not isinstance(keep_rollouts, bool):
            raise ActivationError(
                f"keep_rollouts must be True or False, got {brief(keep_rollouts)}"
            )
        keep, why = keep_rollouts, _text(reason, "reason", free=True)
        settled = self._settle_others()
        if settled is not None and settled.activated:
            raise ActivationError(
                f"settling the pending distribution activated v{settled.activated[-1]} (every "
                "required worker's ack of it was in): the active version changed, nothing was "
                "rolled back; call rollback() again to roll back the version active now"
            )
        pointer, rolled = self._step(plan)[0]
        if not keep:
            self._quarantine(rolled, f"v{rolled} rolled back: {why}")
        return pointer

    # ---- reading -----------------------------------------------------------------------

    def pointer(self) -> ActivePointer | None:
        """The active pointer (None before the first activation)."""
        return self.registry.pointer()

    def artifact(self, version: int) -> ArtifactRecord:
        """The record of `version`; ActivationError if it was never registered."""
        rec = self.registry.artifact(_version(version))
        if rec is None:
            raise ActivationError(f"artifact v{version} is not registered")
        return rec

    def artifacts(self) -> list[ArtifactRecord]:
        """Every record, by version."""
        return self.registry.artifacts()

    def reports(self) -> dict[str, WorkerAck]:
        """The latest stored report of each worker that has one (durable), members or not:
        what each worker last said it holds. Only acks echoing a current token count."""
        return {w: r.ack for w, r in self.registry.workers().items() if r.ack is not None}

    def attempt_tokens(self, version: int) -> dict[str, str]:
        """The token of each required worker for `version`'s current distribution attempt.

        Send each worker its own with the weights; its ack must echo it (`WorkerAck.token`,
        or `WorkerLoader.load(..., token=...)`). ActivationError when `version` is not
        registered or not awaiting acks (a report of it needs no token).
        """
        _version(version)

        def plan(view: RegistryView) -> tuple[RegistryStep, dict[str, str]]:
            # one read of the record, the tokens and the worker set: the answer (tokens, or
            # why there are none) is true at one instant (issue 33)
            rec = view.artifact(version)
            if rec is None:
                raise ActivationError(f"artifact v{version} is not registered")
            if rec.state != "awaiting_acks":
                raise ActivationError(
                    f"v{version} is {rec.state}, not awaiting acks: no distribution attempt of "
                    "it is open, so there is no token to echo (a worker reports what it holds "
                    "without one; distribute or retry the version to open an attempt)"
                )
            tokens = {t.worker_id: t for t in view.attempt_tokens(version)}
            required = view.required_workers()
            if required is None:
                raise ActivationError("the registry records no required workers")
            out = {
                w: t.token
                for w in required
                if (t := tokens.get(w)) is not None and t.attempt == rec.attempts
            }
            missing = [w for w in required if w not in out]
            if missing:
                raise ActivationError(
                    f"no token is stored for {missing} on v{version} attempt {rec.attempts}; "
                    "retry the distribution"
                )
            return RegistryStep(self.clock()), out

        return self._step(plan)[0]

    def attempt_token(self, worker_id: str, version: int) -> str:
        """The token `worker_id` must echo to ack `version`'s current distribution attempt.

        ActivationError when `version` is not awaiting acks, or `worker_id` is not in the
        required worker set (add it with change_membership: it is issued a token then).
        """
        _text(worker_id, "worker_id")
        # only this worker's token is read: on PostgreSQL with roles a worker sees its own
        # tokens and no other worker's (row-level security), so `attempt_tokens` is the
        # coordinator's
        rec = self.artifact(version)
        if rec.state != "awaiting_acks":
            self.attempt_tokens(version)  # raises: no attempt of it is open
        required = self.required_workers
        if worker_id not in required:
            raise ActivationError(
                f"{worker_id!r} is not a required worker ({sorted(required)}), so it has no "
                f"token for v{version}: its reports are recorded but never count; add it "
                "with change_membership() to issue it one"
            )
        for t in self.registry.attempt_tokens(version):
            if t.worker_id == worker_id and t.attempt == rec.attempts:
                return t.token
        raise ActivationError(
            f"no token is stored for {[worker_id]} on v{version} attempt {rec.attempts} (the "
            "registry changed meanwhile?); read again, or retry the distribution"
        )

    def activated_hash(self, version: int) -> str | None:
        """The hash of `version` if it ever became active, else None (an admission registry)."""
        return activated_hash(self.registry, version)

    def history(self, version: int | None = None) -> list[ArtifactChanged]:
        """Artifact events in global order, optionally of one version."""
        return self.registry.history(version)

    def trace(self) -> list[TraceEvent]:
        """Every registry event: artifacts, membership changes, worker reports."""
        return self.registry.trace()

    def statistics(self) -> CoordinatorStatistics:
        """Counts by state, which required workers hold the active version, and counters
        (the registry read in one step: the figures are of one instant)."""

        def plan(view: RegistryView) -> tuple[RegistryStep, tuple[Any, ...]]:
            read = (view.artifacts(), view.pointer(), view.workers())
            return RegistryStep(self.clock()), (*read, view.required_workers(), view.max_version())

        arts, pointer, workers, stored, top = self._step(plan)[0]
        if stored is None:
            raise ActivationError("the registry records no required workers")
        required: tuple[str, ...] = stored
        reports = {w: r.ack for w, r in workers.items() if r.ack is not None}
        by_state = Counter(a.state for a in arts)
        in_sync = tuple(
            w
            for w in required
            if pointer is not None
            and (a := reports.get(w)) is not None
            and (a.version, a.artifact_hash) == (pointer.version, pointer.artifact_hash)
        )
        return CoordinatorStatistics(
            artifacts=len(arts),
            by_state={s: by_state.get(s, 0) for s in ACTIVATION.states},
            pointer=pointer,
            max_version=top,
            required_workers=required,
            workers_in_sync=in_sync,
            workers_out_of_sync=tuple(w for w in required if w not in in_sync),
            acks=self._snapshot(self._acks),
            activation_attempts=self._snapshot(self._attempts),
        )

    def _snapshot(self, counter: Counter[str]) -> dict[str, int]:
        with self._counter_lock:
            return dict(counter)

    def resume(self) -> PendingWork:
        """After a restart: settle attempts awaiting acks (`settle`: activate one whose acks
        are all in, fail one past its deadline), re-apply ledger quarantine for failed and
        retired (rolled-back) versions (idempotent), and return what is still pending, so
        the caller can re-distribute, retry or fail it."""
        self.settle()
        arts = self.registry.artifacts()
        retired = retired_versions(arts)
        failed = [a for a in arts if a.state in QUARANTINE_STATES or a.version in retired]
        for a in failed:
            cause = a.failure.cause if a.failure is not None else a.state
            self._quarantine(a.version, f"v{a.version} {a.state} (resumed): {cause}")
        if self.ledger is not None:
            for a in arts:  # a crash between activation and lifting the mark is healed too
                if a.state == "active" and a.version in self.ledger.bad_versions:
                    self.ledger.clear_bad_version(a.version)

        def of(state: str) -> tuple[ArtifactRecord, ...]:
            return tuple(a for a in arts if a.state == state)

        return PendingWork(
            pointer=self.registry.pointer(),
            prepared=of("prepared"),
            committed=of("committed"),
            awaiting_acks=of("awaiting_acks"),
            distribution_failed=of("distribution_failed"),
            quarantined_versions=tuple(a.version for a in failed) if self.ledger else (),
        )
