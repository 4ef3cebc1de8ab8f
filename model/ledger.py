"""The revisioned rollout ledger: protocol, shared planning logic, and the in-memory backend.

Every backend (memory, SQLite, PostgreSQL) shares the *planning* functions here: given the
entry as read and the request, they decide the outcome and the new entry by asking the
declared lifecycle machine. Backends differ only in how they make "check the revision and
write" one indivisible step (a lock here, a single-statement compare-and-set in SQL).
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from rollout_lifecycle.model import rules
from rollout_lifecycle.model.errors import (
    CommitMismatch,
    DuplicateRollout,
    InvalidLedgerArgument,
    LedgerError,
    RevisionConflict,
    UnknownRollout,
    brief,
)
from rollout_lifecycle.model.events import Change, EntryChanged, EventLog
from rollout_lifecycle.model.machines import LIFECYCLE
from rollout_lifecycle.model.pacing import (
    LIVE_STATES,
    DispatchOutcome,
    DispatchPremise,
    PacingRow,
    PacingStatistics,
    check_chain,
    oldest_first,
    pacing_from,
    plan_dispatch,
    row_of,
    stale_disposition,
    window_floor,
)
from rollout_lifecycle.model.records import (
    AdmissionPolicy,
    AdmissionStamp,
    Disposition,
    LedgerEntry,
    Reward,
    Rollout,
    text_problem,
)

Clock = Callable[[], float]

# reasons a reservation returns (the first four are CONTRACT section 5's)
RESERVED = "reserved"
IDEMPOTENT = "idempotent_retry"
CONFLICT = "revision_conflict"
NOT_REWARDED = "not_rewarded"
MISSING = "missing_rollout"
# refusals decided inside the reservation's atomic step (model.rules.reservation_refusal)
NOT_ADMITTED = rules.NOT_ADMITTED
POINTER_MOVED = rules.POINTER_MOVED
VERSION_NOT_ACTIVE = rules.VERSION_NOT_ACTIVE
STAMP_CONTRADICTS = rules.STAMP_CONTRADICTS
NO_POLICY = rules.NO_POLICY
LOOSER_THAN_POLICY = rules.LOOSER_THAN_POLICY
VERSION_RETIRED = rules.VERSION_RETIRED

# events that `transition` may fire directly (reserve/commit/abort/expiry have their own calls)
DIRECT_EVENTS = frozenset(
    {
        "generation_done",
        "reward_ready",
        "generation_failed",
        "reward_timeout",
        "reward_error",
        "quarantine",
        "retire_stale",
    }
)


def check_lease_seconds(lease_seconds: object) -> float:
    """A lease length must be a finite number of seconds > 0 (NaN or inf never expire)."""
    try:
        ok = (
            not isinstance(lease_seconds, bool)
            and isinstance(lease_seconds, int | float)
            and math.isfinite(lease_seconds)
            and 0 < lease_seconds <= 10**12
        )
    except OverflowError:
        ok = False
    if not ok:
        raise InvalidLedgerArgument(
            f"lease_seconds must be a finite number of seconds in (0, 1e12], got "
            f"{brief(lease_seconds)}"
        )
    assert isinstance(lease_seconds, int | float)
    return float(lease_seconds)


class ManualClock:
    """A clock tests and simulations move by hand, so lease expiry is deterministic."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move time forward (never backward) and return the new time."""
        if seconds < 0:
            raise ValueError("a clock only moves forward")
        self.now += seconds
        return self.now


@attrs.frozen
class RecoveryRule:
    """Decides, for a returned reservation (abort or expired lease), quarantine vs release.

    Quarantine when the rollout's behaviour version was marked bad (a failed activation:
    its data came from weights that never became active), or when it was already released
    `max_releases` times (a poison rollout that keeps killing updates). Otherwise release.
    """

    max_releases: int = 3

    def quarantine_cause(self, entry: LedgerEntry, bad_versions: Iterable[int]) -> str | None:
        """The cause to quarantine with, or None to release."""
        if entry.behavior_version in set(bad_versions):
            return "failed_version"
        if entry.releases >= self.max_releases:
            return "too_many_releases"
        return None


@attrs.frozen
class ReserveRequest:
    """One item of a batch reservation: the revision the learner read and its admission."""

    rollout_id: str
    expected_revision: int
    admission: AdmissionStamp | None


@attrs.frozen
class ReserveOutcome:
    """Result of one compare-and-set reservation; `entry` is the record after the attempt.

    `detail` says more about a refusal (which figure of the stamp failed, how far the
    pointer moved); it is empty on success.
    """

    rollout_id: str
    reserved: bool
    reason: str
    entry: LedgerEntry | None
    detail: str = ""


