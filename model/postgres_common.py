"""What the PostgreSQL ledger and registry share: connections, locks, schema versions, events.

Ledger and registry live in one database (one schema of it) so that their events share one
global order, as on SQLite. A `PostgresDatabase` owns a psycopg 3 connection pool (one per
process: a forked child never touches its parent's sockets) and runs every step as a
function of one connection, inside one transaction, under READ COMMITTED.

Locks (transaction-scoped advisory locks, keyed per schema, always taken in this order, so no
two steps can wait on each other in a cycle):

    K_SCHEMA    DDL on first use (creating tables while another process does the same)
    K_DISPATCH  shared: add / add_many insert live rollouts; exclusive: a dispatch counts the
                live rollouts of its window and then inserts one, so no add lands between
    K_BAD       shared: add / abort / expire_leases read the bad versions they act on;
                exclusive: quarantine_version / clear_bad_version change them
    K_REGISTRY  exclusive: every registry step (its plan reads a registry nobody else changes)
    K_PREMISE   shared: a reservation reads the active pointer and ever-active versions;
                exclusive: a registry step that changes an artifact or the pointer
    K_REWARDED  exclusive: retire_stale, which retires EVERY rewarded rollout too old for
                the pointer, so none may become rewarded between its read and its commit
                (a row entering its set is a phantom its row locks cannot see); shared: every
                other ledger step, and a single write that moves a row into 'rewarded'
    (rows)      rollout rows, always locked in rollout_id order
    K_EVENTS    exclusive, the LAST lock of every writing step: events get their txn and seq
                numbers under it and it is held to COMMIT, so seq order is commit order. A
                reader that has seen seq n has seen every step that committed before it,
                and the trace replays in the order the steps really happened.

A lost connection is retried while nothing can have been committed (the server rolled the
open transaction back). One lost during COMMIT is resolved on a new connection once the
server answers again, by a mark: every transaction that wrote something inserts a random
token into `commit_marks` in its COMMIT round trip (through `rl_mark`: with roles no login
may write a table), so the token is there exactly when its
writes landed (one that wrote nothing leaves no mark, and running it again is harmless).
The transaction id cannot decide it: a server that restarts before the transaction's WAL
reached the kernel hands the same id to a later transaction, and `pg_xact_status` then
reports that one's fate. The mark is read once the transaction cannot be running any more:
the server restarted, or the session that ran it (pid and start time, from
`pg_stat_activity`) has ended or sits idle. So a restarted server never makes a
client repeat a step that landed, nor report as landed one that did not.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import attrs
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool, PoolTimeout

from rollout_lifecycle.model.backends import redact_url as redact
from rollout_lifecycle.model.errors import (
    BackendUnavailable,
    BackendURLError,
    LedgerError,
    RoleRefused,
    RolloutLifecycleError,
    StorageFull,
    newer_schema,
    schema_steps,
    tampered,
)
from rollout_lifecycle.model.events import (
    RECORDED_TABLES,
    SEAL,
    ChainHead,
    EntryStates,
    Payload,
    StoredEvent,
    StoredRows,
    TraceEvent,
    chain_evidence,
    event_subject,
    events_where,
    recorded_rows,
    row_event,
    stored_payload,
)
from rollout_lifecycle.model.postgres_roles import refused

T = TypeVar("T")
Conn = psycopg.Connection[Any]

SCHEMES = ("postgresql", "postgres")
MIN_SERVER = 130000  # pg_current_xact_id_if_assigned (commit marks) arrived in PostgreSQL 13

# advisory lock class ids ("RL" + purpose); the second key is hashtext(current_schema())
_BASE = 0x524C0000
K_SCHEMA = _BASE + 1
K_BAD = _BASE + 2
K_REGISTRY = _BASE + 3
K_PREMISE = _BASE + 4
K_EVENTS = _BASE + 5
K_DISPATCH = _BASE + 6  # a dispatch exclusively (counts, then writes); adds shared
# one update's record: a ledger step reading it holds it exclusively, a single reservation's
# guarded write shares it (its second key hashes the schema and the update id)
K_UPDATE = _BASE + 7
K_REWARDED = _BASE + 8  # see the module doc: retire_stale's set stays its set until COMMIT

COUNTER_SHARDS = 16  # counter rows per name, so racing connections rarely share one row

_META_DDL = """
CREATE TABLE IF NOT EXISTS schema_meta (
    component text PRIMARY KEY,
    version   integer NOT NULL
);
CREATE SEQUENCE IF NOT EXISTS events_seq;
CREATE SEQUENCE IF NOT EXISTS events_txn;
CREATE TABLE IF NOT EXISTS events (
    seq     bigint PRIMARY KEY,
    txn     bigint NOT NULL,
    kind    text NOT NULL,
    subject text NOT NULL,
    payload text NOT NULL
);
CREATE INDEX IF NOT EXISTS events_subject ON events(kind, subject);
CREATE INDEX IF NOT EXISTS events_txn_idx ON events(txn);
"""
# every writing step's COMMIT inserts here (see the module doc); created with the schema,
# and added to a database whose schema predates it
_MARKS_DDL = """
CREATE TABLE IF NOT EXISTS commit_marks (
    token text PRIMARY KEY,
    at    timestamptz NOT NULL DEFAULT now()
);
"""

ZERO_HASH = "decode(repeat('00', 32), 'hex')"  # the chain's start (model.events)
# The function every append chains onto: under the events lock, the head's hash, after
# checking that the head exists and names the newest stored event (model.events.
# chain_broken, restated in SQL); else it raises TAMPERED, which becomes HistoryTampered.
# VOLATILE, so each of its reads sees every append committed before it ran (a statement's
# own snapshot, taken before it waited for the lock, would not).
CHAIN_PREV = "events_chain_prev"
TAMPERED = "RLH01"  # the SQLSTATE of a refused append (class RL: this project's own)
# CHAIN_PREV as the tables' owner (model.postgres_functions creates it, every login may call
# it): a deployment role may not lock the head row itself
CHAIN_CHECK = "rl_check_chain"

# The hash chain (see model.events): two columns on events, the head, and the function that
# links one step's events in one pass (plpgsql, so the append stays ONE statement). Added to
# a database whose events predate it; those stay an unchained prefix, counted in the head.
_CHAIN_DDL = (
    """
