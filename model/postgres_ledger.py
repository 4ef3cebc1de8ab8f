"""The ledger on a PostgreSQL server, for learners and generators on many machines.

`PostgresStore` is the ledger's store (see `model.ledger.Store`): every step of
`StoreLedger` runs as one READ COMMITTED transaction of `PostgresDatabase.write`, and this
module only makes "check the revision and write" indivisible there. It writes nothing
itself: every write is one call of a server-side function named for the step's operation
(model.postgres_functions), which a login may run only in a role that may run that
operation (model.postgres_roles), with or without roles the same calls:

- A compare-and-set is ONE conditional statement, the one statement of `rl_write_rows`:
  ``UPDATE ... FROM unnest(...)`` (the columns as binary arrays: no JSON to quote or
  parse) with RETURNING the winners, for one row or a set. Under
  READ COMMITTED a racing UPDATE waits for the
  winner's COMMIT, re-checks the WHERE on the new row and matches nothing: the loser gets 0
  rows, never an error and never an overwrite. The set statement's CTE locks the matching
  rows in rollout_id order first, so two batches over overlapping rows can never deadlock.
- The reservation's premise (the active pointer and the ever-active versions, see
  `ActivationPremise`) is read INSIDE the reservation's transaction, after taking the
  premise lock in SHARED mode in the BEGIN round trip; a registry step that changes an
  artifact or the pointer takes it EXCLUSIVE before writing. So a pointer switch either
  committed before the reservation read the pointer (and the reservation is judged against
  the new one) or waits until the reservation committed, while reservations never block
  each other on it. (A row lock on the pointer row would do the same but needs the row to
  exist before the first activation, and FOR SHARE from many transactions costs a
  multixact each.)
- Steps that read a set of rows and write them (commit, abort, fail_update, expire_leases,
  quarantine_version) lock that set with ``SELECT ... ORDER BY rollout_id FOR UPDATE``
  (inside `rl_lock_rows`: FOR UPDATE needs the UPDATE right no role has);
  under READ COMMITTED the predicate is re-checked on rows that changed while waiting.
  The bad-version lock (shared for add/abort/expiry, exclusive for quarantine_version)
  keeps a rollout of a version being marked bad from slipping through open.
- A single reservation of an update already recorded is ONE round trip (`reserve_one`,
  the ledger's `OneCallStore`): one call of the write-one function in its one-call form
  (p_guard 3) takes the premise lock SHARED, judges the row and the premise as
  `plan_reserve` would, splices the entry and the event's payload the way the client's
  `SqlUnit` does (the lease the server's clock plus the lease's seconds), and writes only
  a certain win; anything else (a refusal, a lost compare-and-set, the update's first
  reservation, a row laid out otherwise) writes nothing and answers 'moved', and the
  reservation takes the path below, whose own read gives every refusal (issue 33).
- Otherwise a single reservation (`peek`, `write_one`: the ledger's `GuardedStore`) is two
  round trips. One autocommit read takes the row, the premise (of the row's version and the
  stamp's) and the server's time; the ledger
  plans, judges and enforces on them; then ONE call of the server-side function
  `ledger_write_one_v7` (created on open) takes the premise lock SHARED, checks that the
  premise is still the one the plan was judged on (an equality of the stored facts, no
  rule), compare-and-sets the row, appends its event and counters by the steps of the
  statement `append_events` sends (as plain statements, in the same order), and inserts
  the commit mark only when it wrote. A premise that
  moved sends the reservation through the step above; a row that moved is re-read.

Events and counters are written last, in one statement under the events lock (see
`postgres_common`; one call of `rl_append`), in the same transaction as the rows they
describe.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from rollout_lifecycle.model.errors import DuplicateRollout, LedgerError
from rollout_lifecycle.model.events import (
    Change,
    EntryChanged,
    StoredRows,
    TraceEvent,
    UpdateChange,
    entry_events,
    update_events,
)
from rollout_lifecycle.model.ledger import (
    NO_REGISTRY,
    ActivationPremise,
    Clock,
    Peeked,
    RecoveryRule,
    Step,
    StoreLedger,
    StoreView,
    Tallies,
    UnitOfWork,
    WriteOutcome,
    check_lease_seconds,
    load_entry,
    update_from_row,
)
from rollout_lifecycle.model.lineage_index import PG_LEDGER_DDL, PG_LEDGER_MIGRATION
from rollout_lifecycle.model.postgres_common import (
    K_BAD,
    K_DISPATCH,
    K_PREMISE,
    K_REWARDED,
    K_UPDATE,
    Conn,
    OneStatement,
    PostgresDatabase,
    append_events,
    has_table,
    lock_sql,
    read_events,
    read_stored,
)
from rollout_lifecycle.model.postgres_functions import (
    CAS_STEP,
    PREMISE,
    PREMISE_OF,
    WRITE_ONE_ARGS,
    WRITE_ONE_CALL,
    WRITE_ONE_DDL,
    ensure_functions,
    premise_sql,
    update_document,
)
from rollout_lifecycle.model.postgres_functions import WRITE_ONE as WRITE_ONE
from rollout_lifecycle.model.postgres_one_call import OneCallReservations
from rollout_lifecycle.model.postgres_one_call import counter_arrays as _counters
from rollout_lifecycle.model.records import (
    AdmissionPolicy,
    LedgerEntry,
    UpdateRecord,
)
from rollout_lifecycle.model.rules import retired_from_rows
from rollout_lifecycle.model.sql_unit import UPDATE_COLUMNS, SqlUnit, read_bad

T = TypeVar("T")

COMPONENT = "ledger"
SCHEMA_VERSION = 4
# 1 -> 2: entry events store only the fields that changed (model.events.CHANGED); nothing
# stored is rewritten, the bump makes an older program refuse the schema (as on SQLite)
# 2 -> 3: the ledger's update records (ledger_updates, created by the DDL; as on SQLite)
# 3 -> 4: the lineage index's marks (ledger_updates.claimed and its partial index, added by
#   the DDL; model.lineage_index), set where the registry already claims
MIGRATIONS = {1: "", 2: "", 3: PG_LEDGER_MIGRATION}

# The indexed columns copy LedgerEntry fields that queries filter on; `entry` holds the whole
# record. The CHECK repeats the exclusive-ownership invariant at the storage level.
_DDL = f"""
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
CREATE TABLE IF NOT EXISTS ledger_updates (
    update_id text PRIMARY KEY,
    status    text NOT NULL CHECK (status IN ('open', 'landed', 'poisoned')),
    cause     text,
    detail    text NOT NULL DEFAULT '',
    CHECK ((cause IS NULL) = (status <> 'poisoned'))
);
CREATE INDEX IF NOT EXISTS ledger_updates_status ON ledger_updates(status);
{PG_LEDGER_DDL}
CREATE TABLE IF NOT EXISTS ledger_counters (
    name  text NOT NULL,
    shard integer NOT NULL,
    n     bigint NOT NULL,
    PRIMARY KEY (name, shard)
);
"""

# The statements of every write live in the server-side functions (model.postgres_functions);
# this module calls them, one call per write, naming the step's operation. The plain
# compare-and-set of one row is kept for benchmarks/postgres_floor.py's baselines.
_CAS_ONE = (
    "UPDATE rollouts SET state = %s, revision = %s, reserved_by = %s, lease_expires_at = %s, "
    "entry = %s WHERE rollout_id = %s AND revision = %s RETURNING rollout_id"
)
_PREMISE = PREMISE
_NOW = "extract(epoch FROM clock_timestamp())::float8"
# the update's record as one JSON text (the table is the ledger's own: it always exists)
_UPDATE_TEXT = (
    "(SELECT json_build_array(update_id, status, cause, detail) FROM ledger_updates "
    "WHERE update_id = %s)::text"
)
# the premise of the versions a single reservation judges: its row's (read in this same
# statement) and those its caller names (its stamp's), in order, without NULLs
_PEEK = (
    "WITH asked AS (SELECT ARRAY(SELECT DISTINCT v FROM unnest(%s::bigint[] || (SELECT "
    "behavior_version FROM rollouts WHERE rollout_id = %s)) AS v WHERE v IS NOT NULL "
    "ORDER BY v) AS a) "
    f"SELECT {_NOW}, (SELECT entry FROM rollouts WHERE rollout_id = %s), {_UPDATE_TEXT}, "
    f"{premise_sql('(SELECT a FROM asked)::bigint[]')}"
)
_PEEK_BARE = (
    f"SELECT {_NOW}, (SELECT entry FROM rollouts WHERE rollout_id = %s), {_UPDATE_TEXT}, "
    "to_regclass('registry_pointer') IS NOT NULL"
)
# the single compare-and-set, its arguments and its call (see postgres_functions)
_CAS_STEP = CAS_STEP
_WRITE_ONE_ARGS = WRITE_ONE_ARGS
_WRITE_ONE_SIGNATURE = f"{WRITE_ONE}({', '.join(t for _, t in _WRITE_ONE_ARGS)})"
_WRITE_ONE_CALL = WRITE_ONE_CALL
_WRITE_ONE_DDL = WRITE_ONE_DDL  # the definition test builds edit (stateful_tests.mutants)
_WRITE_ROWS = (
    "SELECT * FROM rl_write_rows(%s, %b::text[], %b::bigint[], %b::text[], %b::bigint[], "
    "%b::text[], %b::float8[], %b::text[])"
)
_INSERT_ROWS = "SELECT * FROM rl_insert_rows(%s, %s::json)"
_LOCK_ROWS = "SELECT * FROM rl_lock_rows(%s, %s, %s, %s, %s::text[])"
_BAD_VERSION = "SELECT rl_bad_version(%s, %s, %s, %s)"


def _won(row: tuple[Any, ...] | None) -> WriteOutcome:
    assert row is not None and row[0] in ("won", "lost", "moved"), row
    out: WriteOutcome = row[0]
    return out


_LOCKS = {
    "premise": lock_sql(K_PREMISE, shared=True),
    "read": lock_sql(K_BAD, shared=True),
    "change": lock_sql(K_BAD),
    # adds share the dispatch lock, a dispatch holds it alone: it counts the live rollouts
    # and then writes, so no new live rollout may commit in between
    "add": lock_sql(K_DISPATCH, shared=True),
    "count": lock_sql(K_DISPATCH),
    # every step may move a row into 'rewarded' (a landing, a release); retire_stale's set
    # of rewarded rows must not gain one while it runs (postgres_common, K_REWARDED)
    "rewarded": lock_sql(K_REWARDED, shared=True),
    "retire": lock_sql(K_REWARDED),
}


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


_LAST_PREMISE: list[tuple[str, ActivationPremise]] = []  # the last one parsed, by its text


def _premise(text: str) -> ActivationPremise:
    """The premise from `_PREMISE`'s text. The premise changes only with a registry step,
    so the text is nearly always the last one: its (immutable) premise is reused."""
    last = _LAST_PREMISE[-1:]
    if last and last[0][0] == text:
        return last[0][1]
    found = _parse_premise(text)
    _LAST_PREMISE[:] = [(text, found)]
    return found


def _parse_premise(text: str) -> ActivationPremise:
    pointer, was, pol, rolled, *_ = json.loads(text)  # (and the versions asked, if any)
    was = was or ()
    return ActivationPremise(
        None if pointer is None else int(pointer),
        frozenset(int(v) for v, _ in was),
        None
        if pol is None
        else AdmissionPolicy(
            int(pol[0]),
            float(pol[1]),
            _opt_int(pol[2]),
            _opt_int(pol[3]),
            str(pol[4] or "ledger"),
            str(pol[5] or "identity"),
        ),
        retired_from_rows(rolled or ()),
        {int(v): str(h) for v, h in was if h is not None},
    )


def _update(text: str | None) -> UpdateRecord | None:
    """An update's record from `_UPDATE_TEXT` (None: not recorded)."""
    return None if text is None else update_from_row(json.loads(text))


