"""Open a ledger and a registry from one URL, so every tool names its state the same way.

    memory://                      MemoryLedger + MemoryRegistry sharing one EventLog
    sqlite:///relative/path.db     SQLiteLedger + SQLiteRegistry on one file (relative to cwd)
    sqlite:////absolute/path.db    the same, with an absolute path
    postgresql://user:password@host:5432/dbname
                                   PostgresLedger + PostgresRegistry in one database (also
                                   postgres://; libpq parameters such as
                                   ?options=-csearch_path%3Dmyschema or sslmode=require apply)

Ledger and registry always share one event order (one EventLog, or one `events` table), so
the spec can replay the whole trace: a reservation is judged against the pointer that was
active at that moment. Adding a backend means adding one opener to `OPENERS`; `PLANNED`
explains why a URL users will try is refused.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from rollout_lifecycle.model.atomic import describe_os_error
from rollout_lifecycle.model.errors import (
    BackendUnavailable,
    BackendURLError,
    HistoryTampered,
    LedgerError,
    brief,
)
from rollout_lifecycle.model.events import EventLog, StoredRows, TraceEvent
from rollout_lifecycle.model.ledger import Clock, Ledger, MemoryLedger, check_lease_seconds
from rollout_lifecycle.model.records import to_jsonable
from rollout_lifecycle.model.registry import (
    _ART_COLS,
    MemoryRegistry,
    RegistryStore,
    SQLiteRegistry,
    _record_to_row,
)
from rollout_lifecycle.model.sqlite_common import (
    FileReplaced,
    absent_sidecars,
    connect_read_only,
    has_component,
    remove_read_sidecars,
)
from rollout_lifecycle.model.sqlite_ledger import SQLiteLedger

DEFAULT_URL = "sqlite:///rollout-lifecycle.db"

EXAMPLES = (
    "memory://",
    "sqlite:///rollout-lifecycle.db (relative to the current directory)",
    "sqlite:////var/lib/rl/ledger.db (absolute path)",
    "postgresql://user:password@host:5432/dbname",
)


@attrs.frozen
class Backend:
    """A ledger and a registry opened together; close both with `close()` or `with`."""

    url: str
    ledger: Ledger
    registry: RegistryStore
    path: Path | None = None
    # the SQLite -wal/-shm a read-only open created, removed again by close()
    read_sidecars: tuple[Path, ...] = ()

    def trace(self) -> list[TraceEvent]:
        """The whole stored trace (ledger and registry events) in its one global order."""
        events: list[TraceEvent] = [*self.ledger.history(), *self.registry.trace()]
        return sorted(events, key=lambda e: e.seq)

    def stored_rows(self) -> StoredRows:
        """Every stored row and event, with the hash chain and its head, from one consistent
        snapshot (what `ledger check` audits against the replayed trace)."""
        read = getattr(self.ledger, "stored_rows", None)
        if callable(read):
            rows = read()
            if isinstance(rows, StoredRows):
                return rows
        if isinstance(self.ledger, MemoryLedger) and isinstance(self.registry, MemoryRegistry):
            return memory_rows(self.ledger, self.registry)
        raise LedgerError(f"{type(self.ledger).__name__} cannot list what it stores")

    def close(self) -> None:
        """Release connections; safe to call twice."""
        try:
            self.ledger.close()
        finally:
            self.registry.close()
            if self.path is not None and self.read_sidecars:
                remove_read_sidecars(self.path, self.read_sidecars)

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dumps(value: object) -> str:
    return json.dumps(to_jsonable(value), separators=(",", ":"))


def memory_rows(ledger: MemoryLedger, registry: MemoryRegistry) -> StoredRows:
    """A memory backend's records laid out as the SQL stores' tables (same names and
    columns), with the shared log's chain, under the registry's lock (which an attached
    ledger shares): so one audit judges all three backends alike."""
    with registry.lock:
        events, head = registry.log.stored_events()
        stats = ledger.statistics()
        tables: dict[str, list[dict[str, Any]]] = {
            "rollouts": [
                {
                    "rollout_id": e.rollout_id,
                    "state": e.state,
                    "revision": e.revision,
                    "reserved_by": e.reserved_by,
                    "lease_expires_at": e.lease_expires_at,
                    "behavior_version": e.behavior_version,
                    "entry": _dumps(e),
                }
                for e in ledger.snapshot().values()
            ],
            "ledger_bad_versions": [{"version": v} for v in sorted(ledger.bad_versions)],
            "ledger_counters": [
                {"name": k, "n": getattr(stats, k)}
                for k in ("writes", "reservations", "expirations", "commits", "aborts")
            ],
            "registry_artifacts": [
                dict(zip(_ART_COLS.replace(" ", "").split(","), _record_to_row(a), strict=True))
                for a in registry.artifacts()
            ],
            "registry_workers": [
                {
                    "worker_id": w.worker_id,
                    "floor": w.floor,
                    "ack": None if w.ack is None else _dumps(w.ack),
                }
                for w in registry.workers().values()
            ],
            "registry_attempt_tokens": [attrs.asdict(t) for t in registry.attempt_tokens()],
            # the lineage index as the SQL stores keep it (model.lineage_index)
            "registry_claims": [
                {"update_id": u, "version": v}
                for u, vs in sorted(registry._claims.items())
                for v in vs
            ],
            "ledger_updates": [
                {**attrs.asdict(u), "claimed": 1 if u.update_id in registry._claims else None}
                for u in ledger.updates().values()
            ],
        }
        pointer, members, policy = (
            registry.pointer(),
            registry.required_workers(),
            registry.policy(),
        )
    tables["registry_pointer"] = (
        []
        if pointer is None
        else [{"id": 1, "version": pointer.version, "artifact_hash": pointer.artifact_hash}]
    )
    tables["registry_membership"] = (
        [] if members is None else [{"id": 1, "workers": json.dumps(list(members))}]
    )
    tables["registry_policy"] = (
        []
        if policy is None
        else [
            {
                "id": 1,
                "max_lag": policy.max_lag,
                "max_drift": policy.max_drift,
                "batch_size": policy.batch_size,
                "max_attempts": policy.max_attempts,
                "lineage": policy.lineage,
                "chain_key": policy.chain_key,
            }
        ]
    )
    return StoredRows(events=events, head=head, tables=tables)


@attrs.frozen
class OpenOptions:
    """What every opener receives besides the URL's own part."""

    clock: Clock | None  # None: the deployment's clock (see model.clocks); tests inject one
    lease_seconds: float
    create: bool


