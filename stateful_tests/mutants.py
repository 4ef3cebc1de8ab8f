"""The mutation catalogue: realistic protocol bugs, injected by patching model/ at run time.

Each mutant is a bug shape that a peer RL framework shipped (FIELD-NOTES "Bugs that peers
shipped", numbered there) or a classic protocol slip. A mutant is a context manager that
replaces one function or method while it is active; nothing in model/ knows it exists, and
model/ never imports this module. The fuzzer and the explorer must each kill every mutant
their bounds reach: `rollout-lifecycle mutants` runs them all and tabulates who killed what.

Patches reach every module that bound the original object (`from x import f` copies the
binding), so a mutant of `model.ledger.plan_reserve` also reaches the SQLite backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import hashlib
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import numpy as np

from rollout_lifecycle.model import api as api_mod
from rollout_lifecycle.model import artifacts as artifacts_mod
from rollout_lifecycle.model import coordinator as coord_mod
from rollout_lifecycle.model import gate as gate_mod
from rollout_lifecycle.model import ledger as ledger_mod
from rollout_lifecycle.model import registry as registry_mod
from rollout_lifecycle.model import rules as rules_mod
from rollout_lifecycle.model.errors import ActivationError
from rollout_lifecycle.model.ledger import (
    IDEMPOTENT,
    MISSING,
    NOT_REWARDED,
    RESERVED,
    ReserveOutcome,
)
from rollout_lifecycle.model.records import AdmissionPolicy, Disposition, LedgerEntry, Reward

PROJECT_PREFIXES = ("rollout_lifecycle.",)


@contextlib.contextmanager
def patch_everywhere(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    """Replace `owner.name`, and every project-module global bound to the same object."""
    original = getattr(owner, name)
    # a class keeps its staticmethod / classmethod wrapper: restore that, not the function;
    # an attribute it inherits is deleted again, not left behind as a copy that would shadow
    # a later patch of the base class (StoreLedger's methods on its three backends)
    inherited = isinstance(owner, type) and name not in vars(owner)
    stored = vars(owner).get(name, original) if isinstance(owner, type) else original
    touched: list[tuple[Any, str, Any]] = [(owner, name, stored)]
    setattr(owner, name, replacement)
    for mod_name, mod in list(sys.modules.items()):
        if (
            mod is None
            or mod is owner
            or mod_name == __name__  # our own references to the originals stay intact
            or not mod_name.startswith(PROJECT_PREFIXES)
        ):
            continue
        for attr, value in list(vars(mod).items()):
            if value is original:
                touched.append((mod, attr, value))
                setattr(mod, attr, replacement)
    try:
        yield
    finally:
        for obj, attr, value in reversed(touched):
            setattr(obj, attr, value)
        if inherited:
            delattr(owner, name)


# what kind of bug a mutant is (issue 18's classes of what a campaign can miss; the first
# catalogue's protocol bugs are 'protocol'); `mutants` reports its table per class
CLASSES: dict[str, str] = {
    "protocol": "a protocol bug in the enforcing code",
    "unloaded": "code the core campaign never loaded (PostgreSQL statements, the verl adapter)",
    "checker": "a checker that stops checking (spec, race history judge, ledger check)",
    "shared_rule": "a rule of the write path that a spec sharing it would be blind to",
    "input": "a bug only inputs nobody generated expose (NaN, empty masks, one-figure lies, "
    "conflicting acks, a rollback between admission and reservation)",
    "budget": "a bug found only at a boundary a small budget rarely reaches",
    # issue 37's classes of what the campaign could still not see
    "integration": "an integration the campaign never ran (verl's v1 replay buffer on a real "
    "TransferQueue: steps, a resume that redoes a step, eviction and refill)",
    "time": "an order of events in time no run made (a lease renewed, then outlived)",
    "skew": "a client clock off by minutes against the server's, with the server clock on",
    "recorded": "a recorded choice no run read back (a rollback's kept or retired cause)",
    "window": "a race window too narrow for a timed race to hit (the premise lock between "
    "a write's guard and its compare-and-set)",
    # issue 31: a fence only faults open (lost leases, killed activators, careless lineages)
    "fence": "a fence only faults reach (a lost lease's update in a version's lineage, an "
    "attempt whose activator was SIGKILLed): the fault race's stage",
}


@attrs.frozen
class Mutant:
    """One injected bug: a name, what it does, which peer bug it mirrors, and its patch."""

    name: str
    description: str
    peer_bug: int | None
    patch: Callable[[], contextlib.AbstractContextManager[None]]
    # which checkers can reach it: 'fuzz', 'explore', 'race' (real processes, each with its
    # own connection), 'checkers' (the known-bad histories and the differential stage),
    # 'adapter' (the verl adapter fuzz), 'interleavings' (scripted gaps between two
    # connections, stateful_tests/interleavings.py), with which machine / model
    reach: tuple[str, ...] = ("fuzz", "explore")
    explorer_model: str = "ledger"
    fuzz_machine: str = "ledger"
    klass: str = "protocol"
    # the backend whose code it breaks: its campaign runs there ('postgresql' needs a server,
    # 'memory' is the in-process store the default campaign never runs)
    backend: str = "sqlite"
    # a module the patched code needs (an optional extra): without it the mutant is not
    # reached, never counted as killed
    needs: str | None = None

    def __call__(self) -> contextlib.AbstractContextManager[None]:
        return self.patch()


# ---- ledger mutants --------------------------------------------------------------------------


def _buggy_reserve(
    refuse: Callable[[LedgerEntry, int], str | None],
) -> Callable[..., tuple[ReserveOutcome, LedgerEntry | None]]:
    """A plan_reserve whose availability check is `refuse`, and whose write bypasses the
    declared machine (the way hand-written ledgers set `state = "reserved"`)."""

    def plan(
        entry: LedgerEntry | None,
        rollout_id: str,
        expected_revision: int,
        update_id: str,
        admission: Any,
        *,
        premise: Any,
        lease_expires_at: float | None,
        poisoned: bool = False,  # the update's record: not what this bug is about
    ) -> tuple[ReserveOutcome, LedgerEntry | None]:
        if entry is None:
            return ReserveOutcome(rollout_id, False, MISSING, None), None
        if entry.state == "reserved" and entry.reserved_by == update_id:
            return ReserveOutcome(rollout_id, True, IDEMPOTENT, entry), None
        why = refuse(entry, expected_revision)
        if why is not None:
            return ReserveOutcome(rollout_id, False, why, entry), None
        new = attrs.evolve(
            entry,
            state="reserved",
            revision=entry.revision + 1,
            reserved_by=update_id,
            lease_expires_at=lease_expires_at,
            admission=admission,
        )
        return ReserveOutcome(rollout_id, True, RESERVED, new), new

    return plan


def _reserve_bug(
    refuse: Callable[[LedgerEntry, int], str | None],
) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """One availability bug in both reservation planners: the single `plan_reserve`, and the
    batch planner replaced by its reference form (`plan_each`) over the same buggy plan."""
    plan = _buggy_reserve(refuse)
    return _both(
        _simple(ledger_mod, "plan_reserve", plan),
        _simple(ledger_mod, "plan_reserves", functools.partial(ledger_mod.plan_each, plan)),
    )


def _available_on_snapshot(entry: LedgerEntry, expected_revision: int) -> str | None:
    """Availability judged on the caller's snapshot, then an unconditional write (bug 1)."""
    return None if entry.state in ("rewarded", "reserved") else NOT_REWARDED