@attrs.frozen
class _Seen:
    """What `peek` read: the premise's text (None: no registry) and the row's stored JSON."""

    premise: str | None
    entry: str | None


def _lock_updates(conn: Conn, update_ids: Sequence[str]) -> list[str]:
    """Take each update's lock exclusively, in id order (unnest keeps the sorted array's),
    so a reservation, a commit and a poisoning of one update land one after the other, in
    the events' order too (a single reservation's guarded write shares the lock). Returns
    the ids, sorted."""
    ids = sorted(set(update_ids))
    if ids:
        conn.execute(
            f"SELECT pg_advisory_xact_lock({K_UPDATE}, "
            "hashtext(current_schema() || '/' || u)) FROM unnest(%s::text[]) AS u",
            (ids,),
        )
    return ids


def _row_and_update(
    conn: Conn, rollout_id: str, update_id: str
) -> tuple[LedgerEntry | None, UpdateRecord | None]:
    """A row and an update's record from one statement (one snapshot)."""
    sql = f"SELECT (SELECT entry FROM rollouts WHERE rollout_id = %s), {_UPDATE_TEXT}"
    row = conn.execute(sql, (rollout_id, update_id)).fetchone()
    assert row is not None
    return (None if row[0] is None else load_entry(row[0])), _update(row[1])


