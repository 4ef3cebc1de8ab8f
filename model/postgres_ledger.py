"""The ledger on a PostgreSQL server, for learners and generators on many machines.

Every decision is made by the shared planners of `model.ledger` (`plan_reserve`,
`plan_release`, `commit_plan`, ...) on rows read from the server, and every write passes
`enforce`; this module only makes "check the revision and write" indivisible, under READ
COMMITTED:

- A single-row write (`reserve`, `transition`) is a real compare-and-set: the row is read
  without a lock, planned in Python, and written by ONE conditional
  ``UPDATE rollouts ... WHERE rollout_id = %s AND revision = %s``. Under READ COMMITTED a
  racing UPDATE waits for the winner's COMMIT, re-checks the WHERE on the new row and
  matches nothing: the loser gets 0 rows, never an error and never an overwrite.
- A batch reservation is set-based: one unlocked SELECT reads every row, Python plans each
  item, and ONE statement compare-and-sets them all (``UPDATE ... FROM unnest(...)`` with
  RETURNING the winners). Its CTE locks the matching rows in rollout_id order first, so two
  batches over overlapping rows can never deadlock. Items that lost are re-read and
  reported as a conflict (or an idempotent retry if the same update took them meanwhile).
- The reservation's premise (the active pointer and the ever-active versions, see
  `ActivationPremise`) is read INSIDE the reservation's transaction, after taking the
  premise lock in SHARED mode; a registry step that changes an artifact or the pointer takes
  it EXCLUSIVE before writing. So a pointer switch either committed before the reservation
  read the pointer (and the reservation is judged against the new one) or waits until the
  reservation committed: "read the pointer, then write the reservations" is atomic against
  a concurrent switch, while reservations never block each other on it. (A row lock on the
  pointer row would do the same but needs the row to exist before the first activation,
  and FOR SHARE from many transactions costs a multixact each.)
- Steps that read a set of rows and write them (commit, abort, fail_update, expire_leases,
  quarantine_version) lock that set with ``SELECT ... ORDER BY rollout_id FOR UPDATE``;
  under READ COMMITTED the predicate is re-checked on rows that changed while waiting.
  The bad-version lock (shared for add/abort/expiry, exclusive for quarantine_version)
  keeps a rollout of a version being marked bad from slipping through open.

Events and counters are written last, under the events lock (see `postgres_common`), in the
same transaction as the rows they describe.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs

from rollout_lifecycle.model.errors import (
    DuplicateRollout,
    LedgerError,
    RevisionConflict,
    UnknownRollout,
)
from rollout_lifecycle.model.events import Change, EntryChanged, StoredRows, entry_events
from rollout_lifecycle.model.ledger import (
    CONFLICT,
    IDEMPOTENT,
    NO_REGISTRY,
    PROCESS_LOCAL_COUNTERS,
    RESERVED,
    ActivationPremise,
    Clock,
    LedgerStatistics,
    RecoveryRule,
    ReserveOutcome,
    ReserveRequest,
    check_id,
    check_lease_seconds,
    check_limit,
    check_requests,
    check_revision,
    check_update_id,
    commit_plan,
    direct_changes,
    dispatch_entry,
    enforce,
    plan_add,
    plan_release,
    plan_reserve,
    plan_transition,
    renew_plan,
    replan_lost,
    statistics_from,
)
from rollout_lifecycle.model.machines import LIFECYCLE
from rollout_lifecycle.model.pacing import (
    LIVE_STATES,
    DispatchOutcome,
    DispatchPremise,
    PacingRow,
    oldest_first,
    plan_dispatch,
    rows_from_columns,
    stale_disposition,
    window_floor,
)
from rollout_lifecycle.model.postgres_common import (
    COUNTER_SHARDS,
    K_BAD,
    K_DISPATCH,
    K_PREMISE,
    Conn,
    PostgresDatabase,
    append_events,
    has_table,
    lock,
    lock_sql,
    read_events,
    read_stored,
)
from rollout_lifecycle.model.records import (
    AdmissionPolicy,
    AdmissionStamp,
    Disposition,
    LedgerEntry,
    Reward,
    Rollout,
    from_jsonable,
    to_jsonable,
)
from rollout_lifecycle.model.rules import WAS_ACTIVE_STATES, retired_from_rows

COMPONENT = "ledger"
SCHEMA_VERSION = 1

# The indexed columns copy LedgerEntry fields that queries filter on; `entry` holds the whole
# record. The CHECK repeats the exclusive-ownership invariant at the storage level.
_DDL = """
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id       text PRIMARY KEY,
    state            text NOT NULL,
    revision         bigint NOT NULL CHECK (revision >= 0),
    reserved_by      text,
    lease_expires_at double precision,
    behavior_version bigint NOT NULL,
    entry            text NOT NULL,
    CHECK ((reserved_by IS NULL) = (state <> 'reserved'))
);
CREATE INDEX IF NOT EXISTS rollouts_owner ON rollouts(reserved_by)
    WHERE reserved_by IS NOT NULL;
CREATE INDEX IF NOT EXISTS rollouts_lease ON rollouts(lease_expires_at)
    WHERE reserved_by IS NOT NULL;
