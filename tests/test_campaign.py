"""The README campaign: covers every declared edge, reaches every sometimes-property, and
writes its reports and coverage diagrams without violations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from rollout_lifecycle.cli.campaign_cmd import README_SEED
from rollout_lifecycle.cli.main import cli
from tests.test_report_schemas import validate

# a known-long module: a larger limit than the suite's default (pyproject.toml)
pytestmark = pytest.mark.timeout(1800)


def test_campaign_fuzz_covers_everything(tmp_path: Path) -> None:
    """A README-seeded fuzz campaign (smaller example count) exercises every declared edge."""
    out = tmp_path / "camp"
    res = CliRunner().invoke(
        cli,
        [
            "campaign",
            "--no-explore",
            "--stage",
            "none",
            "--backend",
            "memory",
            "--seed",
            str(README_SEED),
            "--out",
            str(out),
            "--report",
            str(tmp_path / "summary.json"),
            "--quiet",
        ],
    )
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert all(not v for v in summary["goals_missed"].values()), summary["goals_missed"]
    cov = json.loads((out / "coverage.json").read_text())
    for name, m in cov["machines"].items():
        assert m["covered"] == m["declared"], (name, [e for e, n in m["edges"].items() if not n])
    fuzz = json.loads((out / "fuzz-report.json").read_text())
    assert fuzz["violations"] == 0
    assert all(n > 0 for n in fuzz["sometimes"].values()), fuzz["sometimes"]
    drawn = (out / "lifecycle-coverage.mmd").read_text().split("%% Coverage")[1]
    assert "⚠ 0 NEVER" not in drawn.split("\n", 1)[1]
    assert "Traceback" not in res.output


def test_campaign_explore_subset(tmp_path: Path) -> None:
    """The explore half writes its report and merges coverage with the fuzz half."""
    out = tmp_path / "camp"
    res = CliRunner().invoke(
        cli,
        [
            "campaign",
            "--backend",
            "memory",
            "--examples",
            "5",
            "--model",
            "activation-2v",
            "--stage",
            "none",
            "--out",
            str(out),
            "--quiet",
        ],
    )
    # 5 examples cannot take every edge: the campaign says which goals it missed and the
    # budget that reaches each; nothing was violated, so it exits 5, not 1
    assert res.exit_code == 5, res.output
    assert "goal missed" in res.output and "never took" in res.output
    assert "rerun with --examples" in res.output
    ex = json.loads((out / "explore-report.json").read_text())
    # 1695 before attempt tokens (see tests/test_protocol_models.py for why it grew)
    assert ex["models"]["activation-2v"]["distinct_states"] == 2743
    assert ex["violations"] == 0


def test_campaign_bad_model_is_a_usage_error(tmp_path: Path) -> None:
    """An unknown explorer model is a one-line usage error, not a traceback."""
    res = CliRunner().invoke(
        cli,
        [
            "campaign",
            "--backend",
            "memory",
            "--examples",
            "1",
            "--model",
            "nope",
            "--out",
            str(tmp_path),
            "--quiet",
        ],
    )
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_first_reached_reference_is_the_readme_campaigns() -> None:
    """stateful_tests/first_reached.json is what the README campaign wrote: its seed and
    budget, and every goal of the declared machines reached within that budget."""
    from rollout_lifecycle.cli.campaign_cmd import load_first_reached
    from rollout_lifecycle.spec.invariants import SOMETIMES
    from rollout_lifecycle.stateful_tests.recording import DECLARED
    from rollout_lifecycle.stateful_tests.runner import README_BACKEND, README_EXAMPLES

    ref = load_first_reached()
    assert (ref["seed"], ref["examples"]) == (README_SEED, README_EXAMPLES)
    assert ref["backend"].startswith(README_BACKEND)
    goals = {f"{m}: {spec.edge_id(e)}" for m, spec in DECLARED.items() for e in spec.edges}
    goals |= set(SOMETIMES)
    assert goals <= set(ref["first_reached"]), sorted(goals - set(ref["first_reached"]))
    assert all(1 <= n <= README_EXAMPLES for _m, n in ref["first_reached"].values())


def test_budget_hints_name_the_examples_that_reach_a_goal() -> None:
    """A missed goal's hint gives the README run's example number; an unknown one says the
    README budget does not reach it either; an explorer witness points at the models."""
    from rollout_lifecycle.cli.campaign_cmd import budget_hints, load_first_reached

    goal, (machine, n) = next(iter(load_first_reached()["first_reached"].items()))
    witness = "activation-2v: activated"
    hints = budget_hints([goal, "no such goal", witness], explorer=[witness])
    assert f"--examples {n}" in hints[goal] and machine in hints[goal]
    assert "not reached by the README budget" in hints["no such goal"]
    assert "explorer witness" in hints[witness]
    # a fuzz edge of a machine that shares its name with an explorer model is still a
    # fuzz goal: the hint names its example
    edge = next(g for g in load_first_reached()["first_reached"] if g.startswith("lifecycle: "))
    assert "--examples" in budget_hints([edge])[edge]


def test_campaign_stages_report_and_say_where_they_do_not_run(tmp_path: Path) -> None:
    """A PostgreSQL stage asked for on memory is skipped saying so; the report lists the
    stages that ran (here none) under "stages"."""
    out = tmp_path / "camp"
    res = CliRunner().invoke(
        cli,
        [
            "campaign",
            "--no-explore",
            "--backend",
            "memory",
            "--examples",
            "1",
            "--stage",
            "clock-skew",
            "--stage",
            "premise-window",
            "--out",
            str(out),
            "--report",
            str(tmp_path / "summary.json"),
        ],
    )
    assert res.exit_code in (0, 5), res.output
    assert "clock-skew stage skipped" in res.output and "postgresql" in res.output
    assert "premise-window stage skipped" in res.output
    assert json.loads((tmp_path / "summary.json").read_text())["stages"] == []


def test_campaign_on_sqlite_runs_the_interleavings_and_checks_the_race_history(
    tmp_path: Path,
) -> None:
    """On a durable backend the campaign scripts the two-connection gaps (every answer
    right) and checks the race's whole recorded history for linearizability, with its
    counts in the report (issue 33)."""
    out = tmp_path / "camp"
    res = CliRunner().invoke(
        cli,
        [
            "campaign",
            "--no-explore",
            "--backend",
            "sqlite",
            "--examples",
            "1",
            "--race-seconds",
            "2",
            "--stage",
            "none",
            "--out",
            str(out),
            "--report",
            str(tmp_path / "summary.json"),
            "--quiet",
        ],
    )
    assert res.exit_code in (0, 5), res.output  # 1 example misses goals, violates nothing
    summary = json.loads((tmp_path / "summary.json").read_text())
    validate(summary)  # the campaign report's schema, the race's inside it
    assert summary["violations"] == 0
    assert summary["interleavings"] and not any(summary["interleavings"].values())
    lin = summary["race"]["linearizability"]
    assert lin["verdict"] == "ok" and lin["calls"] > 0 and lin["partitions"] > 0, lin
    assert lin["max_partition"] > 0 and lin["seconds"] >= 0
    assert (out / "race" / "history.jsonl").exists()
    assert "linearizability: ok" in res.output
