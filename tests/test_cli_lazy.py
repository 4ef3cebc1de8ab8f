"""The command line starts without Hypothesis; the commands that need it load when used."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from rollout_lifecycle.cli.main import LAZY_COMMANDS, NEEDS_HYPOTHESIS, cli
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


def test_help_imports_neither_hypothesis_nor_torch_nor_any_command() -> None:
    """`python -X importtime -m rollout_lifecycle --help`, as a user starts it: the import
    log names neither Hypothesis nor torch, nor any sub-command's module (each loads when
    its command runs)."""
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "rollout_lifecycle", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert "Commands:" in res.stdout
    imported = {
        line.rpartition("|")[2].strip()
        for line in res.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "rollout_lifecycle.cli.main" in imported  # the log is the one expected
    assert not {m for m in imported if m.partition(".")[0] in ("hypothesis", "torch")}
    assert not imported & {module for module, _ in LAZY_COMMANDS.values()}


def test_embedding_the_model_never_imports_hypothesis() -> None:
    """`import rollout_lifecycle.model` and the ledgers, as a trainer embeds them, leave
    Hypothesis (and the stateful runner) out."""
    code = (
        "import sys\n"
        "import rollout_lifecycle.model, rollout_lifecycle.model.ledger\n"
        "import rollout_lifecycle.model.sqlite_ledger, rollout_lifecycle.model.gate\n"
        "print(sorted(m for m in sys.modules if m.partition('.')[0] == 'hypothesis'\n"
        "    or m.startswith('rollout_lifecycle.stateful_tests')))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]", res.stdout


def test_lazy_summaries_are_the_commands_own() -> None:
    """The summary `--help` lists for a lazy command is its docstring's first paragraph,
    and the command runs through the group (its own --help)."""
    for name, (module, summary) in LAZY_COMMANDS.items():
        cmd = getattr(importlib.import_module(module), name.replace("-", "_"))
        assert cmd.name == name, (name, cmd.name)
        assert cmd.help is not None, name
        assert " ".join(cmd.help.split("\n\n")[0].split()) == summary, name
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


# A meta-path finder that makes `import hypothesis` fail as it does where the [campaign]
# extra is not installed (the test venv has it, so it must be hidden, not uninstalled).
_BLOCK_HYPOTHESIS = """
import importlib.abc, sys
class _NoHypothesis(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "hypothesis":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoHypothesis())
"""


def _without_hypothesis(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BLOCK_HYPOTHESIS + code],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_embedding_and_plain_commands_work_without_hypothesis(tmp_path: Path) -> None:
    """Hypothesis is the [campaign] extra: the model API, the ledger, the coordinator and the
    commands that read or write deployment state all work where it cannot be imported."""
    code = """
import sys
from rollout_lifecycle import transition_lifecycle
from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.cli.main import run
assert transition_lifecycle("rewarded", "reserve") == "reserved"
with open_backend("sqlite:///led.db") as be:
    coord = ActivationCoordinator(be.registry, ["w0"], ledger=be.ledger)
    coord.prepare(0)
url = "sqlite:///led.db"
for argv in (["--help"], ["ledger", "counts", "--backend", url],
             ["ledger", "check", "--backend", url, "--quiet"],
             ["deployment", "show", "--backend", url], ["admit", "--help"], ["version"]):
    rc = run(argv)
    assert rc == 0, (argv, rc)
assert "hypothesis" not in sys.modules
print("ok")
"""
    res = _without_hypothesis(code, tmp_path)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr


def test_fuzzing_commands_without_hypothesis_say_what_to_install(tmp_path: Path) -> None:
    """campaign, fuzz and mutants need Hypothesis: without it, exit 3 (a missing optional
    dependency, as the README's exit-code list says) and the extra to install, no traceback;
    nothing is created in the working folder."""
    for name in NEEDS_HYPOTHESIS:
        code = f"import sys\nfrom rollout_lifecycle.cli.main import run\nsys.exit(run([{name!r}]))"
        res = _without_hypothesis(code, tmp_path)
        assert res.returncode == 3, (name, res.stdout, res.stderr)
        assert "rollout-lifecycle[campaign]" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr, res.stderr
    assert list(tmp_path.iterdir()) == []
