"""The small functional API of CONTRACT section 5: four plain functions over plain dicts.

They wrap the full machinery: edges come from the declared machines, the lag/drift core is
the gate's, and the reservation order is the ledgers' `reserve_precheck`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rollout_lifecycle.model.errors import ActivationError, InvalidRecord, brief
from rollout_lifecycle.model.gate import lag_drift_decision
from rollout_lifecycle.model.ledger import MISSING, RESERVED, reserve_precheck
from rollout_lifecycle.model.machines import ACTIVATION, LIFECYCLE
from rollout_lifecycle.model.records import INT64_MAX


def transition_lifecycle(state: str, event: str) -> str:
    """Next lifecycle state for (state, event); ValueError for any pair the machine refuses.

    No context is given, so guards are False: `abort` releases (reserved -> rewarded).
    """
    if not isinstance(state, str) or not isinstance(event, str):
        raise InvalidRecord(f"state and event must be strings, got {brief(state)}, {brief(event)}")
    return LIFECYCLE.next_state(state, event)


def assess_policy_compatibility(
    old_log_probs: Sequence[float],
    current_log_probs: Sequence[float],
    action_mask: Sequence[bool],
    behavior_version: int,
    current_version: int,
    max_lag: int,
    max_mean_abs_log_ratio: float,
) -> dict[str, Any]:
    """Lag and drift admission of one rollout: {accepted, reason, freshness, mean_abs_log_ratio}."""
    return lag_drift_decision(
        old_log_probs,
        current_log_probs,
        action_mask,
        behavior_version,
        current_version,
        max_lag,
        max_mean_abs_log_ratio,
    )


def _entry_field(entry: Mapping[str, Any], key: str, rollout_id: Any) -> Any:
    if key not in entry:
        raise InvalidRecord(f"ledger entry for {brief(rollout_id)} has no {brief(key)}")
    return entry[key]


def _revision(value: Any, what: str) -> int:
    """A revision is a non-negative int (never a bool, a float or a negative number)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value > INT64_MAX:
        raise InvalidRecord(f"{what} must be a non-negative int, got {brief(value)}")
    return value


def compare_and_reserve(
    ledger: dict[Any, dict[str, Any]], rollout_id: Any, expected_revision: int, update_id: str
) -> dict[str, Any]:
    """Compare-and-set reservation on a plain dict ledger: {reserved, reason, record}.

    On success the entry is replaced by a new dict (state 'reserved', reserved_by, revision + 1);
    otherwise the ledger is untouched. `record` is always a copy.
    """
    if not isinstance(update_id, str) or not update_id:
        raise InvalidRecord(f"update_id must be a non-empty string, got {brief(update_id)}")
    _revision(expected_revision, "expected_revision")
    if not isinstance(ledger, dict):
        raise InvalidRecord(f"ledger must be a dict of rollout id -> entry, got {type(ledger)}")
    try:
        entry = ledger.get(rollout_id)
    except TypeError:
        raise InvalidRecord(f"rollout_id must be hashable, got {brief(rollout_id)}") from None
    if entry is None:
        return {"reserved": False, "reason": MISSING, "record": None}
    if not isinstance(entry, Mapping):
        raise InvalidRecord(
            f"ledger entry for {brief(rollout_id)} must be a dict, got {type(entry)}"
        )
    state = _entry_field(entry, "lifecycle_state", rollout_id)
    if not isinstance(state, str) or state not in LIFECYCLE.states:
        raise InvalidRecord(
            f"ledger entry for {brief(rollout_id)}: unknown lifecycle_state {brief(state)}"
        )
    revision = _revision(_entry_field(entry, "revision", rollout_id), "stored revision")
    why = reserve_precheck(state, revision, entry.get("reserved_by"), expected_revision, update_id)
    if why is not None:
        return {"reserved": why == "idempotent_retry", "reason": why, "record": dict(entry)}
    new = dict(entry)
    new["lifecycle_state"] = LIFECYCLE.next_state(state, "reserve")
    new["reserved_by"] = update_id
    new["revision"] = revision + 1
    ledger[rollout_id] = new
    return {"reserved": True, "reason": RESERVED, "record": dict(new)}


