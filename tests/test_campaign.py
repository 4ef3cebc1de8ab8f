"""The README campaign: covers every declared edge, reaches every sometimes-property, and
writes its reports and coverage diagrams without violations."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from rollout_lifecycle.cli.campaign_cmd import README_SEED
from rollout_lifecycle.cli.main import cli


def test_campaign_fuzz_covers_everything(tmp_path: Path) -> None:
    """A README-seeded fuzz campaign (smaller example count) exercises every declared edge."""
    out = tmp_path / "camp"
    res = CliRunner().invoke(
        cli,
        [
            "campaign",
            "--no-explore",
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
            "--out",
            str(out),
            "--quiet",
        ],
    )
    # 5 examples cannot take every edge: the campaign says which goals it missed, exit 1
    assert res.exit_code == 1, res.output
    assert "goal missed" in res.output and "never took" in res.output
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
