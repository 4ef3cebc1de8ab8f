"""Least privilege on PostgreSQL (docs/postgres.md, model.postgres_roles): each party of a
deployment logs in as its own login, and the SERVER refuses every operation outside its
role, whether asked through the library (a typed RoleRefused naming the role needed) or
sent by a hostile client straight to the server-side functions and tables.

One deployment per test module: roles set up by `deployment roles`, one login per party
(operator, coordinator, two workers, generator, learner, auditor), v0 and v1 active through
the honest path, rollouts added, reserved and committed by their own parties.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from rollout_lifecycle.model.backends import Backend, open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.errors import RoleRefused, RolloutLifecycleError
from rollout_lifecycle.model.ledger import ReserveRequest
from rollout_lifecycle.model.postgres_common import PostgresDatabase
from rollout_lifecycle.model.postgres_roles import OPERATIONS, ROLES
from rollout_lifecycle.model.postgres_setup import (
    drop_logins,
    party_logins,
    roles_info,
    setup_roles,
)
from rollout_lifecycle.model.records import (
    AdmissionPolicy,
    AdmissionStamp,
    LedgerEntry,
    Reward,
    WorkerAck,
)
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.spec.invariants import check_trace, compare_with_store, stored_world
from tests import pg_server

pytestmark = pytest.mark.postgres

CLI = [sys.executable, "-m", "rollout_lifecycle.cli.main"]
H = {v: f"{v:x}".rjust(64, "c") for v in range(20)}
WORKERS = ("gen-0", "gen-1")
POLICY = AdmissionPolicy(max_lag=1, max_drift=0.2)
# the parties of the deployment: login suffix -> (role, worker id)
PARTIES = {
    "operator": ("operator", None),
    "coordinator": ("coordinator", None),
    "worker0": ("worker", "gen-0"),
    "worker1": ("worker", "gen-1"),
    "generator": ("generator", None),
    "learner": ("learner", None),
    "auditor": ("auditor", None),
}
# every table of a deployment: no role may write any of them directly
TABLES = (
    "rollouts",
    "ledger_bad_versions",
    "ledger_counters",
    "events",
    "events_chain",
    "schema_meta",
    "commit_marks",
    "registry_artifacts",
    "registry_pointer",
    "registry_workers",
    "registry_membership",
    "registry_policy",
    "registry_attempt_tokens",
    "rl_operations",
    "rl_roles",
    "rl_logins",
)


def _stamp(behavior: int, current: int, max_lag: int = 1, drift: float = 0.0) -> AdmissionStamp:
    lag = current - behavior
    return AdmissionStamp(
        current_version=current,
        behavior_version=behavior,
        max_lag=max_lag,
        max_drift=0.2 if max_lag <= 1 else 1e9,
        drift=drift,
        freshness="fresh" if lag == 0 else "tolerated",
        reason="ok",
        accepted=True,
    )


def _rewarded(rid: str, version: int) -> LedgerEntry:
    return LedgerEntry(
        rollout_id=rid,
        behavior_version=version,
        artifact_hash=H[version],
        state="rewarded",
        reward=Reward("rm", "1", 1.0),
    )


class Deployment:
    """The module's deployment: the admin URL, one URL per party, open backends on demand."""

    def __init__(self, admin: str, urls: dict[str, str]) -> None:
        self.admin, self.urls = admin, urls
        self._open: dict[str, Backend] = {}

    def backend(self, party: str) -> Backend:
        """The party's backend, opened once (a pool of its own)."""
        if party not in self._open:
            self._open[party] = open_backend(self.urls[party])
        return self._open[party]

    def conn(self, party: str) -> psycopg.Connection[Any]:
        """A raw connection as `party`: what a hostile client holding its credentials has."""
        return psycopg.connect(self.urls[party], autocommit=True)

    def close(self) -> None:
        for b in self._open.values():
            b.close()


