"""`rollout-lifecycle demo`: the end-to-end story runs, leaves a clean ledger, and refuses reuse."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner, Result

import rollout_lifecycle.cli.demo_cmd as demo_cmd
from rollout_lifecycle.cli.main import cli
from rollout_lifecycle.model.artifacts import ArtifactStore
from rollout_lifecycle.spec.invariants import TraceReport, Violation, check_trace


def run(args: list[str]) -> Result:
    """Invoke the CLI group as a user would."""
    return CliRunner().invoke(cli, args)


def test_demo_runs_end_to_end_with_zero_violations(tmp_path: Path) -> None:
    """The demo on a SQLite file ends with '0 violations' and the expected final states."""
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    res = run(["demo", "--backend", url, "--workdir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "0 violations" in out
    for sign in (
        "reward timeout",
        "policy_drift -> reject",
        "revision_conflict",
        "activation refused",
        "(tolerated)",
        "stale_policy -> offline",
        "retired_stale",
    ):
        assert sign in out, sign
    assert "Traceback" not in res.output
    counts = json.loads(run(["ledger", "counts", "--backend", url, "--json"]).stdout)
    assert {k: v for k, v in counts["by_state"].items() if v} == {
        "consumed": 6,
        "reward_timed_out": 1,
        "retired_stale": 1,
    }
    # the demo's lost compare-and-set wrote nothing: SQLite counts it in the demo's process
    # only, so a later `ledger counts` names the counter as not stored instead of showing 0
    assert "cas_conflicts" not in counts["counters"]
    assert "cas_conflicts" in counts["not_stored"]
    check = run(["ledger", "check", "--backend", url, "--quiescent"])
    assert check.exit_code == 0 and "0 violations" in check.stdout
    store = ArtifactStore(tmp_path / "artifacts", create=False)
    assert store.versions() == [0, 1, 2]


def test_demo_default_uses_a_fresh_temp_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without options the ledger and artifacts go to a new temp dir, named in the output."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    res = run(["demo"])
    assert res.exit_code == 0, res.output
    made = [p for p in tmp_path.iterdir() if p.name.startswith("rollout-lifecycle-demo-")]
    assert len(made) == 1
    assert (made[0] / "demo.db").is_file() and (made[0] / "artifacts").is_dir()
    assert f"sqlite:///{made[0] / 'demo.db'}" in res.stdout


def test_demo_on_memory_backend(tmp_path: Path) -> None:
    """The same story passes on memory:// (artifacts still real files)."""
    res = run(["demo", "--backend", "memory://", "--workdir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "0 violations" in res.stdout


def test_demo_refuses_an_existing_ledger_file(tmp_path: Path) -> None:
    """The demo writes a fresh ledger: an existing file is a usage error, left untouched."""
    db = tmp_path / "demo.db"
    db.write_bytes(b"keep")
    res = run(["demo", "--backend", f"sqlite:///{db}", "--workdir", str(tmp_path)])
    assert res.exit_code == 2 and "already exists" in res.output
    assert db.read_bytes() == b"keep"


def test_demo_refuses_a_used_artifact_dir(tmp_path: Path) -> None:
    """Artifacts are immutable: a non-empty artifacts/ directory is refused up front."""
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "v000000000000").mkdir()
    res = run(["demo", "--backend", "memory://", "--workdir", str(tmp_path)])
    assert res.exit_code == 2 and "not empty" in res.output


def test_demo_bad_backend_url_is_a_usage_error(tmp_path: Path) -> None:
    """A bad URL is reported with examples, no traceback."""
    res = run(["demo", "--backend", "mysql://x/y", "--workdir", str(tmp_path)])
    assert res.exit_code == 2 and "unknown scheme 'mysql'" in res.output
    assert "sqlite:///" in res.output and "postgresql://" in res.output  # the examples
    assert "Traceback" not in res.output


def test_demo_unreachable_server_is_a_technical_failure(tmp_path: Path) -> None:
    """A well-formed URL whose server does not answer exits 3 (technical), one line."""
    url = "postgresql://nobody@127.0.0.1:1/nodb"
    res = run(["demo", "--backend", url, "--workdir", str(tmp_path)])
    assert res.exit_code == 3 and "cannot reach PostgreSQL" in res.output
    assert "Traceback" not in res.output


def test_demo_exits_1_and_prints_violations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the trace check finds a violation, the demo prints it and exits 1."""

    def broken(*args: object, **kwargs: object) -> TraceReport:
        report = check_trace(*args, **kwargs)  # type: ignore[arg-type]
        return attrs.evolve(report, violations=(Violation("exactly_once", "r0: twice", 7),))

    monkeypatch.setattr(demo_cmd, "check_trace", broken)
    res = run(["demo", "--backend", "memory://", "--workdir", str(tmp_path)])
    assert res.exit_code == 1
    assert "exactly_once: r0: twice (event #7)" in res.stdout and "1 violations" in res.stdout


def test_demo_hint_is_a_command_that_runs_where_the_demo_ran(tmp_path: Path) -> None:
    """`make demo` runs `.venv/bin/rollout-lifecycle`, which is not on PATH: the closing
    hint names the program as it was invoked, and that command runs as printed."""
    import os
    import shlex
    import subprocess
    import sys

    script = Path(sys.executable).parent / "rollout-lifecycle"
    if not script.is_file():
        pytest.skip("the console script is not installed beside this interpreter")
    env = {**os.environ, "PATH": "/usr/bin:/bin"}  # as after `make demo`: no venv on PATH
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    res = subprocess.run(
        [str(script), "demo", "--backend", url, "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    (hint,) = [ln for ln in res.stdout.splitlines() if ln.startswith("inspect it: ")]
    command = hint.removeprefix("inspect it: ")
    assert command.startswith(shlex.quote(str(script)) + " ledger history"), command
    again = subprocess.run(
        shlex.split(command), capture_output=True, text=True, env=env, timeout=120
    )
    assert again.returncode == 0 and "history of r3" in again.stdout, again.stderr


def test_demo_json_report_is_the_only_stdout(tmp_path: Path) -> None:
    """--json: stdout is the report (the story goes to stderr); --quiet drops the story;
    --report writes the same report to a file."""
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    report = tmp_path / "demo.json"
    quiet_json = ["--json", "--quiet", "--report", str(report)]
    res = run(["demo", "--backend", url, "--workdir", str(tmp_path), *quiet_json])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data == json.loads(report.read_text())
    assert data["schema"] == "rollout-lifecycle/demo/1" and data["trace"]["violations"] == []
    assert data["rollouts"]["r3"]["state"] == "retired_stale"
    assert "[ 1]" not in res.stdout and "[ 1]" not in res.stderr
