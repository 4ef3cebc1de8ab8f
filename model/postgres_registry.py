"""The activation registry on a PostgreSQL server: artifacts, worker acks, pointer, membership.

A coordinator step is planned and written inside ONE transaction: it takes the registry lock
(exclusive, with its BEGIN), so its plan and `check_step` read a registry no other
coordinator changes meanwhile (two coordinators racing on one database act one after the
other, each on what the other committed, as with SQLite's BEGIN IMMEDIATE). `check_step`
re-judges a pointer switch with `activation_decision` on the STORED acks echoing the current
attempt's STORED tokens (`registry_attempt_tokens`) and the DURABLE required worker set read
in that same transaction, so the switch succeeds only when every required worker's ack of
this attempt matches version and hash, whatever the coordinator believed.

A step's reads cost few round trips: the premise most steps judge (pointer, required
workers, policy, newest version with its tokens, active version, server clock, the reports
of the workers the plan names: `ReadsWorkers`) is one statement after the lock
(`_PgView.step_reads`), and each other question is asked once (`StepReads`): an ack is BEGIN
with the lock, that read, the write and COMMIT, where each read was a statement of its own
(23 for an ack, 32 for an activation).

The step's rows and its events (to the `events` table shared with the ledger, under the
events lock: one global order, commit order) are written by ONE call of `rl_registry_write`
for the step's operation (`step_operation`), which the server refuses to a role that may not
run it and for a change outside it (model.postgres_functions). A step that changes an
artifact, the pointer or the policy takes the premise lock exclusive in that call, before
its first write, so no reservation reads the pointer while it moves (see
`postgres_ledger`); a step that only stores a worker's ack does not, and never blocks
reservations.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg

from rollout_lifecycle.model.errors import ActivationError
from rollout_lifecycle.model.events import ArtifactChanged, EntryChanged, RowRecorded, TraceEvent
from rollout_lifecycle.model.lineage_index import (
    CLAIMS_TABLE,
    MARK_INDEX,
    PG_REGISTRY_DDL,
    PG_REGISTRY_MIGRATION,
    UNCLAIMED_PG,
)
from rollout_lifecycle.model.postgres_common import (
    K_REGISTRY,
    Conn,
    PostgresDatabase,
    event_columns,
    lock_sql,
    read_events,
    stamp_events,
)
from rollout_lifecycle.model.postgres_functions import ensure_functions
from rollout_lifecycle.model.postgres_roles import refused, registry_operation
from rollout_lifecycle.model.records import ActivePointer, to_jsonable
from rollout_lifecycle.model.registry import (
    _LATER_COLUMNS,
    ReadsWorkers,
    RegistryStep,
    RegistryView,
    SqlView,
    StepReads,
    ViewReads,
    _artifact_events,
    _EmptyView,
    _record_to_row,
    _row_to_record,
    _row_to_token,
    _row_to_worker,
    _Unchanged,
    check_step,
    make_events,
    policy_from_row,
    policy_row,
)

R = TypeVar("R")

COMPONENT = "registry"
# 2: the durable admission policy (registry_policy)
# 3: the policy's pacing bounds (batch_size, max_attempts)
# 4: the policy's lineage mode and attempt-chain key (issue 31)
# 5: an attempt's ack deadline and spent attempt tokens (issue 31)
# 6: the lineage index's claims (registry_claims and its trigger, made by the DDL and filled
#    from the stored lineages; model.lineage_index)
SCHEMA_VERSION = 6
# 1 -> 2 adds tables (created by the DDL) and the artifacts' lineage column
MIGRATIONS = {
    1: "ALTER TABLE registry_artifacts ADD COLUMN IF NOT EXISTS trained_by text",
    2: "ALTER TABLE registry_policy ADD COLUMN IF NOT EXISTS batch_size bigint, "
    "ADD COLUMN IF NOT EXISTS max_attempts bigint",
    3: "ALTER TABLE registry_policy ADD COLUMN IF NOT EXISTS lineage text NOT NULL "
    "DEFAULT 'ledger', ADD COLUMN IF NOT EXISTS chain_key text NOT NULL DEFAULT 'identity'",
    # a token some stored ack already echoed counted once: spent, as the history says
    4: "ALTER TABLE registry_artifacts ADD COLUMN IF NOT EXISTS ack_deadline double precision;"
    "ALTER TABLE registry_attempt_tokens ADD COLUMN IF NOT EXISTS spent boolean NOT NULL "
    "DEFAULT false;"
    "UPDATE registry_attempt_tokens t SET spent = true WHERE EXISTS (SELECT 1 FROM events e "
    "WHERE e.kind = 'worker' AND e.subject = t.worker_id "
    "AND (e.payload::jsonb -> 'ack' ->> 'version')::bigint = t.version "
    "AND e.payload::jsonb -> 'ack' ->> 'token' = t.token)",
    5: PG_REGISTRY_MIGRATION,
}

_DDL = (
    """
