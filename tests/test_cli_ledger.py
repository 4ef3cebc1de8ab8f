"""`rollout-lifecycle ledger`: counts, show, history and check on a ledger file built here."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner, Result

from rollout_lifecycle.cli.main import cli
from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.events import EntryChanged
from rollout_lifecycle.model.gate import AdmissionGate, GatePolicy
from rollout_lifecycle.model.ledger import ReserveRequest
from rollout_lifecycle.model.machines import LIFECYCLE
from rollout_lifecycle.model.records import (
    ActionEvidence,
    AdmissionPolicy,
    BehaviorPolicy,
    GenerationConditions,
    Reward,
    Rollout,
    RolloutIdentity,
    WorkerAck,
    to_jsonable,
)
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.model.sqlite_common import append_events, connect

H0 = "0" * 64
COND = GenerationConditions("tok", 1.0, 1.0, -1, 8)


def _rollout(rid: str) -> Rollout:
    return Rollout(
        RolloutIdentity(rid, "p", "d", 0),
        BehaviorPolicy(0, H0),
        COND,
        ActionEvidence([1, 2], [True, True], [-1.0, -1.0]),
    )


@pytest.fixture
def ledger_url(tmp_path: Path) -> str:
    """A ledger file: v0 active; r0 consumed by update-1, r1 rewarded, r2 reward timed out."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    with open_backend(url) as b:
        set_admission_policy(b.registry, AdmissionPolicy(1, 0.2), "set by the operator")
        coord = ActivationCoordinator(
            b.registry, ["w0"], ledger=b.ledger, policy=AdmissionPolicy(1, 0.2)
        )
        coord.prepare(0)
        coord.commit_artifact(0, H0)
        coord.distribute(0)
        coord.record_ack(WorkerAck("w0", 0, H0, token=coord.attempt_token("w0", 0)))
        assert coord.try_activate(0).activated
        for rid in ("r0", "r1", "r2"):
            b.ledger.add(_rollout(rid))
            b.ledger.transition(rid, "generation_done", 0)
        for rid in ("r0", "r1"):
            b.ledger.transition(rid, "reward_ready", 1, reward=Reward("f", "1", 1.0))
        b.ledger.transition("r2", "reward_timeout", 1)
        gate = AdmissionGate(GatePolicy(1, 0.2, COND), coord.activated_hash)
        d = gate.assess(_rollout("r0"), [-1.0, -1.0], 0, b.ledger.get("r0"))
        assert d.accepted
        b.ledger.reserve_batch("update-1", [ReserveRequest("r0", 2, d.stamp())])
        b.ledger.reserve("r0", 2, "update-2", d.stamp())  # loses its CAS
        b.ledger.commit("update-1", ["r0"])
    return url


def run(args: list[str]) -> Result:
    """Invoke the CLI group as a user would."""
    return CliRunner().invoke(cli, args)


