"""Every checker checked: the catalogue of known-bad and known-good inputs, the mutants that
break a checker, the differential of rules and spec, and the race judge's retry rule."""

from __future__ import annotations

import pytest

from rollout_lifecycle.model.events import EntryChanged
from rollout_lifecycle.spec.invariants import INVARIANTS
from rollout_lifecycle.stateful_tests.checkers import (
    all_cases,
    invariants_without_bad_case,
    run_checker_checks,
)
from rollout_lifecycle.stateful_tests.mutants import BY_NAME, CATALOGUE, CLASSES
from rollout_lifecycle.stateful_tests.race import judge_calls


def test_every_checker_passes_its_catalogue() -> None:
    """The shipped checkers flag every known-bad input and pass every known-good one."""
    rep = run_checker_checks(seed=3)
    assert rep.ok, [str(f) for f in rep.failures[:10]]
    assert set(rep.cases) == {"spec", "race", "linearizability", "audit", "differential"}
    assert rep.cases["linearizability"] >= 13 + 12  # known histories, twins, generated
    assert rep.bad_cases >= 60 and rep.good_cases >= 400


def test_every_invariant_has_a_known_bad_history() -> None:
    """No spec invariant goes unchecked: each is shown at least one history it must name."""
    assert invariants_without_bad_case() == []
    named = {c.expect for c in all_cases(generated=0, differential=0)}
    assert {inv.name for inv in INVARIANTS} <= named


def test_generated_corruptions_are_each_named() -> None:
    """Random correct histories pass; one targeted corruption of each is named."""
    cases = [
        c for c in all_cases(seed=11, generated=20, differential=0) if c.checker == "spec:generated"
    ]
    good = [c for c in cases if c.expect is None]
    bad = [c for c in cases if c.expect is not None]
    assert len(good) == 20 and len(bad) >= 15
    assert len({c.expect for c in bad}) >= 4
    for c in cases:
        ok, got = c.judge()
        assert ok, (c.name, c.expect, got)


CHECKER_MUTANTS = [m.name for m in CATALOGUE if "checkers" in m.reach]


@pytest.mark.parametrize("name", CHECKER_MUTANTS)
def test_a_broken_checker_or_rule_fails_the_checker_stage(name: str) -> None:
    """Break a checker (or a rule the differential compares): a known-bad input passes, or
    the two judgements disagree, and the stage reports it."""
    with BY_NAME[name]():
        rep = run_checker_checks(seed=20261130)
    assert not rep.ok, f"{name} survived the checker stage"


def test_every_class_has_a_mutant() -> None:
    """The catalogue holds at least one mutant of each class of issue 18."""
    assert {m.klass for m in CATALOGUE} == set(CLASSES)


def _entry(state: str, rev: int, owner: str | None) -> object:
    from rollout_lifecycle.model.records import AdmissionStamp, LedgerEntry, Reward

    adm = None
    if owner is not None:
        adm = AdmissionStamp(0, 0, 1, 0.2, 0.0, "fresh", "ok", True)
    return LedgerEntry(
        rollout_id="r",
        behavior_version=0,
        artifact_hash="a" * 64,
        state=state,
        revision=rev,
        reserved_by=owner,
        reward=Reward("rm", "1", 1.0),
        admission=adm,
    )


def test_race_judge_checks_who_holds_a_retried_row() -> None:
    """'idempotent_retry' is true only for the update that holds the row during the call."""
    free, held = _entry("rewarded", 2, None), _entry("reserved", 3, "u1")
    trace = [EntryChanged(1, 1, 1.0, "r", "reserve", free, held, "u1")]  # type: ignore[arg-type]

    def call(update: str, reason: str) -> dict[str, object]:
        return {
            "update_id": update,
            "start": 2.0,
            "end": 3.0,
            "asked": [["r", 2, None]],
            "got": [["r", reason]],
        }

    assert judge_calls(trace, [call("u1", "idempotent_retry")]) == []
    bad = judge_calls(trace, [call("u2", "idempotent_retry")])
    assert [v.invariant for v in bad] == ["call_outcome_linearizable"]


def test_served_after_sync_has_hand_built_bad_traces() -> None:
    """The states a restarted worker's checker must flag are written event by event (the
    real coordinator voids a restarted worker's ack, so a trace built through it shows the
    checker only what the code already prevents); that one is marked and does not count
    as the invariant's known-bad history."""
    served = [c for c in all_cases(generated=0, differential=0) if "served" in c.checker]
    real = [c for c in served if c.real_code]
    hand = [c for c in served if not c.real_code and c.expect == "served_after_sync"]
    assert len(real) == 1 and len(hand) >= 3
    assert any("previous incarnation" in c.name for c in hand)
    for c in served:
        ok, got = c.judge()
        assert ok, (c.name, got)


def test_an_invariant_with_only_real_code_bad_cases_counts_as_uncovered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`invariants_without_bad_case` ignores cases built through the code under check."""
    import attrs

    from rollout_lifecycle.stateful_tests import checkers

    real = checkers.spec_cases

    def only_real() -> list[checkers.CheckerCase]:
        return [
            attrs.evolve(c, real_code=True) if c.expect == "served_after_sync" else c
            for c in real()
        ]

    monkeypatch.setattr(checkers, "spec_cases", only_real)
    assert checkers.invariants_without_bad_case() == ["served_after_sync"]
