"""Hypothesis strategies shared by the test modules (one central place, as attrs does)."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from rollout_lifecycle.model.records import (
    ActionEvidence,
    BehaviorPolicy,
    GenerationConditions,
    LedgerEntry,
    Reward,
    Rollout,
    RolloutIdentity,
)

finite_lp = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False, allow_infinity=False)
any_float = st.floats(allow_nan=True, allow_infinity=True, width=64)
versions = st.integers(min_value=0, max_value=12)
lags = st.integers(min_value=0, max_value=5)
drift_bounds = st.floats(min_value=0.0, max_value=3.0, allow_nan=False)

CONDITIONS = GenerationConditions(
    tokenizer_id="tok-v1", temperature=1.0, top_p=1.0, top_k=-1, max_tokens=64, seed=None
)


@st.composite
def batches(draw: Any, max_b: int = 6, max_t: int = 12) -> dict[str, Any]:
    """A B x T batch: behaviour and current log-probs, a bool mask, and behaviour versions."""
    b = draw(st.integers(min_value=1, max_value=max_b))
    t = draw(st.integers(min_value=1, max_value=max_t))
    old = np.array(draw(st.lists(finite_lp, min_size=b * t, max_size=b * t))).reshape(b, t)
    cur = np.array(draw(st.lists(finite_lp, min_size=b * t, max_size=b * t))).reshape(b, t)
    mask = np.array(draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))).reshape(b, t)
    bvs = np.array(draw(st.lists(versions, min_size=b, max_size=b)), dtype=np.int64)
    return {"old": old, "cur": cur, "mask": mask, "bvs": bvs}


def make_rollout(
    rid: str,
    version: int,
    log_probs: list[float],
    mask: list[bool],
    *,
    artifact_hash: str | None = None,
    state: str = "rewarded",
    conditions: GenerationConditions = CONDITIONS,
) -> Rollout:
    """A rollout in `state` with aligned evidence, stamped with `version`."""
    h = artifact_hash or f"hash-v{version}"
    reward = Reward("rm", "1", 1.0) if state in ("rewarded", "reserved", "consumed") else None
    status = LedgerEntry(
        rollout_id=rid,
        behavior_version=version,
        artifact_hash=h,
        state=state,
        revision=2,
        reward=reward,
        reserved_by="u0" if state == "reserved" else None,
    )
    return Rollout(
        identity=RolloutIdentity(
            rollout_id=rid, prompt_id=f"p-{rid}", dataset="gsm8k", sample_index=0
        ),
        behavior=BehaviorPolicy(version=version, artifact_hash=h),
        conditions=conditions,
        evidence=ActionEvidence(
            response_token_ids=list(range(len(log_probs))),
            action_mask=mask,
            behavior_log_probs=log_probs,
        ),
        status=status,
    )
