"""The verl adapter on real verl batches: DataProto and TensorDict, numpy and torch, int masks."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from rollout_lifecycle.gpu_check.extra import INSTALL_HINT, missing_modules

pytestmark = pytest.mark.skipif(
    bool(missing_modules()),
    reason=f"the [verl] extra is not installed ({', '.join(missing_modules())}): {INSTALL_HINT}",
)

if not missing_modules():
    import torch
    from verl import DataProto
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    from rollout_lifecycle.gpu_check.verl_adapter import (
        MISSING_VERSION,
        AdapterInputError,
        admission_mask,
    )
    from rollout_lifecycle.model.api import assess_policy_compatibility
    from rollout_lifecycle.model.errors import GateConfigError

B, T = 6, 8
CURRENT = 5


def _tensors(mask_dtype: Any = None) -> dict[str, Any]:
    """Six samples: ok, drift, stale, future, empty mask, partial rollout (judged by oldest)."""
    g = torch.Generator().manual_seed(7)
    behaviour = -torch.rand(B, T, generator=g) * 3
    current = behaviour + 0.01
    current[1] += 0.5  # drift 0.51 > 0.2
    mask = torch.ones(B, T, dtype=torch.int64 if mask_dtype is None else mask_dtype)
    mask[0, 5:] = 0
    mask[4] = 0  # no action token
    behaviour[0, 6] = float("nan")  # masked positions never matter
    return {
        "rollout_log_probs": behaviour,
        "old_log_probs": current,
        "response_mask": mask,
        "responses": torch.zeros(B, T, dtype=torch.long),
    }


MIN = [5, 5, 2, 6, 5, 3]  # row 5 spans versions 3..5: its oldest (3) makes it stale
MAX = [5, 5, 2, 6, 5, 5]
EXPECTED = (
    "ok",
    "policy_drift",
    "stale_policy",
    "future_policy",
    "empty_action_mask",
    "stale_policy",
)


def _dataproto(mask_dtype: Any = None) -> DataProto:
    return DataProto.from_dict(
        tensors=_tensors(mask_dtype),
        non_tensors={
            "min_global_steps": np.array(MIN, dtype=object),
            "max_global_steps": np.array(MAX, dtype=object),
        },
    )


def test_dataproto_decisions_match_the_contract_function() -> None:
    """Each row's reason and drift equal assess_policy_compatibility on that row alone."""
    batch = _dataproto()
    d = admission_mask(batch, current_version=CURRENT, max_lag=1, max_drift=0.2)
    assert d.reasons == EXPECTED
    assert d.keep.dtype == torch.bool and d.keep.tolist() == [True] + [False] * 5
    t = batch.batch
    for i in range(B):
        m = t["response_mask"][i].bool().tolist()
        ref = assess_policy_compatibility(
            t["rollout_log_probs"][i].tolist(),
            t["old_log_probs"][i].tolist(),
            m,
            MIN[i],
            CURRENT,
            1,
            0.2,
        )
        assert ref["reason"] == d.reasons[i]
        if ref["mean_abs_log_ratio"] is None:
            assert math.isnan(d.drift[i])
        else:
            assert d.drift[i] == pytest.approx(ref["mean_abs_log_ratio"], abs=1e-6)
    assert d.kept == 1 and d.counts()["stale_policy"] == 2


def test_tensordict_batch_gives_the_same_decisions() -> None:
    """verl's TensorDict form (versions as a NonTensorStack) is judged the same way."""
    batch = _dataproto()
    td = batch.to_tensordict()
    a = admission_mask(batch, current_version=CURRENT, max_lag=1, max_drift=0.2)
    b = admission_mask(td, current_version=CURRENT, max_lag=1, max_drift=0.2)
    assert a.reasons == b.reasons and torch.equal(a.keep, b.keep)
    np.testing.assert_array_equal(a.drift, b.drift)


@pytest.mark.parametrize("mask_dtype", ["int64", "int32", "bool"])
def test_int_and_bool_response_masks(mask_dtype: str) -> None:
    """verl's int masks (int64 or int32) and bool masks give the same decisions."""
    d = admission_mask(
        _dataproto(getattr(torch, mask_dtype)), current_version=CURRENT, max_lag=1, max_drift=0.2
    )
    assert d.reasons == EXPECTED


def test_numpy_arrays_in_a_plain_mapping() -> None:
    """numpy log-probs and an int32 mask: a numpy keep-mask comes back."""
    t = {k: v.numpy() for k, v in _tensors().items()}
    t["response_mask"] = t["response_mask"].astype(np.int32)
    d = admission_mask(
        {**t, "min_global_steps": np.array(MIN), "max_global_steps": MAX},
        current_version=CURRENT,
        max_lag=1,
        max_drift=0.2,
    )
    assert isinstance(d.keep, np.ndarray) and d.keep.tolist() == [True] + [False] * 5
    assert d.reasons == EXPECTED
    masked = d.masked(t["response_mask"])
    assert masked.dtype == np.int32 and masked[1:].sum() == 0 and masked[0].sum() == 5


