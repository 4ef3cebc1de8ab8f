"""The PostgreSQL race with least privilege: every party logs in as its own login, in its
own role (model.postgres_roles), so every run exercises the grants; and a hostile learner
tries each operation outside its role, straight at the server, and must be refused.

Roles are used when the race's URL names PostgreSQL, its login may create roles, and no
mutant is entered (a mutant patches code the server runs: only the owner may replace it).
`plan_logins` sets the deployment's roles up and makes one login per party (random
passwords; dropped again by `RoleLogins.drop`); the honest parties are the operator, the
coordinator(s), one worker per worker id, the generators (the pool and each dispatcher),
the learners, and the auditor that judges the trace.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.errors import ActivationError, RolloutLifecycleError
from rollout_lifecycle.model.postgres_functions import WRITE_ONE, WRITE_ONE_ARGS
from rollout_lifecycle.model.records import WorkerAck
from rollout_lifecycle.stateful_tests.history import CallLog, attach

START_TIMEOUT_S = 180.0  # a child still importing after this is taken as dead


def start_line(seconds: float, line: Any) -> float:
    """Wait at the start line until every process has started, then race `seconds`.

    Spawned children import the project before they run; on a loaded machine that can take
    longer than a short race, which then judged nothing. A broken line (a child that died
    before reaching it) starts this one anyway: the parent reports the dead child."""
    with contextlib.suppress(threading.BrokenBarrierError):
        line.wait(timeout=START_TIMEOUT_S)
    return time.time() + seconds


@attrs.frozen
class RoleLogins:
    """One URL per party (name -> URL, each its own login), and the admin's URL."""

    admin: str
    urls: dict[str, str]
    logins: tuple[str, ...]

    def url(self, party: str) -> str:
        """The URL the party connects with."""
        return self.urls[party]

    def drop(self) -> None:
        """Drop the logins (the deployment's group roles and grants stay)."""
        from rollout_lifecycle.model.postgres_common import PostgresDatabase
        from rollout_lifecycle.model.postgres_setup import drop_logins

        db = PostgresDatabase(self.admin).acquire()
        try:
            drop_logins(db, self.logins)
        finally:
            db.release()


def wants_roles(url: str, roles: bool | None, mutant: str | None) -> bool:
    """Whether the race runs with roles: asked for, or (None) when the server allows it."""
    from rollout_lifecycle.model.postgres_common import is_postgres_url

    if roles is False or not is_postgres_url(url):
        if roles:
            raise RolloutLifecycleError("roles are PostgreSQL's: give a postgresql:// URL")
        return False
    if mutant is not None:
        if roles:
            raise RolloutLifecycleError(
                "a mutant replaces the server's functions, which only the owner may: run it "
                "without roles"
            )
        return False
    from rollout_lifecycle.model.postgres_common import PostgresDatabase
    from rollout_lifecycle.model.postgres_setup import can_create_roles

    db = PostgresDatabase(url).acquire()
    try:
        able = can_create_roles(db)
    finally:
        db.release()
    if roles and not able:
        raise RolloutLifecycleError(
            "the race's login may not create roles (it needs CREATEROLE or superuser)"
        )
    return able


def plan_logins(url: str, parties: dict[str, tuple[str, str | None]]) -> RoleLogins:
    """Set the deployment's roles up and make a login for each party (name -> (role,
    worker id)); the login names carry a random tag, since logins are cluster-wide."""
    from rollout_lifecycle.model.postgres_common import PostgresDatabase
    from rollout_lifecycle.model.postgres_setup import party_logins, setup_roles

    tag = f"race{os.getpid() % 10000}{random.randrange(16**4):04x}"
    names = {party: f"{tag}_{party.replace('-', '_')}" for party in parties}
    db = PostgresDatabase(url).acquire()
    try:
        setup_roles(db)
        made = party_logins(db, url, {names[p]: role for p, role in parties.items()})
    finally:
        db.release()
    return RoleLogins(url, {p: made[names[p]] for p in parties}, tuple(names.values()))


