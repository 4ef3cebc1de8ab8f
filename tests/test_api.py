"""The four functions of CONTRACT section 5, case by case."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from rollout_lifecycle.model import (
    activate_policy_version,
    assess_policy_compatibility,
    compare_and_reserve,
    transition_lifecycle,
)

# ---- transition_lifecycle -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "event", "dest"),
    [
        ("generated", "reward_ready", "rewarded"),
        ("rewarded", "reserve", "reserved"),
        ("reserved", "commit", "consumed"),
        ("reserved", "abort", "rewarded"),
    ],
)
def test_lifecycle_legal_pairs(state: str, event: str, dest: str) -> None:
    """The contract's four legal pairs go where section 5 says."""
    assert transition_lifecycle(state, event) == dest


@pytest.mark.parametrize(
    ("state", "event"),
    [
        ("generated", "reserve"),
        ("rewarded", "commit"),
        ("consumed", "reserve"),
        ("consumed", "abort"),
        ("rewarded", "reward_ready"),
        ("reward_timed_out", "reserve"),
        ("nonsense", "reserve"),
        ("rewarded", "nonsense"),
    ],
)
def test_lifecycle_illegal_pairs_raise(state: str, event: str) -> None:
    """Any pair the machine does not allow raises ValueError."""
    with pytest.raises(ValueError):
        transition_lifecycle(state, event)


def test_lifecycle_non_string_raises() -> None:
    """Non-string arguments are a ValueError, not a KeyError or TypeError."""
    with pytest.raises(ValueError):
        transition_lifecycle(None, "reserve")  # type: ignore[arg-type]


# ---- assess_policy_compatibility --------------------------------------------------------------

OLD = [-0.2, -0.2, -9.0]
CUR = [-0.21, -0.19, 9.0]
MASK = [True, True, False]


def assess(**kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        old_log_probs=OLD,
        current_log_probs=CUR,
        action_mask=MASK,
        behavior_version=3,
        current_version=3,
        max_lag=1,
        max_mean_abs_log_ratio=0.05,
    )
    args.update(kw)
    return assess_policy_compatibility(**args)


def test_contract_example() -> None:
    """The worked example: masked position ignored, ratio 0.01, fresh and accepted."""
    r = assess()
    assert r["accepted"] is True and r["reason"] == "ok" and r["freshness"] == "fresh"
    assert r["mean_abs_log_ratio"] == pytest.approx(0.01)
    assert set(r) >= {"accepted", "reason", "freshness", "mean_abs_log_ratio"}


@pytest.mark.parametrize(
    ("bv", "cv", "freshness", "reason", "accepted"),
    [
        (4, 3, "future", "future_policy", False),
        (3, 3, "fresh", "ok", True),
        (2, 3, "tolerated", "ok", True),
        (1, 3, "stale", "stale_policy", False),
    ],
)
def test_freshness_classes(bv: int, cv: int, freshness: str, reason: str, accepted: bool) -> None:
    """future / fresh / tolerated / stale as in section 3, with the ratio still reported."""
    r = assess(behavior_version=bv, current_version=cv)
    assert (r["freshness"], r["reason"], r["accepted"]) == (freshness, reason, accepted)
    assert r["mean_abs_log_ratio"] == pytest.approx(0.01)


def test_drift_over_bound() -> None:
    """Drift over D_max is 'policy_drift', even for a fresh rollout."""
    r = assess(max_mean_abs_log_ratio=0.005)
    assert r == {
        "accepted": False,
        "reason": "policy_drift",
        "freshness": "fresh",
        "mean_abs_log_ratio": pytest.approx(0.01),
    }


def test_drift_at_bound_is_admitted() -> None:
    """D_beh == D_max is admitted (the bound is inclusive)."""
    r = assess(
        old_log_probs=[0.0], current_log_probs=[0.5], action_mask=[True], max_mean_abs_log_ratio=0.5
    )
    assert r["accepted"] is True


def test_empty_action_mask() -> None:
    """No action position: its own rejection, freshness and ratio None."""
    r = assess(action_mask=[False, False, False])
    assert r == {
        "accepted": False,
        "reason": "empty_action_mask",
        "freshness": None,
        "mean_abs_log_ratio": None,
    }
    r = assess(old_log_probs=[], current_log_probs=[], action_mask=[])
    assert r["reason"] == "empty_action_mask"


def test_masked_nonfinite_ignored() -> None:
    """NaN or inf at a masked position does not count and does not raise."""
    r = assess(old_log_probs=[-0.2, -0.2, math.nan], current_log_probs=[-0.21, -0.19, math.inf])
    assert r["accepted"] is True and r["mean_abs_log_ratio"] == pytest.approx(0.01)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("which", ["old_log_probs", "current_log_probs"])
def test_nonfinite_at_action_position_raises(bad: float, which: str) -> None:
    """A non-finite log-prob at an action position is a ValueError."""
    vals = [-0.2, bad, -9.0]
    with pytest.raises(ValueError, match="non-finite"):
        assess(**{which: vals})


