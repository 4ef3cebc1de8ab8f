"""The admission gate: lag and drift on one rollout and on a B x T batch, numpy and torch."""

from __future__ import annotations

import contextlib
import math
import tracemalloc
from typing import Any
from unittest import mock

import attrs
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from rollout_lifecycle.model import gate as gate_mod
from rollout_lifecycle.model.api import assess_policy_compatibility
from rollout_lifecycle.model.errors import GateConfigError
from rollout_lifecycle.model.gate import (
    AdmissionDecision,
    AdmissionGate,
    BatchAssessment,
    GatePolicy,
    RecordColumns,
    assess_arrays,
    classify_lag,
    lag_drift_decision,
)
from rollout_lifecycle.model.ledger import MemoryLedger
from rollout_lifecycle.model.records import (
    ActionEvidence,
    GenerationConditions,
    LedgerEntry,
    Reward,
    Rollout,
)
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


# every record check's outcome, and the lag/drift ones, for the batch-vs-single test below
CHECK_KINDS = (
    "ok",
    "tolerated",
    "stale",
    "future",
    "hash",
    "unregistered",
    "conditions",
    "missing",
    "misaligned",
    "empty",
    "drift",
)
OTHER_CONDITIONS = GenerationConditions(
    tokenizer_id="tok-v2", temperature=1.0, top_p=1.0, top_k=-1, max_tokens=64
)


def _checked_rollout(kind: str, state: str, i: int) -> Rollout:
    lp, m = [-0.1, -0.2], [True, True]
    rid = f"r{i}"
    if kind == "future":
        return make_rollout(rid, 7, lp, m, state=state)
    if kind == "hash":
        return make_rollout(rid, 4, lp, m, artifact_hash="evil", state=state)
    if kind == "conditions":
        return make_rollout(rid, 5, lp, m, conditions=OTHER_CONDITIONS, state=state)
    version = {"tolerated": 4, "stale": 1, "unregistered": 3}.get(kind, 5)
    lp = [-3.0, -3.0] if kind == "drift" else lp
    m = [False, False] if kind == "empty" else m
    ro = make_rollout(rid, version, lp, m, state=state)
    if kind == "missing":
        return attrs.evolve(ro, evidence=None)
    if kind == "misaligned":
        return attrs.evolve(ro, evidence=ActionEvidence([1, 2], [True], [-0.1, -0.1]))
    return ro


@given(
    st.lists(
        st.tuples(
            st.sampled_from(CHECK_KINDS), st.sampled_from(["rewarded", "generated", "reserved"])
        ),
        min_size=1,
        max_size=12,
    ),
    st.booleans(),
)
def test_batch_record_checks_equal_single(rows: list[tuple[str, str]], threaded: bool) -> None:
    """The batch's record checks (each field read over the whole batch, each distinct value
    judged once, flagged rows re-checked one by one) give every rollout exactly the
    decision the single path gives it, each check failing alone or behind another, and
    look up the registry for the versions of rewarded rollouts only."""
    registry = {v: f"hash-v{v}" for v in range(8) if v != 3}
    looked: list[int] = []

    def lookup(v: int) -> str | None:
        looked.append(v)
        return registry.get(v)

    g = AdmissionGate(
        GatePolicy(
            max_lag=2, max_drift=0.2, conditions=make_rollout("a", 5, [0.0], [True]).conditions
        ),
        registry=lookup,
    )
    ros = [_checked_rollout(kind, state, i) for i, (kind, state) in enumerate(rows)]
    cur = np.full((len(ros), 2), -0.15)
    current: Any = torch.from_numpy(cur) if threaded else cur
    batch = g.assess_batch(ros, current, 5)
    batch_looked = set(looked)
    assert batch_looked == {
        r.behavior.version for r in ros if r.status and r.status.state == "rewarded"
    }
    singles = [g.assess(ro, [-0.15, -0.15], 5) for ro in ros]
    for a, b in zip(batch, singles, strict=True):
        assert type(a) is AdmissionDecision
        assert (a.drift is None) == (b.drift is None)
        if a.drift is not None and b.drift is not None:
            assert a.drift == pytest.approx(b.drift, rel=1e-12)
        same = attrs.evolve(a, drift=b.drift)
        assert same == b and hash(same) == hash(b)
    kept = [ro for ro in ros if ro.evidence is not None]  # columns always carry evidence
    looked.clear()
    by_records = g.assess_batch(kept, current[: len(kept)], 5)
    records_looked = list(looked)
    looked.clear()
    assert g.assess_columns(_columns_of(kept, 2), current[: len(kept)], 5) == by_records
    assert looked == records_looked


def _columns_of(ros: list[Rollout], t: int) -> RecordColumns:
    """Rollouts (with evidence and status) as the gate's columns, arrays padded to T."""
    old = np.zeros((len(ros), t))
    mask = np.zeros((len(ros), t), np.bool_)
    for i, ro in enumerate(ros):
        assert ro.evidence is not None and ro.status is not None
        lp, m = ro.evidence.behavior_log_probs, ro.evidence.action_mask
        old[i, : lp.size], mask[i, : m.size] = lp, m
    return RecordColumns(
        rollout_ids=[ro.rollout_id for ro in ros],
        states=[ro.status.state for ro in ros if ro.status is not None],
        behavior_versions=[ro.behavior.version for ro in ros],
        artifact_hashes=[ro.behavior.artifact_hash for ro in ros],
        conditions=[ro.conditions for ro in ros],
        token_counts=[ro.evidence.response_token_ids.size for ro in ros if ro.evidence],
        mask_counts=[ro.evidence.action_mask.size for ro in ros if ro.evidence],
        log_prob_counts=[ro.evidence.behavior_log_probs.size for ro in ros if ro.evidence],
        old_log_probs=old,
        action_mask=mask,
    )


