"""Records built from what RL code holds: ActionEvidence from arrays, tensors, lists, scalars."""

from __future__ import annotations

import json
import math
from typing import Any, cast

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_lifecycle.model.errors import InvalidRecord
from rollout_lifecycle.model.records import (
    ActionEvidence,
    Rollout,
    check_int64,
    from_jsonable,
    ints64_pass,
    text_problem,
    texts_pass,
    to_jsonable,
)
from tests.strategies import make_rollout

torch = pytest.importorskip("torch")

IDS = [5, 6, 7, 8]
MASK = [False, True, True, False]
LPS = [-0.5, -1.25, float("nan"), -0.75]


def forms() -> dict[str, tuple[Any, Any, Any]]:
    """The same evidence as each kind of container RL code has."""
    return {
        "lists": (IDS, MASK, LPS),
        "tuples": (tuple(IDS), tuple(MASK), tuple(LPS)),
        "numpy": (np.array(IDS), np.array(MASK), np.array(LPS)),
        "numpy int32 ids, uint8 mask, float32": (
            np.array(IDS, np.int32),
            np.array(MASK, np.uint8),
            np.array(LPS, np.float32),
        ),
        "numpy scalars": (
            [np.int64(i) for i in IDS],
            [np.bool_(m) for m in MASK],
            [np.float32(x) for x in LPS],
        ),
        "0/1 int mask list": (IDS, [int(m) for m in MASK], LPS),
        "torch": (torch.tensor(IDS), torch.tensor(MASK), torch.tensor(LPS)),
        "torch int mask, bfloat16": (
            torch.tensor(IDS, dtype=torch.int32),
            torch.tensor(MASK, dtype=torch.int64),
            torch.tensor(LPS, dtype=torch.bfloat16),
        ),
        "generator": (iter(IDS), (m for m in MASK), iter(LPS)),
    }


@pytest.mark.parametrize("name", list(forms()))
def test_every_form_gives_the_same_read_only_arrays(name: str) -> None:
    """Each form becomes int64 ids, a bool mask and float log-probs, all read-only, equal."""
    ev = ActionEvidence(*forms()[name])
    assert ev.response_token_ids.dtype == np.int64
    assert ev.action_mask.dtype == np.bool_
    assert ev.behavior_log_probs.dtype in (np.float32, np.float64)
    for arr in (ev.response_token_ids, ev.action_mask, ev.behavior_log_probs):
        assert not arr.flags.writeable and arr.ndim == 1
        with pytest.raises(ValueError, match="read-only"):
            arr[0] = 0
    assert ev.response_token_ids.tolist() == IDS
    assert ev.action_mask.tolist() == MASK
    reference = ActionEvidence(IDS, MASK, LPS)
    if "bfloat16" in name:  # bfloat16 rounds -1.25 and -0.75 exactly, -0.5 too: all equal
        assert np.array_equal(ev.behavior_log_probs, reference.behavior_log_probs, equal_nan=True)
    assert ev == reference and hash(ev) == hash(reference)


def test_log_prob_dtype_rule() -> None:
    """float32 (and narrower) stays float32; Python floats, ints and float64 are float64."""
    f32 = ActionEvidence(IDS, MASK, np.array(LPS, np.float32)).behavior_log_probs
    f16 = ActionEvidence(IDS, MASK, np.array(LPS, np.float16)).behavior_log_probs
    bf16 = ActionEvidence(IDS, MASK, torch.tensor(LPS, dtype=torch.bfloat16)).behavior_log_probs
    assert f32.dtype == f16.dtype == bf16.dtype == np.float32
    assert ActionEvidence(IDS, MASK, LPS).behavior_log_probs.dtype == np.float64
    assert ActionEvidence(IDS, MASK, [0, -1, -2, -3]).behavior_log_probs.dtype == np.float64
    assert ActionEvidence(IDS, MASK, np.array(LPS)).behavior_log_probs.dtype == np.float64


def test_converted_once_the_source_can_change_afterwards() -> None:
    """The record holds its own copy: mutating the caller's array or tensor changes nothing."""
    lp = np.array([-1.0, -2.0])
    t = torch.tensor([True, False])
    ev = ActionEvidence(np.array([1, 2]), t, lp)
    lp[0] = 99.0
    t[1] = True
    assert ev.behavior_log_probs.tolist() == [-1.0, -2.0]
    assert ev.action_mask.tolist() == [True, False]


def test_evolve_keeps_the_arrays_it_made() -> None:
    """attrs.evolve re-runs the converters; the record's own frozen arrays are not copied."""
    ev = ActionEvidence(IDS, MASK, LPS)
    moved = attrs.evolve(ev, action_mask=[True, True, True, True])
    assert moved.behavior_log_probs is ev.behavior_log_probs
    assert moved.response_token_ids is ev.response_token_ids