def _activate(d: Deployment, version: int) -> None:
    """The honest path of an activation, each party with its own login."""
    c = ActivationCoordinator(d.backend("coordinator").registry, ledger=None)
    c.prepare(version)
    c.commit_artifact(version, H[version])
    c.distribute(version)
    for party, wid in (("worker0", "gen-0"), ("worker1", "gen-1")):
        w = ActivationCoordinator(d.backend(party).registry)
        token = w.attempt_token(wid, version)
        assert w.record_ack(WorkerAck(wid, version, H[version], token=token)).counted
    assert c.try_activate(version).activated


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    """Roles set up, a login per party, v0 then v1 active, rollouts of v0 and v1 waiting."""
    from tests.conftest import postgres_server_or_skip

    server = postgres_server_or_skip()
    admin = pg_server.new_database(server, prefix="roles")
    tag = admin.rsplit("/", 1)[-1]
    db = PostgresDatabase(admin).acquire()
    setup_roles(db)
    names = {party: f"{tag}_{party}" for party in PARTIES}
    logins = party_logins(db, admin, {names[p]: role for p, role in PARTIES.items()})
    d = Deployment(admin, {p: logins[names[p]] for p in PARTIES})
    op = d.backend("operator")
    set_admission_policy(op.registry, POLICY, "the operator's setup step")
    ActivationCoordinator(op.registry, WORKERS, ledger=op.ledger, policy=POLICY)
    _activate(d, 0)
    gen = d.backend("generator").ledger
    gen.add_many([_rewarded(f"a{i}", 0) for i in range(6)])
    _activate(d, 1)
    gen.add_many([_rewarded(f"b{i}", 1) for i in range(6)])
    try:
        yield d
    finally:
        d.close()
        drop_logins(db, list(names.values()))
        db.release()
        server.psql(f'DROP DATABASE IF EXISTS "{tag}" WITH (FORCE)')


# ---- the honest deployment -------------------------------------------------------------


def test_each_party_does_its_own_part_and_the_trace_is_clean(deployment: Deployment) -> None:
    """The learner reserves (single and batch) and commits, the generator moves its
    rollouts, the auditor checks the whole trace: every party through its own login."""
    led = deployment.backend("learner").ledger
    assert led.reserve("b0", 0, "u-honest", _stamp(1, 1)).reserved
    outs = led.reserve_batch("u-honest", [ReserveRequest("b1", 0, _stamp(1, 1))])
    assert [o.reason for o in outs] == ["reserved"]
    assert {e.rollout_id for e in led.commit("u-honest", ["b0", "b1"])} == {"b0", "b1"}
    gen = deployment.backend("generator").ledger
    gen.add(LedgerEntry(rollout_id="g0", behavior_version=1, artifact_hash=H[1]))
    gen.transition("g0", "generation_done", 0)
    gen.transition("g0", "reward_ready", 1, reward=Reward("rm", "1", 1.0))
    audit = deployment.backend("auditor")
    report = check_trace(audit.trace(), with_registry=True)
    assert report.ok, [str(v) for v in report.violations[:5]]
    assert compare_with_store(report.final, stored_world(audit.ledger, audit.registry)) == []