def test_columns_give_the_records_figures_to_the_bit() -> None:
    """assess_columns over right-padded arrays gives every decision of assess_batch over
    the same rows, drift to the bit (same kernel, blocks and dtypes), float32 and float64,
    numpy and torch current log-probs; columns of another length are refused."""
    rng = np.random.default_rng(3)
    g = gate()
    for dtype in (np.float32, np.float64):
        lengths = rng.integers(0, 300, 50)
        ros = [
            make_rollout(
                f"r{i}",
                int(rng.integers(0, 4)),
                rng.normal(-1, 0.5, n).astype(dtype),
                rng.random(n) < 0.8,
            )
            for i, n in enumerate(lengths.tolist())
        ]
        t = int(lengths.max())
        cur = rng.normal(-1, 0.5, (len(ros), t)).astype(dtype)
        cols = _columns_of(ros, t)
        cols = attrs.evolve(cols, old_log_probs=cols.old_log_probs.astype(dtype))
        for current in (cur, torch.from_numpy(cur)):
            assert g.assess_columns(cols, current, 3) == g.assess_batch(ros, current, 3)
    with pytest.raises(GateConfigError, match="columns must all hold"):
        g.assess_columns(attrs.evolve(cols, states=cols.states[:-1]), cur, 3)


def test_stamp_keeps_the_decision() -> None:
    """An admission decision's stamp carries what the spec re-checks at reservation."""
    d = gate().assess(make_rollout("a", 4, [-0.1], [True]), [-0.15], current_version=5)
    s = d.stamp()
    assert s.accepted and s.lag == 1 and s.max_lag == 1 and s.drift == pytest.approx(0.05)


# ---- the one-pass batch core against the plain-Python contract --------------------------

NONFINITE = st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -1e300])


@st.composite
def hard_batches(draw: Any) -> dict[str, Any]:
    """Batches with masked NaN/inf garbage, empty rows, and float32 or float64 values."""
    b = draw(batches(max_b=7, max_t=40))
    old, cur, mask = b["old"].copy(), b["cur"].copy(), b["mask"].copy()
    for i in draw(st.lists(st.integers(0, len(mask) - 1), max_size=3)):
        mask[i] = False  # whole empty rows
    masked = np.argwhere(~mask)
    if len(masked):
        picks = draw(st.lists(st.integers(0, len(masked) - 1), max_size=len(masked)))
        for k in picks:
            i, j = masked[k]
            arr = draw(st.sampled_from([old, cur]))
            arr[i, j] = draw(NONFINITE)
    dtype = draw(st.sampled_from([np.float64, np.float32]))
    with np.errstate(over="ignore"):
        old, cur = old.astype(dtype), cur.astype(dtype)
    mask_kind = draw(st.sampled_from(["bool", "int64", "int32", "uint8"]))
    m = mask if mask_kind == "bool" else mask.astype(mask_kind)
    return {"old": old, "cur": cur, "mask": m, "bool_mask": mask, "bvs": b["bvs"]}


def reference_rows(b: dict[str, Any], cv: int, max_lag: int, dmax: float) -> list[dict[str, Any]]:
    """lag_drift_decision, in plain Python, on every row (float32 values taken exactly)."""
    return [
        lag_drift_decision(
            b["old"][i].tolist(),
            b["cur"][i].tolist(),
            b["bool_mask"][i].tolist(),
            int(b["bvs"][i]),
            cv,
            max_lag,
            dmax,
        )
        for i in range(len(b["bvs"]))
    ]


def assert_rows_agree(
    got: BatchAssessment, want: list[dict[str, Any]], dmax: float, float32: bool
) -> None:
    """Same reason, freshness and drift per row; float32 inputs allow their own rounding."""
    rel = 4e-7 if float32 else 1e-12
    for i, w in enumerate(want):
        g = got.row(i)
        assert g["freshness"] == w["freshness"], i
        if w["mean_abs_log_ratio"] is None:
            assert g["mean_abs_log_ratio"] is None and g["reason"] == w["reason"], i
            continue
        assert g["mean_abs_log_ratio"] == pytest.approx(
            w["mean_abs_log_ratio"], rel=rel, abs=1e-300
        )
        near_bound = abs(w["mean_abs_log_ratio"] - dmax) <= rel * max(dmax, 1e-300)
        if not (float32 and near_bound and w["reason"] in ("ok", "policy_drift")):
            assert g["reason"] == w["reason"] and g["accepted"] == w["accepted"], i


# small blocks split rows into several blocks and single rows into column chunks
BLOCKS = st.sampled_from([None, 1, 3, 8, 16, 64])


@contextlib.contextmanager
def block_size(n: int | None, threads_from: int | None = None) -> Any:
    with contextlib.ExitStack() as stack:
        if n is not None:
            stack.enter_context(mock.patch.object(gate_mod, "_CPU_BLOCK", n))
            stack.enter_context(mock.patch.object(gate_mod, "_TORCH_CPU_BLOCK", n))
        if threads_from is not None:
            stack.enter_context(mock.patch.object(gate_mod, "_THREADS_FROM", threads_from))
        yield


