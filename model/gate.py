"""The admission gate: identity, evidence and conditions checks, then version lag AND drift.

    Δv    = v_current - v_behavior
    D_beh = Σ_t m_t |log π_current(a_t|s_t) - log π_behavior(a_t|s_t)| / Σ_t m_t

Admission needs 0 <= Δv <= L_max and D_beh <= D_max (CONTRACT section 3). Two gates, because
Δv = 0 proves only that versions match, not that the data is on-policy, and a small Δv can
still hide a large drift.

Two implementations of the lag/drift core are kept on purpose: `lag_drift_decision` in plain
Python (the exact contract semantics, for one rollout) and `assess_arrays`, vectorised over a
B x T batch for numpy arrays or torch tensors (torch is never imported here: a tensor's own
module is used). Tests check that they agree, which is worth more than one shared code path.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from rollout_lifecycle.model.errors import GateConfigError
from rollout_lifecycle.model.records import (
    AdmissionStamp,
    GenerationConditions,
    LedgerEntry,
    Rollout,
)

FRESHNESS = ("future", "fresh", "tolerated", "stale")

# route: what the caller should do with a rollout that was not admitted
ROUTE_ADMIT = "admit"
ROUTE_OFFLINE = "offline"  # stale: retire into the offline buffer (lifecycle event retire_stale)
ROUTE_QUARANTINE = "quarantine"  # registration error / contradiction (event quarantine)
ROUTE_REJECT = "reject"  # not admitted now; the record is left as it is
ROUTE_WAIT = "wait"  # generation or reward not finished yet

REASON_ROUTE: dict[str, str] = {
    "ok": ROUTE_ADMIT,
    "empty_action_mask": ROUTE_REJECT,
    "future_policy": ROUTE_QUARANTINE,
    "stale_policy": ROUTE_OFFLINE,
    "policy_drift": ROUTE_REJECT,
    "unregistered_version": ROUTE_QUARANTINE,
    "artifact_hash_mismatch": ROUTE_QUARANTINE,
    "conditions_mismatch": ROUTE_REJECT,
    "missing_evidence": ROUTE_REJECT,
    "evidence_misaligned": ROUTE_REJECT,
    "not_finished": ROUTE_WAIT,
    "already_reserved": ROUTE_REJECT,
    "already_consumed": ROUTE_REJECT,
    "terminal_state": ROUTE_REJECT,
}


def _check_version(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise GateConfigError(f"{name} must be a non-negative int (bool is not an int), got {v!r}")
    return v


def check_bounds(max_lag: Any, max_drift: Any) -> tuple[int, float]:
    """Validate L_max (int >= 0) and D_max (finite, >= 0)."""
    if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0:
        raise GateConfigError(f"max_lag must be an int >= 0, got {max_lag!r}")
    if isinstance(max_drift, bool) or not isinstance(max_drift, int | float):
        raise GateConfigError(f"max drift must be a number, got {max_drift!r}")
    if not math.isfinite(max_drift) or max_drift < 0:
        raise GateConfigError(f"max drift must be finite and >= 0, got {max_drift!r}")
    return max_lag, float(max_drift)


def classify_lag(lag: int, max_lag: int) -> str:
    """Freshness of Δv: future (< 0), fresh (= 0), tolerated (<= L_max), stale (> L_max)."""
    if lag < 0:
        return "future"
    if lag == 0:
        return "fresh"
    if lag <= max_lag:
        return "tolerated"
    return "stale"


def lag_drift_decision(
    old_log_probs: Sequence[Any],
    current_log_probs: Sequence[Any],
    action_mask: Sequence[Any],
    behavior_version: Any,
    current_version: Any,
    max_lag: Any,
    max_drift: Any,
) -> dict[str, Any]:
    """Exact CONTRACT section 5 semantics of assess_policy_compatibility, in plain Python."""
    bv = _check_version("behavior_version", behavior_version)
    cv = _check_version("current_version", current_version)
    max_lag, max_drift = check_bounds(max_lag, max_drift)
    try:
        n = len(old_log_probs)
        if len(current_log_probs) != n or len(action_mask) != n:
            raise GateConfigError(
                "old_log_probs, current_log_probs and action_mask must have the same length, got "
                f"{n}, {len(current_log_probs)}, {len(action_mask)}"
            )
    except TypeError:
        raise GateConfigError("log-probs and mask must be sequences") from None
    total = 0.0
    count = 0
    for i, (o, c, m) in enumerate(zip(old_log_probs, current_log_probs, action_mask, strict=True)):
        if not isinstance(m, bool | np.bool_):
            raise GateConfigError(f"action_mask[{i}] must be a boolean, got {m!r}")
        if not m:
            continue
        fo, fc = float(o), float(c)
        if not (math.isfinite(fo) and math.isfinite(fc)):
            raise GateConfigError(
                f"non-finite log-prob at action position {i} (old {fo!r}, current {fc!r})"
            )
        total += abs(fc - fo)
        count += 1
    if count == 0:
        return {
            "accepted": False,
            "reason": "empty_action_mask",
            "freshness": None,
            "mean_abs_log_ratio": None,
        }
    drift = total / count
    freshness = classify_lag(cv - bv, max_lag)
    if freshness == "future":
        reason = "future_policy"
    elif freshness == "stale":
        reason = "stale_policy"
    elif drift > max_drift:
        reason = "policy_drift"
    else:
        reason = "ok"
    return {
        "accepted": reason == "ok",
        "reason": reason,
        "freshness": freshness,
        "mean_abs_log_ratio": drift,
    }


# --------------------------------------------------------------------------------------------
# Vectorised batch core (numpy, or torch without importing it)
# --------------------------------------------------------------------------------------------


@attrs.frozen
class BatchAssessment:
    """Per-row lag/drift decisions for a B x T batch; plain numpy arrays and lists."""

    accepted: npt.NDArray[np.bool_]
    reasons: tuple[str, ...]
    freshness: tuple[str | None, ...]
    drift: npt.NDArray[np.float64]  # NaN where a row has no action position
    lag: npt.NDArray[np.int64]

    def __len__(self) -> int:
        return len(self.reasons)

    def row(self, i: int) -> dict[str, Any]:
        """Row i in the contract's dict shape."""
        d = float(self.drift[i])
        return {
            "accepted": bool(self.accepted[i]),
            "reason": self.reasons[i],
            "freshness": self.freshness[i],
            "mean_abs_log_ratio": None if math.isnan(d) else d,
        }


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _to_host(x: Any) -> npt.NDArray[Any]:
    """A small (B-sized) result to numpy; torch tensors leave the device only here."""
    if _is_torch(x):
        return np.asarray(x.detach().cpu().numpy())
    return np.asarray(x)