def test_show_says_which_role_the_login_is(deployment: Deployment) -> None:
    """`deployment show` names the mode and the login's role (and a worker's id)."""
    for party, (role, wid) in PARTIES.items():
        res = subprocess.run(
            [*CLI, "deployment", "show", "--backend", deployment.urls[party]],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        assert f"roles: on, you are {role}" in res.stdout, res.stdout
        if wid is not None:
            assert f"worker id {wid}" in res.stdout


# ---- refused through the library: a typed error naming the role --------------------------

# operation outside the role -> (the parties that must be refused, a call doing it)
_OUTSIDE: dict[str, tuple[tuple[str, ...], Any]] = {
    "set_policy": (
        ("coordinator", "worker0", "generator", "learner", "auditor"),
        lambda b: set_admission_policy(b.registry, AdmissionPolicy(1000, 1e9), "hostile"),
    ),
    "change_membership": (
        ("coordinator", "worker0", "generator", "learner", "auditor"),
        lambda b: ActivationCoordinator(b.registry).change_membership(["fake"], "hostile"),
    ),
    "rollback": (
        ("coordinator", "worker0", "generator", "learner", "auditor"),
        lambda b: ActivationCoordinator(b.registry).rollback(),
    ),
    "register": (  # moving the pointer starts with a new version: the coordinator's
        ("operator", "worker0", "generator", "learner", "auditor"),
        lambda b: ActivationCoordinator(b.registry).prepare(99),
    ),
    "reserve": (
        ("operator", "coordinator", "worker0", "generator", "auditor"),
        lambda b: b.ledger.reserve("a5", 0, "u-hostile", _stamp(0, 1)),
    ),
    "reserve_batch": (
        ("operator", "coordinator", "worker0", "generator", "auditor"),
        lambda b: b.ledger.reserve_batch("u-h", [ReserveRequest("a5", 0, _stamp(0, 1))]),
    ),
    "add": (
        ("operator", "coordinator", "worker0", "learner", "auditor"),
        lambda b: b.ledger.add(_rewarded("hostile-add", 1)),
    ),
    "report": (  # an ack: only a worker login, for its own worker id
        ("operator", "coordinator", "generator", "learner", "auditor"),
        lambda b: ActivationCoordinator(b.registry).record_ack(WorkerAck("gen-0", 1, H[1])),
    ),
    "quarantine_version": (
        ("worker0", "generator", "learner", "auditor"),
        lambda b: b.ledger.quarantine_version(1, "hostile"),
    ),
}


@pytest.mark.parametrize(
    ("operation", "party"),
    [(op, party) for op, (parties, _) in _OUTSIDE.items() for party in parties],
)
def test_an_operation_outside_the_role_is_refused(
    deployment: Deployment, operation: str, party: str
) -> None:
    """Each role, each operation it may not run: RoleRefused names the operation and the
    role it needs, and nothing was written."""
    b = deployment.backend(party)
    before = deployment.backend("auditor").trace()
    with pytest.raises(RoleRefused) as info:
        _OUTSIDE[operation][1](b)
    assert set(info.value.needed) & set(OPERATIONS[operation].roles), str(info.value)
    assert info.value.operation == operation, str(info.value)
    assert "role" in str(info.value)
    assert len(deployment.backend("auditor").trace()) == len(before)


def test_every_operation_is_refused_to_some_role() -> None:
    """The declared list gives no operation to every writing role."""
    for name, op in OPERATIONS.items():
        assert set(op.roles) < set(ROLES) - {"auditor"}, name


# ---- refused by the server: a hostile client bypassing the library ------------------------


@pytest.mark.parametrize("party", list(PARTIES))
@pytest.mark.parametrize("table", TABLES)
def test_no_role_edits_a_table_directly(deployment: Deployment, party: str, table: str) -> None:
    """INSERT, UPDATE, DELETE and TRUNCATE on any table: permission denied for every role."""
    with deployment.conn(party) as conn:
        for sql in (
            f"UPDATE {table} SET {_column(conn, table)} = {_column(conn, table)}",
            f"DELETE FROM {table}",
            f"TRUNCATE {table}",
            f"INSERT INTO {table} DEFAULT VALUES",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(sql)


def _column(conn: psycopg.Connection[Any], table: str) -> str:
    row = conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum = 1",
        (table,),
    ).fetchone()
    assert row is not None
    return str(row[0])


def test_a_worker_reads_only_its_own_tokens(deployment: Deployment) -> None:
    """Row-level security: a worker sees its own attempt tokens and not another worker's
    (not in the tokens table, and not in the events, whose payloads carry them); the
    coordinator and the auditor see every one."""
    coord = ActivationCoordinator(deployment.backend("coordinator").registry)
    coord.prepare(2)
    coord.commit_artifact(2, H[2])
    coord.distribute(2)
    try:
        with deployment.conn("worker0") as conn:
            rows = conn.execute("SELECT worker_id FROM registry_attempt_tokens").fetchall()
            assert {r[0] for r in rows} == {"gen-0"}
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT payload FROM events")
        with deployment.conn("learner") as conn:
            assert conn.execute("SELECT count(*) FROM registry_attempt_tokens").fetchone() == (0,)
        for party in ("coordinator", "auditor"):
            with deployment.conn(party) as conn:
                got = conn.execute("SELECT DISTINCT worker_id FROM registry_attempt_tokens")
                assert {r[0] for r in got} == set(WORKERS)
        w = ActivationCoordinator(deployment.backend("worker0").registry)
        assert w.attempt_token("gen-0", 2)  # its own, through the library
    finally:
        coord.fail_distribution(2, "test over")


def test_a_worker_cannot_ack_for_another_worker(deployment: Deployment) -> None:
    """A worker login reports only for its own worker id, through the library or straight
    to the function; and stores an ack with a token only if it is its own current one."""
    coord = ActivationCoordinator(deployment.backend("coordinator").registry)
    coord.prepare(3)
    coord.commit_artifact(3, H[3])
    coord.distribute(3)
    try:
        w0 = ActivationCoordinator(deployment.backend("worker0").registry)
        # gen-1's token is not even visible to it: a guess is judged stale, not stored;
        # a report of what gen-1 holds (no token needed) is refused by the server
        guess = w0.record_ack(WorkerAck("gen-1", 3, H[3], token="guessed"))
        assert not guess.counted and guess.reason == "stale_attempt_token"
        with pytest.raises(RoleRefused, match="reports as worker gen-0"):
            w0.record_ack(WorkerAck("gen-1", 1, H[1]))
        ack = json.dumps({"worker_id": "gen-1", "version": 3, "artifact_hash": H[3]})
        with deployment.conn("worker0") as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="gen-0"):
                conn.execute(
                    "SELECT * FROM rl_registry_write('report', %s::json, %s, %s, %s)",
                    (json.dumps({"workers": [["gen-1", 0, ack]]}), [], [], []),
                )
            forged = json.dumps(
                {"worker_id": "gen-0", "version": 3, "artifact_hash": H[3], "token": "forged"}
            )
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="current one"):
                conn.execute(
                    "SELECT * FROM rl_registry_write('report', %s::json, %s, %s, %s)",
                    (json.dumps({"workers": [["gen-0", 0, forged]]}), [], [], []),
                )
    finally:
        coord.fail_distribution(3, "test over")


