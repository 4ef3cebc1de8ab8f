"""PostgreSQL-only behaviour: URLs and errors, read-only opens, schema versions, the set-based
batch, real races across processes, crashes, a restarted server, lease expiry of a dead
learner, and coordinators racing to move the pointer while acks arrive.

The behaviour shared with every backend runs in test_ledger_conformance.py, test_coordinator,
test_seams and the stateful machines (all parametrised with "postgresql"); this module holds
what only a server can show. Every test here starts from a new database on the session's
throwaway server (tests/conftest.py) or, for a server restart, on a server of its own.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import attrs
import pytest

from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.errors import (
    ActivationError,
    BackendUnavailable,
    BackendURLError,
    LedgerError,
    RevisionConflict,
)
from rollout_lifecycle.model.events import ArtifactChanged, EntryChanged, WorkerReported
from rollout_lifecycle.model.ledger import RecoveryRule, ReserveRequest
from rollout_lifecycle.model.records import AdmissionPolicy, WorkerAck
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.spec.invariants import check_trace, compare_with_store, stored_world
from tests import pg_server
from tests.helpers_ledger import HASH, REWARD, add_rewarded, ids, rewarded, stamp
from tests.helpers_ledger import activate as _activate

pytestmark = pytest.mark.postgres

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "rollout_lifecycle.cli.main"]
# every version registered with the helpers' hash: the entries they add carry it, and each
# reservation compares the stamped hash with the registry's
H = dict.fromkeys(range(200), HASH)
POLICY = AdmissionPolicy(max_lag=1, max_drift=0.2)  # the deployment's recorded policy


def _ledger(url: str, **kw: Any) -> Any:
    from rollout_lifecycle.model.postgres_ledger import PostgresLedger

    return PostgresLedger(url, **kw)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=600, env=env
    )


def _tables(server: pg_server.Server, url: str) -> list[str]:
    out = server.psql(
        "SELECT tablename FROM pg_tables "
        "WHERE schemaname NOT IN ('pg_catalog', 'information_schema') ORDER BY tablename",
        url.rsplit("/", 1)[-1],
    )
    return out.split("\n") if out else []


# ---- URLs, errors, read-only, schema versions ------------------------------------------------


def test_both_url_schemes_open_one_database(postgres_url: str) -> None:
    """postgresql:// and postgres:// name the same database; ledger and registry share it."""
    with open_backend(postgres_url) as b:
        b.ledger.add(rewarded("a"))
        ActivationCoordinator(b.registry, ["w0"])
    other = "postgres://" + postgres_url.removeprefix("postgresql://")
    with open_backend(other, create=False) as b:
        assert b.ledger.get("a").state == "rewarded"
        assert b.registry.required_workers() == ("w0",)
        assert [e.kind for e in b.trace()] == ["entry", "membership"]


def test_unreachable_server_is_a_clear_technical_error() -> None:
    """Nothing listens on the port: BackendUnavailable naming host and port, quickly."""
    port = pg_server.free_port()
    with pytest.raises(BackendUnavailable, match=rf"cannot reach PostgreSQL at 127.0.0.1:{port}"):
        open_backend(f"postgresql://postgres@127.0.0.1:{port}/rl")
    down = f"postgresql://postgres@127.0.0.1:{port}/rl"
    res = _cli("ledger", "counts", "--backend", down)
    assert res.returncode == 3, res.stderr
    assert "cannot reach PostgreSQL" in res.stderr and "Traceback" not in res.stderr
    res = _cli("race", "--backend", down, "--seconds", "1")
    assert res.returncode == 3 and "cannot reach PostgreSQL" in res.stderr


def test_wrong_password_and_missing_database_say_what_to_fix(
    postgres_server: pg_server.Server,
) -> None:
    """Wrong credentials and a missing database are input errors (exit 2), never a hang;
    the password is never repeated back."""
    bad = postgres_server.url("rl", user=pg_server.PASSWORD_ROLE, password="wrong-secret")
    with pytest.raises(BackendURLError, match="refused the credentials") as info:
        open_backend(bad)
    assert "wrong-secret" not in str(info.value)
    good = postgres_server.url("rl", user=pg_server.PASSWORD_ROLE, password=pg_server.PASSWORD)
    with open_backend(good) as b:
        assert b.ledger.statistics().entries == 0
    with pytest.raises(BackendURLError, match="does not exist; create it"):
        open_backend(postgres_server.url("no_such_db"))
    res = _cli("ledger", "counts", "--backend", bad)
    assert res.returncode == 2 and "refused the credentials" in res.stderr
    assert "wrong-secret" not in res.stderr
    with pytest.raises(BackendURLError, match=r"drop the '\+psycopg'"):
        open_backend("postgresql+psycopg://localhost/rl")


def test_reading_an_empty_database_creates_nothing(
    postgres_server: pg_server.Server, postgres_url: str
) -> None:
    """create=False on a database without a ledger is refused, and no table appears."""
    with pytest.raises(BackendURLError, match="holds no rollout-lifecycle ledger"):
        open_backend(postgres_url, create=False)
    assert _tables(postgres_server, postgres_url) == []
    res = _cli("ledger", "check", "--backend", postgres_url)
    assert res.returncode == 2 and "holds no rollout-lifecycle ledger" in res.stderr
    assert _tables(postgres_server, postgres_url) == []


def test_read_only_open_cannot_write(postgres_url: str) -> None:
    """Readers run with default_transaction_read_only: the API refuses, and so does the server."""
    with open_backend(postgres_url) as b:
        add_rewarded(b.ledger, ["a"])
    with open_backend(postgres_url, create=False) as b:
        led: Any = b.ledger
        show = led.db.read(lambda c: c.execute("SHOW default_transaction_read_only").fetchone())
        assert show == ("on",)
        with pytest.raises(LedgerError, match="read-only"):
            b.ledger.add(rewarded("b"))
        with pytest.raises(LedgerError, match="read-only"):
            b.ledger.reserve("a", 0, "u", stamp())
        with pytest.raises(ActivationError, match="read-only"):
            ActivationCoordinator(b.registry, ["w0"])

        def raw_write(conn: Any) -> None:
            conn.execute("UPDATE rollouts SET revision = 9")

        with pytest.raises(LedgerError, match="read-only"):
            led.db.read(raw_write, "a raw write")
    with open_backend(postgres_url, create=False) as b:
        assert b.ledger.get("a").revision == 0 and len(b.trace()) == 1


def test_schema_newer_than_the_code_is_refused(
    postgres_server: pg_server.Server, postgres_url: str
) -> None:
    """A database written by a newer rollout-lifecycle: open refuses, saying to upgrade."""
    from rollout_lifecycle.model.postgres_ledger import SCHEMA_VERSION

    _ledger(postgres_url).close()
    postgres_server.psql(
        "UPDATE schema_meta SET version = 99 WHERE component = 'ledger'",
        postgres_url.rsplit("/", 1)[-1],
    )
    for create in (True, False):
        with pytest.raises(BackendURLError, match="newer rollout-lifecycle; upgrade"):
            open_backend(postgres_url, create=create)
    with pytest.raises(
        LedgerError, match=f"schema version 99, this program expects {SCHEMA_VERSION}"
    ):
        _ledger(postgres_url)


def test_schema_is_migrated_forward_once(postgres_url: str) -> None:
    """An older component schema is migrated step by step on first use, and only once."""
    from rollout_lifecycle.model.postgres_common import PostgresDatabase

    db = PostgresDatabase(postgres_url).acquire()
    try:
        db.ensure_schema("probe", 1, "CREATE TABLE IF NOT EXISTS probe (a int);")
        steps = {1: "ALTER TABLE probe ADD COLUMN b int", 2: "ALTER TABLE probe ADD COLUMN c int"}
        db.ensure_schema("probe", 3, "CREATE TABLE IF NOT EXISTS probe (a int);", migrations=steps)
        db.ensure_schema("probe", 3, "CREATE TABLE IF NOT EXISTS probe (a int);", migrations=steps)
        assert db.component_version("probe") == 3
        cols = db.read(
            lambda c: [
                r[0]
                for r in c.execute(
                    "SELECT column_name FROM information_schema.columns "
                    "WHERE table_name = 'probe' ORDER BY ordinal_position"
                )
            ]
        )
        assert cols == ["a", "b", "c"]
        with pytest.raises(LedgerError, match="cannot migrate"):
            db.ensure_schema("probe", 5, "", migrations=steps)
    finally:
        db.release()


