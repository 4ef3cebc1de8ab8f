"""The revisioned rollout ledger: the planning functions, the one ledger, the memory store.

The planning functions decide, given the entry as read and the request, the outcome and the
new entry by asking the declared lifecycle machine. `StoreLedger` is the one ledger: it
holds the protocol (planning, `enforce`, events, counters, the activation premise check)
over a `Store`, which only makes "read, check revisions, write, append events, bump
counters" one atomic step in its own way: a lock here (`MemoryStore`), a SQLite IMMEDIATE
transaction (model.sqlite_ledger), a PostgreSQL transaction (model.postgres_ledger).
"""

from __future__ import annotations

import functools
import heapq
import json
import math
import operator
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Literal, Protocol, Self, TypeVar, runtime_checkable

import attrs

from rollout_lifecycle.model import rules
from rollout_lifecycle.model.errors import (
    CommitMismatch,
    DispatchRefused,
    DuplicateRollout,
    InvalidLedgerArgument,
    LedgerError,
    RevisionConflict,
    UnknownRollout,
    UpdatePoisoned,
    brief,
)
from rollout_lifecycle.model.events import (
    Change,
    EntryChanged,
    EventLog,
    UpdateChange,
    row_event,
)
from rollout_lifecycle.model.machines import LIFECYCLE
from rollout_lifecycle.model.pacing import (
    LIVE_STATES,
    DispatchOutcome,
    DispatchPremise,
    PacingRow,
    PacingStatistics,
    check_chain,
    identity_chain,
    oldest_first,
    pacing_from,
    plan_dispatch,
    row_of,
    stale_disposition,
    window_floor,
)
from rollout_lifecycle.model.records import (
    INT64_MAX,
    AdmissionPolicy,
    AdmissionStamp,
    Disposition,
    LedgerEntry,
    Reward,
    Rollout,
    UpdateRecord,
    from_jsonable,
    ints64_pass,
    plain_maker,
    slot_setter,
    text_problem,
    texts_pass,
    to_jsonable,
)

Clock = Callable[[], float]

# reasons a reservation returns (the first four are CONTRACT section 5's)
RESERVED = "reserved"
IDEMPOTENT = "idempotent_retry"
CONFLICT = "revision_conflict"
NOT_REWARDED = "not_rewarded"
MISSING = "missing_rollout"
# a dispatch_many request whose id the ledger already holds (its stored entry is returned)
ALREADY_DISPATCHED = "already_dispatched"
# a landing of a rollout never dispatched, under a pacing policy (land_and_reserve skips it)
NOT_DISPATCHED = "not_dispatched"
# refusals decided inside the reservation's atomic step (model.rules.reservation_refusal)
NOT_ADMITTED = rules.NOT_ADMITTED
POINTER_MOVED = rules.POINTER_MOVED
VERSION_NOT_ACTIVE = rules.VERSION_NOT_ACTIVE
STAMP_CONTRADICTS = rules.STAMP_CONTRADICTS
NO_POLICY = rules.NO_POLICY
LOOSER_THAN_POLICY = rules.LOOSER_THAN_POLICY
VERSION_RETIRED = rules.VERSION_RETIRED
ARTIFACT_HASH_MISMATCH = rules.ARTIFACT_HASH_MISMATCH
UPDATE_POISONED = rules.UPDATE_POISONED

# why an update is poisoned (UpdateRecord.cause)
POISON_COMMIT_MISMATCH = "commit_mismatch"
POISON_LEASE_EXPIRED = "lease_expired"
POISON_RETIRED_VERSION = "retired_version"

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

    def quarantine_cause(
        self, entry: LedgerEntry, bad_versions: Iterable[int], retired: Iterable[int] = ()
    ) -> str | None:
        """The cause to quarantine with, or None to release (`retired`: rolled-back
        versions, read from the registry in the same step)."""
        if entry.behavior_version in set(bad_versions):
            return "failed_version"
        if entry.behavior_version in set(retired):
            return "rolled_back"
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
    and only the admission stamp itself is judged. A step reads `was_active`, `retired`
    and `hashes` for the versions it judges only (`StoreView.read_premise`), so its read
    does not grow with the versions a run published: a version outside that set reads
    as never active.
    """

    pointer_version: int | None
    was_active: frozenset[int] | None
    policy: AdmissionPolicy | None = None
    retired: frozenset[int] = frozenset()
    # the registered hash of each version in `was_active` (None: not read, a test's premise)
    hashes: Mapping[int, str] | None = attrs.field(default=None, hash=False)

    def refusal(
        self,
        admission: AdmissionStamp | None,
        behavior_version: int,
        artifact_hash: str | None = None,
        *,
        stamp_passed: bool = False,
    ) -> tuple[str, str] | None:
        """(reason, detail) when the reservation may not land now; None when it may
        (`stamp_passed`: see rules.reservation_refusal)."""
        return rules.reservation_refusal(
            admission,
            behavior_version,
            self.pointer_version,
            self.was_active,
            self.policy,
            self.retired,
            artifact_hash,
            self.hashes,
            stamp_passed=stamp_passed,
        )


NO_REGISTRY = ActivationPremise(None, None)


def judged_versions(versions: Iterable[object]) -> frozenset[int]:
    """The versions a step's premise read asks about: those a registry can hold (any other
    value, read or not, is in no premise's sets: leaving it out changes no answer).

    A batch names a version per row, mostly one or two distinct ones: when every distinct
    value is a plain int (the usual case) only those are judged; otherwise (a bool, a float
    that equals an int, an unhashable value) each value is, as given, as a short list is."""
    given = versions if type(versions) is list else list(versions)
    if len(given) > 8:
        try:
            distinct: set[Any] = set(given)
        except TypeError:  # an unhashable value: judged as given, below
            pass
        else:
            if all(type(v) is int for v in distinct):
                return frozenset(v for v in distinct if 0 <= v <= INT64_MAX)
    return frozenset(int(v) for v in given if isinstance(v, int) and 0 <= v <= INT64_MAX)


def stamp_versions(stamps: Iterable[AdmissionStamp | None]) -> list[object]:
    """The current version each stamp was admitted against (a reservation judges it)."""
    return [getattr(s, "current_version", None) for s in stamps]


class ActivationSource(Protocol):
    """A registry a ledger reads inside its own atomic step (the memory registry)."""

    @property
    def lock(self) -> threading.RLock:
        """The lock that makes the registry's steps atomic; the ledger shares it."""
        ...

    def premise(self, versions: Collection[int] | None = None) -> ActivationPremise:
        """The pointer and the facts of `versions` (None: of every version) now (the
        caller holds `lock`); see `StoreView.read_premise`."""
        ...


class WriteRefused(LedgerError, ValueError):
    """A write that would break a rule of the spec; it was refused before anything landed."""


def enforce(afters: Iterable[LedgerEntry]) -> None:
    """Refuse a step whose records break a per-record rule (model.rules.entry_problems)."""
    problems = rules.entries_problems(afters)
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
    """A result limit: a non-negative int under the 64-bit bound every backend's LIMIT takes
    (PostgreSQL refuses a larger one, SQLite's driver overflows: refused alike, typed)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT64_MAX:
        raise InvalidLedgerArgument(
            f"limit must be a non-negative int of at most 2**63 - 1, got {brief(value)}"
        )
    return value


def check_revision(value: object, what: str = "expected_revision") -> int:
    """A revision the caller read: a non-negative int (never a bool or a float)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT64_MAX:
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
    if update_id is _CHECKED_UPDATE[0]:  # a str is immutable: it passed, it passes
        return update_id  # type: ignore[return-value]
    checked = check_id(update_id, "update_id")
    if type(checked) is str:
        _CHECKED_UPDATE[0] = checked
    return checked


# the update id checked last (a batch checks its update id once per row it plans), held so
# that its id cannot be reused; threads racing to store theirs each store a checked one
_CHECKED_UPDATE: list[object] = [object()]


def check_requests(requests: object) -> list[ReserveRequest]:
    """A batch: ReserveRequests, each rollout named once, each with a valid revision."""
    if isinstance(requests, str | bytes) or not isinstance(requests, Sequence):
        raise InvalidLedgerArgument(
            f"a batch is a list of ReserveRequest, got {type(requests).__name__}"
        )
    out = list(requests)
    ids = _plain_batch_ids(out)
    if ids is None:  # judged item by item, so the first bad item is the one refused
        ids = check_request_items(out)
    if len(set(ids)) != len(out):
        seen = Counter(ids)
        dups = [k for k, n in seen.items() if n > 1]
        raise InvalidLedgerArgument(f"a batch names rollouts more than once: {sorted(dups)[:5]}")
    return out


def check_request_items(requests: Sequence[object]) -> list[str]:
    """`check_requests`'s checks of each item, one item at a time (the first bad one is
    refused): a ReserveRequest with a valid id, revision and stamp. Returns the ids."""
    ids: list[str] = []
    for r in requests:
        if not isinstance(r, ReserveRequest):
            raise InvalidLedgerArgument(f"a batch holds ReserveRequest items, got {brief(r)}")
        check_id(r.rollout_id)
        check_revision(r.expected_revision)
        if r.admission is not None and not isinstance(r.admission, AdmissionStamp):
            raise InvalidLedgerArgument(
                f"admission must be an AdmissionStamp or None, got {brief(r.admission)}"
            )
        ids.append(r.rollout_id)
    return ids


_REQUEST_COLUMNS = operator.attrgetter("rollout_id", "expected_revision", "admission")
_STAMP_TYPES = frozenset({AdmissionStamp, type(None)})


def _plain_batch_ids(requests: list[Any]) -> list[str] | None:
    """The ids of a batch whose every item passes `check_requests`'s item checks, judged a
    column at a time (exact types, valid ids, revisions in range); None when some item
    needs judging one by one (it may still pass)."""
    if not requests:
        return []
    if set(map(type, requests)) != {ReserveRequest}:
        return None
    ids, revisions, stamps = zip(*map(_REQUEST_COLUMNS, requests), strict=True)
    if (
        not ints64_pass(revisions)
        or not set(map(type, stamps)) <= _STAMP_TYPES
        or not texts_pass(ids)
    ):
        return None
    return list(ids)


def dispatch_entry(rollout: object, chain: object) -> tuple[LedgerEntry, str | None, str | None]:
    """What `dispatch` accepts, validated before any lock: a new entry without a chain of
    its own (the ledger numbers the attempt), the caller's chain key (None: none given) and
    the key its prompt identity names (None: a LedgerEntry names no prompt)."""
    entry = as_entry(rollout)
    key = None if chain is None else check_chain(chain)
    own = identity_chain(rollout.identity) if isinstance(rollout, Rollout) else None
    if entry.chain is not None:
        raise WriteRefused(
            f"rollout {brief(entry.rollout_id)}: dispatch assigns the chain and attempt; "
            f"pass a rollout without them (got chain {brief(entry.chain)})"
        )
    probe = key if key is not None else own if own is not None else "chain"
    plan_add(attrs.evolve(entry, chain=probe, attempt=1), (), dispatched=True)
    return entry, key, own


def chain_of(
    entry: LedgerEntry, caller: str | None, own: str | None, policy: AdmissionPolicy | None
) -> str | None:
    """The attempt chain a new rollout is counted on, under the deployment's recorded
    `chain_key` (model.pacing); None: it is added without a chain (no pacing applies).

    "identity" (the default, also where no policy is recorded): the key its prompt
    identity names (dataset, prompt id, sample index), so a caller's fresh key cannot reset
    `max_attempts`; a caller key that differs is refused, and under a pacing policy a bare
    LedgerEntry, which names no prompt, is refused too. "caller": the key the caller gives.
    """
    mode = "identity" if policy is None else policy.chain_key
    if mode == "caller":
        return caller
    if own is not None:
        if caller is not None and caller != own:
            raise InvalidLedgerArgument(
                f"rollout {brief(entry.rollout_id)}: the deployment counts a prompt's attempts "
                f"by its identity (chain_key 'identity'), whose chain is {brief(own)}, not "
                f"{brief(caller)}: omit chain= (or record chain_key 'caller' with "
                "`deployment set-policy --chain-key caller`)"
            )
        return own
    if policy is not None and policy.paced:
        raise InvalidLedgerArgument(
            f"rollout {brief(entry.rollout_id)}: a LedgerEntry names no prompt, and the "
            "deployment's pacing policy counts attempts by prompt identity (chain_key "
            "'identity'): pass the Rollout (its RolloutIdentity names the chain), or record "
            "chain_key 'caller' with `deployment set-policy --chain-key caller`"
        )
    return caller


def as_entry(rollout: object) -> LedgerEntry:
    """What `add` accepts: a Rollout (its entry at dispatch) or a LedgerEntry."""
    if isinstance(rollout, Rollout):
        return rollout.entry()
    if isinstance(rollout, LedgerEntry):
        return rollout
    raise InvalidLedgerArgument(
        f"add() takes a Rollout or a LedgerEntry, got {type(rollout).__name__}"
    )


_EVOLVERS: dict[tuple[Any, ...], Callable[..., Any]] = {}  # (class, *changed names)