@attrs.frozen
class ActivationPremise:
    """What a reservation step read of the deployment's registry, inside that same step.

    `pointer_version` is the active version at that moment (None: none is active);
    `was_active` the versions that were ever the active pointer; `policy` the recorded
    admission policy (None: none recorded); `retired` the rolled-back versions whose
    rollouts are retired. `was_active` None means no registry is attached to the ledger,
    and only the admission stamp itself is judged.
    """

    pointer_version: int | None
    was_active: frozenset[int] | None
    policy: AdmissionPolicy | None = None
    retired: frozenset[int] = frozenset()

    def refusal(
        self, admission: AdmissionStamp | None, behavior_version: int
    ) -> tuple[str, str] | None:
        """(reason, detail) when the reservation may not land now; None when it may."""
        return rules.reservation_refusal(
            admission,
            behavior_version,
            self.pointer_version,
            self.was_active,
            self.policy,
            self.retired,
        )


NO_REGISTRY = ActivationPremise(None, None)


class ActivationSource(Protocol):
    """A registry a ledger reads inside its own atomic step (the memory registry)."""

    @property
    def lock(self) -> threading.RLock:
        """The lock that makes the registry's steps atomic; the ledger shares it."""
        ...

    def premise(self) -> ActivationPremise:
        """The pointer and ever-active versions now (the caller holds `lock`)."""
        ...


class WriteRefused(LedgerError, ValueError):
    """A write that would break a rule of the spec; it was refused before anything landed."""


def enforce(afters: Iterable[LedgerEntry]) -> None:
    """Refuse a step whose records break a per-record rule (model.rules.entry_problems)."""
    problems = [m for e in afters for m in rules.entry_problems(e)]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise WriteRefused("refused, nothing written: " + "; ".join(problems[:5]) + more)


# Counters of outcomes that write nothing (a lost compare-and-set, a refusal, an idempotent
# retry). A losing racer must write nothing at all, so the durable ledgers keep these per
# ledger object: statistics() of a later process reads 0 for them (`ledger counts` says so).
PROCESS_LOCAL_COUNTERS = frozenset({"cas_conflicts", "refused", "idempotent_retries"})


@attrs.frozen
class LedgerStatistics:
    """Counters for introspection and the fuzz report."""

    entries: int
    by_state: dict[str, int]
    writes: int
    reservations: int
    idempotent_retries: int
    cas_conflicts: int
    refused: int
    commits: int
    aborts: int
    expirations: int
    bad_versions: tuple[int, ...]
    # staleness of what was trained, attempts per prompt, wasted generation, length bias
    pacing: PacingStatistics | None = None


# ---- planning (shared by every backend) ---------------------------------------------------


_LIVE = frozenset(LIVE_STATES)


def check_limit(value: object) -> int:
    """A result limit: a non-negative int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidLedgerArgument(f"limit must be a non-negative int, got {brief(value)}")
    return value


def check_revision(value: object, what: str = "expected_revision") -> int:
    """A revision the caller read: a non-negative int (never a bool or a float)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**63 - 1:
        raise InvalidLedgerArgument(f"{what} must be a non-negative int, got {brief(value)}")
    return value


def check_id(value: object, what: str = "rollout_id") -> str:
    """An id argument under the records' one limit for ids (length, no NUL, valid Unicode):
    every backend refuses the same ids before touching storage."""
    problem = text_problem(value)
    if problem is not None:
        raise InvalidLedgerArgument(f"{what} {problem}")
    assert isinstance(value, str)
    return value


def check_update_id(update_id: object) -> str:
    """An update id: a non-empty string under the records' limit for ids."""
    return check_id(update_id, "update_id")


def check_requests(requests: object) -> list[ReserveRequest]:
    """A batch: ReserveRequests, each rollout named once, each with a valid revision."""
    if isinstance(requests, str | bytes) or not isinstance(requests, Sequence):
        raise InvalidLedgerArgument(
            f"a batch is a list of ReserveRequest, got {type(requests).__name__}"
        )
    out = list(requests)
    for r in out:
        if not isinstance(r, ReserveRequest):
            raise InvalidLedgerArgument(f"a batch holds ReserveRequest items, got {brief(r)}")
        check_id(r.rollout_id)
        check_revision(r.expected_revision)
        if r.admission is not None and not isinstance(r.admission, AdmissionStamp):
            raise InvalidLedgerArgument(
                f"admission must be an AdmissionStamp or None, got {brief(r.admission)}"
            )
    seen = Counter(r.rollout_id for r in out)
    dups = [k for k, n in seen.items() if n > 1]
    if dups:
        raise InvalidLedgerArgument(f"a batch names rollouts more than once: {sorted(dups)[:5]}")
    return out


def dispatch_entry(rollout: object, chain: object) -> LedgerEntry:
    """What `dispatch` accepts, validated before any lock: a new entry without a chain of
    its own (the ledger numbers the attempt), and a chain key."""
    entry = as_entry(rollout)
    key = check_chain(chain)
    if entry.chain is not None:
        raise WriteRefused(
            f"rollout {brief(entry.rollout_id)}: dispatch assigns the chain and attempt; "
            f"pass a rollout without them (got chain {brief(entry.chain)})"
        )
    plan_add(attrs.evolve(entry, chain=key, attempt=1), (), dispatched=True)
    return entry


