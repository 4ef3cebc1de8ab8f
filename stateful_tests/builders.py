"""Deterministic rollouts, artifact hashes and 'current policy' log-probs for the machines.

Everything is derived from a rollout id and version numbers through sha256, so a shrunk
program replays bit for bit and the machines can predict the gate's answer on their own:
the drift between behaviour and current log-probs is DESIGNED (a per-rollout scale times the
version lag), and masked positions carry large garbage that must never count.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from rollout_lifecycle.model.records import (
    ActionEvidence,
    AdmissionStamp,
    BehaviorPolicy,
    GenerationConditions,
    LedgerEntry,
    Reward,
    Rollout,
    RolloutIdentity,
)

REWARD = Reward(function_id="exact_match", function_version="1", value=1.0)
CONDITIONS = GenerationConditions(
    tokenizer_id="tok-v1", temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8, seed=None
)
TOKENS = 6
ACTION_MASK = (False, True, True, False, True, True)
MASKED_GARBAGE = 9.0  # added at non-action positions: a gate that counts them drifts by ~3
PAD = 7.0  # right padding of a batch row, also never an action position
EVIDENCE_KINDS = ("ok", "drifty", "empty_mask", "misaligned", "missing")
# the current policy's log-prob at the first action position is NaN (a NaN loss upstream):
# both gates must refuse the row, never judge it (what the batch gate sees, not the record)
NAN_CURRENT = "nan_current"
# per-rollout drift per version of lag; none sits near the 0.2 / 0.25 bounds used
DRIFT_SCALES = (0.05, 0.1, 0.15, 0.3, 0.4)
DRIFTY_EXTRA = 1.5


def _digest(*parts: object) -> bytes:
    return hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()


def artifact_hash(version: int) -> str:
    """The true content hash of `version`'s weights (64 hex digits, as ArtifactStore gives)."""
    return hashlib.sha256(f"policy-weights-v{version}".encode()).hexdigest()


def corrupt_hash(version: int) -> str:
    """What a worker that loaded `version` corrupted reports: right version, wrong hash."""
    return hashlib.sha256(f"corrupt-load-v{version}".encode()).hexdigest()


def behaviour_log_probs(rollout_id: str, n: int = TOKENS) -> tuple[float, ...]:
    """The sampler's per-token log-probs, in [-2.1, -0.1]."""
    d = _digest("behaviour", rollout_id)
    return tuple(-0.1 - (d[t] % 100) / 50.0 for t in range(n))


def drift_scale(rollout_id: str) -> float:
    """How far this rollout's log-probs move per version of lag."""
    return DRIFT_SCALES[_digest("scale", rollout_id)[0] % len(DRIFT_SCALES)]


def designed_drift(rollout_id: str, evidence: str, lag: int) -> float:
    """D_beh by construction: 0 with the same weights, growing with |lag|."""
    base = drift_scale(rollout_id) * abs(lag)
    return base + (DRIFTY_EXTRA if evidence == "drifty" else 0.0)


def make_rollout(
    rollout_id: str, index: int, version: int, hash_: str, evidence: str = "ok"
) -> Rollout:
    """A rollout stamped with `version`/`hash_`; `evidence` picks an evidence fault, if any."""
    if evidence not in (*EVIDENCE_KINDS, NAN_CURRENT):
        raise ValueError(f"evidence kind must be one of {EVIDENCE_KINDS}, got {evidence!r}")
    ev: ActionEvidence | None
    if evidence == "missing":
        ev = None
    else:
        mask: tuple[bool, ...] = ACTION_MASK
        if evidence == "empty_mask":
            mask = (False,) * TOKENS
        elif evidence == "misaligned":
            mask = ACTION_MASK[:-1]
        ev = ActionEvidence(
            response_token_ids=tuple(range(100, 100 + TOKENS)),
            action_mask=mask,
            behavior_log_probs=behaviour_log_probs(rollout_id),
        )
    return Rollout(
        identity=RolloutIdentity(rollout_id, f"prompt-{index % 3}", "arith", index),
        behavior=BehaviorPolicy(version, hash_),
        conditions=CONDITIONS,
        evidence=ev,
    )


def current_log_probs(rollout: Rollout, current_version: int, evidence: str) -> list[float]:
    """Log-probs of the same tokens under the current policy, with the designed drift.

    Action positions move by exactly +/- the designed drift; masked positions move by
    MASKED_GARBAGE, so any gate that averages over them is visibly wrong.
    """
    ev = rollout.evidence
    if ev is None:
        return []
    lag = current_version - rollout.behavior.version
    d = designed_drift(rollout.rollout_id, evidence, lag)
    out = []
    poisoned = evidence != NAN_CURRENT
    for t, b in enumerate(ev.behavior_log_probs):
        action = t < len(ev.action_mask) and ev.action_mask[t]
        if action and not poisoned:
            out.append(math.nan)
            poisoned = True
            continue
        out.append(b + (d if t % 2 == 0 else -d) if action else b + MASKED_GARBAGE)
    return out


def current_batch(
    rollouts: list[Rollout], current_version: int, evidence: Mapping[str, str]
) -> npt.NDArray[np.float64]:
    """B x T current log-probs (right-padded with PAD) for `assess_batch`."""
    rows = [current_log_probs(r, current_version, evidence[r.rollout_id]) for r in rollouts]
    width = max((len(r) for r in rows), default=0) or 1
    out = np.full((len(rows), width), PAD, dtype=np.float64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def expected_reason(
    rollout: Rollout,
    evidence: str,
    current_version: int,
    registry: Mapping[int, str],
    max_lag: int,
    max_drift: float,
) -> str:
    """What the gate must answer for a rewarded rollout, from CONTRACT section 3 alone."""
    bv = rollout.behavior.version
    lag = current_version - bv
    if lag < 0:
        return "future_policy"
    if bv not in registry:
        return "unregistered_version"
    if registry[bv] != rollout.behavior.artifact_hash:
        return "artifact_hash_mismatch"
    if evidence == "missing":
        return "missing_evidence"
    if evidence == "misaligned":
        return "evidence_misaligned"
    if evidence == "empty_mask":
        return "empty_action_mask"
    if lag > max_lag:
        return "stale_policy"
    if designed_drift(rollout.rollout_id, evidence, lag) > max_drift:
        return "policy_drift"
    return "ok"


def fresh_stamp(version: int, max_lag: int, max_drift: float) -> AdmissionStamp:
    """An accepted admission of a same-version rollout (what the gate gives at lag 0)."""
    return AdmissionStamp(
        current_version=version,
        behavior_version=version,
        max_lag=max_lag,
        max_drift=max_drift,
        drift=0.0,
        freshness="fresh",
        reason="ok",
        accepted=True,
    )


def rewarded_entry(rollout_id: str, version: int) -> LedgerEntry:
    """A new ledger entry that is ready to reserve (state rewarded, revision 0)."""
    return LedgerEntry(
        rollout_id=rollout_id,
        behavior_version=version,
        artifact_hash=artifact_hash(version),
        state="rewarded",
        reward=REWARD,
    )