def _mask_ok(mask: Any) -> Any:
    """Accept bool masks, or integer masks holding only 0/1 (verl's response_mask is int)."""
    if _is_torch(mask):
        torch = sys.modules["torch"]
        if mask.dtype == torch.bool:
            return mask
        if mask.dtype.is_floating_point or mask.dtype.is_complex:
            raise GateConfigError(f"action mask must be bool or 0/1 integers, got {mask.dtype}")
        if bool(((mask != 0) & (mask != 1)).any()):
            raise GateConfigError("integer action mask must hold only 0 and 1")
        return mask != 0
    arr = np.asarray(mask)
    if arr.dtype == np.bool_:
        return arr
    if not np.issubdtype(arr.dtype, np.integer):
        raise GateConfigError(f"action mask must be bool or 0/1 integers, got dtype {arr.dtype}")
    if ((arr != 0) & (arr != 1)).any():
        raise GateConfigError("integer action mask must hold only 0 and 1")
    return arr != 0


def assess_arrays(
    old_log_probs: Any,
    current_log_probs: Any,
    action_mask: Any,
    behavior_versions: Any,
    current_version: int,
    max_lag: int,
    max_drift: float,
) -> BatchAssessment:
    """Lag and drift for B rollouts x T tokens at once; no Python loop over tokens.

    Inputs are numpy arrays (or anything np.asarray takes) or torch tensors on any device;
    with tensors the reduction runs where they live and only B numbers come back. Values at
    masked positions never matter, even NaN or inf. Non-finite values at action positions
    raise GateConfigError naming the rows.
    """
    cv = _check_version("current_version", current_version)
    max_lag, max_drift = check_bounds(max_lag, max_drift)
    torch_mode = _is_torch(old_log_probs) or _is_torch(current_log_probs)
    if torch_mode:
        torch = sys.modules["torch"]
        old = old_log_probs if _is_torch(old_log_probs) else torch.as_tensor(old_log_probs)
        cur = (
            current_log_probs
            if _is_torch(current_log_probs)
            else torch.as_tensor(current_log_probs, device=old.device)
        )
        mask = _mask_ok(
            action_mask if _is_torch(action_mask) else torch.as_tensor(np.asarray(action_mask))
        ).to(old.device)
        cur = cur.to(old.device)
        if old.ndim != 2 or old.shape != cur.shape or old.shape != mask.shape:
            raise GateConfigError(
                "old, current log-probs and mask must all be B x T with the same shape, got "
                f"{tuple(old.shape)}, {tuple(cur.shape)}, {tuple(mask.shape)}"
            )
        if not (old.dtype.is_floating_point and cur.dtype.is_floating_point):
            raise GateConfigError("log-probs must be floating-point tensors")
        old64, cur64 = old.double(), cur.double()
        bad = (~torch.isfinite(old64) | ~torch.isfinite(cur64)) & mask
        bad_rows = _to_host(bad.any(dim=1))
        diff = torch.where(mask, (cur64 - old64).abs(), torch.zeros_like(old64))
        sums = _to_host(diff.sum(dim=1)).astype(np.float64)
        counts = _to_host(mask.sum(dim=1)).astype(np.int64)
    else:
        old_a = np.asarray(old_log_probs)
        cur_a = np.asarray(current_log_probs)
        mask_a = _mask_ok(action_mask)
        if old_a.ndim != 2 or old_a.shape != cur_a.shape or old_a.shape != mask_a.shape:
            raise GateConfigError(
                "old, current log-probs and mask must all be B x T with the same shape, got "
                f"{old_a.shape}, {cur_a.shape}, {mask_a.shape}"
            )
        if not (
            np.issubdtype(old_a.dtype, np.floating) and np.issubdtype(cur_a.dtype, np.floating)
        ):
            raise GateConfigError(
                f"log-probs must be floating-point arrays, got {old_a.dtype} and {cur_a.dtype}"
            )
        old64, cur64 = old_a.astype(np.float64), cur_a.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            bad_rows = ((~np.isfinite(old64) | ~np.isfinite(cur64)) & mask_a).any(axis=1)
            diff = np.where(mask_a, np.abs(cur64 - old64), 0.0)
        sums = diff.sum(axis=1)
        counts = mask_a.sum(axis=1).astype(np.int64)
    if bad_rows.any():
        rows = np.flatnonzero(bad_rows).tolist()
        raise GateConfigError(
            f"non-finite log-prob at an action position in row(s) {rows[:10]}"
            + (" ..." if len(rows) > 10 else "")
        )
    bv = _to_host(behavior_versions)
    if bv.ndim != 1 or bv.shape[0] != sums.shape[0]:
        raise GateConfigError(
            f"behavior_versions must be a vector of length B={sums.shape[0]}, got shape {bv.shape}"
        )
    if bv.dtype == np.bool_ or not np.issubdtype(bv.dtype, np.integer) or (bv < 0).any():
        raise GateConfigError("behavior_versions must be non-negative integers")
    lag = (cv - bv.astype(np.int64)).astype(np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        drift = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    reasons: list[str] = []
    freshness: list[str | None] = []
    for i in range(len(lag)):  # a loop over rollouts (B), never over tokens
        if counts[i] == 0:
            reasons.append("empty_action_mask")
            freshness.append(None)
            continue
        fr = classify_lag(int(lag[i]), max_lag)
        freshness.append(fr)
        if fr == "future":
            reasons.append("future_policy")
        elif fr == "stale":
            reasons.append("stale_policy")
        elif drift[i] > max_drift:
            reasons.append("policy_drift")
        else:
            reasons.append("ok")
    accepted = np.array([r == "ok" for r in reasons], dtype=np.bool_)
    return BatchAssessment(
        accepted=accepted,
        reasons=tuple(reasons),
        freshness=tuple(freshness),
        drift=drift.astype(np.float64),
        lag=lag,
    )


# --------------------------------------------------------------------------------------------
# The full gate over rollout records
# --------------------------------------------------------------------------------------------


@attrs.frozen
class GatePolicy:
    """Admission bounds and the experiment's generation conditions."""

    max_lag: int
    max_drift: float
    conditions: GenerationConditions | None = None

    def __attrs_post_init__(self) -> None:
        check_bounds(self.max_lag, self.max_drift)


@attrs.frozen
class AdmissionDecision:
    """One rollout's admission: accepted or not, why, where it should go, and the figures."""

    rollout_id: str
    accepted: bool
    reason: str
    route: str
    freshness: str | None
    drift: float | None
    lag: int
    current_version: int
    behavior_version: int
    max_lag: int
    max_drift: float

    def stamp(self) -> AdmissionStamp:
        """The record a reservation keeps of this decision."""
        return AdmissionStamp(
            current_version=self.current_version,
            behavior_version=self.behavior_version,
            max_lag=self.max_lag,
            max_drift=self.max_drift,
            drift=self.drift,
            freshness=self.freshness,
            reason=self.reason,
            accepted=self.accepted,
        )


Registry = Mapping[int, str] | Callable[[int], str | None]


def _registered_hash(registry: Registry | None, version: int) -> tuple[bool, str | None]:
    if registry is None:
        return False, None
    if callable(registry):
        h = registry(version)
        return True, h
    return True, registry.get(version)


class AdmissionGate:
    """Admits rollouts for an update against the current version, the registry and conditions.

    `registry` maps every version that ever became active to its artifact hash (or is a
    callable doing the lookup). A behaviour version absent from it is a registration error
    (quarantine), as is a hash that contradicts the registered one.
    """

    def __init__(self, policy: GatePolicy, registry: Registry | None = None) -> None:
        self.policy = policy
        self.registry = registry

    def _record_checks(
        self, rollout: Rollout, entry: LedgerEntry | None, current_version: int
    ) -> str | None:
        """Reasons that do not need log-probs, in order; None when all pass."""
        state = (entry or rollout.entry()).state
        if state in ("dispatched", "generated"):
            return "not_finished"
        if state == "reserved":
            return "already_reserved"
        if state == "consumed":
            return "already_consumed"
        if state != "rewarded":
            return "terminal_state"
        bv = rollout.behavior.version
        known, registered = _registered_hash(self.registry, bv)
        if bv > current_version:
            return "future_policy"
        if known and registered is None:
            return "unregistered_version"
        if known and registered != rollout.behavior.artifact_hash:
            return "artifact_hash_mismatch"
        expected = self.policy.conditions
        if expected is not None and rollout.conditions != expected:
            return "conditions_mismatch"
        ev = rollout.evidence
        if ev is None:
            return "missing_evidence"
        n = len(ev.response_token_ids)
        if len(ev.action_mask) != n or len(ev.behavior_log_probs) != n:
            return "evidence_misaligned"
        return None

    def _decision(
        self,
        rollout: Rollout,
        current_version: int,
        reason: str,
        freshness: str | None,
        drift: float | None,
    ) -> AdmissionDecision:
        lag = current_version - rollout.behavior.version
        if freshness is None and reason not in ("empty_action_mask",):
            freshness = classify_lag(lag, self.policy.max_lag)
        return AdmissionDecision(
            rollout_id=rollout.rollout_id,
            accepted=reason == "ok",
            reason=reason,
            route=REASON_ROUTE[reason],
            freshness=freshness,
            drift=drift,
            lag=lag,
            current_version=current_version,
            behavior_version=rollout.behavior.version,
            max_lag=self.policy.max_lag,
            max_drift=self.policy.max_drift,
        )

    def assess(
        self,
        rollout: Rollout,
        current_log_probs: Sequence[float],
        current_version: int,
        entry: LedgerEntry | None = None,
    ) -> AdmissionDecision:
        """Admit one rollout: record checks, then lag and drift in plain Python."""
        _check_version("current_version", current_version)
        early = self._record_checks(rollout, entry, current_version)
        if early is not None:
            return self._decision(rollout, current_version, early, None, None)
        ev = rollout.evidence
        assert ev is not None  # record checks guarantee it
        if len(current_log_probs) != len(ev.behavior_log_probs):
            raise GateConfigError(
                f"rollout {rollout.rollout_id!r}: {len(current_log_probs)} current log-probs for "
                f"{len(ev.behavior_log_probs)} tokens"
            )
        r = lag_drift_decision(
            ev.behavior_log_probs,
            current_log_probs,
            ev.action_mask,
            rollout.behavior.version,
            current_version,
            self.policy.max_lag,
            self.policy.max_drift,
        )
        return self._decision(
            rollout, current_version, r["reason"], r["freshness"], r["mean_abs_log_ratio"]
        )

    def assess_batch(
        self,
        rollouts: Sequence[Rollout],
        current_log_probs: Any,
        current_version: int,
        entries: Sequence[LedgerEntry | None] | None = None,
    ) -> list[AdmissionDecision]:
        """Admit B rollouts; `current_log_probs` is B x T (numpy or torch), right-padded.

        Record checks loop over rollouts; lag and drift run vectorised over the whole batch.
        """
        _check_version("current_version", current_version)
        b = len(rollouts)
        if entries is not None and len(entries) != b:
            raise GateConfigError(f"{len(entries)} entries for {b} rollouts")
        shape = tuple(current_log_probs.shape)
        if len(shape) != 2 or shape[0] != b:
            raise GateConfigError(f"current log-probs must be {b} x T, got shape {shape}")
        t = shape[1]
        early: list[str | None] = []
        old = np.zeros((b, t), dtype=np.float64)
        mask = np.zeros((b, t), dtype=np.bool_)
        for i, ro in enumerate(rollouts):
            why = self._record_checks(ro, entries[i] if entries else None, current_version)
            early.append(why)
            if why is None:
                ev = ro.evidence
                assert ev is not None
                n = len(ev.behavior_log_probs)
                if n > t:
                    raise GateConfigError(
                        f"rollout {ro.rollout_id!r} has {n} tokens but the batch is T={t} wide"
                    )
                old[i, :n] = ev.behavior_log_probs
                mask[i, :n] = ev.action_mask
        if _is_torch(current_log_probs):
            torch = sys.modules["torch"]
            old_in: Any = torch.as_tensor(old, device=current_log_probs.device)
            mask_in: Any = torch.as_tensor(mask, device=current_log_probs.device)
        else:
            old_in, mask_in = old, mask
        versions = np.array([ro.behavior.version for ro in rollouts], dtype=np.int64)
        res = assess_arrays(
            old_in,
            current_log_probs,
            mask_in,
            versions,
            current_version,
            self.policy.max_lag,
            self.policy.max_drift,
        )
        out = []
        for i, ro in enumerate(rollouts):
            if early[i] is not None:
                out.append(self._decision(ro, current_version, early[i] or "", None, None))
            else:
                d = float(res.drift[i])
                out.append(
                    self._decision(
                        ro,
                        current_version,
                        res.reasons[i],
                        res.freshness[i],
                        None if math.isnan(d) else d,
                    )
                )
        return out