def as_entry(rollout: object) -> LedgerEntry:
    """What `add` accepts: a Rollout (its entry at dispatch) or a LedgerEntry."""
    if isinstance(rollout, Rollout):
        return rollout.entry()
    if isinstance(rollout, LedgerEntry):
        return rollout
    raise InvalidLedgerArgument(
        f"add() takes a Rollout or a LedgerEntry, got {type(rollout).__name__}"
    )


_EVOLVERS: dict[tuple[type[Any], frozenset[str]], Callable[..., Any]] = {}


def _evolver(cls: type[Any], changed: frozenset[str]) -> Callable[..., Any]:
    """attrs.evolve for one class and one set of changed fields, written out once: a direct
    call of the class's own __init__ (its validators and post-init check still run)."""
    fields = [a for a in attrs.fields(cls) if a.init]
    unknown = changed - {a.alias for a in fields}
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    args = ", ".join(
        (f"{a.alias}=" if a.kw_only else "")  # positional where __init__ allows it
        + (f"c[{a.alias!r}]" if a.alias in changed else f"e.{a.name}")
        for a in fields
    )
    scope: dict[str, Any] = {"cls": cls}
    exec(f"def evolve(e, c):\n    return cls({args})\n", scope)
    fn: Callable[..., Any] = scope["evolve"]
    return fn


def _evolve(entry: LedgerEntry, **changes: Any) -> LedgerEntry:
    """attrs.evolve(entry, **changes) without its per-call introspection: it runs once per
    written row, so the few (class, changed fields) shapes are compiled once each."""
    key = (type(entry), frozenset(changes))
    fn = _EVOLVERS.get(key)
    if fn is None:
        fn = _EVOLVERS[key] = _evolver(*key)
    new: LedgerEntry = fn(entry, changes)
    return new


def plan_transition(
    entry: LedgerEntry,
    event: str,
    guards: Mapping[str, bool] | None = None,
    **changes: Any,
) -> LedgerEntry:
    """The entry after `event`, per the declared machine; revision + 1. Raises IllegalTransition."""
    edge = LIFECYCLE.resolve(entry.state, event, guards)
    return _evolve(entry, state=edge.dest, revision=entry.revision + 1, **changes)


def reserve_precheck(
    state: str, revision: int, reserved_by: str | None, expected_revision: int, update_id: str
) -> str | None:
    """The contract's order of reservation checks; None means the compare-and-set may write.

    Idempotent retry by the same owner first (its revision is stale by design), then the
    revision (checked before the state), then whether the machine allows `reserve` at all.
    """
    if state == "reserved" and reserved_by == update_id:
        return IDEMPOTENT
    if revision != expected_revision:
        return CONFLICT
    if not LIFECYCLE.is_legal(state, "reserve"):
        return NOT_REWARDED
    return None


def plan_reserve(
    entry: LedgerEntry | None,
    rollout_id: str,
    expected_revision: int,
    update_id: str,
    admission: AdmissionStamp | None,
    *,
    premise: ActivationPremise,
    lease_expires_at: float | None,
) -> tuple[ReserveOutcome, LedgerEntry | None]:
    """Decide a compare-and-set reservation: (outcome, new entry to write or None).

    Order matters and follows the contract: missing, idempotent retry by the same owner,
    revision conflict (before state), not rewarded; then the reservation's premise, judged
    with what this atomic step read of the registry: a stamp that passed, for a version
    that was active, within the lag bound of the pointer as it is now.
    """
    check_update_id(update_id)
    check_revision(expected_revision)
    if entry is None:
        return ReserveOutcome(rollout_id, False, MISSING, None), None
    why = reserve_precheck(
        entry.state, entry.revision, entry.reserved_by, expected_revision, update_id
    )
    if why is not None:
        return ReserveOutcome(rollout_id, why == IDEMPOTENT, why, entry), None
    refusal = premise.refusal(admission, entry.behavior_version)
    if refusal is not None:
        return ReserveOutcome(rollout_id, False, refusal[0], entry, refusal[1]), None
    new = plan_transition(
        entry,
        "reserve",
        reserved_by=update_id,
        lease_expires_at=lease_expires_at,
        admission=admission,
    )
    return ReserveOutcome(rollout_id, True, RESERVED, new), new


def replan_lost(
    now: LedgerEntry | None,
    rollout_id: str,
    expected_revision: int,
    update_id: str,
    admission: AdmissionStamp | None,
    lease_expires_at: float | None,
) -> ReserveOutcome:
    """The outcome of a compare-and-set that lost, re-planned on the row as it is now.
    Revisions only grow, so it is a conflict, or an idempotent retry when this same update
    reserved the rollout meanwhile (e.g. through a concurrent batch)."""
    again, _ = plan_reserve(
        now,
        rollout_id,
        expected_revision,
        update_id,
        admission,
        premise=NO_REGISTRY,
        lease_expires_at=lease_expires_at,
    )
    if again.reason != IDEMPOTENT:
        return ReserveOutcome(rollout_id, False, CONFLICT, now)
    return again


