"""The protocol's per-record and per-step rules, written once: enforced, then checked.

Every ledger and registry write path calls these predicates on the records it is about to
write and refuses the write with a typed error (or a refusal reason) before anything lands;
spec/invariants.py wraps the very same functions as named invariants for the checkers
(stateful tests, explorer, trace replay, `ledger check`). They live on the ground floor
because the write paths must not import spec/; spec/ imports them, never retypes them.

Which states need a reward, an admission stamp or a failure stage is read off the declared
machines' rule tags (model/machines.py), never listed here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence

from rollout_lifecycle.model.errors import brief
from rollout_lifecycle.model.machines import ACTIVATION, LIFECYCLE
from rollout_lifecycle.model.records import (
    FRESHNESS_CLASSES,
    AdmissionPolicy,
    AdmissionStamp,
    ArtifactRecord,
    LedgerEntry,
)

# ---- state classes, read off the machines' tags -------------------------------------------

START_STATES = frozenset(LIFECYCLE.states_tagged("start"))
REWARD_STATES = frozenset(LIFECYCLE.states_tagged("carries_reward"))
ADMITTED_STATES = frozenset(LIFECYCLE.states_tagged("admitted"))
REWARD_FAILURE_STATES = frozenset(LIFECYCLE.states_tagged("reward_failure"))
OPEN_STATES = frozenset(s for s in LIFECYCLE.states if s not in LIFECYCLE.terminal)
WAS_ACTIVE_STATES = frozenset(ACTIVATION.states_tagged("was_active"))
UNRESOLVED_STATES = frozenset(ACTIVATION.states_tagged("unresolved"))
FAILED_ACTIVATION_STATES = frozenset(ACTIVATION.states_tagged("failure"))

# refusal reasons of a reservation whose premise does not hold at the moment of the write
NOT_ADMITTED = "not_admitted"
POINTER_MOVED = "pointer_moved"
VERSION_NOT_ACTIVE = "version_not_active"
# the trust boundary: what the deployment's durable state says, not the learner's stamp
STAMP_CONTRADICTS = "stamp_contradicts_itself"
NO_POLICY = "no_admission_policy"
LOOSER_THAN_POLICY = "looser_than_policy"
VERSION_RETIRED = "version_retired"
ARTIFACT_HASH_MISMATCH = "artifact_hash_mismatch"
# the ledger's own record of the update (judged before the premise: see StoreLedger.reserve)
UPDATE_POISONED = "update_poisoned"

# the cause a rollback records on the rolled-back artifact: its rollouts are retired, or,
# by the operator's explicit choice, kept (see ActivationCoordinator.rollback)
ROLLBACK_RETIRED = "rolled_back"
ROLLBACK_KEPT = "rolled_back_kept"


def set_policy_command(url: str | None, policy: AdmissionPolicy | None = None) -> str:
    """The operator's step that records `policy` (placeholders when None) on the deployment
    at `url`: the CLI command naming that very database (a bare `set-policy` would write a
    new ./rollout-lifecycle.db instead), or, for a registry that has no URL (memory), the
    library call."""
    lag = "N" if policy is None else str(policy.max_lag)
    drift = "X" if policy is None else repr(policy.max_drift)
    if url is None:
        return (
            f"model.registry.set_admission_policy(registry, {policy!r}, reason) (the operator's "
            "step; a memory:// registry lives in one process)"
            if policy is not None
            else "model.registry.set_admission_policy(registry, AdmissionPolicy(N, X), reason)"
        )
    out = (
        f"rollout-lifecycle deployment set-policy --backend {url} --max-lag {lag} "
        f"--max-drift {drift}"
    )
    if policy is not None and policy.batch_size is not None:
        out += f" --batch-size {policy.batch_size}"
    if policy is not None and policy.max_attempts is not None:
        out += f" --max-attempts {policy.max_attempts}"
    if policy is not None and policy.lineage != "ledger":
        out += f" --lineage {policy.lineage}"
    if policy is not None and policy.chain_key != "identity":
        out += f" --chain-key {policy.chain_key}"
    return out


def no_policy_detail(url: str | None) -> str:
    """The detail of a `no_admission_policy` refusal: what to run, on which database
    (`url` None: not known where the refusal is decided; the ledger names it)."""
    return "the deployment records no admission policy; the operator sets it with " + (
        "`rollout-lifecycle deployment set-policy --backend URL-OF-THIS-DATABASE --max-lag N "
        "--max-drift X` (or model.registry.set_admission_policy)"
        if url is None
        else f"`{set_policy_command(url)}`"
    )


# ---- one ledger entry --------------------------------------------------------------------


def ownership_problems(e: LedgerEntry) -> list[str]:
    """reserved_by is set if and only if the state is reserved."""
    if (e.reserved_by is not None) != (e.state == "reserved"):
        return [f"{e.rollout_id}: state {brief(e.state)} with reserved_by {brief(e.reserved_by)}"]
    return []


def reward_problems(e: LedgerEntry) -> list[str]:
    """A reward failure carries no reward value; what can be trained carries a real one."""
    out = []
    if e.state in REWARD_FAILURE_STATES and e.reward is not None:
        out.append(f"{e.rollout_id}: {e.state} carries reward value {e.reward.value}")
    if e.state in REWARD_STATES and e.reward is None:
        out.append(f"{e.rollout_id}: {e.state} without a reward value")
    if e.state in ADMITTED_STATES and e.disposition is not None:
        out.append(f"{e.rollout_id}: {e.state} yet marked failed ({e.disposition.cause})")
    return out


def stamp_contradictions(a: AdmissionStamp) -> list[str]:
    """Where a stamp contradicts itself, whatever it claims: malformed types (a record
    bypassed), a decision that does not follow from its own figures.

    CONTRACT section 3: freshness follows from the lag and L_max, accepted iff reason 'ok',
    and an accepted decision has a drift figure. Checked before anything the stamp claims
    is believed.
    """
    out = []
    if not isinstance(a.accepted, bool):
        out.append(f"accepted is {brief(a.accepted)}, not a bool")
    if not isinstance(a.reason, str) or not a.reason:
        out.append(f"reason {brief(a.reason)} is not a non-empty string")
    if a.freshness is not None and a.freshness not in FRESHNESS_CLASSES:
        out.append(f"unknown freshness {brief(a.freshness)}")
    for name in ("current_version", "behavior_version", "max_lag"):
        v = getattr(a, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            out.append(f"{name} {brief(v)} is not a non-negative int")
    for name, v, optional in (("max_drift", a.max_drift, False), ("drift", a.drift, True)):
        if v is None and optional:
            continue
        try:
            ok = (
                not isinstance(v, bool)
                and isinstance(v, int | float)
                and math.isfinite(v)
                and v >= 0
            )
        except OverflowError:
            ok = False
        if not ok:
            out.append(f"{name} {brief(v)} is not a finite number >= 0")
    if out:
        return out  # the figures below cannot be read
    if a.accepted != (a.reason == "ok"):
        out.append(f"accepted={a.accepted} with reason {brief(a.reason)}")
    lag = a.current_version - a.behavior_version
    if a.freshness is not None:
        want = (
            "future"
            if lag < 0
            else "fresh"
            if lag == 0
            else "tolerated"
            if lag <= a.max_lag
            else "stale"
        )
        if a.freshness != want:
            out.append(f"freshness {a.freshness} but lag {lag} with max_lag {a.max_lag} is {want}")
    elif a.accepted:
        out.append("accepted without a freshness class")
    if a.accepted and a.drift is None:
        out.append("accepted without a drift figure")
    if a.accepted and a.freshness in ("future", "stale"):
        out.append(f"accepted although {a.freshness} by its own lag {lag}")
    if a.accepted and a.drift is not None and a.drift > a.max_drift:
        out.append(f"accepted although its drift {a.drift} is over its own {a.max_drift}")
    return out


def _malformed(a: AdmissionStamp) -> bool:
    """Whether a stamp's fields are not even of their types (its figures cannot be read)."""
    ints = (a.current_version, a.behavior_version, a.max_lag)
    nums = (a.max_drift,) + (() if a.drift is None else (a.drift,))
    return (
        not isinstance(a.accepted, bool)
        or any(isinstance(v, bool) or not isinstance(v, int) for v in ints)
        or any(isinstance(v, bool) or not isinstance(v, int | float) for v in nums)
    )


