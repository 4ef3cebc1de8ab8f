"""The SQLite events layout of ledger schema 2 / registry schema 5 (no AUTOINCREMENT, no index
on txn) against files written by the code before it (ledger 1 / registry 4): such a file is
migrated on open, keeps its events, seqs and counters, and audits clean after new writes; a
program of the old layout refuses a file of the new one."""

from __future__ import annotations

import itertools
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from rollout_lifecycle.cli.main import cli
from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.ledger import ReserveRequest
from rollout_lifecycle.model.records import AdmissionStamp, Reward
from rollout_lifecycle.model.registry import SCHEMA_VERSION as REGISTRY_SCHEMA
from rollout_lifecycle.model.sqlite_ledger import SCHEMA_VERSION as LEDGER_SCHEMA
from rollout_lifecycle.model.sqlite_ledger import SQLiteLedger
from tests.data.old_layout_builder import rollout

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parent.parent
OLD_COMMIT = "cdf3a11"  # the last commit writing the old layout


def _old_file(path: Path) -> Path:
    """tests/data/ledger-v1.sql (made by old_layout_builder.py run with the old code) as a
    database file."""
    conn = sqlite3.connect(path)
    conn.executescript((DATA / "ledger-v1.sql").read_text())
    conn.close()
    return path


def _indexes(path: Path) -> set[str]:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'").fetchall()
    finally:
        conn.close()
    return {str(r[0]) for r in rows}