CREATE INDEX IF NOT EXISTS rollouts_version ON rollouts(behavior_version, state);
CREATE INDEX IF NOT EXISTS rollouts_state ON rollouts(state, rollout_id);
CREATE INDEX IF NOT EXISTS rollouts_chain ON rollouts(((entry::jsonb)->>'chain'))
    WHERE (entry::jsonb)->>'chain' IS NOT NULL;
CREATE TABLE IF NOT EXISTS ledger_bad_versions (
    version bigint PRIMARY KEY,
    reason  text NOT NULL
);
CREATE TABLE IF NOT EXISTS ledger_counters (
    name  text NOT NULL,
    shard integer NOT NULL,
    n     bigint NOT NULL,
    PRIMARY KEY (name, shard)
);
"""

_CAS_ONE = (
    "UPDATE rollouts SET state = %s, revision = %s, reserved_by = %s, lease_expires_at = %s, "
    "entry = %s WHERE rollout_id = %s AND revision = %s RETURNING rollout_id"
)

# ONE statement compare-and-sets a whole set of rows: `locked` takes the row locks of the
# rows whose revision still matches, in rollout_id order (deadlock-free against any other
# batch), re-checking the revision of rows that changed while it waited; the UPDATE then
# writes exactly those rows and returns their ids: the winners.
_CAS_MANY = """
WITH v AS (
    SELECT * FROM json_to_recordset(%s::json)
        AS v(rollout_id text, expected bigint, state text, revision bigint, reserved_by text,
             lease float8, entry text)
), locked AS (
    SELECT r.rollout_id FROM rollouts r JOIN v ON r.rollout_id = v.rollout_id
    WHERE r.revision = v.expected
    ORDER BY r.rollout_id
    FOR UPDATE OF r
)
UPDATE rollouts r SET state = v.state, revision = v.revision, reserved_by = v.reserved_by,
    lease_expires_at = v.lease, entry = v.entry
FROM v
WHERE r.rollout_id = v.rollout_id AND r.revision = v.expected
    AND r.rollout_id IN (SELECT rollout_id FROM locked)
RETURNING r.rollout_id
"""

_PACING_COLUMNS = (
    "SELECT rollout_id, state, behavior_version, (entry::jsonb)->>'chain', "
    "(entry::jsonb)->>'attempt', (entry::jsonb)->>'tokens', "
    "(entry::jsonb)->'admission'->>'current_version' FROM rollouts"
)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


_INSERT_MANY = """
INSERT INTO rollouts(rollout_id, state, revision, reserved_by, lease_expires_at,
                     behavior_version, entry)
SELECT * FROM json_to_recordset(%s::json)
    AS n(rollout_id text, state text, revision bigint, reserved_by text, lease float8,
         version bigint, entry text)