def _not_reserved_is_available(entry: LedgerEntry, expected_revision: int) -> str | None:
    """'Not reserved' taken to mean 'available': consumed and failed rollouts go back in."""
    if entry.revision != expected_revision:
        return ledger_mod.CONFLICT
    return NOT_REWARDED if entry.state == "reserved" else None


def _no_idempotency(
    state: str, revision: int, reserved_by: str | None, expected_revision: int, update_id: str
) -> str | None:
    """The owner's retry is judged like anyone's: its stale revision loses (no idempotency)."""
    if revision != expected_revision:
        return ledger_mod.CONFLICT
    if state != "rewarded":
        return NOT_REWARDED
    return None


_real_plan_transition = ledger_mod.plan_transition


def _timeout_as_zero(
    entry: LedgerEntry, event: str, guards: Any = None, **changes: Any
) -> LedgerEntry:
    """A reward timeout stored as reward 0.0 with a side flag, still trainable (bug 2)."""
    if event == "reward_timeout":
        return _real_plan_transition(
            entry,
            "reward_ready",
            guards,
            reward=Reward("timeout", "0", 0.0),
            disposition=Disposition("reward", "timeout"),
        )
    return _real_plan_transition(entry, event, guards, **changes)


@contextlib.contextmanager
def _leases_never_expire() -> Iterator[None]:
    """Failed workers never release their slot: expiry finds nothing (bug 10)."""

    def none(self: Any) -> list[LedgerEntry]:
        return []

    # the one ledger: every backend (memory, SQLite, PostgreSQL) inherits expire_leases
    with patch_everywhere(ledger_mod.StoreLedger, "expire_leases", none):
        yield


# ---- gate mutants ----------------------------------------------------------------------------


def _off_by_one_lag(lag: int, max_lag: int) -> str:
    """`lag <= max_lag + 1` tolerated: L_max = 0 still admits two policies (bug 6)."""
    if lag < 0:
        return "future"
    if lag == 0:
        return "fresh"
    if lag <= max_lag + 1:
        return "tolerated"
    return "stale"


_real_assess_arrays = gate_mod.assess_arrays


def _drift_over_masked(
    old_log_probs: Any,
    current_log_probs: Any,
    action_mask: Any,
    behavior_versions: Any,
    current_version: int,
    max_lag: int,
    max_drift: float,
) -> Any:
    """Drift averaged over every position, prompt and padding included (masked-mean bug)."""
    res = _real_assess_arrays(
        old_log_probs,
        current_log_probs,
        action_mask,
        behavior_versions,
        current_version,
        max_lag,
        max_drift,
    )
    mask = np.asarray(action_mask.cpu() if hasattr(action_mask, "cpu") else action_mask) != 0
    width = mask.shape[1] if mask.ndim == 2 else 1
    counts = mask.sum(axis=1)
    diluted = np.where(counts > 0, res.drift * counts / max(width, 1), np.nan)
    reasons = tuple(
        "ok" if r == "policy_drift" and d <= max_drift else r
        for r, d in zip(res.reasons, diluted, strict=True)
    )
    return attrs.evolve(
        res,
        drift=diluted.astype(np.float64),
        reasons=reasons,
        accepted=np.array([r == "ok" for r in reasons], dtype=np.bool_),
    )


_real_assess_batch = gate_mod.AdmissionGate.assess_batch


def _drift_over_masked_batch(
    self: gate_mod.AdmissionGate,
    rollouts: Any,
    current_log_probs: Any,
    current_version: int,
    entries: Any = None,
    **kwargs: Any,
) -> Any:
    """The same masked-mean bug in the records path (which reduces the records' own arrays)."""
    decisions = _real_assess_batch(
        self, rollouts, current_log_probs, current_version, entries, **kwargs
    )
    width = max(int(current_log_probs.shape[1]), 1)
    out = []
    for ro, d in zip(rollouts, decisions, strict=True):
        if d.drift is not None and ro.evidence is not None:
            diluted = d.drift * int(np.count_nonzero(ro.evidence.action_mask)) / width
            if d.reason == "policy_drift" and diluted <= self.policy.max_drift:
                d = attrs.evolve(d, reason="ok", route=gate_mod.ROUTE_ADMIT, accepted=True)
            d = attrs.evolve(d, drift=diluted)
        out.append(d)
    return out


@contextlib.contextmanager
def _drift_over_masked_everywhere() -> Iterator[None]:
    with (
        patch_everywhere(gate_mod, "assess_arrays", _drift_over_masked),
        patch_everywhere(gate_mod.AdmissionGate, "assess_batch", _drift_over_masked_batch),
    ):
        yield


# ---- activation mutants ----------------------------------------------------------------------

_real_activate = api_mod.activate_policy_version


def _decide(
    active_pointer: Any,
    artifact: Any,
    worker_states: Any,
    required_workers: Any,
    *,
    ignore_missing: str,
    ignore_mismatch: bool = False,
    ignore_version_order: bool = False,
) -> dict[str, Any]:
    required = list(required_workers)
    if ignore_missing == "all":
        required = []
    elif ignore_missing == "some":
        present = [w for w in required if w in worker_states]
        required = present if present else required
    if ignore_mismatch:
        required = [w for w in required if w in worker_states]
        worker_states = {
            w: {"version": artifact["version"], "artifact_hash": artifact["artifact_hash"]}
            for w in required
        }
    if ignore_version_order:
        active_pointer = None
    if not required:
        # "nobody needs to ack": the real decision refuses an empty set, so stand in one
        # worker that acked exactly this artifact
        required = ["<nobody>"]
        worker_states = {
            "<nobody>": {"version": artifact["version"], "artifact_hash": artifact["artifact_hash"]}
        }
    return _real_activate(active_pointer, artifact, worker_states, required)


def _version_before_load(*args: Any) -> dict[str, Any]:
    """The pointer flips as soon as the artifact is committed, before any worker loads (bug 3)."""
    return _decide(*args, ignore_missing="all", ignore_mismatch=True)


def _success_without_all_acks(*args: Any) -> dict[str, Any]:
    """'Weight update succeeded' once some worker answered; missing acks ignored (bug 4)."""
    return _decide(*args, ignore_missing="some")


def _stale_ack_counted(*args: Any) -> dict[str, Any]:
    """Any report counts as an ack, whatever version or hash it names (bug 12)."""
    return _decide(*args, ignore_missing="none", ignore_mismatch=True)


