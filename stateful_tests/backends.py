"""Which ledger (and registry) a machine runs on, built at run time through the model modules.

Mutants monkeypatch names inside `model.ledger`, `model.coordinator` and friends, so every
constructor here is looked up through its module when a machine starts, never bound at
import time. A ledger factory is any callable ``factory(tmp_path, clock, **options)``; the
options every backend must accept are ``lease_seconds``, ``recovery`` and
and nothing else. A factory that also has ``reopen(ledger, tmp_path, clock, **options)``
is durable: the ledger machine then closes and reopens it mid-run.

PostgreSQL: the backend name ``postgresql`` runs on the server named by the environment
variable ROLLOUT_LIFECYCLE_POSTGRES_URL (the test suite starts a throwaway one and sets it),
and a ``postgresql://...`` URL runs on that server. Each machine instance gets a fresh schema
of its own in that database (named after its temporary directory, so a reopen finds it
again); schemas of instances whose directory is gone are dropped as new ones are made.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib
import os
import shutil
import sqlite3
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import attrs

import rollout_lifecycle.model.coordinator as coord_mod
import rollout_lifecycle.model.ledger as ledger_mod
import rollout_lifecycle.model.registry as registry_mod
import rollout_lifecycle.model.sqlite_ledger as sqlite_ledger_mod
from rollout_lifecycle.model.backends import redact_url
from rollout_lifecycle.model.errors import BackendUnavailable
from rollout_lifecycle.model.events import EntryStates, EventLog, TraceEvent
from rollout_lifecycle.model.ledger import Clock, Ledger
from rollout_lifecycle.model.records import AdmissionPolicy
from rollout_lifecycle.model.registry import RegistryStore
from rollout_lifecycle.model.sqlite_common import connect, read_events
from rollout_lifecycle.stateful_tests.recording import Recorder

BACKEND_NAMES = ("memory", "sqlite", "postgresql")
DB_NAME = "state.db"
POSTGRES_URL_ENV = "ROLLOUT_LIFECYCLE_POSTGRES_URL"


class LedgerFactory(Protocol):
    """Builds a fresh, empty ledger; may put files under `tmp_path`."""

    def __call__(self, tmp_path: Path, clock: Clock, **options: Any) -> Ledger: ...


def memory_ledger(tmp_path: Path, clock: Clock, **options: Any) -> Ledger:
    """The in-memory reference backend (looked up through `model.ledger` at call time)."""
    led: Ledger = ledger_mod.MemoryLedger(clock=clock, **options)
    return led


class SQLiteLedgerFactory:
    """One SQLite file per machine instance; `reopen` closes it and opens the same file."""

    def __call__(self, tmp_path: Path, clock: Clock, **options: Any) -> Ledger:
        led: Ledger = sqlite_ledger_mod.SQLiteLedger(tmp_path / DB_NAME, clock=clock, **options)
        return led

    def reopen(self, ledger: Ledger, tmp_path: Path, clock: Clock, **options: Any) -> Ledger:
        """Close the connection(s) and open the file again, as a restarted process would."""
        ledger.close()
        return self(tmp_path, clock, **options)

    def __repr__(self) -> str:
        return "sqlite_ledger"


sqlite_ledger = SQLiteLedgerFactory()


# ---- PostgreSQL: one fresh schema per machine instance ---------------------------------------


def is_postgres(backend: object) -> bool:
    """Whether `backend` names PostgreSQL: the name 'postgresql' or a postgresql:// URL."""
    if not isinstance(backend, str):
        return False
    return backend == "postgresql" or backend.startswith(("postgresql://", "postgres://"))


def postgres_url(backend: str = "postgresql") -> str:
    """The server URL a PostgreSQL backend runs on (the URL itself, or the environment's)."""
    if backend != "postgresql":
        return backend
    url = os.environ.get(POSTGRES_URL_ENV)
    if not url:
        raise ValueError(
            f"the 'postgresql' backend runs on the server named by {POSTGRES_URL_ENV} "
            "(e.g. postgresql://user:password@localhost:5432/dbname); set it, or pass the "
            "postgresql:// URL itself as the backend"
        )
    return url


