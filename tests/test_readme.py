"""The README stays true and short: its code runs, its commands exist, its campaign figures
are the committed reports', CI runs its tests; the docs it sends readers to (the machines'
diagrams, the command line, the campaign) stay true too."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from rollout_lifecycle.cli.main import cli
from rollout_lifecycle.model.machines import ACTIVATION, LIFECYCLE
from rollout_lifecycle.spec.diagrams import to_mermaid

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CHECKING = (ROOT / "docs" / "checking.md").read_text(encoding="utf-8")
CLI_DOC = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
CAMPAIGN_DOC = (ROOT / "docs" / "campaign.md").read_text(encoding="utf-8")


def _body(text: str) -> str:
    """Mermaid text without its front matter (GitHub renders the title from the heading)."""
    if text.startswith("---"):
        text = text.split("---", 2)[2].lstrip("\n")
    return text.rstrip("\n")


def test_readme_fits_on_a_screen_or_two() -> None:
    """The README is at most 200 lines: what it is, the commands with their times, the small
    API, links; everything else lives in docs/."""
    assert len(README.splitlines()) <= 200, len(README.splitlines())
    assert README.index("make demo") < README.index("make campaign")


def test_guide_run_folder_is_ignored() -> None:
    """The guide's working folder (docs/guide.md, "Running this guide") is never committed."""
    assert "guide-run/" in (ROOT / ".gitignore").read_text().splitlines()


def test_machine_diagrams_are_the_machines() -> None:
    """Both Mermaid blocks in docs/checking.md equal what the declared machines draw today."""
    blocks = re.findall(r"```mermaid\n(.*?)\n```", CHECKING, flags=re.S)
    assert _body(to_mermaid(LIFECYCLE)) in blocks
    assert _body(to_mermaid(ACTIVATION)) in blocks


def test_readme_commands_exist() -> None:
    """Every `rollout-lifecycle <command>` the README and docs/cli.md name is a real command."""
    named = set(re.findall(r"rollout-lifecycle ([a-z][a-z-]*)", README + CLI_DOC))
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