def test_the_pointer_moves_only_on_every_workers_ack(deployment: Deployment) -> None:
    """Straight to the function: a learner or worker may not activate at all; the
    coordinator or the operator (who may settle) may not activate a version its workers
    did not ack (the server judges the acks and tokens itself), nor the operator roll back
    anywhere but the recorded rollback version."""
    coord = ActivationCoordinator(deployment.backend("coordinator").registry)
    coord.prepare(4)
    coord.commit_artifact(4, H[4])
    coord.distribute(4)
    rec = coord.artifact(4)
    row = [4, H[4], None, 1, "active", None, None, rec.attempts, None]
    step = json.dumps({"artifacts": [{"event": "activate", "row": row}], "pointer": [4, H[4]]})
    call = "SELECT * FROM rl_registry_write('activate', %s::json, %s, %s, %s)"
    try:
        for party in ("learner", "worker0", "generator"):
            with (
                deployment.conn(party) as conn,
                pytest.raises(psycopg.errors.InsufficientPrivilege),
            ):
                conn.execute(call, (step, [], [], []))
        for party in ("coordinator", "operator"):
            with (
                deployment.conn(party) as conn,
                pytest.raises(
                    psycopg.errors.InsufficientPrivilege, match="every required worker acked"
                ),
            ):
                conn.execute(call, (step, [], [], []))
        # the recorded rollback version of v1 is v0: only with v1 stepping down and v0
        # reinstated in the same step, and nowhere else
        back = "SELECT * FROM rl_registry_write('rollback', %s::json, %s, %s, %s)"
        v0 = [0, H[0], None, None, "active", None, None, 1, None]
        elsewhere = [2, H[2], None, 1, "active", None, None, 1, None]
        for doc, why in (
            ({"pointer": [0, H[0]]}, "makes active"),
            ({"artifacts": [{"event": "reinstate", "row": v0}], "pointer": [0, H[0]]}, "rollback"),
            (
                {"artifacts": [{"event": "reinstate", "row": elsewhere}], "pointer": [2, H[2]]},
                "rollback",
            ),
        ):
            with (
                deployment.conn("operator") as conn,
                pytest.raises(psycopg.errors.InsufficientPrivilege, match=why),
            ):
                conn.execute(back, (json.dumps(doc), [], [], []))
        assert deployment.backend("auditor").registry.pointer().version == 1
    finally:
        coord.fail_distribution(4, "test over")