def _non_monotonic_decision(*args: Any) -> dict[str, Any]:
    return _decide(*args, ignore_missing="none", ignore_version_order=True)


@contextlib.contextmanager
def _non_monotonic() -> Iterator[None]:
    """Version order is checked nowhere: an older version may be distributed and then
    activate over a newer one (both the decision and the distribution guard forget it)."""
    with (
        patch_everywhere(registry_mod, "activate_policy_version", _non_monotonic_decision),
        patch_everywhere(registry_mod, "distribution_refusal", lambda *_a: None),
    ):
        yield


def _ignore_incarnation(report: Any, ack: Any) -> str:
    """A restarted worker's old acks still count: it serves before it synced (bug 11)."""
    latest = report.ack
    if latest is None:
        return coord_mod.COUNTED
    key, latest_key = (ack.incarnation, ack.seq), (latest.incarnation, latest.seq)
    if key == latest_key:
        return coord_mod.DUPLICATE if ack == latest else coord_mod.CONFLICTING
    return coord_mod.COUNTED if ack.seq > latest.seq or key > latest_key else coord_mod.OUT_OF_ORDER


@contextlib.contextmanager
def _no_quarantine_on_failure() -> Iterator[None]:
    """Generation resumes after a failed update; its rollouts are never quarantined (bug 5)."""

    def skip(self: Any, version: int, reason: str) -> None:
        return None

    with patch_everywhere(coord_mod.ActivationCoordinator, "_quarantine", skip):
        yield


def _stamp_at_completion(version_at_dispatch: int, version_at_completion: int) -> int:
    """The version is stamped when generation completes, not at dispatch (bug 7)."""
    return version_at_completion


@contextlib.contextmanager
def _stamp_patch() -> Iterator[None]:
    e2e_machine = importlib.import_module("rollout_lifecycle.stateful_tests.e2e_machine")
    with patch_everywhere(e2e_machine, "stamp_policy", _stamp_at_completion):
        yield


# ---- safety at the seams (issue 9): each reverts one write-path fix --------------------------


def _stamp_only(
    self: ledger_mod.ActivationPremise,
    admission: Any,
    behavior_version: int,
    artifact_hash: str | None = None,
    *,
    stamp_passed: bool = False,  # judged here all the same
) -> tuple[str, str] | None:
    """The reservation judges the stamp it is given, never the pointer of its own step."""
    problems = (
        ["no stamp"] if admission is None else rules_mod.stamp_problems(admission, behavior_version)
    )
    return (ledger_mod.NOT_ADMITTED, "; ".join(problems)) if problems else None


def _trust_accepted(
    self: ledger_mod.ActivationPremise,
    admission: Any,
    behavior_version: int,
    artifact_hash: str | None = None,
    *,
    stamp_passed: bool = False,  # judged here all the same
) -> tuple[str, str] | None:
    """The reservation trusts a stamp's `accepted` flag, not its own figures."""
    if admission is None or not admission.accepted:
        return ledger_mod.NOT_ADMITTED, "no accepted stamp"
    known = None if self.was_active is None else behavior_version in self.was_active
    if known is False:
        return ledger_mod.VERSION_NOT_ACTIVE, ""
    if self.pointer_version is not None and not (
        0 <= self.pointer_version - behavior_version <= admission.max_lag
    ):
        return ledger_mod.POINTER_MOVED, ""
    return None


def _stamp_bounds_trusted(
    self: ledger_mod.ActivationPremise,
    admission: Any,
    behavior_version: int,
    artifact_hash: str | None = None,
    *,
    stamp_passed: bool = False,  # judged here all the same
) -> tuple[str, str] | None:
    """The reservation judges lag and drift with the bounds the stamp says it was judged
    with, not the deployment's recorded policy (a learner with max_lag 1000 trains on
    lag-10 data: prime-rl #2812, AReaL #1481)."""
    loose = None if admission is None else AdmissionPolicy(admission.max_lag, admission.max_drift)
    return rules_mod.reservation_refusal(
        admission,
        behavior_version,
        self.pointer_version,
        self.was_active,
        loose if self.policy is not None else None,
        self.retired,
        artifact_hash,
        self.hashes,
    )


def _rollback_forgets_ledger(
    self: Any, *, keep_rollouts: bool = False, reason: str = "operator rollback"
) -> Any:
    """The pointer goes back, but the rolled-back version's rollouts are never retired in
    the ledger: they stay trainable, and once a newer version is active they are admitted
    at lag 1 (issue 17 #5)."""
    self._quarantine = lambda version, why: None
    try:
        return _real_rollback(self, keep_rollouts=keep_rollouts, reason=reason)
    finally:
        del self._quarantine


_real_rollback = coord_mod.ActivationCoordinator.rollback


@contextlib.contextmanager
def _ledger_trusts_writes() -> Iterator[None]:
    """The ledger stores what it is told: no per-record rules on write, stamps trusted."""
    with (
        patch_everywhere(ledger_mod, "enforce", lambda _afters: None),
        patch_everywhere(ledger_mod.ActivationPremise, "refusal", _trust_accepted),
    ):
        yield


_ACTING: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "acting_worker_set", default=None
)


@contextlib.contextmanager
def _own_worker_set() -> Iterator[None]:
    """Each coordinator activates against the worker set IT was given, not a durable one."""
    cls = coord_mod.ActivationCoordinator
    orig_init, orig_step = cls.__init__, cls._step
    orig_required = registry_mod.required_set

    def init(self: Any, registry: Any, required_workers: Any = None, **kw: Any) -> None:
        self._own = None if required_workers is None else tuple(required_workers)
        try:
            orig_init(self, registry, required_workers, **kw)
        except ActivationError:
            orig_init(self, registry, None, **kw)  # attach anyway, keeping its own set

    def step(self: Any, plan: Any) -> Any:
        token = _ACTING.set(getattr(self, "_own", None))
        try:
            return orig_step(self, plan)
        finally:
            _ACTING.reset(token)

    def required(view: Any) -> tuple[str, ...]:
        return _ACTING.get() or orig_required(view)

    with (
        patch_everywhere(cls, "__init__", init),
        patch_everywhere(cls, "_step", step),
        patch_everywhere(registry_mod, "required_set", required),
    ):
        yield


# ---- the campaign's former blind spots (issue 14) ---------------------------------------------

_real_load = artifacts_mod.WorkerLoader.load


def _ack_registered_hash(
    self: Any,
    version: int,
    expected_hash: str,
    *,
    token: str | None = None,
    attempt: int | None = None,
) -> tuple[Any, Any]:
    """The loader parses whatever it read and acks the hash it was TOLD to expect."""
    manifest = self.store.read_manifest(version)
    entries = []
    for f in manifest.files:
        data = self.store.read_bytes(version, f.name)
        entries.append(artifacts_mod.FileEntry(f.name, len(data), hashlib.sha256(data).hexdigest()))
    real = artifacts_mod.content_hash(entries)
    loaded, ack = _real_load(self, version, real, token=token, attempt=attempt)
    return loaded, attrs.evolve(ack, artifact_hash=expected_hash)


