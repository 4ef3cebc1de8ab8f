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

import bisect
import collections
import concurrent.futures
import functools
import itertools
import math
import operator
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast, overload

import attrs
import numpy as np
import numpy.typing as npt

from rollout_lifecycle.model.errors import GateConfigError, RolloutLifecycleError, brief
from rollout_lifecycle.model.records import (
    ActionEvidence,
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
        raise GateConfigError(
            f"{name} must be a non-negative int (bool is not an int), got {brief(v)}"
        )
    return v


_REAL = (int, float, np.integer, np.floating)


def _log_prob(v: Any, which: str, i: int) -> float:
    """One log-prob of the plain-Python path: a real number (never a bool, a string, a
    container or a complex), as a float; an int too large for a float is refused."""
    if isinstance(v, bool | np.bool_) or not isinstance(v, _REAL):
        raise GateConfigError(f"{which}_log_probs[{i}] must be a number, got {brief(v)}")
    try:
        return float(v)
    except OverflowError:
        raise GateConfigError(f"{which}_log_probs[{i}] is too large: {brief(v)}") from None


def check_bounds(max_lag: Any, max_drift: Any) -> tuple[int, float]:
    """Validate L_max (int >= 0) and D_max (finite, >= 0)."""
    if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0:
        raise GateConfigError(f"max_lag must be an int >= 0, got {brief(max_lag)}")
    if isinstance(max_drift, bool) or not isinstance(max_drift, int | float):
        raise GateConfigError(f"max drift must be a number, got {brief(max_drift)}")
    try:
        finite = math.isfinite(max_drift)
    except OverflowError:
        finite = False
    if not finite or max_drift < 0:
        raise GateConfigError(f"max drift must be finite and >= 0, got {brief(max_drift)}")
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
            raise GateConfigError(f"action_mask[{i}] must be a boolean, got {brief(m)}")
        if not m:
            continue
        fo, fc = _log_prob(o, "old", i), _log_prob(c, "current", i)
        if not (math.isfinite(fo) and math.isfinite(fc)):
            raise GateConfigError(
                f"non-finite log-prob at action position {i} (old {brief(fo)}, current {brief(fc)})"
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
# Per-row results of the batch core
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


# --------------------------------------------------------------------------------------------
# Vectorised batch core (numpy, or torch without importing it)
# --------------------------------------------------------------------------------------------
#
# Σ_t m_t |cur_t - old_t| and Σ_t m_t per row, in ONE pass over cache-sized blocks of rows,
# never a full-size temporary. Per block:
#   d = cur - old        in the compute dtype: float64 when either input is float64, else
#                        float32 (float16 / bfloat16 inputs widen exactly). The records path
#                        lays each block's rows out from the records' stored arrays by
#                        one C-level call per field (`_block_rows`), then subtracts.
#   bits(d) *= m         an integer multiply of d's bit pattern by the 0/1 mask: a masked
#                        position becomes +0.0 whatever it held, NaN and inf included (a float
#                        multiply would keep them: NaN * 0 = NaN; a select is branchy and
#                        several times slower)
#   d = |d|, row sums    summed in float64
#   counts               bools counted 8 (numpy: popcount) or 64 (torch: byte sums) at a time
# A NaN or inf at an action position makes its row's sum non-finite, so detecting it costs no
# extra pass: only rows whose sum is not finite are looked at again, exactly, to tell a real
# NaN/inf (an error naming the rows) from finite float32 values whose difference overflowed
# (that row is then recomputed in float64, as the plain-Python reference computes it).
#
# Precision: float64 inputs are computed in float64 throughout, like the reference (up to the
# order of summation). float32 inputs round cur - old to float32 (relative error <= 2^-24 per
# token, and none when the two are within a factor of 2 of each other: the data's own
# precision), add 256 tokens at a time in float32 and those partial sums in float64: the
# measured relative error is a few 1e-8.

_CPU_BLOCK = 1 << 16  # elements per numpy block: ~0.25 MiB of float32 scratch, inside L2
_TORCH_CPU_BLOCK = 1 << 17  # torch's per-call overhead is higher: somewhat larger blocks
_PARTIAL = 256  # float32: tokens per float32 partial sum, then the partials summed in float64
_BYTES_SUM = 0x0101010101010101  # (x * this) >> 56: the sum of x's 8 bytes (each small)
_POPCOUNT = getattr(np, "bitwise_count", None)  # numpy >= 2

# diff_into(r0, r1, c0, c1, d, m): write cur - old of that block into d and return its mask
# (numpy: `m` is bool scratch of the block's shape that it may fill and return)
DiffInto = Callable[..., Any]
# elements: below this, a second thread's share is too short to outlast scheduling noise
_THREADS_FROM = 1 << 22
# bfloat16 / float16 cost several times more per element (widening), and torch's bare
# expression on them already runs its threads from about this size: split them sooner
_HALF_THREADS_FROM = 1 << 17
_MASK_DTYPE_MSG = "action mask must be bool or 0/1 integers, got {}"
_MASK_VALUES_MSG = "integer action mask must hold only 0 and 1"


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _to_host(x: Any) -> npt.NDArray[Any]:
    """A small (B-sized) result to numpy; torch tensors leave the device only here."""
    if _is_torch(x):
        return np.asarray(x.detach().cpu().numpy())
    return np.asarray(x)


def _tiles(b: int, t: int, block: int) -> tuple[int, int]:
    """(rows, columns) per block: whole rows when a row fits, else column chunks of one row."""
    if t <= block:
        return max(1, min(b, block // max(t, 1))), max(t, 1)
    return 1, block


def _np_sums(
    diff_into: DiffInto,
    b: int,
    t: int,
    dtype: np.dtype[Any],
    int_mask: bool,
    threads: int = 1,
    block: int | None = None,
    threads_from: int | None = None,
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """Masked |cur - old| row sums and action counts, block by block (numpy).

    With `threads` > 1 (torch tensors on the CPU from _SPLIT_FROM_THREADS torch threads:
    as many as torch's own intra-op threads, on the array and the records paths) that
    many threads, each with its own scratch, claim ranges of blocks in turn (a few per
    thread) until none is left; numpy releases the GIL inside every call. A thread the
    scheduler parks on a busy machine so delays the call by one range, not by its whole
    share, as a static split would (torch's per-op barrier is what this avoids).
    """
    block = _CPU_BLOCK if block is None else block
    rows, _ = _tiles(b, t, block)
    sums = np.zeros(b, np.float64)
    counts = np.zeros(b, np.int64)
    blocks = -(-b // rows)
    threads = max(1, min(threads, blocks))
    if threads == 1 or b * t < min(_THREADS_FROM, threads_from or _THREADS_FROM):
        _np_range(diff_into, _claims([(0, b)]), t, dtype, int_mask, sums, counts, block)
        return sums, counts
    per = -(-blocks // (threads * _RANGES_PER_THREAD)) * rows
    claim = _claims([(lo, min(b, lo + per)) for lo in range(0, b, per)])
    pool = _pool(threads - 1)
    futures = [
        pool.submit(_np_range, diff_into, claim, t, dtype, int_mask, sums, counts, block)
        for _ in range(threads - 1)
    ]
    try:
        _np_range(diff_into, claim, t, dtype, int_mask, sums, counts, block)
    finally:
        for f in futures:
            f.result()
    return sums, counts


_RANGES_PER_THREAD = 4
Claim = Callable[[], "tuple[int, int] | None"]


def _claims(ranges: list[tuple[int, int]]) -> Claim:
    """The next unclaimed (lo, hi) row range, or None; safe to call from any thread."""
    it = iter(ranges)
    lock = threading.Lock()

    def claim() -> tuple[int, int] | None:
        with lock:
            return next(it, None)

    return claim


_POOLS: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """A process-wide pool of `workers` threads, kept between calls (one per size, never
    shut down while another call may use it): starting threads per call costs more than
    the kernel on a few hundred thousand elements."""
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = concurrent.futures.ThreadPoolExecutor(workers, "rl-gate")
        return pool


def _np_range(
    diff_into: DiffInto,
    claim: Claim,
    t: int,
    dtype: np.dtype[Any],
    int_mask: bool,
    sums: npt.NDArray[np.float64],
    counts: npt.NDArray[np.int64],
    block: int,
) -> None:
    """The row ranges this thread claims, each written into its slices of `sums` and
    `counts` (ranges are whole multiples of the block's rows, so every thread cuts the
    same blocks)."""
    got = claim()
    if got is None:
        return
    rows, cols = _tiles(sums.shape[0], t, block)
    narrow = dtype.itemsize == 4
    word_t = np.int32 if narrow else np.int64
    d = np.empty((rows, cols), dtype)
    mask_scratch = np.zeros((rows, cols), np.bool_)
    part = np.empty((rows, max(1, cols // _PARTIAL)), dtype)
    more_s = np.empty(rows, np.float64)
    more_c = np.empty(rows, np.int64)
    popcount = getattr(np, "bitwise_count", None)  # numpy >= 2
    with np.errstate(invalid="ignore", over="ignore"):
        while got is not None:
            lo, hi = got
            for r0 in range(lo, hi, rows):
                r1 = min(hi, r0 + rows)
                n = r1 - r0
                for c0 in range(0, t, cols):
                    c1 = min(t, c0 + cols)
                    k = c1 - c0
                    dd = d[:n, :k]
                    m = diff_into(r0, r1, c0, c1, dd, mask_scratch[:n, :k])
                    if int_mask and m.size and m.view(f"u{m.itemsize}").max() > 1:
                        raise GateConfigError(_MASK_VALUES_MSG)
                    bits = dd.view(word_t)
                    np.multiply(bits, m, out=bits, casting="unsafe")
                    np.abs(dd, out=dd)
                    s_out = sums[r0:r1] if c0 == 0 else more_s[:n]
                    c_out = counts[r0:r1] if c0 == 0 else more_c[:n]
                    if narrow and k % _PARTIAL == 0:
                        p = part[:n, : k // _PARTIAL]
                        # einsum's plain sum loop is about twice numpy's reduction over a short
                        # inner axis, and single-threaded (BLAS would start threads)
                        np.einsum("ij->i", dd.reshape(-1, _PARTIAL), out=p.reshape(-1))
                        np.add.reduce(p, axis=1, dtype=np.float64, out=s_out)
                    else:
                        np.add.reduce(dd, axis=1, dtype=np.float64, out=s_out)
                    if int_mask:
                        np.add.reduce(m, axis=1, dtype=np.int64, out=c_out)
                    elif popcount is not None and k % 8 == 0 and m.strides[-1] == 1:
                        # a bool is one byte, 0 or 1: the set bits of 8 packed bools count them
                        np.add.reduce(
                            popcount(m.view(np.uint64)), axis=1, dtype=np.int64, out=c_out
                        )
                    else:
                        c_out[...] = np.count_nonzero(m, axis=1)
                    if c0:
                        sums[r0:r1] += s_out
                        counts[r0:r1] += c_out
            got = claim()


def _torch_counts(torch: Any, m: Any, n: int, k: int) -> Any:
    """Action positions per row of a block; bool masks 64 at a time through int64 words."""
    if (
        m.dtype == torch.bool
        and k % 64 == 0
        and m.stride(-1) == 1
        and m.stride(0) % 8 == 0
        and m.storage_offset() % 8 == 0
    ):
        words = m.view(torch.int64).view(n, k // 64, 8).sum(-1)  # each byte <= 8: no carries
        return ((words * _BYTES_SUM) >> 56).sum(1)  # top byte: the sum of 8 bytes, <= 64
    return torch.count_nonzero(m, dim=1)


def _torch_block(torch: Any, device: Any, b: int, t: int) -> tuple[int, int]:
    if device.type == "cpu":
        return _tiles(b, t, _TORCH_CPU_BLOCK)
    # an accelerator: few, large launches; the scratch stays under 1/8 of the inputs
    return _tiles(b, t, max(t, (b * t) // 8))


def _torch_sums(
    torch: Any,
    diff_into: DiffInto,
    b: int,
    t: int,
    d: Any,
    int_mask: bool,
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """The same pass with torch ops, where the tensors live; only B numbers come back.

    `d` is the (rows, cols) scratch in the compute dtype on the tensors' device.
    """
    rows, cols = d.shape
    narrow = d.dtype != torch.float64
    word_t = torch.int32 if narrow else torch.int64
    # accumulate in float64 where the device has it (Apple's MPS does not)
    acc = torch.float32 if d.device.type == "mps" else torch.float64
    sums = torch.zeros(b, dtype=acc, device=d.device)
    counts = torch.zeros(b, dtype=torch.int64, device=d.device)
    extremes: list[Any] = []
    for r0 in range(0, b, rows):
        r1 = min(b, r0 + rows)
        n = r1 - r0
        for c0 in range(0, t, cols):
            c1 = min(t, c0 + cols)
            k = c1 - c0
            dd = d[:n, :k]
            m = diff_into(r0, r1, c0, c1, dd)
            if int_mask:
                extremes.append(torch.aminmax(m))
            dd.view(word_t).mul_(m)
            dd.abs_()
            if narrow and k % _PARTIAL == 0 and dd.is_contiguous():
                s = torch.sum(dd.view(n, k // _PARTIAL, _PARTIAL).sum(-1), 1, dtype=acc)
            else:
                s = torch.sum(dd, dim=1, dtype=acc)
            sums[r0:r1] += s
            counts[r0:r1] += _torch_counts(torch, m, n, k)
    if extremes:  # one synchronisation for the whole mask
        lo = torch.stack([e[0] for e in extremes]).min()
        hi = torch.stack([e[1] for e in extremes]).max()
        if int(lo) < 0 or int(hi) > 1:
            raise GateConfigError(_MASK_VALUES_MSG)
    return _to_host(sums).astype(np.float64), _to_host(counts).astype(np.int64)


def _nonfinite_message(rows: Sequence[int], ids: Sequence[str] | None = None) -> str:
    shown = list(rows[:10])
    more = " ..." if len(rows) > 10 else ""
    msg = f"non-finite log-prob at an action position in row(s) {shown}{more}"
    if ids is not None:
        msg += f" (rollouts {[ids[i] for i in shown]}{more})"
    return msg


ExactRows = Callable[[npt.NDArray[np.intp]], tuple[Any, Any]]


def _recheck(
    sums: npt.NDArray[np.float64], exact_rows: ExactRows, ids: Sequence[str] | None = None
) -> None:
    """Rows whose sum is not finite: raise on a real NaN/inf at an action position, else
    replace the float32 overflow by the exact float64 sum."""
    rows = np.flatnonzero(~np.isfinite(sums))
    if rows.size == 0:
        return
    bad, exact = exact_rows(rows)
    bad = _to_host(bad).astype(bool)
    if bad.any():
        raise GateConfigError(_nonfinite_message(rows[bad].tolist(), ids))
    sums[rows] = _to_host(exact).astype(np.float64)


def _np_exact_rows(old: Any, cur: Any, mask: Any) -> ExactRows:
    def exact(rows: npt.NDArray[np.intp]) -> tuple[Any, Any]:
        o = np.asarray(old[rows], dtype=np.float64)
        c = np.asarray(cur[rows], dtype=np.float64)
        m = np.asarray(mask[rows]) != 0
        with np.errstate(invalid="ignore", over="ignore"):
            bad = (m & ~(np.isfinite(o) & np.isfinite(c))).any(axis=1)
            total = np.where(m, np.abs(c - o), 0.0).sum(axis=1)
        return bad, total

    return exact


def _torch_exact_rows(torch: Any, old: Any, cur: Any, mask: Any) -> ExactRows:
    def exact(rows: npt.NDArray[np.intp]) -> tuple[Any, Any]:
        idx = torch.as_tensor(rows, device=old.device)
        o = old.index_select(0, idx).double()
        c = cur.index_select(0, idx).double()
        m = mask.index_select(0, idx) != 0
        bad = (m & ~(torch.isfinite(o) & torch.isfinite(c))).any(dim=1)
        total = torch.where(m, (c - o).abs(), torch.zeros_like(o)).sum(dim=1)
        return bad, total

    return exact


_REASON_CODES = ("empty_action_mask", "future_policy", "stale_policy", "policy_drift", "ok")
_FRESHNESS_CODES: tuple[str | None, ...] = (None, "future", "fresh", "tolerated", "stale")


_REASON_NAMES = np.array(_REASON_CODES, dtype=object)
_FRESHNESS_NAMES = np.array(_FRESHNESS_CODES, dtype=object)


def _freshness_codes(lag: npt.NDArray[np.int64], max_lag: int) -> npt.NDArray[np.intp]:
    """classify_lag over a vector: 1 future, 2 fresh, 3 tolerated, 4 stale.

    Counted, not selected: each class adds one past the last (max_lag >= 0 makes them
    nested), a few times cheaper than np.select at B in the thousands."""
    code = (lag >= 0).astype(np.intp)
    code += lag > 0
    code += lag > max_lag
    code += 1
    return code


def _decide(
    sums: npt.NDArray[np.float64],
    counts: npt.NDArray[np.int64],
    behavior_versions: Any,
    cv: int,
    max_lag: int,
    max_drift: float,
) -> BatchAssessment:
    """Per-row decisions from the sums, in the contract's order; vectorised over B."""
    try:
        bv = _to_host(behavior_versions)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        # numpy refuses e.g. a list nested deeper than 64 levels or ragged nesting
        raise GateConfigError(
            f"behavior_versions must be a vector of B non-negative integers: {exc}"
        ) from None
    if bv.ndim != 1 or bv.shape[0] != sums.shape[0]:
        raise GateConfigError(
            f"behavior_versions must be a vector of length B={sums.shape[0]}, got shape {bv.shape}"
        )
    if bv.dtype == np.bool_ or not np.issubdtype(bv.dtype, np.integer) or (bv < 0).any():
        raise GateConfigError("behavior_versions must be non-negative integers")
    lag = (cv - bv.astype(np.int64)).astype(np.int64)
    empty = counts == 0
    with np.errstate(invalid="ignore", divide="ignore"):
        drift = np.where(empty, np.nan, sums / np.maximum(counts, 1))
    fresh = _freshness_codes(lag, max_lag)
    fresh[empty] = 0
    # the contract's order: the first that holds of empty, future, stale, drift wins
    reason = np.full(lag.shape, 4, np.intp)
    reason[drift > max_drift] = 3
    reason[lag > max_lag] = 2
    reason[lag < 0] = 1
    reason[empty] = 0
    return BatchAssessment(
        accepted=reason == 4,
        reasons=tuple(_REASON_NAMES[reason].tolist()),
        freshness=tuple(_FRESHNESS_NAMES[fresh].tolist()),
        drift=drift.astype(np.float64),
        lag=lag,
    )


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
    with tensors the reduction runs where they live and only B numbers come back. The mask
    is bool, or integers that are all 0 or 1 (verl's response_mask). Values at masked
    positions never matter, even NaN or inf. Non-finite values at action positions raise
    GateConfigError naming the rows. One pass over cache-sized blocks: no full-size
    temporaries, and scratch of a few hundred KiB (numpy) or under 1/8 of the inputs.
    """
    cv = _check_version("current_version", current_version)
    max_lag, max_drift = check_bounds(max_lag, max_drift)
    if _is_torch(old_log_probs) or _is_torch(current_log_probs) or _is_torch(action_mask):
        sums, counts = _torch_array_sums(old_log_probs, current_log_probs, action_mask)
    else:
        sums, counts = _np_array_sums(old_log_probs, current_log_probs, action_mask)
    return _decide(sums, counts, behavior_versions, cv, max_lag, max_drift)


def _check_shapes(old: Any, cur: Any, mask: Any) -> None:
    shapes = (tuple(old.shape), tuple(cur.shape), tuple(mask.shape))
    if len(shapes[0]) != 2 or shapes[0] != shapes[1] or shapes[0] != shapes[2]:
        raise GateConfigError(
            "old, current log-probs and mask must all be B x T with the same shape, got "
            f"{shapes[0]}, {shapes[1]}, {shapes[2]}"
        )


def _np_compute_dtype(a: np.dtype[Any], b: np.dtype[Any]) -> np.dtype[Any]:
    """float64 when either side is wider than float32, else float32."""
    if a.itemsize > 4 or b.itemsize > 4:
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def _np_array_sums(
    old_log_probs: Any, current_log_probs: Any, action_mask: Any, threads: int = 1
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    old = np.asarray(old_log_probs)
    cur = np.asarray(current_log_probs)
    mask = np.asarray(action_mask)
    if mask.dtype != np.bool_ and not np.issubdtype(mask.dtype, np.integer):
        raise GateConfigError(_MASK_DTYPE_MSG.format(f"dtype {mask.dtype}"))
    _check_shapes(old, cur, mask)
    if not (np.issubdtype(old.dtype, np.floating) and np.issubdtype(cur.dtype, np.floating)):
        raise GateConfigError(
            f"log-probs must be floating-point arrays, got {old.dtype} and {cur.dtype}"
        )
    b, t = old.shape
    dtype = _np_compute_dtype(old.dtype, cur.dtype)

    def diff_into(r0: int, r1: int, c0: int, c1: int, d: Any, _m: Any) -> Any:
        np.subtract(cur[r0:r1, c0:c1], old[r0:r1, c0:c1], out=d, dtype=dtype)
        return mask[r0:r1, c0:c1]

    sums, counts = _np_sums(diff_into, b, t, dtype, mask.dtype != np.bool_, threads)
    _recheck(sums, _np_exact_rows(old, cur, mask))
    return sums, counts


def _numpy_viewable(torch: Any) -> tuple[Any, ...]:
    """torch dtypes whose CPU tensors numpy can view without a copy."""
    return (
        torch.float16,
        torch.float32,
        torch.float64,
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
    )


_WIDE = ("torch.float32", "torch.float64")  # dtypes compared by name: no torch import here
_HALF = ("torch.bfloat16", "torch.float16")
# torch runs an element-wise op on the calling thread below this many elements (its grain
# size), with no OpenMP fork/join: float16 is widened by torch's copy in pieces this small
_TORCH_INLINE = (1 << 15) - 1
# torch threads from which CPU tensors are split across Python threads. After every torch
# op, torch's OpenMP workers spin for milliseconds (measured: 6-8 ms of CPU each time) on
# the cores a second Python thread would need; on two torch threads the split was slower
# than one thread in every case of the bench (docs/benchmarks, e.g. bf16 1024 x 1024 5.3 vs
# 2.0 ms, fp16 1024 x 4096 23.5 vs 10.6 ms), so up to two the kernel runs on this thread.
# Running torch's own ops on its pool there instead (widen, subtract, bit-mask, abs, float32
# partials, for 2^17..2^20 elements; `git log -S _torch_pool_sums`, measured with
# benchmarks/gate_torch_ab.py) brought bf16 / fp16 256 x 1024 on 2 threads from 1.3-1.8x to
# 1.2-1.6x the bare expression in quiet runs, but on a busy machine each op's fork/join
# became a time slice: 26-56 ms where this thread's kernel took 1.2 ms. Not kept.
_SPLIT_FROM_THREADS = 3


class _HostReader:
    """Blocks of a CPU tensor as numpy arrays: float32/float64 as zero-copy views,
    bfloat16/float16 widened exactly into float32 scratch.

    bfloat16 is the top half of a float32: a 16-bit shift of its int16 view (numpy has no
    bfloat16). float16 goes through torch's vectorised copy (numpy's float16 cast is
    several times slower); with several torch threads in pieces under torch's grain size,
    so that torch runs each on the calling thread, without an OpenMP fork/join.
    """

    def __init__(self, torch: Any, x: Any) -> None:
        self.torch = torch
        self.x = x
        kind = str(x.dtype)
        self.narrow = kind in _HALF
        self.array: npt.NDArray[Any] | None = None
        self.bits: npt.NDArray[np.uint16] | None = None
        self.piece = _TORCH_INLINE if torch.get_num_threads() > 1 else 0
        if kind == "torch.bfloat16":
            self.bits = x.view(torch.int16).numpy().view(np.uint16)
        elif not self.narrow:
            self.array = x.numpy()

    def read(self, r0: int, r1: int, c0: int, c1: int, out: npt.NDArray[np.float32]) -> Any:
        """The block: a view, or widened into `out` (of the block's shape)."""
        if self.array is not None:
            return self.array[r0:r1, c0:c1]
        if self.bits is not None:
            np.left_shift(self.bits[r0:r1, c0:c1], 16, out=out.view(np.uint32), dtype=np.uint32)
            return out
        dst, src = self.torch.from_numpy(out), self.x[r0:r1, c0:c1]
        n, k = out.shape
        if not self.piece or n * k <= self.piece:
            dst.copy_(src)
        elif k <= self.piece:  # whole rows, as many as fit in a piece
            step = self.piece // k
            for j in range(0, n, step):
                dst[j : j + step].copy_(src[j : j + step])
        else:  # a column chunk of one row, wider than a piece
            for j in range(0, k, self.piece):
                dst[:, j : j + self.piece].copy_(src[:, j : j + self.piece])
        return out


def _half_array_sums(
    torch: Any, old_t: Any, cur_t: Any, mask_t: Any, threads: int
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """CPU tensors, one or both bfloat16 / float16: `_np_sums` on blocks widened on the way.

    Widening is exact, so the arithmetic is the float32 (or float64) that torch's own
    kernels do, in one pass and without a full-size temporary.
    """
    old, cur = _HostReader(torch, old_t), _HostReader(torch, cur_t)
    mask = mask_t.numpy()
    b, t = mask.shape
    dtype = np.dtype(np.float64 if torch.float64 in (old_t.dtype, cur_t.dtype) else np.float32)
    scratch = threading.local()  # one float32 block per thread, beside the kernel's own

    def diff_into(r0: int, r1: int, c0: int, c1: int, d: Any, _m: Any) -> Any:
        n, k = r1 - r0, c1 - c0
        buf = getattr(scratch, "buf", None)
        if buf is None or buf.shape[0] < n or buf.shape[1] < k:
            buf = scratch.buf = np.empty((n, k), np.float32)
        if cur.narrow and d.dtype == np.float32:  # cur widens straight into d
            c = cur.read(r0, r1, c0, c1, d)
            o = old.read(r0, r1, c0, c1, buf[:n, :k])
        else:  # exactly one side is narrow: it widens into buf
            c = cur.read(r0, r1, c0, c1, buf[:n, :k])
            o = old.read(r0, r1, c0, c1, buf[:n, :k])
        np.subtract(c, o, out=d, dtype=dtype)
        return mask[r0:r1, c0:c1]

    sums, counts = _np_sums(
        diff_into, b, t, dtype, mask.dtype != np.bool_, threads, _CPU_BLOCK, _HALF_THREADS_FROM
    )
    _recheck(sums, _torch_exact_rows(torch, old_t, cur_t, mask_t))
    return sums, counts


def _torch_compute_dtype(torch: Any, a: Any, b: Any) -> Any:
    return torch.float64 if torch.float64 in (a, b) else torch.float32


def _torch_subtract(torch: Any, c: Any, o: Any, d: Any) -> None:
    if c.dtype == d.dtype and o.dtype == d.dtype:
        torch.sub(c, o, out=d)
    else:  # in place, so the arithmetic runs in the compute dtype
        d.copy_(c)
        d.sub_(o)


def _torch_array_sums(
    old_log_probs: Any, current_log_probs: Any, action_mask: Any
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    torch = sys.modules["torch"]
    given = (old_log_probs, current_log_probs, action_mask)
    for name, x in zip(("old_log_probs", "current_log_probs", "action_mask"), given, strict=True):
        if _is_torch(x) and x.device.type == "meta":  # shapes only: there is nothing to read
            raise GateConfigError(
                f"{name} is a tensor on torch's 'meta' device, which holds no values; pass "
                "the tensor that holds the log-probs (on the CPU or an accelerator)"
            )
    ref = next(x for x in given if _is_torch(x))
    device = ref.device

    def tensor(x: Any) -> Any:
        if _is_torch(x):
            return x.detach().to(device)
        return torch.as_tensor(np.asarray(x), device=device)

    old, cur, mask = tensor(old_log_probs), tensor(current_log_probs), tensor(action_mask)
    if mask.dtype != torch.bool and (mask.dtype.is_floating_point or mask.dtype.is_complex):
        raise GateConfigError(_MASK_DTYPE_MSG.format(mask.dtype))
    _check_shapes(old, cur, mask)
    if not (old.dtype.is_floating_point and cur.dtype.is_floating_point):
        raise GateConfigError("log-probs must be floating-point tensors")
    viewable = _numpy_viewable(torch)
    if device.type == "cpu" and mask.dtype in viewable:
        # CPU tensors are host memory: numpy's kernel on zero-copy views, on this thread or,
        # from _SPLIT_FROM_THREADS torch threads, on as many as torch would use. torch's own
        # CPU kernels pay a thread barrier per call, which a busy machine turns into a
        # scheduler time slice per call.
        threads = torch.get_num_threads()
        threads = threads if threads >= _SPLIT_FROM_THREADS else 1
        kinds = {str(old.dtype), str(cur.dtype)}
        if kinds <= {*_WIDE} and old.dtype in viewable and cur.dtype in viewable:
            return _np_array_sums(old.numpy(), cur.numpy(), mask.numpy(), threads=threads)
        if kinds <= {*_WIDE, *_HALF}:
            # bfloat16 / float16: widened block by block into float32 scratch, inside the
            # same one-pass kernel
            return _half_array_sums(torch, old, cur, mask, threads)
    b, t = old.shape
    rows, cols = _torch_block(torch, device, b, t)
    dtype = _torch_compute_dtype(torch, old.dtype, cur.dtype)
    d = torch.empty((rows, cols), dtype=dtype, device=device)

    def diff_into(r0: int, r1: int, c0: int, c1: int, dd: Any) -> Any:
        _torch_subtract(torch, cur[r0:r1, c0:c1], old[r0:r1, c0:c1], dd)
        return mask[r0:r1, c0:c1]

    sums, counts = _torch_sums(torch, diff_into, b, t, d, mask.dtype != torch.bool)
    _recheck(sums, _torch_exact_rows(torch, old, cur, mask))
    return sums, counts


def _records_sums(
    olds: Sequence[npt.NDArray[Any] | None],
    masks: Sequence[npt.NDArray[np.bool_] | None],
    current_log_probs: Any,
    ids: Sequence[str],
    lengths: Sequence[int] | None = None,
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """The batch core over records' stored arrays, without B x T copies of them.

    Each block of whole rows is laid out right-padded from the records' arrays by one
    C-level call per field (`_block_rows`), then the rest runs on the whole block, as on
    the array path. Rows of _ROWLOOP_FROM tokens or more on average instead have
    `cur - old` written row by row straight from each record (one pass over long rows
    instead of a copy and a subtraction), only the mask laid out joined. Columns past a
    row's length are masked out, so whatever they hold never counts (the bit multiply
    makes it +0.0), and a None row (it failed a record check) is all padding. The block
    therefore holds what `_padded_sums` reads from a padded B x T copy: the figures are
    that kernel's, to the bit. A row wider than a block is read in column chunks,
    straight from its record. `lengths`, when given, are the rows' log-prob counts (0 for
    a None row).
    """
    b = len(olds)
    # a None row has length 0: only then is an identity pass needed to find one
    has_none = (lengths is None or 0 in lengths) and any(
        map(operator.is_, olds, itertools.repeat(None))
    )
    # each row's dtype in one C-level pass; a failed row's None has no dtype
    kinds = set(map(_DTYPE, filter(_NOT_NONE, olds) if has_none else olds))
    lp_dtype = np.dtype(np.float64 if kinds - {np.dtype(np.float32)} else np.float32)
    cur, cur_t, threads = _host_current(current_log_probs)
    t = int(cur.shape[1]) if cur is not None else int(cur_t.shape[1])
    if lengths is None:
        lengths = [0 if lp is None else lp.size for lp in olds]
    if cur is None:
        # an accelerator (or bfloat16): build the two arrays on the host once, then the
        # tensor path does the rest where the tensors live
        old_h, mask_h = _records_rows(olds, masks, range(b), t, lp_dtype, lengths)
        return _device_sums(sys.modules["torch"], cur_t, old_h, mask_h, ids)
    dtype = _np_compute_dtype(lp_dtype, cur.dtype)
    _, cols = _tiles(b, t, _CPU_BLOCK)
    long_rows = cols == t and sum(lengths) >= _ROWLOOP_FROM * max(b, 1)

    def exact(rows_idx: npt.NDArray[np.intp]) -> tuple[Any, Any]:
        o, m = _records_rows(olds, masks, rows_idx.tolist(), t, lp_dtype, lengths)
        return _np_exact_rows(o, cur[rows_idx], m)(np.arange(len(rows_idx)))

    ragged = threads == 1 and t % _PARTIAL == 0 and lp_dtype == cur.dtype == np.float32
    popcount = _POPCOUNT
    if long_rows and ragged and popcount is not None:
        sums, counts = _ragged_sums(olds, masks, cur, lengths, has_none, popcount)
        _recheck(sums, exact, ids)
        return sums, counts
    if long_rows:
        # long rows: cur - old straight from each record's array into its row of the block
        # (one pass; a call per row is cheap next to a long row), the mask laid out joined
        read_mask = _block_rows(masks, lengths, t, np.dtype(np.bool_), True, has_none)
        subtract = np.subtract
        same_dtypes = lp_dtype == dtype == cur.dtype

        def diff_into(r0: int, r1: int, c0: int, c1: int, d: Any, m: Any) -> Any:
            # a row whose n is 0 is never read, so a None there is never used as an array
            block = cast("Sequence[npt.NDArray[Any]]", olds[r0:r1])
            if not has_none:
                # the block's arrays read once in a C-level pass first: their headers and
                # shapes (out of the caches after the record checks, at large B) are then
                # fetched together, not one miss at a time between the calls below
                _drain(map(len, block))
            # d may have more rows than this (last) block: zip stops at the shortest;
            # n: the row's log-prob count, 0 for a None row
            rows_in = zip(block, cur[r0:r1], d, lengths[r0:r1], strict=False)
            if same_dtypes:  # positional out, no dtype: the cheapest ufunc call
                for lp, cr, dr, n in rows_in:
                    if n:
                        subtract(cr[:n], lp, dr[:n])
            else:
                for lp, cr, dr, n in rows_in:
                    if n:
                        subtract(cr[:n], lp, out=dr[:n], dtype=dtype)
            return read_mask(r0, r1)

    elif cols == t:  # whole rows per block (the usual case)
        read_old = _block_rows(olds, lengths, t, lp_dtype, kinds <= {lp_dtype}, has_none)
        read_mask = _block_rows(masks, lengths, t, np.dtype(np.bool_), True, has_none)
        subtract = np.subtract
        same_dtypes = lp_dtype == dtype == cur.dtype

        def diff_into(r0: int, r1: int, c0: int, c1: int, d: Any, m: Any) -> Any:
            if same_dtypes:  # positional out, no dtype: the cheapest ufunc call
                subtract(cur[r0:r1], read_old(r0, r1), d)
            else:
                subtract(cur[r0:r1], read_old(r0, r1), out=d, dtype=dtype)
            return read_mask(r0, r1)

    else:  # one row per block, in column chunks: the per-row calls are not what costs

        def diff_into(r0: int, r1: int, c0: int, c1: int, d: Any, m: Any) -> Any:
            m.fill(False)
            for j in range(r1 - r0):
                lp, mask = olds[r0 + j], masks[r0 + j]
                if lp is None or mask is None or lp.size <= c0:
                    continue
                e = min(lp.size, c1)
                np.subtract(cur[r0 + j, c0:e], lp[c0:e], out=d[j, : e - c0], dtype=dtype)
                m[j, : e - c0] = mask[c0:e]
            return m

    sums, counts = _np_sums(diff_into, b, t, dtype, False, threads)
    _recheck(sums, exact, ids)
    return sums, counts


# _RAGGED_PADS[k]: k zero bytes, what fills a mask up to its row's next 256-token chunk
_RAGGED_PADS = [memoryview(bytes(_PARTIAL))[:k] for k in range(_PARTIAL)]


def _ragged_sums(
    olds: Sequence[npt.NDArray[Any] | None],
    masks: Sequence[npt.NDArray[np.bool_] | None],
    cur: npt.NDArray[np.float32],
    lengths: Sequence[int],
    has_none: bool,
    popcount: Callable[..., Any],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """The long-row records kernel for float32 on one thread (T a multiple of 256), each
    row laid out only up to the end of its last 256-token chunk instead of out to T.

    Rows shorter than T (T is the batch's longest, so most are) cost the padded kernel
    the whole width in its mask multiply, abs, partial sums and count; here those run on
    the rows' own chunks, packed one after another in blocks of at most _CPU_BLOCK
    tokens, which pays for the per-record calls (issue 36: records / arrays 1.35 to 1.5
    at T = 4096). The figures are the padded kernel's to the bit: each chunk's float32
    partial sums the same 256 values the same way (a chunk wholly past a row's end is
    +0.0 there), and the partials are put back in place, zeros between, for the same
    float64 sum of T / 256 of them per row; counts are exact whatever the order."""
    b, t = cur.shape
    per_row = t // _PARTIAL
    n = np.fromiter(lengths, np.int64, b)
    chunks = -(-n // _PARTIAL)
    first = np.zeros(b + 1, np.int64)  # first[i]: row i's first chunk; first[b]: all chunks
    np.cumsum(chunks, out=first[1:])
    total = int(first[-1])
    starts = first.tolist()
    cap = _CPU_BLOCK // _PARTIAL  # chunks per block; a row's (t <= _CPU_BLOCK) always fit
    bounds = [0]
    while bounds[-1] < b:  # as many whole rows as fit, at least one
        r0 = bounds[-1]
        bounds.append(max(r0 + 1, bisect.bisect_right(starts, starts[r0] + cap, r0 + 1) - 1))
    # each row's offset in its block's scratch
    base = np.repeat(first[bounds[:-1]], np.diff(bounds))
    offsets = ((first[:-1] - base) * _PARTIAL).tolist()
    parts: list[Any] = [None] * (2 * b)
    parts[0::2] = [b"" if m is None else m for m in masks] if has_none else masks
    parts[1::2] = map(_RAGGED_PADS.__getitem__, (-n % _PARTIAL).tolist())
    d = np.empty(cap * _PARTIAL, np.float32)
    words = np.empty(cap * _PARTIAL // 8, np.uint8)
    word_chunks = np.arange(0, words.size, _PARTIAL // 8)
    partials = np.empty(total, np.float32)
    chunk_counts = np.empty(total, np.int64)
    join, subtract = b"".join, np.subtract
    arrays = cast("Sequence[npt.NDArray[Any]]", olds)  # a None row has length 0: never read
    with np.errstate(invalid="ignore", over="ignore"):
        for r0, r1 in itertools.pairwise(bounds):
            k0, k1 = starts[r0], starts[r1]
            rows_in = zip(arrays[r0:r1], cur[r0:r1], offsets[r0:r1], lengths[r0:r1], strict=True)
            for lp, cr, at, k in rows_in:
                if k:
                    subtract(cr[:k], lp, d[at : at + k])
            m = np.frombuffer(join(parts[2 * r0 : 2 * r1]), np.bool_)
            dd = d[: m.size]
            bits = dd.view(np.int32)
            np.multiply(bits, m, out=bits, casting="unsafe")
            np.abs(dd, out=dd)
            np.einsum("ij->i", dd.reshape(-1, _PARTIAL), out=partials[k0:k1])
            w = popcount(m.view(np.uint64), out=words[: m.size // 8])
            np.add.reduceat(w, word_chunks[: k1 - k0], dtype=np.int64, out=chunk_counts[k0:k1])
    padded = np.zeros((b, per_row), np.float32)
    at_chunk = np.arange(total, dtype=np.int64) + np.repeat(
        np.arange(0, b * per_row, per_row, dtype=np.int64) - first[:-1], chunks
    )
    padded.reshape(-1)[at_chunk] = partials
    sums = np.add.reduce(padded, axis=1, dtype=np.float64)
    if chunks.all():
        return sums, np.add.reduceat(chunk_counts, first[:-1])
    # a row with no chunk (no tokens, or failed): reduceat would give it the next row's
    counts = np.zeros(b, np.int64)
    some = np.flatnonzero(chunks)
    if some.size:
        counts[some] = np.add.reduceat(chunk_counts, first[some])
    return sums, counts


def _block_rows(
    arrays: Sequence[npt.NDArray[Any] | None],
    lengths: Sequence[int],
    t: int,
    dtype: np.dtype[Any],
    same_dtype: bool,
    has_none: bool = True,
) -> Callable[[int, int], npt.NDArray[Any]]:
    """read(r0, r1): rows r0..r1 of `arrays` as an (r1 - r0) x t array of `dtype`, each row
    right-padded with zeros (a None row: all zeros).

    The rows' arrays are interleaved once with padding views (`parts`: row i's array,
    then the t - n_i zero items that fill its row), so a block is one C-level call over
    2 (r1 - r0) parts instead of Python calls per row, which on rows of a few hundred
    tokens cost more than the whole kernel. When every array already has `dtype` (the
    records' arrays are C-contiguous: their converters make them so), that call is
    bytes.join over their buffers, about twice as fast as np.concatenate (B=4096, T=1024:
    1.3 vs 2.8 ms for both fields); np.concatenate casts mixed dtypes. `has_none` False
    says that no row is None (the caller knows), sparing a pass that looks.
    """
    parts: list[Any] = [None] * (2 * len(arrays))
    # by identity: `None in arrays` would compare arrays with None elementwise
    has_none = has_none and any(map(operator.is_, arrays, itertools.repeat(None)))
    pad: dict[int, Any]
    empty: Any
    if same_dtype:
        pad, empty = _zero_pads(t, dtype.itemsize, lengths), b""
    else:
        zeros = np.zeros(t, dtype)
        pad, empty = {n: zeros[n:] for n in set(lengths)}, zeros[:0]
    parts[0::2] = [empty if a is None else a for a in arrays] if has_none else arrays
    parts[1::2] = map(pad.__getitem__, lengths)
    if same_dtype:
        join = b"".join

        def read(r0: int, r1: int) -> npt.NDArray[Any]:
            flat = np.frombuffer(join(parts[2 * r0 : 2 * r1]), dtype)
            return flat.reshape(r1 - r0, t)

        return read

    def read_cast(r0: int, r1: int) -> npt.NDArray[Any]:
        if r1 == r0:  # np.concatenate needs at least one part
            return np.zeros((0, t), dtype)
        return np.concatenate(parts[2 * r0 : 2 * r1], dtype=dtype).reshape(r1 - r0, t)

    return read_cast


def _host_current(current_log_probs: Any) -> tuple[Any, Any, int]:
    """The records paths' current log-probs: (a numpy array, or None where they stay a
    tensor (an accelerator, or bfloat16/float16), the torch tensor or None, threads).

    A float32/64 CPU tensor is host memory: a zero-copy numpy view, and numpy's kernel,
    whose calls per row cost far less than torch's (and leave torch's worker threads idle);
    threads as the array path uses them (from _SPLIT_FROM_THREADS torch threads, as many as
    torch would use, else one): on two, splitting was slower than one thread (B=4096,
    T=1024: 18.7 vs 13.0 ms, 21 vs 13 ms of CPU); filling a block holds the GIL, and after
    a torch op torch's own workers spin on the other core (see _SPLIT_FROM_THREADS)."""
    torch = sys.modules.get("torch") if _is_torch(current_log_probs) else None
    if torch is None:
        cur = np.asarray(current_log_probs)
        if not np.issubdtype(cur.dtype, np.floating):
            raise GateConfigError(f"current log-probs must be floating-point, got {cur.dtype}")
        return cur, None, 1
    cur_t = current_log_probs.detach()
    if not cur_t.dtype.is_floating_point:
        raise GateConfigError("current log-probs must be a floating-point tensor")
    if cur_t.device.type != "cpu" or cur_t.dtype not in (torch.float32, torch.float64):
        return None, cur_t, 1
    threads = int(torch.get_num_threads())
    return cur_t.numpy(), cur_t, threads if threads >= _SPLIT_FROM_THREADS else 1


def _device_sums(
    torch: Any,
    cur_t: Any,
    old_h: npt.NDArray[Any],
    mask_h: npt.NDArray[np.bool_],
    ids: Sequence[str],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """The records' right-padded host arrays against current log-probs on an accelerator
    (or in bfloat16): moved there once, then torch's block kernel."""
    b, t = int(cur_t.shape[0]), int(cur_t.shape[1])
    old_t = torch.as_tensor(old_h, device=cur_t.device)
    mask_t = torch.as_tensor(mask_h, device=cur_t.device)
    rows, cols = _torch_block(torch, cur_t.device, b, t)
    dtype = _torch_compute_dtype(torch, old_t.dtype, cur_t.dtype)
    d = torch.empty((rows, cols), dtype=dtype, device=cur_t.device)

    def diff_dev(r0: int, r1: int, c0: int, c1: int, dd: Any) -> Any:
        _torch_subtract(torch, cur_t[r0:r1, c0:c1], old_t[r0:r1, c0:c1], dd)
        return mask_t[r0:r1, c0:c1]

    sums, counts = _torch_sums(torch, diff_dev, b, t, d, False)
    _recheck(sums, _torch_exact_rows(torch, old_t, cur_t, mask_t), ids)
    return sums, counts


def _padded_sums(
    old: npt.NDArray[Any],
    mask: npt.NDArray[np.bool_],
    current_log_probs: Any,
    ids: Sequence[str],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """`_records_sums` over rows already laid out as right-padded B x T arrays (zeros and
    False past each row's length, a failed row all False): the same kernel, blocks, dtypes
    and threads, so the same figures to the bit, one ufunc call per block instead of two
    per row."""
    b, t = old.shape
    if old.dtype not in (np.float32, np.float64):
        raise GateConfigError(f"old log-probs must be float32 or float64, got {old.dtype}")
    lp_dtype = old.dtype
    cur, cur_t, threads = _host_current(current_log_probs)
    if cur is None:
        return _device_sums(sys.modules["torch"], cur_t, old, mask, ids)
    dtype = _np_compute_dtype(lp_dtype, cur.dtype)

    def diff_into(r0: int, r1: int, c0: int, c1: int, d: Any, _m: Any) -> Any:
        np.subtract(cur[r0:r1, c0:c1], old[r0:r1, c0:c1], out=d, dtype=dtype)
        return mask[r0:r1, c0:c1]

    sums, counts = _np_sums(diff_into, b, t, dtype, False, threads)

    def exact(rows_idx: npt.NDArray[np.intp]) -> tuple[Any, Any]:
        return _np_exact_rows(old[rows_idx], cur[rows_idx], mask[rows_idx])(
            np.arange(len(rows_idx))
        )

    _recheck(sums, exact, ids)
    return sums, counts


# (T, item size) -> a zero buffer of T items and its views by row length: see _zero_pads
_PADS: dict[tuple[int, int], tuple[memoryview, dict[int, memoryview]]] = {}
# mean tokens per row from which the records path subtracts row by row straight from the
# records instead of laying the block out first: in `rollout-lifecycle bench --part gate`
# (records run after the bare torch expression has evicted them from the caches), at T=4096
# (mean 3072) the records path took 7.5 / 27.3 ms that way against 10.1 / 30.1 ms joined
# (B=1024 / 4096, 1 thread); at T=1024 (mean 768) joining wins (in-process, B=4096: the
# block filling 3.8 ms against 5.0 ms row by row)
_ROWLOOP_FROM = 2048
_drain: Callable[[Iterable[Any]], None] = collections.deque[Any](maxlen=0).extend  # keeps nothing
_PADS_KEPT = 8  # row widths and item sizes remembered (a gate sees the same few)
_PAD_VIEWS_KEPT = 4096  # views kept per width, beyond which they start again (~0.75 MB)


def _zero_pads(t: int, itemsize: int, lengths: Iterable[int]) -> dict[int, memoryview]:
    """pads[n]: the zero bytes that fill a row of n items (of `itemsize` bytes) up to t,
    for every n in `lengths`.

    Views of one zero buffer per (T, item size), kept between calls, each made the first
    time its length is seen: making them per call took 7% of a B=256, T=1024 batch
    (cProfile), and a gate sees the same few widths and lengths call after call. At most
    _PAD_VIEWS_KEPT views per width (more only while one call needs them), for at most
    _PADS_KEPT widths."""
    key = (t, itemsize)
    kept = _PADS.get(key)
    if kept is None:
        if len(_PADS) >= _PADS_KEPT:
            _PADS.clear()
        kept = _PADS[key] = (memoryview(bytes(t * itemsize)), {})
    zero, pads = kept
    if len(pads) > _PAD_VIEWS_KEPT:
        pads.clear()
    for n in set(lengths).difference(pads):  # another thread may add the same: harmless
        pads[n] = zero[n * itemsize :]
    return pads


def _records_rows(
    olds: Sequence[npt.NDArray[Any] | None],
    masks: Sequence[npt.NDArray[np.bool_] | None],
    rows: Sequence[int],
    t: int,
    dtype: np.dtype[Any],
    lengths: Sequence[int],
) -> tuple[npt.NDArray[Any], npt.NDArray[np.bool_]]:
    """Some records' arrays as R x T arrays, right-padded (zeros, masked out); `lengths`
    are all rows' log-prob counts (0 for a None row)."""
    n = [lengths[i] for i in rows]
    read_old = _block_rows([olds[i] for i in rows], n, t, dtype, False)
    read_mask = _block_rows([masks[i] for i in rows], n, t, np.dtype(np.bool_), False)
    return read_old(0, len(n)), read_mask(0, len(n))


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


# AdmissionDecision has no validators, converters or post-init: setting its slots is
# exactly what its __init__ does, and doing it field by field over a whole batch (each
# slot's descriptor mapped over the rows, in C) is several times cheaper than B calls
_DECISION_SETTERS = tuple(
    getattr(AdmissionDecision, f.name).__set__ for f in attrs.fields(AdmissionDecision)
)
_PLAIN_DECISION = not any(
    f.validator is not None or f.converter is not None for f in attrs.fields(AdmissionDecision)
) and not hasattr(AdmissionDecision, "__attrs_post_init__")


def _decisions(columns: Sequence[Iterable[Any]], b: int) -> list[AdmissionDecision]:
    """B decisions from their columns (in field order), as `AdmissionDecision(*row)` each."""
    if not _PLAIN_DECISION:
        return list(map(AdmissionDecision, *columns))
    out = list(map(object.__new__, itertools.repeat(AdmissionDecision, b)))
    for setter, column in zip(_DECISION_SETTERS, columns, strict=True):
        collections.deque(map(setter, out, column), maxlen=0)
    return out


class AdmissionDecisions(Sequence[AdmissionDecision]):
    """A batch's decisions, one per rollout in the rollouts' order, held as columns.

    It is a read-only `Sequence[AdmissionDecision]` (len, index, slice, iteration, `in`,
    equality with a list of the same decisions, `+` with a list gives a list) whose
    AdmissionDecision objects are built only when they are read: building B of them cost
    more than the batch kernel itself (B=4096: ~2.4 ms, more than the array path's whole
    per-row cost), and a caller that acts on a few rows (the admitted ones) or reads one
    field needs no object for the rest. Iterating builds all of them at once, by the
    columnar `_decisions`, and keeps them: a second pass reads the same objects. Call
    list() on it where a mutable list is needed.
    """

    __slots__ = (
        "_bvs",
        "_cv",
        "_drift",
        "_freshness",
        "_ids",
        "_items",
        "_lags",
        "_max_drift",
        "_max_lag",
        "_reasons",
    )

    def __init__(
        self,
        ids: list[str],
        reasons: list[str],
        freshness: list[str | None],
        drift: list[float | None],
        lags: list[int],
        behavior_versions: list[int],
        current_version: int,
        max_lag: int,
        max_drift: float,
    ) -> None:
        self._ids = ids
        self._reasons = reasons
        self._freshness = freshness
        self._drift = drift
        self._lags = lags
        self._bvs = behavior_versions
        self._cv = current_version
        self._max_lag = max_lag
        self._max_drift = max_drift
        self._items: list[AdmissionDecision] | None = None

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, i: int) -> AdmissionDecision: ...

    @overload
    def __getitem__(self, i: slice) -> AdmissionDecisions: ...

    def __getitem__(self, i: int | slice) -> AdmissionDecision | AdmissionDecisions:
        if isinstance(i, slice):
            return AdmissionDecisions(
                self._ids[i],
                self._reasons[i],
                self._freshness[i],
                self._drift[i],
                self._lags[i],
                self._bvs[i],
                self._cv,
                self._max_lag,
                self._max_drift,
            )
        if self._items is not None:
            return self._items[i]
        reason = self._reasons[i]  # IndexError / TypeError as a list gives them
        return AdmissionDecision(
            self._ids[i],
            reason == "ok",
            reason,
            REASON_ROUTE[reason],
            self._freshness[i],
            self._drift[i],
            self._lags[i],
            self._cv,
            self._bvs[i],
            self._max_lag,
            self._max_drift,
        )

    def _all(self) -> list[AdmissionDecision]:
        items = self._items
        if items is None:
            b = len(self._ids)
            reasons = self._reasons
            items = self._items = _decisions(
                (
                    self._ids,
                    map("ok".__eq__, reasons),
                    reasons,
                    map(REASON_ROUTE.__getitem__, reasons),
                    self._freshness,
                    self._drift,
                    self._lags,
                    itertools.repeat(self._cv, b),
                    self._bvs,
                    itertools.repeat(self._max_lag, b),
                    itertools.repeat(self._max_drift, b),
                ),
                b,
            )
        return items

    def __iter__(self) -> Iterator[AdmissionDecision]:
        return iter(self._all())

    def __reversed__(self) -> Iterator[AdmissionDecision]:
        return reversed(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, AdmissionDecisions):
            return self._all() == other._all()
        if isinstance(other, list):
            return self._all() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, so unhashable as they are

    def __add__(self, other: object) -> list[AdmissionDecision]:
        if isinstance(other, AdmissionDecisions | list):
            return [*self._all(), *other]
        return NotImplemented

    def __radd__(self, other: object) -> list[AdmissionDecision]:
        if isinstance(other, list):
            return [*other, *self._all()]
        return NotImplemented

    def __repr__(self) -> str:
        return f"AdmissionDecisions({self._all()!r})"


_STATE = operator.attrgetter("state")
_BEHAVIOR = operator.attrgetter("behavior")
_VERSION = operator.attrgetter("version")
_HASH = operator.attrgetter("artifact_hash")
_CONDITIONS = operator.attrgetter("conditions")
_EVIDENCE = operator.attrgetter("evidence")
_STATUS = operator.attrgetter("status")
_OLD_LOG_PROBS = operator.attrgetter("behavior_log_probs")
_ACTION_MASK = operator.attrgetter("action_mask")
_TOKEN_IDS = operator.attrgetter("response_token_ids")
_DTYPE = operator.attrgetter("dtype")
_ROLLOUT_ID = operator.attrgetter("identity.rollout_id")
_ENTRY_ID = operator.attrgetter("rollout_id")
_ENTRY_VERSION = operator.attrgetter("behavior_version")
_EVIDENCE_SIZES = ("response_token_ids.size", "action_mask.size", "behavior_log_probs.size")
_SIZES = operator.attrgetter(*_EVIDENCE_SIZES)
_LENGTHS = tuple(map(operator.attrgetter, _EVIDENCE_SIZES))
_NOT_NONE = functools.partial(operator.is_not, None)


Registry = Mapping[int, str] | Callable[[int], str | None]


def _registered_hash(registry: Registry | None, version: int) -> tuple[bool, str | None]:
    if registry is None:
        return False, None
    try:
        h = registry(version) if callable(registry) else registry.get(version)
    except RolloutLifecycleError:
        raise
    except Exception as exc:  # the caller's lookup failed: say so, typed, with its cause
        raise GateConfigError(
            f"the registry lookup for v{version} failed ({type(exc).__name__}: {brief(exc)})"
        ) from exc
    if h is not None and not isinstance(h, str):
        raise GateConfigError(f"the registry must give an artifact hash or None, got {brief(h)}")
    return True, h


def _batch_width(current_log_probs: Any, b: int) -> int:
    """T of the B x T current log-probs; GateConfigError for any other shape."""
    shape = tuple(getattr(current_log_probs, "shape", ()))
    if len(shape) != 2 or shape[0] != b:
        raise GateConfigError(f"current log-probs must be {b} x T, got shape {shape}")
    return int(shape[1])


@attrs.frozen
class RecordColumns:
    """B rollouts as columns (`AdmissionGate.assess_columns`): per row its id, ledger state,
    behaviour version and artifact hash, generation conditions, and its evidence's token,
    mask and log-prob counts; its behaviour log-probs and action mask as B x T arrays,
    right-padded (zeros and False past each row's length)."""

    rollout_ids: Sequence[str]
    states: Sequence[str]
    behavior_versions: Sequence[int]
    artifact_hashes: Sequence[str]
    conditions: Sequence[GenerationConditions]
    token_counts: Sequence[int]
    mask_counts: Sequence[int]
    log_prob_counts: Sequence[int]
    old_log_probs: npt.NDArray[np.floating[Any]]
    action_mask: npt.NDArray[np.bool_]


class LedgerReader(Protocol):
    """What the gate reads from a ledger: where each rollout stands now."""

    def find(self, rollout_id: str) -> LedgerEntry | None: ...


class AdmissionGate:
    """Admits rollouts for an update against the current version, the registry and conditions.

    `registry` maps every version that ever became active to its artifact hash (or is a
    callable doing the lookup). A behaviour version absent from it is a registration error
    (quarantine), as is a hash that contradicts the registered one.

    Where each rollout stands (finished? reserved? consumed?) is read, in this order, from
    `entries` (what the caller read from its ledger), from `ledger` (looked up here), or
    from each record's own `status`. When none of them says, the gate raises
    GateConfigError instead of guessing: a rollout with no known state is never silently
    rejected as unfinished.
    """

    def __init__(self, policy: GatePolicy, registry: Registry | None = None) -> None:
        self.policy = policy
        self.registry = registry

    @staticmethod
    def _states(
        rollouts: Sequence[Rollout],
        entries: Sequence[LedgerEntry | None] | None,
        ledger: LedgerReader | None,
    ) -> list[LedgerEntry]:
        """Each rollout's ledger entry: from entries, else the ledger, else its status."""
        b = len(rollouts)
        if entries is not None and ledger is not None:
            raise GateConfigError("pass entries= or ledger=, not both")
        if entries is not None:
            if len(entries) != b:
                raise GateConfigError(f"{len(entries)} entries for {b} rollouts")
            given: Sequence[LedgerEntry | None] = entries
        elif ledger is not None:
            given = [ledger.find(ro.rollout_id) for ro in rollouts]
            absent = [ro.rollout_id for ro, e in zip(rollouts, given, strict=True) if e is None]
            if absent:
                raise GateConfigError(
                    f"{len(absent)} rollout(s) are not in the ledger ({absent[:5]}); "
                    "add them before admitting them"
                )
        else:
            # no entries: every state is the record's own status, read in one C-level pass
            statuses = list(map(_STATUS, rollouts))
            if not any(map(operator.is_, statuses, itertools.repeat(None))):
                return statuses
            given = [None] * b
        out: list[LedgerEntry] = []
        unknown: list[str] = []
        for ro, e in zip(rollouts, given, strict=True):
            if e is None:
                e = ro.status
                if e is None:
                    unknown.append(ro.rollout_id)
                    continue
            elif e.rollout_id != ro.identity.rollout_id:
                raise GateConfigError(
                    f"the entry given for rollout {brief(ro.identity.rollout_id)} belongs to "
                    f"{brief(e.rollout_id)}; entries must be in the rollouts' order"
                )
            out.append(e)
        if unknown:
            raise GateConfigError(
                f"no ledger state for {len(unknown)} rollout(s) ({unknown[:5]}): pass "
                "entries= (what the ledger holds for each) or ledger=, or give each Rollout "
                "its status; the gate does not guess whether a rollout is finished"
            )
        return out

    def _record_checks(
        self,
        rollout: Rollout,
        entry: LedgerEntry,
        current_version: int,
        memo: dict[Any, Any] | None = None,
    ) -> str | None:
        """Reasons that do not need log-probs, in order; None when all pass."""
        ev = rollout.evidence
        return self._checks(
            entry.state,
            rollout.behavior.version,
            rollout.behavior.artifact_hash,
            rollout.conditions,
            None if ev is None else _SIZES(ev),
            current_version,
            {} if memo is None else memo,
        )

    def _checks(
        self,
        state: str,
        bv: int,
        artifact_hash: str,
        cond: GenerationConditions,
        sizes: tuple[int, int, int] | None,
        current_version: int,
        memo: dict[Any, Any],
    ) -> str | None:
        """`_record_checks` on one rollout's fields; `sizes` are its evidence's token, mask
        and log-prob counts (None: no evidence).

        `memo` caches registry lookups per version and conditions comparisons per object
        within one batch (thousands of rollouts share a handful of each).
        """
        if state != "rewarded":
            if state in ("dispatched", "generated"):
                return "not_finished"
            if state == "reserved":
                return "already_reserved"
            if state == "consumed":
                return "already_consumed"
            return "terminal_state"
        key = ("v", bv)
        looked = memo.get(key)
        if looked is None:
            looked = memo[key] = _registered_hash(self.registry, bv)
        known, registered = looked
        if bv > current_version:
            return "future_policy"
        if known and registered is None:
            return "unregistered_version"
        if known and registered != artifact_hash:
            return "artifact_hash_mismatch"
        expected = self.policy.conditions
        if expected is not None and cond is not expected:
            ckey = ("c", id(cond))
            same = memo.get(ckey)
            if same is None:
                same = memo[ckey] = (cond == expected, cond)  # keep cond alive: id stays
            if not same[0]:
                return "conditions_mismatch"
        if sizes is None:
            return "missing_evidence"
        n, n_mask, n_lp = sizes
        if n_mask != n or n_lp != n:
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
        if freshness is None and reason != "empty_action_mask":
            freshness = classify_lag(lag, self.policy.max_lag)
        return AdmissionDecision(
            rollout_id=rollout.identity.rollout_id,
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
        *,
        ledger: LedgerReader | None = None,
    ) -> AdmissionDecision:
        """Admit one rollout: record checks, then lag and drift in plain Python.

        Its state comes from `entry`, else `ledger`, else `rollout.status` (GateConfigError
        when none is given).
        """
        _check_version("current_version", current_version)
        (state,) = self._states([rollout], None if entry is None else [entry], ledger)
        early = self._record_checks(rollout, state, current_version)
        if early is not None:
            return self._decision(rollout, current_version, early, None, None)
        ev = rollout.evidence
        assert ev is not None  # record checks guarantee it
        if len(current_log_probs) != ev.behavior_log_probs.size:
            raise GateConfigError(
                f"rollout {brief(rollout.rollout_id)}: "
                f"{len(current_log_probs)} current log-probs for "
                f"{ev.behavior_log_probs.size} tokens"
            )
        r = lag_drift_decision(
            ev.behavior_log_probs.tolist(),
            current_log_probs,
            ev.action_mask.tolist(),
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
        *,
        ledger: LedgerReader | None = None,
    ) -> AdmissionDecisions:
        """Admit B rollouts; `current_log_probs` is B x T (numpy or torch), right-padded.

        Each rollout's state comes from `entries` (in the rollouts' order; a None falls back
        to the record's status), else from `ledger`, else from each `rollout.status`; a
        rollout whose state nobody gives raises GateConfigError. Record checks read each
        field of the whole batch in one C-level pass and judge each distinct value once
        (`_column_checks`); lag and drift run vectorised over the whole batch, reading the
        records' stored arrays block by block (no B x T copies, no Python call per row or
        token: `_records_sums`).

        The result is an `AdmissionDecisions`: a read-only Sequence[AdmissionDecision] held
        as columns, whose objects are built when read (building B of them cost more than
        the array path's whole per-row work); list() it where a mutable list is needed.
        """
        _check_version("current_version", current_version)
        b = len(rollouts)
        states = self._states(rollouts, entries, ledger)
        t = _batch_width(current_log_probs, b)
        if entries is None and ledger is None:
            # the states are the records' own statuses, which Rollout holds to its identity
            # and behaviour (its post-init): the same id, version and hash, one attribute
            # away instead of two (B=4096: 1.44 vs 1.63 ms for reading every field)
            ids = list(map(_ENTRY_ID, states))
            bvs = list(map(_ENTRY_VERSION, states))
            hashes = list(map(_HASH, states))
        else:
            ids = list(map(_ROLLOUT_ID, rollouts))
            behaviors = list(map(_BEHAVIOR, rollouts))
            bvs = list(map(_VERSION, behaviors))
            hashes = list(map(_HASH, behaviors))
        evidence: list[ActionEvidence | None] = list(map(_EVIDENCE, rollouts))
        # by identity: `None in evidence` would call ActionEvidence.__eq__ once per record
        missing = any(map(operator.is_, evidence, itertools.repeat(None)))
        olds: list[npt.NDArray[Any] | None]
        masks: list[npt.NDArray[np.bool_] | None]
        if missing:
            sizes = [[None if ev is None else get(ev) for ev in evidence] for get in _LENGTHS]
        else:  # the arrays, then their sizes: the gate reads the arrays anyway
            olds = list(map(_OLD_LOG_PROBS, evidence))
            masks = list(map(_ACTION_MASK, evidence))
            tokens = map(_TOKEN_IDS, evidence)
            # len: the converters make every evidence array 1-D (and len is cheaper)
            sizes = [list(map(len, arrays)) for arrays in (tokens, masks, olds)]
        # conditions are read only where the policy sets some, as the per-row checks do
        conds = list(map(_CONDITIONS, rollouts)) if self.policy.conditions is not None else None
        early = self._column_checks(
            list(map(_STATE, states)), bvs, hashes, conds, sizes, current_version
        )
        failed = b - early.count(None)
        if failed:
            evidence = [
                None if why is not None else ev for ev, why in zip(evidence, early, strict=True)
            ]
            olds = [None if ev is None else ev.behavior_log_probs for ev in evidence]
            masks = [None if ev is None else ev.action_mask for ev in evidence]
            lengths = [
                0 if n is None or why is not None else n
                for n, why in zip(sizes[2], early, strict=True)
            ]
        else:  # every row passed, so every row has evidence (read above)
            lengths = cast("list[int]", sizes[2])
        widest = max(lengths, default=0)
        if widest > t:
            i = next(i for i, lp in enumerate(olds) if lp is not None and lp.size > t)
            raise GateConfigError(
                f"rollout {brief(rollouts[i].rollout_id)} has {widest} tokens but the batch is "
                f"T={t} wide"
            )
        sums, counts = _records_sums(olds, masks, current_log_probs, ids, lengths)
        return self._column_decisions(ids, bvs, early, failed, sums, counts, current_version)

    def assess_columns(
        self, columns: RecordColumns, current_log_probs: Any, current_version: int
    ) -> AdmissionDecisions:
        """`assess_batch` over B rollouts given as columns, for callers that hold their
        fields rather than Rollout and LedgerEntry records (e.g. rows read from a file):
        the same checks, reasons, figures and errors, without building a record per row.

        `current_log_probs` is B x T, right-padded, like `columns.old_log_probs`. The
        result is an `AdmissionDecisions`, as from `assess_batch`.
        """
        _check_version("current_version", current_version)
        cols = columns
        b = len(cols.rollout_ids)
        t = _batch_width(current_log_probs, b)
        old, mask = cols.old_log_probs, cols.action_mask
        fields = (cols.states, cols.behavior_versions, cols.artifact_hashes, cols.conditions)
        lengths = (cols.token_counts, cols.mask_counts, cols.log_prob_counts)
        if (
            any(len(c) != b for c in (*fields, *lengths))
            or old.shape != (b, t)
            or (mask.shape != (b, t) or mask.dtype != np.bool_)
        ):
            raise GateConfigError(
                f"columns must all hold {b} rows, and old log-probs and mask be {b} x {t} "
                f"(mask bool), got {old.shape} and {mask.shape} {mask.dtype}"
            )
        early = self._column_checks(
            list(cols.states),
            list(cols.behavior_versions),
            list(cols.artifact_hashes),
            cols.conditions,
            [list(c) for c in lengths],
            current_version,
        )
        failed = b - early.count(None)
        if failed:  # a row that failed a check counts no action position (a copy: ours)
            mask = mask.copy()
            mask[[i for i, why in enumerate(early) if why is not None]] = False
        ids = list(cols.rollout_ids)
        sums, counts = _padded_sums(old, mask, current_log_probs, ids)
        bvs = list(cols.behavior_versions)
        return self._column_decisions(ids, bvs, early, failed, sums, counts, current_version)

    def _column_decisions(
        self,
        ids: list[str],
        bvs: list[int],
        early: list[str | None],
        failed: int,
        sums: npt.NDArray[np.float64],
        counts: npt.NDArray[np.int64],
        current_version: int,
    ) -> AdmissionDecisions:
        """The batch's decisions from its row sums and the record checks' reasons, as
        columns (`AdmissionDecisions`): no AdmissionDecision is built here."""
        b = len(ids)
        versions = np.array(bvs, np.int64) if b else np.zeros(0, np.int64)
        pol = self.policy
        res = _decide(sums, counts, versions, current_version, pol.max_lag, pol.max_drift)
        # the same fields as _decision builds, for B rollouts at once
        drift: list[float | None] = res.drift.tolist()
        reasons = list(res.reasons)
        freshness = list(res.freshness)
        for i in np.flatnonzero(counts == 0).tolist():  # NaN: no action position
            drift[i] = None
        if failed:
            fresh_all = _freshness_codes(res.lag, pol.max_lag).tolist()
            for i, why in enumerate(early):
                if why is not None:
                    reasons[i], freshness[i], drift[i] = why, _FRESHNESS_CODES[fresh_all[i]], None
        return AdmissionDecisions(
            ids,
            reasons,
            freshness,
            drift,
            res.lag.tolist(),
            bvs,
            current_version,
            pol.max_lag,
            pol.max_drift,
        )

    def _column_checks(
        self,
        kinds: list[str],
        bvs: list[int],
        hashes: list[str],
        conditions: Sequence[GenerationConditions] | None,
        sizes: Sequence[Sequence[int | None]],
        current_version: int,
    ) -> list[str | None]:
        """`_record_checks` of every row, from the batch's columns: states, behaviour
        versions and hashes, conditions (or the rollouts, whose `conditions` are read only
        when the policy sets some) and the evidence's token, mask and log-prob counts (None:
        no evidence).

        Each check reads its column in one C-level pass and judges each distinct value
        once: states, (version, hash) pairs, conditions objects, evidence lengths. Only
        rows that some check flags go through `_checks`, which names the first failing
        reason in the contract's order; every other row passes every check. Lookups happen
        for the versions of rewarded rows only, as the per-row checks do.
        """
        b = len(kinds)
        flagged: set[int] = set()
        rewarded = kinds.count("rewarded") == b
        if not rewarded:
            flagged.update(i for i, k in enumerate(kinds) if k != "rewarded")
        memo: dict[Any, Any] = {}
        if rewarded:  # distinct pairs in order of first appearance: the lookups' order
            live = dict.fromkeys(zip(bvs, hashes, strict=True))
        else:
            live = dict.fromkeys(
                p
                for p, k in zip(zip(bvs, hashes, strict=True), kinds, strict=True)
                if k == "rewarded"
            )
        bad = {p for p in live if not self._pair_ok(p, current_version, memo)}
        if bad:
            flagged.update(i for i, p in enumerate(zip(bvs, hashes, strict=True)) if p in bad)
        expected = self.policy.conditions
        conds: Sequence[Any] = [None] * b if conditions is None else conditions
        # all the very object the policy holds (rollouts built with it): nothing to compare
        if expected is not None and not all(map(operator.is_, conds, itertools.repeat(expected))):
            distinct = dict(zip(map(id, conds), conds, strict=True))
            odd = {k for k, c in distinct.items() if c is not expected and c != expected}
            if odd:
                flagged.update(i for i, c in enumerate(conds) if id(c) in odd)
        tokens, in_mask, in_lp = sizes
        if not (tokens == in_mask == in_lp) or None in tokens:
            flagged.update(
                i for i, n in enumerate(tokens) if n is None or n != in_mask[i] or n != in_lp[i]
            )
        early: list[str | None] = [None] * b
        check = self._checks
        for i in flagged:
            n = tokens[i]
            early[i] = check(
                kinds[i],
                bvs[i],
                hashes[i],
                conds[i],
                None if n is None else (n, in_mask[i], in_lp[i]),  # type: ignore[arg-type]
                current_version,
                memo,
            )
        return early

    def _pair_ok(self, pair: tuple[int, str], current_version: int, memo: dict[Any, Any]) -> bool:
        """Whether a (behaviour version, artifact hash) pair passes the version checks
        (`_record_checks`' lookups, shared through `memo`)."""
        bv, artifact_hash = pair
        key = ("v", bv)
        looked = memo.get(key)
        if looked is None:
            looked = memo[key] = _registered_hash(self.registry, bv)
        known, registered = looked
        return bv <= current_version and (not known or registered == artifact_hash)