def stamp_problems(a: AdmissionStamp, behavior_version: int) -> list[str]:
    """What is wrong with an admission stamp that is offered as a pass (empty: it passes).

    The stamp must be self-consistent: accepted with reason 'ok', for this rollout's
    behaviour version, 0 <= lag <= L_max and a finite drift <= D_max. A stamp that says
    accepted while its own figures say stale or drifted is refused, not trusted.
    """
    problems = []
    if not a.accepted or a.reason != "ok":
        problems.append(f"decision {brief(a.reason)} (accepted={a.accepted})")
    if a.behavior_version != behavior_version:
        problems.append(f"admitted for v{a.behavior_version}, stamped v{behavior_version}")
    if not 0 <= a.lag <= a.max_lag:
        problems.append(f"lag {a.lag} outside [0, {a.max_lag}]")
    if a.drift is None or not math.isfinite(a.drift) or a.drift > a.max_drift:
        problems.append(f"drift {a.drift} over {a.max_drift}")
    return problems


def admission_problems(e: LedgerEntry) -> list[str]:
    """Every reserved or consumed rollout carries a stamp that passed admission."""
    if e.state not in ADMITTED_STATES:
        return []
    if e.admission is None:
        return [f"{e.rollout_id}: {e.state} with no admission record"]
    problems = stamp_problems(e.admission, e.behavior_version)
    return [f"{e.rollout_id}: {e.state} but " + "; ".join(problems)] if problems else []


