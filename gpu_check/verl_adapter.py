"""The piece to embed in a verl training step: the project's gate over a verl batch.

    from rollout_lifecycle.gpu_check.verl_adapter import admission_mask

    # in the trainer step, after old_log_probs were recomputed by the actor
    # (RayPPOTrainer._compute_old_log_prob) and before advantages / update_actor:
    decision = admission_mask(batch, current_version=trainer_version, max_lag=1, max_drift=0.2)
    batch.batch["response_mask"] = decision.masked(batch.batch["response_mask"])
    metrics.update(decision.metrics())

`batch` is a verl `DataProto` (or a `TensorDict`, or a plain mapping) holding, per sample:
`response_mask` (B x T, verl's int 0/1 mask), the behaviour log-probs the rollout engine
returned (`rollout_log_probs`, present when `actor_rollout_ref.rollout.calculate_log_probs=
True`), the trainer's recomputed `old_log_probs`, and the versions verl's agent loop records
(`min_global_steps` / `max_global_steps`, object arrays in `non_tensor_batch`). A rollout
whose tokens span several versions (a partial rollout resumed across a weight sync) is
judged by its OLDEST version, `min_global_steps`: its lag is the worst of its tokens'.

The decision is `model.gate.assess_arrays`, the same vectorised lag-AND-drift core the
project's gate uses everywhere: the reduction runs where the tensors live (only B numbers
come back to the host), no Python loop touches a token, and the keep-mask is returned on
the batch's device. A sample with no recorded version is never admitted.

How it differs from verl's own `algorithm.rollout_correction.rollout_rs` options: verl's
`seq_mean_k1` bounds the SIGNED mean of log(pi_train/pi_rollout) over a sequence, so
per-token errors of opposite sign cancel and a sequence whose tokens each moved a lot can
still pass; this gate bounds the mean ABSOLUTE log-ratio (CONTRACT section 3), where they
cannot, and it also enforces the version lag, which no `rollout_rs` option looks at.
Measured figures are in docs/gpu-check.md (benchmarks/verl_drift_gate.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from rollout_lifecycle.gpu_check.errors import GpuCheckError
from rollout_lifecycle.model.gate import assess_arrays

MISSING_VERSION = "missing_version"


class AdapterInputError(GpuCheckError, ValueError):
    """A verl batch the adapter cannot judge (a missing key, inconsistent versions)."""


@attrs.frozen(eq=False)
class AdmissionMask:
    """The gate's decisions for a verl batch: keep-mask (on the batch's device) and reasons."""

    keep: Any  # torch.bool tensor on the batch's device, or a numpy bool array
    reasons: tuple[str, ...]
    drift: npt.NDArray[np.float64]  # mean |log-ratio| per sample (NaN: no action token)
    lag: npt.NDArray[np.int64]  # current_version - min_global_steps
    freshness: tuple[str | None, ...]
    oldest_version: npt.NDArray[np.int64]  # -1 where none was recorded
    newest_version: npt.NDArray[np.int64] | None

    def __len__(self) -> int:
        return len(self.reasons)

    @property
    def kept(self) -> int:
        """How many samples the update may use."""
        return sum(r == "ok" for r in self.reasons)

    def counts(self) -> dict[str, int]:
        """Samples per reason."""
        return dict(Counter(self.reasons))

    def masked(self, response_mask: Any) -> Any:
        """`response_mask` with every rejected sample's row set to 0 (same dtype and device)."""
        keep = self.keep
        if hasattr(response_mask, "device") and hasattr(keep, "to"):
            keep = keep.to(response_mask.device)
            return response_mask * keep[:, None].to(response_mask.dtype)
        arr = np.asarray(response_mask)
        return arr * np.asarray(keep)[:, None].astype(arr.dtype)

    def metrics(self, prefix: str = "rollout_lifecycle/") -> dict[str, float]:
        """Scalars to log beside verl's own metrics."""
        n = max(len(self), 1)
        out: dict[str, float] = {f"{prefix}kept_fraction": self.kept / n}
        for reason, count in self.counts().items():
            if reason != "ok":
                out[f"{prefix}rejected/{reason}"] = float(count)
        finite = self.drift[np.isfinite(self.drift)]
        if finite.size:
            out[f"{prefix}drift_mean"] = float(finite.mean())
            out[f"{prefix}drift_max"] = float(finite.max())
        known = self.lag[self.oldest_version >= 0]
        if known.size:
            out[f"{prefix}lag_max"] = float(known.max())
        if self.newest_version is not None:
            span = (self.newest_version - self.oldest_version)[self.oldest_version >= 0]
            if span.size:
                out[f"{prefix}partial_fraction"] = float((span > 0).mean())
        return out