def plan_release(
    entry: LedgerEntry, event: str, rule: RecoveryRule, bad_versions: Iterable[int]
) -> LedgerEntry:
    """A returned reservation (`abort` or `expire_lease`) under the recovery rule."""
    cause = rule.quarantine_cause(entry, bad_versions)
    if cause is not None:
        return plan_transition(
            entry,
            event,
            {"recovery_quarantines": True},
            reserved_by=None,
            lease_expires_at=None,
            disposition=Disposition("recovery", cause, f"on {event}"),
        )
    return plan_transition(
        entry,
        event,
        {"recovery_quarantines": False},
        reserved_by=None,
        lease_expires_at=None,
        releases=entry.releases + 1,
    )


TOKEN_EVENTS = frozenset({"generation_done", "generation_failed"})


def direct_changes(
    event: str,
    reward: Reward | None,
    disposition: Disposition | None,
    tokens: int | None = None,
) -> dict[str, Any]:
    """Field changes for a directly fired event, with its stage checked."""
    if event not in DIRECT_EVENTS:
        raise LedgerError(
            f"event {brief(event)} cannot be fired directly; use reserve/commit/abort/fail_update/"
            f"expire_leases (direct events: {sorted(DIRECT_EVENTS)})"
        )
    if tokens is not None:
        if event not in TOKEN_EVENTS:
            raise LedgerError(
                f"{event}: only {'/'.join(sorted(TOKEN_EVENTS))} record generated tokens"
            )
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise InvalidLedgerArgument(
                f"tokens must be a non-negative int (tokens generated), got {brief(tokens)}"
            )
        return {"tokens": tokens, **direct_changes(event, reward, disposition)}
    if event == "reward_ready":
        if reward is None:
            raise LedgerError("reward_ready needs the reward (function id, version, value)")
        return {"reward": reward}
    if reward is not None:
        raise LedgerError(f"{event}: only reward_ready carries a reward value")
    defaults = {
        "generation_failed": ("generation", "error"),
        "reward_timeout": ("reward", "timeout"),
        "reward_error": ("reward", "error"),
        "quarantine": ("admission", "quarantined"),
        "retire_stale": ("admission", "stale"),
    }
    if event in defaults:
        stage, cause = defaults[event]
        d = disposition or Disposition(stage, cause)
        if d.stage != stage:
            raise LedgerError(f"{event} is recorded at stage {brief(stage)}, not {brief(d.stage)}")
        return {"disposition": d}
    return {}


ADDABLE_STATES = tuple(s for s in LIFECYCLE.states if s in rules.START_STATES)


def plan_add(
    entry: LedgerEntry, bad_versions: Iterable[int], *, dispatched: bool = False
) -> list[tuple[str, LedgerEntry | None, LedgerEntry]]:
    """The writes that add a new rollout: the entry, then quarantine if its version is bad.

    A rollout that arrives stamped with a version whose activation failed (a worker still
    generating on weights that never became active) is quarantined on arrival, so no call
    ever leaves such a rollout open.
    """
    if entry.revision != 0 or entry.state not in ADDABLE_STATES:
        raise WriteRefused(
            f"rollout {brief(entry.rollout_id)}: a new entry starts at revision 0 in "
            f"{'/'.join(ADDABLE_STATES)}, got revision {entry.revision} in {brief(entry.state)}"
        )
    if (entry.chain is not None) != dispatched:
        raise WriteRefused(
            f"rollout {brief(entry.rollout_id)}: an attempt chain is assigned by dispatch "
            "(ledger.dispatch(rollout, chain=...)), never carried into add"
            if not dispatched
            else f"rollout {brief(entry.rollout_id)}: a dispatch names its chain"
        )
    if entry.reserved_by is not None or entry.admission is not None:
        raise WriteRefused(
            f"rollout {brief(entry.rollout_id)}: a new entry carries no reservation or admission"
        )
    enforce([entry])
    changes: list[tuple[str, LedgerEntry | None, LedgerEntry]] = [("add", None, entry)]
    if entry.behavior_version in set(bad_versions):
        d = Disposition("activation", "failed_version", "arrived after its version failed")
        changes.append(("quarantine", entry, plan_transition(entry, "quarantine", disposition=d)))
    return changes


def renew_plan(owned: Sequence[LedgerEntry], now: float, lease_seconds: float) -> list[LedgerEntry]:
    """A heartbeat: each held reservation's lease runs `lease_seconds` from the deployment's
    `now` (one write per rollout, through the declared `renew_lease` edge)."""
    return [plan_transition(e, "renew_lease", lease_expires_at=now + lease_seconds) for e in owned]


