"""Issue 33: the linearizability checker (spec/linearizability.py) and the call recorder.

The checker flags histories no single order explains and passes their good twins; a search
past its time limit says 'unknown', never 'ok'; the model explains every answer of the
real code on generated sequential workloads, and flags each with one answer changed.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollout_lifecycle.model.errors import RevisionConflict
from rollout_lifecycle.model.ledger import MemoryLedger
from rollout_lifecycle.spec import call_model as cm
from rollout_lifecycle.spec.linearizability import HistoryError, check_history, parse, read_history
from rollout_lifecycle.stateful_tests import call_histories as H
from rollout_lifecycle.stateful_tests.history import (
    CallLog,
    RecordingLedger,
    history_header,
    write_history,
)
from tests.helpers_ledger import rewarded, stamp

PAIRS: list[tuple[str, Callable[..., Any], Any, Any]] = [
    ("stale_row_refusal", H.stale_row_refusal, "pointer_moved", "revision_conflict"),
    ("refusal_reason", H.refusal_reason, "pointer_moved", "revision_conflict"),
    ("double_reserve", H.double_reserve, "reserved", "revision_conflict"),
    ("lost_commit", H.lost_commit, "reserved", "consumed"),
    ("retry", H.retry_answered_differently, "revision_conflict", "idempotent_retry"),
    ("batch_half_applied", H.batch_half_applied, "rewarded", "reserved"),
    ("pointer_goes_back", H.pointer_goes_back, 0, 1),
    ("settle_before_the_ack", H.settle_before_the_ack, True, False),
    ("settle_fails_what_was_not_awaiting", H.settle_fails_what_was_not_awaiting, 0, 1),
    ("policy_and_activation_at_once", H.policy_and_activation_at_once, 0.95, 2.0),
    ("sweep_after_a_rollback", H.sweep_after_a_rollback, "retired_stale", "quarantined"),
]


@pytest.mark.parametrize(("name", "build", "bad", "good"), PAIRS, ids=[p[0] for p in PAIRS])
def test_known_bad_history_is_flagged_and_its_twin_passes(
    name: str, build: Callable[..., Any], bad: Any, good: Any
) -> None:
    """Each known-bad history is a violation naming its object; its twin is ok."""
    flagged = check_history(build(bad))
    assert flagged.verdict == "violation", flagged
    assert flagged.findings and flagged.findings[0].partitions
    passed = check_history(build(good))
    assert passed.verdict == "ok", [f.message for f in passed.findings]


def test_the_issue_history_names_the_untrue_refusal() -> None:
    """The issue's history: the rollout's partition cannot fit the pointer_moved answer."""
    got = check_history(H.stale_row_refusal("pointer_moved"))
    (finding,) = got.findings
    assert finding.partitions == ("rollout:r",)
    assert "learner#0 reserve" in finding.message and "pointer_moved" in finding.message


def test_a_batch_half_applied_is_caught_across_partitions() -> None:
    """Each rollout alone is explained; only one instant for the whole batch is not."""
    got = check_history(H.batch_half_applied("rewarded"))
    (finding,) = got.findings
    assert set(finding.partitions) == {"rollout:r1", "rollout:r2"}
    assert "one instant" in finding.message
    assert got.joint_searches >= 1


def test_a_search_past_its_time_limit_is_unknown_never_ok() -> None:
    """Exponentially many orders to try before a 'no': past the limit it is 'unknown'."""
    lines = H.many_reads_one_impossible(40)
    assert check_history(lines, time_limit=0.05).verdict == "unknown"
    assert check_history(H.many_reads_one_impossible(6), time_limit=30).verdict == "violation"


@pytest.mark.parametrize("seed", range(6))
def test_model_explains_the_code_and_flags_one_changed_answer(seed: int) -> None:
    """A sequential workload through the real memory backend is ok; with one answer
    changed it is a violation (in a sequential history each answer is the only true one)."""
    lines = H.generated_history(seed, steps=150)
    got = check_history(lines)
    assert got.verdict == "ok", [f.message for f in got.findings]
    assert got.checked_calls == got.calls
    bad = H.corrupted(lines, random.Random(seed))
    assert bad is not None
    assert check_history(bad).verdict == "violation"


def test_refusal_order_is_the_documented_one() -> None:
    """The model's reservation order: the contract's four (missing, idempotent retry,
    revision, state) before the stamp, the stamp before the registry's facts."""
    reasons = [sorted(r)[0] for r, _, _ in cm.RESERVE_ORDER]
    assert reasons[:5] == [
        "missing_rollout",
        "idempotent_retry",
        "revision_conflict",
        "not_rewarded",
        "update_poisoned",  # 'maybe' until the model holds the poison
    ]
    assert reasons.index("no_admission_policy") > reasons.index("not_admitted")
    assert reasons[-1] == "pointer_moved"
    view = cm.EMPTY_VIEW._replace(
        pointer=3, ever=frozenset({0, 1, 2, 3}), policy=(1, 0.2, None, None)
    )
    row = cm.Row("rewarded", 2, None, 1, 0, None)
    st = cm.stamp_of(H.stamp(1, 2))
    poisoned = ("update_poisoned", False)
    got = cm.reserve_answer(cm.Ask(row, 2, "u", st, view))
    assert got == {poisoned, ("pointer_moved", False)}
    moved = row._replace(rev=4)  # the row moved on too: the revision comes first
    assert cm.reserve_answer(cm.Ask(moved, 2, "u", st, view)) == {("revision_conflict", False)}


