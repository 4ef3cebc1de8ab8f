"""The README stays true: its diagrams are the machines, its commands exist, CI runs its tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import click
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


def setup_for(block: str) -> str | None:
    """The ```sh block that sets up the deployment a ```python block runs on: the last one
    between the python block and the heading of its section (the operator's step), if any."""
    at = README.index(f"```python\n{block}\n```")
    section = README.rfind("\n## ", 0, at)
    found = re.findall(r"```sh\n(.*?)\n```", README[section:at], flags=re.S)
    return found[-1] if found else None


def run_block(block: str, folder: Path, *, setup: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a ```python block as a script in `folder`, after its set-up ```sh block (with this
    interpreter's bin folder first on PATH, so `rollout-lifecycle` is this checkout's)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    commands = setup_for(block) if setup else None
    if commands is not None:
        res = subprocess.run(
            ["bash", "-e", "-c", commands],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if res.returncode != 0:
            return res
    script = folder / "block.py"
    script.write_text(block, encoding="utf-8")
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_readme_has_runnable_examples() -> None:
    """The README shows the small API and the embedding pattern as Python code."""
    assert len(PYTHON_BLOCKS) >= 2
    assert any("open_backend" in b and "admit_and_reserve" in b for b in PYTHON_BLOCKS)


def test_readme_embedding_runs_twice_in_the_same_folder(tmp_path: Path) -> None:
    """The embedding example is rerunnable: a second run on the same ledger file (the
    deployment already set up, its rollouts already consumed) trains on new rollouts."""
    (block,) = [b for b in PYTHON_BLOCKS if "admit_and_reserve" in b]
    for run in (1, 2):  # the operator's set-up step once, before the first run
        res = run_block(block, tmp_path, setup=run == 1)
        assert res.returncode == 0, (run, res.stdout + res.stderr)
        assert "trained on 4 rollouts" in res.stdout, res.stdout


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_readme_python_block_runs_as_printed(index: int, tmp_path: Path) -> None:
    """Each ```python block runs verbatim, in a fresh folder, in a new interpreter, after
    the ```sh block that sets up its deployment (the operator's step), if it has one."""
    res = run_block(PYTHON_BLOCKS[index], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


def test_readme_embedding_needs_the_operators_step(tmp_path: Path) -> None:
    """Without the operator's set-policy step the embedding block refuses to start (the
    coordinator never records the policy itself) and its message names the command, with
    this very database's URL; after the step it runs."""
    (block,) = [b for b in PYTHON_BLOCKS if "admit_and_reserve" in b]
    setup = setup_for(block)
    assert setup is not None and "deployment set-policy --backend sqlite:///runs/ledger.db" in (
        setup.replace("\\\n", " ")
    )
    (tmp_path / "runs").mkdir()
    res = run_block(block, tmp_path, setup=False)
    assert res.returncode != 0
    url = f"sqlite:///{tmp_path.resolve() / 'runs' / 'ledger.db'}"
    assert f"deployment set-policy --backend {url} --max-lag 1 --max-drift 0.2" in res.stderr
    assert run_block(block, tmp_path).returncode == 0


def test_readme_links_point_at_files() -> None:
    """Every relative link and image in the README names a file or folder that exists."""
    targets = re.findall(r"\]\(([^)#]+)\)", README)
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert local
    missing = [t for t in local if not (ROOT / t).exists()]
    assert missing == []


def _leaf_commands() -> list[tuple[str, click.Command]]:
    """Every runnable command of the CLI, sub-commands of groups included, by full name."""
    ctx = click.Context(cli)
    found: list[tuple[str, click.Command]] = []

    def walk(group: click.Group, prefix: str) -> None:
        for name in group.list_commands(ctx):
            cmd = group.get_command(ctx, name)
            assert cmd is not None, name
            if isinstance(cmd, click.Group):
                walk(cmd, f"{prefix}{name} ")
            else:
                found.append((f"{prefix}{name}", cmd))

    walk(cli, "")
    return found


def test_every_command_has_the_conventions_the_readme_promises() -> None:
    """The README says `--json`, `--report` and `--quiet` are the same for every command:
    each command, sub-commands included, has all three (and `--help`)."""
    assert "`--json` prints the\ncommand's report" in README
    leaves = _leaf_commands()
    assert len(leaves) >= 20
    missing = {}
    for name, cmd in leaves:
        opts = {o for p in cmd.params for o in getattr(p, "opts", ())}
        lacks = sorted({"--json", "--report", "--quiet"} - opts)
        if lacks:
            missing[name] = lacks
    assert missing == {}


def test_help_texts_say_what_the_commands_do() -> None:
    """`admit --help` states the exit code bad input really gets (2, as the README says) and
    `fuzz --help` counts the machines there are."""
    from rollout_lifecycle.cli import exitcodes
    from rollout_lifecycle.stateful_tests.runner import MACHINES

    runner = CliRunner()
    admit_help = " ".join(runner.invoke(cli, ["admit", "--help"]).output.split())
    assert f"{exitcodes.USAGE} bad input data" in admit_help, admit_help
    assert "1 bad input" not in admit_help
    fuzz_help = " ".join(runner.invoke(cli, ["fuzz", "--help"]).output.split())
    assert f"Default: all {len(MACHINES)}." in fuzz_help and len(MACHINES) == 5, fuzz_help
    assert "all three" not in fuzz_help


def test_readme_explorer_counts_are_the_pinned_ones() -> None:
    """Each explorer state count the README quotes for a model whose count is pinned
    (tests/test_protocol_models.py) is that pinned count."""
    from tests.test_protocol_models import PINNED

    rows = re.findall(r"^\| ([a-z0-9-]+) \| ([\d,]+) \| [\d,]+ \| \d+ \| yes \|", README, re.M)
    quoted = {name: int(n.replace(",", "")) for name, n in rows if name in PINNED}
    assert quoted, rows
    assert quoted == {k: PINNED[k] for k in quoted}
