"""The throwaway-server fixture itself: without PostgreSQL binaries the PostgreSQL tests skip
and say how to install them, and with REQUIRE_POSTGRES=1 (CI) the same run fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "REQUIRE_POSTGRES"}
    full.update(ROLLOUT_LIFECYCLE_PG_BIN=str(tmp_path / "no-bin"), **env)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "--basetemp",
            str(tmp_path / "bt"),
            "tests/test_postgres.py::test_both_url_schemes_open_one_database",
            "tests/test_ledger_conformance.py::test_unknown_rollout",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=full,
    )


@pytest.mark.slow
def test_without_binaries_postgres_tests_skip_saying_how_to_install(tmp_path: Path) -> None:
    """No initdb/pg_ctl: the PostgreSQL tests skip with the install hint, the others run."""
    res = _run(tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "apt-get install postgresql" in out
    assert "2 passed" in out and "2 skipped" in out, out  # memory, sqlite; postgresql x2


@pytest.mark.slow
def test_require_postgres_turns_the_skip_into_a_failure(tmp_path: Path) -> None:
    """REQUIRE_POSTGRES=1 (CI installed PostgreSQL): a missing server fails the run."""
    res = _run(tmp_path, REQUIRE_POSTGRES="1")
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "REQUIRE_POSTGRES is set" in out and "apt-get install postgresql" in out