# ---- a worker: acks what it loaded, with its own token -----------------------------------


def worker(seconds: float, url: str, worker_id: str, line: Any, out: Any) -> None:
    """Ack every distribution attempt it is asked for (the weights 'load' at once), with
    the token only it can read; report what it holds when not asked."""
    deadline = start_line(seconds, line)
    stats: Counter[str] = Counter()
    acked: set[tuple[int, int]] = set()
    log = CallLog(f"worker-{worker_id}")  # its acks are calls of the history too
    try:
        with open_backend(url) as b:
            coord = attach(log, b.registry)
            while time.time() < deadline:
                time.sleep(0.01)
                for rec in b.registry.artifacts():
                    key = (rec.version, rec.attempts)
                    if rec.state != "awaiting_acks" or key in acked:
                        continue
                    try:
                        token = coord.attempt_token(worker_id, rec.version)
                    except ActivationError:
                        stats["ack:no_token"] += 1  # not required now, or moved on
                        continue
                    assert rec.artifact_hash is not None
                    got = coord.record_ack(
                        WorkerAck(worker_id, rec.version, rec.artifact_hash, token=token)
                    )
                    stats[f"ack:{got.reason}"] += 1
                    acked.add(key)
        out.put({"role": f"worker-{worker_id}", "stats": dict(stats), "history": log.calls})
    except Exception as exc:
        out.put(
            {
                "role": f"worker-{worker_id}",
                "stats": dict(stats),
                "history": log.calls,
                "error": repr(exc),
            }
        )


# ---- the hostile learner: each operation outside its role, straight at the server --------


def _attempts(conn: Any) -> list[tuple[str, Callable[[], Any]]]:
    """(operation, a call doing it) for each operation a learner may not run, sent as a
    hostile client would: to the server-side functions and tables themselves."""
    reg = "SELECT * FROM rl_registry_write(%s, %s::json, %s, %s, %s)"

    def registry(op: str, doc: dict[str, Any]) -> Callable[[], Any]:
        return lambda: conn.execute(reg, (op, json.dumps(doc), [], [], [])).fetchall()

    ptr = conn.execute("SELECT version, artifact_hash FROM registry_pointer").fetchone()
    pointer = [int(ptr[0]), str(ptr[1])] if ptr else [0, "0" * 64]
    row = [pointer[0], pointer[1], None, None, "active", None, None, 1, None]
    entry = json.dumps({"rollout_id": "hostile"})
    waiting = conn.execute(
        "SELECT rollout_id, revision FROM rollouts WHERE state = 'rewarded' LIMIT 1"
    ).fetchone()
    rid, rev = (str(waiting[0]), int(waiting[1])) if waiting else ("none", 0)
    one = f"SELECT {WRITE_ONE}({', '.join(['%s'] * len(WRITE_ONE_ARGS))})"

    def write_one(op: str, state: str) -> Callable[[], Any]:
        args = (op, 0, None, state, rev + 1, None, None, entry, rid, rev, "entry", "{}")
        return lambda: conn.execute(one, (*args, "{writes}", "{1}", None, "hostile")).fetchone()

    add = json.dumps([{"rollout_id": "hostile-add", "state": "rewarded", "revision": 0}])
    append = "SELECT * FROM rl_append(%s, %s::text[], %s::text[], %s::text[], NULL, %s::json)"
    poison = json.dumps([{"u": "someone-else", "s": "poisoned", "c": "hostile", "d": ""}])
    land = json.dumps(
        [{"rollout_id": "hostile-land", "state": "rewarded", "revision": 0, "version": 0}]
    )
    return [
        ("set_policy", registry("set_policy", {"policy": [1000, 1e9, None, None]})),
        ("change_membership", registry("change_membership", {"membership": ["fake"]})),
        ("rollback", registry("rollback", {"artifacts": [{"row": row}], "pointer": pointer})),
        ("activate", registry("activate", {"artifacts": [{"row": row}], "pointer": pointer})),
        ("ack_as_worker", registry("report", {"workers": [["gen-0", 0, None]]})),
        ("add", lambda: conn.execute("SELECT * FROM rl_insert_rows('add', %s)", (add,))),
        (
            "quarantine_version",
            lambda: conn.execute(
                "SELECT rl_bad_version(%s, 0, 'h', true)", ("quarantine_version",)
            ),
        ),
        ("commit_unreserved", write_one("commit", "consumed")),
        ("reward_transition", write_one("transition reward_ready", "rewarded")),
        # a learner's own operation may change an update only as it does: a reservation
        # opens one, it never poisons another's
        (
            "poison_update",
            lambda: conn.execute(append, ("reserve", ["update"], ["x"], ["{}"], poison)),
        ),
        # a trainer's landing needs the generator's role as well as the learner's
        (
            "land_and_reserve",
            lambda: conn.execute("SELECT * FROM rl_insert_rows('land_and_reserve', %s)", (land,)),
        ),
        ("edit_updates", lambda: conn.execute("UPDATE ledger_updates SET status = status")),
        ("edit_rollouts", lambda: conn.execute("UPDATE rollouts SET revision = revision")),
        ("edit_pointer", lambda: conn.execute("DELETE FROM registry_pointer")),
        ("edit_events", lambda: conn.execute("TRUNCATE events")),
    ]