@given(hard_batches(), versions, lags, drift_bounds, BLOCKS)
def test_numpy_core_agrees_with_plain_python(
    b: dict[str, Any], cv: int, max_lag: int, dmax: float, block: int | None
) -> None:
    """numpy: every row as lag_drift_decision decides it, masked garbage and empty rows too."""
    with block_size(block):
        got = assess_arrays(b["old"], b["cur"], b["mask"], b["bvs"], cv, max_lag, dmax)
    assert_rows_agree(got, reference_rows(b, cv, max_lag, dmax), dmax, b["old"].dtype == np.float32)


@given(hard_batches(), versions, lags, drift_bounds, BLOCKS, st.sampled_from(["views", "torch"]))
def test_torch_core_agrees_with_plain_python(
    b: dict[str, Any], cv: int, max_lag: int, dmax: float, block: int | None, kernel: str
) -> None:
    """torch: CPU tensors through numpy views (threaded) and through torch's own kernels."""
    old, cur, mask = (torch.from_numpy(np.ascontiguousarray(b[k])) for k in ("old", "cur", "mask"))
    with contextlib.ExitStack() as stack:
        stack.enter_context(block_size(block, threads_from=1))
        if kernel == "torch":  # the kernel an accelerator runs, here on the CPU
            stack.enter_context(mock.patch.object(gate_mod, "_numpy_viewable", lambda _t: ()))
        got = assess_arrays(old, cur, mask, torch.from_numpy(b["bvs"]), cv, max_lag, dmax)
    assert_rows_agree(got, reference_rows(b, cv, max_lag, dmax), dmax, b["old"].dtype == np.float32)


@pytest.mark.parametrize("kernel", ["numpy", "views", "torch"])
def test_float32_overflow_is_not_a_nonfinite_input(kernel: str) -> None:
    """Finite float32 values whose difference overflows float32 still give the exact drift."""
    old = np.array([[-3e38, -1.0], [-1.0, -1.0]], np.float32)
    cur = np.array([[3e38, -1.0], [-1.5, -1.0]], np.float32)
    mask = np.array([[True, True], [True, False]])
    want = (6e38 + 0.0) / 2  # what the plain-Python reference computes
    args: tuple[Any, ...] = (old, cur, mask)
    with contextlib.ExitStack() as stack:
        if kernel != "numpy":
            args = tuple(torch.from_numpy(a) for a in args)
        if kernel == "torch":
            stack.enter_context(mock.patch.object(gate_mod, "_numpy_viewable", lambda _t: ()))
        res = assess_arrays(*args, np.array([1, 1]), 1, 0, 0.1)
    ref = lag_drift_decision(old[0].tolist(), cur[0].tolist(), [True, True], 1, 1, 0, 0.1)
    assert res.drift[0] == pytest.approx(ref["mean_abs_log_ratio"], rel=1e-7)
    assert res.drift[0] == pytest.approx(want, rel=1e-7)
    assert res.reasons == ("policy_drift", "policy_drift") and res.drift[1] == 0.5


def test_float64_overflow_is_infinite_drift_as_in_python() -> None:
    """Finite float64 values whose difference is not finite: drift inf, like the reference."""
    old, cur = np.array([[-1.7e308, 0.0]]), np.array([[1.7e308, 0.0]])
    mask = np.array([[True, True]])
    res = assess_arrays(old, cur, mask, [0], 0, 0, 1.0)
    ref = lag_drift_decision(old[0].tolist(), cur[0].tolist(), [True, True], 0, 0, 0, 1.0)
    assert res.drift[0] == ref["mean_abs_log_ratio"] == math.inf
    assert res.reasons[0] == ref["reason"] == "policy_drift"


@pytest.mark.parametrize("block", [None, 4])
def test_integer_mask_checked_in_every_block(block: int | None) -> None:
    """A 2 (or -1) anywhere in an integer mask is refused, also in a late block."""
    mask = np.ones((6, 4), np.int64)
    mask[5, 3] = 2
    for lib in ("numpy", "torch", "torch-kernel"):
        m: Any = mask if lib == "numpy" else torch.from_numpy(mask)
        o: Any = np.zeros((6, 4)) if lib == "numpy" else torch.zeros(6, 4, dtype=torch.float64)
        with contextlib.ExitStack() as stack:
            stack.enter_context(block_size(block))
            if lib == "torch-kernel":
                stack.enter_context(mock.patch.object(gate_mod, "_numpy_viewable", lambda _t: ()))
            with pytest.raises(GateConfigError, match="only 0 and 1"):
                assess_arrays(o, o, m, np.zeros(6, np.int64), 0, 0, 0.1)
            m2 = mask.copy()
            m2[5, 3] = -1
            with pytest.raises(GateConfigError, match="only 0 and 1"):
                assess_arrays(
                    o,
                    o,
                    m2 if lib == "numpy" else torch.from_numpy(m2),
                    np.zeros(6, int),
                    0,
                    0,
                    0.1,
                )