def _version(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > INT64_MAX:
        raise ActivationError(f"{name} must be a non-negative int, got {brief(v)}")
    return v


def activate_policy_version(
    active_pointer: Mapping[str, Any] | None,
    artifact: Mapping[str, Any],
    worker_states: Mapping[str, Mapping[str, Any]],
    required_workers: Iterable[str],
) -> dict[str, Any]:
    """Two-phase activation decision: switch the pointer only on a committed artifact, a
    strictly newer version, and every required worker acking the same version and hash.

    Returns {activated, reason, active_pointer, missing_workers, mismatched_workers}; the
    caller's pointer is never mutated, and on failure the returned pointer equals the old one.
    """
    for name, arg in (("artifact", artifact), ("worker_states", worker_states)):
        if not isinstance(arg, Mapping):
            raise ActivationError(f"{name} must be a dict, got {type(arg).__name__}")
    if active_pointer is not None and not isinstance(active_pointer, Mapping):
        raise ActivationError(f"active_pointer must be a dict or None, got {brief(active_pointer)}")
    for w, reported in worker_states.items():
        if not isinstance(reported, Mapping):
            raise ActivationError(f"worker {brief(w)}: state must be a dict, got {brief(reported)}")
    if isinstance(required_workers, str):
        raise ActivationError(
            f"required_workers must be a list of worker ids, got the "
            f"string {brief(required_workers)}"
        )
    try:
        required = list(required_workers)
    except TypeError:
        raise ActivationError(
            f"required_workers must be a list of worker ids, got {brief(required_workers)}"
        ) from None
    for w in required:
        if not isinstance(w, str) or not w:
            raise ActivationError(f"worker id must be a non-empty string, got {brief(w)}")
    if not required:
        raise ActivationError(
            "at least one required worker is needed: a version no worker loaded is never active"
        )
    if len(set(required)) != len(required):
        dups = sorted({w for w in required if required.count(w) > 1})
        raise ActivationError(f"required workers listed more than once: {dups}")
    old: dict[str, Any] | None = None
    if active_pointer is not None:
        old = {
            "version": _version("active_pointer version", active_pointer.get("version")),
            "artifact_hash": active_pointer.get("artifact_hash"),
        }
    version = _version("artifact version", artifact.get("version"))
    art_hash = artifact.get("artifact_hash")
    if not isinstance(art_hash, str) or not art_hash:
        raise ActivationError(f"artifact hash must be a non-empty string, got {brief(art_hash)}")
    committed = artifact.get("committed")
    if not isinstance(committed, bool):
        raise ActivationError(f"artifact 'committed' must be a bool, got {brief(committed)}")
    missing: list[str] = []
    mismatched: list[str] = []
    for w in required:
        st = worker_states.get(w)
        if st is None:
            missing.append(w)
            continue
        wv = st.get("version")
        if wv is not None:
            _version(f"worker {brief(w)} version", wv)
        if wv != version or st.get("artifact_hash") != art_hash:
            mismatched.append(w)

    def result(reason: str, pointer: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "activated": reason == "activated",
            "reason": reason,
            "active_pointer": None if pointer is None else dict(pointer),
            "missing_workers": sorted(missing),
            "mismatched_workers": sorted(mismatched),
        }

    # walk the declared activation machine: an uncommitted artifact is still `prepared`
    state = "awaiting_acks" if committed else ACTIVATION.initial
    if not ACTIVATION.is_legal(state, "activate"):
        return result("artifact_not_committed", old)
    if old is not None and version <= old["version"]:
        return result("non_monotonic_version", old)
    if missing:
        return result("missing_worker_ack", old)
    if mismatched:
        return result("worker_mismatch", old)
    ACTIVATION.resolve(state, "activate", {"all_acked": True})
    return result("activated", {"version": version, "artifact_hash": art_hash})