def _write_one(op: str, rid: str, state: str, owner: str | None, entry: str) -> tuple[Any, ...]:
    """Arguments of ledger_write_one_v7 for a forged compare-and-set of `rid` at revision 0."""
    return (
        op,
        0,
        None,
        state,
        1,
        owner,
        1e12,
        entry,
        rid,
        0,
        "entry",
        "{}",
        "{writes}",
        "{1}",
        None,
        "t",
    )


def test_a_hostile_learner_cannot_reserve_a_stale_rollout_or_move_rows_it_does_not_drive(
    deployment: Deployment,
) -> None:
    """Straight to the functions with a learner's login: a reservation of a rollout outside
    the recorded policy (lag 1 behind v1 is fine; a future version is not), a commit of a
    row nobody reserved, a reward transition, all refused by the server; the learner's own
    edges are accepted."""
    gen = deployment.backend("generator").ledger
    gen.add_many([_rewarded("s-future", 7), _rewarded("s-ok", 1), _rewarded("s-open", 1)])
    # update u recorded (open) by a reservation of its own: a reservation for an update
    # not recorded is not refused but not written either ('moved': re-judged in a step)
    got = deployment.backend("learner").ledger.reserve("s-open", 0, "u", _stamp(1, 1))
    assert got.reserved, got
    entry = json.dumps({"rollout_id": "x"})
    sql = f"SELECT ledger_write_one_v7({', '.join(['%s'] * 16)})"
    with deployment.conn("learner") as conn:
        for args, why in (
            (_write_one("reserve", "s-future", "reserved", "u", entry), "may not be reserved"),
            (_write_one("commit", "s-ok", "consumed", None, entry), "from rewarded to consumed"),
            (_write_one("reserve", "s-ok", "consumed", None, entry), "from rewarded to consumed"),
            (_write_one("transition reward_ready", "s-ok", "rewarded", None, entry), "role"),
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match=why):
                conn.execute(sql, args)
        batch = (
            "SELECT * FROM rl_write_rows('reserve_batch', %s, %s, %s, %s, %s, %s, %s)",
            (["s-future"], [0], ["reserved"], [1], ["u"], [1e12], [entry]),
        )
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="may not be reserved"):
            conn.execute(*batch)
    assert deployment.backend("auditor").ledger.get("s-future").state == "rewarded"


def test_the_issue_hostile_sequence_fails_at_its_first_step(deployment: Deployment) -> None:
    """Issue 32's sequence with a learner's login: loosen the policy, reserve a lag-10
    rollout, read every worker's token and ack for all of them, roll back, change the worker
    set. The first step is refused, and so is every later one, each by the server."""
    b = deployment.backend("learner")
    learner = ActivationCoordinator(b.registry)
    steps = [
        lambda: set_admission_policy(b.registry, AdmissionPolicy(1000, 1e9), "hostile"),
        lambda: b.ledger.reserve("a4", 0, "u-h", _stamp(0, 10, max_lag=1000)),
        lambda: (
            [
                learner.record_ack(WorkerAck(t.worker_id, t.version, H[t.version], token=t.token))
                for t in b.registry.attempt_tokens()
            ]
            or learner.record_ack(WorkerAck("gen-0", 1, H[1]))
        ),
        lambda: learner.rollback(),
        lambda: learner.change_membership(["fake"], "hostile"),
    ]
    outcomes = []
    for step in steps:
        try:
            got = step()
        except RoleRefused as exc:
            outcomes.append(("refused", exc.operation))
        else:
            outcomes.append(("done", repr(got)[:80]))
    assert outcomes[0] == ("refused", "set_policy"), outcomes
    # the reservation: the stamp is refused by the ledger before anything is sent, and a
    # forged call is refused by the server (test above)
    assert (
        outcomes[1][0] != "done"
        or "refused" in outcomes[1][1]
        or "reserved=False" in (outcomes[1][1])
    ), outcomes
    assert [o[0] for o in outcomes[2:]] == ["refused"] * 3, outcomes
    assert b.registry.attempt_tokens() == []  # a learner sees no token at all
    assert deployment.backend("auditor").registry.policy() == POLICY