def test_dispatch_of_a_rolled_back_version_is_version_retired_first() -> None:
    """The model's dispatch order is the ledger's (docs/pacing.md): a version a rollback
    retired is refused `version_retired` before anything else (it sits above the pointer
    the rollback went back to), and only such a version; a kept rollback retires nothing.
    Without it the race's recorded history was called unlinearizable for every dispatch
    the ledger refused after a rollback (found merging issue 31's refusal with issue 33's
    checker)."""
    view = cm.EMPTY_VIEW._replace(pointer=3, ever=frozenset({0, 1, 2, 3, 4}), policy=(1, 0.2, 8, 3))
    assert cm.dispatch_reasons([], 3, view) == {"dispatched", "no_capacity"}
    assert cm.dispatch_reasons([], 4, view) == {"not_active"}  # above the pointer
    back = cm.view_effect(
        view._replace(pointer=4), "rollback", {"keep": False}, cm.Outcome([3], None)
    )
    assert back.retired == {4} and back.pointer == 3
    assert cm.dispatch_reasons([], 4, back) == {"version_retired"}
    assert cm.dispatch_reasons([], 3, back) == {"dispatched", "no_capacity"}
    kept = cm.view_effect(
        view._replace(pointer=4), "rollback", {"keep": True}, cm.Outcome([3], None)
    )
    assert cm.dispatch_reasons([], 4, kept) == {"not_active"}


def test_recorder_passes_answers_and_errors_through(tmp_path: Path) -> None:
    """The recording ledger returns what the ledger returns, raises what it raises, and
    records both on one monotonic clock, in a file the checker reads back."""
    log = CallLog("p0")
    led = RecordingLedger(MemoryLedger(), log)  # a ledger without a registry
    led.add(rewarded("r", version=1))
    out = led.reserve("r", 0, "u1", stamp(1))
    assert out.reserved and out.reason == "reserved"
    with pytest.raises(RevisionConflict):
        led.transition("r", "quarantine", 0)
    assert led.get("r").reserved_by == "u1"
    ops = [c["op"] for c in log.calls]
    assert ops == ["add", "reserve", "transition", "get"]
    assert all(c["inv"] <= c["ret"] for c in log.calls)
    assert log.calls[2]["error"]["type"] == "RevisionConflict"
    assert log.calls[2]["error"]["actual"] == 1
    path = tmp_path / "h.jsonl"
    assert write_history(path, log.calls, history_header(registry=False)) == 4
    header, calls = read_history(str(path))
    assert header["clock"] == "CLOCK_MONOTONIC" and len(calls) == 4
    assert check_history(path.read_text().splitlines()).verdict == "ok"


def test_a_malformed_history_is_a_typed_error() -> None:
    """Lines that are not the schema's are refused with the line number."""
    with pytest.raises(HistoryError, match="line 1"):
        check_history(["not json"])
    with pytest.raises(HistoryError, match="line 2"):
        check_history([json.dumps(history_header()), json.dumps({"proc": "p"})])
    with pytest.raises(HistoryError, match="before its invocation"):
        line = {"proc": "p", "seq": 0, "op": "get", "args": {"id": "r"}, "inv": 2, "ret": 1}
        check_history([json.dumps(line)])


def test_registry_writes_keep_their_order_only_where_they_conflict() -> None:
    """The consistency pass holds the registry's writes to the order of groups they share
    (call_model.registry_footprint): a policy change and an activation commute; an attach
    (it reads the policy) stays after the policy it saw and before the next change of it."""
    from rollout_lifecycle.spec.linearizability import Call, _conflicting

    ops = ["set_policy", "attach", "try_activate", "set_policy", "quarantine_version"]
    calls = [
        Call("p", i, op, {}, float(i), i + 0.5, cm.Outcome(None, None)) for i, op in enumerate(ops)
    ]
    edges = set(_conflicting(range(len(ops)), calls))
    assert edges == {(0, 1), (1, 2), (1, 3), (0, 3)}, edges  # not (0, 2), nothing to 4


