"""The verl adapter fuzzed: generated verl batches judged by the adapter and, row by row,
by the contract's reference function; any disagreement is a finding.

The adapter (gpu_check/verl_adapter.py) is the piece users paste into verl's trainer, and
its vectorised path shares no code with the per-rollout reference (`model.api.
assess_policy_compatibility`). Batches are real verl `DataProto`s, their `TensorDict` form,
or plain numpy mappings; log-probs float32 or bfloat16; masks int64, int32 or bool, ragged,
some rows all masked; NaN where the mask is 0 (never looked at) and, in some batches, NaN
at an action position (both sides must refuse the batch); per-sample versions spanning
several steps (partial rollouts), some missing. Importing this module needs the [verl]
extra: the campaign skips the stage, saying so, without it.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

import numpy as np
import torch
from verl import DataProto

from rollout_lifecycle.gpu_check import verl_adapter
from rollout_lifecycle.model.api import assess_policy_compatibility
from rollout_lifecycle.model.errors import GateConfigError

KINDS = ("dataproto", "tensordict", "numpy")
DTYPES = ("float32", "bfloat16")
MASKS = ("int64", "int32", "bool")


def _batch(rng: random.Random) -> tuple[dict[str, Any], list[int | None], list[int | None], int]:
    """Raw tensors, oldest and newest versions per sample, and the current version."""
    b, t = rng.randint(1, 10), rng.randint(1, 12)
    cv = rng.randint(0, 6)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    behaviour = -torch.rand(b, t, generator=g) * 4
    shift = torch.zeros(b, t)
    for i in range(b):  # per-row drift from none to well past the bounds used
        shift[i] = rng.choice((0.0, 0.0, 0.05, 0.15, 0.3, 0.8)) * torch.sign(
            torch.randn(t, generator=g)
        )
    current = behaviour + shift
    mask = (torch.rand(b, t, generator=g) < rng.choice((0.5, 0.8, 1.0))).to(torch.int64)
    for i in range(b):
        if rng.random() < 0.15:
            mask[i] = 0  # no action token at all
    hole = mask == 0
    behaviour[hole & (torch.rand(b, t, generator=g) < 0.3)] = float("nan")
    oldest: list[int | None] = []
    newest: list[int | None] = []
    for _ in range(b):
        if rng.random() < 0.08:
            oldest.append(None)
            newest.append(None)
            continue
        lo = max(0, cv - rng.choice((-1, 0, 0, 1, 1, 2, 3)))
        hi = lo + (rng.choice((1, 2)) if rng.random() < 0.3 else 0)  # a partial rollout
        oldest.append(lo)
        newest.append(hi)
    return (
        {"rollout_log_probs": behaviour, "old_log_probs": current, "response_mask": mask},
        oldest,
        newest,
        cv,
    )


def _dressed(raw: dict[str, Any], oldest: list[Any], newest: list[Any], kind: str) -> Any:
    versions = {
        "min_global_steps": np.array(oldest, dtype=object),
        "max_global_steps": np.array(newest, dtype=object),
    }
    if kind == "numpy":
        arrays = {k: v.float().numpy() for k, v in raw.items() if k != "response_mask"}
        return {**arrays, "response_mask": raw["response_mask"].numpy(), **versions}
    proto = DataProto.from_dict(tensors=dict(raw), non_tensors=versions)
    return proto.to_tensordict() if kind == "tensordict" else proto


def _reference(
    raw: dict[str, Any], oldest: list[Any], cv: int, max_lag: int, max_drift: float
) -> list[tuple[str, float | None]] | str:
    """Each row judged alone by the contract function, or the error it raises."""
    out: list[tuple[str, float | None]] = []
    bh = raw["rollout_log_probs"].float().tolist()
    cu = raw["old_log_probs"].float().tolist()
    ms = raw["response_mask"].bool().tolist()
    err = None
    for i, v in enumerate(oldest):
        try:  # an unversioned row is refused, but its tokens are still input to validate
            ref = assess_policy_compatibility(
                bh[i], cu[i], ms[i], cv if v is None else v, cv, max_lag, max_drift
            )
        except GateConfigError as exc:
            err = str(exc)
            continue
        if v is None:
            out.append((verl_adapter.MISSING_VERSION, None))
        else:
            out.append((str(ref["reason"]), ref["mean_abs_log_ratio"]))
    return err if err is not None else out


def fuzz_one(rng: random.Random) -> tuple[str, int, list[str]]:
    """One generated batch through the adapter and the reference: (kind, rows, disagreements)."""
    raw, oldest, newest, cv = _batch(rng)
    kind, dtype, mdt = rng.choice(KINDS), rng.choice(DTYPES), rng.choice(MASKS)
    if kind == "numpy":
        dtype = "float32"
    if dtype == "bfloat16":
        for k in ("rollout_log_probs", "old_log_probs"):
            raw[k] = raw[k].to(torch.bfloat16)
    raw["response_mask"] = raw["response_mask"].to(getattr(torch, mdt))
    if rng.random() < 0.1:  # a non-finite value where the mask is 1
        rows = [i for i in range(raw["response_mask"].shape[0]) if raw["response_mask"][i].any()]
        if rows:
            i = rng.choice(rows)
            j = int(torch.nonzero(raw["response_mask"][i])[0, 0])
            raw["old_log_probs"][i, j] = rng.choice((float("nan"), float("inf")))
    max_lag, max_drift = rng.choice((0, 1, 2)), rng.choice((0.1, 0.2, 0.5))
    label = f"{kind}/{dtype}/{mdt}"
    ref = _reference(raw, oldest, cv, max_lag, max_drift)
    try:
        got = verl_adapter.admission_mask(
            _dressed(raw, oldest, newest, kind),
            current_version=cv,
            max_lag=max_lag,
            max_drift=max_drift,
        )
    except GateConfigError as exc:
        if isinstance(ref, str):
            return label, len(oldest), []
        return (
            label,
            len(oldest),
            [f"{label}: the adapter refused a batch the reference judges: {exc}"],
        )
    if isinstance(ref, str):
        return (
            label,
            len(oldest),
            [f"{label}: the adapter judged a batch the reference refuses: {ref}"],
        )
    out = []
    keep = [bool(k) for k in np.asarray(torch.as_tensor(got.keep).cpu())]
    for i, (reason, drift) in enumerate(ref):
        near = drift is not None and abs(drift - max_drift) < 2e-2  # bf16 rounding
        if keep[i] != (reason == "ok") and not near:
            out.append(f"{label} row {i}: kept={keep[i]}, the reference says {reason}")
        if got.reasons[i] != reason and not near:
            out.append(f"{label} row {i}: reason {got.reasons[i]}, the reference says {reason}")
        if drift is not None and not math.isclose(
            float(got.drift[i]), drift, rel_tol=2e-2, abs_tol=2e-2
        ):
            out.append(f"{label} row {i}: drift {got.drift[i]:.4f}, reference {drift:.4f}")
    return label, len(oldest), out


def run_adapter_fuzz(seed: int = 0, examples: int = 200) -> dict[str, Any]:
    """`examples` generated batches; the report lists every disagreement."""
    rng = random.Random(seed)
    t0 = time.perf_counter()
    failures: list[str] = []
    kinds: set[str] = set()
    rows = 0
    for _ in range(examples):
        label, n, bad = fuzz_one(rng)
        kinds.add(label.split("/")[0])
        failures.extend(bad)
        rows += n
    return {
        "batches": examples,
        "rows": rows,
        "kinds": sorted(kinds),
        "failures": failures[:200],
        "elapsed_s": round(time.perf_counter() - t0, 2),
    }