def schema_for(tmp_path: Path) -> str:
    """The schema of the machine instance that works in `tmp_path` (stable across reopen)."""
    digest = hashlib.sha1(str(Path(tmp_path).resolve()).encode()).hexdigest()[:24]
    return f"rl_{digest}"


_made: dict[tuple[str, str], Path] = {}
_made_lock = threading.Lock()


def _drop_schemas(url: str, schemas: list[str]) -> None:
    if not schemas:
        return
    import psycopg
    from psycopg import sql

    with contextlib.suppress(psycopg.Error), psycopg.connect(url, autocommit=True) as conn:
        for name in schemas:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def _sweep(keep: tuple[str, str] | None = None) -> None:
    """Drop the schemas of instances whose temporary directory was removed (torn down)."""
    with _made_lock:
        gone = [k for k, d in _made.items() if k != keep and not d.exists()]
        for k in gone:
            del _made[k]
    by_url: dict[str, list[str]] = {}
    for url, name in gone:
        by_url.setdefault(url, []).append(name)
    for url, names in by_url.items():
        _drop_schemas(url, names)


atexit.register(_sweep)


def fresh_schema(url: str, tmp_path: Path) -> str:
    """An empty schema for the instance in `tmp_path` (dropped first if it held anything)."""
    name = schema_for(tmp_path)
    _drop_schemas(url, [name])
    with _made_lock:
        _made[(url, name)] = Path(tmp_path)
    _sweep(keep=(url, name))
    return name


def with_schema(url: str, schema: str) -> str:
    """`url` with libpq's options=-csearch_path=<schema> added: a URL of that schema."""
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}options={urllib.parse.quote('-csearch_path=' + schema)}"


class PostgresLedgerFactory:
    """A fresh schema per machine instance; `reopen` closes the pool and opens it again."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url

    def _open(self, tmp_path: Path, clock: Clock, schema: str, **options: Any) -> Ledger:
        module = importlib.import_module("rollout_lifecycle.model.postgres_ledger")
        led: Ledger = module.PostgresLedger(
            postgres_url(self.url or "postgresql"), schema=schema, clock=clock, **options
        )
        return led

    def __call__(self, tmp_path: Path, clock: Clock, **options: Any) -> Ledger:
        schema = fresh_schema(postgres_url(self.url or "postgresql"), tmp_path)
        return self._open(tmp_path, clock, schema, **options)

    def reopen(self, ledger: Ledger, tmp_path: Path, clock: Clock, **options: Any) -> Ledger:
        """Close the connections and open the same schema again, as a restarted process would."""
        ledger.close()
        return self._open(tmp_path, clock, schema_for(tmp_path), **options)

    def __repr__(self) -> str:
        return "postgres_ledger"


postgres_ledger = PostgresLedgerFactory()

LEDGER_FACTORIES: dict[str, LedgerFactory] = {
    "memory": memory_ledger,
    "sqlite": sqlite_ledger,
    "postgresql": postgres_ledger,
}


def resolve_factory(backend: str | LedgerFactory) -> tuple[str, LedgerFactory]:
    """(label, factory) for a backend name, a postgresql:// URL or a user's factory callable."""
    if isinstance(backend, str):
        if backend in LEDGER_FACTORIES:
            return backend, LEDGER_FACTORIES[backend]
        if is_postgres(backend):
            from rollout_lifecycle.model.postgres_common import url_params

            url_params(backend)  # a malformed URL is refused here, not in every example
            return redact_url(backend), PostgresLedgerFactory(backend)
        if ":" in backend:
            return backend, load_factory(backend)
        raise ValueError(
            f"unknown ledger backend {backend!r}: use one of {list(BACKEND_NAMES)}, a "
            "postgresql:// URL or 'package.module:factory'"
        )
    if not callable(backend):
        raise TypeError(f"a ledger backend is a name or a factory callable, got {backend!r}")
    label = getattr(backend, "__qualname__", None) or repr(backend)
    module = getattr(backend, "__module__", None)
    return (f"{module}:{label}" if module else label), backend