ALTER TABLE events ADD COLUMN IF NOT EXISTS prev_hash bytea,
    ADD COLUMN IF NOT EXISTS hash bytea;
CREATE TABLE IF NOT EXISTS events_chain (
    id         integer PRIMARY KEY CHECK (id = 1),
    base_seq   bigint NOT NULL,
    base_count bigint NOT NULL,
    last_seq   bigint NOT NULL,
    last_hash  bytea NOT NULL
);
INSERT INTO events_chain(id, base_seq, base_count, last_seq, last_hash)
SELECT 1, COALESCE(MAX(seq), 0), COUNT(*), COALESCE(MAX(seq), 0), decode(repeat('00', 32), 'hex')
FROM events
ON CONFLICT (id) DO NOTHING;
CREATE OR REPLACE FUNCTION events_chain_link(head bytea, msgs bytea[])
RETURNS TABLE (ord bigint, prev_hash bytea, hash bytea)
LANGUAGE plpgsql IMMUTABLE STRICT AS $$
DECLARE
    m bytea;
    h bytea := head;
    i bigint := 0;
BEGIN
    FOREACH m IN ARRAY msgs LOOP
        i := i + 1;
        ord := i;
        prev_hash := h;
        h := sha256(h || m);
        hash := h;
        RETURN NEXT;
    END LOOP;
END
$$;
"""
    + f"""
CREATE OR REPLACE FUNCTION {CHAIN_PREV}()
RETURNS bytea LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    h bytea;
    b bigint;
    t bytea;
    s bigint;
BEGIN
    SELECT last_hash, base_seq INTO h, b FROM events_chain WHERE id = 1 FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = '{TAMPERED}', MESSAGE =
            'has no head (its events_chain row is missing: deleted, or the table dropped)';
    END IF;
    SELECT e.hash, e.seq INTO t, s FROM events e ORDER BY e.seq DESC LIMIT 1;
    IF s IS NULL THEN
        IF h = {ZERO_HASH} THEN
            RETURN h;
        END IF;
        RAISE EXCEPTION USING ERRCODE = '{TAMPERED}', MESSAGE =
            'names a last event, but no event is stored (the history was deleted)';
    END IF;
    IF t = h OR (h = {ZERO_HASH} AND t IS NULL AND s <= b) THEN
        RETURN h;
    END IF;
    IF t IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '{TAMPERED}', MESSAGE = format(
            'ends in event #%s, which carries no hash (hashes stripped, or added by hand)', s);
    END IF;
    RAISE EXCEPTION USING ERRCODE = '{TAMPERED}', MESSAGE = format(
        'does not end in the event its head names (event #%s is stored last): events were '
        'cut off, replaced or added by hand', s);