# Classes whose field validators judge the value alone (model/records.py): a value of an
# immutable scalar type that passed a field's validator passes it again, so an evolver of
# these classes skips the validator when handed the very object it validated last (a batch
# hands every row the same owner, lease and state objects).
_VALUE_VALIDATED: frozenset[type[Any]] = frozenset({LedgerEntry})
_IMMUTABLE = (str, int, float, type(None))


def _put_line(cls: type[Any], i: int, name: str, value: str, scope: dict[str, Any]) -> str:
    """A line of generated code that stores `value` in field `name` of the new record `o`:
    through the field's slot when it has one, else through object.__setattr__ (`put`)."""
    setter = slot_setter(cls, name)
    if setter is None:
        return f"    put(o, {name!r}, {value})"
    scope[f"s{i}"] = setter
    return f"    s{i}(o, {value})"


def _evolver(
    cls: type[Any], changed: frozenset[str], order: Sequence[str] | None = None
) -> Callable[..., Any]:
    """attrs.evolve for one class and one set of changed fields, written out once.

    The fields left as they were passed their validators when the record was built, so only
    the changed ones are validated again (see `_VALUE_VALIDATED`), then the class's
    post-init check runs, as in __init__. A class with converters or non-init fields is
    built by its __init__ instead. The evolver takes the changes as a dict (`evolve(e, c)`),
    or, given `order`, as positional arguments in that order (`evolve(e, *values)`: a
    batch planner calls it per row without building a dict).
    """
    every = list(attrs.fields(cls))
    fields = [a for a in every if a.init]
    unknown = changed - {a.alias for a in fields}
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    if order is not None and (len(order) != len(changed) or set(order) != changed):
        raise TypeError(f"the order {list(order)} names other fields than {sorted(changed)}")
    scope: dict[str, Any] = {
        "cls": cls,
        "new": object.__new__,
        "put": object.__setattr__,
        "immutable": _IMMUTABLE,
    }
    # where each changed value comes from: the dict, or the positional arguments
    value = {n: f"c[{n!r}]" if order is None else f"a_{n}" for n in changed}
    params = "c" if order is None else ", ".join(f"a_{n}" for n in order) or "*_"
    memo = cls in _VALUE_VALIDATED
    if len(fields) != len(every) or any(a.converter is not None for a in fields):
        args = ", ".join(
            (f"{a.alias}=" if a.kw_only else "")  # positional where __init__ allows it
            + (value[a.alias] if a.alias in changed else f"e.{a.name}")
            for a in fields
        )
        exec(f"def evolve(e, {params}):\n    return cls({args})\n", scope)
    else:
        # the helpers bound as defaults: locals, not a global lookup per field
        head = f"def evolve(e, {params}, cls=cls, new=new, put=put"
        lines = ["    o = new(cls)"]
        for i, a in enumerate(fields):
            if a.alias not in changed:
                lines.append(_put_line(cls, i, a.name, f"e.{a.name}", scope))
                continue
            lines.append(f"    x = {value[a.alias]}")
            lines.append(_put_line(cls, i, a.name, "x", scope))
            if a.validator is None:
                continue
            scope[f"f{i}"], scope[f"v{i}"] = a, a.validator
            if not memo:
                lines.append(f"    v{i}(o, f{i}, x)")
                continue
            # the last value validated, held so its id cannot be reused (racing threads
            # each store a value they validated: any of them is right)
            scope[f"m{i}"] = [object()]
            lines += [
                f"    if x is not m{i}[0]:",
                f"        v{i}(o, f{i}, x)",
                "        if type(x) in immutable:",
                f"            m{i}[0] = x",
            ]
        if hasattr(cls, "__attrs_post_init__"):
            lines.append("    o.__attrs_post_init__()")
        lines.append("    return o")
        setters = "".join(f", s{i}=s{i}" for i in range(len(fields)) if f"s{i}" in scope)
        exec("\n".join([head + setters + "):", *lines]) + "\n", scope)
    fn: Callable[..., Any] = scope["evolve"]
    return fn


def _evolve(entry: LedgerEntry, **changes: Any) -> LedgerEntry:
    """attrs.evolve(entry, **changes) without its per-call introspection: it runs once per
    written row, so the few (class, changed fields) shapes are compiled once each."""
    key = (type(entry), *changes)  # cheaper to build and hash than a frozenset
    fn = _EVOLVERS.get(key)
    if fn is None:
        fn = _EVOLVERS[key] = _evolver(type(entry), frozenset(changes))
    new: LedgerEntry = fn(entry, changes)
    return new


def plan_transition(
    entry: LedgerEntry,
    event: str,
    guards: Mapping[str, bool] | None = None,
    **changes: Any,
) -> LedgerEntry:
    """The entry after `event`, per the declared machine; revision + 1. Raises IllegalTransition."""
    dest = None if guards else _DESTS.get((entry.state, event))
    if dest is None:
        dest = transition_dest(entry.state, event, guards)
    return _evolve(entry, state=dest, revision=entry.revision + 1, **changes)


def transition_dest(state: str, event: str, guards: Mapping[str, bool] | None = None) -> str:
    """Where `event` takes a record in `state`, per the declared machine (IllegalTransition
    when it cannot); the unguarded edges' destinations are looked up once each."""
    dest = None if guards else _DESTS.get((state, event))
    if dest is None:
        dest = LIFECYCLE.resolve(state, event, guards).dest
        if not guards:
            _DESTS[(state, event)] = dest
    return dest


# (state, event) -> destination of the unguarded edge: the declared machine never changes
_DESTS: dict[tuple[str, str], str] = {}


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
    poisoned: bool = False,
) -> tuple[ReserveOutcome, LedgerEntry | None]:
    """Decide a compare-and-set reservation: (outcome, new entry to write or None).

    Order matters and follows the contract: missing, idempotent retry by the same owner,
    revision conflict (before state), not rewarded; then the ledger's own record of the
    update (`poisoned`, as read with the row: update_poisoned); then the reservation's
    premise, judged with what this atomic step read of the registry: a stamp that passed,
    for a version that was active, stamped with its registered hash, within the lag bound
    of the pointer as it is now.
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
    if poisoned:
        return ReserveOutcome(rollout_id, False, UPDATE_POISONED, entry, _POISONED), None
    refusal = premise.refusal(admission, entry.behavior_version, entry.artifact_hash)
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


_POISONED = (
    "the ledger records this update as poisoned (a commit of it was refused, a lease of one "
    "of its rollouts expired, or it held a rollout of a retired version): abort it and "
    "train a new update"
)


def plan_each(
    plan: Callable[..., tuple[ReserveOutcome, LedgerEntry | None]],
    entries: Mapping[str, LedgerEntry],
    requests: Sequence[ReserveRequest],
    update_id: str,
    *,
    premise: ActivationPremise,
    lease_expires_at: float | None,
    poisoned: bool = False,
) -> tuple[list[ReserveOutcome], dict[str, tuple[LedgerEntry, LedgerEntry]]]:
    """A checked batch planned request by request with `plan` (`plan_reserve`'s signature):
    what `plan_reserves` must return, kept as its reference (the batch tests compare the
    two; the catalogue's reservation mutants plan batches through their buggy `plan`)."""
    outcomes: list[ReserveOutcome] = []
    planned: dict[str, tuple[LedgerEntry, LedgerEntry]] = {}
    for r in requests:
        before = entries.get(r.rollout_id)
        out, new = plan(
            before,
            r.rollout_id,
            r.expected_revision,
            update_id,
            r.admission,
            premise=premise,
            lease_expires_at=lease_expires_at,
            poisoned=poisoned,
        )
        outcomes.append(out)
        if new is not None and before is not None:
            planned[r.rollout_id] = (before, new)
    return outcomes, planned


_REASON = operator.attrgetter("reason")
_LOCATED = frozenset({NO_POLICY})  # the refusals whose hint `_located` rewrites
_make_outcome = plain_maker(ReserveOutcome)  # ReserveOutcome(...), built once per row
# the fields a reservation changes, in the order the batch planner's evolvers take them
_RESERVED_FIELDS = ("state", "revision", "reserved_by", "lease_expires_at", "admission")
_RESERVE_EVOLVERS: dict[type[Any], Callable[..., Any]] = {}  # entry class -> its evolver


def plan_reserves(
    entries: Mapping[str, LedgerEntry],
    requests: Sequence[ReserveRequest],
    update_id: str,
    *,
    premise: ActivationPremise,
    lease_expires_at: float | None,
    poisoned: bool = False,
) -> tuple[list[ReserveOutcome], dict[str, tuple[LedgerEntry, LedgerEntry]]]:
    """`plan_reserve` of each request of a checked batch (`check_requests`) against the rows
    its step read: the same outcomes, in order, and the (before, after) of each row to
    write, by id.

    What the rows share is worked out once per batch, not per row: the update id and the
    revisions were checked with the batch, the premise judges each (stamp, version) once,
    each state's destination is looked up once, and each new entry is built by an evolver
    of the reservation's fields that takes them as arguments (it still validates a value
    it has not passed, and runs the record's post-init check).
    """
    check_update_id(update_id)
    precheck, outcome = reserve_precheck, _make_outcome
    get = entries.get
    outcomes: list[ReserveOutcome] = []
    add = outcomes.append
    planned: dict[str, tuple[LedgerEntry, LedgerEntry]] = {}
    # (id of the stamp, behaviour version, hash) -> refusal: the requests hold every stamp,
    # so no id is reused while this runs; a batch mostly carries one stamp, one version and
    # one hash, so the last one judged is kept at hand as well
    judged: dict[tuple[int, int, str], tuple[str, str] | None] = {}
    last_stamp: object = judged  # no request's stamp
    last_version, last_hash, refusal = -1, "", None
    dests: dict[str, str] = {}
    # state -> whether `reserve_precheck` passes a row in it at the expected revision
    # whoever owns it (the precheck reads the owner only to find this update's own retry,
    # so asking with that owner covers every owner): only other rows are prechecked
    plain_states: dict[str, bool] = {}
    kind: type[Any] | None = None  # the class `evolve` builds
    evolve: Callable[..., LedgerEntry] | None = None
    for r in requests:
        rid = r.rollout_id
        entry = get(rid)
        if entry is None:
            add(outcome(rid, False, MISSING, None))
            continue
        state = entry.state
        plain = plain_states.get(state)
        if plain is None:  # asked of the precheck itself, with the owner that could retry
            plain = plain_states[state] = precheck(state, 0, update_id, 0, update_id) is None
        if not plain or entry.revision != r.expected_revision:  # the checks, in their order
            why = precheck(state, entry.revision, entry.reserved_by, r.expected_revision, update_id)
            if why is not None:
                add(outcome(rid, why == IDEMPOTENT, why, entry))
                continue
        if poisoned:
            add(outcome(rid, False, UPDATE_POISONED, entry, _POISONED))
            continue
        admission, version, digest = r.admission, entry.behavior_version, entry.artifact_hash
        if admission is not last_stamp or version != last_version or digest != last_hash:
            key = (id(admission), version, digest)
            if key in judged:
                refusal = judged[key]
            else:
                refusal = judged[key] = premise.refusal(admission, version, digest)
            last_stamp, last_version, last_hash = admission, version, digest
        if refusal is not None:
            add(outcome(rid, False, refusal[0], entry, refusal[1]))
            continue
        dest = dests.get(state)
        if dest is None:
            dest = dests[state] = transition_dest(state, "reserve")
        if type(entry) is not kind or evolve is None:
            kind = type(entry)
            evolve = _RESERVE_EVOLVERS.get(kind)
            if evolve is None:
                evolve = _RESERVE_EVOLVERS[kind] = _evolver(
                    kind, frozenset(_RESERVED_FIELDS), _RESERVED_FIELDS
                )
        new = evolve(entry, dest, entry.revision + 1, update_id, lease_expires_at, admission)
        planned[rid] = (entry, new)
        add(outcome(rid, True, RESERVED, new))
    return outcomes, planned


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
    entry: LedgerEntry,
    event: str,
    rule: RecoveryRule,
    bad_versions: Iterable[int],
    retired: Iterable[int] = (),
) -> LedgerEntry:
    """A returned reservation (`abort` or `expire_lease`) under the recovery rule."""
    cause = (
        rule.quarantine_cause(entry, bad_versions, retired)
        if retired
        else rule.quarantine_cause(entry, bad_versions)
    )
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
    entry: LedgerEntry,
    bad_versions: Iterable[int],
    *,
    dispatched: bool = False,
    retired: Iterable[int] = (),
) -> list[tuple[str, LedgerEntry | None, LedgerEntry]]:
    """The writes that add a new rollout: the entry, then quarantine if its version is bad
    or retired.

    A rollout that arrives stamped with a version whose activation failed (a worker still
    generating on weights that never became active), or with a version rolled back (read
    from the registry in the same step, whoever rolled it back), is quarantined on arrival,
    so no call ever leaves such a rollout open. `dispatched`: it carries its attempt chain.
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
    elif entry.behavior_version in set(retired):
        d = Disposition(
            "activation", "rolled_back", f"arrived after v{entry.behavior_version} was rolled back"
        )
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

    def in_state(self, state: str, limit: int | None = None) -> list[LedgerEntry]: ...

    def update(self, update_id: str) -> UpdateRecord | None: ...

    def updates(self) -> dict[str, UpdateRecord]: ...

    def dispatch(
        self, rollout: Rollout | LedgerEntry, *, chain: str | None = None
    ) -> DispatchOutcome: ...

    def retire_stale(self) -> list[LedgerEntry]: ...

    def oldest_admissible(self, limit: int) -> list[LedgerEntry]: ...

    def premise_and_rows(
        self, rollout_ids: Sequence[str]
    ) -> tuple[ActivationPremise, dict[str, LedgerEntry]]: ...

    def snapshot(self) -> dict[str, LedgerEntry]: ...

    def history(self, rollout_id: str | None = None) -> list[EntryChanged]: ...

    def statistics(self) -> LedgerStatistics: ...

    def close(self) -> None: ...


def _check_id_list(rollout_ids: Sequence[str]) -> list[str]:
    """A list of rollout ids, each a valid id (repeats are judged by the caller)."""
    if isinstance(rollout_ids, str | bytes) or not isinstance(rollout_ids, Sequence):
        raise InvalidLedgerArgument(
            f"rollout ids must be a list of strings, got {type(rollout_ids).__name__}"
        )
    ids = list(rollout_ids)
    for rid in ids:
        check_id(rid, "rollout id")
    return ids


def commit_mismatch(
    update_id: str, rollout_ids: Sequence[str], owned: Sequence[LedgerEntry]
) -> str | None:
    """Why a commit of `rollout_ids` is not exactly what `update_id` holds (`owned`), or
    None: the message of the CommitMismatch (ids listed twice are a mismatch too)."""
    dup = sorted(k for k, n in Counter(rollout_ids).items() if n > 1)
    if dup:
        return f"rollout ids listed more than once: {dup[:5]}; nothing was committed"
    ids, held = set(rollout_ids), {e.rollout_id for e in owned}
    if ids == held:
        return None
    missing, extra = sorted(held - ids), sorted(ids - held)
    return (
        f"update {brief(update_id)} must commit exactly what it reserved: "
        f"{len(missing)} reserved but not listed {missing[:5]}, "
        f"{len(extra)} listed but not reserved by it {extra[:5]}; nothing was committed"
    )


def poison_change(
    update_id: str, record: UpdateRecord | None, cause: str, detail: str
) -> UpdateChange | None:
    """The change that poisons `update_id` (None: it is poisoned already; the first cause
    stands)."""
    if record is not None and record.status == "poisoned":
        return None
    return ("poison", record, UpdateRecord(update_id, "poisoned", cause, detail))


def open_change(update_id: str, record: UpdateRecord | None) -> list[UpdateChange]:
    """The change that records `update_id` at its first reservation (none if recorded)."""
    return [] if record is not None else [("open", None, UpdateRecord(update_id, "open"))]


def land_change(update_id: str, record: UpdateRecord | None) -> list[UpdateChange]:
    """The change a commit that consumed rollouts makes (none if it landed before)."""
    if record is not None and record.status == "landed":
        return []
    return [("land", record, UpdateRecord(update_id, "landed"))]


def update_from_row(row: Sequence[object]) -> UpdateRecord:
    """An update record from its stored (update_id, status, cause, detail) row."""
    uid, status, cause, detail = row
    return UpdateRecord(str(uid), str(status), None if cause is None else str(cause), str(detail))


def poisoned_error(record: UpdateRecord) -> UpdatePoisoned:
    """The typed refusal of a commit of a poisoned update."""
    return UpdatePoisoned(
        f"update {brief(record.update_id)} is poisoned ({record.cause}: {record.detail}); "
        "nothing was committed, and no commit of it ever lands: abort it (its rollouts "
        "return) and train a new update on fresh reservations",
        update_id=record.update_id,
        cause=record.cause or "",
    )


# ---- stored JSON of an entry ----------------------------------------------------------------
# A SQL store keeps each entry as JSON it wrote itself, after the entry passed its validators
# and `enforce`. Reading it back re-running every validator was a fifth of a batch's cost,
# so a row with exactly the fields this program writes, in its order, is rebuilt without
# them; any other shape (an older or edited row) takes the validating path and its typed
# errors.

_NESTED_IN_ENTRY: dict[str, type[Any]] = {
    "reward": Reward,
    "disposition": Disposition,
    "admission": AdmissionStamp,
}
_STORED: tuple[type[Any], ...] = (LedgerEntry, *_NESTED_IN_ENTRY.values())

# Fields a record's JSON leaves out at their defaults (records: `omit_default`), in the
# groups that are written together: LedgerEntry writes `chain` and `attempt` together (a
# dispatched rollout) and `tokens` on its own (records._entry_jsonable).
_OMITTED_TOGETHER: dict[type[Any], tuple[tuple[str, ...], ...]] = {
    LedgerEntry: (("chain", "attempt"), ("tokens",)),
}


def _shapes(cls: type[Any]) -> dict[tuple[str, ...], dict[str, Any]]:
    """Every key tuple this program writes for `cls`, each with the defaults of the fields
    it leaves out: the written fields keep declaration order."""
    fields = attrs.fields(cls)
    omitted = {a.name for a in fields if a.metadata.get("omit_default")}
    groups = _OMITTED_TOGETHER.get(cls, tuple((n,) for n in sorted(omitted)))
    if {n for g in groups for n in g} != omitted:
        raise TypeError(f"{cls.__name__}: omitted fields {sorted(omitted)} not all grouped")
    shapes: dict[tuple[str, ...], dict[str, Any]] = {}
    for mask in range(2 ** len(groups)):
        left_out = {n for i, g in enumerate(groups) if not mask >> i & 1 for n in g}
        names = tuple(a.name for a in fields if a.name not in left_out)
        shapes[names] = {a.name: a.default for a in fields if a.name in left_out}
    return shapes


_SHAPES = {cls: _shapes(cls) for cls in _STORED}


def _builder(cls: type[Any], defaults: Mapping[str, Any]) -> Callable[[dict[str, Any]], Any]:
    """A record of `cls` from a decoded dict of one exact shape, its left-out fields at
    `defaults`: written out once per shape, with no validator (see above)."""
    scope: dict[str, Any] = {"cls": cls, "new": object.__new__, "put": object.__setattr__}
    lines = ["    o = new(cls)"]
    fields = attrs.fields(cls)
    for i, a in enumerate(fields):
        if a.name in defaults:
            scope[f"d{i}"] = defaults[a.name]
            lines.append(_put_line(cls, i, a.name, f"d{i}", scope))
        else:
            lines.append(_put_line(cls, i, a.name, f"d[{a.name!r}]", scope))
    lines.append("    return o")
    setters = "".join(f", s{i}=s{i}" for i in range(len(fields)) if f"s{i}" in scope)
    head = f"def build(d, cls=cls, new=new, put=put{setters}):"
    exec("\n".join([head, *lines]) + "\n", scope)
    fn: Callable[[dict[str, Any]], Any] = scope["build"]
    return fn


# class -> key tuple of a written shape -> its builder
_BUILDERS = {
    cls: {shape: _builder(cls, defaults) for shape, defaults in shapes.items()}
    for cls, shapes in _SHAPES.items()
}


_NESTED_BUILDERS = tuple((k, _BUILDERS[cls]) for k, cls in _NESTED_IN_ENTRY.items())
NESTED_IN_ENTRY: Mapping[str, type[Any]] = _NESTED_IN_ENTRY  # the records nested in an entry


def stored_shapes(cls: type[Any]) -> list[tuple[str, ...]]:
    """The key tuples `read_entry` trusts for `cls` (an entry or a record nested in one)."""
    return list(_SHAPES[cls])


# json.loads' own scanner (C where the interpreter has it), set up as json.loads sets it up
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _decode(text: str) -> Any:
    """`json.loads(text)`, less its per-call wrapper for the text a store writes (a compact
    object, nothing before or after it): anything else, or any error, is left to
    json.loads itself, so the value and the errors are json.loads' own."""
    if type(text) is str:
        try:
            data, end = _scan(text, 0)
        except (StopIteration, ValueError):
            return json.loads(text)
        if end == len(text):
            return data
    return json.loads(text)