def _unconditional_cas(sql: str) -> str:
    """SQLite's CAS without its revision condition (the placeholder stays, so the statement
    takes the same parameters): atomic on one connection (the read and the write of one
    thread never interleave with another's) but not across connections."""
    return sql.replace("AND revision = ?", "AND ? IS NOT NULL")


def _simple(
    owner: Any, name: str, replacement: Any
) -> Callable[[], contextlib.AbstractContextManager[None]]:
    return lambda: patch_everywhere(owner, name, replacement)


# ---- acks bound to an attempt (issue 17) ---------------------------------------------------


def _acks_by_arrival(view: Any, rec: Any) -> dict[str, Any]:
    """Every stored ack of the version counts, whichever attempt it answered."""
    return {w: r.ack for w, r in view.workers().items() if r.ack is not None}


@contextlib.contextmanager
def _late_acks_win() -> Iterator[None]:
    """An ack counts for the attempt in flight whatever token it echoes (or none): the
    attempt is "numbered by arrival", so a delayed ack of a failed attempt activates a
    version its worker no longer holds (issue 17 item 3; acks counted from a previous
    version, as peers shipped)."""
    with (
        patch_everywhere(coord_mod, "judge_token", lambda *_a: None),
        patch_everywhere(registry_mod, "counted_acks", _acks_by_arrival),
    ):
        yield


def _forgetful_membership(
    view: Any, new: tuple[str, ...], reason: str, at: float, new_token: Any
) -> Any:
    """A membership change that only records the new set: leavers keep their acks and
    tokens, joiners get no token of their own."""
    return registry_mod.RegistryStep(at, membership=new, membership_reason=reason)


@contextlib.contextmanager
def _membership_forgets() -> Iterator[None]:
    """Leaving the worker set voids nothing, and the write path does not insist: an ack a
    worker sent before it left counts after it re-joins (issue 17 item 2)."""
    with (
        patch_everywhere(coord_mod, "membership_step", _forgetful_membership),
        patch_everywhere(registry_mod, "_check_tokens", lambda *_a: None),
    ):
        yield


def _wrap(
    module: str, name: str, make: Callable[[Any], Any]
) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A patch replacing `module.name` by `make(original)`; the module (and its optional
    dependencies) is imported only when the mutant is entered."""

    @contextlib.contextmanager
    def cm() -> Iterator[None]:
        owner: Any = importlib.import_module(module)
        for part in name.split(".")[:-1]:
            owner = getattr(owner, part)
        attr = name.split(".")[-1]
        with patch_everywhere(owner, attr, make(getattr(owner, attr))):
            yield

    return cm


_PG = "rollout_lifecycle.model.postgres_ledger"


def _cas_many_unconditional(sql: str) -> str:
    """The batch compare-and-set without its revision condition (and without the
    server's check of the operation's edges, which alone would keep a second reservation
    of a reserved row out)."""
    out = sql.replace("WHERE r.revision = v.expected", "WHERE TRUE")
    out = out.replace("AND (r.state || '>' || v.state) = ANY(%(edges)b::text[])", "")
    return out.replace("AND r.revision = v.expected", "")


@contextlib.contextmanager
def _batch_cas_unconditional() -> Iterator[None]:
    """The batch compare-and-set without its revision condition, and the batch's read of
    its rows without their locks (locked rows alone would keep the CAS honest)."""
    from rollout_lifecycle.model import postgres_ledger as pg

    def unlocked(self: Any, rollout_ids: Any) -> Any:
        return self.read_rows(rollout_ids)

    cas = _wrap("rollout_lifecycle.model.postgres_functions", "CAS_MANY", _cas_many_unconditional)
    with cas(), patch_everywhere(pg._Unit, "lock_rows", unlocked):
        yield


def _skip_premise(atomic: Any) -> Any:
    def no_lock(self: Any, body: Any, step: Any) -> Any:
        return atomic(self, body, attrs.evolve(step, premise=False))

    return no_lock


def _write_one_skips_premise(write_one: Any) -> Any:
    """A single reservation's one-statement write without the premise lock (and so without
    the check, under it, that the premise its plan was judged on still holds)."""

    def no_lock(
        self: Any, pair: Any, changes: Any, at: Any, counts: Any, step: Any, seen: Any
    ) -> Any:
        return write_one(self, pair, changes, at, counts, attrs.evolve(step, premise=False), seen)

    return no_lock


def _no_one_call(reserve_one: Any) -> Any:
    """The one-call reservation never tried: every single reservation takes the full path
    (a read, then the one-statement write)."""

    def never(self: Any, *args: Any) -> Any:
        return None

    return never


def _both(
    *patches: Callable[[], contextlib.AbstractContextManager[None]],
) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """Several patches entered together: one bug that lives in more than one place."""

    @contextlib.contextmanager
    def cm() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch())
            yield

    return cm


def _negative_lag(refusal: Any) -> Any:
    def check(stamp: Any, bv: int, pv: Any, was_active: Any, *rest: Any, **kw: Any) -> Any:
        r = refusal(stamp, bv, pv, was_active, *rest, **kw)
        if r is not None and r[0] == rules_mod.POINTER_MOVED and pv is not None and pv < bv:
            return None  # the bound read as lag <= max_lag only
        return r

    return check


def _drift_unchecked(fn: Any) -> Any:
    def problems(*args: Any) -> list[str]:
        return [p for p in fn(*args) if "drift" not in p]

    return problems


@contextlib.contextmanager
def _nan_drift_passes() -> Iterator[None]:
    """Neither stamp check looks at the drift figure: a NaN or missing drift passes."""
    with (
        _wrap(rules_mod.__name__, "stamp_contradictions", _drift_unchecked)(),
        _wrap(rules_mod.__name__, "stamp_problems", _drift_unchecked)(),
    ):
        yield


def _looser_drift(refusal: Any) -> Any:
    def check(
        stamp: Any, bv: int, pv: Any, was_active: Any, policy: Any = None, *r: Any, **kw: Any
    ) -> Any:
        out = refusal(stamp, bv, pv, was_active, policy, *r, **kw)
        if (
            out is not None
            and out[0] == rules_mod.LOOSER_THAN_POLICY
            and stamp.max_lag <= policy.max_lag
        ):  # only max_lag compared with the policy: the stamp's own max_drift believed
            looser = attrs.evolve(policy, max_drift=stamp.max_drift)
            return refusal(stamp, bv, pv, was_active, looser, *r, **kw)
        return out

    return check


def _sanitized(recheck: Any) -> Any:
    def nan_to_zero(sums: Any, exact_rows: Any, ids: Any = None) -> None:
        sums[~np.isfinite(sums)] = 0.0  # nan_to_num on the row sums

    return nan_to_zero


def _empty_rows_pass(decide: Any) -> Any:
    def guarded(sums: Any, counts: Any, *rest: Any) -> Any:
        return decide(sums, np.maximum(counts, 1), *rest)  # divide-by-zero "fixed"

    return guarded


def _conflict_counted(judge: Any) -> Any:
    def counted(report: Any, ack: Any) -> str:
        r = judge(report, ack)
        return coord_mod.COUNTED if r == coord_mod.CONFLICTING else str(r)

    return counted


@contextlib.contextmanager
def _strict_expiry() -> Iterator[None]:
    """A lease counts as expired only strictly after its deadline (`<` for `<=`)."""

    def make(expire: Any) -> Any:
        def late(self: Any) -> Any:
            real = self.clock
            self.clock = lambda: real() - 1e-6
            try:
                return expire(self)
            finally:
                self.clock = real

        return late

    # the one ledger's method, which memory and SQLite inherit (PostgreSQL reads the
    # server's clock, so this shift of the ledger's own clock does not reach it)
    with _wrap(ledger_mod.__name__, "StoreLedger.expire_leases", make)():
        yield


class _RowsAsPeeked:
    """A unit of work whose `read_rows` answers with the rows read before the step."""

    def __init__(self, uow: Any, peeked: dict[str, Any]) -> None:
        self._uow, self._peeked = uow, peeked

    def read_rows(self, rollout_ids: Any) -> dict[str, Any]:
        got: dict[str, Any] = self._uow.read_rows(rollout_ids)
        got.update({r: self._peeked[r] for r in rollout_ids if self._peeked.get(r) is not None})
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self._uow, name)


def _stale_row_refusal(reserve: Any) -> Any:
    """StoreLedger.reserve whose step judges the row as read before the step (issue 33):
    the premise's refusal is built on that earlier read, as it was."""

    @functools.wraps(reserve)
    def stale(self: Any, rollout_id: str, *args: Any, **kwargs: Any) -> Any:
        store = self.store
        peeked: dict[str, Any] = {}
        real_find, real_peek, real_atomic = (
            store.find_with_update,
            getattr(store, "peek", None),
            store.atomic,
        )

        def find(rid: str, *rest: Any) -> Any:  # the row read before the step (and its update)
            got = real_find(rid, *rest)
            peeked[rid] = got[0]
            return got

        def peek(rid: str, *rest: Any) -> Any:
            assert real_peek is not None
            got = real_peek(rid, *rest)
            peeked[rid] = got[0]
            return got

        def atomic(body: Any, step: Any) -> Any:
            if step.what != "reserve" or not inspect.isfunction(body):
                return real_atomic(body, step)  # (a one-statement write is not a body)
            return real_atomic(lambda uow: body(_RowsAsPeeked(uow, peeked)), step)

        names = ("find_with_update", "atomic", "peek")
        own = {n: vars(store)[n] for n in names if n in vars(store)}  # a test's own hooks
        store.find_with_update, store.atomic = find, atomic
        if real_peek is not None:
            store.peek = peek
        try:
            return reserve(self, rollout_id, *args, **kwargs)
        finally:
            for name in names:
                vars(store).pop(name, None)
            vars(store).update(own)

    return stale