def statistics_from(
    entries: Iterable[LedgerEntry],
    counters: Mapping[str, int],
    bad_versions: Iterable[int],
    pacing_rows: Iterable[PacingRow] | None = None,
) -> LedgerStatistics:
    """Build statistics from the entries (or the pacing rows a store read) and counters."""
    entries = list(entries)
    by_state: Counter[str] = Counter(e.state for e in entries)
    rows = [row_of(e) for e in entries] if pacing_rows is None else pacing_rows
    return LedgerStatistics(
        entries=sum(by_state.values()),
        by_state={s: by_state.get(s, 0) for s in LIFECYCLE.states},
        writes=counters.get("writes", 0),
        reservations=counters.get("reservations", 0),
        idempotent_retries=counters.get("idempotent_retries", 0),
        cas_conflicts=counters.get("cas_conflicts", 0),
        refused=counters.get("refused", 0),
        commits=counters.get("commits", 0),
        aborts=counters.get("aborts", 0),
        expirations=counters.get("expirations", 0),
        bad_versions=tuple(sorted(set(bad_versions))),
        pacing=pacing_from(rows),
    )


@runtime_checkable
class Ledger(Protocol):
    """What every ledger backend offers; the conformance kit runs against this protocol."""

    def add(self, rollout: Rollout | LedgerEntry) -> LedgerEntry: ...

    def get(self, rollout_id: str) -> LedgerEntry: ...

    def find(self, rollout_id: str) -> LedgerEntry | None: ...

    def transition(
        self,
        rollout_id: str,
        event: str,
        expected_revision: int,
        *,
        reward: Reward | None = None,
        disposition: Disposition | None = None,
        tokens: int | None = None,
    ) -> LedgerEntry: ...

    def reserve(
        self,
        rollout_id: str,
        expected_revision: int,
        update_id: str,
        admission: AdmissionStamp | None,
    ) -> ReserveOutcome: ...

    def reserve_batch(
        self, update_id: str, requests: Sequence[ReserveRequest]
    ) -> list[ReserveOutcome]: ...

    def commit(self, update_id: str, rollout_ids: Sequence[str]) -> list[LedgerEntry]: ...

    def abort(self, update_id: str) -> list[LedgerEntry]: ...

    def fail_update(self, update_id: str, cause: str, detail: str = "") -> list[LedgerEntry]: ...

    def expire_leases(self) -> list[LedgerEntry]: ...

    def renew_leases(self, update_id: str) -> list[LedgerEntry]: ...

    def quarantine_version(self, version: int, reason: str) -> list[LedgerEntry]: ...

    def clear_bad_version(self, version: int) -> None: ...

    @property
    def bad_versions(self) -> frozenset[int]: ...

    def reserved_by(self, update_id: str) -> list[str]: ...

    def dispatch(self, rollout: Rollout | LedgerEntry, *, chain: str) -> DispatchOutcome: ...

    def retire_stale(self) -> list[LedgerEntry]: ...

    def oldest_admissible(self, limit: int) -> list[LedgerEntry]: ...

    def snapshot(self) -> dict[str, LedgerEntry]: ...

    def history(self, rollout_id: str | None = None) -> list[EntryChanged]: ...

    def statistics(self) -> LedgerStatistics: ...

    def close(self) -> None: ...


def _check_ids(rollout_ids: Sequence[str]) -> list[str]:
    if isinstance(rollout_ids, str | bytes) or not isinstance(rollout_ids, Sequence):
        raise InvalidLedgerArgument(
            f"rollout ids must be a list of strings, got {type(rollout_ids).__name__}"
        )
    ids = list(rollout_ids)
    for rid in ids:
        check_id(rid, "rollout id")
    dup = [k for k, n in Counter(ids).items() if n > 1]
    if dup:
        raise CommitMismatch(f"rollout ids listed more than once: {sorted(dup)[:5]}")
    return ids


def commit_plan(
    update_id: str, rollout_ids: Sequence[str], owned: Sequence[LedgerEntry]
) -> list[LedgerEntry]:
    """New entries for a commit, only if `rollout_ids` is exactly what `update_id` reserved."""
    check_update_id(update_id)
    ids = set(_check_ids(rollout_ids))
    held = {e.rollout_id for e in owned}
    if ids != held:
        missing = sorted(held - ids)
        extra = sorted(ids - held)
        raise CommitMismatch(
            f"update {brief(update_id)} must commit exactly what it reserved: "
            f"{len(missing)} reserved but not listed {missing[:5]}, "
            f"{len(extra)} listed but not reserved by it {extra[:5]}; nothing was committed"
        )
    return [plan_transition(e, "commit", reserved_by=None, lease_expires_at=None) for e in owned]


_COUNTER_OF = {
    RESERVED: "reservations",
    IDEMPOTENT: "idempotent_retries",
    CONFLICT: "cas_conflicts",
}