def fuzz_backend(backend: str) -> str:
    """The backend name the machines run on for a URL every other command takes.

    `memory://` is `memory`; `sqlite:///PATH` is `sqlite` (the path is checked, never
    written: every machine instance needs a fresh database, so the machines make their own
    files under the run's work folder); a postgresql:// URL, a backend name or a
    `module:factory` are returned as they are. A malformed SQLite URL is BackendURLError."""
    if backend == "memory://":
        return "memory"
    if backend.startswith("sqlite:"):
        if backend not in ("sqlite://", "sqlite:///"):
            from rollout_lifecycle.model.backends import sqlite_path

            sqlite_path(backend)
        return "sqlite"
    return backend


def check_reachable(backend: str | LedgerFactory) -> None:
    """Connect once to a PostgreSQL backend's server, before any work: BackendUnavailable
    when it cannot be reached (or psycopg is not installed), BackendURLError when the URL,
    the credentials or the database are wrong. Other backends need no server."""
    if not is_postgres(backend):
        return
    assert isinstance(backend, str)
    url = postgres_url(backend)
    try:
        import psycopg

        common = importlib.import_module("rollout_lifecycle.model.postgres_common")
    except ImportError as exc:
        raise BackendUnavailable(
            f"the PostgreSQL backend needs psycopg 3 ({exc}); install the extra "
            "rollout-lifecycle[postgres] (from a checkout: pip install -e '.[postgres]')"
        ) from None
    params = common.url_params(url)
    kwargs: dict[str, Any] = {"autocommit": True}
    if "connect_timeout" not in params:
        kwargs["connect_timeout"] = 10
    target = url if not url.startswith("postgres://") else "postgresql" + url[8:]
    try:
        conn = psycopg.connect(target, **kwargs)
    except psycopg.Error as exc:
        raise common.connect_error(exc, common.describe(params), params) from None
    conn.close()


def load_factory(spec: str) -> LedgerFactory:
    """Import ``package.module:attribute`` and return it; errors say what to fix."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"ledger factory must look like 'package.module:factory', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"cannot import {module_name!r} for ledger factory {spec!r}: {exc}"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_name!r} has no attribute {attr!r} (from {spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{spec!r} is not callable")
    factory: LedgerFactory = obj
    return factory


def reopener(factory: LedgerFactory) -> Callable[..., Ledger] | None:
    """The factory's `reopen` when it has one (a durable backend), else None."""
    fn = getattr(factory, "reopen", None)
    return fn if callable(fn) else None


# ---- ledger + registry stacks for the activation and end-to-end machines --------------------


@attrs.define
class Stack:
    """A ledger, a registry and a coordinator whose events land in ONE global order."""

    backend: str
    ledger: Ledger
    registry: RegistryStore
    coordinator: coord_mod.ActivationCoordinator
    source: TraceSource
    url: str | None = None  # the server of a PostgreSQL stack

    @property
    def durable(self) -> bool:
        """Whether the state outlives the objects (a restart may reopen it)."""
        return self.backend != "memory"


class TraceSource(Protocol):
    """Yields the trace events written since the previous call, in global order."""

    def new_events(self) -> list[TraceEvent]: ...

    def close(self) -> None: ...


class LogSource:
    """New events of a shared in-memory EventLog."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self._seen = 0

    def new_events(self) -> list[TraceEvent]:
        """Events appended since the last call."""
        evs = self.log.events()
        new = evs[self._seen :]
        self._seen = len(evs)
        return new

    def close(self) -> None:
        """Nothing to release."""


class SQLiteEventSource:
    """New rows of the shared `events` table (ledger and registry events, one global order).

    Reads only rows after the last seq seen; re-reading the whole table every step would make
    a run quadratic in its length.
    """

    def __init__(self, path: Path) -> None:
        self._conn: sqlite3.Connection = connect(path)
        self._last = 0
        self._states = EntryStates()  # each rollout as the rows read so far leave it

    def new_events(self) -> list[TraceEvent]:
        """Rows with seq above the last one returned."""
        out = read_events(self._conn, after_seq=self._last, states=self._states)
        if out:
            self._last = out[-1].seq
        return out

    def close(self) -> None:
        """Close the reader connection."""
        self._conn.close()


class PostgresEventSource:
    """New rows of the shared `events` table on PostgreSQL, read after the last seq seen.

    Events get their seq under a lock held to COMMIT, so a seq read here is never followed
    by a smaller one committing later: reading only above the last seq misses nothing.
    """

    def __init__(self, db: Any) -> None:
        self._db = db.acquire()
        self._last = 0
        self._states = EntryStates()  # each rollout as the rows read so far leave it
        self._read_events = importlib.import_module(
            "rollout_lifecycle.model.postgres_common"
        ).read_events

    def new_events(self) -> list[TraceEvent]:
        """Rows with seq above the last one returned."""
        last = self._last
        out: list[TraceEvent] = self._db.read(
            lambda conn: self._read_events(conn, after_seq=last, states=self._states),
            "reading new events",
        )
        if out:
            self._last = out[-1].seq
        return out

    def close(self) -> None:
        """Release the reader's hold on the pool."""
        self._db.release()