_REFUSALS = frozenset(
    {
        "missing_rollout",
        "revision_conflict",
        "not_rewarded",
        "not_admitted",
        "stamp_contradicts_itself",
        "no_admission_policy",
        "looser_than_policy",
        "version_not_active",
        "version_retired",
        "pointer_moved",
    }
)


def _any_refusal(answer: Any) -> Any:
    """The model's reservation answer, any refusal standing for any other."""

    def loose(ask: Any) -> Any:
        allowed = answer(ask)
        if any(held for _, held in allowed):
            return allowed
        return allowed | {(r, False) for r in _REFUSALS}

    return loose


_PACING = "rollout_lifecycle.model.pacing"


def _budget_ignored(plan: Any) -> Any:
    """plan_dispatch as if nothing were live: the budget never refuses."""
    return lambda entry, chain, premise, **kw: plan(
        entry, chain, attrs.evolve(premise, live_window=0), **kw
    )


def _attempts_unbounded(plan: Any) -> Any:
    """plan_dispatch with the policy's max_attempts dropped: a chain is requeued forever."""

    def planned(entry: Any, chain: str, premise: Any, **kw: Any) -> Any:
        pol = premise.policy
        if pol is not None:
            premise = attrs.evolve(premise, policy=attrs.evolve(pol, max_attempts=None))
        return plan(entry, chain, premise, **kw)

    return planned


# ---- issue 31's fences, as the fault race meets them ------------------------------------


def _lineage_admits_poisoned(refusal: Any) -> Any:
    """lineage_refusal judging only the updates that were never poisoned: a version naming
    a poisoned update (one that lost a lease: its rollouts went to another) registers."""

    def refused(view: Any, rec: Any) -> str | None:
        found = view.updates(rec.trained_by)
        kept = tuple(u for u in rec.trained_by if u not in found or found[u].status != "poisoned")
        return refusal(view, attrs.evolve(rec, trained_by=kept)) if kept else None

    return refused


def _ack_timeout_forever(timeout: Any) -> Any:
    """Every attempt's ack deadline lies a year ahead (a timeout read in the wrong unit):
    an attempt whose activator died awaits acks for good."""
    return lambda v: timeout(v) * 3.15e7