_GROUPS: dict[str, tuple[str, ...]] = {
    "policy": ("policy",),
    "bad": ("bad",),
    "main": ("arts", "pointer", "members", "reports", "tokens", "spent"),
}


def _group(reg: cm.Registry, g: str) -> tuple[Any, ...]:
    return tuple(getattr(reg, f) for f in _GROUPS[g])


def _with_group(reg: cm.Registry, g: str, value: tuple[Any, ...]) -> cm.Registry:
    return reg._replace(**dict(zip(_GROUPS[g], value, strict=True)))


@functools.cache
def _registry_instances() -> tuple[list[tuple[cm.Registry, Any, cm.Registry]], dict[str, Any]]:
    """Every registry call of generated sequential workloads with the state before and
    after it, and every value each field group took."""
    seen: dict[str, set[tuple[Any, ...]]] = {g: set() for g in _GROUPS}
    instances: list[tuple[cm.Registry, Any, cm.Registry]] = []
    for seed in range(4):
        _header, calls = parse(H.generated_history(seed, steps=150))
        reg = cm.Registry()
        for c in sorted(calls, key=lambda c: c.seq):  # return order: nested calls first
            if c.op not in cm.REGISTRY_OPS:
                continue
            new = cm.registry_step(reg, c.op, c.args, c.out)
            if new is None:
                # a refusal that held before the calls nested in it (a rollback settles
                # first): it changed nothing, so the replay goes on from the same state
                assert c.out.error is not None, c.brief()
                continue
            instances.append((reg, c, new))
            for g in _GROUPS:
                seen[g].add(_group(reg, g))
            reg = new
    return instances, seen


def _footprint_findings(
    footprint: Callable[[str], tuple[frozenset[str], frozenset[str]]],
) -> list[str]:
    """Where `footprint` says less than the registry's steps read or write."""
    instances, seen = _registry_instances()
    ops = {c.op for _r, c, _n in instances}
    assert ops >= {"set_policy", "attach", "try_activate", "record_ack", "quarantine_version"}
    assert all(len(v) > 1 for v in seen.values()), {g: len(v) for g, v in seen.items()}
    found: list[str] = []
    for reg, c, new in instances:
        reads, writes = footprint(c.op)
        for g in set(_GROUPS) - writes:
            if _group(new, g) != _group(reg, g):
                found.append(f"{c.op} writes {g}")
        for g in set(_GROUPS) - reads - writes:
            for other in seen[g]:
                moved = _with_group(reg, g, other)
                if cm.registry_step(moved, c.op, c.args, c.out) != _with_group(new, g, other):
                    found.append(f"{c.op} reads {g}")
    return sorted(set(found))


def test_registry_footprints_are_what_the_steps_read_and_write() -> None:
    """`call_model.registry_footprint` (and so VIEW_LANES and `_conflicting`) is checked
    against the registry's step functions themselves, on every registry call of generated
    sequential workloads: a step changes no group outside what it writes, and a group it
    neither reads nor writes, replaced by another value seen in the run, changes neither
    whether the answer holds nor what the step does to the other groups. (The checker
    reorders writes of disjoint groups on that premise; a step that read one more field
    than its footprint says would make it pass a history no order explains.)"""
    assert _footprint_findings(cm.registry_footprint) == []
    # the lanes of changes a rollout partition may reorder are the footprints' conflicts
    for a, la in cm.VIEW_LANES.items():
        for b, lb in cm.VIEW_LANES.items():
            ra, wa = cm.registry_footprint(a)
            rb, wb = cm.registry_footprint(b)
            conflict = bool(wa & (rb | wb)) or bool(wb & ra)
            assert conflict == (la == lb), (a, b)


@pytest.mark.parametrize(
    ("op", "wrong", "finding"),
    [
        ("set_policy", (frozenset(), frozenset()), "set_policy writes policy"),
        ("attach", (frozenset({"main"}), frozenset({"main"})), "attach reads policy"),
        ("quarantine_version", (frozenset(), frozenset({"main"})), "quarantine_version writes bad"),
    ],
)
def test_a_footprint_that_leaves_out_a_field_is_found(
    op: str, wrong: tuple[frozenset[str], frozenset[str]], finding: str
) -> None:
    """The check above, shown a footprint that says less than its step does."""

    def footprint(o: str) -> tuple[frozenset[str], frozenset[str]]:
        return wrong if o == op else cm.registry_footprint(o)

    assert finding in _footprint_findings(footprint)