def stage_problems(e: LedgerEntry) -> list[str]:
    """A failure state records its cause at one of the stages its state allows."""
    want = LIFECYCLE.stages(e.state)
    if not want:
        return []
    if e.disposition is None:
        return [f"{e.rollout_id}: {e.state} with no recorded stage/cause"]
    if e.disposition.stage not in want:
        return [f"{e.rollout_id}: {e.state} recorded at stage {brief(e.disposition.stage)}"]
    return []


def entry_problems(e: LedgerEntry) -> list[str]:
    """Every per-record rule on one entry: what a write path refuses to store.

    The rules read no more of an entry than `_judged` gives (the id only names the entry in
    a message); a rule that reads more must add it there, or `entries_problems` would
    pass an entry by the verdict on another."""
    return [*ownership_problems(e), *reward_problems(e), *admission_problems(e), *stage_problems(e)]


def _judged(e: LedgerEntry) -> tuple[object, ...]:
    """What of an entry decides whether `entry_problems` finds anything: its state, whether
    it has an owner and a reward, its disposition and stamp (by identity: whoever keeps the
    key keeps the objects too, so no other object takes their ids) and its version."""
    return (
        type(e),
        e.state,
        e.reserved_by is None,
        e.reward is None,
        id(e.disposition),
        id(e.admission),
        e.behavior_version,
    )


def entries_problems(entries: Iterable[LedgerEntry]) -> list[str]:
    """`entry_problems` of each entry, in order: a step's rows mostly agree on all that the
    rules read (`_judged`), so an entry that agrees with one that passed passes too, and
    only the others are judged one by one."""
    if type(entries) is list and len(entries) == 1:  # a single write: nothing to share
        return entry_problems(entries[0])
    passed: dict[tuple[object, ...], tuple[object, object]] = {}
    out: list[str] = []
    for e in entries:
        key = _judged(e)
        if key in passed:
            continue
        found = entry_problems(e)
        if found:
            out += found
        else:  # the objects whose ids are in the key, held so no id is reused meanwhile
            passed[key] = (e.disposition, e.admission)
    return out


def artifact_stage_problems(a: ArtifactRecord) -> list[str]:
    """A failed activation records its cause at one of the stages its state allows."""
    want = ACTIVATION.stages(a.state)
    if not want:
        return []
    if a.failure is None:
        return [f"artifact v{a.version}: {a.state} with no recorded stage/cause"]
    if a.failure.stage not in want:
        return [f"artifact v{a.version}: {a.state} recorded at stage {brief(a.failure.stage)}"]
    return []


def retired_versions(artifacts: Iterable[ArtifactRecord]) -> frozenset[int]:
    """Rolled-back versions whose rollouts are retired (all but those kept explicitly)."""
    return frozenset(
        a.version
        for a in artifacts
        if a.state == "rolled_back" and (a.failure is None or a.failure.cause != ROLLBACK_KEPT)
    )


