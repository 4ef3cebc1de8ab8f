"""Issue 21's simulation (cli/pacing_sim.py): the report's shape, determinism for a seed,
every dispatched rollout accounted for in the real ledger, and the done-when targets.

Everything runs in child processes, as test_bench does: the simulation's modules are then
never loaded into the test process (Hypothesis draws on the constants of every loaded
project module, so loading them here would change what later seeded fuzz runs generate).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

ROW_KEYS = {
    "strategy",
    "max_lag",
    "never_trained",
    "max_attempts",
    "wasted_fraction",
    "ks_length",
    "throughput",
}

# Runs in a child: every strategy at every lag on the quick pool, and per run what the ledger
# holds against what was dispatched; then one run again, for determinism within a process.
ACCOUNTING = """
import json
from rollout_lifecycle.cli import pacing_sim as S
from rollout_lifecycle.model.pacing import LIVE_STATES

out = {"runs": [], "config_max_attempts": S.QUICK.max_attempts}
prompts = S.Prompts.draw(S.QUICK)
for lag in S.LAGS:
    for strategy in S.STRATEGIES:
        r = S.Simulation(S.QUICK, prompts, strategy, lag).run()
        states = [r.entries[i].state for i in r.dispatched_ids if i in r.entries]
        out["runs"].append({
            "row": r.row,
            "detail": r.detail,
            "dispatched": len(r.dispatched_ids),
            "distinct_dispatched": len(set(r.dispatched_ids)),
            "entries": len(r.entries),
            "consumed": states.count("consumed"),
            "live": sum(s in LIVE_STATES for s in states),
            "ended_with_cause": sum(
                1 for i in r.dispatched_ids
                if i in r.entries and r.entries[i].state != "consumed"
                and r.entries[i].state not in LIVE_STATES
                and r.entries[i].disposition is not None
            ),
            "problems": S.unaccounted(r),
        })
again = S.simulate(S.QUICK, "ours", 1)
out["again"] = again.row
# the check itself must see a rollout missing from the ledger and one ended without a cause
import attrs
first = next(iter(again.entries))
missing = attrs.evolve(again, entries={k: v for k, v in again.entries.items() if k != first})
out["missing_detected"] = bool(S.unaccounted(missing))
causeless = attrs.evolve(again.entries[first], state="retired_stale", disposition=None)
silent = attrs.evolve(again, entries={**again.entries, first: causeless})
out["causeless_detected"] = bool(S.unaccounted(silent))
out["untampered_clean"] = S.unaccounted(again) == []
out["ks_checks"] = [S.ks_distance([1, 2, 3], [1, 2, 3]), S.ks_distance([1, 2], [3, 4]),
                    S.ks_distance([1, 2, 3, 4], [3, 4])]
print(json.dumps(out))
"""


def _child(code: str) -> dict[str, Any]:
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert res.returncode == 0, res.stderr
    out: dict[str, Any] = json.loads(res.stdout)
    return out


@pytest.fixture(scope="module")
def cli_report() -> dict[str, Any]:
    """`rollout-lifecycle bench --part pacing --quick --json`, as a user runs it."""
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_lifecycle",
            "bench",
            "--part",
            "pacing",
            "--quick",
            "--json",
            "--no-docs",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    report: dict[str, Any] = json.loads(res.stdout)
    return report


@pytest.fixture(scope="module")
def accounting() -> dict[str, Any]:
    return _child(ACCOUNTING)


def _by(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["strategy"], r["max_lag"]): r for r in rows}


def test_json_shape(cli_report: dict[str, Any]) -> None:
    """`pacing.results`: one row per strategy and lag, exactly the issue's fields."""
    rows = cli_report["pacing"]["results"]
    assert len(rows) == 9
    assert set(_by(rows)) == {
        (s, lag) for s in ("discard", "capacity", "ours") for lag in (1, 2, 4)
    }
    for r in rows:
        assert set(r) == ROW_KEYS
        for k in ("never_trained", "max_attempts", "max_lag"):
            assert isinstance(r[k], int) and r[k] >= 0
        assert 0 <= r["wasted_fraction"] <= 1 and 0 <= r["ks_length"] <= 1
        assert r["throughput"] > 0
    goals = [g for g in cli_report["goals"] if g["goal"].startswith("pacing (issue 21)")]
    assert len(goals) == 5 and all(g["met"] is not None for g in goals)
    assert {"admission", "ledgers", "checkers"}.isdisjoint(cli_report)  # only the part asked


def test_deterministic_for_a_seed(cli_report: dict[str, Any], accounting: dict[str, Any]) -> None:
    """Two processes (the CLI and the child) and two runs in one process agree exactly."""
    assert [a["row"] for a in accounting["runs"]] == cli_report["pacing"]["results"]
    assert [a["detail"] for a in accounting["runs"]] == cli_report["pacing"]["details"]
    assert accounting["again"] == _by(cli_report["pacing"]["results"])[("ours", 1)]


def test_every_dispatched_rollout_is_accounted_for(accounting: dict[str, Any]) -> None:
    """Each ledger entry is consumed, live, or ended with a recorded cause, and the ledger
    holds exactly one entry per dispatch, for every strategy at every lag."""
    assert accounting["untampered_clean"]
    assert accounting["missing_detected"] and accounting["causeless_detected"]
    for run in accounting["runs"]:
        where = (run["row"]["strategy"], run["row"]["max_lag"])
        assert run["problems"] == [], where
        n = run["dispatched"]
        assert n == run["distinct_dispatched"] == run["entries"], where
        assert run["consumed"] + run["live"] + run["ended_with_cause"] == n, where
        prompts = run["detail"]["prompts"]
        assert run["consumed"] == run["detail"]["trained"] <= prompts, where
        assert run["row"]["max_attempts"] >= 1 and n >= prompts, where


def test_ks_distance(accounting: dict[str, Any]) -> None:
    """The two-sample KS statistic: 0 for equal samples, 1 when disjoint, the largest gap."""
    assert accounting["ks_checks"] == [0.0, 1.0, 0.5]


def test_done_when_at_max_lag_1(cli_report: dict[str, Any], accounting: dict[str, Any]) -> None:
    """Issue 21's targets, ours against discard-and-requeue at max_lag 1 on the quick pool
    (deterministic for its seed). Throughput has the least margin: 1.04x here, 0.97-1.04x
    over seeds 0-4 of this pool, 0.96-0.97x over seeds 0-2 of the full one; wasted
    generation is 0.36-0.38x discard's on both."""
    rows = _by(cli_report["pacing"]["results"])
    ours, discard = rows[("ours", 1)], rows[("discard", 1)]
    assert ours["never_trained"] == 0
    assert 1 <= ours["max_attempts"] <= accounting["config_max_attempts"]
    assert ours["ks_length"] <= 0.05
    assert ours["wasted_fraction"] <= 0.5 * discard["wasted_fraction"]
    assert ours["throughput"] >= 0.95 * discard["throughput"]
    assert all(g["met"] for g in cli_report["goals"] if g["goal"].startswith("pacing"))