def _parts(batch: Any) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """(tensors, per-sample non-tensors) of a DataProto, TensorDict or plain mapping."""
    if hasattr(batch, "batch") and hasattr(batch, "non_tensor_batch"):  # verl DataProto
        return batch.batch, batch.non_tensor_batch
    return batch, batch


def _get(source: Mapping[str, Any], key: str, hint: str) -> Any:
    try:
        keys = source.keys()
        present = key in keys
    except (AttributeError, TypeError):
        present = False
    if not present:
        raise AdapterInputError(f"the batch has no {key!r}; {hint}")
    return source[key]


def _versions(value: Any, b: int, key: str) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Per-sample versions as int64 (-1 where missing) and a mask of the missing ones."""
    if hasattr(value, "tolist") and not isinstance(value, np.ndarray):
        value = value.tolist()  # torch tensor or tensordict NonTensorStack
    items = list(np.asarray(value, dtype=object).reshape(-1))
    if len(items) != b:
        raise AdapterInputError(f"{key!r} has {len(items)} entries for {b} samples")
    out = np.full(b, -1, dtype=np.int64)
    missing = np.zeros(b, dtype=np.bool_)
    for i, v in enumerate(items):  # B entries, never tokens
        if v is None:
            missing[i] = True
            continue
        if isinstance(v, bool | np.bool_) or not isinstance(v, int | np.integer) or v < 0:
            raise AdapterInputError(f"{key!r}[{i}] must be a non-negative int or None, got {v!r}")
        out[i] = int(v)
    return out, missing


def judged_versions(
    oldest: npt.NDArray[np.int64], newest: npt.NDArray[np.int64] | None
) -> npt.NDArray[np.int64]:
    """The version each sample is judged by: its OLDEST (a partial rollout resumed across a
    weight sync is as stale as its stalest token), never the newest it saw."""
    return oldest


def refuse_unversioned(
    accepted: npt.NDArray[np.bool_], missing: npt.NDArray[np.bool_]
) -> npt.NDArray[np.bool_]:
    """A sample with no recorded version is never kept, whatever its figures say."""
    return accepted & ~missing


def admission_mask(
    batch: Any,
    *,
    current_version: int,
    max_lag: int,
    max_drift: float,
    behavior_key: str = "rollout_log_probs",
    current_key: str = "old_log_probs",
    mask_key: str = "response_mask",
    oldest_key: str = "min_global_steps",
    newest_key: str = "max_global_steps",
) -> AdmissionMask:
    """Admit each sample of a verl batch by version lag AND behaviour drift.

    Raises AdapterInputError naming a missing key or inconsistent versions, and the
    gate's GateConfigError for bad bounds, shapes or non-finite log-probs at action tokens.
    """
    tensors, extras = _parts(batch)
    behaviour = _get(
        tensors,
        behavior_key,
        "the rollout engine's log-probs are needed: set "
        "actor_rollout_ref.rollout.calculate_log_probs=True",
    )
    current = _get(tensors, current_key, "recompute them with the actor first (compute_log_prob)")
    mask = _get(tensors, mask_key, "verl puts the response mask there")
    b = int(mask.shape[0])
    oldest, missing = _versions(
        _get(extras, oldest_key, "verl's agent loop records it per sample (non_tensor_batch)"),
        b,
        oldest_key,
    )
    newest: npt.NDArray[np.int64] | None = None
    try:
        raw_newest = extras[newest_key]
    except (KeyError, TypeError):
        raw_newest = None
    if raw_newest is not None:
        newest, missing_new = _versions(raw_newest, b, newest_key)
        bad = ~missing & ~missing_new & (newest < oldest)
        if bad.any():
            rows = np.flatnonzero(bad).tolist()[:5]
            raise AdapterInputError(f"{newest_key} < {oldest_key} in rows {rows}")
    # a sample without a version is judged as if current, then refused on its own reason
    res = assess_arrays(
        behaviour,
        current,
        mask,
        np.where(missing, current_version, judged_versions(oldest, newest)),
        current_version,
        max_lag,
        max_drift,
    )
    reasons = tuple(MISSING_VERSION if missing[i] else r for i, r in enumerate(res.reasons))
    accepted = refuse_unversioned(res.accepted, missing)
    keep: Any = accepted
    if hasattr(mask, "device") and type(mask).__module__.split(".")[0] == "torch":
        import torch

        keep = torch.as_tensor(accepted, device=mask.device)
    return AdmissionMask(
        keep=keep,
        reasons=reasons,
        drift=res.drift,
        lag=res.lag,
        freshness=tuple(None if missing[i] else f for i, f in enumerate(res.freshness)),
        oldest_version=oldest,
        newest_version=newest,
    )