def _updates(conn: Conn, only: Sequence[str] | None) -> dict[str, UpdateRecord]:
    """The ledger's update records (of `only`'s ids), by id."""
    sql = f"SELECT {UPDATE_COLUMNS} FROM ledger_updates"
    if only is None:
        rows = conn.execute(sql + " ORDER BY update_id").fetchall()
    else:
        rows = conn.execute(sql + " WHERE update_id = ANY(%s::text[])", (list(only),)).fetchall()
    return {str(r[0]): update_from_row(r) for r in rows}


def _rows(
    conn: Conn, rollout_ids: Sequence[str], load: Callable[[str], LedgerEntry] = load_entry
) -> dict[str, LedgerEntry]:
    rows = conn.execute(
        "SELECT rollout_id, entry FROM rollouts WHERE rollout_id = ANY(%s::text[])",
        (list(rollout_ids),),
    ).fetchall()
    return {str(rid): load(text) for rid, text in rows}


class _Unit(SqlUnit):
    """One step's access to the server, inside its transaction."""

    mark = "%s"
    row_locks = " FOR UPDATE"  # re-checked after any wait, under READ COMMITTED

    def __init__(self, store: PostgresStore, conn: Conn, op: str) -> None:
        super().__init__(conn)
        self.store = store
        self.op = op  # the operation this step's writes run for (model.postgres_roles)
        self.now: float | None = None  # the server's clock, once this step read it

    def field(self, *path: str, integer: bool = False) -> str:
        *into, last = path
        text = "(entry::jsonb)" + "".join(f"->'{p}'" for p in into) + f"->>'{last}'"
        return f"({text})::bigint" if integer else text

    def read_rows(self, rollout_ids: Sequence[str]) -> dict[str, LedgerEntry]:
        return _rows(self.conn, rollout_ids, self.load)

    def read_premise(self, versions: Collection[int] | None = None) -> ActivationPremise:
        """The premise (of `versions`, see `StoreView.read_premise`), with the server's time
        now in the same round trip (see module doc: the premise lock was taken in this
        transaction's first round trip)."""
        if not self.store.registry_seen:
            if not has_table(self.conn, "registry_pointer"):
                return NO_REGISTRY
            self.store.registry_seen = True  # a registry, once created, never goes away
        if versions is None:
            row = self.conn.execute(f"SELECT {_NOW}, {_PREMISE}").fetchone()
        else:
            only = sorted(versions)
            row = self.conn.execute(f"SELECT {_NOW}, {PREMISE_OF}", (only,) * 3).fetchone()
        assert row is not None
        self.now = float(row[0])
        return _premise(row[1])

    def read_updates(self, update_ids: Sequence[str]) -> dict[str, UpdateRecord]:
        """The records, each update's lock held first (see `_lock_updates`)."""
        return super().read_updates(_lock_updates(self.conn, update_ids))

    def server_now(self) -> float | None:
        if not self.store.server_clock:
            return None
        if self.now is None:
            row = self.conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8")
            found = row.fetchone()
            assert found is not None
            self.now = float(found[0])
        return self.now

    def insert(self, entries: Sequence[LedgerEntry]) -> None:
        doc = [
            {
                "rollout_id": e.rollout_id,
                "state": e.state,
                "revision": e.revision,
                "reserved_by": e.reserved_by,
                "lease": e.lease_expires_at,
                "version": e.behavior_version,
                "entry": self.dump(e),
            }
            for e in entries
        ]
        rows = self.conn.execute(_INSERT_ROWS, (self.op, json.dumps(doc))).fetchall()
        got = {str(r[0]) for r in rows}
        if len(got) != len(entries):
            dup = sorted({e.rollout_id for e in entries} - got) or sorted(
                k for k, n in Counter(e.rollout_id for e in entries).items() if n > 1
            )
            raise DuplicateRollout(
                f"rollout {dup[0]!r} is already in the ledger (or listed twice); nothing was added"
            )

    def write(self, pairs: Sequence[tuple[LedgerEntry, LedgerEntry]]) -> set[str]:
        """Compare-and-set every pair in ONE call (the function's one statement); the ids
        that won."""
        columns = (
            [a.rollout_id for _, a in pairs],
            [b.revision for b, _ in pairs],
            [a.state for _, a in pairs],
            [a.revision for _, a in pairs],
            [a.reserved_by for _, a in pairs],
            [a.lease_expires_at for _, a in pairs],
            [self.dump_after(b, a) for b, a in pairs],
        )
        return {str(r[0]) for r in self.conn.execute(_WRITE_ROWS, (self.op, *columns)).fetchall()}

    def append(
        self,
        changes: Sequence[Change],
        at: float,
        counts: Mapping[str, int],
        updates: Sequence[UpdateChange] = (),
    ) -> None:
        # the counters, and the update records the step leaves, ride in the events' call
        # (the counters alone, when nothing changed)
        events: list[TraceEvent] = [*entry_events(changes, at)] if changes else []
        if updates:
            events += update_events(updates, at)
        events += self.recorded_events(at)
        append_events(
            self.conn,
            events,
            op=self.op,
            counters=counts,
            payload_of=self.payload,
            stamped=False,
            updates=update_document(updates) if updates else None,
        )

    def locked(
        self, which: str, text: str | None, number: float | None, states: Sequence[str] = ()
    ) -> list[LedgerEntry]:
        """Locked by `rl_lock_rows` in rollout_id order (a login that may write no table
        may not lock its rows either: FOR UPDATE needs UPDATE rights)."""
        rows = self.conn.execute(_LOCK_ROWS, (self.op, which, text, number, list(states)))
        return [self.load(r[0]) for r in rows.fetchall()]

    def lock_rows(self, rollout_ids: Sequence[str]) -> dict[str, LedgerEntry]:
        got = self.locked("ids", json.dumps(list(rollout_ids)), None)
        return {e.rollout_id: e for e in got}

    def bad_version(self, version: int, reason: str, *, mark: bool) -> bool:
        """Through `rl_bad_version` (the tables are the functions' to write)."""
        row = self.conn.execute(_BAD_VERSION, (self.op, version, reason, mark)).fetchone()
        return bool(row and row[0])


