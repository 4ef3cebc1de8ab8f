"""The README stays true: its diagrams are the machines, its commands exist, CI runs its tests."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
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


PYTHON_BLOCKS = re.findall(r"```python\n(.*?)\n```", README, flags=re.S)


def test_readme_has_runnable_examples() -> None:
    """The README shows the small API and the embedding pattern as Python code."""
    assert len(PYTHON_BLOCKS) >= 2
    assert any("open_backend" in b and "admit_and_reserve" in b for b in PYTHON_BLOCKS)


def test_readme_embedding_runs_twice_in_the_same_folder(tmp_path: Path) -> None:
    """The embedding example is rerunnable: a second run on the same ledger file (the
    deployment already set up, its rollouts already consumed) trains on new rollouts."""
    (block,) = [b for b in PYTHON_BLOCKS if "admit_and_reserve" in b]
    script = tmp_path / "block.py"
    script.write_text(block, encoding="utf-8")
    for run in (1, 2):
        res = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
        assert res.returncode == 0, (run, res.stdout + res.stderr)
        assert "trained on 4 rollouts" in res.stdout, res.stdout


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_readme_python_block_runs_as_printed(index: int, tmp_path: Path) -> None:
    """Each ```python block runs verbatim, in a fresh folder, in a new interpreter."""
    script = tmp_path / "block.py"
    script.write_text(PYTHON_BLOCKS[index], encoding="utf-8")
    res = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_readme_links_point_at_files() -> None:
    """Every relative link and image in the README names a file or folder that exists."""
    targets = re.findall(r"\]\(([^)#]+)\)", README)
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert local
    missing = [t for t in local if not (ROOT / t).exists()]
    assert missing == []
