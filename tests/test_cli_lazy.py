"""The command line starts without Hypothesis; the commands that need it load when used."""

from __future__ import annotations

import importlib
import subprocess
import sys

from click.testing import CliRunner

from rollout_lifecycle.cli.main import LAZY_COMMANDS, cli
from rollout_lifecycle.model import rules
from rollout_lifecycle.spec import invariants


def test_help_and_embedding_never_import_hypothesis() -> None:
    """`--help`, a plain subcommand's help and the embedding imports leave Hypothesis out."""
    code = (
        "import sys\n"
        "from rollout_lifecycle.cli.main import run\n"
        "import rollout_lifecycle.model.admission, rollout_lifecycle.model.backends\n"
        "for argv in (['--help'], ['ledger', '--help'], ['deployment', 'show', '--help']):\n"
        "    try:\n"
        "        run(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('hypothesis' in sys.modules)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip().splitlines()[-1] == "False", res.stdout


def test_lazy_summaries_are_the_commands_own() -> None:
    """The summary `--help` lists for a lazy command is its docstring's first line, and
    the command runs through the group (its own --help)."""
    for name, (module, summary) in LAZY_COMMANDS.items():
        cmd = getattr(importlib.import_module(module), name)
        assert cmd.help is not None and cmd.help.splitlines()[0] == summary, name
        res = CliRunner().invoke(cli, [name, "--help"])
        assert res.exit_code == 0 and summary in " ".join(res.output.split()), res.output


def test_spec_state_classes_agree_with_the_write_path() -> None:
    """Differential: the spec reads its state classes and the 'kept' cause on its own; they
    must say what the enforcing rules say."""
    assert invariants.REWARD_FAILURE_STATES == rules.REWARD_FAILURE_STATES
    assert invariants.ADMITTED_STATES == rules.ADMITTED_STATES
    assert invariants.EVER_ACTIVE_STATES == rules.WAS_ACTIVE_STATES
    assert invariants.OPEN_STATES == rules.OPEN_STATES
    assert invariants.ENTRY_START_STATES == rules.START_STATES
    assert invariants.FAILED_ACTIVATION == rules.FAILED_ACTIVATION_STATES
    assert invariants._ROLLBACK_KEPT == rules.ROLLBACK_KEPT
