"""The conformance kit as the installed pytest plugin (the ``pytest11`` entry point): a user's
pytest run with ``--rl-ledger`` checks the named ledgers, passing good ones, failing a broken
one with the kit's summary, on the built-in backends including PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