class MemoryLedger:
    """Thread-safe in-memory ledger: one lock makes read-check-write indivisible.

    Good for tests, simulations and single-process trainers; state is lost with the process.
    """

    def __init__(
        self,
        *,
        clock: Clock = time.time,
        lease_seconds: float = 600.0,
        recovery: RecoveryRule | None = None,
        event_log: EventLog | None = None,
        activation: ActivationSource | None = None,
    ) -> None:
        check_lease_seconds(lease_seconds)
        # attached to a registry, the ledger shares its lock: a reservation reads the active
        # pointer and writes in ONE step that no pointer switch can interleave with
        self.activation = activation
        self._lock = activation.lock if activation is not None else threading.RLock()
        self._entries: dict[str, LedgerEntry] = {}
        self._bad_versions: set[int] = set()
        self._counters: Counter[str] = Counter()
        self._index_reset()
        self.clock = clock
        self.lease_seconds = float(lease_seconds)
        self.recovery = recovery or RecoveryRule()
        self.log = event_log if event_log is not None else EventLog()

    @classmethod
    def restore(
        cls,
        entries: Iterable[LedgerEntry],
        bad_versions: Iterable[int] = (),
        **kwargs: Any,
    ) -> MemoryLedger:
        """A ledger holding exactly these entries, without replaying their history.

        The explorer rebuilds a real ledger from each state it expands this way, so it
        checks the same code that runs in production rather than a retyped copy.
        """
        led = cls(**kwargs)
        led._entries = {e.rollout_id: e for e in entries}
        led._bad_versions = set(bad_versions)
        led._index_reset()
        return led

    @property
    def bad_versions(self) -> frozenset[int]:
        """Versions marked bad by quarantine_version (the recovery rule quarantines them)."""
        with self._lock:
            return frozenset(self._bad_versions)

    # ---- helpers ---------------------------------------------------------------------------

    def _record(self, changes: list[Change]) -> None:
        if not changes:
            return
        enforce(after for _, _, after, _ in changes)
        at = self.clock()
        for _, _, after, _ in changes:
            self._index_write(self._entries.get(after.rollout_id), after)
            self._entries[after.rollout_id] = after
        self._counters["writes"] += len(changes)
        self.log.record_entries(at, changes)

    # ---- ownership and lease index -----------------------------------------------------
    # Which rollouts each update holds, and a heap of lease deadlines, kept in step with every
    # write in `_record`, so commit, abort, fail_update, reserved_by and expire_leases cost
    # what the update holds or what is due, not the size of the ledger. The heap is lazy: a
    # deadline whose reservation has since ended is dropped when it surfaces.

    def _index_reset(self) -> None:
        self._chains: dict[str, list[str]] = {}
        self._live_by_version: Counter[int] = Counter()
        self._owners: dict[str, set[str]] = {}
        self._leases: list[tuple[float, str]] = []
        self._held = 0
        for e in self._entries.values():
            self._index_write(None, e)

    def _index_write(self, before: LedgerEntry | None, after: LedgerEntry) -> None:
        if before is None and after.chain is not None:
            self._chains.setdefault(after.chain, []).append(after.rollout_id)
        if before is not None and before.state in _LIVE:
            self._live_by_version[before.behavior_version] -= 1
        if after.state in _LIVE:
            self._live_by_version[after.behavior_version] += 1
        if before is not None and before.reserved_by is not None:
            held = self._owners.get(before.reserved_by)
            if held is not None and before.rollout_id in held:
                held.discard(before.rollout_id)
                self._held -= 1
                if not held:
                    del self._owners[before.reserved_by]
        if after.reserved_by is None:
            return
        held = self._owners.setdefault(after.reserved_by, set())
        if after.rollout_id not in held:
            held.add(after.rollout_id)
            self._held += 1
        if after.lease_expires_at is not None:
            heapq.heappush(self._leases, (after.lease_expires_at, after.rollout_id))
            if len(self._leases) > 1024 and len(self._leases) > 4 * self._held:
                # mostly deadlines of reservations that ended: rebuild from what is held
                self._leases = [
                    (e.lease_expires_at, e.rollout_id)
                    for e in (self._entries.get(r) for s in self._owners.values() for r in s)
                    if e is not None and e.lease_expires_at is not None
                ]
                heapq.heapify(self._leases)

    def _owned(self, update_id: str) -> list[LedgerEntry]:
        held = self._owners.get(update_id, ())
        return sorted((self._entries[r] for r in held), key=lambda e: e.rollout_id)

    # ---- protocol ----------------------------------------------------------------------

    def add(self, rollout: Rollout | LedgerEntry) -> LedgerEntry:
        """Insert a new rollout at revision 0; its id must be new."""
        entry = as_entry(rollout)
        with self._lock:
            changes = plan_add(entry, self._bad_versions)
            if entry.rollout_id in self._entries:
                raise DuplicateRollout(
                    f"rollout {brief(entry.rollout_id)} is already in the ledger"
                )
            self._record([(ev, b, a, None) for ev, b, a in changes])
            return changes[-1][2]

    def find(self, rollout_id: str) -> LedgerEntry | None:
        """The entry, or None when absent."""
        check_id(rollout_id)
        with self._lock:
            return self._entries.get(rollout_id)

    def get(self, rollout_id: str) -> LedgerEntry:
        """The entry; UnknownRollout when absent."""
        e = self.find(rollout_id)
        if e is None:
            raise UnknownRollout(f"rollout {brief(rollout_id)} is not in the ledger")
        return e

    def transition(
        self,
        rollout_id: str,
        event: str,
        expected_revision: int,
        *,
        reward: Reward | None = None,
        disposition: Disposition | None = None,
        tokens: int | None = None,
    ) -> LedgerEntry:
        """Fire a direct lifecycle event under compare-and-set; nothing changes on failure."""
        changes = direct_changes(event, reward, disposition, tokens)
        check_revision(expected_revision)
        with self._lock:
            entry = self.get(rollout_id)
            if entry.revision != expected_revision:
                self._counters["cas_conflicts"] += 1
                raise RevisionConflict(rollout_id, expected_revision, entry.revision)
            new = plan_transition(entry, event, **changes)
            self._record([(event, entry, new, None)])
            return new

    def reserve(
        self,
        rollout_id: str,
        expected_revision: int,
        update_id: str,
        admission: AdmissionStamp | None,
    ) -> ReserveOutcome:
        """Compare-and-set reservation of one rollout."""
        return self.reserve_batch(
            update_id, [ReserveRequest(rollout_id, expected_revision, admission)]
        )[0]

    def reserve_batch(
        self, update_id: str, requests: Sequence[ReserveRequest]
    ) -> list[ReserveOutcome]:
        """Reserve many rollouts in one atomic step; each item wins or loses on its own CAS."""
        check_update_id(update_id)
        requests = check_requests(requests)
        with self._lock:
            lease = self.clock() + self.lease_seconds
            premise = NO_REGISTRY if self.activation is None else self.activation.premise()
            outcomes: list[ReserveOutcome] = []
            changes: list[Change] = []
            for r in requests:
                entry = self._entries.get(r.rollout_id)
                out, new = plan_reserve(
                    entry,
                    r.rollout_id,
                    r.expected_revision,
                    update_id,
                    r.admission,
                    premise=premise,
                    lease_expires_at=lease,
                )
                self._count(out.reason)
                if new is not None:
                    changes.append(("reserve", entry, new, update_id))
                outcomes.append(out)
            self._record(changes)
            return outcomes

    def _count(self, reason: str) -> None:
        self._counters[_COUNTER_OF.get(reason, "refused")] += 1

    def commit(self, update_id: str, rollout_ids: Sequence[str]) -> list[LedgerEntry]:
        """Consume exactly the rollouts `update_id` reserved, atomically; else CommitMismatch."""
        with self._lock:
            owned = self._owned(update_id)
            new = commit_plan(update_id, rollout_ids, owned)
            self._record([("commit", b, a, update_id) for b, a in zip(owned, new, strict=True)])
            self._counters["commits"] += 1
            return new

    def abort(self, update_id: str) -> list[LedgerEntry]:
        """Return every reservation of `update_id` under the recovery rule."""
        check_update_id(update_id)
        with self._lock:
            owned = self._owned(update_id)
            new = [plan_release(e, "abort", self.recovery, self._bad_versions) for e in owned]
            self._record([("abort", b, a, update_id) for b, a in zip(owned, new, strict=True)])
            self._counters["aborts"] += 1
            return new

    def fail_update(self, update_id: str, cause: str, detail: str = "") -> list[LedgerEntry]:
        """The update itself failed with this data: its rollouts end in update_failed."""
        check_update_id(update_id)
        if not isinstance(cause, str) or not cause:
            raise InvalidLedgerArgument(f"cause must be a non-empty string, got {brief(cause)}")
        with self._lock:
            owned = self._owned(update_id)
            new = [
                plan_transition(
                    e,
                    "update_failed",
                    reserved_by=None,
                    lease_expires_at=None,
                    disposition=Disposition("update", cause, detail),
                )
                for e in owned
            ]
            self._record(
                [("update_failed", b, a, update_id) for b, a in zip(owned, new, strict=True)]
            )
            return new

    def expire_leases(self) -> list[LedgerEntry]:
        """Return reservations whose lease ran out (a crashed learner never blocks forever)."""
        with self._lock:
            now = self.clock()
            found: dict[str, LedgerEntry] = {}
            while self._leases and self._leases[0][0] <= now:
                _, rid = heapq.heappop(self._leases)
                e = self._entries.get(rid)
                if (
                    e is not None
                    and e.state == "reserved"
                    and e.lease_expires_at is not None
                    and e.lease_expires_at <= now
                ):
                    found[rid] = e
            due = sorted(found.values(), key=lambda e: e.rollout_id)
            new = [plan_release(e, "expire_lease", self.recovery, self._bad_versions) for e in due]
            self._record(
                [("expire_lease", b, a, b.reserved_by) for b, a in zip(due, new, strict=True)]
            )
            self._counters["expirations"] += len(new)
            return new

    def renew_leases(self, update_id: str) -> list[LedgerEntry]:
        """Heartbeat of a long update: every rollout it holds gets a full lease from now.

        Only the owner renews, and only what it still holds: a reservation that expired
        and went to another update is not among them (check the returned ids)."""
        check_update_id(update_id)
        with self._lock:
            owned = self._owned(update_id)
            new = renew_plan(owned, self.clock(), self.lease_seconds)
            self._record(
                [("renew_lease", b, a, update_id) for b, a in zip(owned, new, strict=True)]
            )
            return new

    def quarantine_version(self, version: int, reason: str) -> list[LedgerEntry]:
        """Mark a version bad: quarantine its open rollouts now, reserved ones when returned."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {brief(version)}")
        with self._lock:
            self._bad_versions.add(version)
            due = sorted(
                (
                    e
                    for e in self._entries.values()
                    if e.behavior_version == version and LIFECYCLE.is_legal(e.state, "quarantine")
                ),
                key=lambda e: e.rollout_id,
            )
            d = Disposition("activation", "failed_version", reason)
            new = [plan_transition(e, "quarantine", disposition=d) for e in due]
            self._record([("quarantine", b, a, None) for b, a in zip(due, new, strict=True)])
            return new

    def clear_bad_version(self, version: int) -> None:
        """Lift the mark: the version became active after a retry, its new rollouts are good.

        Rollouts already quarantined stay quarantined (terminal states absorb).
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {brief(version)}")
        with self._lock:
            self._bad_versions.discard(version)

    def reserved_by(self, update_id: str) -> list[str]:
        """Ids currently reserved by `update_id`, sorted."""
        with self._lock:
            return [e.rollout_id for e in self._owned(update_id)]

    def _premise(self) -> ActivationPremise:
        return NO_REGISTRY if self.activation is None else self.activation.premise()

    def dispatch(self, rollout: Rollout | LedgerEntry, *, chain: str) -> DispatchOutcome:
        """Start a rollout of `chain` only within the staleness budget (model.pacing)."""
        entry = dispatch_entry(rollout, chain)
        with self._lock:
            if entry.rollout_id in self._entries:
                raise DuplicateRollout(
                    f"rollout {brief(entry.rollout_id)} is already in the ledger"
                )
            act = self._premise()
            floor = window_floor(act.pointer_version, act.policy)
            live = sum(n for v, n in self._live_by_version.items() if floor is None or v >= floor)
            states = tuple(self._entries[r].state for r in self._chains.get(chain, ()))
            premise = DispatchPremise(act.pointer_version, act.was_active, act.policy, live, states)
            out, new = plan_dispatch(entry, chain, premise)
            if new is not None:
                changes = plan_add(new, self._bad_versions, dispatched=True)
                self._record([(ev, b, a, None) for ev, b, a in changes])
                out = attrs.evolve(out, entry=changes[-1][2])
            return out

    def retire_stale(self) -> list[LedgerEntry]:
        """Retire, with their cause, rewarded rollouts now too old for the pointer."""
        with self._lock:
            act = self._premise()
            floor = window_floor(act.pointer_version, act.policy)
            if floor is None or act.policy is None or act.pointer_version is None:
                return []
            due = sorted(
                (
                    e
                    for e in self._entries.values()
                    if e.state == "rewarded" and e.behavior_version < floor
                ),
                key=lambda e: e.rollout_id,
            )
            pointer, bound = act.pointer_version, act.policy.max_lag
            new = [
                plan_transition(
                    e,
                    "retire_stale",
                    disposition=stale_disposition(pointer - e.behavior_version, bound, pointer),
                )
                for e in due
            ]
            self._record([("retire_stale", b, a, None) for b, a in zip(due, new, strict=True)])
            return new

    def oldest_admissible(self, limit: int) -> list[LedgerEntry]:
        """Up to `limit` rewarded rollouts still within the lag bound, oldest first."""
        limit = check_limit(limit)
        with self._lock:
            act = self._premise()
            floor = window_floor(act.pointer_version, act.policy)
            top = act.pointer_version
            found = [
                e
                for e in self._entries.values()
                if e.state == "rewarded"
                and (floor is None or e.behavior_version >= floor)
                and (top is None or e.behavior_version <= top)
            ]
            return oldest_first(found)[:limit]

    def snapshot(self) -> dict[str, LedgerEntry]:
        """A consistent copy of every entry (records are frozen, so sharing them is safe)."""
        with self._lock:
            return dict(self._entries)

    def history(self, rollout_id: str | None = None) -> list[EntryChanged]:
        """This ledger's trace, optionally for one rollout."""
        if rollout_id is not None:
            check_id(rollout_id)
        evs = self.log.events()
        return [
            e
            for e in evs
            if isinstance(e, EntryChanged) and (rollout_id is None or e.rollout_id == rollout_id)
        ]

    def statistics(self) -> LedgerStatistics:
        """Counts by state and counters of writes, wins, losses and returns."""
        with self._lock:
            return statistics_from(self._entries.values(), self._counters, self._bad_versions)

    def close(self) -> None:
        """Nothing to release; present for protocol parity with durable backends."""
