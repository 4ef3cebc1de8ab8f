"""The admission gate: lag and drift on one rollout and on a B x T batch, numpy and torch."""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from rollout_lifecycle.model.api import assess_policy_compatibility
from rollout_lifecycle.model.errors import GateConfigError
from rollout_lifecycle.model.gate import (
    AdmissionGate,
    GatePolicy,
    assess_arrays,
    classify_lag,
)
from rollout_lifecycle.model.records import ActionEvidence, GenerationConditions
from tests.strategies import any_float, batches, drift_bounds, lags, make_rollout, versions

torch = pytest.importorskip("torch")


def row_single(b: dict[str, Any], i: int, cv: int, max_lag: int, dmax: float) -> dict[str, Any]:
    return assess_policy_compatibility(
        b["old"][i].tolist(),
        b["cur"][i].tolist(),
        [bool(m) for m in b["mask"][i]],
        int(b["bvs"][i]),
        cv,
        max_lag,
        dmax,
    )


@given(batches(), versions, lags, drift_bounds)
def test_batch_and_single_agree(b: dict[str, Any], cv: int, max_lag: int, dmax: float) -> None:
    """The vectorised batch and the plain-Python single decision agree on every row."""
    res = assess_arrays(b["old"], b["cur"], b["mask"], b["bvs"], cv, max_lag, dmax)
    for i in range(len(res)):
        single = row_single(b, i, cv, max_lag, dmax)
        got = res.row(i)
        assert got["reason"] == single["reason"]
        assert got["accepted"] == single["accepted"]
        assert got["freshness"] == single["freshness"]
        if single["mean_abs_log_ratio"] is None:
            assert got["mean_abs_log_ratio"] is None
        else:
            assert got["mean_abs_log_ratio"] == pytest.approx(
                single["mean_abs_log_ratio"], rel=1e-12, abs=1e-12
            )


@given(batches(), versions, lags, drift_bounds, st.data())
def test_masked_values_never_matter(
    b: dict[str, Any], cv: int, max_lag: int, dmax: float, data: st.DataObject
) -> None:
    """Replacing every masked value (even by NaN or inf) leaves every decision unchanged."""
    base = assess_arrays(b["old"], b["cur"], b["mask"], b["bvs"], cv, max_lag, dmax)
    n = int((~b["mask"]).sum())
    fill_old = data.draw(st.lists(any_float, min_size=n, max_size=n))
    fill_cur = data.draw(st.lists(any_float, min_size=n, max_size=n))
    old, cur = b["old"].copy(), b["cur"].copy()
    old[~b["mask"]] = fill_old
    cur[~b["mask"]] = fill_cur
    res = assess_arrays(old, cur, b["mask"], b["bvs"], cv, max_lag, dmax)
    assert res.reasons == base.reasons
    np.testing.assert_array_equal(res.accepted, base.accepted)
    np.testing.assert_array_equal(res.drift, base.drift)


@given(batches(), versions, lags, drift_bounds)
def test_numpy_and_torch_agree(b: dict[str, Any], cv: int, max_lag: int, dmax: float) -> None:
    """numpy arrays and torch tensors (float32 and float64, bool and int masks) agree."""
    ref = assess_arrays(b["old"], b["cur"], b["mask"], b["bvs"], cv, max_lag, dmax)
    t = assess_arrays(
        torch.tensor(b["old"]),
        torch.tensor(b["cur"]),
        torch.tensor(b["mask"]),
        torch.tensor(b["bvs"]),
        cv,
        max_lag,
        dmax,
    )
    assert t.reasons == ref.reasons and t.freshness == ref.freshness
    np.testing.assert_allclose(t.drift, ref.drift, rtol=1e-12, equal_nan=True)
    t32 = assess_arrays(
        torch.tensor(b["old"], dtype=torch.float32),
        torch.tensor(b["cur"], dtype=torch.float32),
        torch.tensor(b["mask"].astype(np.int64)),
        b["bvs"],
        cv,
        max_lag,
        dmax,
    )
    np32 = assess_arrays(
        b["old"].astype(np.float32),
        b["cur"].astype(np.float32),
        b["mask"].astype(np.int64),
        b["bvs"],
        cv,
        max_lag,
        dmax,
    )
    assert t32.reasons == np32.reasons
    np.testing.assert_allclose(t32.drift, np32.drift, rtol=1e-6, equal_nan=True)