END
$$;
"""
)

MARKS_KEPT = "1 day"  # a mark only matters while its writer may still be resolving it
_PRUNE_EVERY = 1000  # each object prunes old marks once per this many commits
_PRUNE_MARKS = f"DELETE FROM commit_marks WHERE at < now() - interval '{MARKS_KEPT}'; "
_PRUNE_CALL = "SELECT rl_prune_marks(); "  # the same, by the function every role may call

# connection failures that leave nothing committed (or in doubt only during COMMIT)
_LOST_STATES = {"57P01", "57P02", "57P03", "08000", "08003", "08006", "08001", "08004"}
_RETRY_STATES = {"40001", "40P01"}  # serialization failure, deadlock: rolled back, run again
_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


# ---- URLs and errors ----------------------------------------------------------------------


def is_postgres_url(url: str) -> bool:
    """Whether `url` names a PostgreSQL server (postgresql:// or postgres://)."""
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme in SCHEMES


def url_params(url: str) -> dict[str, Any]:
    """libpq's parameters of a postgresql:// URL; BackendURLError when it is not one."""
    if not is_postgres_url(url):
        raise BackendURLError(
            "a PostgreSQL URL starts with postgresql:// (or postgres://), e.g. "
            "postgresql://user:password@host:5432/dbname"
        )
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    try:
        params = conninfo_to_dict(url)
    except psycopg.Error as exc:
        raise BackendURLError(
            f"not a valid PostgreSQL URL ({str(exc).strip()}); use "
            "postgresql://user:password@host:5432/dbname"
        ) from None
    return dict(params)


def describe(params: Mapping[str, Any]) -> str:
    """host:port/dbname of a connection, for messages (never the password)."""
    host = params.get("host") or os.environ.get("PGHOST") or "localhost"
    port = params.get("port") or os.environ.get("PGPORT") or "5432"
    db = params.get("dbname") or os.environ.get("PGDATABASE") or params.get("user") or "?"
    return f"PostgreSQL at {host}:{port}/{db}"


def connect_error(exc: psycopg.Error, where: str, params: Mapping[str, Any]) -> Exception:
    """A typed error with what to do, for a failed connection attempt."""
    text = str(exc).replace("connection failed: ", "").strip()
    low = text.lower()
    user = params.get("user") or os.environ.get("PGUSER") or "(default user)"
    if "password authentication failed" in low or "no password supplied" in low:
        return BackendURLError(
            f"{where} refused the credentials of role {user!r} (wrong or missing password): "
            "check user and password in the URL, PGPASSWORD or ~/.pgpass"
        )
    if re.search(r'role ".*" does not exist', low):
        return BackendURLError(
            f"{where} has no role {user!r}: check the user name in the URL, or create the "
            "role (createuser)"
        )
    if re.search(r'database ".*" does not exist', low):
        db = params.get("dbname", "?")
        return BackendURLError(
            f"{where}: database {db!r} does not exist; create it (createdb {db}) or name an "
            "existing one in the URL"
        )
    if "pg_hba.conf" in low:
        return BackendURLError(
            f"{where} does not accept this client ({text.splitlines()[-1]}): allow it in "
            "pg_hba.conf or connect as a role that is allowed"
        )
    first = text.splitlines()[0] if text else type(exc).__name__
    return BackendUnavailable(
        f"cannot reach {where} ({first}): is the server running, and are host and port in "
        "the URL right?"
    )


def _is_lost(exc: BaseException, conn: Conn) -> bool:
    """Whether `exc` means the connection itself is gone (not a statement's error)."""
    if not isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return False
    return _state(exc) in _LOST_STATES or conn.closed or conn.broken


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _ConnectionBroke(BackendUnavailable):
    """The connection broke under a step (the server restarted, the network dropped)."""


def _primary(exc: BaseException) -> str:
    """The server's primary message of an error (what a RAISE said)."""
    diag = getattr(exc, "diag", None)
    text = getattr(diag, "message_primary", None)
    return str(text) if text else _first_line(exc)


def _state(exc: BaseException) -> str | None:
    state = getattr(exc, "sqlstate", None)
    return state if isinstance(state, str) else None


def quote_ident(name: str) -> sql.Identifier:
    """A schema name as an SQL identifier; only plain names are accepted."""
    if not _SCHEMA_NAME.match(name):
        raise BackendURLError(
            f"schema name {name!r} must be letters, digits and underscores (at most 63), "
            "starting with a letter or underscore"
        )
    return sql.Identifier(name)


# ---- the database --------------------------------------------------------------------------


@attrs.frozen
class Backend:
    """One server session: its pid, when it started, and when the server itself started
    (a restart ends every session, and pids are reused)."""

    pid: int
    started: str
    server_started: str


def new_token() -> str:
    """A random commit-mark token (32 hex digits)."""
    return os.urandom(16).hex()


@attrs.define
class _Attempt:
    """What a write attempt knew when its connection broke."""

    backend: Backend | None = None  # the server session that ran it
    token: str = attrs.field(factory=new_token)
    committing: bool = False
    result: Any = None
    ddl: bool = False  # a schema step: its mark is written directly, not by `rl_mark`


@attrs.frozen
class OneStatement(Generic[T]):
    """A writing step that is ONE autocommit statement (a server-side function that takes
    its own locks and inserts the commit mark itself, given as its LAST parameter, only if
    it wrote): one round trip, and no BEGIN or COMMIT of its own. `params` are the other
    positional parameters, in order; `read` turns its row into the step's result; `landed`
    is the result when it wrote, which is what a lost answer whose mark is found returns
    (only a statement that wrote inserts the mark)."""

    sql: str
    params: Sequence[Any]
    read: Callable[[tuple[Any, ...] | None], T]
    landed: T

    def __call__(self, conn: Conn) -> T:
        """The same statement inside a transaction already open (its mark a fresh token)."""
        return self.read(conn.execute(self.sql, (*self.params, new_token())).fetchone())


class _Checkout:
    """`with` a connection taken from `pool`: on the way out an error rolls back what is
    still open (as the pool's own context manager does) and the connection goes back to the
    pool, which replaces it if it broke. Without a generator and without the pool's commit
    of an autocommit connection: a single reservation takes two of these."""

    __slots__ = ("conn", "pool")

    def __init__(self, pool: ConnectionPool[Conn], conn: Conn) -> None:
        self.pool, self.conn = pool, conn

    def __enter__(self) -> Conn:
        return self.conn

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        conn = self.conn
        if kind is not None and not conn.closed:
            with contextlib.suppress(Exception):  # broken: the pool replaces it
                conn.rollback()
        self.pool.putconn(conn)


class PostgresDatabase:
    """One database (one schema in it) shared by a ledger and a registry.

    `acquire`/`release` count its users; the last release closes the pool. Every step is
    `write(body)` or `read(body)`: `body(conn)` runs inside one transaction.
    """

    def __init__(
        self,
        url: str,
        *,
        schema: str | None = None,
        read_only: bool = False,
        pool_size: int = 10,
        retry_seconds: float = 30.0,
        connect_timeout: float = 10.0,
    ) -> None:
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
            raise ValueError(f"pool_size must be an int >= 1, got {pool_size!r}")
        if retry_seconds < 0:
            raise ValueError("retry_seconds must be >= 0")
        self.url = redact(url)
        self._schema_option = schema
        self.params = url_params(url)
        self.where = describe(self.params)
        self.read_only = read_only
        self.pool_size = pool_size
        self.retry_seconds = float(retry_seconds)
        self._commits = 0  # write transactions sent to COMMIT by this object (for pruning)
        self._sessions: weakref.WeakKeyDictionary[Conn, Backend] = weakref.WeakKeyDictionary()
        options = str(self.params.get("options", "") or "")
        extra = []
        if schema is not None:
            quote_ident(schema)
            extra.append(f"-c search_path={schema}")
        if read_only:
            extra.append("-c default_transaction_read_only=on")
        merged = " ".join([options, *extra]).strip()
        kwargs: dict[str, Any] = {"application_name": "rollout-lifecycle"}
        if merged:
            kwargs["options"] = merged
        if "connect_timeout" not in self.params:
            kwargs["connect_timeout"] = max(1, int(connect_timeout))
        url_clean = url if not url.startswith("postgres://") else "postgresql" + url[8:]
        self.conninfo = make_conninfo(url_clean, **kwargs)
        self._lock = threading.Lock()
        self._pool: ConnectionPool[Conn] | None = None
        self._pool_pid = -1
        self._inherited: list[ConnectionPool[Conn]] = []
        self._users = 0
        self._closed = False
        # how often this handle lost a connection and ran a step again, and how often it
        # learned the fate of a COMMIT that got no answer (introspection for tests and ops)
        self.retries = 0
        self.in_doubt_resolved = 0
        self.schema = self._first_contact(create=not read_only)

    @property
    def backend_url(self) -> str:
        """This database as a backend URL an operator can pass to `--backend` (password
        masked; a schema given apart from the URL is folded into its options)."""
        if self._schema_option is None:
            return self.url
        sep = "&" if "?" in self.url else "?"
        return f"{self.url}{sep}options=-csearch_path%3D{self._schema_option}"

    # ---- connections -----------------------------------------------------------------------

    def _connect(self) -> Conn:
        try:
            return psycopg.connect(self.conninfo, autocommit=True)
        except psycopg.Error as exc:
            raise connect_error(exc, self.where, self.params) from None

    def _first_contact(self, *, create: bool) -> str | None:
        """Connect once directly (clear errors), check the server, create the schema."""
        conn = self._connect()
        try:
            if conn.info.server_version < MIN_SERVER:
                raise LedgerError(
                    f"{self.where} runs PostgreSQL {conn.info.server_version // 10000}; "
                    "PostgreSQL 13 or newer is needed"
                )
            row = conn.execute("SELECT current_schema()").fetchone()
            current = None if row is None else row[0]
            if current is not None or not create:
                return None if current is None else str(current)
            target = self._wanted_schema(conn)
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s, 0)", (K_SCHEMA,))
                conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(quote_ident(target)))
            return target
        except psycopg.errors.InsufficientPrivilege as exc:
            raise LedgerError(
                f"{self.where}: permission denied ({exc}); grant the role CREATE on the "
                "database, or name a schema it owns (options=-csearch_path=...)"
            ) from None
        except psycopg.Error as exc:
            raise connect_error(exc, self.where, self.params) from None
        finally:
            conn.close()

    @staticmethod
    def _wanted_schema(conn: Conn) -> str:
        row = conn.execute("SHOW search_path").fetchone()
        path = "" if row is None else str(row[0])
        first = path.split(",")[0].strip().strip('"') if path else "public"
        if first == "$user":
            user = conn.execute("SELECT current_user").fetchone()
            first = "public" if user is None else str(user[0])
        return first or "public"

    def _get_pool(self) -> ConnectionPool[Conn]:
        with self._lock:
            if self._closed:
                raise LedgerError(f"{self.where}: this ledger/registry was closed; open it again")
            pid = os.getpid()
            if self._pool is None or self._pool_pid != pid:
                if self._pool is not None:
                    # a forked child: its parent's sockets must never be used or closed here
                    self._inherited.append(self._pool)
                pool: ConnectionPool[Conn] = ConnectionPool(
                    self.conninfo,
                    min_size=1,
                    max_size=self.pool_size,
                    kwargs={"autocommit": True},
                    open=False,
                    timeout=max(self.retry_seconds, 1.0),
                    name=f"rollout-lifecycle-{pid}",
                )
                pool.open(wait=False)
                self._pool, self._pool_pid = pool, pid
            return self._pool

    def _checkout(self) -> _Checkout:
        """A pooled connection for one step, given back when the `with` block ends."""
        pool = self._get_pool()
        try:
            conn = pool.getconn()
        except PoolTimeout:
            raise self._unreachable() from None
        return _Checkout(pool, conn)

    def _unreachable(self) -> Exception:
        """Why no connection came: probe directly so the message names the real cause."""
        try:
            self._connect().close()
        except RolloutLifecycleError as exc:
            return exc
        return BackendUnavailable(
            f"no connection to {self.where} within {self.retry_seconds:.0f}s: every pooled "
            f"connection ({self.pool_size}) stayed busy; raise pool_size or use fewer threads"
        )

    def _purge(self) -> None:
        """After a lost connection, test the idle ones at once (a restart breaks them all)."""
        pool = self._pool
        if pool is not None and self._pool_pid == os.getpid():
            with contextlib.suppress(Exception):
                pool.check()

    # ---- running steps -------------------------------------------------------------------

    def write(
        self,
        body: Callable[[Conn], T],
        what: str = "a write",
        *,
        error: type[RolloutLifecycleError] = LedgerError,
        prologue: str = "",
        ddl: bool = False,
    ) -> T:
        """Run `body` in one READ COMMITTED transaction and commit it; see the module doc.

        `prologue` (SQL without parameters, e.g. taking a lock) runs right after BEGIN in the
        same round trip. Exceptions raised by `body` itself roll the transaction back and
        propagate as they are; database errors become `error` (or BackendUnavailable) with
        what to do. A step of the protocol leaves its commit mark through `rl_mark` (its
        login may write no table); `ddl` (creating or migrating the schema, whose login
        owns it) writes the mark itself, before any function exists.
        """
        if self.read_only:
            raise error(f"{self.where} was opened read-only; nothing was written ({what})")
        deadline = time.monotonic() + self.retry_seconds
        delay = 0.05
        while True:
            attempt = _Attempt()
            try:
                attempt.ddl = ddl
                return self._write_once(body, attempt, prologue)
            except _ConnectionBroke as exc:
                if attempt.committing:
                    status = self._resolve(attempt, deadline, what)
                    with self._lock:
                        self.in_doubt_resolved += 1
                    if status == "committed":
                        return attempt.result  # type: ignore[no-any-return]
                    # aborted: the server rolled it back, so running it again is safe
                self._purge()
                failure: Exception = BackendUnavailable(
                    f"lost the connection to {self.where} during {what} and could not get it "
                    f"back within {self.retry_seconds:.0f}s ({exc}); nothing was written. "
                    "Check the server, then retry"
                )
            except psycopg.Error as exc:
                if _state(exc) not in _RETRY_STATES:
                    raise self._translate(exc, what, error) from None
                # a deadlock or serialization failure rolled it all back: run it again
                failure = error(
                    f"{self.where}: {what} kept failing ({str(exc).splitlines()[0]}); "
                    "nothing was written, retry later"
                )
            if time.monotonic() + delay > deadline:
                raise failure from None
            with self._lock:
                self.retries += 1
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _write_once(self, body: Callable[[Conn], T], attempt: _Attempt, prologue: str = "") -> T:
        with self._checkout() as conn:
            try:
                attempt.backend = self._session(conn)
                if isinstance(body, OneStatement):
                    if prologue:
                        raise LedgerError(f"{self.where}: a one-statement step takes its own locks")
                    done: T = self._one_statement(conn, body, attempt)
                    return done
                # one round trip: BEGIN and the prologue; each statement its own snapshot
                conn.execute(f"BEGIN; {prologue}" if prologue else "BEGIN")
                result = body(conn)
                attempt.result = result
                with self._lock:
                    self._commits += 1
                    prune = self._commits % _PRUNE_EVERY == 0
                # the mark rides in the COMMIT round trip (a hex token: safe as a literal),
                # and only a transaction that wrote something has an id and gets one: a step
                # that wrote nothing (a lost compare-and-set) leaves nothing behind at all
                if attempt.ddl:
                    ending = (
                        f"INSERT INTO commit_marks(token) SELECT '{attempt.token}' "
                        "WHERE pg_current_xact_id_if_assigned() IS NOT NULL; "
                    )
                    ending += _PRUNE_MARKS if prune else ""
                else:
                    ending = f"SELECT rl_mark('{attempt.token}'); "
                    ending += _PRUNE_CALL if prune else ""
                attempt.committing = True
                conn.execute(ending + "COMMIT")
                return result
            except BaseException as exc:
                if not conn.closed and not conn.broken:
                    with contextlib.suppress(psycopg.Error):
                        conn.execute("ROLLBACK")
                if isinstance(exc, psycopg.Error) and _is_lost(exc, conn):
                    raise _ConnectionBroke(_first_line(exc)) from exc
                raise

    def _one_statement(self, conn: Conn, step: OneStatement[T], attempt: _Attempt) -> T:
        """`step` as one autocommit statement carrying the attempt's mark token: it commits
        as it ends, so from the moment it is sent a lost answer is resolved by the mark."""
        with self._lock:
            self._commits += 1
            prune = self._commits % _PRUNE_EVERY == 0
        if prune:  # before the step, so that its failure can never follow a commit
            conn.execute(_PRUNE_CALL)
        attempt.result = step.landed
        attempt.committing = True
        row = conn.execute(step.sql, (*step.params, attempt.token)).fetchone()
        return step.read(row)

    def _session(self, conn: Conn) -> Backend:
        """Who this connection is on the server; asked once per connection, then cached."""
        known = self._sessions.get(conn)
        if known is None:
            row = conn.execute(
                "SELECT pg_backend_pid(), backend_start::text, pg_postmaster_start_time()::text "
                "FROM pg_stat_activity WHERE pid = pg_backend_pid()"
            ).fetchone()
            if row is None:  # pragma: no cover - a session always sees itself
                raise LedgerError(f"{self.where}: the server does not list this session")
            known = Backend(int(row[0]), str(row[1]), str(row[2]))
            with self._lock:
                self._sessions[conn] = known
        return known

    def _fate(self, attempt: _Attempt) -> str:
        """'committed' or 'aborted' when known now, else 'in progress'.

        The mark decides once the transaction can no longer be running: the server
        restarted since (every session ended), or its session is gone. A transaction that
        committed without a mark wrote nothing, so running its step again is harmless."""
        ran = attempt.backend
        conn = psycopg.connect(self.conninfo, autocommit=True)
        try:
            marked = "EXISTS (SELECT 1 FROM commit_marks WHERE token = %s)"
            row = conn.execute(
                f"SELECT {marked}, pg_postmaster_start_time()::text", (attempt.token,)
            ).fetchone()
            if row is None:
                return "in progress"
            if row[0]:
                return "committed"
            if ran is None or row[1] != ran.server_started:
                return "aborted"  # the server restarted: the transaction is gone, unmarked
            alive = conn.execute(
                "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND backend_start::text = %s "
                "AND state IS DISTINCT FROM 'idle'",
                (ran.pid, ran.started),
            ).fetchone()
            if alive is not None:
                return "in progress"  # its session may still commit or roll back
            # its session ended, or sits idle outside any transaction: the mark decides
            again = conn.execute(f"SELECT {marked}", (attempt.token,)).fetchone()
            return "committed" if again is not None and again[0] else "aborted"
        finally:
            conn.close()

    def _resolve(self, attempt: _Attempt, deadline: float, what: str) -> str:
        """The fate of a transaction whose COMMIT got no answer: committed or aborted."""
        if attempt.backend is None:
            return "aborted"
        delay = 0.05
        last = ""
        while True:
            try:
                status = self._fate(attempt)
                if status in ("committed", "aborted"):
                    return status
                pid = attempt.backend.pid
                last = f"its server session (pid {pid}) is still inside the transaction"
            except psycopg.Error as exc:
                last = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if time.monotonic() + delay > deadline:
                raise BackendUnavailable(
                    f"lost the connection to {self.where} while committing {what}, and could "
                    f"not learn whether it landed ({last}); re-read before retrying (a repeated "
                    "reserve by the same update is an idempotent retry)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def read(self, body: Callable[[Conn], T], what: str = "a read", *, snapshot: bool = False) -> T:
        """Run `body` on one connection (one REPEATABLE READ snapshot with `snapshot`);
        a lost connection is retried (reading twice is harmless)."""
        deadline = time.monotonic() + self.retry_seconds
        delay = 0.05
        while True:
            try:
                return self._read_once(body, snapshot)
            except _ConnectionBroke as exc:
                self._purge()
                failure: Exception = BackendUnavailable(
                    f"lost the connection to {self.where} during {what} and could not get it "
                    f"back within {self.retry_seconds:.0f}s ({exc}); check the server, then retry"
                )
            except psycopg.Error as exc:
                if _state(exc) not in _RETRY_STATES:
                    raise self._translate(exc, what, LedgerError) from None
                failure = LedgerError(f"{self.where}: {what} kept failing ({_first_line(exc)})")
            if time.monotonic() + delay > deadline:
                raise failure from None
            with self._lock:
                self.retries += 1
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _read_once(self, body: Callable[[Conn], T], snapshot: bool) -> T:
        with self._checkout() as conn:
            try:
                if not snapshot:
                    return body(conn)
                conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                try:
                    return body(conn)
                finally:
                    if not conn.closed and not conn.broken:
                        conn.execute("COMMIT")
            except psycopg.Error as exc:
                if _is_lost(exc, conn):
                    raise _ConnectionBroke(_first_line(exc)) from exc
                raise

    def _translate(
        self, exc: BaseException, what: str, error: type[RolloutLifecycleError]
    ) -> RolloutLifecycleError:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if _state(exc) == TAMPERED:
            return tampered(self.where, _primary(exc), self.url)
        if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
            return error(f"{self.where} was opened read-only; nothing was written ({what})")
        if isinstance(exc, psycopg.errors.InsufficientPrivilege):
            login = str(self.params.get("user") or os.environ.get("PGUSER") or "?")
            return refused(exc, what, login, self.where)
        if isinstance(exc, psycopg.errors.DiskFull):
            # the same typed error as SQLite's full disk, from the ledger and the registry
            return StorageFull(
                f"{self.where}: {what} failed, nothing was written: the server's storage is "
                f"full ({first}); free space on the server and retry"
            )
        if isinstance(exc, psycopg.errors.UndefinedTable) and "events_chain" in first:
            return tampered(
                self.where, "has no head (its events_chain table was dropped)", self.url
            )
        if isinstance(exc, psycopg.errors.UndefinedTable):
            return error(
                f"{self.where}: tables are missing during {what} ({first}); open it with "
                "create=True once, or check the URL's database and search_path"
            )
        return error(f"{self.where}: {what} failed, nothing was written ({first})")

    # ---- schema ----------------------------------------------------------------------------

    def component_version(self, component: str) -> int | None:
        """The schema version of `component` here, or None when it has none."""

        def body(conn: Conn) -> int | None:
            row = conn.execute("SELECT to_regclass('schema_meta') IS NOT NULL").fetchone()
            if row is None or not row[0]:
                return None
            found = conn.execute(
                "SELECT version FROM schema_meta WHERE component = %s", (component,)
            ).fetchone()
            return None if found is None else int(found[0])

        return self.read(body, f"reading the {component} schema version")

    def ensure_schema(
        self,
        component: str,
        version: int,
        ddl: str,
        *,
        migrations: Mapping[int, str] | None = None,
    ) -> None:
        """Create `component`'s tables on first use, migrate an older schema, refuse a newer one.

        `migrations[v]` takes the component from schema v to v + 1 (run after the DDL, whose
        CREATE ... IF NOT EXISTS adds new tables); a schema written by a NEWER program is
        refused with a message that says to upgrade. DDL runs under K_SCHEMA, so processes
        opening one new database at once do not trip over each other's CREATE TABLE.
        """

        # the usual case, an up-to-date schema, runs no DDL at all: CREATE INDEX IF NOT
        # EXISTS still takes a SHARE lock on its table, which would queue behind (and then
        # block) every writer of a ledger in use
        if self.component_version(component) == version and self.read(
            lambda conn: has_table(conn, "commit_marks") and has_chain(conn) and _sealed(conn),
            "looking for commit_marks, the event chain and its seal",
        ):
            # no DDL, but no writer starts on an edited history either (HistoryTampered):
            # the head's row lock, held by every append while it inserts, makes the check
            # see a head and a newest event that belong together (that lock needs UPDATE on
            # the head, which no deployment role holds: it checks through CHAIN_CHECK, run
            # as the tables' owner, where the schema has it)
            self.read(_open_check, "opening")
            return

        def body(conn: Conn) -> None:
            conn.execute("SELECT pg_advisory_xact_lock(%s, 0)", (K_SCHEMA,))
            meta = has_table(conn, "schema_meta") and has_table(conn, "events")
            found = None
            if meta:
                found = conn.execute(
                    "SELECT version FROM schema_meta WHERE component = %s", (component,)
                ).fetchone()
            conn.execute(_MARKS_DDL)
            recorded: list[TraceEvent] = []
            if found is None or int(found[0]) != version:
                conn.execute(ddl if meta else _META_DDL + ddl)
            self._ensure_chain(conn)
            row = conn.execute(
                "SELECT version FROM schema_meta WHERE component = %s", (component,)
            ).fetchone()
            if row is None:
                conn.execute(
                    "INSERT INTO schema_meta(component, version) VALUES (%s, %s)",
                    (component, version),
                )
                recorded.append(_schema_event(component, version, "created"))
            elif int(row[0]) != version:
                stored = int(row[0])
                remedy = "use a new database or schema"
                steps = schema_steps(self.where, component, stored, version, migrations, remedy)
                for script in steps:
                    if script.strip():
                        conn.execute(script)
                conn.execute(
                    "UPDATE schema_meta SET version = %s WHERE component = %s",
                    (version, component),
                )
                recorded.append(_schema_event(component, version, f"migrated from {stored}"))
            # the events lock before the head's row lock, as every append takes them (after
            # the DDL's table locks: K_EVENTS is the last lock a step takes)
            lock(conn, K_EVENTS)
            self._check_chain(conn)
            append_events(conn, _seal(conn) or recorded, op=None, stamped=False)

        try:
            self.write(body, f"creating the {component} schema", ddl=True)
        except RoleRefused as exc:
            raise LedgerError(
                f"{self.where}: the {component} schema is missing or older than this program, "
                f"and this login may not create or migrate it ({exc.login}); run "
                "`rollout-lifecycle deployment roles --backend URL` as the deployment's "
                "administrator"
            ) from None

    def _ensure_chain(self, conn: Conn) -> None:
        """The chain's columns, head and functions where missing (a database whose events
        predate the chain: they stay an unchained prefix), inside the schema step; refused
        (HistoryTampered) where the schema had a chain and lost part of it: starting a chain
        over it would bless the edit (`_check_chain` then holds the head to its newest
        event)."""
        if not has_chain(conn):
            empty = conn.execute("SELECT NOT EXISTS (SELECT 1 FROM events)").fetchone()
            if empty is not None and not empty[0]:
                why = chain_required(conn)
                if why is not None and not (has_table(conn, "events_chain") and _has_hashes(conn)):
                    raise tampered(self.where, f"is incomplete although {why}", self.url)
            conn.execute(_CHAIN_DDL)  # also adds a function a database made before it lacks

    def _check_chain(self, conn: Conn) -> None:
        """HistoryTampered unless the head exists and names the newest stored event."""
        try:
            conn.execute(f"SELECT {CHAIN_PREV}()")
        except psycopg.Error as exc:
            if _state(exc) == TAMPERED:
                raise tampered(self.where, _primary(exc), self.url) from None
            raise

    def check_readable(self, component: str, version: int) -> int | None:
        """The stored version of `component` (None: absent); LedgerError when it is newer."""
        stored = self.component_version(component)
        if stored is not None and stored > version:
            raise LedgerError(newer_schema(self.where, component, stored, version))
        return stored

    # ---- lifetime ----------------------------------------------------------------------------

    def acquire(self) -> PostgresDatabase:
        """One more user (ledger or registry) of this database."""
        with self._lock:
            if self._closed:
                raise LedgerError(f"{self.where}: this database handle was closed")
            self._users += 1
        return self

    def release(self) -> None:
        """One user fewer; the last one closes the pool. Idempotent past zero."""
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users:
                return
            self._closed = True
            pool, pid = self._pool, self._pool_pid
            self._pool = None
        if pool is not None and pid == os.getpid():
            with contextlib.suppress(Exception):
                pool.close(timeout=5.0)

    @property
    def closed(self) -> bool:
        """Whether the last user released it."""
        return self._closed


# ---- statements shared by ledger and registry ---------------------------------------------


def lock_sql(key: int, *, shared: bool = False) -> str:
    """The statement taking a transaction-scoped advisory lock of this schema."""
    fn = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
    return f"SELECT {fn}({int(key)}, hashtext(current_schema()))"


def lock(conn: Conn, key: int, *, shared: bool = False) -> None:
    """Take a transaction-scoped advisory lock of this schema (see the module doc)."""
    conn.execute(lock_sql(key, shared=shared))


def _prefixed(text: str) -> str:
    """SQL for a text's UTF-8 bytes after their length (8 bytes), as model.events hashes it."""
    raw = f"convert_to({text}, 'UTF8')"
    return f"int8send(octet_length({raw})::bigint) || {raw}"


def chain_message(seq: str, txn: str, kind: str, subject: str, payload: str) -> str:
    """SQL for one event's hashed message, as `model.events.chain_hash` builds it (its hash
    is ``sha256(prev || message)``): every server-side link of the chain uses this one."""
    return f"int8send({seq}) || int8send({txn}) || " + " || ".join(
        _prefixed(c) for c in (kind, subject, payload)
    )


# K_EVENTS first, then CHAIN_PREV: the head as the last appender committed it (not as this
# statement's snapshot saw it), checked against the newest stored event, so each step chains
# onto the step committed right before it and never onto an edited history. `ch` links the
# step's events in seq order in one pass; the rows and the new head are written by the same
# statement.
_APPEND = (
    """
WITH lk AS (
    SELECT pg_advisory_xact_lock(%(key)s, hashtext(current_schema())) AS locked
), t AS (
    SELECT nextval('events_txn') AS txn,
           setval('events_seq', nextval('events_seq') + %(n)s - 1) AS last
    FROM lk
), e AS (
    SELECT * FROM unnest(%(kinds)b::text[], %(subjects)b::text[], %(payloads)b::text[])
        WITH ORDINALITY AS e(kind, subject, payload, ord)
), hd AS (
    SELECT """
    + CHAIN_PREV
    + """() AS last_hash FROM lk
), msg AS (
    SELECT array_agg("""
    + chain_message("t.last - %(n)s + e.ord", "t.txn", "e.kind", "e.subject", "e.payload")
    + """ ORDER BY e.ord) AS m
    FROM t, e
), ch AS (
    SELECT l.ord, l.prev_hash, l.hash
    FROM msg, events_chain_link((SELECT last_hash FROM hd), msg.m) AS l
), ins AS (
    INSERT INTO events(seq, txn, kind, subject, payload, prev_hash, hash)
    SELECT t.last - %(n)s + e.ord, t.txn, e.kind, e.subject, e.payload, ch.prev_hash, ch.hash
    FROM t, e JOIN ch ON ch.ord = e.ord
), head AS (
    INSERT INTO events_chain(id, base_seq, base_count, last_seq, last_hash)
    SELECT 1, 0, 0, t.last, ch.hash FROM t, ch WHERE ch.ord = %(n)s
    ON CONFLICT (id) DO UPDATE SET last_seq = excluded.last_seq, last_hash = excluded.last_hash
){counting}
SELECT {result}
"""
)

_COUNTING = f"""
, cnt AS (
    INSERT INTO ledger_counters(name, shard, n)
    SELECT c.name, pg_backend_pid() %% {COUNTER_SHARDS}, c.n
    FROM t, json_to_recordset(%(counters)s::json) AS c(name text, n bigint)
    ORDER BY c.name
    ON CONFLICT (name, shard) DO UPDATE SET n = ledger_counters.n + excluded.n
)"""


def append_statement(*, counted: bool, result: str = "txn, last FROM t") -> str:
    """The events append of `append_events` (with the ledger's counters when `counted`);
    `result` replaces what it returns (a server-side function selects INTO its variables)."""
    return _APPEND.replace("{counting}", _COUNTING if counted else "").replace("{result}", result)


def event_columns(
    events: Sequence[TraceEvent], payload_of: Payload = stored_payload
) -> dict[str, list[str]]:
    """One step's events as the arrays the append statement unnests, in order (seq and txn
    are stamped by the server, under the events lock). Sent as binary arrays: no quoting of
    the payloads' JSON, in Python or on the server."""
    return {
        "kinds": [ev.kind for ev in events],
        "subjects": [event_subject(ev) for ev in events],
        "payloads": [payload_of(ev, None) for ev in events],
    }


_APPEND_CALL = (
    "SELECT o_txn, o_last FROM rl_append(%s, %b::text[], %b::text[], %b::text[], %s, %s::json)"
)
_APPEND_PLAIN = append_statement(counted=False)


def append_events(
    conn: Conn,
    events: Sequence[TraceEvent],
    *,
    op: str | None,
    counters: Mapping[str, int] | None = None,
    payload_of: Payload = stored_payload,
    stamped: bool = True,
    updates: str | None = None,
) -> list[TraceEvent]:
    """Append one atomic step's events (and the ledger's `counters`, name -> increment, and
    its update records, `updates` as `rl_append` takes them) inside the caller's
    transaction, in ONE call of `rl_append` for operation `op`, whose one statement first
    takes K_EVENTS (held to COMMIT), so txn and seq numbers are handed out in commit order,
    and chains them by hash onto the head (see model.events), moving the head in the same
    statement. `op` None: the schema step's own append (its login owns the tables, and the
    functions may not exist yet), the statement itself. Returns the events with their seq
    and txn (none when not `stamped`, or with no events: then only the counters move)."""
    counts = sorted((k, v) for k, v in (counters or {}).items() if v)
    if not events and not counts and updates is None:
        return []
    cols = event_columns(events, payload_of)
    if op is None:
        if counts or updates is not None:
            raise ValueError("the schema step's append records events only")
        if not events:
            return []
        row = conn.execute(_APPEND_PLAIN, {"key": K_EVENTS, "n": len(events), **cols}).fetchone()
    else:
        doc = json.dumps([{"name": k, "n": v} for k, v in counts]) if counts else None
        row = conn.execute(
            _APPEND_CALL,
            (op, cols["kinds"], cols["subjects"], cols["payloads"], doc, updates),
        ).fetchone()
    if not events or not stamped:
        return []
    assert row is not None
    return stamp_events(events, int(row[0]), int(row[1]))


def stamp_events(events: Sequence[TraceEvent], txn: int, last: int) -> list[TraceEvent]:
    """`events` with the txn and seq numbers the server gave them (`last` is the last seq)."""
    first = last - len(events) + 1
    return [attrs.evolve(ev, seq=first + i, txn=txn) for i, ev in enumerate(events)]


def read_events(
    conn: Conn,
    kind: str | None = None,
    subject: str | None = None,
    *,
    after_seq: int = 0,
    exclude_kind: str | None = None,
    states: EntryStates | None = None,
) -> list[TraceEvent]:
    """Events in global order, optionally of one kind and subject, and only after `after_seq`.

    Entry events that store only what changed are rebuilt from their rollout's earlier
    events, as `sqlite_common.read_events` rebuilds them (`states`: kept by an incremental
    reader across its reads)."""
    where, args = events_where("%s", after_seq, kind, exclude_kind, subject)
    rows = conn.execute(
        f"SELECT seq, txn, payload FROM events WHERE {where} ORDER BY seq", args
    ).fetchall()
    decoded = [(seq, txn, json.loads(payload)) for seq, txn, payload in rows]
    known = EntryStates() if states is None else states
    if after_seq:
        known.catch_up(
            [data for _, _, data in decoded],
            lambda ids: (
                p
                for (p,) in conn.execute(
                    "SELECT payload FROM events WHERE kind = 'entry' AND seq <= %s "
                    "AND subject = ANY(%s) ORDER BY seq",
                    (after_seq, ids),
                ).fetchall()
            ),
        )
    out = []
    for seq, txn, data in decoded:
        data["seq"], data["txn"] = int(seq), int(txn)
        out.append(known.event(data))
    return out


def has_chain(conn: Conn) -> bool:
    """Whether the events table has its hash chain (columns, head table, the functions)."""
    row = conn.execute(
        "SELECT to_regclass('events_chain') IS NOT NULL "
        "AND to_regprocedure('events_chain_link(bytea, bytea[])') IS NOT NULL "
        f"AND to_regprocedure('{CHAIN_PREV}()') IS NOT NULL "
        "AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('events') "
        "AND attname = 'hash' AND NOT attisdropped)"
    ).fetchone()
    return bool(row and row[0])


def _open_check(conn: Conn) -> None:
    """The chain's check at open (HistoryTampered on an edited history), through CHAIN_CHECK
    where the schema has it (with roles, only it may take the head's lock)."""
    row = conn.execute(f"SELECT to_regprocedure('{CHAIN_CHECK}()') IS NOT NULL").fetchone()
    name = CHAIN_CHECK if row is not None and row[0] else CHAIN_PREV
    conn.execute(f"SELECT {name}()").fetchone()


def _has_hashes(conn: Conn) -> bool:
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('events') "
        "AND attname = 'hash' AND NOT attisdropped)"
    ).fetchone()
    return bool(row and row[0])