def test_schema_option_isolates_two_ledgers_in_one_database(postgres_url: str) -> None:
    """`schema=` (or options=-csearch_path in the URL) keeps two deployments apart."""
    from rollout_lifecycle.stateful_tests.backends import with_schema

    a = _ledger(postgres_url, schema="team_a")
    b = _ledger(postgres_url, schema="team_b")
    try:
        a.add(rewarded("x"))
        assert b.find("x") is None and b.statistics().entries == 0
    finally:
        a.close()
        b.close()
    with open_backend(with_schema(postgres_url, "team_a"), create=False) as via_url:
        assert via_url.ledger.get("x").state == "rewarded"


# ---- the batch is set-based -----------------------------------------------------------------


def _record_statements(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every statement psycopg sends from now on, in order (the list fills as they go)."""
    import psycopg

    seen: list[str] = []
    real = psycopg.Connection.execute

    def recording(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(str(query))
        return real(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "execute", recording)
    return seen


def test_batch_reservation_is_one_compare_and_set_statement(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However many rollouts a batch names, ONE call of the row-writing function (whose one
    statement is the compare-and-set) writes them, in one transaction."""
    led = _ledger(postgres_url)
    add_rewarded(led, ids(600))
    seen = _record_statements(monkeypatch)
    counts = []
    for size, start in ((10, 0), (500, 10)):
        seen.clear()
        reqs = [ReserveRequest(r, 0, stamp()) for r in ids(600)[start : start + size]]
        outs = led.reserve_batch(f"u{size}", reqs)
        assert all(o.reserved for o in outs)
        updates = [q for q in seen if "rl_write_rows" in q]
        assert len(updates) == 1, updates
        counts.append(len(seen))
    assert counts[0] == counts[1]  # statements per batch do not grow with its size
    monkeypatch.undo()
    reserves = [e for e in led.history() if e.event == "reserve"]
    assert len({e.txn for e in reserves if e.update_id == "u500"}) == 1
    led.close()


@pytest.mark.parametrize("plans", ["auto", "force_generic_plan"])
def test_batch_compare_and_set_reaches_its_rows_by_key(postgres_url: str, plans: str) -> None:
    """The batch compare-and-set locks and writes its rows through the primary key, in the
    plan the server makes for it and in the generic plan of a prepared statement: locked by
    a join alone, it hashed the whole table, so every batch cost as much as the table."""
    import re

    import psycopg

    from rollout_lifecycle.model.postgres_functions import CAS_MANY

    led = _ledger(postgres_url)
    add_rewarded(led, ids(3000))
    led.close()
    batch = ids(3000)[1000:1250]
    values = {
        "ids": batch,
        "expected": [0] * 250,
        "states": ["reserved"] * 250,
        "revisions": [1] * 250,
        "owners": ["u"] * 250,
        "leases": [1.0] * 250,
        "entries": ["{}"] * 250,
        "edges": ["rewarded>reserved"],
        "versions": [0, 1],
    }
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)b", CAS_MANY)))
    prepared = re.sub(r"%\((\w+)\)b", lambda m: f"${names.index(m.group(1)) + 1}", CAS_MANY)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("ANALYZE rollouts")
        conn.execute(f"SET plan_cache_mode = {plans}")
        conn.execute(f"PREPARE cas AS {prepared}")
        conn.execute("BEGIN")
        marks = ", ".join(["%s"] * len(names))
        with psycopg.ClientCursor(conn) as cur:  # EXECUTE takes no protocol parameters
            cur.execute(f"EXPLAIN EXECUTE cas({marks})", [values[n] for n in names])
            text = "\n".join(str(r[0]) for r in cur.fetchall())
        conn.execute("ROLLBACK")
    assert "Seq Scan on rollouts" not in text, text
    assert "rollouts_pkey" in text, text