CATALOGUE: tuple[Mutant, ...] = (
    Mutant(
        "blind_reserve",
        "check-then-reserve without compare-and-set: a second learner "
        "overwrites a reservation it saw as free",
        1,
        _reserve_bug(_available_on_snapshot),
    ),
    Mutant(
        "retry_not_idempotent",
        "the owner's retry of its own reservation is refused as a conflict",
        None,
        _simple(ledger_mod, "reserve_precheck", _no_idempotency),
    ),
    Mutant(
        "consumed_reservable",
        "'not reserved' means 'available': consumed and failed rollouts are reserved again",
        13,
        _reserve_bug(_not_reserved_is_available),
    ),
    Mutant(
        "reward_timeout_as_zero",
        "a reward timeout becomes reward 0.0 with a side flag and stays trainable",
        2,
        _simple(ledger_mod, "plan_transition", _timeout_as_zero),
    ),
    Mutant(
        "lease_never_expires",
        "a crashed learner's reservations are never returned",
        10,
        _leases_never_expire,
    ),
    Mutant(
        "off_by_one_lag",
        "lag bound checked as lag <= L_max + 1",
        6,
        _simple(gate_mod, "classify_lag", _off_by_one_lag),
        reach=("fuzz", "explore"),
        explorer_model="activation",
        fuzz_machine="e2e",
    ),
    Mutant(
        "drift_over_masked",
        "behaviour drift averaged over every position, masked ones included",
        8,
        _drift_over_masked_everywhere,
        reach=("fuzz",),
        fuzz_machine="e2e",
    ),
    Mutant(
        "version_before_load",
        "the pointer flips when the artifact is committed, before workers load it",
        3,
        _simple(registry_mod, "activate_policy_version", _version_before_load),
        explorer_model="activation",
        fuzz_machine="activation",
    ),
    Mutant(
        "success_without_all_acks",
        "activation reported once some workers acked",
        4,
        _simple(registry_mod, "activate_policy_version", _success_without_all_acks),
        explorer_model="activation",
        fuzz_machine="activation",
    ),
    Mutant(
        "stale_ack_counted",
        "an ack of an older version or another hash counts",
        12,
        _simple(registry_mod, "activate_policy_version", _stale_ack_counted),
        explorer_model="activation",
        fuzz_machine="activation",
    ),
    Mutant(
        "restart_ack_counted",
        "a restarted worker's pre-restart ack still counts",
        11,
        _simple(coord_mod, "judge_ack", _ignore_incarnation),
        explorer_model="activation",
        fuzz_machine="activation",
    ),
    Mutant(
        "late_attempt_ack_counted",
        "an ack counts whatever attempt token it echoes: a delayed ack of a failed attempt "
        "activates a version its worker no longer holds (issue 17 #3)",
        12,
        _late_acks_win,
        explorer_model="activation",
        fuzz_machine="activation",
    ),
    Mutant(
        "membership_forgets_acks",
        "leaving the worker set voids nothing: a worker's ack from before it left counts "
        "after it re-joins (issue 17 #2)",
        None,
        _membership_forgets,
        reach=("fuzz",),  # the explorer's worker set is fixed
        fuzz_machine="activation",
    ),
    Mutant(
        "no_quarantine_on_failure",
        "rollouts of a version whose activation failed are not quarantined",
        5,
        _no_quarantine_on_failure,
        explorer_model="activation",
        fuzz_machine="activation",
    ),
    Mutant(
        "non_monotonic_activation",
        "an older version may be activated over a newer one",
        None,
        _non_monotonic,
        explorer_model="activation-2v",
        # the activation machine's coordinator never tries an older version; the seams
        # machine's second coordinator does
        fuzz_machine="seams",
    ),
    Mutant(
        "reservation_ignores_pointer",
        "a reservation judges its stamp but not the pointer of its own step: a version "
        "activated after admission lets stale rollouts in (the README pattern, issue 9 #1)",
        8,
        _simple(ledger_mod.ActivationPremise, "refusal", _stamp_only),
        explorer_model="seams",
        fuzz_machine="seams",
    ),
    Mutant(
        "stamp_bounds_trusted",
        "a reservation judges lag and drift with the bounds its stamp claims, not the "
        "deployment's recorded policy (issue 17 #1)",
        None,
        _simple(ledger_mod.ActivationPremise, "refusal", _stamp_bounds_trusted),
        explorer_model="seams",
        fuzz_machine="seams",
    ),
    Mutant(
        "rollback_forgets_ledger",
        "a rollback moves the pointer back but never retires the rolled-back version's "
        "rollouts in the ledger: they stay trainable (issue 17 #5)",
        None,
        _simple(coord_mod.ActivationCoordinator, "rollback", _rollback_forgets_ledger),
        explorer_model="activation",
        fuzz_machine="e2e",
    ),
    Mutant(
        "coordinator_own_worker_set",
        "each coordinator activates against its own worker set: a second one requiring "
        "only gen-0 moves the pointer on a partial set (issue 9 #2)",
        4,
        _own_worker_set,
        explorer_model="seams",
        fuzz_machine="seams",
    ),
    Mutant(
        "ledger_trusts_writes",
        "the ledger stores records its spec rejects: a rewarded rollout without a reward, a "
        "stamp saying accepted with stale figures (issue 9 #3)",
        2,
        _ledger_trusts_writes,
        explorer_model="seams",
        fuzz_machine="seams",
    ),
    Mutant(
        "older_distribution_accepted",
        "a version older than the active one is distributed and holds the one distribution "
        "slot (issue 9 #4)",
        None,
        _simple(registry_mod, "distribution_refusal", lambda *_a: None),
        explorer_model="seams",
        fuzz_machine="seams",
    ),
    Mutant(
        "loader_acks_registered_hash",
        "a worker's loader acks the registered artifact hash instead of the hash of the "
        "bytes it read: damaged weights activate (issue 14: acks were abstract)",
        4,
        _simple(artifacts_mod.WorkerLoader, "load", _ack_registered_hash),
        reach=("fuzz",),
        fuzz_machine="artifacts",
    ),
    Mutant(
        "cas_atomic_on_one_connection",
        "SQLite's compare-and-set drops its revision condition: correct on one connection, "
        "two learners on two connections both win a rollout (issue 14: one connection)",
        1,
        _wrap("rollout_lifecycle.model.sqlite_ledger", "_CAS", _unconditional_cas),
        reach=("race",),
    ),
    Mutant(
        "version_stamped_at_completion",
        "rollouts carry the version active when they finish, not the one that generated them",
        7,
        _stamp_patch,
        reach=("fuzz",),
        fuzz_machine="e2e",
    ),
)

