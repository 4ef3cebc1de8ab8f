"""`python benchmarks/postgres_floor.py`, which docs/postgres.md cites for the floor of a
reservation, runs as printed (here on a few rows) and reports every sequence; never its
times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.postgres
def test_floor_script_runs_every_sequence(tmp_path: Path, postgres_url: str) -> None:
    """A subprocess, as a user runs it (the measurement module stays out of this process).
    Its sequences assert themselves that every write won, so a statement that stopped
    matching the schema fails here."""
    out = tmp_path / "floor.json"
    tiny = ["--rounds", "1", "--single-n", "8", "--batch-n", "20", "--chunk", "10"]
    res = subprocess.run(
        [
            sys.executable,
            "benchmarks/postgres_floor.py",
            "--url",
            postgres_url,
            *tiny,
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = json.loads(out.read_text())
    single = ["plain", "same_cols", "peek", "cas_fn", "cas_event_fn", "peek+cas_fn", "fn"]
    batch = ["same", "cas", "statements", "reserve_batch"]
    assert list(rows) == [*single, "fn_guard", "peek+fn_guard", "reserve", *batch]
    for name, row in rows.items():
        assert row["client_ms"] > 0 and row["server_ms"] >= 0, (name, row)
        assert row["total_ms"] > 0 and row["base_vs_total"] > 0, (name, row)
    assert rows["plain"]["base_vs_total"] == 1.0 and rows["same"]["base_vs_total"] == 1.0
