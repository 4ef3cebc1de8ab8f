"""Infrastructure is not a finding: telling a dead server or a full disk from a bug.

A fuzz machine, the race or a campaign stage that fails because its backend cannot be
reached, its connection was lost or its disk filled up has judged nothing: reporting it as
a violation (a FAILED machine, a "shrunk failing program" that only reconnects to a dead
server) would send a user hunting for a bug that is not there. The runner and the race
classify every failure with `infrastructure_cause`; the CLI turns an `InfrastructureFailure`
into exit 3 naming the cause. Imports no test runner (the race uses it too).
"""

from __future__ import annotations

import errno
import sqlite3

from rollout_lifecycle.model.errors import BackendUnavailable, OutputError, StorageFull

# errors of the machine the checks run on, never of the code under test
INFRASTRUCTURE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ENOMEM, errno.EMFILE}
)
_SQLITE_INFRA = ("disk is full", "disk i/o error", "unable to open database file")


class InfrastructureStop(BaseException):
    """A machine could not even start on its backend. A BaseException on purpose: Hypothesis
    treats an Exception as a failure to shrink, and stops at once on anything else."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def infrastructure_cause(exc: BaseException) -> BaseException | None:
    """The infrastructure error behind `exc`, if any: a backend that cannot be reached or
    whose connection was lost, a full disk, an I/O error. Looks through causes, contexts and
    exception groups (Hypothesis wraps what it re-raises)."""
    stack: list[BaseException] = [exc]
    seen: set[int] = set()
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, InfrastructureStop):
            return e.cause
        if isinstance(e, BackendUnavailable | StorageFull):
            return e
        if isinstance(e, OSError) and e.errno in INFRASTRUCTURE_ERRNOS:
            return e
        if isinstance(e, OutputError) and "No space left" in str(e):
            return e
        if isinstance(e, sqlite3.OperationalError) and any(
            k in str(e).lower() for k in _SQLITE_INFRA
        ):
            return e
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        stack.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None


def describe_cause(cause: BaseException) -> str:
    """`Type: first line` of an infrastructure error, for a one-line message."""
    text = str(cause).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(cause).__name__}: {first}"[:600]


class InfrastructureFailure(Exception):
    """A stage could not go on: its backend or its disk failed under it.

    Not a finding: nothing was judged, no program is saved, no machine is marked failed."""

    def __init__(self, where: str, backend: str, cause: BaseException) -> None:
        self.where = where
        self.backend = backend
        self.cause = cause
        super().__init__(f"{where} could not run on {backend}: {describe_cause(cause)}")


__all__ = [
    "INFRASTRUCTURE_ERRNOS",
    "InfrastructureFailure",
    "InfrastructureStop",
    "describe_cause",
    "infrastructure_cause",
]
