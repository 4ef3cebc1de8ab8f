"""No step of a run scans a PostgreSQL table that grows with the run (issue 34: flat per-step
cost at any ledger size). The server's own count of sequential scans in each step's
transaction (`pg_stat_xact_user_tables`) is read before its COMMIT, over the steps a trainer
repeats: land and reserve a batch, commit it, publish a version with its default lineage
(prepare, commit, distribute, every worker's ack, activate), on a store that already holds
hundreds of updates, versions and attempt tokens, its statistics gathered.

Three such scans were found this way, each a join with a step's JSON that the planner ran as
a scan of every row: the update records a ledger step leaves, checked against every update
ever recorded; the attempt tokens an ack spends, against every token ever issued; and the
lineage mark of a new version's updates.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from rollout_lifecycle.model.backends import Backend, open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.ledger import ReserveRequest
from rollout_lifecycle.model.postgres_common import OneStatement, PostgresDatabase
from rollout_lifecycle.model.records import (
    AdmissionPolicy,
    AdmissionStamp,
    LedgerEntry,
    Reward,
)
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.stateful_tests.backends import durable_url
from tests.helpers_ledger import activate

pytestmark = pytest.mark.postgres

GROWING = (
    "rollouts",
    "events",
    "ledger_updates",
    "registry_artifacts",
    "registry_attempt_tokens",
    "registry_claims",
)
WORKERS = ("w0", "w1")
REWARD = Reward("rm", "1", 1.0)
POLICY = AdmissionPolicy(max_lag=1, max_drift=0.2)


def digest(v: int) -> str:
    return f"{v:x}".rjust(64, "e")


class Run:
    """A trainer's steps: each lands and reserves 4 rollouts of the active version for its
    own update, commits them, and publishes the next version with its default lineage."""

    def __init__(self, b: Backend, first: int) -> None:
        set_admission_policy(b.registry, POLICY, "flat steps test")
        self.b = b
        self.c = ActivationCoordinator(b.registry, list(WORKERS), ledger=b.ledger, policy=POLICY)
        self.v = first
        self.publish()

    def publish(self) -> None:
        activate(self.c, self.v, digest(self.v))

    def step(self) -> None:
        v, led = self.v, self.b.ledger
        ids = [f"s{v}-{i}" for i in range(4)]
        led.add_many(
            [LedgerEntry(rid, v, digest(v), state="rewarded", reward=REWARD) for rid in ids]
        )
        stamp = AdmissionStamp(v, v, 1, 0.2, 0.0, "fresh", "ok", True)
        got = led.reserve_batch(f"step{v}", [ReserveRequest(r, 0, stamp) for r in ids])
        assert all(o.reserved for o in got), got
        led.commit(f"step{v}", ids)
        self.v += 1
        self.publish()
        assert self.b.registry.artifact(self.v).trained_by == (f"step{v}",)


def _scans_recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int]]:
    """(what, table, sequential scans) of every write transaction from now on, counted by
    the server inside it, up to just before its COMMIT."""
    seen: list[tuple[str, str, int]] = []
    write = PostgresDatabase.write

    def counted(
        self: PostgresDatabase, body: Callable[[Any], Any], what: str = "a write", **kw: Any
    ) -> Any:
        if isinstance(body, OneStatement):
            return write(self, body, what, **kw)

        def scans(conn: Any) -> dict[str, int]:
            rows = conn.execute(
                "SELECT relname, seq_scan FROM pg_stat_xact_user_tables WHERE relname = ANY(%s)",
                (list(GROWING),),
            ).fetchall()
            return {str(r[0]): int(r[1]) for r in rows}

        def wrapped(conn: Any) -> Any:
            # the backend's counts not yet reported include earlier transactions' (they
            # are reported at most once a second): this step's are the difference
            before = scans(conn)
            out = body(conn)
            for table, n in scans(conn).items():
                if n > before.get(table, 0):
                    seen.append((what, table, n - before.get(table, 0)))
            return out

        return write(self, wrapped, what, **kw)

    monkeypatch.setattr(PostgresDatabase, "write", counted)
    return seen


# the rows a long run leaves, written directly (a run of that length takes minutes): the
# versions it superseded (before the run's own, which start above them), landed updates each
# claimed by an old version, and spent tokens of old attempts
OLD_VERSIONS = (
    "INSERT INTO registry_artifacts(version, artifact_hash, state, attempts) "
    "SELECT i, lpad(to_hex(i), 64, 'f'), 'superseded', 1 FROM generate_series(0, %(n)s - 1) i "
    "ORDER BY i"
)
PAD = (
    "INSERT INTO ledger_updates(update_id, status, cause, detail, claimed) "
    "SELECT 'old-' || i, 'landed', NULL, '', 1 FROM generate_series(1, %(n)s) i",
    "INSERT INTO registry_claims(update_id, version) "
    "SELECT 'old-' || i, 0 FROM generate_series(1, %(n)s) i",
    "INSERT INTO registry_attempt_tokens(version, worker_id, attempt, token, spent) "
    "SELECT 1000000 + i, 'w0', 0, 'old', true FROM generate_series(1, %(n)s) i",
    "ANALYZE",
)


def test_no_step_scans_a_table_that_grows_with_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store of 100 steps, padded to 4,000 versions, updates, claims and attempt tokens as
    a long run leaves them, its statistics gathered: 5 more steps, each statement of each step's
    transaction read by an index (or a table that does not grow). Before the fix the step's
    update records, an ack's spent tokens and every registry step's (empty) revocation
    scanned their tables whole."""
    url = durable_url("postgresql", tmp_path)
    with open_backend(url) as b:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(OLD_VERSIONS, {"n": 4000})
        run = Run(b, 4000)
        for _ in range(100):
            run.step()
        with psycopg.connect(url, autocommit=True) as admin:
            for stmt in PAD:
                admin.execute(stmt, {"n": 4000})
        scans = _scans_recorded(monkeypatch)
        for _ in range(5):
            run.step()
        assert len(scans) == 0, sorted(set(scans))