@given(batches(), versions, st.sampled_from([math.nan, math.inf, -math.inf]), st.data())
def test_nonfinite_at_action_is_error(
    b: dict[str, Any], cv: int, bad: float, data: st.DataObject
) -> None:
    """NaN/inf at an action position raises, naming the row, for numpy and torch."""
    assume(b["mask"].any())
    idx = np.argwhere(b["mask"])
    i, j = idx[data.draw(st.integers(0, len(idx) - 1))]
    which = data.draw(st.sampled_from(["old", "cur"]))
    arr = b[which].copy()
    arr[i, j] = bad
    args = dict(b, **{which: arr})
    with pytest.raises(GateConfigError, match=rf"row\(s\) \[.*{i}.*\]"):
        assess_arrays(args["old"], args["cur"], b["mask"], b["bvs"], cv, 1, 0.1)
    with pytest.raises(GateConfigError, match="non-finite"):
        assess_arrays(
            torch.tensor(args["old"]),
            torch.tensor(args["cur"]),
            torch.tensor(b["mask"]),
            b["bvs"],
            cv,
            1,
            0.1,
        )


@given(st.integers(-20, 20), lags)
def test_lag_classes_at_every_boundary(lag: int, max_lag: int) -> None:
    """future < 0 = fresh < tolerated <= L_max < stale, at every boundary."""
    got = classify_lag(lag, max_lag)
    if lag < 0:
        assert got == "future"
    elif lag == 0:
        assert got == "fresh"
    elif lag <= max_lag:
        assert got == "tolerated"
    else:
        assert got == "stale"


@given(versions, lags)
def test_admitted_versions_are_a_window_of_lmax_plus_one(cv: int, max_lag: int) -> None:
    """Exactly L_max + 1 behaviour versions are admitted (just one when L_max = 0)."""
    bvs = np.arange(0, cv + 5, dtype=np.int64)
    b = len(bvs)
    res = assess_arrays(
        np.zeros((b, 2)), np.zeros((b, 2)), np.ones((b, 2), dtype=bool), bvs, cv, max_lag, 0.0
    )
    admitted = bvs[res.accepted].tolist()
    assert admitted == [v for v in range(max(0, cv - max_lag), cv + 1)]


@pytest.mark.parametrize(
    ("old", "cur", "mask", "bvs", "match"),
    [
        (np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3), bool), [0, 0], "same shape"),
        (np.zeros(3), np.zeros(3), np.ones(3, bool), [0], "B x T"),
        (np.zeros((1, 3)), np.zeros((1, 3)), np.ones((1, 3)), [0], "bool or 0/1"),
        (np.zeros((1, 3)), np.zeros((1, 3)), np.array([[0, 2, 1]]), [0], "only 0 and 1"),
        (np.zeros((1, 3), int), np.zeros((1, 3)), np.ones((1, 3), bool), [0], "floating"),
        (np.zeros((2, 3)), np.zeros((2, 3)), np.ones((2, 3), bool), [0], "length B=2"),
        (np.zeros((1, 3)), np.zeros((1, 3)), np.ones((1, 3), bool), [-1], "non-negative"),
        (np.zeros((1, 3)), np.zeros((1, 3)), np.ones((1, 3), bool), [0.5], "non-negative"),
    ],
)
def test_batch_input_errors(old: Any, cur: Any, mask: Any, bvs: Any, match: str) -> None:
    """Shape, dtype and version mistakes are typed errors with a message that says what to fix."""
    with pytest.raises(GateConfigError, match=match):
        assess_arrays(old, cur, mask, np.asarray(bvs), 0, 1, 0.1)


def test_torch_is_not_imported_by_the_gate() -> None:
    """The gate module never imports torch itself (it uses a tensor's own module)."""
    import ast
    import pathlib

    src = pathlib.Path("model/gate.py").read_text()
    names = {a.name for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Import) for a in n.names}
    froms = {n.module for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom)}
    assert "torch" not in names and "torch" not in froms


# ---- the full gate over records ---------------------------------------------------------

REG = {v: f"hash-v{v}" for v in range(0, 6)}


def gate(**kw: Any) -> AdmissionGate:
    pol = GatePolicy(
        max_lag=kw.pop("max_lag", 1),
        max_drift=kw.pop("max_drift", 0.2),
        conditions=kw.pop("conditions", None),
    )
    return AdmissionGate(pol, registry=kw.pop("registry", REG))