def test_single_reservation_is_one_round_trip(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A winning single reservation of a recorded update sends ONE statement: the call of
    the server-side write in its one-call form (premise lock, the premise and the row
    judged, the entry spliced, compare-and-set, events, counters and commit mark); no
    read, no BEGIN, no COMMIT. The first reservation of an update (it records the update)
    takes the full path: the one call answers 'moved', then the read and a step."""

    with open_backend(postgres_url) as b:
        set_admission_policy(b.registry, POLICY, "set by the operator")
        coord = ActivationCoordinator(b.registry, ["w0"], ledger=b.ledger, policy=POLICY)
        _activate(coord, 1)
        add_rewarded(b.ledger, ["a", "b", "c"])
        seen = _record_statements(monkeypatch)
        assert b.ledger.reserve("a", 0, "u", stamp()).reserved  # records u: the full path
        assert seen[0].startswith("SELECT ledger_write_one") and len(seen) > 2, seen
        for rid in ("b", "c"):
            seen.clear()
            assert b.ledger.reserve(rid, 0, "u", stamp()).reserved
            assert len(seen) == 1, seen
            assert seen[0].startswith("SELECT ledger_write_one")
        monkeypatch.undo()
        assert [e.event for e in b.ledger.history("b")] == ["add", "reserve"]
        assert b.ledger.statistics().reservations == 3
        report = check_trace(b.trace(), with_registry=True)
        assert report.ok, [str(v) for v in report.violations[:5]]


def test_a_registry_step_reads_its_premise_in_one_statement(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A coordinator step asks each question of the server once, and the premise most steps
    judge (with the acking worker's report) in one statement after the lock: an ack is
    BEGIN with the registry lock, that read, the write (which takes the premise lock itself
    where the step moves an artifact or the pointer) and COMMIT. Each read was a statement
    of its own: 23 for an ack, 32 for an activation. The answers are the trace's as before."""
    from rollout_lifecycle.model.postgres_common import K_REGISTRY, lock_sql

    with open_backend(postgres_url) as b:
        set_admission_policy(b.registry, POLICY, "set by the operator")
        coord = ActivationCoordinator(b.registry, ["w0", "w1"], ledger=b.ledger, policy=POLICY)
        _activate(coord, 1)
        coord.prepare(2)
        coord.commit_artifact(2, H[2])
        seen = _record_statements(monkeypatch)
        counts: dict[str, list[str]] = {}
        assert coord.distribute(2)
        counts["distribute"], seen[:] = list(seen), []
        tokens = {w: coord.attempt_token(w, 2) for w in ("w0", "w1")}
        seen.clear()
        for w in ("w0", "w1"):
            assert coord.record_ack(WorkerAck(w, 2, H[2], token=tokens[w])).counted
            counts[f"ack {w}"], seen[:] = list(seen), []
        assert coord.try_activate(2).activated
        counts["activate"] = list(seen)
        monkeypatch.undo()
        lock = lock_sql(K_REGISTRY)
        for what, every in counts.items():
            # the step's transaction (the coordinator reads some things before it, and the
            # ledger's quarantine of older versions after an activation is its own step)
            start = max(i for i, q in enumerate(every) if q == f"BEGIN; {lock}")
            end = next(i for i, q in enumerate(every) if i > start and q.endswith("COMMIT"))
            sent = counts[what] = every[start : end + 1]
            assert "registry_pointer" in sent[1], (what, sent)
            assert sum("pg_advisory_xact_lock" in q for q in sent) == 1, (what, sent)
            assert len(set(sent)) == len(sent), (what, sent)  # no question asked twice
        assert len(counts["ack w0"]) == 4 and len(counts["ack w1"]) == 4, counts
        assert len(counts["distribute"]) <= 5 and len(counts["activate"]) <= 5, counts
        assert b.registry.pointer() is not None and b.registry.pointer().version == 2
        report = check_trace(b.trace(), with_registry=True)
        assert report.ok, [str(v) for v in report.violations[:5]]


def _distributing(b: Any) -> ActivationCoordinator:
    """The recorded policy, one worker "w0", v1 active and v2 awaiting its ack."""
    set_admission_policy(b.registry, POLICY, "set by the operator")
    coord = ActivationCoordinator(b.registry, ["w0"], ledger=b.ledger, policy=POLICY)
    _activate(coord, 1)
    coord.prepare(2)
    coord.commit_artifact(2, H[2])
    coord.distribute(2)
    return coord


def test_a_step_moving_the_pointer_waits_for_reservations_and_an_ack_does_not(
    postgres_url: str,
) -> None:
    """The registry write takes the premise lock exclusive itself where the step moves an
    artifact or the pointer: while a reservation holds it shared, an activation waits and
    then lands; an ack, which moves neither, lands at once."""
    import psycopg

    from rollout_lifecycle.model.postgres_common import K_PREMISE, lock_sql

    with open_backend(postgres_url) as b:
        coord = _distributing(b)
        done = threading.Event()
        with psycopg.connect(postgres_url, autocommit=True) as reader:
            reader.execute("BEGIN")
            reader.execute(lock_sql(K_PREMISE, shared=True))  # a reservation's premise read
            token = coord.attempt_token("w0", 2)
            assert coord.record_ack(WorkerAck("w0", 2, H[2], token=token)).counted
            t = threading.Thread(target=lambda: (coord.try_activate(2), done.set()))
            t.start()
            assert not done.wait(0.5), "the pointer moved while a reservation read it"
            assert coord.pointer() is not None and coord.pointer().version == 1
            reader.execute("COMMIT")
        t.join(30)
        assert done.is_set() and coord.pointer().version == 2


def test_no_rollout_becomes_rewarded_while_retire_stale_runs(postgres_url: str) -> None:
    """retire_stale retires EVERY rewarded rollout too old for the pointer, so none may
    become rewarded between its read and its commit: a row its read did not see (still
    'generated') but that turned rewarded before it committed was left out of an answer
    true at no instant (the campaign's race on PostgreSQL caught it: two in_state reads saw
    a newly rewarded stale rollout beside two the retire then retired, and not it). Here the
    retire is held on a candidate's row lock; a reward landing meanwhile waits for it."""
    import psycopg

    with open_backend(postgres_url) as b, open_backend(postgres_url) as other:
        set_admission_policy(b.registry, POLICY, "set by the operator")
        coord = ActivationCoordinator(b.registry, ["w0"], ledger=b.ledger, policy=POLICY)
        _activate(coord, 1)
        add_rewarded(b.ledger, ["old"])
        late = attrs.evolve(rewarded("late"), state="generated", reward=None)
        b.ledger.add(late)
        for v in (2, 3):  # pointer v3, max_lag 1: every v1 rollout is stale
            _activate(coord, v)
        retired: list[list[str]] = []
        landed: list[str] = []
        with psycopg.connect(postgres_url, autocommit=True) as holder:
            holder.execute("BEGIN")
            holder.execute("SELECT 1 FROM rollouts WHERE rollout_id = 'old' FOR UPDATE")
            t = threading.Thread(
                target=lambda: retired.append([e.rollout_id for e in b.ledger.retire_stale()])
            )
            t.start()
            time.sleep(0.5)  # the retire has read its set and waits on 'old''s row lock
            u = threading.Thread(
                target=lambda: landed.append(
                    other.ledger.transition("late", "reward_ready", 0, reward=REWARD).state
                )
            )
            u.start()
            u.join(1.0)
            early = list(landed)
            holder.execute("COMMIT")
        t.join(30)
        u.join(30)
        assert early == [], "a rollout became rewarded while retire_stale was in flight"
        assert retired == [["old"]] and landed == ["rewarded"]
        assert b.ledger.get("late").state == "rewarded"  # after the retire: the next one's


@pytest.mark.parametrize("step", ["commit", "renew_leases", "abort", "fail_update"])
def test_a_step_over_an_updates_rollouts_sees_every_reservation_before_it(
    postgres_url: str, step: str
) -> None:
    """commit, renew_leases, abort and fail_update act on every rollout the update holds,
    so no reservation for that update may commit between their read of what it holds and
    their own commit: one that did was left out of an answer true at no instant (a commit
    of exactly the ids it was given while the update held one more). The step takes the
    update's lock before that read. Here the step is held on a held row's lock; a
    reservation for the same update meanwhile waits for it, and the trace shows every
    reservation the step did not act on recorded after it."""
    import psycopg

    with open_backend(postgres_url) as b, open_backend(postgres_url) as other:
        set_admission_policy(b.registry, POLICY, "set by the operator")
        _activate(ActivationCoordinator(b.registry, ["w0"], ledger=b.ledger, policy=POLICY), 1)
        add_rewarded(b.ledger, ["a", "b"])
        assert b.ledger.reserve("a", 0, "u", stamp()).reserved
        acts = {
            "commit": lambda: b.ledger.commit("u", ["a"]),
            "renew_leases": lambda: b.ledger.renew_leases("u"),
            "abort": lambda: b.ledger.abort("u"),
            "fail_update": lambda: b.ledger.fail_update("u", "oom"),
        }
        acted: list[list[str]] = []
        reserved: list[bool] = []
        with psycopg.connect(postgres_url, autocommit=True) as holder:
            holder.execute("BEGIN")
            holder.execute("SELECT 1 FROM rollouts WHERE rollout_id = 'a' FOR UPDATE")
            t = threading.Thread(target=lambda: acted.append([e.rollout_id for e in acts[step]()]))
            t.start()
            time.sleep(0.5)  # the step waits on 'a''s row lock
            u = threading.Thread(
                target=lambda: reserved.append(other.ledger.reserve("b", 0, "u", stamp()).reserved)
            )
            u.start()
            u.join(1.0)
            early = list(reserved)
            holder.execute("COMMIT")
        t.join(30)
        u.join(30)
        assert early == [], f"a reservation for the update committed while {step} was in flight"
        assert acted == [["a"]], acted
        trace = [e for e in b.trace() if isinstance(e, EntryChanged)]
        last_step = max(e.seq for e in trace if e.rollout_id == "a")
        # declaratively: every reservation of the update recorded before the step's events
        # is one the step acted on (b's, if the update still took one, comes after)
        later = [e.seq for e in trace if e.rollout_id == "b" and e.event == "reserve"]
        assert all(seq > last_step for seq in later), (later, last_step)


def test_a_steps_first_read_sees_what_committed_while_it_waited_for_the_lock(
    postgres_url: str,
) -> None:
    """The step's first read follows the registry lock: it sees what the lock's holder
    committed while the step waited (here a restart that raised the worker's floor), never
    a snapshot from before the lock."""
    import psycopg

    from rollout_lifecycle.model.postgres_common import K_REGISTRY, lock_sql

    with open_backend(postgres_url) as b:
        coord = _distributing(b)
        token = coord.attempt_token("w0", 2)
        got: list[Any] = []
        with psycopg.connect(postgres_url, autocommit=True) as holder:
            holder.execute("BEGIN")
            holder.execute(lock_sql(K_REGISTRY))
            t = threading.Thread(
                target=lambda: got.append(coord.record_ack(WorkerAck("w0", 2, H[2], token=token)))
            )
            t.start()
            time.sleep(0.3)
            assert not got, "the step did not wait for the registry lock"
            holder.execute("UPDATE registry_workers SET floor = 5 WHERE worker_id = 'w0'")
            holder.execute("COMMIT")
        t.join(30)
        assert got and not got[0].counted and got[0].reason == "stale_incarnation", got


def test_a_steps_premise_read_ahead_answers_as_each_read_does(postgres_url: str) -> None:
    """`step_reads` answers what the view's own reads answer, for a registry with an active
    version, a failed one with its disposition and a distributed one with tokens and a
    deadline: the one statement decodes every column as the separate reads do."""
    from rollout_lifecycle.model.postgres_registry import _PgView

    with open_backend(postgres_url) as b:
        set_admission_policy(b.registry, POLICY, "set by the operator")
        coord = ActivationCoordinator(
            b.registry, ["w0", "w1"], ledger=b.ledger, policy=POLICY, ack_timeout=300.0
        )
        _activate(coord, 1)
        coord.prepare(2)
        coord.commit_artifact(2, H[2])
        coord.distribute(2)
        coord.fail_distribution(2, "bad_weights")
        coord.prepare(3)
        coord.commit_artifact(3, H[3])
        coord.distribute(3)

        def both(conn: Any) -> tuple[dict[Any, Any], dict[Any, Any]]:
            view = _PgView(conn)
            ahead = ("w1", "nobody", "o'quote")
            known = view.step_reads(ahead)
            plain = _PgView(conn)
            asked = {
                ("pointer",): plain.pointer(),
                ("membership",): plain.required_workers(),
                ("policy",): plain.policy(),
                ("max_version",): plain.max_version(),
                ("artifact", 3): plain.artifact(3),
                ("tokens", 3): plain.attempt_tokens(3),
                ("artifact", 1): plain.artifact(1),
                ("worker", "w1"): plain.worker("w1"),
                ("worker", "nobody"): None,
                ("worker", "o'quote"): None,
            }
            return known, asked

        known, asked = b.registry.db.read(both, "comparing")
        assert known == asked
        assert known[("artifact", 3)].ack_deadline is not None
        assert len(known[("tokens", 3)]) == 2
        assert known[("worker", "w1")] is not None and known[("worker", "w1")].ack is not None


def test_a_single_reservation_peeks_and_guards_its_versions_only(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34: after 199 activations, a single reservation that the one call does not
    take reads the premise of its row's version and its stamp's only, in its read and
    again in its write's guard under the premise lock (the guard compares the text it
    names); a pointer that moves in between still sends it back to a step, judged anew."""
    import psycopg

    from rollout_lifecycle.model.postgres_ledger import PostgresStore

    with open_backend(postgres_url) as b:
        set_admission_policy(b.registry, POLICY, "set by the operator")
        coord = ActivationCoordinator(b.registry, ["w0"], ledger=b.ledger, policy=POLICY)
        top = 198
        for v in range(top + 1):
            _activate(coord, v)
        led: Any = b.ledger
        add_rewarded(led, ["a", "b", "c"], version=top)
        assert led.reserve("a", 0, "u", stamp(top)).reserved  # records u: a step
        led._one_call = None  # the path of a reservation the one call answers 'moved'
        sent: list[tuple[str, Any]] = []
        execute = psycopg.Connection.execute

        def recording(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
            sent.append((str(query), params))
            return execute(self, query, params, **kwargs)

        monkeypatch.setattr(psycopg.Connection, "execute", recording)
        assert led.reserve("b", 0, "u", stamp(top)).reserved
        premise = json.loads(sent[-1][1][2])  # the text the write's guard compares
        assert premise[1] == [[top, HASH]], len(premise[1])  # of 199 ever-active versions
        assert (premise[0], premise[3], premise[4]) == (top, None, [top])
        assert [q.split("(")[0] for q, _ in sent] == [
            "WITH asked AS ",
            "SELECT ledger_write_one_v7",
        ]
        real = PostgresStore.peek

        def peek_then(self: Any, *args: Any) -> Any:
            got = real(self, *args)
            _activate(coord, top + 1)  # between the read and the guarded write
            return got

        monkeypatch.setattr(PostgresStore, "peek", peek_then)
        out = led.reserve("c", 0, "u", attrs.evolve(stamp(top), max_lag=0))
        assert (out.reserved, out.reason) == (False, "pointer_moved"), out
        monkeypatch.undo()
        assert led.get("c").revision == 0 and led.reserved_by("u") == ["a", "b"]
        report = check_trace(b.trace(), with_registry=True)
        assert report.ok, [str(v) for v in report.violations[:5]]


def test_old_commit_marks_are_pruned_by_both_kinds_of_write(postgres_url: str) -> None:
    """Marks older than a day go once per 1,000 commits of a client, whether the commit was
    a step's COMMIT (add) or a one-statement write (a single reservation)."""
    import psycopg

    from rollout_lifecycle.model import postgres_common as pc

    led = _ledger(postgres_url)
    add_rewarded(led, ["a"])
    for write in (lambda: add_rewarded(led, ["b"]), lambda: led.reserve("a", 0, "u", stamp())):
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO commit_marks(token, at) VALUES ('old', now() - interval '2 days')"
            )
        led.db._commits = pc._PRUNE_EVERY - 1
        write()
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            tokens = [r[0] for r in conn.execute("SELECT token FROM commit_marks")]
        assert "old" not in tokens and len(tokens) >= 1
    assert led.get("a").state == "reserved" and led.get("b").state == "rewarded"
    led.close()