Opener = Callable[[str, str, OpenOptions], Backend]


def redact_url(url: str) -> str:
    """The URL with any password replaced by ***, for messages and reports."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def _bad(url: str, why: str, *, stored: bool = False) -> BackendURLError:
    """A BackendURLError with valid examples; `stored`: the command reads a stored ledger,
    so memory:// (which stores nothing) is not offered as one."""
    examples = "; ".join(e for e in EXAMPLES if not (stored and e.startswith("memory:")))
    return BackendURLError(f"backend URL {brief(url)}: {why}. Valid examples: {examples}")


def _open_memory(url: str, rest: str, opts: OpenOptions) -> Backend:
    if rest:
        raise _bad(url, "memory:// takes nothing after the scheme")
    if not opts.create:
        raise _bad(
            url,
            "memory:// starts empty in every process, so there is nothing stored to read; "
            "point at the sqlite:/// file your run wrote, or the postgresql:// database",
            stored=True,
        )
    log = EventLog()
    registry = MemoryRegistry(event_log=log)
    # the ledger shares the registry's lock: a reservation reads the pointer in its own step
    ledger = MemoryLedger(
        clock=opts.clock or time.time,
        lease_seconds=opts.lease_seconds,
        event_log=log,
        activation=registry,
    )
    return Backend(url=url, ledger=ledger, registry=registry)


def sqlite_path(url: str) -> Path:
    """The file a `sqlite:///...` URL names; BackendURLError when it names none."""
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        raise _bad(url, "a SQLite URL starts with sqlite:/// (three slashes, then the path)")
    rest = url[len(prefix) :]
    if not rest or rest == "/":
        raise _bad(url, "the path to the database file is missing")
    if rest == ":memory:":
        raise _bad(url, "an in-memory SQLite database is private to one connection; use memory://")
    if "?" in rest or "#" in rest:
        raise _bad(url, "query parameters and fragments are not supported")
    return Path(rest)


def _check_existing(url: str, path: Path) -> None:
    """Refuse a missing file or one this project never wrote, before anything creates tables."""
    if not path.exists():
        why = f"no such file {path} (reading never creates a ledger; check the path)"
        raise _bad(url, why, stored=True)
    if path.is_dir():
        raise _bad(url, f"{path} is a directory, not a database file", stored=True)
    if not os.access(path, os.R_OK):
        raise _bad(url, f"{path} cannot be read (permission denied)", stored=True)
    try:
        conn = connect_read_only(path)
        try:
            found = has_component(conn, "ledger") is not None
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise _bad(url, f"{path} is not a readable SQLite database ({exc})", stored=True) from None
    if not found:
        why = f"{path} is a SQLite file but holds no rollout-lifecycle ledger"
        raise _bad(url, why, stored=True)


def _read_only_storage(path: Path) -> bool:
    folder = path.parent if str(path.parent) else Path(".")
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY) or not os.access(folder, os.W_OK)
    except OSError:
        return False


def _storage_hint(path: Path, message: str) -> str:
    """Say plainly when the cause is storage that cannot be written."""
    if "readonly" in message or "read-only" in message or _read_only_storage(path):
        return (
            f"{message}. {path} (or its folder) cannot be written: commands that only read "
            "(ledger counts/show/history/check) open it read-only; to write, use writable storage"
        )
    return message


