"""A hang is a failure: the suite's per-test timeout (pytest-timeout, pyproject.toml) turns a
test that never returns into a failed test that is named, and the rest of the run goes on."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_suite_has_a_default_timeout() -> None:
    """pyproject.toml sets a default limit per test (known-long modules set larger ones)."""
    opts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert 60 <= float(opts["timeout"]) <= 900


def test_a_hanging_test_fails_named_and_the_run_goes_on(tmp_path: Path) -> None:
    """Under the suite's own settings (with the limit lowered to 2 s), a test stuck waiting
    fails with pytest-timeout's message and its name; the next test still passes."""
    (tmp_path / "test_hang.py").write_text(
        textwrap.dedent(
            """
            import threading

            def test_waits_forever():
                threading.Event().wait()

            def test_after_it():
                assert sum(range(4)) == 6  # runs, after the hang
            """
        )
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            "-p",
            "no:cacheprovider",
            "-o",
            "timeout=2",
            str(tmp_path / "test_hang.py"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "Timeout" in out and "test_waits_forever" in out, out
    assert "1 failed, 1 passed" in out, out