@pytest.mark.parametrize(
    "kw",
    [
        {"behavior_version": -1},
        {"current_version": -1},
        {"behavior_version": True},
        {"current_version": False},
        {"behavior_version": 1.0},
        {"current_version": "3"},
        {"behavior_version": None},
        {"max_lag": -1},
        {"max_mean_abs_log_ratio": -0.1},
        {"max_mean_abs_log_ratio": math.nan},
        {"max_mean_abs_log_ratio": math.inf},
        {"current_log_probs": [-0.2, -0.2]},
        {"action_mask": [True, True]},
        {"old_log_probs": [-0.2]},
        {"action_mask": [1, 1, 0]},
        {"action_mask": [True, "yes", False]},
        {"action_mask": [True, None, False]},
    ],
)
def test_assess_value_errors(kw: dict[str, Any]) -> None:
    """Every input section 5 calls invalid is a ValueError."""
    with pytest.raises(ValueError):
        assess(**kw)


def test_lag_zero_admits_exactly_one_version() -> None:
    """With L_max = 0 only Δv = 0 is admitted (peer bug: off-by-one admitted two policies)."""
    admitted = [
        bv
        for bv in range(0, 8)
        if assess(behavior_version=bv, current_version=5, max_lag=0)["accepted"]
    ]
    assert admitted == [5]


# ---- compare_and_reserve ----------------------------------------------------------------------


def ledger() -> dict[str, dict[str, Any]]:
    return {
        "r1": {"lifecycle_state": "rewarded", "revision": 4, "reserved_by": None, "extra": 1},
        "r2": {"lifecycle_state": "generated", "revision": 1, "reserved_by": None},
        "r3": {"lifecycle_state": "reserved", "revision": 7, "reserved_by": "u9"},
        "r4": {"lifecycle_state": "consumed", "revision": 9, "reserved_by": None},
    }


def test_reserve_success_replaces_entry() -> None:
    """Success replaces the entry with a new dict: reserved, owner set, revision + 1."""
    led = ledger()
    old = led["r1"]
    snapshot = copy.deepcopy(old)
    r = compare_and_reserve(led, "r1", 4, "u1")
    assert r["reserved"] is True and r["reason"] == "reserved"
    assert led["r1"] is not old and old == snapshot
    assert led["r1"] == {
        "lifecycle_state": "reserved",
        "revision": 5,
        "reserved_by": "u1",
        "extra": 1,
    }
    assert r["record"] == led["r1"] and r["record"] is not led["r1"]


def test_reserve_idempotent_retry() -> None:
    """The same update retrying: reserved True, idempotent_retry, no change at all."""
    led = ledger()
    compare_and_reserve(led, "r1", 4, "u1")
    before = copy.deepcopy(led)
    entry = led["r1"]
    r = compare_and_reserve(led, "r1", 4, "u1")
    assert (r["reserved"], r["reason"]) == (True, "idempotent_retry")
    assert led == before and led["r1"] is entry and r["record"] is not entry


def test_reserve_revision_conflict_checked_before_state() -> None:
    """A stale revision is 'revision_conflict' even when the state is also wrong; untouched."""
    led = ledger()
    before = copy.deepcopy(led)
    for rid, rev in [("r1", 3), ("r2", 0), ("r4", 8)]:
        r = compare_and_reserve(led, rid, rev, "u1")
        assert (r["reserved"], r["reason"]) == (False, "revision_conflict")
        assert r["record"] == led[rid] and r["record"] is not led[rid]
    assert led == before


def test_reserve_conflicting_writer_never_overwrites() -> None:
    """Another update cannot take a reserved rollout, whatever revision it sends."""
    led = ledger()
    before = copy.deepcopy(led)
    r = compare_and_reserve(led, "r3", 7, "u1")
    assert (r["reserved"], r["reason"]) == (False, "not_rewarded")
    assert led == before


@pytest.mark.parametrize(("rid", "rev"), [("r2", 1), ("r4", 9)])
def test_reserve_not_rewarded(rid: str, rev: int) -> None:
    """Right revision but not in 'rewarded': 'not_rewarded', untouched."""
    led = ledger()
    before = copy.deepcopy(led)
    r = compare_and_reserve(led, rid, rev, "u1")
    assert (r["reserved"], r["reason"]) == (False, "not_rewarded")
    assert led == before


def test_reserve_missing() -> None:
    """Unknown id: 'missing_rollout', record None."""
    assert compare_and_reserve(ledger(), "nope", 0, "u1") == {
        "reserved": False,
        "reason": "missing_rollout",
        "record": None,
    }


@pytest.mark.parametrize("uid", ["", None, 3])
def test_reserve_empty_update_id(uid: Any) -> None:
    """An empty (or non-string) update_id is a ValueError, ledger untouched."""
    led = ledger()
    before = copy.deepcopy(led)
    with pytest.raises(ValueError):
        compare_and_reserve(led, "r1", 4, uid)
    assert led == before