def read_entry(text: str) -> tuple[LedgerEntry, bool]:
    """An entry from the JSON a store wrote, and whether it took the trusted path (see
    above): then `text` is what `dump_entry` makes of it, and a store may reuse it."""
    data = _decode(text)
    build = _BUILDERS[LedgerEntry].get(tuple(data)) if isinstance(data, dict) else None
    if build is not None:
        nested = []
        for key, builders in _NESTED_BUILDERS:
            sub = data[key]
            if sub is not None:
                sub_build = builders.get(tuple(sub)) if isinstance(sub, dict) else None
                if sub_build is None:
                    break  # not a shape this program writes: the validating path
                nested.append((key, sub_build, sub))
        else:
            for key, sub_build, sub in nested:
                data[key] = sub_build(sub)
            entry: LedgerEntry = build(data)
            return entry, True
    return from_jsonable(LedgerEntry, data), False


def load_entry(text: str) -> LedgerEntry:
    """An entry from the JSON a store wrote (trusted when its shape is exact, see above)."""
    return read_entry(text)[0]


def dump_entry(entry: LedgerEntry) -> str:
    """The JSON a store keeps of an entry (compact, fields in declaration order)."""
    return json.dumps(to_jsonable(entry), separators=(",", ":"))


# ---- one ledger over stores ----------------------------------------------------------------
# The protocol (planning, `enforce`, events, counters, the premise check) is written once, in
# `StoreLedger`. A backend is a `Store`: it runs a step's body as ONE atomic unit of work (a
# lock, a SQLite IMMEDIATE transaction, a PostgreSQL transaction under its advisory locks)
# and offers that body a few set-based primitives. A new atomic operation is a StoreLedger
# method whose body calls those primitives; no backend needs a line of its own for it.

T = TypeVar("T")

# what Store.tallies returns: entries by state, durable counters, bad versions, pacing rows
Tallies = tuple[Mapping[str, int], Mapping[str, int], Iterable[int], list[PacingRow]]

_COUNTER_OF = {
    RESERVED: "reservations",
    IDEMPOTENT: "idempotent_retries",
    CONFLICT: "cas_conflicts",
}

# read off the machine, so "which states can be quarantined directly" is never retyped
QUARANTINABLE = tuple(s for s in LIFECYCLE.states if LIFECYCLE.is_legal(s, "quarantine"))


def counter_of(reason: str) -> str:
    """The counter a reservation outcome bumps (the conformance suite compares them)."""
    return _COUNTER_OF.get(reason, "refused")


def check_version(version: object) -> int:
    """A policy version argument: a non-negative int (never a bool)."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be a non-negative int, got {brief(version)}")
    return version


@attrs.frozen
class Step:
    """An atomic step: its name (for messages) and the shared facts its body reads, which a
    store that locks finer than the whole step must lock first, in its fixed order."""

    what: str
    premise: bool = False  # the registry's premise (a reservation)
    bad: Literal["read", "change"] | None = None  # the bad versions: read or change them
    # the live rollouts a dispatch budget counts: "add" steps make new ones (many may at
    # once), a "count" step counts them and then adds one (no add may land in between)
    live: Literal["add", "count"] | None = None
    # a step that acts on EVERY rollout in a state (retire_stale: all the stale rewarded
    # ones): no row may enter that state while it runs (PostgreSQL locks for it; the other
    # stores run one writing step at a time)
    retires: bool = False


class _CountFirst(Exception):
    """An add step found a pacing policy while sharing the dispatch lock: run it again
    holding the lock alone (it counts the live budget, then writes)."""


def _hold_update(uow: UnitOfWork, update_id: str) -> UpdateRecord | None:
    """The update's record, read by a step over every rollout the update holds (commit,
    abort, renew_leases, fail_update) BEFORE it reads what the update holds: on a store
    that locks finer than the step (PostgreSQL) the read takes the update's lock, which a
    reservation for the update holds to its commit, so none commits between the step's
    read of what the update holds and the step's own commit (the step's answer would then
    be true at no instant)."""
    return uow.read_updates([update_id]).get(update_id)


_RESERVE = Step("reserve", premise=True)
_RESERVE_BATCH = Step("reserve_batch", premise=True)


class StoreView(Protocol):
    """What a read-only body may read from one consistent view of a store."""

    def read_premise(self, versions: Collection[int] | None = None) -> ActivationPremise:
        """The registry's premise as of this step (NO_REGISTRY without a registry): the
        pointer and policy, and whether each of `versions` was ever active, is retired and
        its hash (None: every version's, a read that grows with the run; a step passes the
        versions it judges, `judged_versions`, so its read stays the same size)."""
        ...

    def rewarded_between(self, low: int | None, high: int | None, limit: int) -> list[LedgerEntry]:
        """Up to `limit` rewarded entries of behaviour version in [low, high] (None: no
        bound on that side), the first in `model.pacing.oldest_first`'s order."""
        ...

    def read_rows(self, rollout_ids: Sequence[str]) -> dict[str, LedgerEntry]:
        """The stored entries of these ids (absent ids are left out)."""
        ...

    def lock_rows(self, rollout_ids: Sequence[str]) -> dict[str, LedgerEntry]:
        """`read_rows`, each row held until the step ends where the store locks rows (in
        rollout_id order): what a step refuses on is then still so when it commits, so
        its refusals and its writes are true at one instant (issue 33)."""
        ...

    def bad_versions(self) -> frozenset[int]:
        """Versions marked bad, as of this step."""
        ...

    def reserved_ids(self, update_id: str) -> list[str]:
        """Ids `update_id` holds, sorted (no entry decoded)."""
        ...

    def read_policy(self) -> tuple[int | None, AdmissionPolicy | None]:
        """The active version and the recorded policy, as `read_premise` has them ((None,
        None) without a registry), where the ever-active versions are not needed."""
        ...