def _check(path: Path) -> dict[str, Any]:
    res = CliRunner().invoke(cli, ["ledger", "check", "--backend", f"sqlite:///{path}", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert isinstance(data, dict)
    return data


def _write_more(path: Path) -> None:
    """Every kind of write on the migrated file: adds, single and batch reservations, a
    commit, an abort, a registry step."""
    with open_backend(f"sqlite:///{path}") as b:
        stamp = AdmissionStamp(0, 0, 1, 0.2, 0.0, "fresh", "ok", True)
        for rid in ("n0", "n1", "n2"):
            b.ledger.add(rollout(rid))
            b.ledger.transition(rid, "generation_done", 0)
            b.ledger.transition(rid, "reward_ready", 1, reward=Reward("f", "1", 1.0))
        assert b.ledger.reserve("r3", 2, "update-3", stamp).reserved
        assert b.ledger.reserve("n0", 2, "update-3", stamp).reserved
        b.ledger.commit("update-3", ["r3", "n0"])
        out = b.ledger.reserve_batch(
            "update-4", [ReserveRequest(r, 2, stamp) for r in ("n1", "n2")]
        )
        assert all(o.reserved for o in out)
        b.ledger.abort("update-4")
        ActivationCoordinator(b.registry, ["w0"], ledger=b.ledger).prepare(1)


def test_an_old_file_is_migrated_and_audits_clean_after_new_writes(tmp_path: Path) -> None:
    """The old file opens, loses its events_txn index, keeps its counters, hands out seqs
    and txns after the old ones, and `ledger check` finds 0 violations."""
    path = _old_file(tmp_path / "old.db")
    assert "events_txn" in _indexes(path)
    before = _check(path)
    assert before["violations"] == []
    conn = sqlite3.connect(path)
    last_seq, last_txn = conn.execute("SELECT MAX(seq), MAX(txn) FROM events").fetchone()
    conn.close()
    for read_only in (True, False):  # read-only: the old table, unmigrated; then migrated
        with SQLiteLedger(path, read_only=read_only) as led:
            old_stats = led.statistics()
        assert (old_stats.writes, old_stats.reservations, old_stats.aborts) == (21, 3, 1)
        assert ("events_txn" in _indexes(path)) is read_only
    _write_more(path)
    assert "events_txn" not in _indexes(path)
    data = _check(path)
    assert data["violations"] == [], data["violations"]
    # unsealed, the old file's recorded tables could not be compared; the first writer of
    # this version sealed it (their rows recorded in the chain), and now every table is
    # compared, the counters (moved into the head's row) with the recorded writes; the
    # lineage index, which that writer built, too
    assert set(before["not_compared"]) == {
        "host_clock",
        "ledger_bad_versions",
        "schema_meta",
        "registry_claims",
    }
    assert data["not_compared"] == {}
    assert {"ledger_counters", "schema_meta"} <= set(data["compared"])
    conn = sqlite3.connect(path)
    versions = dict(conn.execute("SELECT component, version FROM schema_meta").fetchall())
    rows = conn.execute("SELECT seq, txn FROM events WHERE seq > ? ORDER BY seq", (last_seq,))
    new = rows.fetchall()
    head = conn.execute("SELECT last_seq FROM events_chain").fetchone()[0]
    conn.close()
    # history: the seal
    assert versions == {"ledger": LEDGER_SCHEMA, "registry": REGISTRY_SCHEMA, "history": 1}
    assert new[0] == (last_seq + 1, last_txn + 1)
    assert [s for s, _ in new] == list(range(last_seq + 1, last_seq + 1 + len(new)))
    assert all(a[1] <= b[1] for a, b in itertools.pairwise(new))
    assert head == new[-1][0]
    with SQLiteLedger(path, read_only=True) as led:
        st = led.statistics()
    assert (st.reservations, st.commits, st.aborts) == (3 + 4, 2, 2)


def test_a_deleted_tail_before_the_chain_is_not_numbered_again(tmp_path: Path) -> None:
    """A file of events written before the hash chain whose last events were deleted: the
    chain's head takes AUTOINCREMENT's counter, so the next event never reuses their seqs
    (as AUTOINCREMENT never did)."""
    path = _old_file(tmp_path / "old.db")
    conn = sqlite3.connect(path)
    conn.executescript(
        "DROP TABLE events_chain; UPDATE events SET prev_hash = NULL, hash = NULL;"
        "DELETE FROM events WHERE seq > 20;"
        # as a program before the chain left it: the chain came with registry schema 3
        "UPDATE schema_meta SET version = 2 WHERE component = 'registry';"
    )
    conn.close()
    with open_backend(f"sqlite:///{path}") as b:
        b.ledger.add(rollout("n0"))
    conn = sqlite3.connect(path)
    seqs = [r[0] for r in conn.execute("SELECT seq FROM events WHERE seq > 20")]
    conn.close()
    assert seqs[0] == 29 and seqs == list(range(29, 29 + len(seqs)))  # the seal's, then n0's


def test_a_new_file_has_the_new_layout(tmp_path: Path) -> None:
    """Events numbered without AUTOINCREMENT (no sqlite_sequence page per commit), no index
    on txn, no counters table (the head's columns); `ledger check` lists what it does not
    compare as for a migrated file."""
    path = tmp_path / "new.db"
    _write_more(_old_file(tmp_path / "x.db"))  # any content; the new file gets its own
    with open_backend(f"sqlite:///{path}") as b:
        b.ledger.add(rollout("a"))
        b.ledger.add(rollout("b"))
    conn = sqlite3.connect(path)
    sql = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'events'").fetchone()[0]
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    txns = conn.execute("SELECT seq, txn FROM events ORDER BY seq").fetchall()
    conn.close()
    assert "AUTOINCREMENT" not in sql and "sqlite_sequence" not in tables
    assert "events_txn" not in _indexes(path) and "ledger_counters" not in tables
    # the first steps seal the file (its schema rows, the host clock's origin: recorded
    # in the chain), then the two adds, each a step of its own
    assert [s for s, _ in txns] == list(range(1, len(txns) + 1))
    assert all(a[1] <= b[1] for a, b in itertools.pairwise(txns))
    assert txns[-1][1] == txns[-2][1] + 1
    assert _check(path)["not_compared"] == _check(tmp_path / "x.db")["not_compared"]


def _old_code(tmp_path: Path) -> Path:
    """The old layout's code, from git (skipped where the checkout has no history)."""
    out = tmp_path / "old-code"
    out.mkdir()
    try:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", OLD_COMMIT],
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip(f"commit {OLD_COMMIT} is not in this checkout's history")
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True, timeout=60)
    return out


def _run_old(code: Path, script: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(code)}
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=code,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_old_code_writes_then_new_code_writes_then_old_code_is_refused(tmp_path: Path) -> None:
    """The old program (cdf3a11) writes a file, this one migrates it and writes more, the
    audit finds 0 violations; the old program then refuses the file with its message about
    a newer schema, for the ledger and for the registry."""
    code = _old_code(tmp_path)
    path = tmp_path / "live.db"
    made = _run_old(
        code,
        f"import sys; sys.path.insert(0, {str(DATA)!r}); "
        f"from old_layout_builder import build; build({str(path)!r})",
    )
    assert made.returncode == 0, made.stderr
    assert "events_txn" in _indexes(path)
    _write_more(path)
    assert _check(path)["violations"] == []
    ledger = _run_old(
        code,
        "from rollout_lifecycle.model.sqlite_ledger import SQLiteLedger; "
        f"SQLiteLedger({str(path)!r})",
    )
    assert ledger.returncode != 0
    assert f"ledger schema version {LEDGER_SCHEMA}, this program expects 1" in ledger.stderr
    assert "newer rollout-lifecycle" in ledger.stderr
    registry = _run_old(
        code,
        "from rollout_lifecycle.model.registry import SQLiteRegistry; "
        f"SQLiteRegistry({str(path)!r})",
    )
    assert registry.returncode != 0
    assert f"registry schema version {REGISTRY_SCHEMA}, this program expects 4" in registry.stderr


def test_the_head_stores_every_durable_counter_the_statistics_read() -> None:
    """The head's counter columns are the statistics' counters that are not process-local:
    a counter added to one and not the other would be refused on write or read as 0."""
    import attrs

    from rollout_lifecycle.model.ledger import PROCESS_LOCAL_COUNTERS, LedgerStatistics
    from rollout_lifecycle.model.sqlite_common import HEAD_COUNTERS

    counters = {f.name for f in attrs.fields(LedgerStatistics) if f.type in (int, "int")} - {
        "entries"
    }
    assert set(HEAD_COUNTERS) == counters - PROCESS_LOCAL_COUNTERS