class PostgresStore(OneCallReservations):
    """The ledger's tables on a PostgreSQL server; see the module doc."""

    def __init__(self, db: PostgresDatabase, *, server_clock: bool) -> None:
        self.db = db
        self.url = db.backend_url  # named in hints (see StoreLedger._located)
        self.server_clock = server_clock
        self.registry_seen = False
        self.closed = False

    def _check_open(self, *, write: bool = False) -> None:
        if self.closed:
            raise LedgerError(f"ledger on {self.db.where} is closed; open a new PostgresLedger")
        if write and self.db.read_only:
            raise LedgerError(f"ledger on {self.db.where} was opened read-only; nothing written")

    def atomic(self, body: Callable[[UnitOfWork], T] | OneStatement[T], step: Step) -> T:
        """One transaction; the step's advisory locks are taken right after BEGIN, in the
        same round trip and in the fixed order (dispatch budget, bad versions, premise).
        A `OneStatement` body is a server-side function that takes them itself."""
        self._check_open(write=True)
        if isinstance(body, OneStatement):  # it takes the step's locks itself
            return self.db.write(body, step.what)
        locks = [step.live, step.bad, "premise" if step.premise else None]
        locks.append("retire" if step.retires else "rewarded")
        prologue = "; ".join(_LOCKS[k] for k in locks if k is not None)
        return self.db.write(
            lambda conn: body(_Unit(self, conn, step.what)), step.what, prologue=prologue
        )

    def peek(
        self, rollout_id: str, update_id: str, versions: Collection[int] = ()
    ) -> tuple[LedgerEntry | None, UpdateRecord | None, Peeked]:
        """The row, the update's record and the premise of the row's version and
        `versions` (and the server's time) in ONE autocommit statement."""
        self._check_open(write=True)  # what a reservation peeks for is a write

        def body(conn: Conn) -> tuple[str | None, str | None, str | None, float]:
            if not self.registry_seen:
                row = conn.execute(_PEEK_BARE, (rollout_id, update_id)).fetchone()
                assert row is not None
                if not row[3]:
                    return row[1], row[2], None, float(row[0])
                self.registry_seen = True  # a registry, once created, never goes away
            args = (sorted(versions), rollout_id, rollout_id, update_id)
            row = conn.execute(_PEEK, args).fetchone()
            assert row is not None
            return row[1], row[2], row[3], float(row[0])

        text, update, premise, now = self._read(body, "reserve")
        seen = Peeked(
            NO_REGISTRY if premise is None else _premise(premise),
            now if self.server_clock else None,
            _Seen(premise, text),
        )
        return (None if text is None else load_entry(text)), _update(update), seen

    def find_with_update(
        self, rollout_id: str, update_id: str
    ) -> tuple[LedgerEntry | None, UpdateRecord | None]:
        return self._read(lambda c: _row_and_update(c, rollout_id, update_id), "find")

    def find_update(self, update_id: str) -> UpdateRecord | None:
        return self.all_updates([update_id]).get(update_id)

    def all_updates(self, only: Sequence[str] | None = None) -> dict[str, UpdateRecord]:
        return self._read(lambda c: _updates(c, only), "updates")

    def write_one(
        self,
        pair: tuple[LedgerEntry, LedgerEntry],
        changes: Sequence[Change],
        at: float,
        counts: Mapping[str, int],
        step: Step,
        seen: Peeked | None,
    ) -> WriteOutcome:
        """The premise lock and guard (`step.premise`), the compare-and-set, the event, the
        counters and the commit mark: ONE call of the server-side function, one round trip.
        One row's compare-and-set has exactly one change, the row's own."""
        before, after = pair
        events = entry_events(changes, at)
        if len(events) != 1 or events[0].rollout_id != after.rollout_id:
            raise LedgerError(f"{step.what}: a single write records one change, of its own row")
        unit = SqlUnit(None)  # its JSON and event payloads, without a unit of work
        token = seen.token if seen is not None else None
        if isinstance(token, _Seen) and token.entry is not None:
            unit.texts[id(before)] = (before, token.entry)
        guard, premise = 0, None
        if step.premise:
            if not isinstance(token, _Seen):
                raise LedgerError(f"{step.what}: a guarded write needs the premise it peeked")
            guard, premise = (1, None) if token.premise is None else (2, token.premise)
        entry = unit.dump_after(before, after)
        # a reservation writes only while its update is recorded and not poisoned
        owner = after.reserved_by if step.premise else None
        params = (
            step.what,
            guard,
            premise,
            after.state,
            after.revision,
            after.reserved_by,
            after.lease_expires_at,
            entry,
            after.rollout_id,
            before.revision,
            events[0].kind,
            unit.payload(events[0], None),
            *_counters(counts),
            owner,
        )
        return self.atomic(OneStatement(_WRITE_ONE_CALL, params, _won, "won"), step)

    def view(self, body: Callable[[StoreView], T], what: str) -> T:
        """One read-only REPEATABLE READ snapshot: the body's statements (the premise, then
        the rows) see one instant, so what it answers was true at that instant."""
        return self._read(lambda conn: body(_Unit(self, conn, what)), what, snapshot=True)

    def _read(self, body: Callable[[Conn], T], what: str, *, snapshot: bool = False) -> T:
        self._check_open()
        return self.db.read(body, what, snapshot=snapshot)

    def find(self, rollout_id: str) -> LedgerEntry | None:
        return self._read(lambda c: _rows(c, [rollout_id]).get(rollout_id), "find")

    def reserved_by(self, update_id: str) -> list[str]:
        sql = "SELECT rollout_id FROM rollouts WHERE reserved_by = %s ORDER BY rollout_id"
        rows = self._read(lambda c: c.execute(sql, (update_id,)).fetchall(), "reserved_by")
        return [str(r[0]) for r in rows]

    def snapshot(self) -> dict[str, LedgerEntry]:
        sql = "SELECT rollout_id, entry FROM rollouts ORDER BY rollout_id"
        rows = self._read(lambda c: c.execute(sql).fetchall(), "snapshot")
        return {str(rid): load_entry(text) for rid, text in rows}

    def in_state(self, state: str, limit: int | None) -> list[LedgerEntry]:
        sql = "SELECT entry FROM rollouts WHERE state = %s ORDER BY rollout_id LIMIT %s"
        rows = self._read(lambda c: c.execute(sql, (state, limit)).fetchall(), "in_state")
        return [load_entry(r[0]) for r in rows]

    def bad_versions(self) -> frozenset[int]:
        return self._read(read_bad, "bad_versions")

    def history(self, rollout_id: str | None) -> list[EntryChanged]:
        evs = self._read(lambda c: read_events(c, "entry", rollout_id), "history")
        return [e for e in evs if isinstance(e, EntryChanged)]

    def tallies(self) -> Tallies:
        def body(conn: Conn) -> Tallies:
            states = conn.execute("SELECT state, COUNT(*) FROM rollouts GROUP BY state")
            sums = conn.execute("SELECT name, SUM(n) FROM ledger_counters GROUP BY name")
            by_state = {str(s): int(n) for s, n in states.fetchall()}
            counters = {str(k): int(n) for k, n in sums.fetchall()}
            return by_state, counters, read_bad(conn), _Unit(self, conn, "statistics").pacing_rows()

        return self._read(body, "statistics", snapshot=True)

    def stored_rows(self) -> StoredRows:
        return self._read(read_stored, "reading every stored row", snapshot=True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.db.release()


class PostgresLedger(StoreLedger):
    """Durable ledger on a PostgreSQL server; any number of threads and processes share it.

    `url` is a postgresql:// URL (or a `PostgresDatabase` shared with a registry). The
    tables are created (or migrated) on first use; with `read_only` nothing is ever
    written, not even a table (the connections run with default_transaction_read_only).
    `schema` puts the tables in that schema (created on first use) instead of the
    connection's current one. Lease deadlines and expiry use the SERVER's clock, read
    inside the writing transaction, unless a test injects `clock`; `clock` then only
    dates events.
    """

    store: PostgresStore

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
        if isinstance(url, PostgresDatabase):
            db = url.acquire()
        else:
            db = PostgresDatabase(
                url,
                schema=schema,
                read_only=read_only,
                pool_size=pool_size,
                retry_seconds=retry_seconds,
            ).acquire()
        store = PostgresStore(db, server_clock=clock is None)
        super().__init__(
            store, clock=clock or time.time, lease_seconds=lease_seconds, recovery=recovery
        )
        try:
            if db.read_only:
                if db.check_readable(COMPONENT, SCHEMA_VERSION) is None:
                    raise LedgerError(
                        f"{db.where} holds no rollout-lifecycle ledger (reading never "
                        "creates one; check the URL's database and schema)"
                    )
            else:
                db.ensure_schema(COMPONENT, SCHEMA_VERSION, _DDL, migrations=MIGRATIONS)
                ensure_functions(db)
        except BaseException:
            self.close()
            raise

    @property
    def db(self) -> PostgresDatabase:
        """The database (and its pool) this ledger uses, possibly shared with a registry."""
        return self.store.db

    @property
    def read_only(self) -> bool:
        """Whether nothing may be written through this ledger."""
        return self.store.db.read_only

    @property
    def where(self) -> str:
        """host:port/dbname of the server, for messages."""
        return self.store.db.where

    def stored_rows(self) -> StoredRows:
        """Every table of the schema (ledger and registry), the events with their hash chain
        and its head, from one REPEATABLE READ snapshot: what `ledger check` audits."""
        return self.store.stored_rows()