ORDER BY rollout_id
ON CONFLICT (rollout_id) DO NOTHING
RETURNING rollout_id
"""

_BUMP = f"""
INSERT INTO ledger_counters(name, shard, n)
SELECT c.name, pg_backend_pid() %% {COUNTER_SHARDS}, c.n
FROM json_to_recordset(%s::json) AS c(name text, n bigint)
ORDER BY c.name
ON CONFLICT (name, shard) DO UPDATE SET n = ledger_counters.n + excluded.n
"""

# Same reason -> counter mapping as MemoryLedger; the conformance suite compares the counts.
_COUNTER_OF = {
    RESERVED: "reservations",
    IDEMPOTENT: "idempotent_retries",
    CONFLICT: "cas_conflicts",
}

_WAS_ACTIVE = sorted(WAS_ACTIVE_STATES)
_PREMISE_LOCK = lock_sql(K_PREMISE, shared=True)
# read off the machine, so "which states can be quarantined directly" is never retyped
_QUARANTINABLE = [s for s in LIFECYCLE.states if LIFECYCLE.is_legal(s, "quarantine")]


def _dump(entry: LedgerEntry) -> str:
    return json.dumps(to_jsonable(entry), separators=(",", ":"))


def _load(text: str) -> LedgerEntry:
    return from_jsonable(LedgerEntry, json.loads(text))


def _counter_of(reason: str) -> str:
    return _COUNTER_OF.get(reason, "refused")


def _check_version(version: object) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be a non-negative int, got {version!r}")
    return version


class PostgresLedger:
    """Durable ledger on a PostgreSQL server; any number of threads and processes share it.

    `url` is a postgresql:// URL (or a `PostgresDatabase` shared with a registry). The
    tables are created (or migrated) on first use; with `read_only` nothing is ever
    written, not even a table (the connections run with default_transaction_read_only).
    `schema` puts the tables in that schema (created on first use) instead of the
    connection's current one.
    """

    #: counters of outcomes that write nothing, kept per ledger object (see _bump)
    process_local_counters: ClassVar[frozenset[str]] = PROCESS_LOCAL_COUNTERS

    def __init__(
        self,
        url: str | PostgresDatabase,
        *,
        clock: Clock | None = None,
        lease_seconds: float = 600.0,
        recovery: RecoveryRule | None = None,
        read_only: bool = False,
        schema: str | None = None,
        pool_size: int = 10,
        retry_seconds: float = 30.0,
    ) -> None:
        lease_seconds = check_lease_seconds(lease_seconds)
        # lease deadlines and expiry use the SERVER's clock, read inside the writing
        # transaction, unless a test injects a clock; `self.clock` then only dates events
        self._server_clock = clock is None
        self.clock: Clock = clock if clock is not None else time.time
        self.lease_seconds = float(lease_seconds)
        self.recovery = recovery or RecoveryRule()
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
        self._outcomes: Counter[str] = Counter()  # outcomes that write nothing (see _bump)
        self._outcomes_lock = threading.Lock()
        self._local = threading.local()
        self._registry_seen = False
        self._closed = False
        try:
            if self.read_only:
                if self.db.check_readable(COMPONENT, SCHEMA_VERSION) is None:
                    raise LedgerError(
                        f"{self.db.where} holds no rollout-lifecycle ledger (reading never "
                        "creates one; check the URL's database and schema)"
                    )
            else:
                self.db.ensure_schema(COMPONENT, SCHEMA_VERSION, _DDL)
        except BaseException:
            self.close()
            raise

    @property
    def where(self) -> str:
        """host:port/dbname of the server, for messages."""
        return self.db.where

    # ---- helpers ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise LedgerError(f"ledger on {self.db.where} is closed; open a new PostgresLedger")

    def _write(self, body: Any, what: str, *, premise: bool = False) -> Any:
        """One write step; with `premise`, the premise lock is taken (shared) right after
        BEGIN, in the same round trip, before anything the step reads."""
        self._check_open()
        if self.read_only:
            raise LedgerError(f"ledger on {self.db.where} was opened read-only; nothing written")
        prologue = _PREMISE_LOCK if premise else ""
        pending: Counter[str] = Counter()

        def attempt(conn: Conn) -> Any:
            # outcomes that write nothing are counted only once the step's transaction is
            # done, and afresh on each attempt (a step run again must not count twice)
            pending.clear()
            self._local.pending = pending
            try:
                return body(conn)
            finally:
                self._local.pending = None

        result = self.db.write(attempt, what, prologue=prologue)
        if pending:
            with self._outcomes_lock:
                self._outcomes.update(pending)
        return result

    def _read(self, body: Any, what: str, *, snapshot: bool = False) -> Any:
        self._check_open()
        return self.db.read(body, what, snapshot=snapshot)

    def _bump(self, conn: Conn, counts: Mapping[str, int]) -> None:
        """Add to counters: counts of writes go to the server in the step's transaction;
        outcomes that write nothing (a lost compare-and-set, a refusal, an idempotent retry)
        are counted by this ledger object only, so a losing racer writes nothing at all."""
        local = {k: v for k, v in counts.items() if v and k in PROCESS_LOCAL_COUNTERS}
        if local:
            pending = getattr(self._local, "pending", None)
            if pending is None:
                with self._outcomes_lock:
                    self._outcomes.update(local)
            else:
                pending.update(local)
        rows = sorted((k, v) for k, v in counts.items() if v and k not in local)
        if rows:
            conn.execute(_BUMP, (json.dumps([{"name": k, "n": v} for k, v in rows]),))

    def _bump_now(self, counts: Mapping[str, int]) -> None:
        """Counters of an outcome decided before any transaction (a stale read, a bad stamp)."""
        self._check_open()
        if any(k not in PROCESS_LOCAL_COUNTERS for k, v in counts.items() if v):
            if self.read_only:
                raise LedgerError(
                    f"ledger on {self.db.where} was opened read-only; nothing written"
                )
            self.db.write(lambda conn: self._bump(conn, counts), "updating counters")
        else:
            with self._outcomes_lock:
                self._outcomes.update({k: v for k, v in counts.items() if v})

    @staticmethod
    def _row(conn: Conn, rollout_id: str) -> LedgerEntry | None:
        row = conn.execute(
            "SELECT entry FROM rollouts WHERE rollout_id = %s", (rollout_id,)
        ).fetchone()
        return None if row is None else _load(row[0])

    @staticmethod
    def _rows(conn: Conn, rollout_ids: Sequence[str]) -> dict[str, LedgerEntry]:
        rows = conn.execute(
            "SELECT rollout_id, entry FROM rollouts WHERE rollout_id = ANY(%s::text[])",
            (list(rollout_ids),),
        ).fetchall()
        return {str(rid): _load(text) for rid, text in rows}

    @staticmethod
    def _locked(conn: Conn, where: str, args: Sequence[Any]) -> list[LedgerEntry]:
        """Rows matching `where`, locked in rollout_id order (re-checked after any wait)."""
        rows = conn.execute(
            f"SELECT entry FROM rollouts WHERE {where} ORDER BY rollout_id FOR UPDATE", args
        ).fetchall()
        return [_load(r[0]) for r in rows]

    @staticmethod
    def _bad_versions(conn: Conn) -> set[int]:
        return {int(r[0]) for r in conn.execute("SELECT version FROM ledger_bad_versions")}

    @staticmethod
    def _cas_one(conn: Conn, before: LedgerEntry, after: LedgerEntry) -> bool:
        """THE compare-and-set of one row: one conditional UPDATE; False when it lost."""
        row = conn.execute(
            _CAS_ONE,
            (
                after.state,
                after.revision,
                after.reserved_by,
                after.lease_expires_at,
                _dump(after),
                after.rollout_id,
                before.revision,
            ),
        ).fetchone()
        return row is not None

    @staticmethod
    def _cas_many(conn: Conn, pairs: Sequence[tuple[LedgerEntry, LedgerEntry]]) -> set[str]:
        """Compare-and-set many rows in ONE statement; returns the ids that won."""
        if not pairs:
            return set()
        if len(pairs) == 1:
            before, after = pairs[0]
            return {after.rollout_id} if PostgresLedger._cas_one(conn, before, after) else set()
        doc = [
            {
                "rollout_id": after.rollout_id,
                "expected": before.revision,
                "state": after.state,
                "revision": after.revision,
                "reserved_by": after.reserved_by,
                "lease": after.lease_expires_at,
                "entry": _dump(after),
            }
            for before, after in pairs
        ]
        rows = conn.execute(_CAS_MANY, (json.dumps(doc),)).fetchall()
        return {str(r[0]) for r in rows}

    def _apply(self, conn: Conn, changes: Sequence[Change]) -> None:
        """Write changes to rows this transaction locked; a lost CAS here is a bug."""
        pairs = [(b, a) for _, b, a, _ in changes if b is not None]
        if len(pairs) != len(changes):
            raise LedgerError("an update without a before-image reached _apply")
        enforce(a for _, a in pairs)
        won = self._cas_many(conn, pairs)
        if len(won) != len(pairs):
            lost = sorted({a.rollout_id for _, a in pairs} - won)
            raise LedgerError(f"rollouts {lost[:5]} changed under this transaction's row locks")

    def _finish(self, conn: Conn, changes: Sequence[Change], counts: Mapping[str, int]) -> None:
        """Events and counters of a step, last, under the events lock (held to COMMIT)."""
        total = Counter(counts)
        total["writes"] += len(changes)
        local = {k: total.pop(k) for k in PROCESS_LOCAL_COUNTERS if k in total}
        self._bump(conn, local)  # counted by this object once the step is over
        if not changes:
            self._bump(conn, total)
            return
        append_events(conn, entry_events(changes, self.clock()), counters=total)

    def _now(self, conn: Conn) -> float:
        """The deployment's clock: the server's, inside this transaction (see model.clocks)."""
        if not self._server_clock:
            return self.clock()
        row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        assert row is not None
        return float(row[0])

    def _premise(self, conn: Conn) -> tuple[ActivationPremise, float]:
        """The active pointer, ever-active and retired versions and the recorded policy,
        read inside the caller's transaction after its prologue took the premise lock
        shared (see the module doc; the lock comes first, so a first activation committing
        meanwhile waits for this step too), with the deployment's time now, in the same
        round trip. A database without registry tables (a ledger on its own) gives
        NO_REGISTRY."""
        if not self._registry_seen:
            if not has_table(conn, "registry_pointer"):
                return NO_REGISTRY, self._now(conn)
            self._registry_seen = True  # a registry, once created, never goes away
        row = conn.execute(
            "SELECT extract(epoch FROM clock_timestamp())::float8, "
            "(SELECT version FROM registry_pointer WHERE id = 1), "
            "ARRAY(SELECT version FROM registry_artifacts WHERE state = ANY(%s::text[])), "
            "(SELECT json_build_array(max_lag, max_drift, batch_size, max_attempts) "
            "FROM registry_policy WHERE id = 1), "
            "(SELECT json_agg(json_build_array(version, failure)) FROM registry_artifacts "
            "WHERE state = 'rolled_back')",
            (_WAS_ACTIVE,),
        ).fetchone()
        assert row is not None
        server_now, pointer, was, pol, rolled = row
        premise = ActivationPremise(
            None if pointer is None else int(pointer),
            frozenset(int(v) for v in was),
            None
            if pol is None
            else AdmissionPolicy(int(pol[0]), float(pol[1]), _opt_int(pol[2]), _opt_int(pol[3])),
            retired_from_rows(rolled or ()),
        )
        return premise, float(server_now) if self._server_clock else self.clock()

    # ---- protocol --------------------------------------------------------------------------

    def add(self, rollout: Rollout | LedgerEntry) -> LedgerEntry:
        """Insert a new rollout at revision 0; its id must be new."""
        return self.add_many([rollout])[0]

    def add_many(self, rollouts: Sequence[Rollout | LedgerEntry]) -> list[LedgerEntry]:
        """Insert several new rollouts in one transaction and one INSERT statement.

        All or nothing: a duplicate id anywhere (stored or in the list) adds none of them.
        """
        entries = [r.entry() if isinstance(r, Rollout) else r for r in rollouts]
        for e in entries:
            plan_add(e, ())  # validate before taking any lock
        if not entries:
            return []

        def body(conn: Conn) -> list[LedgerEntry]:
            # shared with other adds, exclusive of a dispatch: a dispatch counts the live
            # rollouts and then writes, so no new live rollout may commit in between
            lock(conn, K_DISPATCH, shared=True)
            lock(conn, K_BAD, shared=True)
            bad = self._bad_versions(conn)
            plans = [plan_add(e, bad) for e in entries]
            final = [p[-1][2] for p in plans]
            doc = [
                {
                    "rollout_id": e.rollout_id,
                    "state": e.state,
                    "revision": e.revision,
                    "reserved_by": e.reserved_by,
                    "lease": e.lease_expires_at,
                    "version": e.behavior_version,
                    "entry": _dump(e),
                }
                for e in final
            ]
            got = {str(r[0]) for r in conn.execute(_INSERT_MANY, (json.dumps(doc),)).fetchall()}
            if len(got) != len(final):
                dup = sorted({e.rollout_id for e in final} - got) or sorted(
                    k for k, n in Counter(e.rollout_id for e in final).items() if n > 1
                )
                raise DuplicateRollout(
                    f"rollout {dup[0]!r} is already in the ledger (or listed twice); "
                    "nothing was added"
                )
            self._finish(conn, [(ev, b, a, None) for p in plans for ev, b, a in p], {})
            return final

        result: list[LedgerEntry] = self._write(body, "add")
        return result

    def find(self, rollout_id: str) -> LedgerEntry | None:
        """The entry, or None when absent."""
        check_id(rollout_id)
        found: LedgerEntry | None = self._read(lambda c: self._row(c, rollout_id), "find")
        return found

    def get(self, rollout_id: str) -> LedgerEntry:
        """The entry; UnknownRollout when absent."""
        e = self.find(rollout_id)
        if e is None:
            raise UnknownRollout(f"rollout {rollout_id!r} is not in the ledger")
        return e

    def in_state(self, state: str, limit: int | None = None) -> list[LedgerEntry]:
        """Entries in `state`, by rollout id (at most `limit`): a learner's 'what is waiting'."""
        if state not in LIFECYCLE.states:
            raise ValueError(f"unknown lifecycle state {state!r}")

        def body(conn: Conn) -> list[LedgerEntry]:
            rows = conn.execute(
                "SELECT entry FROM rollouts WHERE state = %s ORDER BY rollout_id LIMIT %s",
                (state, limit),
            ).fetchall()
            return [_load(r[0]) for r in rows]

        result: list[LedgerEntry] = self._read(body, "in_state")
        return result

    def transition(
        self,
        rollout_id: str,
        event: str,
        expected_revision: int,
        *,
        reward: Reward | None = None,
        disposition: Disposition | None = None,
        tokens: int | None = None,
    ) -> LedgerEntry:
        """Fire a direct lifecycle event under compare-and-set; nothing changes on failure."""
        changes = direct_changes(event, reward, disposition, tokens)
        check_revision(expected_revision)
        entry = self.get(rollout_id)
        if entry.revision != expected_revision:
            self._bump_now({"cas_conflicts": 1})
            raise RevisionConflict(rollout_id, expected_revision, entry.revision)
        new = plan_transition(entry, event, **changes)
        enforce([new])

        def body(conn: Conn) -> LedgerEntry | int:
            if self._cas_one(conn, entry, new):
                self._finish(conn, [(event, entry, new, None)], {})
                return new
            # lost between the read and the write: count it, report what is there now
            self._bump(conn, {"cas_conflicts": 1})
            now = self._row(conn, rollout_id)
            return -1 if now is None else now.revision

        out = self._write(body, f"transition {event}")
        if isinstance(out, LedgerEntry):
            return out
        raise RevisionConflict(rollout_id, expected_revision, int(out))

    def reserve(
        self,
        rollout_id: str,
        expected_revision: int,
        update_id: str,
        admission: AdmissionStamp | None,
    ) -> ReserveOutcome:
        """Compare-and-set reservation of one rollout: unlocked read, one conditional UPDATE."""
        check_update_id(update_id)
        entry = self.find(rollout_id)
        lease = self.clock() + self.lease_seconds
        # plan on the unlocked read (a conflict or a bad stamp costs no transaction) ...
        out, new = plan_reserve(
            entry,
            rollout_id,
            expected_revision,
            update_id,
            admission,
            premise=NO_REGISTRY,
            lease_expires_at=lease,
        )
        if new is None or entry is None:
            self._bump_now({_counter_of(out.reason): 1})
            return out
        enforce([new])
        planned, fresh = out, new

        def body(conn: Conn) -> ReserveOutcome:
            # ... and judge the premise against the pointer of THIS moment, under its lock
            premise, now = self._premise(conn)
            refusal = premise.refusal(admission, entry.behavior_version)
            if refusal is not None:
                self._bump(conn, {"refused": 1})
                return ReserveOutcome(rollout_id, False, refusal[0], entry, refusal[1])
            nonlocal planned, fresh
            if self._server_clock:  # the deadline is the server's, not this client's
                fresh = attrs.evolve(fresh, lease_expires_at=now + self.lease_seconds)
                planned = attrs.evolve(planned, entry=fresh)
            if self._cas_one(conn, entry, fresh):
                self._finish(conn, [("reserve", entry, fresh, update_id)], {"reservations": 1})
                return planned
            return self._lost(conn, rollout_id, expected_revision, update_id, admission, lease)

        result: ReserveOutcome = self._write(body, "reserve", premise=True)
        return result

    def _lost(
        self,
        conn: Conn,
        rollout_id: str,
        expected_revision: int,
        update_id: str,
        admission: AdmissionStamp | None,
        lease: float,
    ) -> ReserveOutcome:
        """A CAS that lost: re-plan on the row as it is now. Revisions only grow, so the
        planner can only say conflict, or idempotent if this same update reserved it
        meanwhile (e.g. through a concurrent batch)."""
        now = self._row(conn, rollout_id)
        again = replan_lost(now, rollout_id, expected_revision, update_id, admission, lease)
        self._bump(conn, {_counter_of(again.reason): 1})
        return again

    def reserve_batch(
        self, update_id: str, requests: Sequence[ReserveRequest]
    ) -> list[ReserveOutcome]:
        """Reserve many rollouts in one transaction with ONE compare-and-set statement.

        Each item wins or loses on its own revision; a crash (or SIGKILL) before COMMIT
        leaves none of them reserved.
        """
        check_update_id(update_id)
        requests = check_requests(requests)  # the same refusals as every other backend
        if not requests:
            return []

        def body(conn: Conn) -> list[ReserveOutcome]:
            premise, server_now = self._premise(conn)
            lease = server_now + self.lease_seconds
            entries = self._rows(conn, [r.rollout_id for r in requests])
            outcomes: list[ReserveOutcome] = []
            planned: dict[str, tuple[LedgerEntry, LedgerEntry]] = {}
            for r in requests:
                entry = entries.get(r.rollout_id)
                out, new = plan_reserve(
                    entry,
                    r.rollout_id,
                    r.expected_revision,
                    update_id,
                    r.admission,
                    premise=premise,
                    lease_expires_at=lease,
                )
                if new is not None and entry is not None:
                    planned[r.rollout_id] = (entry, new)
                outcomes.append(out)
            enforce(a for _, a in planned.values())
            won = self._cas_many(conn, list(planned.values()))
            lost = sorted(set(planned) - won)
            now = self._rows(conn, lost) if lost else {}
            counts: Counter[str] = Counter()
            changes: list[Change] = []
            for i, (r, out) in enumerate(zip(requests, outcomes, strict=True)):
                rid = r.rollout_id
                if rid in won:
                    before, after = planned[rid]
                    changes.append(("reserve", before, after, update_id))
                elif rid in planned:
                    again, _ = plan_reserve(
                        now.get(rid),
                        rid,
                        r.expected_revision,
                        update_id,
                        r.admission,
                        premise=NO_REGISTRY,
                        lease_expires_at=lease,
                    )
                    if again.reason != IDEMPOTENT:
                        again = ReserveOutcome(rid, False, CONFLICT, now.get(rid))
                    outcomes[i] = out = again
                counts[_counter_of(out.reason)] += 1
            self._finish(conn, changes, counts)
            return outcomes

        result: list[ReserveOutcome] = self._write(body, "reserve_batch", premise=True)
        return result

    def dispatch(self, rollout: Rollout | LedgerEntry, *, chain: str) -> DispatchOutcome:
        """Start a rollout of `chain` only within the staleness budget (model.pacing).

        Under the premise lock (shared: no pointer or policy move lands meanwhile) and the
        dispatch lock (exclusive: no other dispatch counts the same free slot); READ
        COMMITTED, so the count after the lock sees every dispatch committed before it."""
        entry = dispatch_entry(rollout, chain)

        def body(conn: Conn) -> DispatchOutcome:
            lock(conn, K_DISPATCH)
            act, _ = self._premise(conn)
            floor = window_floor(act.pointer_version, act.policy)
            row = conn.execute(
                "SELECT COUNT(*) FROM rollouts WHERE state = ANY(%s::text[]) "
                "AND behavior_version >= %s",
                (list(LIVE_STATES), -1 if floor is None else floor),
            ).fetchone()
            assert row is not None
            states = tuple(
                str(r[0])
                for r in conn.execute(
                    "SELECT state FROM rollouts WHERE (entry::jsonb)->>'chain' = %s", (chain,)
                ).fetchall()
            )
            premise = DispatchPremise(
                act.pointer_version, act.was_active, act.policy, int(row[0]), states
            )
            out, new = plan_dispatch(entry, chain, premise)
            if new is None:
                return out
            lock(conn, K_BAD, shared=True)
            changes = plan_add(new, self._bad_versions(conn), dispatched=True)
            written = changes[-1][2]
            doc = [
                {
                    "rollout_id": written.rollout_id,
                    "state": written.state,
                    "revision": written.revision,
                    "reserved_by": None,
                    "lease": None,
                    "version": written.behavior_version,
                    "entry": _dump(written),
                }
            ]
            if not conn.execute(_INSERT_MANY, (json.dumps(doc),)).fetchall():
                raise DuplicateRollout(f"rollout {written.rollout_id!r} is already in the ledger")
            self._finish(conn, [(ev, b, a, None) for ev, b, a in changes], {})
            return attrs.evolve(out, entry=written)

        result: DispatchOutcome = self._write(body, "dispatch", premise=True)
        return result

    def retire_stale(self) -> list[LedgerEntry]:
        """Retire, with their cause, rewarded rollouts now too old for the pointer."""

        def body(conn: Conn) -> list[LedgerEntry]:
            act, _ = self._premise(conn)
            floor = window_floor(act.pointer_version, act.policy)
            if floor is None or act.policy is None or act.pointer_version is None:
                return []
            due = self._locked(conn, "state = 'rewarded' AND behavior_version < %s", (floor,))
            due = [e for e in due if e.state == "rewarded"]  # re-checked after a wait
            pointer, bound = act.pointer_version, act.policy.max_lag
            new = [
                plan_transition(
                    e,
                    "retire_stale",
                    disposition=stale_disposition(pointer - e.behavior_version, bound, pointer),
                )
                for e in due
            ]
            changes: list[Change] = [
                ("retire_stale", b, a, None) for b, a in zip(due, new, strict=True)
            ]
            self._apply(conn, changes)
            self._finish(conn, changes, {})
            return new

        result: list[LedgerEntry] = self._write(body, "retire_stale", premise=True)
        return result

    def oldest_admissible(self, limit: int) -> list[LedgerEntry]:
        """Up to `limit` rewarded rollouts still within the lag bound, oldest first."""
        limit = check_limit(limit)

        def body(conn: Conn) -> list[LedgerEntry]:
            act, _ = self._premise(conn)
            floor = window_floor(act.pointer_version, act.policy)
            top = act.pointer_version
            rows = conn.execute(
                "SELECT entry FROM rollouts WHERE state = 'rewarded' "
                "AND behavior_version >= %s AND behavior_version <= %s "
                "ORDER BY behavior_version, "
                "COALESCE(((entry::jsonb)->>'attempt')::bigint, 0) DESC, rollout_id LIMIT %s",
                (-1 if floor is None else floor, 2**62 if top is None else top, limit),
            ).fetchall()
            return oldest_first(_load(r[0]) for r in rows)

        result: list[LedgerEntry] = self._read(body, "oldest_admissible")
        return result

    def commit(self, update_id: str, rollout_ids: Sequence[str]) -> list[LedgerEntry]:
        """Consume exactly the rollouts `update_id` reserved, atomically; else CommitMismatch."""
        check_update_id(update_id)

        def body(conn: Conn) -> list[LedgerEntry]:
            owned = self._locked(conn, "reserved_by = %s", (update_id,))
            new = commit_plan(update_id, rollout_ids, owned)
            changes: list[Change] = [
                ("commit", b, a, update_id) for b, a in zip(owned, new, strict=True)
            ]
            self._apply(conn, changes)
            self._finish(conn, changes, {"commits": 1})
            return new

        result: list[LedgerEntry] = self._write(body, "commit")
        return result

    def abort(self, update_id: str) -> list[LedgerEntry]:
        """Return every reservation of `update_id` under the recovery rule."""
        check_update_id(update_id)

        def body(conn: Conn) -> list[LedgerEntry]:
            lock(conn, K_BAD, shared=True)
            owned = self._locked(conn, "reserved_by = %s", (update_id,))
            bad = self._bad_versions(conn)
            new = [plan_release(e, "abort", self.recovery, bad) for e in owned]
            changes: list[Change] = [
                ("abort", b, a, update_id) for b, a in zip(owned, new, strict=True)
            ]
            self._apply(conn, changes)
            self._finish(conn, changes, {"aborts": 1})
            return new

        result: list[LedgerEntry] = self._write(body, "abort")
        return result

    def fail_update(self, update_id: str, cause: str, detail: str = "") -> list[LedgerEntry]:
        """The update itself failed with this data: its rollouts end in update_failed."""
        if not update_id or not cause:
            raise ValueError("update_id and cause must be non-empty strings")

        def body(conn: Conn) -> list[LedgerEntry]:
            owned = self._locked(conn, "reserved_by = %s", (update_id,))
            new = [
                plan_transition(
                    e,
                    "update_failed",
                    reserved_by=None,
                    lease_expires_at=None,
                    disposition=Disposition("update", cause, detail),
                )
                for e in owned
            ]
            changes: list[Change] = [
                ("update_failed", b, a, update_id) for b, a in zip(owned, new, strict=True)
            ]
            self._apply(conn, changes)
            self._finish(conn, changes, {})
            return new

        result: list[LedgerEntry] = self._write(body, "fail_update")
        return result

    def expire_leases(self) -> list[LedgerEntry]:
        """Return reservations whose lease ran out (a crashed learner never blocks forever)."""

        def body(conn: Conn) -> list[LedgerEntry]:
            lock(conn, K_BAD, shared=True)
            now = self._now(conn)
            due = self._locked(
                conn,
                "reserved_by IS NOT NULL AND lease_expires_at IS NOT NULL "
                "AND lease_expires_at <= %s",
                (now,),
            )
            bad = self._bad_versions(conn)
            new = [plan_release(e, "expire_lease", self.recovery, bad) for e in due]
            changes: list[Change] = [
                ("expire_lease", b, a, b.reserved_by) for b, a in zip(due, new, strict=True)
            ]
            self._apply(conn, changes)
            self._finish(conn, changes, {"expirations": len(new)})
            return new

        result: list[LedgerEntry] = self._write(body, "expire_leases")
        return result

    def renew_leases(self, update_id: str) -> list[LedgerEntry]:
        """Heartbeat of a long update: every rollout it holds gets a full lease from now
        (the server's clock), in one transaction."""
        check_update_id(update_id)

        def body(conn: Conn) -> list[LedgerEntry]:
            owned = self._locked(conn, "reserved_by = %s", (update_id,))
            new = renew_plan(owned, self._now(conn), self.lease_seconds)
            changes: list[Change] = [
                ("renew_lease", b, a, update_id) for b, a in zip(owned, new, strict=True)
            ]
            self._apply(conn, changes)
            self._finish(conn, changes, {})
            return new

        result: list[LedgerEntry] = self._write(body, "renew_leases")
        return result

    def quarantine_version(self, version: int, reason: str) -> list[LedgerEntry]:
        """Mark a version bad: quarantine its open rollouts now, reserved ones on return."""
        _check_version(version)

        def body(conn: Conn) -> list[LedgerEntry]:
            lock(conn, K_BAD)
            conn.execute(
                "INSERT INTO ledger_bad_versions(version, reason) VALUES (%s, %s) "
                "ON CONFLICT (version) DO NOTHING",
                (version, reason),
            )
            due = self._locked(
                conn, "behavior_version = %s AND state = ANY(%s::text[])", (version, _QUARANTINABLE)
            )
            d = Disposition("activation", "failed_version", reason)
            new = [plan_transition(e, "quarantine", disposition=d) for e in due]
            changes: list[Change] = [
                ("quarantine", b, a, None) for b, a in zip(due, new, strict=True)
            ]
            self._apply(conn, changes)
            self._finish(conn, changes, {})
            return new

        result: list[LedgerEntry] = self._write(body, "quarantine_version")
        return result

    def clear_bad_version(self, version: int) -> None:
        """Lift the mark: the version became active after a retry, its new rollouts are good.

        Rollouts already quarantined stay quarantined (terminal states absorb).
        """
        _check_version(version)

        def body(conn: Conn) -> None:
            lock(conn, K_BAD)
            conn.execute("DELETE FROM ledger_bad_versions WHERE version = %s", (version,))

        self._write(body, "clear_bad_version")

    @property
    def bad_versions(self) -> frozenset[int]:
        """Versions marked bad by quarantine_version, on this server (any process)."""
        found: frozenset[int] = self._read(
            lambda c: frozenset(self._bad_versions(c)), "bad_versions"
        )
        return found

    def reserved_by(self, update_id: str) -> list[str]:
        """Ids currently reserved by `update_id`, sorted."""

        def body(conn: Conn) -> list[str]:
            rows = conn.execute(
                "SELECT rollout_id FROM rollouts WHERE reserved_by = %s ORDER BY rollout_id",
                (update_id,),
            ).fetchall()
            return [str(r[0]) for r in rows]

        result: list[str] = self._read(body, "reserved_by")
        return result

    def snapshot(self) -> dict[str, LedgerEntry]:
        """A consistent copy of every entry (one statement sees one snapshot)."""

        def body(conn: Conn) -> dict[str, LedgerEntry]:
            rows = conn.execute(
                "SELECT rollout_id, entry FROM rollouts ORDER BY rollout_id"
            ).fetchall()
            return {str(rid): _load(text) for rid, text in rows}

        result: dict[str, LedgerEntry] = self._read(body, "snapshot")
        return result

    def history(self, rollout_id: str | None = None) -> list[EntryChanged]:
        """This database's ledger trace (shared `events` table), optionally for one rollout."""
        if rollout_id is not None:
            check_id(rollout_id)
        evs = self._read(lambda c: read_events(c, "entry", rollout_id), "history")
        return [e for e in evs if isinstance(e, EntryChanged)]

    def stored_rows(self) -> StoredRows:
        """Every table of the schema (ledger and registry), the events with their hash chain
        and its head, from one REPEATABLE READ snapshot: what `ledger check` audits."""
        found: StoredRows = self._read(read_stored, "reading every stored row", snapshot=True)
        return found

    def statistics(self) -> LedgerStatistics:
        """Counts by state and counters, from one REPEATABLE READ snapshot."""

        def body(conn: Conn) -> tuple[dict[str, int], dict[str, int], set[int], list[PacingRow]]:
            by_state = {
                str(s): int(n)
                for s, n in conn.execute(
                    "SELECT state, COUNT(*) FROM rollouts GROUP BY state"
                ).fetchall()
            }
            counters = {
                str(k): int(n)
                for k, n in conn.execute(
                    "SELECT name, SUM(n) FROM ledger_counters GROUP BY name"
                ).fetchall()
            }
            pacing = rows_from_columns(conn.execute(_PACING_COLUMNS).fetchall())
            return by_state, counters, self._bad_versions(conn), pacing

        by_state, counters, bad, pacing = self._read(body, "statistics", snapshot=True)
        with self._outcomes_lock:
            for k, v in self._outcomes.items():
                counters[k] = counters.get(k, 0) + v
        base = statistics_from((), counters, bad, pacing)
        states = {s: int(by_state.get(s, 0)) for s in base.by_state}
        return attrs.evolve(base, entries=sum(states.values()), by_state=states)

    def close(self) -> None:
        """Release this ledger's hold on the connection pool; later use raises. Idempotent."""
        if not self._closed:
            self._closed = True
            self.db.release()

    def __enter__(self) -> PostgresLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
