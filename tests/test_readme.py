"""The README stays true: its diagrams are the machines, its commands exist, CI runs its tests."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from rollout_lifecycle.cli.main import cli
from rollout_lifecycle.model.machines import ACTIVATION, LIFECYCLE
from rollout_lifecycle.spec.diagrams import to_mermaid

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _body(text: str) -> str:
    """Mermaid text without its front matter (GitHub renders the title from the heading)."""
    if text.startswith("---"):
        text = text.split("---", 2)[2].lstrip("\n")
    return text.rstrip("\n")


def test_readme_diagrams_are_the_machines() -> None:
    """Both Mermaid blocks in the README equal what the declared machines draw today."""
    blocks = re.findall(r"```mermaid\n(.*?)\n```", README, flags=re.S)
    assert _body(to_mermaid(LIFECYCLE)) in blocks
    assert _body(to_mermaid(ACTIVATION)) in blocks


def test_readme_commands_exist() -> None:
    """Every `rollout-lifecycle <command>` the README names is a real command."""
    named = set(re.findall(r"rollout-lifecycle ([a-z][a-z-]*)", README))
    runner = CliRunner()
    for name in sorted(named):
        res = runner.invoke(cli, [name, "--help"])
        assert res.exit_code == 0, (name, res.output)


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run calls the README's test command, not a private variant."""
    assert "make test" in README
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^make test$", ci, flags=re.M)