CATALOGUE += (
    # ---- class 1: code the core campaign never loaded
    Mutant(
        "pg_batch_cas_unconditional",
        "PostgreSQL's batch compare-and-set drops its revision condition: two learners on two "
        "connections both win a rollout",
        1,
        # the statement of the server-side function, which the patched processes create
        # again (its text changed) before they call it
        _batch_cas_unconditional,
        reach=("race",),
        klass="unloaded",
        backend="postgresql",
    ),
    Mutant(
        "pg_reserve_skips_premise_lock",
        "a PostgreSQL reservation reads the pointer without the premise lock: a pointer switch "
        "committed between its read and its write goes unseen",
        None,
        # the batch's step and the single reservation's one-statement write both lose it
        # (the one-call reservation, whose lock is the server's, is left out: the single
        # reservation takes the path that lost it; pg_write_one_drops_premise_lock drops
        # the server's own)
        _both(
            _wrap(_PG, "PostgresStore.atomic", _skip_premise),
            _wrap(_PG, "PostgresStore.write_one", _write_one_skips_premise),
            _wrap(_PG, "PostgresStore.reserve_one", _no_one_call),
        ),
        reach=("race", "premise-window"),
        klass="unloaded",
        backend="postgresql",
    ),
    Mutant(
        "adapter_lag_from_newest",
        "the verl adapter judges a partial rollout by the NEWEST version it saw, not its oldest",
        None,
        _wrap(
            "rollout_lifecycle.gpu_check.verl_adapter",
            "judged_versions",
            lambda f: lambda o, n: o if n is None else n,
        ),
        reach=("adapter",),
        klass="unloaded",
    ),
    Mutant(
        "adapter_keeps_unversioned",
        "the verl adapter keeps samples with no recorded version in the mask",
        None,
        _wrap(
            "rollout_lifecycle.gpu_check.verl_adapter",
            "refuse_unversioned",
            lambda f: lambda a, m: a,
        ),
        reach=("adapter",),
        klass="unloaded",
    ),
    # ---- class 2: checkers that stop checking
    Mutant(
        "race_win_revision_unchecked",
        "the race's history judge stops checking that a win wrote over the revision its "
        "caller read",
        None,
        _wrap("rollout_lifecycle.stateful_tests.race", "won_over", lambda f: lambda *a: True),
        reach=("checkers",),
        klass="checker",
    ),
    Mutant(
        "race_retry_claim_trusted",
        "the race's history judge accepts any idempotent_retry claim without asking who held "
        "the row",
        None,
        _wrap(
            "rollout_lifecycle.stateful_tests.race", "retry_confirmed", lambda f: lambda *a: True
        ),
        reach=("checkers",),
        klass="checker",
    ),
    Mutant(
        "exactly_once_ignores_consumer",
        "the spec's exactly-once invariant ignores which update consumed a rollout",
        None,
        _wrap(
            "rollout_lifecycle.spec.invariants",
            "_consumed_by_its_reserver",
            lambda f: lambda *a: True,
        ),
        reach=("checkers",),
        klass="checker",
    ),
    Mutant(
        "audit_trusts_stored_hashes",
        "`ledger check` takes each event's stored hash as its own: an edited event passes",
        None,
        _wrap("rollout_lifecycle.spec.audit", "row_hash", lambda f: lambda ev: ev.hash),
        reach=("checkers",),
        klass="checker",
    ),
    Mutant(
        "linearizability_any_refusal",
        "the linearizability model takes any refusal of a reservation for the true one, as "
        "long as the reservation was refused at that instant",
        None,
        _wrap("rollout_lifecycle.spec.call_model", "reserve_answer", _any_refusal),
        reach=("checkers",),
        klass="checker",
    ),
    Mutant(
        "linearizability_no_common_instant",
        "the linearizability check skips its consistency pass: each rollout alone is "
        "explained, a batch seen half applied passes",
        None,
        _wrap(
            "rollout_lifecycle.spec.linearizability", "_consistent", lambda f: lambda *a: (0, [])
        ),
        reach=("checkers",),
        klass="checker",
    ),
    Mutant(
        "audit_head_by_seq_only",
        "`ledger check` compares the chain's head with the last event by seq only: a last "
        "event replaced in place with its hash recomputed (or any event, with the chain "
        "recomputed after it) passes",
        None,
        _wrap(
            "rollout_lifecycle.spec.audit",
            "head_matches",
            lambda f: lambda head, last: head.last_seq == last.seq,
        ),
        reach=("checkers",),
        klass="checker",
    ),
    # ---- class 3: rules that a spec sharing them would be blind to
    Mutant(
        "negative_lag_admitted",
        "the reservation premise bounds the lag from above only: after a rollback that kept a "
        "newer version's rollouts, they are reserved at a negative lag",
        None,
        _wrap(rules_mod.__name__, "reservation_refusal", _negative_lag),
        reach=("checkers", "explore"),
        explorer_model="seams",
        klass="shared_rule",
    ),
    Mutant(
        "nan_drift_passes",
        "the stamp checks never look at the drift figure: a NaN or missing drift passes",
        None,
        _nan_drift_passes,
        reach=("checkers",),
        klass="shared_rule",
    ),
    # ---- class 4: inputs nobody generated
    Mutant(
        "nan_at_action_sanitized",
        "the batch gate replaces a non-finite row sum by 0 (nan_to_num) instead of refusing a "
        "NaN log-prob at an action position: the row passes with drift 0",
        None,
        _wrap(gate_mod.__name__, "_recheck", _sanitized),
        reach=("fuzz",),
        fuzz_machine="e2e",
        klass="input",
    ),
    Mutant(
        "empty_rows_pass",
        "the batch gate guards its division with max(count, 1): a row with no action token "
        "gets drift 0 and passes",
        None,
        _wrap(gate_mod.__name__, "_decide", _empty_rows_pass),
        reach=("fuzz",),
        fuzz_machine="e2e",
        klass="input",
    ),
    Mutant(
        "conflicting_ack_counted",
        "an ack with the same (incarnation, seq) as the stored one but other content counts, "
        "replacing it",
        None,
        _wrap(coord_mod.__name__, "judge_ack", _conflict_counted),
        reach=("fuzz",),
        fuzz_machine="activation",
        klass="input",
    ),
    Mutant(
        "looser_drift_bound_believed",
        "the premise compares only max_lag with the recorded policy: a stamp wrong in exactly "
        "one figure, its max_drift, lets a drifted rollout in",
        None,
        _wrap(rules_mod.__name__, "reservation_refusal", _looser_drift),
        reach=("checkers", "fuzz"),
        fuzz_machine="seams",
        klass="input",
    ),
    # ---- pacing (issue 21): the dispatch-side budget and the attempt chains
    Mutant(
        "dispatch_ignores_budget",
        "dispatch counts no live rollout against the staleness budget: generators start "
        "rollouts that will be stale before a batch can take them",
        None,
        _wrap(_PACING, "plan_dispatch", _budget_ignored),
        reach=("fuzz", "explore", "race"),
        fuzz_machine="e2e",
        explorer_model="pacing",
    ),
    Mutant(
        "requeue_ignores_max_attempts",
        "a prompt whose attempt went stale or failed is requeued with no bound on its attempts",
        None,
        _wrap(_PACING, "plan_dispatch", _attempts_unbounded),
        reach=("fuzz", "explore", "race"),
        fuzz_machine="e2e",
        explorer_model="pacing",
    ),
    Mutant(
        "stale_row_refusal",
        "a single reservation's step refuses on the premise of its own moment but with the "
        "row read before the step: an answer no instant of the call makes true (issue 33)",
        None,
        _wrap(ledger_mod.__name__, "StoreLedger.reserve", _stale_row_refusal),
        reach=("interleavings", "race"),
    ),
    # ---- class 5: a boundary a small budget rarely reaches
    Mutant(
        "lease_expiry_strict",
        "a lease counts as expired only strictly after its deadline (`<` for `<=`)",
        10,
        _strict_expiry,
        reach=("fuzz",),
        fuzz_machine="ledger",
        klass="budget",
    ),
)

# ---- issue 37: what the campaign could still not see ---------------------------------------

_VERL_V1 = "rollout_lifecycle.gpu_check.verl_v1"


def _settles_redone_step_as_landed(settle: Any) -> Any:
    """The buffer settles as if `global_steps` itself had landed (`<=` for `<`): a resumed
    trainer consumes the reservations of the step it is about to redo, made by the process
    that died before that step's update landed."""

    def settled(self: Any, global_steps: int) -> Any:
        return settle(self, global_steps + 1)

    return settled


