"""Issue 33: every answer is true at one instant inside its call, on two connections.

Each scripted interleaving (stateful_tests/interleavings.py) runs the other connection's
calls between a single reservation's read of its row and its atomic step; the answer must
be the one the documented refusal order gives at the step, never a refusal built on the row
as it was before the step (the stale-row `pointer_moved` of the issue).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_lifecycle.stateful_tests.backends import durable_url
from rollout_lifecycle.stateful_tests.interleavings import (
    SCENARIOS,
    Scenario,
    run_interleavings,
    run_scenario,
)
from rollout_lifecycle.stateful_tests.mutants import BY_NAME


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_answer_is_true_at_its_step(kind: str, scenario: Scenario, tmp_path: Path) -> None:
    """The scripted gap between the read and the step; the answer of the step's instant."""
    assert run_scenario(durable_url(kind, tmp_path), scenario) == []


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_the_stale_row_mutant_is_caught_on_both_stores(kind: str, tmp_path: Path) -> None:
    """The catalogue's stale_row_refusal brings the issue's bug back (the step's refusal
    built on the row read before it); the scripted stage names the untrue answers."""
    with BY_NAME["stale_row_refusal"]():
        found = run_interleavings(kind, tmp_path / "runs")
    wrong = {name for name, problems in found.items() if problems}
    assert {"stale_row_pointer_moved", "held_row_pointer_moved"} <= wrong, found
    assert not run_interleavings(kind, tmp_path / "again")["stale_row_pointer_moved"]