def test_counts_lists_every_state_and_the_counters(ledger_url: str) -> None:
    """counts --json gives every lifecycle state (zeros too) and the statistics counters."""
    res = run(["ledger", "counts", "--backend", ledger_url, "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert list(data["by_state"]) == list(LIFECYCLE.states)
    assert data["entries"] == 3
    assert {k: v for k, v in data["by_state"].items() if v} == {
        "consumed": 1,
        "rewarded": 1,
        "reward_timed_out": 1,
    }
    assert data["counters"]["reservations"] == 1
    assert data["counters"]["commits"] == 1
    # the fixture's lost CAS wrote nothing; SQLite counts it per ledger object only
    assert data["not_stored"] == ["idempotent_retries", "cas_conflicts", "refused"]
    assert set(data["not_stored"]).isdisjoint(data["counters"])


def test_counts_table_says_which_counters_are_not_stored(ledger_url: str) -> None:
    """The table marks per-process counters instead of printing a misleading 0."""
    res = run(["ledger", "counts", "--backend", ledger_url])
    assert res.exit_code == 0, res.output
    assert "cas_conflicts" in res.output and "not stored" in res.output


def test_counts_table_names_every_state(ledger_url: str) -> None:
    """The table form shows each state, including those with no rollout."""
    res = run(["ledger", "counts", "--backend", ledger_url])
    assert res.exit_code == 0, res.output
    for state in LIFECYCLE.states:
        assert state in res.stdout
    assert "cas_conflicts" in res.stdout


def test_show_prints_the_stored_entry(ledger_url: str) -> None:
    """show --json is the entry exactly as stored; the table names its state and owner."""
    res = run(["ledger", "show", "r0", "--backend", ledger_url, "--json"])
    assert res.exit_code == 0, res.output
    with open_backend(ledger_url, create=False) as b:
        assert json.loads(res.stdout) == to_jsonable(b.ledger.get("r0"))
    res = run(["ledger", "show", "r2", "--backend", ledger_url])
    assert res.exit_code == 0
    assert "reward_timed_out" in res.stdout and "reward: timeout" in res.stdout


def test_history_lists_every_write_with_states_revisions_and_update(ledger_url: str) -> None:
    """history --json gives each write: event, before -> after state, revision, update id."""
    res = run(["ledger", "history", "r0", "--backend", ledger_url, "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert [(r["event"], r["before_state"], r["after_state"]) for r in rows] == [
        ("add", None, "dispatched"),
        ("generation_done", "dispatched", "generated"),
        ("reward_ready", "generated", "rewarded"),
        ("reserve", "rewarded", "reserved"),
        ("commit", "reserved", "consumed"),
    ]
    assert [r["revision_after"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["update_id"] for r in rows][-2:] == ["update-1", "update-1"]
    assert all(r["time"].endswith("+00:00") for r in rows)
    table = run(["ledger", "history", "r0", "--backend", ledger_url])
    assert table.exit_code == 0
    assert "generation_done" in table.stdout and "update-1" in table.stdout


@pytest.mark.parametrize("sub", ["show", "history"])
def test_unknown_rollout_is_an_error(ledger_url: str, sub: str) -> None:
    """An id that is not in the ledger exits 2 (input error) with its name, no traceback."""
    res = run(["ledger", sub, "nope", "--backend", ledger_url])
    assert res.exit_code == 2
    assert "'nope' is not in" in res.output and "Traceback" not in res.output


def test_check_replays_the_trace_clean(ledger_url: str) -> None:
    """check replays ledger and registry events and reports 0 violations (exit 0)."""
    res = run(["ledger", "check", "--backend", ledger_url])
    assert res.exit_code == 0, res.output
    assert "0 violations" in res.stdout
    res = run(["ledger", "check", "--backend", ledger_url, "--json"])
    data = json.loads(res.stdout)
    assert data["ok"] is True and data["violations"] == []
    assert "pointer_names_active_artifact" in data["checked"]


def test_check_quiescent_passes_when_nothing_is_pending(ledger_url: str) -> None:
    """--quiescent adds the eventually invariants; nothing is reserved, so it still passes."""
    res = run(["ledger", "check", "--backend", ledger_url, "--quiescent", "--json"])
    assert res.exit_code == 0, res.output
    assert "reservations_resolve" in json.loads(res.stdout)["checked"]


def test_check_reports_a_violation_and_exits_1(ledger_url: str, tmp_path: Path) -> None:
    """A stored write that leaves a terminal state is named, and check exits 1."""
    with open_backend(ledger_url, create=False) as b:
        consumed = b.ledger.get("r0")
    bad = attrs.evolve(consumed, state="rewarded", revision=consumed.revision + 1)
    conn = connect(tmp_path / "ledger.db")
    conn.execute("BEGIN IMMEDIATE")
    append_events(conn, [EntryChanged(0, 0, 0.0, "r0", "abort", consumed, bad)])
    conn.execute("COMMIT")
    conn.close()
    res = run(["ledger", "check", "--backend", ledger_url])
    assert res.exit_code == 1
    assert "terminal_absorbing: r0: left terminal state 'consumed'" in res.stdout
    assert "declared_edges" in res.stdout and "stored_matches_trace: r0" in res.stdout
    # an event appended behind the ledger's back counted nothing: the counters say so
    assert "ledger counter writes: stored" in res.stdout
    assert "ledger counter aborts: stored 0" in res.stdout
    assert "5 violations" in res.stdout
    assert "Traceback" not in res.output
    data = json.loads(run(["ledger", "check", "--backend", ledger_url, "--json"]).stdout)
    assert data["ok"] is False
    assert "terminal_absorbing" in {v["invariant"] for v in data["violations"]}


@pytest.mark.parametrize("sub", [["counts"], ["show", "r0"], ["history", "r0"], ["check"]])
def test_missing_file_is_an_error_and_is_not_created(tmp_path: Path, sub: list[str]) -> None:
    """A missing ledger file exits 2 and is never created as an empty database."""
    path = tmp_path / "typo.db"
    res = run(["ledger", *sub, "--backend", f"sqlite:///{path}"])
    assert res.exit_code == 2
    assert "no such file" in res.output and "Traceback" not in res.output
    assert not path.exists()


def test_default_backend_is_rollout_lifecycle_db_in_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --backend the ledger is ./rollout-lifecycle.db, and a missing one is an error."""
    monkeypatch.chdir(tmp_path)
    res = run(["ledger", "counts"])
    assert res.exit_code == 2 and "rollout-lifecycle.db" in res.output
    assert not (tmp_path / "rollout-lifecycle.db").exists()
    with open_backend("sqlite:///rollout-lifecycle.db"):
        pass
    res = run(["ledger", "counts", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["entries"] == 0


def test_memory_and_foreign_files_are_refused(tmp_path: Path) -> None:
    """memory:// holds nothing to read; a SQLite file without a ledger is named as such."""
    res = run(["ledger", "counts", "--backend", "memory://"])
    assert res.exit_code == 2 and "nothing stored" in res.output
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE t (x)")
    res = run(["ledger", "counts", "--backend", f"sqlite:///{other}"])
    assert res.exit_code == 2 and "no rollout-lifecycle ledger" in res.output