def test_single_reservation_rejudges_a_premise_that_moved_after_its_read(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pointer moves between a single reservation's read and its write: the write's
    guard sees it under the premise lock and writes nothing, and the reservation is judged
    again on the new pointer (pointer_moved for a stamp of max_lag 0); a row reserved by
    someone else in that gap is a revision_conflict, and by the same update an idempotent
    retry. Nothing lands on a premise that no longer holds."""
    from rollout_lifecycle.model.postgres_ledger import PostgresStore

    with open_backend(postgres_url) as b:
        set_admission_policy(b.registry, POLICY, "set by the operator")
        coord = ActivationCoordinator(b.registry, ["w0"], ledger=b.ledger, policy=POLICY)
        _activate(coord, 0)
        add_rewarded(b.ledger, ["a", "b", "c", "d"], version=0)
        real = PostgresStore.peek
        gap: list[Any] = []

        def peek_then(self: Any, rollout_id: str, update_id: str, *versions: Any) -> Any:
            got = real(self, rollout_id, update_id, *versions)
            gap.pop()()  # what happens between the read and the write
            return got

        monkeypatch.setattr(PostgresStore, "peek", peek_then)
        lag0 = attrs.evolve(stamp(0), max_lag=0)
        gap.append(lambda: _activate(coord, 1))
        out = b.ledger.reserve("a", 0, "u1", lag0)
        assert (out.reserved, out.reason) == (False, "pointer_moved"), out
        assert b.ledger.get("a").revision == 0
        with open_backend(postgres_url) as other:
            gap.append(lambda: other.ledger.reserve_batch("u2", [ReserveRequest("b", 0, stamp(0))]))
            out = b.ledger.reserve("b", 0, "u1", stamp(0))
            assert (out.reserved, out.reason) == (False, "revision_conflict"), out
            gap.append(lambda: other.ledger.reserve_batch("u3", [ReserveRequest("c", 0, stamp(0))]))
            out = b.ledger.reserve("c", 0, "u3", stamp(0))
            assert (out.reserved, out.reason) == (True, "idempotent_retry"), out
        gap.append(lambda: None)
        assert b.ledger.reserve("d", 0, "u4", stamp(0)).reserved
        monkeypatch.undo()
        assert b.ledger.get("b").reserved_by == "u2" and b.ledger.get("d").reserved_by == "u4"
        reserves = [e.rollout_id for e in b.ledger.history() if e.event == "reserve"]
        assert sorted(reserves) == ["b", "c", "d"]
        report = check_trace(b.trace(), with_registry=True)
        assert report.ok, [str(v) for v in report.violations[:5]]


# ---- real concurrency -------------------------------------------------------------------------


@pytest.mark.slow
def test_four_processes_of_eight_threads_race_for_10000_rollouts(postgres_url: str) -> None:
    """4 OS processes x 8 threads each try every one of 10,000 rollouts (single CAS and
    set-based batches), committing what they win: exactly one winner per rollout, each
    consumed once by the update that reserved it, counters add up, `ledger check` is clean."""
    n, procs_n, threads_n = 10_000, 4, 8
    with open_backend(postgres_url) as b:  # v1 active: every reservation is judged by it
        set_admission_policy(b.registry, POLICY, "set by the operator")
        _activate(
            ActivationCoordinator(b.registry, ["w0", "w1"], ledger=b.ledger, policy=POLICY), 1
        )
    led = _ledger(postgres_url)
    add_rewarded(led, ids(n))
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(procs_n)
    results: Any = ctx.Queue()
    from tests.helpers_postgres import race_process

    started = time.perf_counter()
    procs = [
        ctx.Process(target=race_process, args=(postgres_url, k, n, threads_n, barrier, results))
        for k in range(procs_n)
    ]
    for p in procs:
        p.start()
    got = []
    for _ in procs:
        try:
            got.append(results.get(timeout=540))
        except queue.Empty:
            break
    for p in procs:
        p.join(timeout=60)
    elapsed = time.perf_counter() - started
    assert [r["errors"] for r in got] == [[]] * procs_n
    assert all(p.exitcode == 0 for p in procs)

    winner: dict[str, list[str]] = defaultdict(list)
    reasons: Counter[str] = Counter()
    commit_calls = 0
    for r in got:
        assert len(r["threads"]) == threads_n
        for t in r["threads"]:
            reasons.update(t["reasons"])
            commit_calls += t["commits"]
            for update, rids in t["won"].items():
                for rid in rids:
                    winner[rid].append(update)
    assert sorted(winner) == ids(n) and all(len(w) == 1 for w in winner.values())
    snap = led.snapshot()
    assert all(e.state == "consumed" and e.revision == 2 for e in snap.values())
    hist = led.history()
    per: dict[str, list[EntryChanged]] = defaultdict(list)
    for ev in hist:
        per[ev.rollout_id].append(ev)
    for rid, evs in per.items():
        (update,) = winner[rid]
        assert [(e.event, e.update_id) for e in evs] == [
            ("add", None),
            ("reserve", update),
            ("commit", update),
        ]
    attempts = procs_n * threads_n * n
    st = led.statistics()
    assert reasons["reserved"] == st.reservations == n
    assert sum(reasons.values()) == attempts  # every attempt answered, by its own racer
    assert reasons["revision_conflict"] == attempts - n
    # losers wrote nothing at all: the server holds the n wins, no counters of losses (each
    # racer's own ledger object counted what it lost)
    assert st.cas_conflicts == 0 and st.refused == 0
    assert st.commits == commit_calls and st.by_state["consumed"] == n
    assert st.writes == len(hist) == 3 * n
    led.close()
    check = _cli("ledger", "check", "--backend", postgres_url, "--json")
    assert check.returncode == 0, check.stderr
    report = json.loads(check.stdout)
    assert report["ok"] and report["violation_count"] == 0 and report["rows"] == n, report
    print(f"\n4x8 race over {n} rollouts: {attempts} attempts in {elapsed:.1f}s")


def test_incremental_event_reader_never_misses_a_commit(postgres_url: str) -> None:
    """Events are numbered in commit order: a reader that only asks for seq > last, while 8
    threads write, ends up with exactly the whole trace, in order, without a gap skipped."""
    from rollout_lifecycle.model.postgres_common import PostgresDatabase
    from rollout_lifecycle.stateful_tests.backends import PostgresEventSource

    led = _ledger(postgres_url, pool_size=9)
    add_rewarded(led, ids(800))
    source = PostgresEventSource(PostgresDatabase(postgres_url))
    # the ledger's own events (the rows the store records when it is sealed are not
    # ledger history)
    collected: list[int] = [e.seq for e in source.new_events() if e.kind != "row"]
    done = threading.Event()
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            order = ids(800)
            random.Random(k).shuffle(order)
            for i in range(0, 800, 20):
                part = order[i : i + 20]
                outs = led.reserve_batch(f"w{k}.{i}", [ReserveRequest(r, 0, stamp()) for r in part])
                won = [o.rollout_id for o in outs if o.reserved]
                if won:
                    led.commit(f"w{k}.{i}", won)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    reads = 0
    while any(t.is_alive() for t in threads) or not done.is_set():
        collected.extend(e.seq for e in source.new_events() if e.kind != "row")
        reads += 1
        if not any(t.is_alive() for t in threads):
            done.set()
    collected.extend(e.seq for e in source.new_events() if e.kind != "row")
    source.close()
    assert errors == []
    whole = PostgresEventSource(PostgresDatabase(postgres_url))  # every kind: updates too
    full = [e.seq for e in whole.new_events() if e.kind != "row"]  # (not the sealed rows)
    whole.close()
    assert collected == full and reads > 1
    assert {e.seq for e in led.history()} <= set(full)
    assert led.statistics().by_state["consumed"] == 800
    led.close()


def test_reservations_never_land_past_a_concurrent_pointer_switch(postgres_url: str) -> None:
    """Learners reserve v0 rollouts admitted with max_lag 0 while an activator switches to
    v1: in the one global order, no v0 reservation comes after the switch (each read the
    pointer inside its own atomic step), and the ones refused say pointer_moved."""
    n = 1200
    with open_backend(postgres_url) as b:
        set_admission_policy(b.registry, POLICY, "set by the operator")
        coord = ActivationCoordinator(b.registry, ["w0", "w1"], ledger=b.ledger, policy=POLICY)
        _activate(coord, 0)
        add_rewarded(b.ledger, ids(n), version=0)
    lag0 = attrs.evolve(stamp(0), max_lag=0)
    flipped = threading.Event()
    reasons: Counter[str] = Counter()
    errors: list[BaseException] = []
    lock = threading.Lock()

    def learner(k: int) -> None:
        # the first half races the switch; the second half is tried only after it, so
        # both outcomes are always reached (the race itself decides the first half)
        try:
            with open_backend(postgres_url) as mine:
                for half in (ids(n)[: n // 2], ids(n)[n // 2 :]):
                    order = list(half)
                    random.Random(k).shuffle(order)
                    if half[0] != ids(n)[0]:
                        flipped.wait(timeout=120)
                    for i in range(0, len(order), 10):
                        outs = mine.ledger.reserve_batch(
                            f"L{k}.{half[0]}.{i}",
                            [ReserveRequest(r, 0, lag0) for r in order[i : i + 10]],
                        )
                        with lock:
                            reasons.update(o.reason for o in outs)
        except BaseException as exc:
            errors.append(exc)

    def activator() -> None:
        try:
            with open_backend(postgres_url) as mine:
                c = ActivationCoordinator(mine.registry, ledger=mine.ledger)
                c.prepare(1)
                c.commit_artifact(1, H[1])
                c.distribute(1)
                for w in ("w0", "w1"):
                    c.record_ack(WorkerAck(w, 1, H[1], token=c.attempt_token(w, 1)))
                while reasons["reserved"] < n // 12:
                    time.sleep(0.001)
                assert c.try_activate(1).activated
                flipped.set()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=learner, args=(k,)) for k in range(4)]
    threads.append(threading.Thread(target=activator))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and flipped.is_set()
    assert reasons["reserved"] > 0 and reasons["pointer_moved"] > 0, reasons
    with open_backend(postgres_url, create=False) as b:
        trace = b.trace()
        switch = next(
            e.seq
            for e in trace
            if isinstance(e, ArtifactChanged) and e.event == "activate" and e.version == 1
        )
        late = [
            e
            for e in trace
            if isinstance(e, EntryChanged) and e.event == "reserve" and e.seq > switch
        ]
        assert late == []
        report = check_trace(trace, with_registry=True)
        assert report.ok, [str(v) for v in report.violations[:5]]


def test_two_coordinators_race_while_acks_arrive(postgres_url: str) -> None:
    """Two coordinators race to publish and activate versions while three workers ack
    concurrently (one sometimes acks a corrupt hash first): the pointer only ever moves to a
    committed, newer version whose every required worker's STORED ack of the current
    attempt matches its version and hash."""
    workers = ("w0", "w1", "w2")
    with open_backend(postgres_url) as b:
        set_admission_policy(b.registry, POLICY, "set by the operator")
        _activate(ActivationCoordinator(b.registry, workers, ledger=b.ledger, policy=POLICY), 0)
    stop = threading.Event()
    errors: list[BaseException] = []
    results: Counter[str] = Counter()
    pointers: list[int] = []
    lock = threading.Lock()

    def coordinator(k: int) -> None:
        try:
            with open_backend(postgres_url) as mine:
                c = ActivationCoordinator(mine.registry, ledger=mine.ledger)
                # 12 distributions each; a refused prepare/distribute (the other's attempt
                # is open) is retried after a pause, never counted as a round: counting it
                # let one coordinator spend every round on refusals and never move
                rounds, deadline = 0, time.monotonic() + 120
                while rounds < 12 and time.monotonic() < deadline:
                    v = (c.registry.max_version() or 0) + 1
                    try:
                        c.prepare(v)
                        c.commit_artifact(v, HASH)  # a refused distribute spends v
                        c.distribute(v)
                    except ActivationError as exc:
                        with lock:
                            results[f"refused:{str(exc)[:30]}"] += 1
                        time.sleep(0.01)
                        continue
                    rounds += 1
                    for _attempt in range(200):
                        res = c.try_activate(v)
                        with lock:
                            results[f"c{k}:{res.reason}"] += 1
                        if res.activated or res.reason == "not_awaiting_acks":
                            break
                        time.sleep(0.005)
                    else:
                        c.fail_distribution(v, "timeout")
                # activations this coordinator made, by try_activate or by settling the
                # other's attempt whose acks were all in before its own distribute
                with lock:
                    results[f"c{k}:moved"] = c.statistics().activation_attempts.get("activated", 0)
        except BaseException as exc:
            errors.append(exc)

    def worker(w: str, k: int) -> None:
        rng = random.Random(k)
        try:
            with open_backend(postgres_url) as mine:
                c = ActivationCoordinator(mine.registry)
                while not stop.is_set():
                    awaiting = [a for a in c.artifacts() if a.state == "awaiting_acks"]
                    for a in awaiting:
                        try:  # the token travels with the weights of this attempt
                            token = c.attempt_token(w, a.version)
                        except ActivationError:
                            continue  # the attempt closed meanwhile: nothing to answer
                        if w == "w2" and rng.random() < 0.3:
                            c.record_ack(WorkerAck(w, a.version, "0" * 64, token=token))
                            with lock:
                                results["corrupt_ack"] += 1
                        c.record_ack(WorkerAck(w, a.version, HASH, token=token))
                    time.sleep(rng.uniform(0.001, 0.01))
        except BaseException as exc:
            errors.append(exc)

    def observer() -> None:
        try:
            with open_backend(postgres_url, create=False) as mine:
                while not stop.is_set():
                    p = mine.registry.pointer()
                    if p is not None:
                        pointers.append(p.version)
        except BaseException as exc:
            errors.append(exc)

    coords = [threading.Thread(target=coordinator, args=(k,)) for k in range(2)]
    others = [threading.Thread(target=worker, args=(w, i)) for i, w in enumerate(workers)]
    others.append(threading.Thread(target=observer))
    for t in [*coords, *others]:
        t.start()
    for t in coords:
        t.join()
    stop.set()
    for t in others:
        t.join()
    assert errors == []
    activated = {k for k, n in results.items() if k.endswith(":moved") and n}
    assert activated == {"c0:moved", "c1:moved"}, results
    assert any(k.endswith(("missing_worker_ack", "worker_mismatch")) for k in results), results
    assert pointers == sorted(pointers) and pointers[-1] > 0

    with open_backend(postgres_url, create=False) as b:
        trace = b.trace()
        report = check_trace(trace, with_registry=True)
        assert report.ok, [str(v) for v in report.violations[:5]]
        assert compare_with_store(report.final, stored_world(b.ledger, b.registry)) == []
        required = b.registry.required_workers()
    assert required == workers
    # an independent replay: the stored reports at the moment of each pointer move
    stored: dict[str, WorkerAck | None] = {}
    arts: dict[int, Any] = {}
    sent: dict[tuple[int, str], str] = {}  # the token each attempt issued
    moves = 0
    last = -1
    for ev in trace:
        if isinstance(ev, WorkerReported):
            stored[ev.worker_id] = ev.ack
        elif isinstance(ev, ArtifactChanged):
            sent.update(((t.version, t.worker_id), t.token) for t in ev.tokens)
            if ev.pointer_after != ev.pointer_before and ev.event == "activate":
                moves += 1
                rec = arts[ev.version]
                assert rec.state == "awaiting_acks" and rec.artifact_hash == HASH
                assert ev.pointer_after is not None and ev.pointer_after.version > last
                for w in workers:
                    a = stored[w]
                    assert a is not None, (ev.version, w)
                    assert (a.version, a.artifact_hash, a.token) == (
                        ev.version,
                        rec.artifact_hash,
                        sent[(ev.version, w)],
                    ), (ev.version, w, a)
                last = ev.pointer_after.version
            elif ev.pointer_after != ev.pointer_before and ev.event != "supersede":
                pytest.fail(f"the pointer moved by {ev.event}")
            arts[ev.version] = ev.after
    # every activation a coordinator made, plus v0 activated before the race
    assert moves == 1 + sum(n for k, n in results.items() if k.endswith(":moved"))


# ---- faults ---------------------------------------------------------------------------------


def _child_until(code: str, sig: Path, db_url: str, check_locked: bool) -> str:
    child = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not sig.exists():
            if child.poll() is not None:
                err = child.stderr.read() if child.stderr else ""
                pytest.fail(f"child exited early ({child.returncode}): {err}")
            if time.monotonic() > deadline:
                pytest.fail("child never reached the kill point")
            time.sleep(0.01)
        said = sig.read_text()
        if check_locked:
            # proof that the kill lands mid-transaction: the batch's rows are written and
            # locked by the child's open transaction
            import psycopg

            with psycopg.connect(db_url, autocommit=True) as conn:
                with pytest.raises(psycopg.errors.LockNotAvailable):
                    conn.execute("SELECT 1 FROM rollouts FOR UPDATE NOWAIT")
                row = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' "
                    "AND application_name = 'rollout-lifecycle'"
                ).fetchone()
                assert row is not None and row[0] >= 1
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stderr:
            child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    return said


@pytest.mark.parametrize("kill_at", ["in-batch", "after-commit"])
def test_sigkill_mid_batch_leaves_no_partial_reservation(
    postgres_url: str, tmp_path: Path, kill_at: str
) -> None:
    """A learner SIGKILLed after its batch's UPDATE ran but before COMMIT leaves every rollout
    untouched (the server rolls the dead client back); killed after COMMIT, all are its own."""
    n = 1500
    led = _ledger(postgres_url)
    add_rewarded(led, ids(n))
    untouched = led.snapshot()
    sig = tmp_path / "signal"
    code = (
        "from tests.helpers_postgres import crash_child; "
        f"crash_child({postgres_url!r}, 'crashy', {n}, {kill_at!r}, {str(sig)!r})"
    )
    said = _child_until(code, sig, postgres_url, check_locked=kill_at == "in-batch")
    assert said == ("in-batch" if kill_at == "in-batch" else "committed")
    # the next batch waits for the server to roll the dead client back, then decides
    outs = led.reserve_batch("next", [ReserveRequest(r, 0, stamp()) for r in ids(n)])
    snap = led.snapshot()
    hist = led.history()
    st = led.statistics()
    if kill_at == "in-batch":
        assert {o.reason for o in outs} == {"reserved"}
        assert all(e.reserved_by == "next" for e in snap.values())
        assert [e.event for e in hist] == ["add"] * n + ["reserve"] * n
        assert all(e.update_id == "next" for e in hist[n:])
        assert st.reservations == n and st.writes == 2 * n
    else:
        assert snap == {
            r: e for r, e in snap.items() if e.reserved_by == "crashy" and e.revision == 1
        }
        assert {o.reason for o in outs} == {"revision_conflict"}
        assert st.reservations == n and st.writes == 2 * n
    assert untouched.keys() == snap.keys()
    assert check_trace(hist).ok
    led.close()


def test_lease_expiry_returns_a_dead_learners_rollouts(postgres_url: str, tmp_path: Path) -> None:
    """A learner process that reserved and was SIGKILLed blocks nothing for good: once its
    lease ran out, expire_leases returns its rollouts by the recovery rule (released, or
    quarantined when their version was marked bad meanwhile), and another learner takes them."""
    led = _ledger(postgres_url, recovery=RecoveryRule(max_releases=3))
    add_rewarded(led, ids(20), version=1)
    add_rewarded(led, ids(20, "s"), version=2)
    sig = tmp_path / "signal"
    code = (
        "from tests.helpers_postgres import lease_child; "
        f"lease_child({postgres_url!r}, 'dead', {str(sig)!r})"
    )
    _child_until(code, sig, postgres_url, check_locked=False)
    assert len(led.reserved_by("dead")) == 40
    assert led.expire_leases() == []  # the dead learner's hour is not over
    led.quarantine_version(1, "activation of v1 failed after the fact")
    later = _ledger(postgres_url, clock=lambda: time.time() + 7200.0)
    back = later.expire_leases()
    assert sorted(e.rollout_id for e in back) == sorted([*ids(20), *ids(20, "s")])
    for e in back:
        if e.behavior_version == 1:
            assert e.state == "quarantined" and e.disposition is not None
            assert (e.disposition.stage, e.disposition.cause) == ("recovery", "failed_version")
        else:
            assert (e.state, e.releases, e.reserved_by) == ("rewarded", 1, None)
    assert later.reserved_by("dead") == [] and later.statistics().expirations == 40
    outs = later.reserve_batch("heir", [ReserveRequest(r, 2, stamp(2)) for r in ids(20, "s")])
    assert all(o.reserved for o in outs)
    expired = [e for e in later.history() if e.event == "expire_lease"]
    assert len(expired) == 40 and {e.update_id for e in expired} == {"dead"}
    assert check_trace(later.history()).ok
    later.close()
    led.close()


def test_server_restart_mid_campaign_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    """Learner threads run reserve -> commit while the server is killed (immediate stop,
    crash recovery on start) and restarted twice: the clients retry on their own or get
    BackendUnavailable; afterwards every commit that returned is consumed exactly once, the
    trace replays clean and matches the stored rows, and the counters agree with the trace."""
    try:
        server = pg_server.create_server()
    except pg_server.ServerUnavailable as exc:
        pytest.skip(str(exc))
    try:
        url = pg_server.new_database(server)
        n = 1500
        led = _ledger(url, pool_size=6)
        add_rewarded(led, ids(n))
        committed: dict[str, str] = {}
        in_doubt: set[str] = set()  # updates whose reserve or commit raised
        errors: Counter[str] = Counter()
        unexpected: list[BaseException] = []
        lock = threading.Lock()
        stop = threading.Event()

        def learner(k: int) -> None:
            rng = random.Random(k)
            update = 0
            while not stop.is_set():
                uid = f"L{k}.u{update}"
                try:
                    waiting = led.in_state("rewarded", 64)
                    if not waiting:
                        return
                    rng.shuffle(waiting)
                    update += 1
                    part = waiting[: rng.randint(1, 16)]
                    outs = led.reserve_batch(
                        uid, [ReserveRequest(e.rollout_id, e.revision, stamp()) for e in part]
                    )
                    won = [o.rollout_id for o in outs if o.reserved]
                    if won:
                        led.commit(uid, won)
                        with lock:
                            for rid in won:
                                assert rid not in committed, rid
                                committed[rid] = uid
                except BackendUnavailable:
                    with lock:
                        errors["BackendUnavailable"] += 1
                        in_doubt.add(uid)
                    time.sleep(0.05)
                except BaseException as exc:
                    unexpected.append(exc)
                    return

        threads = [threading.Thread(target=learner, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for target in (n // 4, n // 2):
            while len(committed) < target and any(t.is_alive() for t in threads):
                time.sleep(0.01)
            server.restart(mode="immediate")
        for t in threads:
            t.join(timeout=300)
        stop.set()
        assert unexpected == []
        # the clients noticed the restarts: connections were lost and steps run again
        assert led.db.retries > 0
        snap = led.snapshot()
        hist = led.history()
        for rid, uid in committed.items():
            assert snap[rid].state == "consumed", rid
            commits = [e for e in hist if e.rollout_id == rid and e.event == "commit"]
            assert [e.update_id for e in commits] == [uid]  # once, by its own update
        consumed = {r for r, e in snap.items() if e.state == "consumed"}
        unknown = {
            e.rollout_id for e in hist if e.event == "commit" and e.rollout_id not in committed
        }
        assert consumed - set(committed) == unknown
        # a commit the client did not hear of can only be one that raised
        assert {e.update_id for e in hist if e.rollout_id in unknown} <= in_doubt | {None}
        held = {r: e.reserved_by for r, e in snap.items() if e.state == "reserved"}
        assert set(held.values()) <= in_doubt  # only updates that saw an error hold any
        assert len(snap) == n and len(consumed) + len(held) == n
        print(f"\nrestart: {len(committed)} committed, {dict(errors)}, retries {led.db.retries}")
        report = check_trace(hist)
        assert report.ok, [str(v) for v in report.violations[:5]]
        st = led.statistics()
        assert st.commits == len({e.txn for e in hist if e.event == "commit"})
        assert st.writes == len(hist)
        led.close()
    finally:
        server.remove()


def test_server_down_longer_than_the_retry_budget_is_a_clear_error(tmp_path: Path) -> None:
    """With the server stopped, a call fails after its retry budget with BackendUnavailable
    saying nothing was written; once the server is back, the same ledger object works."""
    try:
        server = pg_server.create_server()
    except pg_server.ServerUnavailable as exc:
        pytest.skip(str(exc))
    try:
        url = pg_server.new_database(server)
        # a budget past psycopg_pool's reconnect backoff (1 s, then 2 s, ...): with 1 s the
        # first call after the restart passed or not by the phase of that backoff
        led = _ledger(url, retry_seconds=3.0)
        add_rewarded(led, ["a", "b"])
        server.stop()
        with pytest.raises(BackendUnavailable, match=r"PostgreSQL at 127\.0\.0\.1"):
            led.reserve("a", 0, "u", stamp())
        with pytest.raises(BackendUnavailable):
            led.transition("b", "retire_stale", 0)
        server.start()
        assert led.reserve("a", 0, "u", stamp()).reserved
        with pytest.raises(RevisionConflict):
            led.transition("b", "retire_stale", 5)
        assert [e.event for e in led.history("a")] == ["add", "reserve"]
        led.close()
    finally:
        server.remove()


def test_commit_whose_answer_was_lost_is_resolved_not_repeated(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A COMMIT whose reply never came is looked up on a new connection by its commit mark:
    landed, the step returns its result and is not run again; rolled back, it runs again;
    still open in its server session, the client waits for that session to end first.
    (Transaction ids decide nothing: a server restarted before the WAL reached the kernel
    reuses them, and the restart test once saw pg_xact_status call a lost commit landed.)"""
    from rollout_lifecycle.model import postgres_common as pc
    from rollout_lifecycle.model.postgres_ledger import PostgresStore

    led = _ledger(postgres_url)
    add_rewarded(led, ["a", "b", "c"])
    db = led.db
    real = pc.PostgresDatabase._write_once
    real_fate = pc.PostgresDatabase._fate
    mode = {"how": "landed", "calls": 0}
    fates: list[str] = []
    import psycopg

    def flaky(self: Any, body: Any, attempt: Any, prologue: str = "") -> Any:
        mode["calls"] += 1
        if mode["calls"] > 1:
            return real(self, body, attempt, prologue)
        if mode["how"] == "landed":
            real(self, body, attempt, prologue)  # it committed ...
            attempt.committing = True
            raise pc._ConnectionBroke("server closed the connection")  # ... the answer got lost
        if mode["how"] == "rolled-back":
            with self._checkout() as conn:  # it never committed: the server rolled it back
                attempt.backend = self._session(conn)
                conn.execute(f"BEGIN; {prologue}")
                body(conn)
                conn.execute("ROLLBACK")
        else:  # still inside its transaction on the server; that session ends 0.5 s later
            side = psycopg.connect(self.conninfo, autocommit=True)
            attempt.backend = self._session(side)
            side.execute(f"BEGIN; {prologue}")
            body(side)
            threading.Timer(0.5, side.close).start()
        attempt.committing = True
        raise pc._ConnectionBroke("server closed the connection")

    def spy(self: Any, attempt: Any) -> str:
        fates.append(real_fate(self, attempt))
        return fates[-1]

    monkeypatch.setattr(pc.PostgresDatabase, "_write_once", flaky)
    monkeypatch.setattr(pc.PostgresDatabase, "_fate", spy)
    # the full step's lost commit (the one-call form's: test_postgres_one_call)
    monkeypatch.setattr(PostgresStore, "reserve_one", lambda *_: None)
    out = led.reserve("a", 0, "u1", stamp())
    assert out.reserved and mode["calls"] == 1 and db.in_doubt_resolved == 1
    assert fates == ["committed"]
    mode.update(how="rolled-back", calls=0)
    out = led.reserve("b", 0, "u2", stamp())
    assert out.reserved and mode["calls"] == 2 and db.in_doubt_resolved == 2
    assert fates[1:] == ["aborted"]
    mode.update(how="open", calls=0)
    out = led.reserve("c", 0, "u3", stamp())
    assert out.reserved and mode["calls"] == 2 and db.in_doubt_resolved == 3
    assert fates[2] == "in progress" and fates[-1] == "aborted", fates
    monkeypatch.undo()
    assert [e.event for e in led.history()] == ["add"] * 3 + ["reserve"] * 3
    assert led.statistics().reservations == 3
    led.close()


def test_a_lost_compare_and_set_leaves_nothing_on_the_server(postgres_url: str) -> None:
    """A reservation that loses its compare-and-set changes no row, event, counter or commit
    mark; a winning one leaves exactly one mark (what in-doubt commits are resolved by)."""
    import psycopg

    led = _ledger(postgres_url)
    add_rewarded(led, ["a"])

    def server_state() -> tuple[Any, ...]:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            return tuple(
                conn.execute(q).fetchall()
                for q in (
                    "SELECT rollout_id, entry FROM rollouts ORDER BY rollout_id",
                    "SELECT count(*) FROM events",
                    "SELECT name, sum(n) FROM ledger_counters GROUP BY name ORDER BY name",
                    "SELECT count(*) FROM commit_marks",
                )
            )

    before = server_state()
    out = led.reserve("a", 7, "u1", stamp())  # stale revision: refused before any write
    assert out.reason == "revision_conflict"
    assert server_state() == before
    lost = led.reserve_batch("u1", [ReserveRequest("a", 3, stamp())])  # refused, locked
    assert [o.reason for o in lost] == ["revision_conflict"]
    # no row, event or counter; the batch read its rows locked (so its refusals hold at
    # its commit, issue 33), which gives its transaction an id and so a commit mark
    # (a true record of a commit that wrote nothing)
    batch = server_state()
    assert batch[:3] == before[:3] and batch[3][0][0] == before[3][0][0] + 1
    assert led.reserve("a", 0, "u1", stamp()).reserved
    after = server_state()
    # one mark; two events: the reservation and the record of "u1" (its first reservation)
    assert after[3][0][0] == batch[3][0][0] + 1 and after[1][0][0] == before[1][0][0] + 2
    assert led.statistics().cas_conflicts == 2  # counted by this ledger object
    led.close()


def test_forked_child_opens_its_own_pool(postgres_url: str) -> None:
    """A forked child never uses its parent's connections; both keep working."""
    led = _ledger(postgres_url)
    add_rewarded(led, ["a", "b"])
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            code = 0 if led.reserve("a", 0, "child", stamp()).reserved else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert led.reserve("b", 0, "parent", stamp()).reserved
    assert led.get("a").reserved_by == "child"
    led.close()


# ---- registry guards and the CLI ------------------------------------------------------------


def test_triggers_guard_write_once_rules(
    postgres_server: pg_server.Server, postgres_url: str
) -> None:
    """Even raw SQL cannot change a committed hash or insert a reused version."""
    with open_backend(postgres_url) as b:
        c = ActivationCoordinator(b.registry, ["w0"])
        c.prepare(1)
        c.commit_artifact(1, H[1])
    import psycopg

    with psycopg.connect(postgres_url, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.IntegrityConstraintViolation, match="never changes"):
            conn.execute("UPDATE registry_artifacts SET artifact_hash = 'x' WHERE version = 1")
        with pytest.raises(psycopg.errors.IntegrityConstraintViolation, match="never reused"):
            conn.execute(
                "INSERT INTO registry_artifacts(version, state, attempts) VALUES (0, 'prepared', 0)"
            )


def test_cli_demo_ledger_and_admit_on_postgresql(postgres_url: str, tmp_path: Path) -> None:
    """demo writes to PostgreSQL; ledger counts/show/history/check and admit --backend read it."""
    res = _cli("demo", "--backend", postgres_url, "--workdir", str(tmp_path))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    counts = _cli("ledger", "counts", "--backend", postgres_url, "--json")
    assert counts.returncode == 0, counts.stderr
    data = json.loads(counts.stdout)
    assert data["entries"] > 0
    # a lost CAS writes nothing on PostgreSQL either: its counter is the demo process's own
    assert data["not_stored"] == ["idempotent_retries", "cas_conflicts", "refused"]
    with open_backend(postgres_url, create=False) as b:
        rid = sorted(b.ledger.snapshot())[0]
        pointer = b.registry.pointer()
    assert pointer is not None
    show = _cli("ledger", "show", rid, "--backend", postgres_url)
    hist = _cli("ledger", "history", rid, "--backend", postgres_url)
    check = _cli("ledger", "check", "--backend", postgres_url)
    assert show.returncode == hist.returncode == check.returncode == 0, check.stderr
    assert rid in show.stdout and "0 violations" in check.stdout
    from tests.test_cli_admit import row

    good = row("x1", pointer.version, artifact_hash=pointer.artifact_hash)
    forged = row("x2", pointer.version, artifact_hash="9" * 64)
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(good) + "\n" + json.dumps(forged) + "\n")
    out = tmp_path / "out.jsonl"
    admit = _cli(
        "admit",
        str(inp),
        "--current-version",
        str(pointer.version),
        "--max-lag",
        "1",
        "--max-drift",
        "0.2",
        "--backend",
        postgres_url,
        "--out",
        str(out),
    )
    assert admit.returncode == 0, admit.stderr
    decisions = {d["rollout_id"]: d for d in map(json.loads, out.read_text().splitlines())}
    assert decisions["x1"]["accepted"] is True
    assert decisions["x2"]["accepted"] is False  # its hash is not the registered one