def test_reserve_record_is_a_copy() -> None:
    """Mutating the returned record never reaches the ledger."""
    led = ledger()
    r = compare_and_reserve(led, "r1", 4, "u1")
    r["record"]["lifecycle_state"] = "consumed"
    assert led["r1"]["lifecycle_state"] == "reserved"


# ---- activate_policy_version ----------------------------------------------------------------

PTR = {"version": 3, "artifact_hash": "h3"}
ART = {"version": 4, "artifact_hash": "h4", "committed": True}
WORKERS = {"w1": {"version": 4, "artifact_hash": "h4"}, "w2": {"version": 4, "artifact_hash": "h4"}}


def activate(**kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        active_pointer=PTR, artifact=ART, worker_states=WORKERS, required_workers=["w2", "w1"]
    )
    args.update(kw)
    return activate_policy_version(**args)


def test_activated_on_all_acks() -> None:
    """Committed, newer, every required worker on the same version and hash: activated."""
    ptr = dict(PTR)
    r = activate(active_pointer=ptr)
    assert r == {
        "activated": True,
        "reason": "activated",
        "active_pointer": {"version": 4, "artifact_hash": "h4"},
        "missing_workers": [],
        "mismatched_workers": [],
    }
    assert ptr == PTR


def test_not_committed_first() -> None:
    """An uncommitted artifact is refused first, even if other reasons also apply."""
    r = activate(artifact={**ART, "committed": False, "version": 2}, worker_states={})
    assert r["reason"] == "artifact_not_committed" and r["activated"] is False
    assert r["active_pointer"] == PTR


@pytest.mark.parametrize("v", [3, 2])
def test_non_monotonic(v: int) -> None:
    """An older or equal version is refused; the pointer stays."""
    r = activate(
        artifact={**ART, "version": v},
        worker_states={w: {"version": v, "artifact_hash": "h4"} for w in WORKERS},
    )
    assert r["reason"] == "non_monotonic_version" and r["active_pointer"] == PTR


def test_missing_ack_before_mismatch() -> None:
    """A missing ack is reported before a mismatch; both lists are sorted and complete."""
    ws = {"w3": {"version": 3, "artifact_hash": "h3"}, "w1": {"version": 4, "artifact_hash": "h4"}}
    r = activate(worker_states=ws, required_workers=["w4", "w3", "w2", "w1"])
    assert r["reason"] == "missing_worker_ack"
    assert r["missing_workers"] == ["w2", "w4"] and r["mismatched_workers"] == ["w3"]
    assert r["active_pointer"] == PTR and r["activated"] is False


@pytest.mark.parametrize(
    "state",
    [
        {"version": 4, "artifact_hash": "bad"},
        {"version": 3, "artifact_hash": "h4"},
        {"version": 3, "artifact_hash": "h3"},
        {"version": None, "artifact_hash": None},
    ],
    ids=["wrong-hash", "stale-version-right-hash", "stale-ack", "nothing-loaded"],
)
def test_worker_mismatch(state: dict[str, Any]) -> None:
    """A worker on another version or hash blocks activation; the pointer stays."""
    r = activate(worker_states={**WORKERS, "w2": state})
    assert r["reason"] == "worker_mismatch" and r["mismatched_workers"] == ["w2"]
    assert r["active_pointer"] == PTR and r["activated"] is False


def test_pointer_never_mutated_and_returned_copy() -> None:
    """The caller's pointer is never mutated; the returned one is a fresh dict."""
    ptr = dict(PTR)
    r = activate(active_pointer=ptr, worker_states={})
    assert ptr == PTR and r["active_pointer"] == PTR and r["active_pointer"] is not ptr


def test_first_activation_without_pointer() -> None:
    """With no version active yet, any committed version with all acks activates."""
    r = activate(active_pointer=None)
    assert r["activated"] is True and r["active_pointer"] == {"version": 4, "artifact_hash": "h4"}


def test_extra_workers_ignored() -> None:
    """Reports from workers that are not required neither help nor block."""
    ws = {**WORKERS, "w9": {"version": 1, "artifact_hash": "zz"}}
    assert activate(worker_states=ws)["activated"] is True


@pytest.mark.parametrize(
    "kw",
    [
        {"active_pointer": {"version": -1, "artifact_hash": "h"}},
        {"active_pointer": {"version": True, "artifact_hash": "h"}},
        {"artifact": {**ART, "version": -2}},
        {"artifact": {**ART, "version": 4.0}},
        {"artifact": {**ART, "version": False}},
        {"artifact": {**ART, "artifact_hash": ""}},
        {"artifact": {**ART, "artifact_hash": None}},
        {"required_workers": ["w1", "w1"]},
        {
            "worker_states": {
                "w1": {"version": -4, "artifact_hash": "h4"},
                "w2": {"version": 4, "artifact_hash": "h4"},
            }
        },
    ],
)
def test_activate_value_errors(kw: dict[str, Any]) -> None:
    """Bad versions, an empty hash and duplicate required workers are ValueErrors."""
    with pytest.raises(ValueError):
        activate(**kw)
