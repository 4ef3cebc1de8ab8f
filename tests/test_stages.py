"""The campaign's targeted stages (stateful_tests/stages.py): registered in one place, each
runs on the backends it names and says why where it does not, and each passes on the
correct code (their mutants are killed in test_mutants.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rollout_lifecycle.stateful_tests.skew import judge_client
from rollout_lifecycle.stateful_tests.stages import (
    STAGES,
    StageContext,
    backend_kind,
    run_stage,
)

# the verl-v1 stage starts Ray and TransferQueue in the test process
pytestmark = pytest.mark.timeout(900)


def test_stages_are_registered_with_backends_profiles_and_entry_points() -> None:
    """Every stage names where it runs, the profiles it belongs in, and an entry point."""
    assert set(STAGES) == {"verl-v1", "clock-skew", "premise-window", "faults"}
    for s in STAGES.values():
        assert s.backends and set(s.backends) <= {"memory", "sqlite", "postgresql"}
        assert "ci" in s.profiles and s.entry.count(":") == 1 and s.seconds_hint
    assert [backend_kind(b) for b in ("memory", "sqlite", "postgresql://u@h/db")] == [
        "memory",
        "sqlite",
        "postgresql",
    ]


@pytest.mark.parametrize("name", ["clock-skew", "premise-window"])
def test_a_postgres_stage_on_sqlite_is_skipped_saying_where_it_runs(
    name: str, tmp_path: Path
) -> None:
    """A stage of PostgreSQL code does not run on SQLite and says what would run it."""
    rep = run_stage(name, StageContext("sqlite", tmp_path))
    assert not rep.ran and rep.ok and rep.skipped is not None
    assert "postgresql" in rep.skipped


def test_verl_v1_stage_without_the_extra_is_skipped_with_the_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without TransferQueue the verl-v1 stage is skipped, loudly, naming the extra."""
    monkeypatch.setitem(sys.modules, "transfer_queue", None)  # import fails
    rep = run_stage("verl-v1", StageContext("sqlite", tmp_path))
    assert not rep.ran and rep.skipped is not None
    assert "[verl-v1]" in rep.skipped and "pip install" in rep.skipped


@pytest.mark.slow
def test_verl_v1_stage_passes_on_sqlite(tmp_path: Path) -> None:
    """Steps, eviction with refill, a killed trainer and a resumed one: nothing violated."""
    pytest.importorskip("transfer_queue")
    rep = run_stage("verl-v1", StageContext("sqlite", tmp_path))
    assert rep.ran and rep.ok, rep.failures
    assert rep.facts["samples"] == 5 and rep.facts["refill_calls"] == 2


@pytest.mark.postgres
def test_clock_skew_stage_passes_on_postgres(tmp_path: Path) -> None:
    """Clients 5 minutes ahead and behind (faketime where installed): every deadline is the
    server's, every expiry pass exact, the trace clean."""
    rep = run_stage("clock-skew", StageContext("postgresql", tmp_path))
    assert rep.ran and rep.ok, rep.failures
    assert rep.facts["calls_judged"] >= 14


@pytest.mark.postgres
def test_premise_window_stage_passes_on_postgres(tmp_path: Path) -> None:
    """With the premise lock, every switch waits for the paused reservation, single and
    batch, and nothing is reserved against a pointer that moved."""
    rep = run_stage("premise-window", StageContext("postgresql", tmp_path))
    assert rep.ran and rep.ok, rep.failures
    rounds = rep.facts["rounds"]
    assert [r["path"] for r in rounds] == ["single", "batch", "single", "batch"]
    assert all(r["switch"] == "activated" and all(r["reserved"].values()) for r in rounds)


@pytest.mark.postgres
def test_premise_window_stage_fails_when_its_switch_never_hits_the_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round counts only when the switch started while the learner was in its window:
    with no pause, the single reservation returns before it is seen in its window, every
    attempt is a miss, and the stage fails rather than passing without having tested."""
    from rollout_lifecycle.stateful_tests import windows

    monkeypatch.setattr(windows, "PAUSE_S", 0.0)
    monkeypatch.setattr(windows, "ATTEMPTS", 2)
    rep = run_stage("premise-window", StageContext("postgresql", tmp_path))
    assert rep.ran and not rep.ok
    missed = [f for f in rep.failures if "never started while the learner was in" in f]
    assert missed and all("(single)" in f for f in missed), rep.failures
    assert rep.facts["missed"] >= 2 * len(missed)
    assert not any(f.startswith("spec:") for f in rep.failures), rep.failures


def test_skew_judge_flags_client_deadlines_and_wrong_expiries() -> None:
    """The skew stage's judge, on recorded calls: a deadline off by the client's skew, a
    lease expired before its server deadline and one left past it are each named."""
    good = {
        "op": "reserve",
        "t0": 100.0,
        "t1": 100.2,
        "lease_seconds": 10.0,
        "leases": {"a": 110.1},
    }
    assert judge_client({"calls": [good]}) == []
    skewed = {**good, "leases": {"a": 410.1}}
    (msg,) = judge_client({"calls": [skewed]})
    assert "off by about 300s" in msg
    expiry = {"op": "expire", "t0": 200.0, "t1": 200.1, "held": {"a": 150.0, "b": 250.0}}
    (early,) = judge_client({"calls": [{**expiry, "returned": ["a", "b"]}]})
    assert "before their deadline" in early and "'b'" in early
    (missed,) = judge_client({"calls": [{**expiry, "returned": []}]})
    assert "were not expired" in missed and "'a'" in missed
    assert judge_client({"error": "child exited 1"}) == ["child exited 1"]