def test_campaign_runs_on_postgresql(postgres_url: str, tmp_path: Path) -> None:
    """`campaign --backend postgresql://...` runs every machine AND the race on the server
    (real processes, a connection each, in a fresh schema), clean; the durable machines
    really closed and reopened their state there."""
    out = tmp_path / "camp"
    res = _cli(
        "campaign",
        "--backend",
        postgres_url,
        "--no-explore",
        "--examples",
        "6",
        "--seed",
        "3",
        "--race-seconds",
        "6",
        "--out",
        str(out),
        "--report",
        str(tmp_path / "summary.json"),
        "--quiet",
    )
    # six examples are too few to reach the coverage goals: exit 5 (missed goals, no
    # violation), never 1
    assert res.returncode in (0, 5), res.stdout[-2000:] + res.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["violations"] == 0
    if res.returncode == 5:
        assert "goal missed" in res.stdout and summary["budget_hints"]
    fuzz = json.loads((out / "fuzz-report.json").read_text())
    assert fuzz["violations"] == 0
    assert set(fuzz["runs"]) == {"ledger", "activation", "e2e", "seams", "artifacts"}
    assert "postgresql://" in fuzz["backend"]
    for machine in ("ledger", "activation", "e2e"):
        assert fuzz["runs"][machine]["rules"].get("reopen", 0) > 0, (machine, fuzz["runs"][machine])
    race = json.loads((out / "race-report.json").read_text())
    assert race["config"]["url"].startswith("postgresql://") and race["ok"]
    assert race["calls_judged"] > 0 and race["totals"].get("committed", 0) > 0