def test_partial_rollouts_are_judged_by_their_oldest_version() -> None:
    """A rollout spanning v3..v5 is stale at L_max 1 but tolerated at L_max 2 (lag 2)."""
    batch = _dataproto()
    strict = admission_mask(batch, current_version=CURRENT, max_lag=1, max_drift=0.2)
    loose = admission_mask(batch, current_version=CURRENT, max_lag=2, max_drift=0.2)
    assert strict.reasons[5] == "stale_policy" and loose.reasons[5] == "ok"
    assert strict.lag[5] == 2 and loose.freshness[5] == "tolerated"
    assert strict.metrics()["rollout_lifecycle/partial_fraction"] == pytest.approx(1 / 6)


def test_masked_zeroes_rejected_rows_on_the_same_device_and_dtype() -> None:
    """The keep-mask applied to response_mask keeps verl's int dtype and the device."""
    batch = _dataproto()
    d = admission_mask(batch, current_version=CURRENT, max_lag=1, max_drift=0.2)
    rm = batch.batch["response_mask"]
    out = d.masked(rm)
    assert out.dtype == rm.dtype and out.device == rm.device == d.keep.device
    assert out[0].tolist() == rm[0].tolist() and int(out[1:].sum()) == 0


def test_a_sample_without_a_version_is_never_admitted() -> None:
    """A None in min_global_steps is its own rejection; its tokens are still not looked at."""
    batch = _dataproto()
    versions = np.array(MIN, dtype=object)
    versions[0] = None
    batch.non_tensor_batch["min_global_steps"] = versions
    d = admission_mask(batch, current_version=CURRENT, max_lag=1, max_drift=0.2)
    assert d.reasons[0] == MISSING_VERSION and not bool(d.keep[0])


def test_inconsistent_or_missing_inputs_are_named() -> None:
    """Missing rollout log-probs say how to get them; max < min versions are refused."""
    batch = _dataproto()
    no_lp = DataProto.from_dict(
        tensors={k: v for k, v in batch.batch.items() if k != "rollout_log_probs"},
        non_tensors=dict(batch.non_tensor_batch),
    )
    with pytest.raises(AdapterInputError, match="calculate_log_probs=True"):
        admission_mask(no_lp, current_version=CURRENT, max_lag=1, max_drift=0.2)
    bad = _dataproto()
    bad.non_tensor_batch["max_global_steps"] = np.array([4, 5, 2, 6, 5, 5], dtype=object)
    with pytest.raises(AdapterInputError, match="max_global_steps < min_global_steps"):
        admission_mask(bad, current_version=CURRENT, max_lag=1, max_drift=0.2)


def test_non_finite_log_prob_at_an_action_token_is_an_error() -> None:
    """NaN where the mask is 1 raises the gate's error naming the row."""
    batch = _dataproto()
    batch.batch["old_log_probs"][2, 0] = float("inf")
    with pytest.raises(GateConfigError, match=r"row\(s\) \[2\]"):
        admission_mask(batch, current_version=CURRENT, max_lag=1, max_drift=0.2)


def test_signed_mean_lets_noise_cancel_where_the_absolute_mean_does_not() -> None:
    """verl's seq_mean_k1 at the same bound keeps a row of +-0.5 log-ratios; the gate rejects it."""
    t = 64
    behaviour = torch.full((2, t), -2.0)
    current = behaviour.clone()
    current[0, 0::2] += 0.5
    current[0, 1::2] -= 0.5  # per token |log-ratio| 0.5, signed mean 0
    current[1] += 0.01
    mask = torch.ones(2, t, dtype=torch.int64)
    bound = 0.2
    verl_mask, _ = compute_rollout_rejection_mask(
        current - behaviour,
        mask,
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold=f"{math.exp(-bound)}_{math.exp(bound)}",
    )
    verl_kept = (verl_mask.sum(-1) > 0).tolist()
    ours = admission_mask(
        {
            "rollout_log_probs": behaviour,
            "old_log_probs": current,
            "response_mask": mask,
            "min_global_steps": [3, 3],
        },
        current_version=3,
        max_lag=0,
        max_drift=bound,
    )
    assert verl_kept == [True, True]
    assert ours.keep.tolist() == [False, True] and ours.reasons[0] == "policy_drift"
    assert ours.drift[0] == pytest.approx(0.5)