def _open_sqlite(url: str, _rest: str, opts: OpenOptions) -> Backend:
    path = sqlite_path(url)
    read_only = not opts.create  # a reader never writes, not even a table
    # nor leaves files behind: the -wal/-shm reading creates are removed on close
    created = absent_sidecars(path) if read_only else ()
    try:
        if not opts.create:
            _check_existing(url, path)
        ledger = SQLiteLedger(
            path, clock=opts.clock, lease_seconds=opts.lease_seconds, read_only=read_only
        )
    except (FileReplaced, HistoryTampered):
        remove_read_sidecars(path, created)
        raise  # the URL is fine: the -wal beside the file is another file's, or the file's
        # history was edited (each says why and what to do)
    except LedgerError as exc:
        remove_read_sidecars(path, created)
        raise _bad(url, _storage_hint(path, str(exc))) from None
    except BaseException:
        remove_read_sidecars(path, created)
        raise
    try:
        registry = SQLiteRegistry(path, read_only=read_only)
    except BaseException:
        ledger.close()
        remove_read_sidecars(path, created)
        raise
    return Backend(url=url, ledger=ledger, registry=registry, path=path, read_sidecars=created)


def _open_postgres(url: str, _rest: str, opts: OpenOptions) -> Backend:
    """Ledger and registry in one PostgreSQL database, sharing one connection pool.

    Reading (`create=False`) opens read-only connections and needs a database that already
    holds a ledger; an unreachable server is BackendUnavailable (a technical failure), a
    bad URL, wrong credentials or a missing database are BackendURLError.
    """
    try:
        from rollout_lifecycle.model.postgres_common import PostgresDatabase
        from rollout_lifecycle.model.postgres_ledger import PostgresLedger
        from rollout_lifecycle.model.postgres_registry import PostgresRegistry
    except ImportError as exc:
        raise BackendUnavailable(
            f"the PostgreSQL backend needs psycopg 3 ({exc}); install the extra "
            "rollout-lifecycle[postgres] (from a checkout: pip install -e '.[postgres]', which "
            "uses the system's libpq; '.[postgres-binary]' brings its own)"
        ) from None
    try:
        db = PostgresDatabase(url, read_only=not opts.create)
        ledger = PostgresLedger(db, clock=opts.clock, lease_seconds=opts.lease_seconds)
    except (BackendUnavailable, HistoryTampered):
        raise
    except LedgerError as exc:
        raise _bad(redact_url(url), str(exc)) from None
    except BackendURLError as exc:
        raise _bad(redact_url(url), str(exc)) from None
    try:
        registry = PostgresRegistry(db)
    except BaseException:
        ledger.close()
        raise
    return Backend(url=url, ledger=ledger, registry=registry)


# The one extension point: scheme -> opener.
OPENERS: dict[str, Opener] = {
    "memory": _open_memory,
    "sqlite": _open_sqlite,
    "postgresql": _open_postgres,
    "postgres": _open_postgres,
}

# Schemes users will try that are refused with a specific reason rather than "unknown".
PLANNED: dict[str, str] = {
    "postgresql+psycopg": (
        "write postgresql://... (the driver is psycopg 3 already; drop the '+psycopg')"
    ),
}


def open_backend(
    url: str,
    *,
    clock: Clock | None = None,
    lease_seconds: float = 600.0,
    create: bool = True,
) -> Backend:
    """Open the ledger and registry `url` names; BackendURLError with examples otherwise.

    With `create=False` (every read-only command) a SQLite file (or a PostgreSQL database)
    must already exist and hold a ledger: a typo in a path must be an error, not a new empty
    database; nothing is ever written through a backend opened that way.
    """
    if not isinstance(url, str):
        raise _bad(brief(url), f"a backend URL is a string, got {type(url).__name__}")
    if not url.strip():
        raise _bad(url, "it is empty")
    scheme, sep, rest = url.partition("://")
    if not sep:
        hint = ""
        if url.endswith((".db", ".sqlite", ".sqlite3")):
            hint = f" (did you mean sqlite:///{url}?)"
        raise _bad(url, f"it has no scheme{hint}", stored=not create)
    if scheme in PLANNED:
        raise _bad(url, PLANNED[scheme])
    opener = OPENERS.get(scheme)
    if opener is None:
        known = sorted(k for k in OPENERS if create or k != "memory")
        raise _bad(
            url, f"unknown scheme {brief(scheme)} (known: {', '.join(known)})", stored=not create
        )
    lease = check_lease_seconds(lease_seconds)
    try:
        return opener(url, rest, OpenOptions(clock, lease, create))
    except OSError as exc:  # e.g. a path too long for the file system
        raise _bad(url, f"cannot open it ({describe_os_error(exc)}: {exc})") from None