def test_race_command_on_postgresql(postgres_url: str) -> None:
    """`race --backend postgresql://...`: activators and learners in real processes, judged
    clean; a second race on the same database is refused (its checks need fresh state)."""
    # one login for all (tests/test_postgres_roles.py races with a login per party)
    res = _cli(
        "race",
        "--backend",
        postgres_url,
        "--seconds",
        "3",
        "--learners",
        "2",
        "--no-roles",
        "--json",
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    report = json.loads(res.stdout[res.stdout.index("{") :])
    assert report["ok"] and report["violation_count"] == 0
    assert report["totals"].get("reserve:reserved", 0) > 0
    again = _cli("race", "--backend", postgres_url, "--seconds", "1")
    assert again.returncode == 2 and "already holds a ledger" in again.stderr


def test_a_schema_without_commit_marks_gets_the_table_on_open(postgres_url: str) -> None:
    """A database whose schema predates commit marks (the table dropped here) gets it back
    when a ledger opens it for writing, and writes work again."""
    import psycopg

    led = _ledger(postgres_url)
    add_rewarded(led, ["a"])
    led.close()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("DROP TABLE commit_marks")
    again = _ledger(postgres_url)
    assert again.reserve("a", 0, "u1", stamp()).reserved
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM commit_marks").fetchone()[0] >= 1
    again.close()


def test_a_database_without_the_current_write_function_gets_it_on_open(
    postgres_url: str,
) -> None:
    """A database made by an older version lacks the current single-write function (its
    body changed, so its name did: v3 now): the first writer that opens it creates it, and
    single reservations and transitions through it land with their events, counters and
    chain intact, next to rows and events the older function wrote."""
    import psycopg

    from rollout_lifecycle.model import postgres_ledger as pl

    with open_backend(postgres_url) as b:
        set_admission_policy(b.registry, POLICY, "set by the operator")
        coord = ActivationCoordinator(b.registry, ["w0"], ledger=b.ledger, policy=POLICY)
        _activate(coord, 1)
        add_rewarded(b.ledger, ["a", "b", "c"])
        assert b.ledger.reserve("a", 0, "u0", stamp()).reserved
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"DROP FUNCTION {pl._WRITE_ONE_SIGNATURE}")
        found = conn.execute("SELECT to_regprocedure(%s)", (pl._WRITE_ONE_SIGNATURE,))
        assert found.fetchone() == (None,)
    with open_backend(postgres_url) as b:
        assert b.ledger.reserve("b", 0, "u1", stamp()).reserved
        assert b.ledger.reserve("b", 0, "u1", stamp()).reason == "idempotent_retry"
        assert b.ledger.reserve("a", 0, "u1", stamp()).reason == "revision_conflict"
        assert b.ledger.transition("c", "quarantine", 0).state == "quarantined"
        assert [e.event for e in b.ledger.history("b")] == ["add", "reserve"]
        stats = b.ledger.statistics()
        assert (stats.reservations, stats.writes) == (2, 3 + 2 + 1)
        report = check_trace(b.trace(), with_registry=True)
        assert report.ok, [str(v) for v in report.violations[:5]]
        assert compare_with_store(report.final, stored_world(b.ledger, b.registry)) == []
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        found = conn.execute("SELECT to_regprocedure(%s)", (pl._WRITE_ONE_SIGNATURE,))
        assert found.fetchone() != (None,)