def test_gate_routes() -> None:
    """Each refusal goes where section 3 says: stale offline, future/unregistered/contradiction
    quarantine, unfinished waits, the rest rejected."""
    g = gate()
    lp, m = [-0.1, -0.2], [True, True]
    cases = {
        "ok": (make_rollout("a", 5, lp, m), "admit"),
        "stale_policy": (make_rollout("b", 2, lp, m), "offline"),
        "future_policy": (make_rollout("c", 7, lp, m, artifact_hash="x"), "quarantine"),
        "artifact_hash_mismatch": (make_rollout("d", 4, lp, m, artifact_hash="evil"), "quarantine"),
        "not_finished": (make_rollout("e", 5, lp, m, state="generated"), "wait"),
        "already_reserved": (make_rollout("f", 5, lp, m, state="reserved"), "reject"),
        "already_consumed": (make_rollout("g", 5, lp, m, state="consumed"), "reject"),
        "terminal_state": (make_rollout("h", 5, lp, m, state="reward_timed_out"), "reject"),
        "empty_action_mask": (make_rollout("i", 5, lp, [False, False]), "reject"),
    }
    for reason, (ro, route) in cases.items():
        d = g.assess(ro, [-0.1, -0.2], current_version=5)
        assert (d.reason, d.route, d.accepted) == (reason, route, reason == "ok"), reason
    g2 = gate(registry={5: "hash-v5"})
    d = g2.assess(make_rollout("u", 4, lp, m), [-0.1, -0.2], current_version=5)
    assert (d.reason, d.route) == ("unregistered_version", "quarantine")


def test_gate_conditions_and_evidence() -> None:
    """Mismatched conditions and missing/misaligned evidence are rejected with their own reason."""
    other = GenerationConditions(
        tokenizer_id="tok-v2", temperature=1.0, top_p=1.0, top_k=-1, max_tokens=64
    )
    g = gate(conditions=make_rollout("a", 5, [0.0], [True]).conditions)
    d = g.assess(make_rollout("a", 5, [-0.1], [True], conditions=other), [-0.1], 5)
    assert d.reason == "conditions_mismatch"
    ro = make_rollout("b", 5, [-0.1, -0.1], [True, True])
    bad = attrs.evolve(ro, evidence=ActionEvidence([1, 2], [True], [-0.1, -0.1]))
    assert g.assess(bad, [-0.1, -0.1], 5).reason == "evidence_misaligned"
    assert g.assess(attrs.evolve(ro, evidence=None), [-0.1, -0.1], 5).reason == "missing_evidence"


TOKEN = st.tuples(st.floats(-5, 0), st.floats(-5, 0), st.booleans())


@given(
    st.lists(st.tuples(versions, st.lists(TOKEN, min_size=1, max_size=6)), min_size=1, max_size=5),
    versions,
)
def test_gate_batch_equals_single(
    rows: list[tuple[int, list[tuple[float, float, bool]]]], cv: int
) -> None:
    """The gate's batch path and single path give the same decision per rollout."""
    g = gate(registry=None)
    ros, curs = [], []
    for k, (v, toks) in enumerate(rows):
        ros.append(make_rollout(f"r{k}", v, [t[0] for t in toks], [t[2] for t in toks]))
        curs.append([t[1] for t in toks])
    t = max(len(c) for c in curs)
    cur = np.full((len(ros), t), np.nan)
    for i, c in enumerate(curs):
        cur[i, : len(c)] = c
    batch = g.assess_batch(ros, cur, cv)
    singles = [g.assess(r, c, cv) for r, c in zip(ros, curs, strict=True)]
    assert [(d.reason, d.accepted, d.freshness) for d in batch] == [
        (d.reason, d.accepted, d.freshness) for d in singles
    ]
    for a, b in zip(batch, singles, strict=True):
        assert (a.drift is None) == (b.drift is None)
        if a.drift is not None and b.drift is not None:
            assert a.drift == pytest.approx(b.drift, abs=1e-12)
    tb = g.assess_batch(ros, torch.tensor(cur), cv)
    assert [d.reason for d in tb] == [d.reason for d in batch]


def test_stamp_keeps_the_decision() -> None:
    """An admission decision's stamp carries what the spec re-checks at reservation."""
    d = gate().assess(make_rollout("a", 4, [-0.1], [True]), [-0.15], current_version=5)
    s = d.stamp()
    assert s.accepted and s.lag == 1 and s.max_lag == 1 and s.drift == pytest.approx(0.05)