CREATE TABLE IF NOT EXISTS registry_artifacts (
    version          bigint PRIMARY KEY CHECK (version >= 0),
    artifact_hash    text,
    parent_version   bigint,
    rollback_version bigint,
    state            text NOT NULL,
    path             text,
    failure          text,
    attempts         bigint NOT NULL CHECK (attempts >= 0),
    trained_by       text,
    ack_deadline     double precision
);
CREATE TABLE IF NOT EXISTS registry_pointer (
    id            integer PRIMARY KEY CHECK (id = 1),
    version       bigint NOT NULL,
    artifact_hash text NOT NULL
);
CREATE TABLE IF NOT EXISTS registry_workers (
    worker_id text PRIMARY KEY,
    floor     bigint NOT NULL,
    ack       text
);
CREATE TABLE IF NOT EXISTS registry_membership (
    id      integer PRIMARY KEY CHECK (id = 1),
    workers text NOT NULL
);
CREATE TABLE IF NOT EXISTS registry_policy (
    id        integer PRIMARY KEY CHECK (id = 1),
    max_lag   bigint NOT NULL CHECK (max_lag >= 0),
    max_drift double precision NOT NULL CHECK (max_drift >= 0),
    batch_size   bigint,
    max_attempts bigint,
    lineage   text NOT NULL DEFAULT 'ledger',
    chain_key text NOT NULL DEFAULT 'identity'
);
CREATE TABLE IF NOT EXISTS registry_attempt_tokens (
    version   bigint NOT NULL CHECK (version >= 0),
    worker_id text NOT NULL,
    attempt   bigint NOT NULL CHECK (attempt >= 0),
    token     text NOT NULL CHECK (token <> ''),
    spent     boolean NOT NULL DEFAULT false,
    PRIMARY KEY (version, worker_id)
);
-- the version awaiting acks, read at every weight sync (`awaiting`), found by this index
-- rather than by a scan of every version registered; a schema made before it was added
-- reads the same rows by a scan (DDL runs only when a schema is made or migrated)
CREATE INDEX IF NOT EXISTS registry_artifacts_state ON registry_artifacts(state);
-- the two write-once rules, held even against a writer that bypasses this module
CREATE OR REPLACE FUNCTION registry_artifacts_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.artifact_hash IS NOT NULL
       AND NEW.artifact_hash IS DISTINCT FROM OLD.artifact_hash THEN
        RAISE EXCEPTION 'a committed artifact hash never changes'
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF TG_OP = 'INSERT' AND NEW.version <= (SELECT MAX(version) FROM registry_artifacts) THEN
        RAISE EXCEPTION 'artifact versions are never reused'
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END
$$;
CREATE OR REPLACE TRIGGER registry_artifacts_guard
    BEFORE INSERT OR UPDATE ON registry_artifacts
    FOR EACH ROW EXECUTE FUNCTION registry_artifacts_guard();
"""
    + PG_REGISTRY_DDL
)


# the step's common reads (`_PgView.step_reads`) in one snapshot; {art}: the artifact columns
_STEP_READS = """
SELECT (SELECT json_build_array(version, artifact_hash) FROM registry_pointer WHERE id = 1),
       (SELECT workers FROM registry_membership WHERE id = 1),
       (SELECT row_to_json(p) FROM registry_policy p WHERE id = 1),
       newest.v,
       (SELECT json_build_array({art}) FROM registry_artifacts WHERE version = newest.v),
       (SELECT json_agg(json_build_array(version, worker_id, attempt, token, spent)
                        ORDER BY worker_id)
          FROM registry_attempt_tokens WHERE version = newest.v),
       (SELECT json_build_array({art}) FROM registry_artifacts
         WHERE version = (SELECT version FROM registry_pointer WHERE id = 1)),
       extract(epoch FROM clock_timestamp())::float8,
       (SELECT json_agg(json_build_array(worker_id, floor, ack)) FROM registry_workers
         WHERE worker_id = ANY(%s::text[]))
