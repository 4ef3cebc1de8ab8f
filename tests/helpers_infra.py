"""Ledger factories whose infrastructure fails mid-run, for the "infrastructure is not a
finding" tests: `fuzz --backend tests.helpers_infra:dying_server` (the server goes away after
a few writes, as a PostgreSQL server that is stopped would) and `...:full_disk` (the disk
fills up). Importable by module name, as `--backend module:factory` needs."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

from rollout_lifecycle.model.errors import BackendUnavailable
from rollout_lifecycle.model.ledger import Clock, Ledger, MemoryLedger

WRITES_BEFORE_FAILING = 40
_state = {"writes": 0}


class _FailingLedger(MemoryLedger):
    """A memory ledger whose `add` starts failing after WRITES_BEFORE_FAILING adds."""

    failure: type[Exception] = BackendUnavailable

    def add(self, *args: Any, **kwargs: Any) -> Any:
        _state["writes"] += 1
        if _state["writes"] > WRITES_BEFORE_FAILING:
            raise _failure(self.failure)
        return super().add(*args, **kwargs)


class _FullDiskLedger(_FailingLedger):
    failure = OSError


def _failure(kind: type[Exception]) -> Exception:
    if kind is OSError:
        return OSError(errno.ENOSPC, "No space left on device")
    return BackendUnavailable(
        "cannot reach PostgreSQL at 127.0.0.1:1/db (connection refused): is the server "
        "running, and are host and port in the URL right?"
    )


def dying_server(tmp_path: Path, clock: Clock, **options: Any) -> Ledger:
    """A ledger on a 'server' that stops answering after a few writes: the instances made
    after that cannot connect at all."""
    if _state["writes"] > WRITES_BEFORE_FAILING:
        raise _failure(BackendUnavailable)
    return _FailingLedger(clock=clock, **options)


def full_disk(tmp_path: Path, clock: Clock, **options: Any) -> Ledger:
    """A ledger whose disk fills up after a few writes (ENOSPC, as a SQLite file's would)."""
    return _FullDiskLedger(clock=clock, **options)