def test_scratch_memory_is_small() -> None:
    """Peak extra memory (tracemalloc) stays a small fraction of the inputs, numpy path."""
    rng = np.random.default_rng(0)
    old = rng.normal(-1, 0.3, (256, 2048)).astype(np.float32)
    cur = old + np.float32(0.01)
    mask = rng.random((256, 2048)) < 0.7
    inputs = old.nbytes + cur.nbytes + mask.nbytes
    tracemalloc.start()
    try:
        assess_arrays(old, cur, mask, np.zeros(256, np.int64), 0, 0, 0.1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 0.1 * inputs, (peak, inputs)


# ---- the records path --------------------------------------------------------------------


@st.composite
def record_batches(draw: Any) -> tuple[list[Rollout], np.ndarray, dict[str, Any]]:
    """Rollouts of ragged lengths holding arrays, and the right-padded current log-probs."""
    b = draw(hard_batches())
    n_rows, t = b["bool_mask"].shape
    lengths = draw(st.lists(st.integers(0, t), min_size=n_rows, max_size=n_rows))
    form = draw(st.sampled_from(["numpy", "torch", "lists"]))
    ros = []
    for i, n in enumerate(lengths):
        lp, m = b["old"][i, :n], b["bool_mask"][i, :n]
        if form == "torch":
            ev_args: tuple[Any, Any, Any] = (
                torch.arange(n),
                torch.from_numpy(m),
                torch.from_numpy(lp),
            )
        elif form == "lists":
            ev_args = (list(range(n)), m.tolist(), lp.tolist())
        else:
            ev_args = (np.arange(n), m, lp)
        ro = make_rollout(f"r{i}", int(b["bvs"][i]), [0.0], [True])
        ros.append(attrs.evolve(ro, evidence=ActionEvidence(*ev_args)))
    pad = draw(st.sampled_from([0.0, math.nan, math.inf]))
    cur = b["cur"].copy()
    mask = b["bool_mask"].copy()
    for i, n in enumerate(lengths):
        cur[i, n:] = pad
        mask[i, n:] = False
    old = b["old"].copy()
    old[~mask] = 0.0
    if form == "lists":
        old = old.astype(np.float64)
    return ros, cur, {"old": old, "cur": cur, "bool_mask": mask, "bvs": b["bvs"]}


@given(record_batches(), versions, lags, drift_bounds, BLOCKS, st.sampled_from(["numpy", "torch"]))
def test_records_path_agrees_with_plain_python(
    data: tuple[list[Rollout], np.ndarray, dict[str, Any]],
    cv: int,
    max_lag: int,
    dmax: float,
    block: int | None,
    lib: str,
) -> None:
    """assess_batch over records holding arrays decides each rollout as the plain-Python
    single path (`assess`, i.e. lag_drift_decision on Python lists) does."""
    ros, cur, _ = data
    g = gate(registry=None, max_lag=max_lag, max_drift=dmax)
    current: Any = cur if lib == "numpy" else torch.from_numpy(cur)
    with block_size(block, threads_from=1):
        decisions = g.assess_batch(ros, current, cv)
    singles = []
    for i, ro in enumerate(ros):
        assert ro.evidence is not None
        n = ro.evidence.behavior_log_probs.size
        singles.append(g.assess(ro, cur[i, :n].tolist(), cv))
    float32 = cur.dtype == np.float32 and all(
        r.evidence is not None and r.evidence.behavior_log_probs.dtype == np.float32 for r in ros
    )
    rel = 4e-7 if float32 else 1e-12
    for d, w in zip(decisions, singles, strict=True):
        assert (d.rollout_id, d.freshness, d.lag) == (w.rollout_id, w.freshness, w.lag)
        if w.drift is None:
            assert d.drift is None and (d.reason, d.route) == (w.reason, w.route)
            continue
        assert d.drift == pytest.approx(w.drift, rel=rel, abs=1e-300)
        near_bound = abs(w.drift - dmax) <= rel * max(dmax, 1e-300)
        if not (float32 and near_bound):
            assert (d.reason, d.route, d.accepted) == (w.reason, w.route, w.accepted)


def test_records_path_names_rollouts_with_nonfinite_actions() -> None:
    """A NaN at an action position of a record (or of the current row) names that rollout."""
    ros = [
        make_rollout("ok", 1, [-0.1, -0.2], [True, True]),
        make_rollout("bad", 1, [-0.1, math.nan], [True, True]),
        make_rollout("masked", 1, [-0.1, math.nan], [True, False]),
    ]
    cur = np.full((3, 4), -0.1)
    with pytest.raises(GateConfigError, match=r"row\(s\) \[1\] \(rollouts \['bad'\]\)"):
        gate().assess_batch(ros, cur, 1)
    cur2 = np.full((2, 2), -0.1)
    cur2[0, 1] = math.inf
    with pytest.raises(GateConfigError, match=r"rollouts \['ok'\]"):
        gate().assess_batch([ros[0], ros[2]], torch.from_numpy(cur2), 1)


# ---- where a rollout stands: entries, a ledger, or its status; never a guess --------------


def _bare(rid: str, version: int = 1) -> Rollout:
    return attrs.evolve(make_rollout(rid, version, [-0.1], [True]), status=None)


def test_no_state_anywhere_is_an_error_not_a_rejection() -> None:
    """Without entries, ledger or status the gate refuses to guess (it used to say
    not_finished for everything)."""
    ros = [_bare("a"), _bare("b")]
    with pytest.raises(GateConfigError, match=r"no ledger state for 2 rollout\(s\)"):
        gate().assess_batch(ros, np.full((2, 1), -0.1), 1)
    with pytest.raises(GateConfigError, match="no ledger state"):
        gate().assess(ros[0], [-0.1], 1)


def test_state_read_from_a_ledger() -> None:
    """With ledger=, each rollout's state is what the ledger holds now."""
    led = MemoryLedger()
    ros = [_bare("a"), _bare("b"), _bare("c")]
    for ro in ros:
        led.add(ro)
    for rid in ("a", "b"):
        led.transition(rid, "generation_done", 0)
    led.transition("a", "reward_ready", 1, reward=Reward("rm", "1", 1.0))
    d = gate().assess_batch(ros, np.full((3, 1), -0.1), 1, ledger=led)
    assert [x.reason for x in d] == ["ok", "not_finished", "not_finished"]
    assert gate().assess(ros[0], [-0.1], 1, ledger=led).reason == "ok"
    with pytest.raises(GateConfigError, match=r"not in the ledger \(\['zz'\]\)"):
        gate().assess_batch([_bare("zz")], np.full((1, 1), -0.1), 1, ledger=led)
    with pytest.raises(GateConfigError, match="not both"):
        gate().assess_batch(ros, np.full((3, 1), -0.1), 1, [None] * 3, ledger=led)


def test_entries_still_work_and_fall_back_to_status() -> None:
    """entries= is used as given; a None there falls back to the record's status."""
    with_status = make_rollout("s", 1, [-0.1], [True], state="reserved")
    bare = _bare("b")
    entry = LedgerEntry(
        "b", 1, "hash-v1", state="rewarded", revision=3, reward=Reward("rm", "1", 1.0)
    )
    d = gate().assess_batch([with_status, bare], np.full((2, 1), -0.1), 1, [None, entry])
    assert [x.reason for x in d] == ["already_reserved", "ok"]
    with pytest.raises(GateConfigError, match="belongs to 'b'"):
        gate().assess_batch([with_status], np.full((1, 1), -0.1), 1, [entry])
    with pytest.raises(GateConfigError, match="1 entries for 2 rollouts"):
        gate().assess_batch([with_status, bare], np.full((2, 1), -0.1), 1, [entry])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_records_path_with_narrow_current_tensors(dtype: str) -> None:
    """bfloat16 / float16 current log-probs (torch's own kernels, as on an accelerator)."""
    rng = np.random.default_rng(1)
    ros, rows = [], []
    for i in range(5):
        n = int(rng.integers(1, 9))
        lp = rng.normal(-1, 0.3, n).round(2).tolist()
        m = (rng.random(n) < 0.7).tolist()
        ros.append(make_rollout(f"r{i}", 4, lp, m))
        rows.append((np.array(lp) + rng.normal(0, 0.1, n)).tolist())
    cur = torch.zeros(5, 8, dtype=getattr(torch, dtype))
    for i, r in enumerate(rows):
        cur[i, : len(r)] = torch.tensor(r)
    g = gate(registry=None, max_drift=0.08)
    batch = g.assess_batch(ros, cur, 4)
    exact = cur.double().numpy()
    singles = [g.assess(ro, exact[i, : len(rows[i])].tolist(), 4) for i, ro in enumerate(ros)]
    for d, w in zip(batch, singles, strict=True):
        assert (d.freshness, d.drift is None) == (w.freshness, w.drift is None)
        if w.drift is not None:
            assert d.drift == pytest.approx(w.drift, rel=1e-6, abs=1e-9)
            if abs(w.drift - 0.08) > 1e-6:
                assert d.reason == w.reason


@pytest.mark.parametrize("kernel", ["numpy", "views", "torch"])
@pytest.mark.parametrize("width", [256, 1024, 1000])
def test_wide_rows_through_float32_partial_sums(kernel: str, width: int) -> None:
    """Rows wide enough for the float32 partial sums (and one that is not a multiple of
    them) stay within float32 rounding of the plain-Python reference."""
    rng = np.random.default_rng(width)
    old = rng.normal(-2, 1.5, (6, width)).astype(np.float32)
    cur = (old + rng.normal(0, 0.05, (6, width))).astype(np.float32)
    mask = rng.random((6, width)) < 0.6
    mask[2] = False
    old[~mask & (rng.random((6, width)) < 0.3)] = np.nan
    args: tuple[Any, ...] = (old, cur, mask)
    with contextlib.ExitStack() as stack:
        if kernel != "numpy":
            args = tuple(torch.from_numpy(a) for a in args)
        if kernel == "torch":
            stack.enter_context(mock.patch.object(gate_mod, "_numpy_viewable", lambda _t: ()))
        res = assess_arrays(*args, np.zeros(6, np.int64), 0, 0, 0.05)
    b = {"old": old, "cur": cur, "bool_mask": mask, "bvs": np.zeros(6, np.int64)}
    assert_rows_agree(res, reference_rows(b, 0, 0, 0.05), 0.05, float32=True)
    assert res.reasons[2] == "empty_action_mask"


# ---- bfloat16 / float16 CPU tensors: widened block by block into the numpy kernel -----------

NARROW_PAIRS = [
    ("bfloat16", "bfloat16"),
    ("float16", "float16"),
    ("bfloat16", "float32"),
    ("float32", "float16"),
    ("float64", "bfloat16"),
    ("float16", "bfloat16"),
]


@pytest.mark.parametrize(("old_dtype", "cur_dtype"), NARROW_PAIRS)
@pytest.mark.parametrize("block", [None, 5, 64])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_narrow_tensors_agree_with_the_torch_kernel_and_python(
    old_dtype: str, cur_dtype: str, block: int | None, threads: int
) -> None:
    """bfloat16 / float16 CPU tensors (alone or mixed with wider ones) go through the numpy
    kernel, widened block by block: the same decisions as torch's own kernel and as the
    plain-Python reference on the exactly widened values, masked NaN/inf garbage included,
    on one thread and several."""
    rng = np.random.default_rng(7)
    b, t = 9, 70
    old = rng.normal(-2, 1, (b, t))
    cur = old + rng.normal(0, 0.08, (b, t))
    mask = rng.random((b, t)) < 0.6
    mask[3] = False
    old[~mask & (rng.random((b, t)) < 0.2)] = np.nan
    cur[~mask & (rng.random((b, t)) < 0.2)] = -np.inf
    o = torch.from_numpy(old).to(getattr(torch, old_dtype))
    c = torch.from_numpy(cur).to(getattr(torch, cur_dtype))
    m = torch.from_numpy(mask)
    bvs = rng.integers(0, 3, b)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with block_size(block, threads_from=1):
            got = assess_arrays(o, c, m, bvs, 2, 1, 0.05)
            with mock.patch.object(gate_mod, "_numpy_viewable", lambda _t: ()):
                kernel = assess_arrays(o, c, m, bvs, 2, 1, 0.05)
    finally:
        torch.set_num_threads(before)
    assert got.reasons == kernel.reasons and got.freshness == kernel.freshness
    np.testing.assert_allclose(got.drift, kernel.drift, rtol=1e-6, equal_nan=True)
    exact = {
        "old": o.double().numpy(),
        "cur": c.double().numpy(),
        "bool_mask": mask,
        "bvs": bvs,
    }
    wide = torch.float64 in (o.dtype, c.dtype)
    assert_rows_agree(got, reference_rows(exact, 2, 1, 0.05), 0.05, float32=not wide)
    assert got.reasons[3] == "empty_action_mask"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_narrow_tensors_nonfinite_and_int_masks(dtype: str) -> None:
    """NaN/inf at an action position of a narrow tensor raises naming the row; an integer
    mask must hold only 0 and 1, as everywhere else."""
    old = torch.full((4, 300), -1.0, dtype=getattr(torch, dtype))
    cur = old.clone()
    mask = torch.ones(4, 300, dtype=torch.bool)
    cur[2, 299] = math.inf
    with pytest.raises(GateConfigError, match=r"row\(s\) \[2\]"):
        assess_arrays(old, cur, mask, np.zeros(4, np.int64), 0, 0, 0.1)
    cur[2, 299] = -1.0
    ints = torch.ones(4, 300, dtype=torch.int64)
    ints[3, 7] = 2
    with block_size(64), pytest.raises(GateConfigError, match="only 0 and 1"):
        assess_arrays(old, cur, ints, np.zeros(4, np.int64), 0, 0, 0.1)
    ints[3, 7] = 1
    res = assess_arrays(old, cur, ints, np.zeros(4, np.int64), 0, 0, 0.1)
    assert res.reasons == ("ok",) * 4 and res.drift.tolist() == [0.0] * 4


@pytest.mark.parametrize(("piece", "block"), [(None, None), (200, None), (7, None), (40, 64)])
@pytest.mark.parametrize("threads", [2, 3])
def test_float16_widened_in_pieces_is_the_one_thread_result(
    piece: int | None, block: int | None, threads: int
) -> None:
    """With several torch threads float16 is widened by torch's copy in pieces small enough
    to run on the calling thread (whole rows, or column chunks of a row wider than a
    piece): the very same sums as one thread's single copy per block, masked garbage too."""
    rng = np.random.default_rng(11)
    b, t = 13, 90
    old = rng.normal(-2, 1, (b, t))
    cur = old + rng.normal(0, 0.08, (b, t))
    mask = rng.random((b, t)) < 0.6
    o, c = (torch.from_numpy(a).to(torch.float16) for a in (old, cur))
    m = torch.from_numpy(mask)
    bvs = np.zeros(b, np.int64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with block_size(block):
            want = assess_arrays(o, c, m, bvs, 0, 0, 0.05)
        torch.set_num_threads(threads)
        with contextlib.ExitStack() as stack:
            stack.enter_context(block_size(block, threads_from=1))
            if piece is not None:
                stack.enter_context(mock.patch.object(gate_mod, "_TORCH_INLINE", piece))
            got = assess_arrays(o, c, m, bvs, 0, 0, 0.05)
    finally:
        torch.set_num_threads(before)
    np.testing.assert_array_equal(got.drift, want.drift)
    assert got.reasons == want.reasons


def _nested(depth: int) -> Any:
    v: Any = [0]
    for _ in range(depth):
        v = [v]
    return v


@pytest.mark.parametrize("versions", [_nested(70), [[1], [1, 2]]], ids=["too-deep", "ragged"])
def test_behavior_versions_numpy_cannot_read_are_a_typed_error(versions: Any) -> None:
    """Versions numpy itself refuses (nested past 64 levels, ragged) are a GateConfigError
    naming behavior_versions, not numpy's bare ValueError (found by test_boundary_fuzz)."""
    b = 1 if len(versions) == 1 else 2
    with pytest.raises(GateConfigError, match="behavior_versions must be a vector"):
        assess_arrays(
            np.zeros((b, 3)), np.zeros((b, 3)), np.ones((b, 3), bool), versions, 1, 1, 0.2
        )


# ---- the records path's blocks and its columnar result ---------------------------------------


def _ragged_rollouts(
    seed: int, dtypes: tuple[Any, ...], n: int = 40, failing: bool = True
) -> list[Rollout]:
    """Rollouts of 0..300 tokens, log-probs of the given dtypes in turn, some of them
    failing a record check (stale, not finished, misaligned, no evidence) unless not
    `failing` (then every one passes them: no row of the batch is None)."""
    rng = np.random.default_rng(seed)
    ros = []
    for i in range(n):
        k = int(rng.integers(0, 300))
        lp: Any = rng.normal(-1, 0.5, k).astype(dtypes[i % len(dtypes)])
        m: Any = rng.random(k) < 0.8
        ro = make_rollout(f"r{i}", int(rng.integers(2 if failing else 3, 6)), lp, m)
        if not failing:
            pass
        elif i % 7 == 3:
            ro = make_rollout(f"r{i}", 5, lp, m, state="generated")
        elif i % 11 == 5:
            ro = attrs.evolve(ro, evidence=None)
        elif i % 13 == 6:
            ro = attrs.evolve(ro, evidence=ActionEvidence([1, 2], [True], [-0.1, -0.1]))
        ros.append(ro)
    return ros


@pytest.mark.parametrize(
    "dtypes", [(np.float32,), (np.float64,), (np.float32, np.float64)], ids=["f32", "f64", "mixed"]
)
@pytest.mark.parametrize("block", [None, 1, 300, 1000])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("row_by_row", [False, True], ids=["joined", "row-by-row"])
@pytest.mark.parametrize("failing", [True, False], ids=["some-fail", "all-pass"])
@pytest.mark.parametrize("t", [300, 512], ids=["T300", "T512"])
def test_records_blocks_give_the_padded_figures_to_the_bit(
    dtypes: tuple[Any, ...],
    block: int | None,
    split: bool,
    row_by_row: bool,
    failing: bool,
    t: int,
) -> None:
    """However the records' blocks are laid out (bytes.join of one dtype, np.concatenate of
    mixed dtypes, long rows subtracted row by row, float32 long rows packed to their own
    256-token chunks (T512), rows wider than a block in column chunks, failed rows as
    padding or none failed, on one thread or split across several), assess_batch's
    figures are those of the same kernel over the rows padded by hand (`_padded_sums`,
    the column path's), to the bit, and the plain-Python figures within rounding."""
    ros = _ragged_rollouts(len(dtypes) + (block or 0), dtypes, failing=failing)
    g = gate(registry=None, max_drift=0.45, max_lag=2)
    rng = np.random.default_rng(7)
    b = len(ros)
    cur64 = rng.normal(-1, 0.5, (b, t))
    for cur in (cur64, cur64.astype(np.float32), torch.from_numpy(cur64.astype(np.float32))):
        with contextlib.ExitStack() as stack:
            stack.enter_context(block_size(block, threads_from=1))
            if row_by_row:  # as rows of _ROWLOOP_FROM tokens and more are
                stack.enter_context(mock.patch.object(gate_mod, "_ROWLOOP_FROM", 0))
            if split:  # several Python threads whatever torch's own thread count
                stack.enter_context(mock.patch.object(gate_mod, "_SPLIT_FROM_THREADS", 1))
                stack.enter_context(mock.patch.object(torch, "get_num_threads", lambda: 3))
            got = g.assess_batch(ros, cur, 5)
            kept = [i for i, d in enumerate(got) if d.drift is not None]
            assert len(kept) > b // 2
            wide = np.float64 in dtypes
            old = np.zeros((b, t), np.float64 if wide else np.float32)
            mask = np.zeros((b, t), np.bool_)
            for i in kept:
                ev = ros[i].evidence
                assert ev is not None
                n = ev.behavior_log_probs.size
                old[i, :n], mask[i, :n] = ev.behavior_log_probs, ev.action_mask
            sums, counts = gate_mod._padded_sums(old, mask, cur, [r.rollout_id for r in ros])
        assert [got[i].drift for i in kept] == (sums[kept] / counts[kept]).tolist()
        host = np.asarray(cur, np.float64)
        for i in kept:
            n = int(counts[i] and ros[i].evidence.behavior_log_probs.size)  # type: ignore[union-attr]
            want = g.assess(ros[i], host[i, :n].tolist(), 5)
            assert got[i].drift == pytest.approx(want.drift, rel=4e-7)
            assert got[i].reason == want.reason or abs(want.drift - 0.45) < 1e-6  # type: ignore[operator]


@pytest.mark.parametrize("t", [256, 1024, 4096])
def test_float32_long_rows_are_summed_over_their_own_chunks(t: int) -> None:
    """Long float32 rows on one thread go through `_ragged_sums` (each row laid out to its
    last 256-token chunk, not to T), and its figures are the padded kernel's to the bit:
    rows of whole chunks and of one token past them, empty and failed rows, blocks of one
    row, and (T = 4096) more partials than numpy's reduction buffer holds (B x T / 256 >
    8192). With float64 current log-probs it is not used (its partials are float32)."""
    rng = np.random.default_rng(t)
    b = 600 if t == 4096 else 300
    lengths = rng.integers(t // 2, t + 1, b)
    lengths[:6] = [t, 256, 257 % t, 1, 0, t - 1]
    ros = [
        make_rollout(f"r{i}", 5, rng.normal(-1, 0.5, n).astype(np.float32), rng.random(n) < 0.8)
        for i, n in enumerate(lengths.tolist())
    ]
    ros[7] = make_rollout("r7", 5, [-0.1, -0.1], [True, True], state="generated")
    old = np.zeros((b, t), np.float32)
    mask = np.zeros((b, t), np.bool_)
    for i, ro in enumerate(ros):
        ev = ro.evidence
        if i != 7 and ev is not None:
            n = ev.behavior_log_probs.size
            old[i, :n], mask[i, :n] = ev.behavior_log_probs, ev.action_mask
    ids = [ro.rollout_id for ro in ros]
    cur32 = rng.normal(-1, 0.5, (b, t)).astype(np.float32)
    g = gate(registry=None, max_drift=0.45, max_lag=2)
    for cur, block, used in ((cur32, None, 1), (cur32, t, 1), (cur32.astype(np.float64), None, 0)):
        with (
            block_size(block),  # None: the default blocks; t: blocks of one row
            mock.patch.object(gate_mod, "_ROWLOOP_FROM", t // 2),  # these rows: 3/4 T on average
            mock.patch.object(gate_mod, "_ragged_sums", wraps=gate_mod._ragged_sums) as spy,
        ):
            got = g.assess_batch(ros, cur, 5)
            sums, counts = gate_mod._padded_sums(old, mask, cur, ids)
        assert spy.call_count == used
        with np.errstate(invalid="ignore"):
            want = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
        drift = np.array([np.nan if d.drift is None else d.drift for d in got])
        assert drift.tobytes() == want.tobytes()
        assert got[4].reason == "empty_action_mask" and got[7].reason == "not_finished"


def test_decisions_are_a_sequence_built_when_read() -> None:
    """assess_batch returns a read-only Sequence[AdmissionDecision]: len, index, slice,
    iteration, `in`, reversed, index/count, equality with the list of the same decisions
    (either side), `+` with a list, stamps; no AdmissionDecision exists before one is read."""
    ros = [
        make_rollout("a", 5, [-0.1, -0.2], [True, True]),
        make_rollout("b", 2, [-0.1], [True]),
        make_rollout("c", 5, [-0.1], [True], state="generated"),
        make_rollout("d", 5, [-3.0], [True]),
    ]
    cur = np.full((4, 2), -0.15)
    g = gate(max_lag=1)
    singles = [g.assess(ro, [-0.15] * ro.evidence.behavior_log_probs.size, 5) for ro in ros]  # type: ignore[union-attr]
    built: list[Any] = []
    real_init = AdmissionDecision.__init__

    def counting(self: Any, *a: Any, **kw: Any) -> None:
        built.append(self)
        real_init(self, *a, **kw)

    with mock.patch.object(AdmissionDecision, "__init__", counting):
        got = g.assess_batch(ros, cur, 5)
        assert built == [] and len(got) == 4
        assert got[1] == singles[1] and got[-1] == singles[3] and len(built) == 2
    assert isinstance(got, gate_mod.AdmissionDecisions) and not isinstance(got, list)
    assert [d.reason for d in got] == ["ok", "stale_policy", "not_finished", "policy_drift"]
    for a, b in zip(got, singles, strict=True):
        assert a.drift == pytest.approx(b.drift) if b.drift is not None else a.drift is None
        assert attrs.evolve(a, drift=b.drift) == b
        assert a.stamp() == attrs.evolve(b, drift=a.drift).stamp()
    same = [attrs.evolve(a) for a in got]
    assert got == same and same == got
    assert not got != same  # noqa: SIM202  (__ne__ from __eq__)
    assert got != same[:3] and got != tuple(same) and got != "abcd"
    first = next(iter(got))
    assert next(iter(got)) is first  # iterated once, kept
    assert got[1:3] == same[1:3] and isinstance(got[1:3], gate_mod.AdmissionDecisions)
    assert got[::-1] == same[::-1] == list(reversed(got))
    assert got[10:] == [] and len(got[10:]) == 0
    assert same[2] in got and got.index(same[2]) == 2 and got.count(same[0]) == 1
    assert got + same[:1] == [*same, same[0]] and same[:1] + got == [same[0], *same]
    assert isinstance(got + [], list) and got + got == same + same  # noqa: RUF005
    with pytest.raises(IndexError):
        got[4]
    with pytest.raises(TypeError):
        hash(got)
    with pytest.raises(TypeError):
        got[0] = same[0]  # type: ignore[index]
    assert repr(got).startswith("AdmissionDecisions([AdmissionDecision(rollout_id='a'")
    assert g.assess_batch([], np.zeros((0, 3)), 5) == []


def test_decisions_read_one_by_one_equal_the_iterated_ones() -> None:
    """An item read by index before any iteration equals the one iteration builds, for
    every field, on the column path too."""
    ros = _ragged_rollouts(5, (np.float32,), n=25)
    cur = np.random.default_rng(2).normal(-1, 0.5, (25, 300)).astype(np.float32)
    g = gate(max_lag=2, max_drift=0.45)
    one_by_one = [g.assess_batch(ros, cur, 5)[i] for i in range(25)]
    assert one_by_one == list(g.assess_batch(ros, cur, 5))
    kept = [ro for ro in ros if ro.evidence is not None and ro.status.state == "rewarded"]  # type: ignore[union-attr]
    cols = _columns_of(kept, 300)
    cols = attrs.evolve(cols, old_log_probs=cols.old_log_probs.astype(np.float32))
    lazily = g.assess_columns(cols, cur[: len(kept)], 5)
    assert [lazily[i] for i in range(len(kept))] == list(lazily)


def test_records_pads_are_kept_for_a_few_widths_only() -> None:
    """The zero pads the records path keeps between calls stay bounded (a few row widths,
    one view per length seen) and give the same decisions as a fresh start."""
    gate_mod._PADS.clear()
    ros = [make_rollout(f"r{i}", 5, [-0.1] * (i + 1), [True] * (i + 1)) for i in range(3)]
    g = gate()
    first = None
    for t in range(3, 3 + 2 * gate_mod._PADS_KEPT):
        got = g.assess_batch(ros, np.full((3, t), -0.15, np.float32), 5)
        first = first or got
        assert got == first
        assert len(gate_mod._PADS) <= gate_mod._PADS_KEPT
        assert all(len(pads) <= t + 1 for _, pads in gate_mod._PADS.values())