def stack_backend(backend: object) -> str:
    """The backend the registry machines run on for `backend` (memory for a user factory)."""
    if isinstance(backend, str) and (backend in BACKEND_NAMES or is_postgres(backend)):
        return backend
    return "memory"


def check_stack_backend(backend: str, machine: str) -> str:
    """`backend` if a ledger+registry stack can run on it, else ValueError saying which can."""
    if backend in BACKEND_NAMES or is_postgres(backend):
        return backend
    raise ValueError(
        f"the {machine} machine runs on {', '.join(repr(n) for n in BACKEND_NAMES)} or a "
        f"postgresql:// URL, not {backend!r}"
    )


def durable_url(backend: str, tmp_path: Path) -> str:
    """A backend URL of fresh durable state for `backend` ('sqlite' or PostgreSQL)."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / DB_NAME}"
    if is_postgres(backend):
        url = postgres_url(backend)
        return with_schema(url, fresh_schema(url, tmp_path))
    raise ValueError(f"{backend!r} keeps no durable state")


def event_source(url: str) -> TraceSource:
    """A reader of new trace events of the state a durable_url names."""
    if url.startswith("sqlite:"):
        from rollout_lifecycle.model.backends import sqlite_path

        return SQLiteEventSource(sqlite_path(url))
    common = importlib.import_module("rollout_lifecycle.model.postgres_common")
    db = common.PostgresDatabase(url)
    source = PostgresEventSource(db)
    return source


def operated(
    registry: RegistryStore,
    workers: tuple[str, ...],
    ledger: Ledger,
    clock: ledger_mod.ManualClock,
    policy: AdmissionPolicy | None,
) -> coord_mod.ActivationCoordinator:
    """A coordinator on a deployment whose operator recorded `policy` first (the operator's
    own step: a coordinator only checks it), or on one with no policy when None."""
    if policy is not None:
        registry_mod.set_admission_policy(registry, policy, "set by the operator", at=clock())
    return coord_mod.ActivationCoordinator(
        registry, workers, ledger=ledger, clock=clock, policy=policy
    )


def _postgres_stack(
    backend: str,
    tmp_path: Path,
    clock: ledger_mod.ManualClock,
    workers: tuple[str, ...],
    schema: str,
    policy: AdmissionPolicy | None = None,
    **ledger_options: Any,
) -> Stack:
    url = postgres_url(backend)
    common = importlib.import_module("rollout_lifecycle.model.postgres_common")
    pg_ledger = importlib.import_module("rollout_lifecycle.model.postgres_ledger")
    pg_registry = importlib.import_module("rollout_lifecycle.model.postgres_registry")
    db = common.PostgresDatabase(url, schema=schema)
    led: Ledger = pg_ledger.PostgresLedger(db, clock=clock, **ledger_options)
    reg: RegistryStore = pg_registry.PostgresRegistry(db)
    coord = operated(reg, workers, led, clock, policy)
    label = "postgresql" if backend == "postgresql" else redact_url(backend)
    return Stack(label, led, reg, coord, PostgresEventSource(db), url=backend)


def open_stack(
    backend: str,
    tmp_path: Path,
    clock: ledger_mod.ManualClock,
    workers: tuple[str, ...],
    policy: AdmissionPolicy | None = None,
    **ledger_options: Any,
) -> Stack:
    """Ledger + registry + coordinator on `backend`: 'memory', 'sqlite' (one file), or
    PostgreSQL ('postgresql' or a URL: one fresh schema); `policy` is recorded as the
    deployment's admission policy by the operator's step (`operated`)."""
    if backend == "memory":
        log = EventLog()
        mem_reg = registry_mod.MemoryRegistry(event_log=log)
        mem_ledger: Ledger = ledger_mod.MemoryLedger(
            clock=clock, event_log=log, activation=mem_reg, **ledger_options
        )
        mem_registry: RegistryStore = mem_reg
        coord = operated(mem_registry, workers, mem_ledger, clock, policy)
        return Stack(backend, mem_ledger, mem_registry, coord, LogSource(log))
    if backend == "sqlite":
        path = tmp_path / DB_NAME
        sql_ledger: Ledger = sqlite_ledger_mod.SQLiteLedger(path, clock=clock, **ledger_options)
        sql_registry: RegistryStore = registry_mod.SQLiteRegistry(path)
        coord = operated(sql_registry, workers, sql_ledger, clock, policy)
        return Stack(backend, sql_ledger, sql_registry, coord, SQLiteEventSource(path))
    if is_postgres(backend):
        schema = fresh_schema(postgres_url(backend), tmp_path)
        return _postgres_stack(
            backend, tmp_path, clock, workers, schema, policy=policy, **ledger_options
        )
    raise ValueError(
        f"activation stacks run on {list(BACKEND_NAMES)} or a postgresql:// URL, not {backend!r}"
    )


def reopen_stack(
    stack: Stack,
    tmp_path: Path,
    clock: ledger_mod.ManualClock,
    workers: tuple[str, ...],
    policy: AdmissionPolicy | None = None,
    **ledger_options: Any,
) -> Stack:
    """Close a durable stack and open the same file with a new coordinator (a restart).

    The trace reader is kept, so no event is judged twice.
    """
    if not stack.durable:
        raise ValueError("only a durable stack can be reopened")
    stack.ledger.close()
    stack.registry.close()
    if stack.url is not None:
        again = _postgres_stack(
            stack.url,
            tmp_path,
            clock,
            workers,
            schema_for(tmp_path),
            policy=policy,
            **ledger_options,
        )
        again.source.close()
        return attrs.evolve(again, source=stack.source)
    path = tmp_path / DB_NAME
    led: Ledger = sqlite_ledger_mod.SQLiteLedger(path, clock=clock, **ledger_options)
    reg: RegistryStore = registry_mod.SQLiteRegistry(path)
    coord = operated(reg, workers, led, clock, policy)
    return Stack(stack.backend, led, reg, coord, stack.source)


def close_stack(stack: Stack) -> None:
    """Close everything; used from teardown, so it never raises over a real failure."""
    for closer in (stack.source.close, stack.ledger.close, stack.registry.close):
        with contextlib.suppress(Exception):
            closer()


def end_example(recorder: Recorder, tmp: Path, closers: Iterable[Callable[[], object]]) -> None:
    """A stack machine's teardown: count a failing example, close everything, delete the
    files; never raises over the real failure."""
    if sys.exc_info()[1] is not None:
        recorder.example_failed()
    for close in closers:
        with contextlib.suppress(Exception):
            close()
    shutil.rmtree(tmp, ignore_errors=True)


M = TypeVar("M", bound=type)


def bind_machine(
    base: M,
    backend: str,
    *,
    machine: str,
    recorder: Recorder | None,
    recorder_name: str,
    workdir: Path | None,
) -> M:
    """`base` bound to a checked stack backend, a recorder and a work folder (a subclass of
    the same name, so Hypothesis reports and saved programs name the machine)."""
    check_stack_backend(backend, machine)
    attrs_: dict[str, Any] = {
        "backend": backend,
        "recorder": recorder or Recorder(recorder_name),
        "workdir": workdir,
        "__module__": base.__module__,
    }
    return cast(M, type(base.__name__, (base,), attrs_))
