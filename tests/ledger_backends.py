"""Ledger backends the conformance suite runs on: name -> factory(tmp_path, clock, **options).

Adding a backend means adding one entry here; every behaviour test in
tests/test_ledger_conformance.py then runs on it unchanged. The "postgresql" entry runs on
the throwaway server tests/conftest.py starts (the test is marked `postgres` by its
parameter, so it skips, or fails under REQUIRE_POSTGRES=1, without PostgreSQL). Options are
the constructor keywords every backend shares: lease_seconds, recovery, require_admission.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Protocol

from rollout_lifecycle.model.ledger import Clock, Ledger, MemoryLedger
from rollout_lifecycle.model.sqlite_ledger import SQLiteLedger
from rollout_lifecycle.stateful_tests.backends import PostgresLedgerFactory


class LedgerFactory(Protocol):
    """Builds a fresh, empty ledger; may put files under `tmp_path`."""

    def __call__(self, tmp_path: Path, clock: Clock, **options: Any) -> Ledger: ...


_files = itertools.count()


def memory_ledger(tmp_path: Path, clock: Clock, **options: Any) -> Ledger:
    """The in-memory reference backend."""
    return MemoryLedger(clock=clock, **options)


def sqlite_ledger(tmp_path: Path, clock: Clock, **options: Any) -> Ledger:
    """A new SQLite file per ledger, so two ledgers in one test never share state by accident."""
    return SQLiteLedger(tmp_path / f"ledger-{next(_files)}.db", clock=clock, **options)


def postgres_ledger(tmp_path: Path, clock: Clock, **options: Any) -> Ledger:
    """A new schema per ledger on the session's server, so two ledgers never share state."""
    return PostgresLedgerFactory()(tmp_path / f"pg-{next(_files)}", clock, **options)


BACKENDS: dict[str, LedgerFactory] = {
    "memory": memory_ledger,
    "sqlite": sqlite_ledger,
    "postgresql": postgres_ledger,
}