def _forget_renewed_deadline(index_many: Any) -> Any:
    """The memory store's lease heap is not told the renewed deadline (a renewal keeps its
    owner, so the index takes it for a write that changes nothing it indexes): the old
    deadline surfaces, finds the lease not yet due and is dropped, and the renewed lease
    never expires."""

    def index(self: Any, writes: Any) -> Any:
        def forget(before: Any, after: Any) -> Any:
            if (
                before is not None
                and before.state == after.state == "reserved"
                and before.reserved_by == after.reserved_by
            ):
                after = copy.copy(after)
                object.__setattr__(after, "lease_expires_at", None)
            return before, after

        return index_many(self, (forget(b, a) for b, a in writes))

    return index


def _batch_lease_from_client_clock(reserve_batch: Any) -> Any:
    """A batch reservation's lease deadline is the CLIENT's clock plus the lease length,
    not the deployment's (the server's, on PostgreSQL); single reservations, renewals and
    expiry keep the server's clock."""

    def batch(self: Any, update_id: str, requests: Any) -> Any:
        self._now = lambda _uow: self.clock()
        try:
            return reserve_batch(self, update_id, requests)
        finally:
            del self._now

    return batch


_PREMISE_LOCK = "PERFORM pg_advisory_xact_lock_shared({lock}, hashtext(current_schema()));"


@contextlib.contextmanager
def _write_one_without_premise_lock() -> Iterator[None]:
    """The single reservation's server-side write keeps its guard (the premise is still
    the one its plan was judged on) but no longer takes the premise lock first: a pointer
    switch that commits between the guard and the compare-and-set goes unseen. (The
    function is created under another name, so a correct one already in the schema does
    not hide the bug.)"""
    pg = importlib.import_module(_PG)
    common = importlib.import_module("rollout_lifecycle.model.postgres_common")
    lock = _PREMISE_LOCK.format(lock=common.K_PREMISE)
    if lock not in pg._WRITE_ONE_DDL:
        raise AssertionError("the write-one function no longer takes the premise lock this way")
    with write_one_variant("_nolock", lambda ddl: ddl.replace(lock, "NULL;")):
        yield


@contextlib.contextmanager
def write_one_variant(suffix: str, edit: Callable[[str], str]) -> Iterator[None]:
    """`write_one`'s server-side function rebuilt as `edit` of its DDL, under its name plus
    `suffix` (variants compose: each renames what the last one made)."""
    pg = importlib.import_module(_PG)
    name = pg.WRITE_ONE
    new = name + suffix
    with contextlib.ExitStack() as stack:
        for attr, value in (
            ("_WRITE_ONE_DDL", edit(pg._WRITE_ONE_DDL).replace(name, new)),
            ("_WRITE_ONE_SIGNATURE", pg._WRITE_ONE_SIGNATURE.replace(name, new)),
            ("_WRITE_ONE_CALL", pg._WRITE_ONE_CALL.replace(name, new)),
            ("WRITE_ONE", new),
        ):
            stack.enter_context(patch_everywhere(pg, attr, value))
        yield


def _rollback_recorded_as_kept(change: Any) -> Any:
    """A rollback that retires its version's rollouts (and quarantines them) records the
    cause 'rolled_back_kept': the record says the operator kept them."""

    def recorded(rec: Any, event: str, guards: Any = None, **kw: Any) -> Any:
        failure = kw.get("failure")
        if event == "roll_back" and failure is not None and failure.cause == "rolled_back":
            kw["failure"] = attrs.evolve(failure, cause="rolled_back_kept")
        return change(rec, event, guards, **kw)

    return recorded


def _ignores_incarnation(holds: Any) -> Any:
    """The served_after_sync checker compares the version and hash of the stored ack with
    the rollout's, never the incarnation: an ack of a previous incarnation still counts."""

    def lenient(rep: Any, incarnation: int, e: Any) -> bool:
        ack = rep.ack
        return ack is not None and (ack.version, ack.artifact_hash) == (
            e.behavior_version,
            e.artifact_hash,
        )

    return lenient


CATALOGUE += (
    Mutant(
        "verl_v1_resume_commits_redone_step",
        "verl v1 buffer: a resumed trainer settles the step it redoes as if it had landed, "
        "consuming the dead process's reservations of it (before, only a hang in one unit test)",
        13,
        _wrap(_VERL_V1, "LedgerReplayBuffer.settle", _settles_redone_step_as_landed),
        reach=("verl-v1",),
        klass="integration",
        needs="transfer_queue",
    ),
    Mutant(
        "memory_renewal_forgets_deadline",
        "the memory store's expiry index never learns a renewed deadline: a renewed lease "
        "whose old deadline already surfaced never expires",
        10,
        _wrap(ledger_mod.__name__, "MemoryStore._index_many", _forget_renewed_deadline),
        reach=("fuzz",),
        fuzz_machine="ledger",
        klass="time",
        backend="memory",
    ),
    Mutant(
        "pg_batch_lease_from_client_clock",
        "a batch reservation takes its lease deadline from the client's clock, not the "
        "server's: a learner minutes behind holds leases a janitor expires at once",
        10,
        _wrap(ledger_mod.__name__, "StoreLedger.reserve_batch", _batch_lease_from_client_clock),
        reach=("clock-skew",),
        klass="skew",
        backend="postgresql",
    ),
    Mutant(
        "pg_write_one_drops_premise_lock",
        "PostgreSQL's single-reservation write checks its premise but without the premise "
        "lock: a pointer switch committed between that guard and the write goes unseen",
        None,
        _write_one_without_premise_lock,
        reach=("premise-window",),
        klass="window",
        backend="postgresql",
    ),
    Mutant(
        "rollback_recorded_as_kept",
        "a rollback that retires its version's rollouts records the cause 'kept'",
        None,
        _wrap(coord_mod.__name__, "_change", _rollback_recorded_as_kept),
        explorer_model="seams",
        fuzz_machine="activation",
        klass="recorded",
    ),
    Mutant(
        "served_check_ignores_incarnation",
        "the served_after_sync checker accepts an ack of a previous incarnation: a restarted "
        "worker serving before it resynced passes",
        11,
        _wrap("rollout_lifecycle.spec.invariants", "_holds", _ignores_incarnation),
        reach=("checkers",),
        klass="checker",
    ),
    Mutant(
        "lineage_admits_poisoned",
        "a version may name an update that lost a lease as its lineage: the rollouts it "
        "trained on and lost are consumed by another update, and both are published",
        None,
        _wrap("rollout_lifecycle.model.registry", "lineage_refusal", _lineage_admits_poisoned),
        reach=("faults",),
        klass="fence",
    ),
    Mutant(
        "ack_deadline_never_passes",
        "the ack timeout is read in the wrong unit: an attempt whose activator was killed "
        "awaits acks for a year, and no settle fails it",
        None,
        _wrap(coord_mod.__name__, "_timeout", _ack_timeout_forever),
        reach=("faults",),
        klass="fence",
    ),
)

BY_NAME: dict[str, Mutant] = {m.name: m for m in CATALOGUE}