FROM (SELECT MAX(version) AS v FROM registry_artifacts) AS newest
"""


class _PgView(SqlView):
    """The registry's reads, with psycopg's parameter marker."""

    PARAM = "%s"
    _now: float | None = None
    TOKENS_TABLE_SQL = "SELECT 1 WHERE to_regclass(%s) IS NOT NULL"
    LINEAGE_SQL = (
        "SELECT a.version, j.value FROM registry_artifacts a, "
        "json_array_elements_text(a.trained_by::json) AS j(value) WHERE a.trained_by IS NOT NULL"
    )
    # the claims table is made and filled in one migration; the marks' partial index with
    # the ledger's column (model.lineage_index)
    INDEX_OBJECTS = (CLAIMS_TABLE, MARK_INDEX)
    UNCLAIMED_SQL = UNCLAIMED_PG
    OBJECT_SQL = "SELECT 1 WHERE to_regclass(%s) IS NOT NULL"
    COLUMN_SQL = (
        "SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema() "
        "AND table_name = %s AND column_name = %s"
    )

    def step_reads(self, workers: Sequence[str] = ()) -> dict[tuple[Any, ...], Any]:
        """What nearly every step reads, in ONE statement (`StepReads`' answers ahead): the
        pointer, the required workers, the policy, the newest version with its record and
        attempt tokens (the version a distribute, an ack or an activation is mostly about),
        the active version's record (an activation's rollback target), the server's clock,
        and the reports of `workers` (those an ack reads). Sent after the registry lock is
        held, so its one snapshot is the step's premise. (Sent with BEGIN and the lock as
        one simple query it was slower: such a text is planned again at every step, where
        this statement's plan is prepared once per connection.)"""
        text = _STEP_READS.format(art=self._art_cols())
        row = self._conn.execute(text, (list(workers),)).fetchone()
        assert row is not None
        pointer, members, policy, newest, art, tokens, active, self._now, reports = row
        known: dict[tuple[Any, ...], Any] = {
            ("pointer",): None if pointer is None else ActivePointer(*pointer),
            ("membership",): None if members is None else tuple(json.loads(members)),
            ("policy",): None if policy is None else policy_from_row(policy),
            ("max_version",): newest,
        }
        if newest is not None:
            known[("artifact", newest)] = None if art is None else _row_to_record(art)
            known[("tokens", newest)] = [_row_to_token(t) for t in tokens or ()]
        if pointer is not None:
            known[("artifact", pointer[0])] = None if active is None else _row_to_record(active)
        found = {str(r[0]): _row_to_worker(r) for r in reports or ()}
        known.update({("worker", w): found.get(w) for w in workers})
        return known

    def now(self) -> float:
        """The server's clock, read inside this step's transaction: activation deadlines
        are set and judged on it, like lease deadlines (never a client's clock). A step
        reads it once, with its premise (`step_reads`)."""
        if self._now is not None:
            return self._now
        row = self._conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8")
        return float(row.fetchone()[0])


def step_operation(step: RegistryStep) -> str | None:
    """The operation (model.postgres_roles) a checked step is; None when it writes nothing."""
    return registry_operation(
        policy=not isinstance(step.policy, _Unchanged),
        membership=not isinstance(step.membership, _Unchanged),
        artifact_events=[ch.event for ch in step.artifacts],
        workers=bool(step.workers),
    )


def step_document(step: RegistryStep) -> dict[str, Any]:
    """What a checked step writes, as `rl_registry_write` reads it: only the parts it has."""
    doc: dict[str, Any] = {}
    if step.artifacts:
        doc["artifacts"] = [
            {"event": ch.event, "row": list(_record_to_row(ch.after))} for ch in step.artifacts
        ]
    if not isinstance(step.pointer, _Unchanged):
        if step.pointer is None:
            raise ActivationError("the active pointer is never cleared")
        doc["pointer"] = [step.pointer.version, step.pointer.artifact_hash]
    if step.workers:
        doc["workers"] = [
            [w.worker_id, w.floor, None if w.ack is None else json.dumps(to_jsonable(w.ack))]
            for w in step.workers
        ]
    if step.revoked:
        doc["revoked"] = list(step.revoked)
    if step.tokens:
        doc["tokens"] = [[t.version, t.worker_id, t.attempt, t.token] for t in step.tokens]
    if not isinstance(step.membership, _Unchanged):
        doc["membership"] = list(step.membership)
    if not isinstance(step.policy, _Unchanged):
        doc["policy"] = list(policy_row(step.policy))
    return doc


_REGISTRY_WRITE = (
    "SELECT o_txn, o_last FROM rl_registry_write(%s, %s::json, %b::text[], %b::text[], %b::text[])"
)


