"""The conformance kit as the installed pytest plugin (the ``pytest11`` entry point): a user's
pytest run with ``--rl-ledger`` checks the named ledgers, passing good ones, failing a broken
one with the kit's summary, on the built-in backends including PostgreSQL."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest as a user runs it, in a folder of their own with no tests of its own."""
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the broken factory lives in tests/
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def test_plugin_passes_a_conforming_ledger(tmp_path: Path) -> None:
    """--rl-ledger=memory adds one item, and it passes."""
    res = _pytest(tmp_path, "--rl-ledger=memory", "--rl-ledger-examples", "10")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "1 passed" in res.stdout


def test_plugin_fails_a_broken_ledger_with_the_kits_summary(tmp_path: Path) -> None:
    """A ledger whose leases never expire fails its item; the report is the kit's summary."""
    factory = "tests.test_conformance_kit:never_expiring"
    res = _pytest(tmp_path, f"--rl-ledger={factory}", "--rl-ledger-examples", "30")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-2000:]
    assert "does not conform" in res.stdout and "recovery" in res.stdout
    assert "1 failed" in res.stdout


def test_plugin_rejects_a_bad_example_count(tmp_path: Path) -> None:
    """--rl-ledger-examples 0 is a usage error before anything runs."""
    res = _pytest(tmp_path, "--rl-ledger=memory", "--rl-ledger-examples", "0")
    assert res.returncode == 4, res.stdout + res.stderr
    assert "--rl-ledger-examples must be >= 1" in res.stderr


def test_plugin_checks_postgresql_by_url(postgres_url: str, tmp_path: Path) -> None:
    """--rl-ledger=postgresql://... runs the kit on the server, in fresh schemas."""
    res = _pytest(tmp_path, f"--rl-ledger={postgres_url}", "--rl-ledger-examples", "10")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "1 passed" in res.stdout


def _plain_pytest(project: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    """The `pytest` script itself (not `python -m pytest`), in the user's project folder."""
    script = Path(sys.executable).parent / "pytest"
    return subprocess.run(
        [str(script), "-q", "-p", "no:cacheprovider", *args],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=600,
        env=env or {k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )


FACTORIES = """
from rollout_lifecycle.model.ledger import MemoryLedger

def make_ledger(tmp_path, clock, **options):
    return MemoryLedger(clock=clock, **options)

NOT_CALLABLE = 3

def returns_a_dict(tmp_path, clock, **options):
    return {}

def takes_nothing():
    return MemoryLedger()
"""


BLIND = """
from rollout_lifecycle.model.ledger import MemoryLedger, ReserveRequest

class Blind(MemoryLedger):
    # reserves on whatever revision is there now: a lost compare-and-set goes unnoticed
    def reserve_batch(self, update_id, requests):
        now = [(r, self.find(r.rollout_id)) for r in requests]
        fixed = [
            ReserveRequest(r.rollout_id, r.expected_revision if e is None else e.revision,
                           r.admission)
            for r, e in now
        ]
        return super().reserve_batch(update_id, fixed)

    # single reservations too (the one ledger no longer routes them through the batch)
    def reserve(self, rollout_id, expected_revision, update_id, admission):
        return self.reserve_batch(
            update_id, [ReserveRequest(rollout_id, expected_revision, admission)]
        )[0]

def make_ledger(tmp_path, clock, **options):
    return Blind(clock=clock, **options)
"""


def test_a_failing_ledger_shows_its_shrunk_program_and_keeps_it(tmp_path: Path) -> None:
    """The race machine's shrunk program is printed in the report, and the file it names
    still exists after the session (it was in a folder deleted at the end before)."""
    (tmp_path / "blind.py").write_text(BLIND)
    res = _plain_pytest(tmp_path, "--rl-ledger=blind:make_ledger", "--rl-ledger-examples", "30")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-2000:]
    saved = re.search(r"shrunk program \(\d+ steps\), saved as (\S+):", res.stdout)
    assert saved is not None, res.stdout[-3000:]
    program = Path(saved.group(1))
    assert program.is_file()
    assert "state.cas(" in res.stdout.split(saved.group(0), 1)[1]
    shutil.rmtree(program.parent.parent, ignore_errors=True)


def test_plain_pytest_imports_a_factory_beside_the_tests(tmp_path: Path) -> None:
    """`pytest --rl-ledger=ledgers:make_ledger` finds ledgers.py in the project folder with
    plain `pytest` (no `python -m`, no PYTHONPATH)."""
    (tmp_path / "ledgers.py").write_text(FACTORIES)
    res = _plain_pytest(tmp_path, "--rl-ledger=ledgers:make_ledger", "--rl-ledger-examples", "5")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "1 passed" in res.stdout


@pytest.mark.parametrize(
    ("factory", "needle"),
    [
        ("nosuchmodule:make", "cannot import 'nosuchmodule'"),
        ("ledgers:missing", "has no attribute 'missing'"),
        ("ledgers:NOT_CALLABLE", "is not callable"),
        ("ledgers:returns_a_dict", "returned dict, not a Ledger"),
        ("ledgers:takes_nothing", "cannot be called that way"),
        ("no-colon", "unknown ledger backend"),
    ],
)
def test_a_bad_factory_is_a_usage_error(tmp_path: Path, factory: str, needle: str) -> None:
    """A factory that cannot be used stops the session with pytest's usage error (exit 4),
    naming the fix and the factory signature, not a failed test with a traceback."""
    (tmp_path / "ledgers.py").write_text(FACTORIES)
    res = _plain_pytest(tmp_path, f"--rl-ledger={factory}")
    assert res.returncode == 4, res.stdout[-2000:] + res.stderr[-2000:]
    assert needle in res.stderr and "make_ledger(tmp_path: Path" in res.stderr, res.stderr
    assert "Traceback" not in res.stdout + res.stderr


def test_plugin_without_hypothesis(tmp_path: Path) -> None:
    """Where Hypothesis is not installed the plugin leaves every other session alone, and
    --rl-ledger is a usage error that says which extra to install."""
    block = tmp_path / "block" / "hypothesis"  # first on sys.path: as if not installed
    block.mkdir(parents=True)
    (block / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'hypothesis'\", name='hypothesis')\n"
    )
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_one.py").write_text("def test_one():\n    assert True\n")
    env = {**os.environ, "PYTHONPATH": str(block.parent)}
    res = _plain_pytest(project, "-p", "no:hypothesispytest", env=env)
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout + res.stderr
    res = _plain_pytest(project, "-p", "no:hypothesispytest", "--rl-ledger=memory", env=env)
    assert res.returncode == 4, res.stdout + res.stderr
    assert "rollout-lifecycle[pytest]" in res.stderr and "Traceback" not in res.stderr
