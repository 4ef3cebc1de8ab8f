"""Which ledger (and registry) a machine runs on, built at run time through the model modules.

Mutants monkeypatch names inside `model.ledger`, `model.coordinator` and friends, so every
constructor here is looked up through its module when a machine starts, never bound at
import time. A ledger factory is any callable ``factory(tmp_path, clock, **options)``; the
options every backend must accept are ``lease_seconds``, ``recovery`` and
and nothing else. A factory that also has ``reopen(ledger, tmp_path, clock, **options)``
is durable: the ledger machine then closes and reopens it mid-run.
"""

from __future__ import annotations

import contextlib
import importlib
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import attrs

import rollout_lifecycle.model.coordinator as coord_mod
import rollout_lifecycle.model.ledger as ledger_mod
import rollout_lifecycle.model.registry as registry_mod
import rollout_lifecycle.model.sqlite_ledger as sqlite_ledger_mod
from rollout_lifecycle.model.events import EventLog, TraceEvent
from rollout_lifecycle.model.ledger import Clock, Ledger
from rollout_lifecycle.model.registry import RegistryStore
from rollout_lifecycle.model.sqlite_common import connect, read_events

BACKEND_NAMES = ("memory", "sqlite")
DB_NAME = "state.db"


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

LEDGER_FACTORIES: dict[str, LedgerFactory] = {"memory": memory_ledger, "sqlite": sqlite_ledger}


def resolve_factory(backend: str | LedgerFactory) -> tuple[str, LedgerFactory]:
    """(label, factory) for a backend name or a user's factory callable."""
    if isinstance(backend, str):
        if backend in LEDGER_FACTORIES:
            return backend, LEDGER_FACTORIES[backend]
        if ":" in backend:
            return backend, load_factory(backend)
        raise ValueError(
            f"unknown ledger backend {backend!r}: use one of {list(BACKEND_NAMES)} or "
            "'package.module:factory'"
        )
    if not callable(backend):
        raise TypeError(f"a ledger backend is a name or a factory callable, got {backend!r}")
    label = getattr(backend, "__qualname__", None) or repr(backend)
    module = getattr(backend, "__module__", None)
    return (f"{module}:{label}" if module else label), backend


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

    def new_events(self) -> list[TraceEvent]:
        """Rows with seq above the last one returned."""
        out = read_events(self._conn, after_seq=self._last)
        if out:
            self._last = out[-1].seq
        return out

    def close(self) -> None:
        """Close the reader connection."""
        self._conn.close()


def open_stack(
    backend: str,
    tmp_path: Path,
    clock: ledger_mod.ManualClock,
    workers: tuple[str, ...],
    **ledger_options: Any,
) -> Stack:
    """Ledger + registry + coordinator on `backend` ('memory', or 'sqlite' in one file)."""
    if backend == "memory":
        log = EventLog()
        mem_reg = registry_mod.MemoryRegistry(event_log=log)
        mem_ledger: Ledger = ledger_mod.MemoryLedger(
            clock=clock, event_log=log, activation=mem_reg, **ledger_options
        )
        mem_registry: RegistryStore = mem_reg
        coord = coord_mod.ActivationCoordinator(
            mem_registry, workers, ledger=mem_ledger, clock=clock
        )
        return Stack(backend, mem_ledger, mem_registry, coord, LogSource(log))
    if backend == "sqlite":
        path = tmp_path / DB_NAME
        sql_ledger: Ledger = sqlite_ledger_mod.SQLiteLedger(path, clock=clock, **ledger_options)
        sql_registry: RegistryStore = registry_mod.SQLiteRegistry(path)
        coord = coord_mod.ActivationCoordinator(
            sql_registry, workers, ledger=sql_ledger, clock=clock
        )
        return Stack(backend, sql_ledger, sql_registry, coord, SQLiteEventSource(path))
    raise ValueError(f"activation stacks run on {list(BACKEND_NAMES)}, not {backend!r}")


def reopen_stack(
    stack: Stack,
    tmp_path: Path,
    clock: ledger_mod.ManualClock,
    workers: tuple[str, ...],
    **ledger_options: Any,
) -> Stack:
    """Close a durable stack and open the same file with a new coordinator (a restart).

    The trace reader is kept, so no event is judged twice.
    """
    if stack.backend != "sqlite":
        raise ValueError("only a durable stack can be reopened")
    stack.ledger.close()
    stack.registry.close()
    path = tmp_path / DB_NAME
    led: Ledger = sqlite_ledger_mod.SQLiteLedger(path, clock=clock, **ledger_options)
    reg: RegistryStore = registry_mod.SQLiteRegistry(path)
    coord = coord_mod.ActivationCoordinator(reg, workers, ledger=led, clock=clock)
    return Stack(stack.backend, led, reg, coord, stack.source)


def close_stack(stack: Stack) -> None:
    """Close everything; used from teardown, so it never raises over a real failure."""
    for closer in (stack.source.close, stack.ledger.close, stack.registry.close):
        with contextlib.suppress(Exception):
            closer()