def retired_from_rows(rows: Iterable[Sequence[object]]) -> frozenset[int]:
    """`retired_versions` over stored (version, failure JSON) rows of rolled-back artifacts."""
    out = set()
    for version, failure in rows:
        cause = None if failure is None else json.loads(str(failure)).get("cause")
        if cause != ROLLBACK_KEPT:
            out.add(int(str(version)))
    return frozenset(out)


# ---- one reservation step ------------------------------------------------------------------


def reservation_refusal(
    stamp: AdmissionStamp | None,
    behavior_version: int,
    pointer_version: int | None,
    was_active: frozenset[int] | None,
    policy: AdmissionPolicy | None = None,
    retired: frozenset[int] = frozenset(),
    artifact_hash: str | None = None,
    hashes: Mapping[int, str] | None = None,
    *,
    stamp_passed: bool = False,
) -> tuple[str, str] | None:
    """Why a reservation may not land NOW, or None: (reason, detail).

    Judged inside the reservation's own atomic step, with what that step read of the
    registry: the active pointer, the versions that were ever active (and the hash each
    was registered with, `hashes`), the deployment's recorded admission policy and the
    retired (rolled-back) versions. `was_active` None means "no registry attached": only
    the stamp itself is judged. With a registry, the stamp is a request, never the premise:
    it may be stricter than the recorded policy, never looser; the rollout's stamped
    `artifact_hash` must be the one registered for its version, whatever form the stamp
    takes; the lag is recomputed from the pointer of this moment and bounded by the policy;
    a version rolled back (retired) is never reserved. (`hashes` None: a premise that
    carries no hashes, built by hand for a test; every store's premise carries them.)

    `stamp_passed`: this very stamp passed this function for `behavior_version` already
    (a plan judged it a moment before; a stamp is frozen and its verdict depends on nothing
    else), so only what the premise adds is judged: the same verdict, without judging the
    stamp's own figures twice.
    """
    if stamp is None:
        return NOT_ADMITTED, "no admission stamp"
    if not stamp_passed:
        contradictions = stamp_contradictions(stamp)
        if contradictions:
            problems = [] if _malformed(stamp) else stamp_problems(stamp, behavior_version)
            return STAMP_CONTRADICTS, "; ".join(contradictions + problems)
        problems = stamp_problems(stamp, behavior_version)
        if problems:
            return NOT_ADMITTED, "; ".join(problems)
    if was_active is None:
        return None
    if policy is None:
        return NO_POLICY, no_policy_detail(None)
    if stamp.max_lag > policy.max_lag or stamp.max_drift > policy.max_drift:
        return (
            LOOSER_THAN_POLICY,
            f"judged with max_lag {stamp.max_lag}, max_drift {stamp.max_drift}; the "
            f"deployment's policy is max_lag {policy.max_lag}, max_drift {policy.max_drift}",
        )
    if behavior_version not in was_active:
        return VERSION_NOT_ACTIVE, f"v{behavior_version} never became the active version"
    if hashes is not None and hashes.get(behavior_version) != artifact_hash:
        return (
            ARTIFACT_HASH_MISMATCH,
            f"stamped v{behavior_version} with hash {brief(artifact_hash)}; the registry's "
            f"v{behavior_version} is {brief(hashes.get(behavior_version))}",
        )
    if behavior_version in retired:
        return VERSION_RETIRED, f"v{behavior_version} was rolled back; its rollouts are retired"
    if stamp.current_version not in was_active:
        return (
            STAMP_CONTRADICTS,
            f"admitted against v{stamp.current_version}, which never was the active version",
        )
    if pointer_version is None:
        return VERSION_NOT_ACTIVE, "no version is active"
    lag = pointer_version - behavior_version
    if not 0 <= lag <= min(stamp.max_lag, policy.max_lag):
        return (
            POINTER_MOVED,
            f"admitted against v{stamp.current_version}, the active version is now "
            f"v{pointer_version}: lag {lag} outside [0, {min(stamp.max_lag, policy.max_lag)}]; "
            "re-admit",
        )
    return None