class PostgresRegistry(ViewReads):
    """The registry in a PostgreSQL database, beside the ledger's tables (component "registry").

    `url` is a postgresql:// URL or a `PostgresDatabase` shared with a ledger. With
    `read_only`, a database that holds no registry reads as an empty one and nothing is
    ever created.
    """

    def __init__(
        self,
        url: str | PostgresDatabase,
        *,
        read_only: bool = False,
        schema: str | None = None,
        pool_size: int = 10,
        retry_seconds: float = 30.0,
    ) -> None:
        if isinstance(url, PostgresDatabase):
            self.db = url.acquire()
        else:
            self.db = PostgresDatabase(
                url,
                schema=schema,
                read_only=read_only,
                pool_size=pool_size,
                retry_seconds=retry_seconds,
            ).acquire()
        self.read_only = self.db.read_only
        self._login = str(self.db.params.get("user") or os.environ.get("PGUSER") or "?")
        self._closed = False
        self._empty = False
        # a writer migrates every later column in; a reader asks once which ones it has
        self._columns = {} if self.read_only else dict.fromkeys(_LATER_COLUMNS, True)
        # and the tables found to exist, so each view does not ask again (a writer made them)
        self._tables: set[str] = set() if self.read_only else {"registry_attempt_tokens"}
        try:
            if self.read_only:
                self._empty = self.db.check_readable(COMPONENT, SCHEMA_VERSION) is None
            else:
                self.db.ensure_schema(COMPONENT, SCHEMA_VERSION, _DDL, migrations=MIGRATIONS)
                ensure_functions(self.db)
        except BaseException:
            self.close()
            raise

    @property
    def backend_url(self) -> str:
        """This database as a backend URL (password masked) an operator's command names."""
        return self.db.backend_url

    @property
    def where(self) -> str:
        """host:port/dbname of the server, for messages."""
        return self.db.where

    def _check_open(self) -> None:
        if self._closed:
            raise ActivationError(f"registry on {self.db.where} is closed; open it again")

    def _view_read(self, fn: Callable[[RegistryView], R], what: str) -> R:
        self._check_open()
        if self._empty:
            return fn(_EmptyView())
        return self.db.read(lambda conn: fn(_PgView(conn, self._columns, self._tables)), what)

    # ---- the store protocol ----------------------------------------------------------------

    def transact(
        self, plan: Callable[[RegistryView], tuple[RegistryStep, R]]
    ) -> tuple[R, list[ArtifactChanged]]:
        """Plan, check and write one step in one transaction; any exception writes nothing."""
        self._check_open()
        if self.read_only:
            raise ActivationError(
                f"registry on {self.db.where} was opened read-only; nothing was written"
            )

        ahead = plan.workers if isinstance(plan, ReadsWorkers) else ()

        def body(conn: Conn) -> tuple[R, list[TraceEvent]]:
            # the registry lock is taken with BEGIN (the write's prologue): then one read
            # of the step's common premise, and each other question asked once
            base = _PgView(conn, self._columns, self._tables)
            view = StepReads(base, base.step_reads(ahead))
            step, result = plan(view)
            check_step(view, step)
            events = make_events(step, view.pointer(), view.required_workers(), view.policy())
            op = step_operation(step)
            if op is None:
                return result, []  # a step that writes nothing (an empty step, a refusal)
            cols = event_columns(events)
            try:
                written = conn.execute(
                    _REGISTRY_WRITE,
                    (
                        op,
                        json.dumps(step_document(step)),
                        cols["kinds"],
                        cols["subjects"],
                        cols["payloads"],
                    ),
                ).fetchone()
            except psycopg.errors.InsufficientPrivilege as exc:
                raise refused(exc, op, self._login, self.db.where) from None
            if not events:
                return result, []
            assert written is not None
            return result, stamp_events(events, int(written[0]), int(written[1]))

        result, stamped = self.db.write(
            body, "registry step", error=ActivationError, prologue=lock_sql(K_REGISTRY)
        )
        return result, _artifact_events(stamped)

    def history(self, version: int | None = None) -> list[ArtifactChanged]:
        """Artifact events in global order (shared with the ledger's), optionally of one version."""
        self._check_open()
        if self._empty:
            return []  # no registry here, so no registry events either
        subject = None if version is None else str(version)
        evs = self.db.read(lambda c: read_events(c, "artifact", subject), "history")
        return [e for e in evs if isinstance(e, ArtifactChanged)]

    def trace(self) -> list[TraceEvent]:
        """Every registry event (artifacts, membership, worker reports) in global order
        (the rows recorded for `ledger check`, RowRecorded, are not registry events)."""
        self._check_open()
        if self._empty:
            return []
        evs = self.db.read(lambda c: read_events(c, exclude_kind="entry"), "trace")
        return [e for e in evs if not isinstance(e, EntryChanged | RowRecorded)]

    def close(self) -> None:
        """Release this registry's hold on the pool; the data stays. Idempotent."""
        if not self._closed:
            self._closed = True
            self.db.release()

    def __enter__(self) -> PostgresRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