class UnitOfWork(StoreView, Protocol):
    """What a step's body may do inside its store's atomic step.

    Reads of sets the step will rewrite (`owned`, `due`, `of_version`) are locked where the
    store needs row locks; `read_rows` is not, and `write` is a compare-and-set on each
    `before`'s revision, so it returns the ids that won. Rows read back from the store were
    validated when written; stores need not validate them again.
    """

    def owned(self, update_id: str) -> list[LedgerEntry]:
        """The entries `update_id` holds, by rollout id."""
        ...

    def due(self, now: float) -> list[LedgerEntry]:
        """Reserved entries whose lease ran out at `now`, by rollout id."""
        ...

    def of_version(self, version: int, states: Sequence[str]) -> list[LedgerEntry]:
        """Entries of behaviour `version` in one of `states`, by rollout id."""
        ...

    def count(self, states: Sequence[str], min_version: int | None = None) -> int:
        """How many entries are in one of `states` now (of behaviour version >= `min_version`
        when given: a dispatch budget counts the live rollouts of its window)."""
        ...

    def chain_states(self, chains: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """The states of the entries dispatched on each attempt chain of `chains`, in one
        read (a step dispatching a batch of prompts reads every chain at once)."""
        ...

    def older_than(self, version: int, states: Sequence[str]) -> list[LedgerEntry]:
        """Entries of behaviour version < `version` in one of `states`, by rollout id."""
        ...

    def server_now(self) -> float | None:
        """The deployment's clock where the store has one (PostgreSQL's); None: the ledger's."""
        ...

    def mark_bad(self, version: int, reason: str) -> None:
        """Mark `version` bad (a second mark keeps the first reason)."""
        ...

    def clear_bad(self, version: int) -> None:
        """Lift the mark of `version`."""
        ...

    def insert(self, entries: Sequence[LedgerEntry]) -> None:
        """Insert new rows, all or none: DuplicateRollout when any id exists or repeats."""
        ...

    def write(self, pairs: Sequence[tuple[LedgerEntry, LedgerEntry]]) -> set[str]:
        """Compare-and-set each (before, after) on before's revision; the ids that won."""
        ...

    def read_updates(self, update_ids: Sequence[str]) -> dict[str, UpdateRecord]:
        """The ledger's records of these updates, as of this step (absent ones left out)."""
        ...

    def append(
        self,
        changes: Sequence[Change],
        at: float,
        counts: Mapping[str, int],
        updates: Sequence[UpdateChange] = (),
    ) -> None:
        """Append the step's events (its entries', then its updates'), store the updates'
        new records, and add `counts` to the durable counters."""
        ...


class Store(Protocol):
    """A ledger backend: an atomic step, and the reads that need no step."""

    def atomic(self, body: Callable[[UnitOfWork], T], step: Step) -> T:
        """Run `body` as one atomic step; an exception it raises leaves nothing written.
        The body may run more than once (a lost connection), so it keeps no state of its
        own between runs."""
        ...

    def view(self, body: Callable[[StoreView], T], what: str) -> T:
        """Run a read-only `body` on one consistent view (no write lock is taken)."""
        ...

    def find(self, rollout_id: str) -> LedgerEntry | None:
        """The stored entry, or None."""
        ...

    def find_with_update(
        self, rollout_id: str, update_id: str
    ) -> tuple[LedgerEntry | None, UpdateRecord | None]:
        """The stored entry and the record of `update_id`, from one consistent read."""
        ...

    def find_update(self, update_id: str) -> UpdateRecord | None:
        """The record of `update_id`, or None."""
        ...

    def all_updates(self) -> dict[str, UpdateRecord]:
        """Every update the ledger records, by id."""
        ...

    def reserved_by(self, update_id: str) -> list[str]:
        """Ids reserved by `update_id`, sorted."""
        ...

    def in_state(self, state: str, limit: int | None) -> list[LedgerEntry]:
        """Entries in `state`, by rollout id (at most `limit`)."""
        ...

    def snapshot(self) -> dict[str, LedgerEntry]:
        """Every entry, from one consistent read."""
        ...

    def bad_versions(self) -> frozenset[int]:
        """Versions marked bad."""
        ...

    def history(self, rollout_id: str | None) -> list[EntryChanged]:
        """The ledger's events, optionally of one rollout."""
        ...

    def tallies(self) -> Tallies:
        """(entries by state, durable counters, bad versions, pacing rows), from one
        consistent read."""
        ...

    def close(self) -> None:
        """Release what the store holds; idempotent."""
        ...


@attrs.frozen
class Peeked:
    """What a store read of the registry together with a row, outside any step: the
    premise a reservation is planned and judged on, the store's clock then (None: the
    ledger's), and `token`, the store's own record of what it read, which its guarded
    write compares under the premise lock before writing (see `GuardedStore`)."""

    premise: ActivationPremise
    now: float | None
    token: object = attrs.field(eq=False, repr=False)


WriteOutcome = Literal["won", "lost", "moved"]


@runtime_checkable
class GuardedStore(Protocol):
    """A store that can do a single compare-and-set in fewer round trips than a step: read
    the row with the premise (`peek`), then write the row, its events and counters as ONE
    atomic write that first checks, under the premise lock, that the premise is still what
    was peeked (`write_one`; a transition, which reads no premise, uses it unguarded). No
    rule is judged by the store: the ledger plans, judges and enforces on what was peeked;
    the store only refuses to write when the row's revision or the premise changed since
    (a compare-and-set on both)."""

    def peek(
        self, rollout_id: str, update_id: str, versions: Collection[int] = ()
    ) -> tuple[LedgerEntry | None, UpdateRecord | None, Peeked]:
        """The row (None: absent), the record of `update_id` and the premise of the row's
        version and `versions` (see `StoreView.read_premise`), from one consistent read;
        `write_one` guards on the premise of those same versions."""
        ...

    def write_one(
        self,
        pair: tuple[LedgerEntry, LedgerEntry],
        changes: Sequence[Change],
        at: float,
        counts: Mapping[str, int],
        step: Step,
        seen: Peeked | None,
    ) -> WriteOutcome:
        """Compare-and-set `pair` and append `changes` and `counts` in one atomic write.
        With `step.premise`, only while the premise is `seen`'s and the reserving update
        (the owner `pair` writes) is recorded and not poisoned ("moved" otherwise); "lost"
        when the row's revision moved; "won" when all of it landed."""
        ...


@runtime_checkable
class OneCallStore(Protocol):
    """A store that can make a whole single reservation in one round trip where it is
    certainly a win (PostgreSQL: the server judges the premise and splices the row)."""

    def reserve_one(
        self,
        rollout_id: str,
        expected_revision: int,
        update_id: str,
        stamp: AdmissionStamp,
        at: float,
        lease_expires_at: float,
        lease_seconds: float,
    ) -> LedgerEntry | None:
        """Reserve `rollout_id` at `expected_revision` for `update_id`, judged and written
        in one atomic call, but only where `plan_reserve` on the row and premise of that
        instant would plan exactly this write (the row rewarded at that revision, the
        update recorded and not poisoned, `stamp` (which passed on its own) reservable
        now): the entry written; None when anything else may be the answer, having
        written nothing (the caller runs the full path, whose own read answers)."""
        ...


class StoreLedger:
    """The one ledger: the protocol over any `Store`.

    Outcomes that write nothing (a lost compare-and-set, a refusal, an idempotent retry) are
    counted by this object only (PROCESS_LOCAL_COUNTERS): a losing racer writes nothing.
    """

    #: counters of outcomes that write nothing; each ledger object counts its own, so a
    #: durable ledger's statistics() from a later process shows 0 for them
    process_local_counters: ClassVar[frozenset[str]] = PROCESS_LOCAL_COUNTERS

    def __init__(
        self,
        store: Store,
        *,
        clock: Clock,
        lease_seconds: float,
        recovery: RecoveryRule | None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.lease_seconds = check_lease_seconds(lease_seconds)
        self.recovery = recovery or RecoveryRule()
        self._outcomes: Counter[str] = Counter()
        self._outcomes_lock = threading.Lock()
        self._guarded = store if isinstance(store, GuardedStore) else None
        self._one_call = store if isinstance(store, OneCallStore) else None
        # whether an add must hold the dispatch lock alone (it counts the live budget under
        # a pacing policy): assumed until a step reads that no pacing policy is recorded
        self._adds_count = True

    # ---- plumbing ------------------------------------------------------------------------

    def _step(self, body: Callable[[UnitOfWork, Counter[str]], T], step: Step) -> T:
        """Run one atomic step; its write-nothing outcomes (the second argument of `body`)
        are counted once, from the run that ended the step, whether it returned or raised."""
        local: Counter[str] = Counter()

        def attempt(uow: UnitOfWork) -> T:
            local.clear()  # a step run again must not count twice
            return body(uow, local)

        try:
            return self.store.atomic(attempt, step)
        finally:
            self._count_local(local)

    def _count_local(self, counts: Mapping[str, int]) -> None:
        if any(counts.values()):
            with self._outcomes_lock:
                self._outcomes.update({k: v for k, v in counts.items() if v})

    def _now(self, uow: UnitOfWork) -> float:
        """The deployment's clock: the store's (PostgreSQL's server) or this ledger's."""
        now = uow.server_now()
        return self.clock() if now is None else now

    def _apply(
        self,
        uow: UnitOfWork,
        event: str,
        befores: Sequence[LedgerEntry],
        afters: list[LedgerEntry],
        update_id: str | None,
        counts: Mapping[str, int],
        *,
        by_owner: bool = False,
        updates: Sequence[UpdateChange] = (),
    ) -> list[LedgerEntry]:
        """Write a step's planned changes to rows it read under its lock, with their events
        (recorded for `update_id`, or with `by_owner` for each row's own holder: lease
        expiry returns many updates' rows at once), and the updates' changes it makes."""
        enforce(afters)
        pairs = list(zip(befores, afters, strict=True))
        if pairs and len(uow.write(pairs)) != len(pairs):
            raise LedgerError(f"rollouts of {event} changed under this step's lock")
        changes: list[Change] = [
            (event, b, a, b.reserved_by if by_owner else update_id) for b, a in pairs
        ]
        uow.append(changes, self.clock(), {"writes": len(changes), **counts}, updates)
        return afters

    def _located(self, out: ReserveOutcome) -> ReserveOutcome:
        """A `no_admission_policy` refusal names this ledger's database in its hint: a bare
        `deployment set-policy` would record the policy in a new ./rollout-lifecycle.db.
        Any other outcome (a reason not in _LOCATED) is returned as it is."""
        url = getattr(self.store, "url", None)
        if out.reason not in _LOCATED or not isinstance(url, str):
            return out
        return attrs.evolve(out, detail=rules.no_policy_detail(url))

    # ---- protocol --------------------------------------------------------------------------

    def add(self, rollout: Rollout | LedgerEntry) -> LedgerEntry:
        """Insert a new rollout at revision 0; its id must be new."""
        return self.add_many([rollout])[0]

    def add_many(self, rollouts: Sequence[Rollout | LedgerEntry]) -> list[LedgerEntry]:
        """Insert several new rollouts in one atomic step, all or nothing: a duplicate id
        anywhere (stored or in the list) adds none of them.

        With a pacing policy recorded (batch_size or max_attempts), an add is a dispatch
        that does not wait: judged inside its step by the same rules as `dispatch` (the
        version, the prompt's attempt chain, the live budget), each new rollout numbered as
        its chain's next attempt; any refusal raises DispatchRefused (nothing is added).
        Without one, a rollout of a version marked bad or rolled back is quarantined on
        arrival."""
        items = list(rollouts)
        entries = [as_entry(r) for r in items]
        plans = [plan_add(e, ()) for e in entries]  # validated before any lock is taken
        if not entries:
            return []
        own = [identity_chain(r.identity) if isinstance(r, Rollout) else None for r in items]
        versions = judged_versions(e.behavior_version for e in entries)

        def body(uow: UnitOfWork, _: Counter[str], exclusive: bool) -> list[LedgerEntry]:
            act = uow.read_premise(versions)
            bad = uow.bad_versions()
            pol = act.policy
            if pol is not None and pol.paced and act.was_active is not None:
                if not exclusive:
                    raise _CountFirst()
                paced = self._paced_adds(uow, act, entries, own)
                steps = [plan_add(e, bad, dispatched=e.chain is not None) for e in paced]
            else:
                self._adds_count = False
                steps = [
                    plan_add(e, bad, retired=act.retired)
                    if e.behavior_version in bad or e.behavior_version in act.retired
                    else p
                    for e, p in zip(entries, plans, strict=True)
                ]
            final = [s[-1][2] for s in steps]
            enforce(a for s in steps for _, b, a in s if b is not None)
            uow.insert(final)
            changes: list[Change] = [(ev, b, a, None) for s in steps for ev, b, a in s]
            uow.append(changes, self.clock(), {"writes": len(changes)})
            return final

        # an add counts the live budget only under a pacing policy, which the step reads:
        # it shares the dispatch lock (PostgreSQL) until a policy says it must hold it alone
        exclusive = self._adds_count
        while True:
            step = Step("add", premise=True, bad="read", live="count" if exclusive else "add")
            try:
                return self._step(functools.partial(body, exclusive=exclusive), step)
            except _CountFirst:
                exclusive = self._adds_count = True

    def _paced_adds(
        self,
        uow: UnitOfWork,
        act: ActivationPremise,
        entries: Sequence[LedgerEntry],
        own: Sequence[str | None],
    ) -> list[LedgerEntry]:
        """`entries` judged as dispatches in this step, in order (each counts on the budget
        and its chain as the ones before it left them): each with its chain and attempt, or
        DispatchRefused naming the reason and `ledger.dispatch`."""
        pol = act.policy
        assert pol is not None
        floor = window_floor(act.pointer_version, pol)
        live = uow.count(LIVE_STATES, floor)
        keys = [chain_of(e, None, key, pol) for e, key in zip(entries, own, strict=True)]
        chains = uow.chain_states(sorted({k for k in keys if k is not None}))
        out: list[LedgerEntry] = []
        for e, chain in zip(entries, keys, strict=True):
            # chain_key 'caller': an add names no chain, only the budget
            chain_states = () if chain is None else chains.get(chain, ())
            premise = DispatchPremise(
                act.pointer_version, act.was_active, pol, live, chain_states, act.retired
            )
            got, new = plan_dispatch(e, chain or "", premise, chained=chain is not None)
            if new is None:
                raise DispatchRefused(
                    f"rollout {brief(e.rollout_id)} was not added ({got.reason}: {got.detail}); "
                    "the deployment's pacing policy judges every entry: call "
                    "ledger.dispatch(rollout) before generating it, and wait while it says "
                    "no_capacity (nothing was added)",
                    reason=got.reason,
                )
            if chain is not None:
                chains[chain] = (*chain_states, new.state)
            live += 1
            out.append(new)
        return out

    def find(self, rollout_id: str) -> LedgerEntry | None:
        """The entry, or None when absent."""
        return self.store.find(check_id(rollout_id))

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
        # planned on a read outside any step, like `reserve`: the conditional write decides
        entry = self.get(rollout_id)
        if entry.revision != expected_revision:
            self._count_local({"cas_conflicts": 1})
            raise RevisionConflict(rollout_id, expected_revision, entry.revision)
        new = plan_transition(entry, event, **changes)
        enforce([new])
        step = Step(f"transition {event}")
        if self._guarded is not None:  # one write with its events, no premise to guard
            got = self._guarded.write_one(
                (entry, new), [(event, entry, new, None)], self.clock(), {"writes": 1}, step, None
            )
            if got == "won":
                return new
            now = self.find(rollout_id)
            self._count_local({"cas_conflicts": 1})
            raise RevisionConflict(
                rollout_id, expected_revision, -1 if now is None else now.revision
            )

        def body(uow: UnitOfWork, local: Counter[str]) -> LedgerEntry:
            if uow.write([(entry, new)]):
                uow.append([(event, entry, new, None)], self.clock(), {"writes": 1})
                return new
            # lost between the read and the write: report what is there now
            now = uow.read_rows([rollout_id]).get(rollout_id)
            local["cas_conflicts"] += 1
            raise RevisionConflict(
                rollout_id, expected_revision, -1 if now is None else now.revision
            )

        return self._step(body, step)

    def reserve(
        self,
        rollout_id: str,
        expected_revision: int,
        update_id: str,
        admission: AdmissionStamp | None,
    ) -> ReserveOutcome:
        """Compare-and-set reservation of one rollout.

        Planned on a read outside any step, so a conflict or a bad stamp costs no write
        lock; the step then judges the premise as of its own moment and writes with ONE
        conditional write whose outcome decides who won. A `GuardedStore` reads the premise
        with the row, so it is judged with the plan, and writes only while the premise it
        was judged on still holds under the premise lock (else the step judges it again).
        Every answer is true at one instant inside the call: a refusal the step's premise
        gives is paired with the row the step itself reads (issue 33).

        A `OneCallStore` (PostgreSQL) first tries the whole reservation in one round trip,
        for a stamp that passes on its own: the store writes only a certain win, judged at
        the write's instant, and otherwise writes nothing and this path runs as above.
        """
        check_update_id(update_id)
        one = self._one_call
        if (
            one is not None
            and type(admission) is AdmissionStamp
            and rules.reservation_refusal(admission, admission.behavior_version, None, None) is None
        ):  # the stamp alone passes: the store may judge the rest and write in one call
            won = one.reserve_one(
                check_id(rollout_id),
                check_revision(expected_revision),
                update_id,
                admission,
                self.clock(),
                self.clock() + self.lease_seconds,
                self.lease_seconds,
            )
            if won is not None:
                return ReserveOutcome(rollout_id, True, RESERVED, won)
        guarded, seen, start = self._guarded, None, None
        if guarded is not None:  # the row and the premise in one read: judged right here
            stamped = judged_versions(stamp_versions([admission]))
            entry, record, seen = guarded.peek(check_id(rollout_id), update_id, stamped)
            start = seen.now
        else:
            entry, record = self.store.find_with_update(check_id(rollout_id), update_id)
        out, new = plan_reserve(
            entry,
            rollout_id,
            expected_revision,
            update_id,
            admission,
            premise=NO_REGISTRY if seen is None else seen.premise,
            lease_expires_at=(self.clock() if start is None else start) + self.lease_seconds,
            poisoned=record is not None and record.status == "poisoned",
        )
        if new is None or entry is None:
            self._count_local({counter_of(out.reason): 1})
            return self._located(out)
        # the first reservation of an update also records it: that takes the step below
        if guarded is not None and record is not None:
            enforce([new])
            got = guarded.write_one(
                (entry, new),
                [("reserve", entry, new, update_id)],
                self.clock(),
                {"writes": 1, "reservations": 1},
                _RESERVE,
                seen,
            )
            if got == "won":
                return out
            if got == "lost":  # see the step's own lost path below
                again = replan_lost(
                    self.find(rollout_id),
                    rollout_id,
                    expected_revision,
                    update_id,
                    admission,
                    new.lease_expires_at,
                )
                self._count_local({counter_of(again.reason): 1})
                return again
            # "moved": the premise changed since the peek; judge it again inside a step
        planned, fresh, version, digest = out, new, entry.behavior_version, entry.artifact_hash
        versions = judged_versions([version, *stamp_versions([admission])])

        def body(uow: UnitOfWork, local: Counter[str]) -> ReserveOutcome:
            # planning judged the stamp alone already (it passed: else no step runs); under
            # this step's lock the update's record and the premise are judged, with the
            # stamp as the request it is
            premise = uow.read_premise(versions)
            now_record = uow.read_updates([update_id]).get(update_id)
            refusal: tuple[str, str] | None
            if now_record is not None and now_record.status == "poisoned":
                refusal = (UPDATE_POISONED, _POISONED)
            elif premise is NO_REGISTRY:
                refusal = None
            else:
                refusal = premise.refusal(admission, version, digest, stamp_passed=True)
            if refusal is not None:
                # an answer is true at one instant: this step's premise goes with this
                # step's row, not the one read before it (the earlier checks come first)
                row = uow.read_rows([rollout_id]).get(rollout_id)
                if row is None or row.revision != entry.revision:
                    again = replan_lost(
                        row, rollout_id, expected_revision, update_id, admission, None
                    )
                    local[counter_of(again.reason)] += 1
                    return again
                local["refused"] += 1
                return self._located(ReserveOutcome(rollout_id, False, refusal[0], row, refusal[1]))
            now, done, lease = uow.server_now(), planned, fresh
            if now is not None:  # the deadline is the server's, not this client's
                lease = _evolve(fresh, lease_expires_at=now + self.lease_seconds)
                done = attrs.evolve(planned, entry=lease)
            enforce([lease])
            if uow.write([(entry, lease)]):
                changes: list[Change] = [("reserve", entry, lease, update_id)]
                opened = open_change(update_id, now_record)
                uow.append(changes, self.clock(), {"writes": 1, "reservations": 1}, opened)
                return done
            # lost: re-plan on the row as it is now (revisions only grow, so a conflict, or
            # an idempotent retry if this update reserved it meanwhile through a batch)
            again = replan_lost(
                uow.read_rows([rollout_id]).get(rollout_id),
                rollout_id,
                expected_revision,
                update_id,
                admission,
                lease.lease_expires_at,
            )
            local[counter_of(again.reason)] += 1
            return again

        return self._step(body, _RESERVE)

    def reserve_batch(
        self, update_id: str, requests: Sequence[ReserveRequest]
    ) -> list[ReserveOutcome]:
        """Reserve many rollouts in one atomic step; each item wins or loses on its own CAS.

        One read of every row, one set-based compare-and-set, one append of the events:
        a constant number of store calls for any batch size.
        """
        check_update_id(update_id)
        requests = check_requests(requests)
        if not requests:
            return []
        ids = [r.rollout_id for r in requests]
        stamped = stamp_versions(r.admission for r in requests)

        def body(uow: UnitOfWork, local: Counter[str]) -> list[ReserveOutcome]:
            # locked: a row refused here cannot change before the step commits, so every
            # answer of the batch holds at its commit (a concurrent commit between this
            # read and the write made a refusal and a win true at no common instant)
            entries = uow.lock_rows(ids)
            # the premise of the versions judged only (the step holds the premise lock, so
            # reading it after the rows changes no answer)
            judged = [e.behavior_version for e in entries.values()]
            premise = uow.read_premise(judged_versions([*judged, *stamped]))
            lease = self._now(uow) + self.lease_seconds
            record = uow.read_updates([update_id]).get(update_id)
            outcomes, planned = plan_reserves(
                entries,
                requests,
                update_id,
                premise=premise,
                lease_expires_at=lease,
                poisoned=record is not None and record.status == "poisoned",
            )
            enforce(a for _, a in planned.values())
            won = uow.write(list(planned.values())) if planned else set()
            changes: list[Change]
            if len(won) == len(planned):  # every planned row won (the usual case)
                changes = [("reserve", b, a, update_id) for b, a in planned.values()]
            else:
                lost = [rid for rid in planned if rid not in won]
                now = uow.read_rows(lost)
                changes = []
                for i, r in enumerate(requests):
                    rid = r.rollout_id
                    if rid in won:
                        changes.append(("reserve", planned[rid][0], planned[rid][1], update_id))
                    elif rid in planned:  # lost to a writer that read and wrote after our read
                        outcomes[i] = replan_lost(
                            now.get(rid), rid, r.expected_revision, update_id, r.admission, lease
                        )
            reasons = Counter(map(_REASON, outcomes))
            counts: Counter[str] = Counter()
            for reason, n in reasons.items():
                counts[counter_of(reason)] += n
            durable = {k: v for k, v in counts.items() if k not in PROCESS_LOCAL_COUNTERS}
            local.update({k: v for k, v in counts.items() if k in PROCESS_LOCAL_COUNTERS})
            opened = open_change(update_id, record) if changes else []
            uow.append(changes, self.clock(), {"writes": len(changes), **durable}, opened)
            if _LOCATED.isdisjoint(reasons):  # no hint to name the database in
                return outcomes
            return [self._located(o) for o in outcomes]

        return self._step(body, _RESERVE_BATCH)

    def commit(self, update_id: str, rollout_ids: Sequence[str]) -> list[LedgerEntry]:
        """Consume exactly the rollouts `update_id` reserved, atomically.

        Refused, with nothing consumed: CommitMismatch when `rollout_ids` is not exactly
        what the update holds; UpdatePoisoned (a CommitMismatch) when the ledger records the
        update as poisoned, or it holds a rollout of a version rolled back (retired, read
        from the registry in this step). A refused commit poisons the update in its own
        step (that record is all it writes): it may have trained on a rollout another
        update consumes, so no later commit of it lands. A commit that consumes rollouts
        records the update as landed."""
        check_update_id(update_id)
        ids = _check_id_list(rollout_ids)

        def body(uow: UnitOfWork, _: Counter[str]) -> list[LedgerEntry] | CommitMismatch:
            record = _hold_update(uow, update_id)
            owned = uow.owned(update_id)
            act = uow.read_premise(judged_versions(e.behavior_version for e in owned))
            if record is not None and record.status == "poisoned":
                return poisoned_error(record)
            why = commit_mismatch(update_id, ids, owned)
            retired = sorted({e.behavior_version for e in owned} & act.retired)
            if why is None and not retired:
                new = [
                    plan_transition(e, "commit", reserved_by=None, lease_expires_at=None)
                    for e in owned
                ]
                landed = land_change(update_id, record) if owned else []
                return self._apply(
                    uow, "commit", owned, new, update_id, {"commits": 1}, updates=landed
                )
            if why is not None:
                cause, detail, error = POISON_COMMIT_MISMATCH, why, CommitMismatch(why)
            else:
                cause = POISON_RETIRED_VERSION
                held = [e.rollout_id for e in owned if e.behavior_version in act.retired]
                detail = f"holds {held[:5]} of v{retired} rolled back (retired)"
                error = None
            change = poison_change(update_id, record, cause, detail)
            assert change is not None  # not poisoned: judged above
            uow.append([], self.clock(), {}, [change])
            return error if error is not None else poisoned_error(change[2])

        got = self._step(body, Step("commit", premise=True))
        if isinstance(got, CommitMismatch):
            raise got
        return got

    def abort(self, update_id: str) -> list[LedgerEntry]:
        """Return every reservation of `update_id` under the recovery rule."""
        check_update_id(update_id)

        def body(uow: UnitOfWork, _: Counter[str]) -> list[LedgerEntry]:
            _hold_update(uow, update_id)
            owned = uow.owned(update_id)
            retired = uow.read_premise(judged_versions(e.behavior_version for e in owned)).retired
            bad = uow.bad_versions()
            new = [plan_release(e, "abort", self.recovery, bad, retired) for e in owned]
            return self._apply(uow, "abort", owned, new, update_id, {"aborts": 1})

        return self._step(body, Step("abort", premise=True, bad="read"))

    def fail_update(self, update_id: str, cause: str, detail: str = "") -> list[LedgerEntry]:
        """The update itself failed with this data: its rollouts end in update_failed."""
        check_update_id(update_id)
        if not isinstance(cause, str) or not cause:
            raise InvalidLedgerArgument(f"cause must be a non-empty string, got {brief(cause)}")
        failed = Disposition("update", cause, detail)

        def body(uow: UnitOfWork, _: Counter[str]) -> list[LedgerEntry]:
            _hold_update(uow, update_id)
            owned = uow.owned(update_id)
            new = [
                plan_transition(
                    e, "update_failed", reserved_by=None, lease_expires_at=None, disposition=failed
                )
                for e in owned
            ]
            return self._apply(uow, "update_failed", owned, new, update_id, {})

        return self._step(body, Step("fail_update"))

    def expire_leases(self) -> list[LedgerEntry]:
        """Return reservations whose lease ran out (a crashed learner never blocks forever)."""

        def body(uow: UnitOfWork, _: Counter[str]) -> list[LedgerEntry]:
            retired = uow.read_premise().retired
            due = uow.due(self._now(uow))
            bad = uow.bad_versions()
            new = [plan_release(e, "expire_lease", self.recovery, bad, retired) for e in due]
            counts = {"expirations": len(new)}
            # a holder that lost a lease may have trained on a rollout another update will
            # consume: it is poisoned in this same step (lineage: no commit of it lands)
            lost: dict[str, list[str]] = {}
            for e in due:
                if e.reserved_by is not None:
                    lost.setdefault(e.reserved_by, []).append(e.rollout_id)
            records = uow.read_updates(sorted(lost)) if lost else {}
            poisons = [
                c
                for u, rids in sorted(lost.items())
                if (
                    c := poison_change(
                        u, records.get(u), POISON_LEASE_EXPIRED, f"lease of {rids[:5]} expired"
                    )
                )
                is not None
            ]
            return self._apply(
                uow, "expire_lease", due, new, None, counts, by_owner=True, updates=poisons
            )

        return self._step(body, Step("expire_leases", premise=True, bad="read"))

    def renew_leases(self, update_id: str) -> list[LedgerEntry]:
        """Heartbeat of a long update: every rollout it holds gets a full lease from now
        (the deployment's clock). Only what it still holds: check the returned ids."""
        check_update_id(update_id)

        def body(uow: UnitOfWork, _: Counter[str]) -> list[LedgerEntry]:
            _hold_update(uow, update_id)
            owned = uow.owned(update_id)
            new = renew_plan(owned, self._now(uow), self.lease_seconds)
            return self._apply(uow, "renew_lease", owned, new, update_id, {})

        return self._step(body, Step("renew_leases"))

    def quarantine_version(self, version: int, reason: str) -> list[LedgerEntry]:
        """Mark a version bad: quarantine its open rollouts now, reserved ones when returned."""
        check_version(version)
        d = Disposition("activation", "failed_version", reason)

        def body(uow: UnitOfWork, _: Counter[str]) -> list[LedgerEntry]:
            uow.mark_bad(version, reason)
            due = uow.of_version(version, QUARANTINABLE)
            new = [plan_transition(e, "quarantine", disposition=d) for e in due]
            return self._apply(uow, "quarantine", due, new, None, {})

        return self._step(body, Step("quarantine_version", bad="change"))

    def clear_bad_version(self, version: int) -> None:
        """Lift the mark: the version became active after a retry, its new rollouts are good.

        Rollouts already quarantined stay quarantined (terminal states absorb).
        """
        check_version(version)

        def body(uow: UnitOfWork, _: Counter[str]) -> None:
            uow.clear_bad(version)
            uow.append([], self.clock(), {})  # the lifted mark's recorded row, if one was lifted

        self._step(body, Step("clear_bad_version", bad="change"))

    @property
    def bad_versions(self) -> frozenset[int]:
        """Versions marked bad by quarantine_version (the recovery rule quarantines them)."""
        return self.store.bad_versions()

    def reserved_by(self, update_id: str) -> list[str]:
        """Ids currently reserved by `update_id`, sorted."""
        return self.store.reserved_by(update_id)

    def in_state(self, state: str, limit: int | None = None) -> list[LedgerEntry]:
        """Entries in `state`, by rollout id (at most `limit`): a learner's 'what is waiting'."""
        if state not in LIFECYCLE.states:
            raise ValueError(f"unknown lifecycle state {state!r}")
        return self.store.in_state(state, None if limit is None else check_limit(limit))

    def update(self, update_id: str) -> UpdateRecord | None:
        """The ledger's record of `update_id` (open, landed or poisoned), or None when it
        never reserved: what lineage is read from."""
        return self.store.find_update(check_update_id(update_id))

    def updates(self) -> dict[str, UpdateRecord]:
        """Every update the ledger records, by id."""
        return self.store.all_updates()

    def dispatch(
        self, rollout: Rollout | LedgerEntry, *, chain: str | None = None
    ) -> DispatchOutcome:
        """Start a rollout only within the staleness budget (model.pacing): the pointer, the
        policy, the live count of the window and the chain are read inside the step that
        inserts the rollout, so no other dispatch counts the same free slot.

        The chain is the rollout's prompt identity (`chain_of`: dataset, prompt id, sample
        index) unless the recorded policy's chain_key is 'caller'; `chain` may then be
        omitted, and one that differs is refused (InvalidLedgerArgument)."""
        entry, caller, own = dispatch_entry(rollout, chain)
        versions = judged_versions([entry.behavior_version])

        def body(uow: UnitOfWork, _: Counter[str]) -> DispatchOutcome:
            act = uow.read_premise(versions)
            key = chain_of(entry, caller, own, act.policy)
            if key is None:
                raise InvalidLedgerArgument(
                    f"dispatch of {brief(entry.rollout_id)} names no chain: pass chain=KEY "
                    "(the deployment counts attempts by the caller's key, chain_key 'caller'), "
                    "or dispatch the Rollout (its identity names the chain)"
                )
            floor = window_floor(act.pointer_version, act.policy)
            live = uow.count(LIVE_STATES, floor)
            states = uow.chain_states([key]).get(key, ())
            premise = DispatchPremise(
                act.pointer_version, act.was_active, act.policy, live, states, act.retired
            )
            out, new = plan_dispatch(entry, key, premise)
            if new is None:
                return out
            changes = plan_add(new, uow.bad_versions(), dispatched=True)
            written = changes[-1][2]
            uow.insert([written])
            uow.append(
                [(ev, b, a, None) for ev, b, a in changes], self.clock(), {"writes": len(changes)}
            )
            return attrs.evolve(out, entry=written)

        return self._step(body, Step("dispatch", premise=True, bad="read", live="count"))

    def retire_stale(self) -> list[LedgerEntry]:
        """Retire, with their cause, rewarded rollouts now too old for the pointer."""

        def body(uow: UnitOfWork, _: Counter[str]) -> list[LedgerEntry]:
            act = uow.read_premise()
            # the open rollouts of a rolled-back version, whoever rolled it back (a
            # coordinator without this ledger too): quarantined here, by the ledger itself
            done: set[str] = set()
            befores: list[LedgerEntry] = []
            afters: list[LedgerEntry] = []
            for v in sorted(act.retired):
                for e in uow.of_version(v, QUARANTINABLE):
                    d = Disposition("activation", "rolled_back", f"v{v} was rolled back")
                    befores.append(e)
                    afters.append(plan_transition(e, "quarantine", disposition=d))
                    done.add(e.rollout_id)
            if befores:
                self._apply(uow, "quarantine", befores, afters, None, {})
            floor = window_floor(act.pointer_version, act.policy)
            if floor is None or act.policy is None or act.pointer_version is None:
                return afters
            due = [
                e
                for e in uow.older_than(floor, ("rewarded",))
                if e.state == "rewarded" and e.rollout_id not in done
            ]
            pointer, bound = act.pointer_version, act.policy.max_lag
            new = [
                plan_transition(
                    e,
                    "retire_stale",
                    disposition=stale_disposition(pointer - e.behavior_version, bound, pointer),
                )
                for e in due
            ]
            return afters + self._apply(uow, "retire_stale", due, new, None, {})

        return self._step(body, Step("retire_stale", premise=True, retires=True))

    def oldest_admissible(self, limit: int) -> list[LedgerEntry]:
        """Up to `limit` rewarded rollouts still within the lag bound, oldest first (read
        with the premise in one consistent view; nothing is written)."""
        limit = check_limit(limit)

        def body(view: StoreView) -> list[LedgerEntry]:
            act = view.read_premise()
            floor = window_floor(act.pointer_version, act.policy)
            return oldest_first(view.rewarded_between(floor, act.pointer_version, limit))

        return self.store.view(body, "oldest_admissible")

    def land_and_reserve(
        self,
        update_id: str | None,
        landings: Sequence[Landing] = (),
        *,
        close: Sequence[tuple[str, str, Disposition]] = (),
        reserve: Mapping[str, AdmissionStamp] | None = None,
    ) -> LandedStep:
        """Land a step's generations, close what must not train, and reserve, in ONE step.

        A trainer's per-step write as one atomic step whose cost is what it writes, whatever
        the ledger's size: each landing is applied to its row as read in this step (see
        `Landing`); each `(id, event, disposition)` of `close` fires `event` (one of
        CLOSING_EVENTS) on the row if the machine allows it from the row's state; then each
        id of `reserve` is reserved for `update_id` with its stamp on the row as this step
        left it (it must be rewarded; the stamp is judged against the registry's premise of
        this step, as `reserve_batch` judges it). The compare-and-set of a reservation is on
        the revision this step read: nothing can move the row in between, except on a store
        that locks rows rather than the step, where a lost write is reported
        ('revision_conflict') and writes nothing.
        """
        items = check_landings(landings)
        closes = [(check_id(r), ev, d) for r, ev, d in close]
        for rid, ev, d in closes:
            if ev not in CLOSING_EVENTS:
                raise InvalidLedgerArgument(
                    f"{rid}: close takes {sorted(CLOSING_EVENTS)}, got {brief(ev)}"
                )
            direct_changes(ev, None, d)
        stamps = dict(reserve or {})
        if stamps:
            if update_id is None:
                raise InvalidLedgerArgument("reserving needs an update id")
            check_update_id(update_id)
            check_requests([ReserveRequest(check_id(r), 0, s) for r, s in stamps.items()])
        ids = list(dict.fromkeys([x.rollout_id for x in items] + [r for r, _, _ in closes]))
        ids += [r for r in stamps if r not in set(ids)]
        if not ids:
            return LandedStep({}, (), {})

        # a reserved row's version: its stored one, or its landing's where this step adds it
        landed = [x.behavior_version for x in items if x.rollout_id in stamps]
        stamped = stamp_versions(stamps.values())

        def body(uow: UnitOfWork, local: Counter[str]) -> LandedStep:
            rows = uow.read_rows(ids)
            bad = uow.bad_versions()
            held = [rows[r].behavior_version for r in stamps if r in rows]
            act = uow.read_premise(judged_versions([*held, *landed, *stamped]))
            # under a pacing policy every entry enters through dispatch, which counts it on
            # the budget and its prompt's chain: a rollout never dispatched is not added here
            paced = act.policy is not None and act.policy.paced and act.was_active is not None
            now: dict[str, LedgerEntry] = dict(rows)
            changes: list[Change] = []
            skipped: dict[str, str] = {}
            for x in items:
                row = now.get(x.rollout_id)
                if row is None and paced:
                    skipped[x.rollout_id] = NOT_DISPATCHED
                    continue
                steps, after, why = plan_landing(row, x, bad)
                if why is not None:
                    skipped[x.rollout_id] = why
                    continue
                assert after is not None
                changes.extend(steps)
                now[x.rollout_id] = after
            for rid, ev, d in closes:
                row = now.get(rid)
                if row is None or not LIFECYCLE.is_legal(row.state, ev):
                    skipped[rid] = "missing" if row is None else row.state
                    continue
                after = plan_transition(row, ev, **direct_changes(ev, None, d))
                changes.append((ev, row, after, None))
                now[rid] = after
            outcomes: list[ReserveOutcome] = []
            record: UpdateRecord | None = None
            if stamps:
                assert update_id is not None
                premise = act
                lease = self._now(uow) + self.lease_seconds
                record = uow.read_updates([update_id]).get(update_id)
                requests = [
                    ReserveRequest(r, now[r].revision if r in now else 0, s)
                    for r, s in stamps.items()
                ]
                outcomes, planned = plan_reserves(
                    now,
                    requests,
                    update_id,
                    premise=premise,
                    lease_expires_at=lease,
                    poisoned=record is not None and record.status == "poisoned",
                )
                for rid, (b, a) in planned.items():
                    changes.append(("reserve", b, a, update_id))
                    now[rid] = a
            enforce(a for _, _, a, _ in changes)
            fresh = [now[r] for r in ids if r not in rows and r in now]
            if fresh:
                uow.insert(fresh)
            pairs = [(rows[r], now[r]) for r in ids if r in rows and now[r] is not rows[r]]
            won = uow.write(pairs) if pairs else set()
            if len(won) != len(pairs):  # a store that locks rows: another writer moved it
                lost = {a.rollout_id for _, a in pairs} - won
                changes = [c for c in changes if c[2].rollout_id not in lost]
                for rid in lost:
                    skipped[rid] = CONFLICT
                    now[rid] = rows[rid]
                outcomes = [
                    ReserveOutcome(o.rollout_id, False, CONFLICT, rows[o.rollout_id])
                    if o.rollout_id in lost
                    else o
                    for o in outcomes
                ]
            counts: Counter[str] = Counter()
            for reason, n in Counter(o.reason for o in outcomes).items():
                counts[counter_of(reason)] += n
            durable = {k: v for k, v in counts.items() if k not in PROCESS_LOCAL_COUNTERS}
            local.update({k: v for k, v in counts.items() if k in PROCESS_LOCAL_COUNTERS})
            reserved = update_id is not None and any(c[0] == "reserve" for c in changes)
            opened = open_change(update_id, record) if reserved and update_id else []
            uow.append(changes, self.clock(), {"writes": len(changes), **durable}, opened)
            return LandedStep(now, tuple(outcomes), skipped)

        step = Step("land_and_reserve", premise=bool(stamps), bad="read", live="add")
        return self._step(body, step)

    def dispatch_many(
        self, rollouts: Sequence[tuple[Rollout | LedgerEntry, str | None]]
    ) -> list[DispatchOutcome]:
        """`dispatch` of several (rollout, chain or None) pairs in ONE step, judged in order:
        the premise and the live count are read once, and each rollout dispatched counts
        against the budget of the ones after it (the same answers as dispatching them one
        by one with nothing in between). Each chain is chosen as `dispatch` chooses it
        (`chain_of`: the rollout's prompt identity unless the policy's chain_key is
        'caller'). A rollout whose id is already in the ledger is refused with reason
        'already_dispatched' and its stored entry (a resumed trainer re-issuing a prompt it
        dispatched before it died continues that attempt)."""
        entries = [dispatch_entry(r, c) for r, c in rollouts]
        if not entries:
            return []
        versions = judged_versions(e.behavior_version for e, _, _ in entries)

        def body(uow: UnitOfWork, _: Counter[str]) -> list[DispatchOutcome]:
            act = uow.read_premise(versions)
            floor = window_floor(act.pointer_version, act.policy)
            live = uow.count(LIVE_STATES, floor)
            stored = uow.read_rows([e.rollout_id for e, _, _ in entries])
            bad = uow.bad_versions()
            # every new prompt's chain read at once (the key of one named by no chain is
            # refused below, in its turn)
            keys = [
                None if e.rollout_id in stored else chain_of(e, caller, own, act.policy)
                for e, caller, own in entries
            ]
            known = uow.chain_states(sorted({k for k in keys if k is not None}))
            extra: dict[str, list[str]] = {}  # chain -> states dispatched earlier in the batch
            out: list[DispatchOutcome] = []
            fresh: list[LedgerEntry] = []
            taken: set[str] = set()
            changes: list[Change] = []
            for (entry, _caller, _own), key in zip(entries, keys, strict=True):
                rid = entry.rollout_id
                have = stored.get(rid)
                if have is not None or rid in taken:
                    got = have if have is not None else entry
                    out.append(
                        DispatchOutcome(
                            rid, False, ALREADY_DISPATCHED, got, got.attempt, None, live
                        )
                    )
                    continue
                if key is None:
                    raise InvalidLedgerArgument(
                        f"dispatch of {brief(rid)} names no chain: pass a chain (the "
                        "deployment counts attempts by the caller's key, chain_key 'caller'), "
                        "or dispatch the Rollout (its identity names the chain)"
                    )
                states = known.get(key, ()) + tuple(extra.get(key, ()))
                premise = DispatchPremise(
                    act.pointer_version, act.was_active, act.policy, live, states, act.retired
                )
                o, new = plan_dispatch(entry, key, premise)
                if new is None:
                    out.append(o)
                    continue
                steps = plan_add(new, bad, dispatched=True)
                written = steps[-1][2]
                fresh.append(written)
                taken.add(rid)
                changes.extend((ev, b, a, None) for ev, b, a in steps)
                extra.setdefault(key, []).append(written.state)
                if written.state in LIVE_STATES and (
                    floor is None or written.behavior_version >= floor
                ):
                    live += 1
                out.append(attrs.evolve(o, entry=written))
            if fresh:
                uow.insert(fresh)
                uow.append(changes, self.clock(), {"writes": len(changes)})
            return out

        return self._step(body, Step("dispatch", premise=True, bad="read", live="count"))

    def premise_and_rows(
        self, rollout_ids: Sequence[str]
    ) -> tuple[ActivationPremise, dict[str, LedgerEntry]]:
        """The registry's premise and these rows from ONE consistent view (nothing is
        written): what admission judges them on was true at one instant."""
        ids = [check_id(r) for r in rollout_ids]

        def body(view: StoreView) -> tuple[ActivationPremise, dict[str, LedgerEntry]]:
            return view.read_premise(), view.read_rows(ids)

        return self.store.view(body, "premise_and_rows")

    def step_premise(self, update_ids: Sequence[str] = ()) -> StepPremise:
        """What a trainer reads before its step, from ONE consistent view (nothing is
        written): the registry's premise, the bad versions, and the ids each of
        `update_ids` holds. One read where a pointer, a policy, a bad-versions and a
        `reserved_by` read per update each took a transaction of their own (the
        ever-active versions a reservation judges are not read: its step reads them)."""
        ids = [check_update_id(u) for u in update_ids]

        def body(view: StoreView) -> StepPremise:
            pointer, policy = view.read_policy()
            held = {u: view.reserved_ids(u) for u in dict.fromkeys(ids)}
            return StepPremise(pointer, policy, view.bad_versions(), held)

        return self.store.view(body, "step_premise")

    def snapshot(self) -> dict[str, LedgerEntry]:
        """A consistent copy of every entry (records are frozen, so sharing them is safe)."""
        return self.store.snapshot()

    def history(self, rollout_id: str | None = None) -> list[EntryChanged]:
        """This ledger's trace, optionally for one rollout."""
        if rollout_id is not None:
            check_id(rollout_id)
        return self.store.history(rollout_id)

    def statistics(self) -> LedgerStatistics:
        """Counts by state and counters of writes, wins, losses and returns."""
        by_state, durable, bad, pacing = self.store.tallies()
        counters = Counter(durable)
        with self._outcomes_lock:
            counters.update(self._outcomes)
        base = statistics_from((), counters, bad, pacing)
        states = {s: int(by_state.get(s, 0)) for s in base.by_state}
        return attrs.evolve(base, entries=sum(states.values()), by_state=states)

    def close(self) -> None:
        """Release the store (connections, pools); later use of a durable one raises."""
        self.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- landing a step's generations and reserving them in one step (verl's buffer) ------------


@attrs.frozen
class Landing:
    """What became of one rollout's generation, as its producer learnt it.

    `land_and_reserve` applies it to the row as that step reads it: an absent row is added
    (rewarded when `reward` is given, else generated; quarantined at once with `failure`),
    unless a pacing policy is recorded, under which only `dispatch` makes entries (skipped:
    'not_dispatched');
    a dispatched row is moved through `generation_done` (tokens) and `reward_ready`, or
    through `generation_failed` with `failure`; a generated row gets its reward. Any other
    row already landed: it is left as it is. The behaviour version and hash name the
    rollout only when it is added; a dispatched row keeps its own (stamped at dispatch).
    """

    rollout_id: str
    behavior_version: int
    artifact_hash: str
    reward: Reward | None = None
    tokens: int | None = None
    failure: Disposition | None = None


#: the events `land_and_reserve` may close a rollout with, from any state that allows them
CLOSING_EVENTS = frozenset({"retire_stale", "quarantine", "generation_failed"})


@attrs.frozen
class StepPremise:
    """What `step_premise` read in one view: the active version and the recorded policy
    (None without a registry), the versions marked bad, and the ids each asked-for update
    holds."""

    pointer: int | None
    policy: AdmissionPolicy | None
    bad: frozenset[int]
    held: dict[str, list[str]]


@attrs.frozen
class LandedStep:
    """What one `land_and_reserve` step did.

    `entries` holds, for every id it read, the row as the step left it; `outcomes` one
    reservation outcome per requested id, in request order; `skipped` why a landing or a
    closing left its row unchanged (the row's state, or 'revision_conflict' when another
    writer moved it between this step's read and its write, on a store that locks rows
    rather than the whole step)."""

    entries: dict[str, LedgerEntry]
    outcomes: tuple[ReserveOutcome, ...]
    skipped: dict[str, str]

    @property
    def reserved(self) -> list[str]:
        """Ids the update holds after the step (new reservations and idempotent retries)."""
        return [o.rollout_id for o in self.outcomes if o.reserved]


def check_landings(landings: Sequence[object]) -> list[Landing]:
    """Landings, checked before any lock: a column at a time where every value is plain
    (ids, versions, hashes, as `texts_pass`/`ints64_pass` judge them), else item by item
    through the fields of the entry each would be added as (the first bad one refused). The
    rules every planned write must pass are enforced inside the step."""
    for x in landings:
        if not isinstance(x, Landing):
            raise InvalidLedgerArgument(f"a landing must be a Landing, got {brief(x)}")
    out: list[Landing] = list(landings)  # type: ignore[arg-type]  # checked just above
    plain = (
        texts_pass([x.rollout_id for x in out])
        and texts_pass([x.artifact_hash for x in out], max_length=None)
        and ints64_pass([x.behavior_version for x in out])
        and ints64_pass([x.tokens for x in out if x.tokens is not None])
    )
    for x in out:
        if not plain:
            landing_entry(x)  # the record's own validators name what is wrong
        if x.reward is not None and type(x.reward) is not Reward:
            raise InvalidLedgerArgument(f"reward must be a Reward, got {brief(x.reward)}")
        if x.failure is not None and type(x.failure) is not Disposition:
            raise InvalidLedgerArgument(f"failure must be a Disposition, got {brief(x.failure)}")
    return out


def landing_entry(landing: Landing) -> LedgerEntry:
    """The entry an absent rollout is added as (rewarded when scored, else generated)."""
    return LedgerEntry(
        landing.rollout_id,
        landing.behavior_version,
        landing.artifact_hash,
        state="rewarded" if landing.reward is not None and landing.failure is None else "generated",
        reward=None if landing.failure is not None else landing.reward,
        tokens=landing.tokens,
    )


def plan_landing(
    row: LedgerEntry | None, landing: Landing, bad: Iterable[int]
) -> tuple[list[Change], LedgerEntry | None, str | None]:
    """(changes, the row after them, why nothing changed) for one landing on `row`."""
    if row is None:
        steps = plan_add(landing_entry(landing), bad)
        changes: list[Change] = [(ev, b, a, None) for ev, b, a in steps]
        now = steps[-1][2]
        if landing.failure is not None and now.state != "quarantined":
            d = Disposition("generation", landing.failure.cause, landing.failure.detail)
            q = plan_transition(now, "quarantine", disposition=attrs.evolve(d, stage="admission"))
            changes.append(("quarantine", now, q, None))
            now = q
        return changes, now, None
    changes = []
    now = row
    if now.state == "dispatched":
        if landing.failure is not None:
            fail = direct_changes("generation_failed", None, landing.failure, landing.tokens)
            after = plan_transition(now, "generation_failed", **fail)
            return [("generation_failed", now, after, None)], after, None
        done = plan_transition(
            now, "generation_done", **direct_changes("generation_done", None, None, landing.tokens)
        )
        changes.append(("generation_done", now, done, None))
        now = done
    if now.state == "generated" and landing.reward is not None and landing.failure is None:
        scored = plan_transition(now, "reward_ready", reward=landing.reward)
        changes.append(("reward_ready", now, scored, None))
        now = scored
    if not changes:
        return [], row, row.state
    return changes, now, None


# ---- the memory store ----------------------------------------------------------------------


class MemoryStore:
    """Entries in a dict; one lock (the registry's, when attached) makes a step atomic.

    An ownership index and a lease heap are kept in step with every write, so commit, abort,
    fail_update, reserved_by and expire_leases cost what the update holds or what is due,
    not the size of the ledger. The heap is lazy: a deadline whose reservation has since
    ended is dropped when it surfaces.
    """

    def __init__(self, activation: ActivationSource | None, log: EventLog) -> None:
        # attached to a registry, the store shares its lock: a reservation reads the active
        # pointer and writes in ONE step that no pointer switch can interleave with
        self.activation = activation
        self.lock = activation.lock if activation is not None else threading.RLock()
        self.log = log
        # the ledger's update records; shared with an attached registry that keeps them
        # (MemoryRegistry.ledger_updates), as the SQL stores share one database
        shared = getattr(activation, "ledger_updates", None)
        self.updates: dict[str, UpdateRecord] = shared if isinstance(shared, dict) else {}
        self.entries: dict[str, LedgerEntry] = {}
        self.bad: set[int] = set()
        self.counters: Counter[str] = Counter()
        self.reindex()

    def reindex(self) -> None:
        """Rebuild the indexes (ownership, lease heap, chains, counts by state and version)
        from the entries."""
        self.owners: dict[str, set[str]] = {}
        self.leases: list[tuple[float, str]] = []
        self._held = 0
        self.chains: dict[str, list[str]] = {}
        self.versions: dict[str, Counter[int]] = {}  # state -> behaviour version -> entries
        self._index_many((None, e) for e in self.entries.values())

    def _index(self, before: LedgerEntry | None, after: LedgerEntry) -> None:
        """Index one write, already stored (`before` None: an insert)."""
        self._index_many(((before, after),))

    def _index_many(self, writes: Iterable[tuple[LedgerEntry | None, LedgerEntry]]) -> None:
        """Index writes that are already stored, in their order, each (the entry it replaced
        or None, the entry now stored). One pass: the counts by state and version move once
        per kind of move (a batch's rows mostly make one), the owner's set is looked up once
        per run of rows of one owner, and the lease heap is checked for bloat once."""
        versions, owners, chains = self.versions, self.owners, self.chains
        leases, push = self.leases, heapq.heappush
        # (state, version) before (None: an insert) and after -> how many rows moved so
        shifts: dict[tuple[str | None, int, str, int], int] = {}
        key: tuple[str | None, int, str, int]
        held_now = self._held
        owner: str | None = None  # the owner whose set `held` is, while it is in `owners`
        held: set[str]  # bound with `owner`, before its first use
        for before, after in writes:
            rid, state, version = after.rollout_id, after.state, after.behavior_version
            if before is None:
                if after.chain is not None:
                    chains.setdefault(after.chain, []).append(rid)
                key = (None, -1, state, version)
                shifts[key] = shifts.get(key, 0) + 1
            else:
                if before.state != state or before.behavior_version != version:
                    key = (before.state, before.behavior_version, state, version)
                    shifts[key] = shifts.get(key, 0) + 1
                gone_from = before.reserved_by
                if gone_from is not None:
                    gone = owners.get(gone_from)
                    if gone is not None and before.rollout_id in gone:
                        gone.discard(before.rollout_id)
                        held_now -= 1
                        if not gone:
                            del owners[gone_from]
                            owner = None  # its set may be the one `held` names
            taker = after.reserved_by
            if taker is None:
                continue
            if taker is not owner:
                owner = taker
                held = owners.setdefault(taker, set())
            if rid not in held:
                held.add(rid)
                held_now += 1
            if after.lease_expires_at is not None:
                push(leases, (after.lease_expires_at, rid))
        self._held = held_now
        # moving the counts kind by kind, in the order each kind first came, ends where
        # moving them row by row would: each row leaves a (state, version) it is counted in
        for (old_state, old_version, state, version), n in shifts.items():
            was = None if old_state is None else versions.get(old_state)
            if was is not None and was.get(old_version, 0) > 0:
                if was[old_version] <= n:
                    del was[old_version]
                else:
                    was[old_version] -= n
            now = versions.get(state)
            if now is None:
                now = versions[state] = Counter()
            now[version] = now.get(version, 0) + n
        if len(leases) > 1024 and len(leases) > 4 * held_now:
            # mostly deadlines of reservations that ended: rebuild from what is held now
            # (every write indexed here is stored already, so none loses its deadline)
            self.leases = [
                (e.lease_expires_at, e.rollout_id)
                for e in (self.entries.get(r) for s in owners.values() for r in s)
                if e is not None and e.lease_expires_at is not None
            ]
            heapq.heapify(self.leases)

    # ---- the step: the store is its own unit of work, under its lock ---------------------

    def atomic(self, body: Callable[[UnitOfWork], T], step: Step) -> T:
        """Run `body` under the lock (a step that raises has written nothing: every write
        comes after its step's last refusal)."""
        with self.lock:
            return body(self)

    def view(self, body: Callable[[StoreView], T], what: str) -> T:
        with self.lock:
            return body(self)

    def read_rows(self, rollout_ids: Sequence[str]) -> dict[str, LedgerEntry]:
        got = self.entries.get
        return {rid: e for rid in rollout_ids if (e := got(rid)) is not None}

    def lock_rows(self, rollout_ids: Sequence[str]) -> dict[str, LedgerEntry]:
        return self.read_rows(rollout_ids)  # every step holds the store's lock

    def owned(self, update_id: str) -> list[LedgerEntry]:
        held = self.owners.get(update_id, ())
        return sorted((self.entries[r] for r in held), key=lambda e: e.rollout_id)

    def reserved_ids(self, update_id: str) -> list[str]:
        return sorted(self.owners.get(update_id, ()))

    def read_policy(self) -> tuple[int | None, AdmissionPolicy | None]:
        premise = self.read_premise(())  # no version's facts: the pointer and policy only
        return premise.pointer_version, premise.policy

    def due(self, now: float) -> list[LedgerEntry]:
        found: dict[str, LedgerEntry] = {}
        while self.leases and self.leases[0][0] <= now:
            _, rid = heapq.heappop(self.leases)
            e = self.entries.get(rid)
            if (
                e is not None
                and e.state == "reserved"
                and e.lease_expires_at is not None
                and e.lease_expires_at <= now
            ):
                found[rid] = e
        return sorted(found.values(), key=lambda e: e.rollout_id)

    def of_version(self, version: int, states: Sequence[str]) -> list[LedgerEntry]:
        return sorted(
            (
                e
                for e in self.entries.values()
                if e.behavior_version == version and e.state in states
            ),
            key=lambda e: e.rollout_id,
        )

    def count(self, states: Sequence[str], min_version: int | None = None) -> int:
        low = -1 if min_version is None else min_version
        counts = [self.versions[s] for s in set(states) if s in self.versions]
        return sum(n for c in counts for v, n in c.items() if v >= low)

    def chain_states(self, chains: Sequence[str]) -> dict[str, tuple[str, ...]]:
        known = {c: self.chains[c] for c in chains if self.chains.get(c)}
        return {c: tuple(self.entries[r].state for r in ids) for c, ids in known.items()}

    def older_than(self, version: int, states: Sequence[str]) -> list[LedgerEntry]:
        return sorted(
            (
                e
                for e in self.entries.values()
                if e.behavior_version < version and e.state in states
            ),
            key=lambda e: e.rollout_id,
        )

    def rewarded_between(self, low: int | None, high: int | None, limit: int) -> list[LedgerEntry]:
        lo, hi = -1 if low is None else low, math.inf if high is None else high
        found = (
            e
            for e in self.entries.values()
            if e.state == "rewarded" and lo <= e.behavior_version <= hi
        )
        return oldest_first(found)[:limit]

    def read_premise(self, versions: Collection[int] | None = None) -> ActivationPremise:
        return NO_REGISTRY if self.activation is None else self.activation.premise(versions)

    def server_now(self) -> float | None:
        return None

    def mark_bad(self, version: int, reason: str) -> None:
        if version not in self.bad:  # a second mark keeps the first: nothing to record
            self.bad.add(version)
            row = {"version": version, "reason": reason}
            self.log.record([row_event("ledger_bad_versions", version, row, "marked bad")])

    def clear_bad(self, version: int) -> None:
        if version in self.bad:
            self.bad.discard(version)
            self.log.record([row_event("ledger_bad_versions", version, None, "mark lifted")])

    def insert(self, entries: Sequence[LedgerEntry]) -> None:
        seen: set[str] = set()
        for e in entries:
            if e.rollout_id in self.entries or e.rollout_id in seen:
                raise DuplicateRollout(f"rollout {brief(e.rollout_id)} is already in the ledger")
            seen.add(e.rollout_id)
        for e in entries:
            self.entries[e.rollout_id] = e
        self._index_many((None, e) for e in entries)

    def write(self, pairs: Sequence[tuple[LedgerEntry, LedgerEntry]]) -> set[str]:
        entries = self.entries
        get = entries.get
        won: set[str] = set()
        written: list[tuple[LedgerEntry | None, LedgerEntry]] = []
        for before, after in pairs:
            rid = after.rollout_id
            now = get(rid)
            if now is not None and now.revision == before.revision:
                entries[rid] = after
                written.append((now, after))
                won.add(rid)
        self._index_many(written)
        return won

    def read_updates(self, update_ids: Sequence[str]) -> dict[str, UpdateRecord]:
        got = self.updates.get
        return {u: r for u in update_ids if (r := got(u)) is not None}

    def append(
        self,
        changes: Sequence[Change],
        at: float,
        counts: Mapping[str, int],
        updates: Sequence[UpdateChange] = (),
    ) -> None:
        for _, _, after in updates:
            self.updates[after.update_id] = after
        if changes or updates:
            self.log.record_entries(at, changes, updates)
        self.counters.update({k: v for k, v in counts.items() if v})

    # ---- reads ------------------------------------------------------------------------------

    def find(self, rollout_id: str) -> LedgerEntry | None:
        with self.lock:
            return self.entries.get(rollout_id)

    def find_with_update(
        self, rollout_id: str, update_id: str
    ) -> tuple[LedgerEntry | None, UpdateRecord | None]:
        with self.lock:
            return self.entries.get(rollout_id), self.updates.get(update_id)

    def find_update(self, update_id: str) -> UpdateRecord | None:
        with self.lock:
            return self.updates.get(update_id)

    def all_updates(self) -> dict[str, UpdateRecord]:
        with self.lock:
            return dict(sorted(self.updates.items()))

    def reserved_by(self, update_id: str) -> list[str]:
        with self.lock:
            return sorted(self.owners.get(update_id, ()))

    def in_state(self, state: str, limit: int | None) -> list[LedgerEntry]:
        with self.lock:
            found = [self.entries[k] for k in sorted(self.entries)]
        return [e for e in found if e.state == state][:limit]

    def snapshot(self) -> dict[str, LedgerEntry]:
        with self.lock:
            return dict(self.entries)

    def bad_versions(self) -> frozenset[int]:
        with self.lock:
            return frozenset(self.bad)

    def history(self, rollout_id: str | None) -> list[EntryChanged]:
        return [
            e
            for e in self.log.events()
            if isinstance(e, EntryChanged) and (rollout_id is None or e.rollout_id == rollout_id)
        ]

    def tallies(self) -> Tallies:
        with self.lock:
            by_state = Counter(e.state for e in self.entries.values())
            rows = [row_of(e) for e in self.entries.values()]
            return by_state, Counter(self.counters), set(self.bad), rows

    def close(self) -> None:
        """Nothing to release."""


class MemoryLedger(StoreLedger):
    """Thread-safe in-memory ledger: one lock makes read-check-write indivisible.

    Good for tests, simulations and single-process trainers; state is lost with the process.
    """

    store: MemoryStore

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
        self.activation = activation
        self.log = event_log if event_log is not None else EventLog()
        store = MemoryStore(activation, self.log)
        super().__init__(store, clock=clock, lease_seconds=lease_seconds, recovery=recovery)

    @classmethod
    def restore(
        cls,
        entries: Iterable[LedgerEntry],
        bad_versions: Iterable[int] = (),
        updates: Iterable[UpdateRecord] = (),
        **kwargs: Any,
    ) -> MemoryLedger:
        """A ledger holding exactly these entries (and update records), without replaying
        their history.

        The explorer rebuilds a real ledger from each state it expands this way, so it
        checks the same code that runs in production rather than a retyped copy.
        """
        led = cls(**kwargs)
        led.store.entries = {e.rollout_id: e for e in entries}
        led.store.bad = set(bad_versions)
        led.store.updates.clear()  # in place: an attached registry shares the dict
        led.store.updates.update((u.update_id, u) for u in updates)
        led.store.reindex()
        return led

    # white-box hooks for tests that build deliberately broken ledgers or corrupt the store
    def _record(self, changes: list[Change]) -> None:
        """Write `changes` as planned, unconditionally (no compare-and-set), with events."""
        enforce(after for _, _, after, _ in changes)
        with self.store.lock:
            for _, _, after, _ in changes:
                before = self.store.entries.get(after.rollout_id)
                self.store.entries[after.rollout_id] = after
                self.store._index(before, after)
            self.store.append(changes, self.clock(), {"writes": len(changes)})

    @property
    def _entries(self) -> dict[str, LedgerEntry]:
        return self.store.entries

    @_entries.setter
    def _entries(self, value: dict[str, LedgerEntry]) -> None:
        self.store.entries = value

    @property
    def _leases(self) -> list[tuple[float, str]]:
        return self.store.leases