class _NoIteration(np.ndarray):
    """An array that fails if anything walks it element by element in Python."""

    def __iter__(self) -> Any:
        raise AssertionError("iterated in Python")

    def tolist(self) -> Any:
        raise AssertionError("converted to a list")


def test_large_arrays_are_never_walked_in_python() -> None:
    """Conversion and validation of arrays are vectorised: no per-element Python work."""
    n = 100_000
    ids = np.arange(n).view(_NoIteration)
    mask = (np.arange(n) % 3 == 0).astype(np.int8).view(_NoIteration)
    lps = np.linspace(-5, 0, n, dtype=np.float32).view(_NoIteration)
    ev = ActionEvidence(ids, mask, lps)
    assert ev.response_token_ids.size == n and int(ev.action_mask.sum()) == (n + 2) // 3
    assert type(ev.behavior_log_probs) is np.ndarray


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (([1, True, 3], MASK[:3], LPS[:3]), r"response_token_ids\[1\] must be an int, got True"),
        (([1, 2.5], [True, True], [0.0, 0.0]), r"response_token_ids\[1\] must be an int"),
        ((np.array([1.0, 2.0]), [True, True], [0.0, 0.0]), "must hold integers"),
        ((np.array([2**63], np.uint64), [True], [0.0]), r"response_token_ids\[0\] does not fit"),
        (([1, 2, 3], [True, 0, 2], [0.0] * 3), r"action_mask\[2\] must be a boolean \(or 0/1\)"),
        (([1, 2], np.array([0, -1]), [0.0] * 2), r"action_mask\[1\] must be a boolean"),
        (([1, 2], [1.0, 0.0], [0.0] * 2), r"action_mask\[0\] must be a boolean"),
        (([1, 2], np.array([1.0, 0.0]), [0.0] * 2), "booleans or 0/1 integers"),
        (([1, 2], [True, True], [0.0, "x"]), r"behavior_log_probs\[1\] must be a number, got 'x'"),
        (([1, 2], [True, True], [0.0, False]), r"behavior_log_probs\[1\] must be a number"),
        (([1, 2], [True, True], np.array([True, False])), "real numbers"),
        (([1, 2], [True, True], [0.0, None]), r"behavior_log_probs\[1\] must be a number"),
        ((np.zeros((2, 2), int), [True], [0.0]), "must be 1-D"),
        (([1], torch.ones(1, 1, dtype=torch.bool), [0.0]), "must be 1-D"),
        (("abc", [True], [0.0]), "must be a 1-D sequence or array"),
        (([1], [True], 0.5), "must be a 1-D sequence or array"),
    ],
)
def test_bad_evidence_names_the_position(args: tuple[Any, Any, Any], needle: str) -> None:
    """Wrong types or values are InvalidRecord errors that say which element is wrong."""
    with pytest.raises(InvalidRecord, match=needle):
        ActionEvidence(*args)


def test_empty_evidence_is_a_record() -> None:
    """Empty sequences give empty arrays of the right dtypes (the gate judges emptiness)."""
    ev = ActionEvidence([], [], [])
    assert ev.response_token_ids.dtype == np.int64 and ev.action_mask.dtype == np.bool_
    assert ev == ActionEvidence(np.zeros(0, np.int32), torch.zeros(0, dtype=torch.bool), ())


def test_equality_is_by_value() -> None:
    """Equal values are equal (NaN too, across dtypes); any differing element is not."""
    a = ActionEvidence(IDS, MASK, LPS)
    assert a == ActionEvidence(IDS, MASK, np.array(LPS, np.float32))
    assert a != ActionEvidence([5, 6, 7, 9], MASK, LPS)
    assert a != ActionEvidence(IDS, [True, True, True, False], LPS)
    assert a != ActionEvidence(IDS, MASK, [-0.5, -1.25, float("nan"), -0.7])
    assert a != ActionEvidence(IDS, MASK, [-0.5, -1.25, 0.0, -0.75])  # NaN is not 0
    assert a != ActionEvidence(IDS[:3], MASK[:3], LPS[:3])
    assert a != "not evidence" and a is not None


def test_records_holding_evidence_stay_hashable_and_comparable() -> None:
    """Rollouts compare and hash through their evidence (sets and dict keys work)."""
    r1 = make_rollout("a", 1, [-0.1, -0.2], [True, False])
    r2 = attrs.evolve(
        r1,
        evidence=ActionEvidence(np.array([0, 1]), np.array([1, 0]), np.array([-0.1, -0.2])),
    )
    assert r1 == r2 and len({r1, r2}) == 1
    r3 = attrs.evolve(r1, evidence=ActionEvidence([0, 1], [True, True], [-0.1, -0.2]))
    assert r1 != r3