def chain_required(conn: Conn) -> str | None:
    """Why this schema must have a hash chain (None: it may predate the chain), read when its
    chain is incomplete: a writer must then refuse rather than start a chain over the events
    (the same reasons as `sqlite_common.chain_required`)."""
    if has_table(conn, "events_chain"):
        return "its events_chain table exists"
    if (
        _has_hashes(conn)
        and conn.execute("SELECT 1 FROM events WHERE hash IS NOT NULL LIMIT 1").fetchone()
    ):
        return "its events carry hashes"
    return chain_evidence(
        lambda sql, args: conn.execute(sql.replace("?", "%s"), args or None),
        "strpos(payload, ?) > 0",
    )


def _sealed(conn: Conn) -> bool:
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM schema_meta WHERE component = %s)", (SEAL[0],)
    ).fetchone()
    return bool(row and row[0])


def _schema_event(component: str, version: int, why: str) -> TraceEvent:
    row = {"component": component, "version": version}
    return row_event("schema_meta", component, row, why, time.time())


def _seal(conn: Conn) -> list[TraceEvent]:
    """The SEAL row and a RowRecorded of every row of the recorded tables (see
    `sqlite_common.seal_events`), where the schema is not sealed yet; else []."""
    if _sealed(conn):
        return []
    conn.execute("INSERT INTO schema_meta(component, version) VALUES (%s, %s)", (SEAL[0], SEAL[1]))
    present = {t for t in RECORDED_TABLES if has_table(conn, t)}
    return recorded_rows(conn, present, "recorded when the store was sealed")