@pytest.mark.parametrize(
    "doc", ["README.md", "docs/cli.md", "docs/campaign.md", "docs/checking.md", "docs/embedding.md"]
)
def test_links_point_at_files(doc: str) -> None:
    """Every relative link and image in the README (and the pages cut out of it) names a
    file or folder that exists."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#]+)\)", text)
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert local
    missing = [t for t in local if not ((ROOT / doc).parent / t).exists()]
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
    """docs/cli.md says `--json`, `--report` and `--quiet` are the same for every command:
    each command, sub-commands included, has all three (and `--help`)."""
    assert "`--json` prints the\ncommand's report" in CLI_DOC
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


def test_campaign_explorer_counts_are_the_pinned_ones() -> None:
    """Each explorer state count docs/campaign.md quotes for a model whose count is pinned
    (tests/test_protocol_models.py) is that pinned count."""
    from tests.test_protocol_models import PINNED

    rows = re.findall(
        r"^\| ([a-z0-9-]+) \| ([\d,]+) \| [\d,]+ \| \d+ \| yes \|", CAMPAIGN_DOC, re.M
    )
    quoted = {name: int(n.replace(",", "")) for name, n in rows if name in PINNED}
    assert quoted, rows
    assert quoted == {k: PINNED[k] for k in quoted}


def test_campaign_figures_are_the_committed_reports() -> None:
    """Every campaign figure the README and docs/campaign.md show is rendered from the
    committed reports (docs/campaign/*.json) by one command; each report is a clean run of
    its profile as the profile is defined now (so a changed budget needs a new report)."""
    from rollout_lifecycle.cli import campaign_report
    from rollout_lifecycle.stateful_tests.campaign_profiles import PROFILES
    from rollout_lifecycle.stateful_tests.mutants import CATALOGUE
    from rollout_lifecycle.stateful_tests.stages import STAGES

    reports = campaign_report.load_reports(ROOT)
    generated = campaign_report.blocks(reports, campaign_report.load_mutants(ROOT))
    for doc, text in (("README.md", README), ("docs/campaign.md", CAMPAIGN_DOC)):
        for name, body in campaign_report.marked(text).items():
            assert body == generated[name], f"{doc}: block {name!r} is stale: make campaign-docs"
    assert set(campaign_report.marked(README)) == {"profiles"}
    assert set(campaign_report.marked(CAMPAIGN_DOC)) == set(generated)
    for name, r in reports.items():
        profile = PROFILES[name]
        assert r["profile"] == name and r["violations"] == 0
        assert not any(r["goals_missed"].values())
        # nothing skipped but the profile's targeted stages of another backend
        elsewhere = {n for n in profile.stages if not STAGES[n].applies_to(r["backend"])}
        assert set(r["skipped"]) == elsewhere, r["skipped"]
        assert [s["stage"] for s in r["stages"]] == [
            n for n in profile.stages if n not in elsewhere
        ]
        assert all(s["ran"] and not s["failures"] for s in r["stages"])
        assert r["examples"] == profile.examples and r["seed"] == profile.seed
        assert r["budget"]["models"] == list(profile.models) and r["budget"]["overridden"] == []
    mutants = campaign_report.load_mutants(ROOT)
    assert mutants["campaign_profile"] == "fast" and mutants["summary"]["survivors"] == []
    assert mutants["summary"]["mutants"] == len(CATALOGUE)
    # every mutant the fast profile reaches is killed; the one it cannot reach is the one
    # only the verl-v1 stage runs (thorough and ci)
    unreached = [r["name"] for r in mutants["results"] if r["campaign"]["killed"] is None]
    assert unreached == ["verl_v1_resume_commits_redone_step"], unreached


def test_mutants_table_says_which_mutants_a_profile_does_not_reach() -> None:
    """A mutant the profile cannot reach is rendered as not reached, with the reason, both
    in the summary line and in its row: never as a kill, never as a survivor."""
    from rollout_lifecycle.cli import campaign_report

    def row(name: str, killed: bool | None, stage: str | None, detail: str) -> dict[str, Any]:
        effort = 3 if killed else None
        kill = {"killed": killed, "stage": stage, "effort": effort, "unit": "examples"}
        return {
            "name": name,
            "class": "protocol",
            "campaign": {**kill, "seconds": 1.0, "detail": detail},
        }

    report = {
        "campaign_profile": "fast",
        "summary": {
            "mutants": 3,
            "campaign": {"killed": 1, "reached": 2, "median_seconds_to_kill": 1.0},
            "survivors": ["b"],
            "campaign_kills_by_stage": {"fuzz": 1},
        },
        "results": [
            row("a", True, "fuzz", "fuzz ledger: boom"),
            row("b", False, None, "no violation"),
            row("c", None, None, "only the verl-v1 stage reaches it"),
        ],
    }
    text = campaign_report.mutants_table(report)
    assert "Not reached by this profile: c (only the verl-v1 stage reaches it)." in text
    assert "| a | protocol | fuzz | 3 examples |" in text
    assert "| b | protocol | SURVIVED | - |" in text
    assert "| c | protocol | not reached: only the verl-v1 stage reaches it | - |" in text


def test_exit_codes_table_is_exitcodes_py() -> None:
    """The exit-code table of docs/cli.md lists exactly the codes cli/exitcodes.py defines,
    with a missing optional dependency under 3 (what every command exits with for one)."""
    from rollout_lifecycle.cli import exitcodes

    rows = dict(re.findall(r"^\| (\d+) \| (.+) \|$", CLI_DOC, flags=re.M))
    defined = {v for k, v in vars(exitcodes).items() if k.isupper() and isinstance(v, int)}
    assert {int(k) for k in rows} == defined
    assert "missing optional dependency" in rows[str(exitcodes.TECHNICAL)]
    assert "missing optional dependency" not in rows[str(exitcodes.USAGE)]