def test_json_round_trip_uses_lists() -> None:
    """to_jsonable writes plain lists; from_jsonable rebuilds an equal record."""
    ev = ActionEvidence(np.array(IDS), torch.tensor(MASK), np.array(LPS, np.float32))
    data = to_jsonable(ev)
    assert all(type(v) is list for v in data.values())
    assert data["response_token_ids"] == IDS and data["action_mask"] == MASK
    lps = data["behavior_log_probs"]
    assert all(type(x) is float for x in lps) and math.isnan(lps[2])
    assert lps[:2] + lps[3:] == [-0.5, -1.25, -0.75]
    text = json.dumps(data)
    assert from_jsonable(ActionEvidence, json.loads(text)) == ev
    ro = make_rollout("r", 2, [-0.5, -1.0, -2.0], [True, False, True])
    again = from_jsonable(Rollout, json.loads(json.dumps(to_jsonable(ro))))
    assert again == ro


lp_values = st.floats(allow_nan=True, allow_infinity=True, width=32)


@given(
    st.lists(st.tuples(st.integers(-(2**40), 2**40), st.booleans(), lp_values), max_size=40),
    st.sampled_from(["lists", "numpy", "torch", "float32"]),
)
def test_any_evidence_round_trips(rows: list[tuple[int, bool, float]], form: str) -> None:
    """Built from any form, evidence equals its list form and survives JSON unchanged."""
    ids = [r[0] for r in rows]
    mask = [r[1] for r in rows]
    lps = [r[2] for r in rows]
    ref = ActionEvidence(ids, mask, lps)
    if form == "numpy":
        ev = ActionEvidence(np.array(ids, np.int64), np.array(mask, bool), np.array(lps))
    elif form == "torch":
        ev = ActionEvidence(
            torch.tensor(ids, dtype=torch.int64),
            torch.tensor(mask, dtype=torch.bool),
            torch.tensor(lps, dtype=torch.float64),
        )
    elif form == "float32":
        ev = ActionEvidence(ids, [int(m) for m in mask], np.array(lps, np.float32))
    else:
        ev = ref
    assert ev == ref and hash(ev) == hash(ref)
    back = from_jsonable(ActionEvidence, json.loads(json.dumps(to_jsonable(ev))))
    assert back == ev
    assert back.behavior_log_probs.dtype == np.float64  # JSON numbers come back as float64


def test_entry_fast_jsonable_equals_the_generic_walk() -> None:
    """The written-out LedgerEntry converter gives exactly what the generic walk gives."""
    import attrs as _attrs

    from rollout_lifecycle.model.records import (
        AdmissionStamp,
        Disposition,
        LedgerEntry,
        Reward,
        _entry_jsonable,
    )

    def generic(obj: object) -> object:
        if _attrs.has(type(obj)):
            return {
                f.name: generic(getattr(obj, f.name))
                for f in _attrs.fields(cast(Any, type(obj)))
                # fields added later are written only where set (older JSON stays exact)
                if not (f.metadata.get("omit_default") and getattr(obj, f.name) == f.default)
            }
        return obj

    e = LedgerEntry(
        "r",
        3,
        "h",
        state="reserved",
        revision=2,
        reserved_by="u",
        lease_expires_at=5.0,
        reward=Reward("rm", "1", 0.5),
        admission=AdmissionStamp(3, 3, 1, 0.2, 0.01, "fresh", "ok", True),
        releases=1,
    )
    assert _entry_jsonable(e) == generic(e)
    q = LedgerEntry("q", 0, "h", state="quarantined", disposition=Disposition("admission", "x"))
    assert _entry_jsonable(q) == generic(q)
    paced = LedgerEntry("p", 0, "h", state="generated", chain="prompt-1", attempt=2, tokens=7)
    assert _entry_jsonable(paced) == generic(paced)
    assert list(_entry_jsonable(paced)) == [f.name for f in _attrs.fields(LedgerEntry)]
    assert "chain" not in _entry_jsonable(e) and "tokens" not in _entry_jsonable(e)


_TEXTS = st.one_of(
    st.text(max_size=6),
    st.text(alphabet=st.characters(), min_size=1, max_size=3),
    st.sampled_from(["a", "\x00", "\ud800", "é", "x" * 300]),
    st.integers(0, 3),
    st.none(),
)


@given(st.lists(_TEXTS, max_size=6))
def test_texts_pass_is_text_problem_on_every_value(values: list[Any]) -> None:
    """The column check passes a column exactly when every value passes text_problem."""
    assert texts_pass(values) == all(text_problem(v) is None for v in values)


@given(st.lists(st.one_of(st.integers(-2, 2**64), st.booleans(), st.floats(0, 1)), max_size=5))
def test_ints64_pass_is_check_int64_on_every_value(values: list[Any]) -> None:
    """The column check passes a column exactly when check_int64 accepts every value."""

    def ok(v: Any) -> bool:
        try:
            check_int64(v, "v")
        except InvalidRecord:
            return False
        return True

    assert ints64_pass(values) == all(map(ok, values))