# ---- set-up -----------------------------------------------------------------------------


def test_roles_is_idempotent_and_prints_its_sql(deployment: Deployment) -> None:
    """`deployment roles` again changes nothing a party relies on; `--sql` prints the
    statements for a DBA (no role is created by printing them)."""
    res = subprocess.run(
        [*CLI, "deployment", "roles", "--backend", deployment.admin],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert deployment.backend("learner").ledger.reserve("a3", 0, "u2", _stamp(0, 1)).reserved
    res = subprocess.run(
        [*CLI, "deployment", "roles", "--backend", deployment.admin, "--sql", "--prefix", "x_"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert 'CREATE ROLE "x_learner" NOLOGIN' in res.stdout
    assert "CREATE OR REPLACE FUNCTION rl_registry_write" in res.stdout
    with psycopg.connect(deployment.admin, autocommit=True) as conn:
        assert conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'x_learner'").fetchone() is None


def test_the_cli_says_which_role_is_needed(deployment: Deployment) -> None:
    """A refused command exits 2 and names the role it needs."""
    res = subprocess.run(
        [
            *CLI,
            "deployment",
            "set-policy",
            "--backend",
            deployment.urls["learner"],
            "--max-lag",
            "1000",
            "--max-drift",
            "1e9",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    assert "needs the operator role" in res.stderr and "Traceback" not in res.stderr


def test_a_database_without_roles_says_so(postgres_url: str) -> None:
    """Without `deployment roles`, one login does everything, and show says roles: off."""
    with open_backend(postgres_url) as b:
        set_admission_policy(b.registry, POLICY, "the operator's setup step")
        c = ActivationCoordinator(b.registry, WORKERS, ledger=b.ledger, policy=POLICY)
        c.prepare(0)
        info = roles_info(b.ledger.db)  # type: ignore[attr-defined]
        assert not info.on and info.describe().startswith("roles: off")


def test_a_second_deployment_on_the_server_gets_its_own_roles(
    deployment: Deployment, postgres_url: str
) -> None:
    """Group roles are named after the database and schema: two deployments on one server
    never share one, so a learner of one is nobody in the other."""
    db = PostgresDatabase(postgres_url).acquire()
    try:
        prefix, _ = setup_roles(db)
        assert prefix not in deployment.admin and prefix.startswith("rl_")
    finally:
        db.release()
    url = deployment.urls["learner"].rsplit("/", 1)[0] + "/" + postgres_url.rsplit("/", 1)[1]
    with (
        pytest.raises(RolloutLifecycleError, match=r"permission denied|may not"),
        open_backend(url) as b,
    ):
        b.ledger.statistics()


# ---- the race, each party its own login --------------------------------------------------


def test_the_race_runs_each_party_in_its_role_and_refuses_the_hostile_learner(
    postgres_url: str,
) -> None:
    """A short race with roles: operator, coordinator, three workers acking with their own
    tokens, generators, a learner, judged through the auditor's login; clean, and every
    operation the hostile learner tried outside its role was refused by the server (how
    much honest work a few loaded seconds do is not asserted)."""
    from rollout_lifecycle.stateful_tests.race import RaceConfig, run_race

    report = run_race(
        RaceConfig(url=postgres_url, learners=1, seconds=4, workers=3, churn=True, roles=True)
    )
    found = [str(v) for v in report.violations]
    assert not report.errors and not found, (report.errors, found[:5])
    assert report.config.roles is True
    totals = report.totals()
    hostile = {k: n for k, n in totals.items() if k.startswith("hostile:")}
    assert hostile and not [k for k in hostile if k.endswith(":ALLOWED")], hostile
    for op in ("set_policy", "change_membership", "rollback", "ack_as_worker", "add"):
        assert hostile.get(f"hostile:{op}:refused", 0) > 0, hostile
    assert report.events > 0  # v0 at least: activated on the three workers' own acks
    with psycopg.connect(postgres_url, autocommit=True) as conn:  # the logins are gone
        left = conn.execute("SELECT count(*) FROM pg_roles WHERE rolname LIKE 'race%'")
        assert left.fetchone() == (0,)


def test_grant_refuses_what_it_cannot_map(deployment: Deployment) -> None:
    """A worker login needs its worker id (and only a worker login takes one); a login
    that does not exist is named with how to create it: exit 2, no traceback."""
    for args, said in (
        (["worker", "someone"], "--worker-id"),
        (["learner", "someone", "--worker-id", "w"], "--worker-id"),
        (["learner", "no_such_login_here"], "CREATE ROLE no_such_login_here LOGIN"),
    ):
        res = subprocess.run(
            [*CLI, "deployment", "grant", *args, "--backend", deployment.admin],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 2, (args, res.stderr)
        assert said in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_the_functions_write_ack_deadlines_and_spend_tokens(postgres_url: str) -> None:
    """Issue 31's columns through `rl_registry_write`: a distribution attempt records its
    ack deadline, a worker's counted ack spends its token, and the function itself refuses
    to store another ack echoing a spent token (a token counts once)."""
    with open_backend(postgres_url) as b:
        set_admission_policy(b.registry, POLICY, "the operator's setup step")
        c = ActivationCoordinator(b.registry, WORKERS, ledger=b.ledger, policy=POLICY)
        c.prepare(0)
        c.commit_artifact(0, H[0])
        c.distribute(0)
        token = c.attempt_token("gen-0", 0)
        assert c.record_ack(WorkerAck("gen-0", 0, H[0], token=token)).counted
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        (deadline,) = conn.execute(
            "SELECT ack_deadline FROM registry_artifacts WHERE version = 0"
        ).fetchone()
        assert deadline is not None
        spent = dict(
            conn.execute(
                "SELECT worker_id, spent FROM registry_attempt_tokens WHERE version = 0"
            ).fetchall()
        )
        assert spent == {"gen-0": True, "gen-1": False}
        floor, ack = conn.execute(
            "SELECT floor, ack FROM registry_workers WHERE worker_id = 'gen-0'"
        ).fetchone()
        other = json.loads(ack)
        other["received_at"] = (other.get("received_at") or 0) + 1  # another ack, same token
        step = json.dumps({"workers": [["gen-0", floor, json.dumps(other)]]})
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="counts once"):
            conn.execute(
                "SELECT * FROM rl_registry_write('report', %s::json, %s, %s, %s)",
                (step, [], [], []),
            )


def test_the_roles_benchmark_measures_both_sides(postgres_url: str) -> None:
    """`benchmarks/postgres_bench.py --roles` (docs/postgres.md cites its figures) still runs
    on the protocol as it is: the operator records the policy, every reservation wins and
    every ack is taken, in tiny rounds; each operation has a ratio from each round."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "postgres_bench.py"
    spec = importlib.util.spec_from_file_location("postgres_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    got = bench.run_roles(postgres_url, rounds=2, single_n=3, batches=1, chunk=4, acks=3)
    assert set(got["ops"]) == {"reserve", "reserve_batch", "ack"}
    for op, row in got["ops"].items():
        assert row["rounds_wall"] == 2 and row["ratio_wall"] > 0, (op, row)
