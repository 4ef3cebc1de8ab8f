"""Every checking command exits non-zero on a finding and zero on a clean run.

These run the REAL installed entry point in a subprocess: click's CliRunner reports the code
of `click.exceptions.Exit` even where the console script would have dropped it, so only a
subprocess sees what a CI job sees. A bug is injected into model/ through a
`sitecustomize.py` on PYTHONPATH that activates one mutant of the catalogue before the
entry point runs, so the command under test is the unmodified `rollout-lifecycle`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest

from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.events import EntryChanged
from rollout_lifecycle.model.sqlite_common import append_events, connect

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "diagrams"


def entry_point() -> list[str]:
    """The console script installed beside this interpreter (what users and CI run)."""
    script = Path(sys.executable).parent / "rollout-lifecycle"
    if not script.exists():
        found = shutil.which("rollout-lifecycle")
        if found is None:
            pytest.fail("the rollout-lifecycle console script is not installed (pip install -e .)")
        script = Path(found)
    return [str(script)]


def cli(
    *args: str, cwd: Path, mutant: str | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run the entry point; with `mutant`, that catalogue bug is active in the child."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["CI"] = "true"
    if mutant is not None:
        site = cwd / "site-mutant"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(
            textwrap.dedent(
                f"""
                from rollout_lifecycle.stateful_tests.mutants import BY_NAME
                _patch = BY_NAME[{mutant!r}]()
                _patch.__enter__()
                """
            )
        )
        env["PYTHONPATH"] = str(site)
    return subprocess.run(
        [*entry_point(), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def clean_db(tmp_path: Path) -> str:
    """A SQLite ledger written by the demo: a clean, complete run."""
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    res = cli("demo", "--backend", url, "--workdir", str(tmp_path / "work"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return url


def test_version_and_help_exit_zero(tmp_path: Path) -> None:
    """--version and --help are clean runs; an unknown command is a usage error (2)."""
    assert cli("--version", cwd=tmp_path).returncode == 0
    assert cli("--help", cwd=tmp_path).returncode == 0
    bad = cli("no-such-command", cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_python_dash_m_is_the_same_cli(tmp_path: Path) -> None:
    """`python -m rollout_lifecycle` runs the same command line."""
    res = subprocess.run(
        [sys.executable, "-m", "rollout_lifecycle", "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0 and "rollout-lifecycle" in res.stdout


def test_ledger_check_exit_codes(tmp_path: Path, clean_db: str) -> None:
    """ledger check: 0 on a clean trace, 1 on a crafted violation, 2 on a missing file."""
    ok = cli("ledger", "check", "--backend", clean_db, cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    path = Path(clean_db.removeprefix("sqlite:///"))
    with open_backend(clean_db, create=False) as b:
        consumed = next(e for e in b.ledger.snapshot().values() if e.state == "consumed")
    bad = attrs.evolve(consumed, state="rewarded", revision=consumed.revision + 1)
    conn = connect(path)
    conn.execute("BEGIN IMMEDIATE")
    append_events(conn, [EntryChanged(0, 0, 0.0, consumed.rollout_id, "abort", consumed, bad)])
    conn.execute("COMMIT")
    conn.close()
    found = cli("ledger", "check", "--backend", clean_db, cwd=tmp_path)
    assert found.returncode == 1, found.stdout + found.stderr
    assert "terminal_absorbing" in found.stdout
    missing = cli("ledger", "check", "--backend", f"sqlite:///{tmp_path / 'nope.db'}", cwd=tmp_path)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr


def test_fuzz_exit_codes(tmp_path: Path) -> None:
    """fuzz: 0 on the shipped ledger, 1 when a blind-write bug is active."""
    args = ("fuzz", "--machine", "ledger", "--backend", "memory", "--examples", "30", "--quiet")
    ok = cli(*args, "--out", str(tmp_path / "ok"), cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = cli(*args, "--out", str(tmp_path / "bad"), cwd=tmp_path, mutant="blind_reserve")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAILED" in bad.stdout


def test_refused_fuzz_backend_creates_no_out_folder(tmp_path: Path) -> None:
    """A backend that cannot be imported is a usage error before fuzz-out/ is made."""
    res = cli("fuzz", "--backend", "mypkg:nosuch", cwd=tmp_path)
    assert res.returncode == 2 and "mypkg" in res.stderr, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_read_only_ledger_commands_leave_no_wal_or_shm(tmp_path: Path, clean_db: str) -> None:
    """counts, show, history and check only read: the folder holds afterwards exactly what
    it held before (no -wal/-shm left beside the ledger file)."""
    folder = Path(clean_db.removeprefix("sqlite:///")).parent
    before = sorted(p.name for p in folder.iterdir())
    assert not [n for n in before if n.endswith(("-wal", "-shm"))], before
    for args in (
        ("ledger", "counts"),
        ("ledger", "check"),
        ("ledger", "show", "no-such-rollout"),
        ("ledger", "history", "no-such-rollout"),
    ):
        res = cli(*args, "--backend", clean_db, cwd=tmp_path)
        assert res.returncode in (0, 2), res.stdout + res.stderr
        assert sorted(p.name for p in folder.iterdir()) == before, args


def test_explore_exit_codes(tmp_path: Path) -> None:
    """explore: 0 on the shipped code, 1 when an activation bug is active."""
    args = ("explore", "--model", "activation-small", "--quiet")
    ok = cli(*args, cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = cli(*args, cwd=tmp_path, mutant="success_without_all_acks")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "violated" in bad.stdout


def test_diagram_check_docs_exit_codes(tmp_path: Path) -> None:
    """diagram --check-docs: 0 on the committed docs, 1 on a stale copy."""
    ok = cli("diagram", "--check-docs", str(DOCS), cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    stale = tmp_path / "diagrams"
    shutil.copytree(DOCS, stale)
    (stale / "lifecycle.mmd").write_text("stateDiagram-v2\n")
    bad = cli("diagram", "--check-docs", str(stale), cwd=tmp_path)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    missing = cli("diagram", "--check-docs", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert "no such folder" in missing.stderr and "stale" not in missing.stdout


def test_diagram_check_docs_reads_what_an_svg_says(tmp_path: Path) -> None:
    """A label edited inside a committed SVG (its source stamp untouched) is stale: the
    text the picture shows is compared with a fresh drawing's."""
    if shutil.which("dot") is None:
        pytest.skip("Graphviz `dot` is needed to draw the fresh SVG")
    docs = tmp_path / "diagrams"
    shutil.copytree(DOCS, docs)
    svg = docs / "activation.svg"
    text = svg.read_text()
    assert ">activate [all_acked]<" in text
    svg.write_text(text.replace(">activate [all_acked]<", ">activate [any_acked]<", 1))
    res = cli("diagram", "--check-docs", str(docs), cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"stale: {svg}" in res.stdout and res.stdout.count("stale:") == 1


def test_mutants_exit_codes(tmp_path: Path) -> None:
    """mutants: 0 when every mutant is killed, 1 when one survives its budget."""
    ok = cli("mutants", "--only", "blind_reserve", "--checker", "fuzz", "--quiet", cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = cli(
        "mutants",
        "--only",
        "retry_not_idempotent",
        "--checker",
        "fuzz",
        "--examples",
        "1",
        "--quiet",
        cwd=tmp_path,
    )
    assert bad.returncode == 1, bad.stdout + bad.stderr


def test_campaign_exit_codes(tmp_path: Path) -> None:
    """campaign: 1 when a bug is active (fuzz finds it), 2 on an unknown explorer model."""
    typo = cli("campaign", "--model", "nope", "--out", str(tmp_path / "c0"), cwd=tmp_path)
    assert typo.returncode == 2 and "nope" in typo.stderr
    assert not (tmp_path / "c0" / "fuzz-report.json").exists()
    bad = cli(
        "campaign",
        "--backend",
        "memory",
        "--examples",
        "20",
        "--no-explore",
        "--quiet",
        "--out",
        str(tmp_path / "c1"),
        cwd=tmp_path,
        mutant="blind_reserve",
    )
    assert bad.returncode == 1, bad.stdout + bad.stderr


def test_admit_bad_input_is_a_usage_error(tmp_path: Path) -> None:
    """admit on a broken line exits 2 with the line number, no traceback, nothing written."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("{oops\n")
    out = tmp_path / "out.jsonl"
    res = cli(
        "admit",
        str(inp),
        "--out",
        str(out),
        "--current-version",
        "1",
        "--max-lag",
        "1",
        "--max-drift",
        "0.2",
        cwd=tmp_path,
    )
    assert res.returncode == 2, res.stderr
    assert "line 1" in res.stderr and "Traceback" not in res.stderr
    assert not out.exists()


def test_drill_without_its_extra_names_the_extra_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The drill needs the [verl] extra (ray, torch, transformers, peft): with transformers
    missing it exits 3 (a missing optional dependency) with one line naming the extra and
    how to install it, never a traceback from inside a Ray actor, and writes nothing."""
    import importlib.util

    from rollout_lifecycle.cli.main import run

    real = importlib.util.find_spec

    def without_transformers(name: str, *args: object) -> object:
        return None if name == "transformers" else real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", without_transformers)
    rc = run(["activation-drill", "--out", str(tmp_path / "d"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert "[verl]" in err and "transformers" in err and "torch==2.13.0" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "d").exists()


def test_reading_memory_is_refused_without_offering_memory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`ledger check --backend memory://` is refused (exit 2: memory:// stores nothing to
    read) by a message whose valid examples do not include memory:// itself."""
    from rollout_lifecycle.cli.main import run

    assert run(["ledger", "check", "--backend", "memory://", "--quiet"]) == 2
    err = capsys.readouterr().err
    valid = err.split("Valid examples:", 1)[1]
    assert "memory://" not in valid and "sqlite:///" in valid and "postgresql://" in valid