def hostile_learner(seconds: float, url: str, line: Any, out: Any) -> None:
    """A learner's credentials used against everything else: each round tries every
    operation outside the role; each must be refused by the server (insufficient_privilege)
    and it must see no worker's token. Anything that lands is reported as an error."""
    import psycopg

    deadline = start_line(seconds, line)
    stats: Counter[str] = Counter()
    allowed: list[str] = []
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            while time.time() < deadline:
                for op, call in _attempts(conn):
                    try:
                        got = call()
                    except psycopg.errors.InsufficientPrivilege:
                        stats[f"hostile:{op}:refused"] += 1
                        continue
                    if isinstance(got, tuple) and got and got[0] in ("lost", "moved"):
                        # its row moved between the read and the call: it wrote nothing
                        stats[f"hostile:{op}:missed"] += 1
                        continue
                    stats[f"hostile:{op}:ALLOWED"] += 1
                    allowed.append(op)
                seen = conn.execute("SELECT count(*) FROM registry_attempt_tokens").fetchone()
                key = "refused" if seen is not None and seen[0] == 0 else "ALLOWED"
                stats[f"hostile:read_tokens:{key}"] += 1
                if key == "ALLOWED":
                    allowed.append("read_tokens")
                time.sleep(0.2)
        report: dict[str, Any] = {"role": "hostile-learner", "stats": dict(stats)}
        if allowed:
            report["error"] = f"operations outside the learner role landed: {sorted(set(allowed))}"
        out.put(report)
    except Exception as exc:
        out.put({"role": "hostile-learner", "stats": dict(stats), "error": repr(exc)})


def parties(
    *,
    activators: int,
    learners: int,
    dispatchers: int,
    workers: Sequence[str],
    churn: bool,
) -> dict[str, tuple[str, str | None]]:
    """party -> (role, worker id) of an honest deployment and its hostile learner."""
    out: dict[str, tuple[str, str | None]] = {"operator": ("operator", None)}
    out.update({f"coordinator-{i}": ("coordinator", None) for i in range(activators)})
    out.update({f"worker-{w}": ("worker", w) for w in workers})
    out["generator"] = ("generator", None)
    out.update({f"dispatcher-{i}": ("generator", None) for i in range(dispatchers)})
    out.update({f"learner-{i}": ("learner", None) for i in range(learners)})
    out["hostile-learner"] = ("learner", None)
    out["auditor"] = ("auditor", None)
    del churn  # the operator churns, when asked; it exists either way (it set the policy)
    return out