# the chain itself: the audit reads events and head on their own; the role tables say who
# may do what (model.postgres_roles, as the server's own catalogs of roles and grants do),
# not what happened
_NOT_STATE = ("events", "events_chain", "rl_operations", "rl_roles", "rl_logins")


def read_stored(conn: Conn) -> StoredRows:
    """Every table of the schema, the events with their chain columns, and the chain's head;
    call it inside one REPEATABLE READ snapshot. A database whose events have no hash
    columns reads as `chained=False` (and `head` None without its table)."""
    names = [
        str(r[0])
        for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() ORDER BY tablename"
        ).fetchall()
    ]
    # the hash columns are read wherever they exist, even when the head's table is gone
    chained = "events" in names and _has_hashes(conn)
    events: list[StoredEvent] = []
    if "events" in names:
        links = "prev_hash, hash" if chained else "NULL::bytea, NULL::bytea"
        events = [
            StoredEvent(int(r[0]), int(r[1]), r[2], r[3], r[4], r[5], r[6])
            for r in conn.execute(
                f"SELECT seq, txn, kind, subject, payload, {links} FROM events ORDER BY seq"
            ).fetchall()
        ]
    head = None
    if "events_chain" in names:
        found = conn.execute(
            "SELECT base_seq, base_count, last_seq, last_hash FROM events_chain WHERE id = 1"
        ).fetchone()
        if found is not None:
            head = ChainHead(int(found[0]), int(found[1]), int(found[2]), bytes(found[3]))
    tables: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        if name in _NOT_STATE:
            continue
        cur = conn.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier(name)))
        columns = [str(d.name) for d in cur.description or ()]
        tables[name] = [dict(zip(columns, r, strict=True)) for r in cur.fetchall()]
    return StoredRows(events=events, head=head, tables=tables, chained=chained)


def has_table(conn: Conn, name: str) -> bool:
    """Whether `name` exists in the connection's schema."""
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone()
    return bool(row and row[0])
