"""Typed errors. Each says what was wrong and what to do, so the CLI can print it as is.

They subclass ValueError where the small API (CONTRACT section 5) promises a ValueError.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping


class RolloutLifecycleError(Exception):
    """Base class for every error this project raises on purpose."""


class InvalidRecord(RolloutLifecycleError, ValueError):
    """A record failed validation at the boundary (wrong type, range or shape)."""


class IllegalTransition(RolloutLifecycleError, ValueError):
    """An event the declared machine does not allow from the current state."""

    def __init__(self, machine: str, state: str, event: str, why: str) -> None:
        self.machine, self.state, self.event, self.why = machine, state, event, why
        super().__init__(f"{machine}: event {event!r} is not allowed from state {state!r}: {why}")


class LedgerError(RolloutLifecycleError):
    """A ledger operation that cannot be carried out as asked; nothing was written."""


class HistoryTampered(LedgerError):
    """The store's hash-chained history was edited (its head missing, its hashes stripped, or
    its last event not the one the head names): nothing was written, and no writer ever
    starts the chain again over such a history (that would bless the edit)."""


def tampered(where: str, what: str, url: str | None = None) -> HistoryTampered:
    """The HistoryTampered of a store at `where` whose chain shows `what`, saying what to do."""
    backend = url or "URL"
    return HistoryTampered(
        f"{where}: the event history's hash chain {what}; nothing was written. A writer never "
        "restarts the chain over an edited history: run `rollout-lifecycle ledger check "
        f"--backend {backend}` to see what was changed, then restore the store from a backup "
        "(compare it with your anchors: `ledger check --anchor FILE`)"
    )


class UnknownRollout(LedgerError, KeyError):
    """The rollout id is not in the ledger."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown rollout"


class DuplicateRollout(LedgerError, ValueError):
    """A rollout id that is already in the ledger was added again."""


class RevisionConflict(LedgerError):
    """A compare-and-set lost: the record's revision is not the one the caller read."""

    def __init__(self, rollout_id: str, expected: int, actual: int) -> None:
        self.rollout_id, self.expected, self.actual = rollout_id, expected, actual
        super().__init__(
            f"rollout {rollout_id!r}: expected revision {expected}, found {actual}; "
            "re-read the record and retry"
        )


class BackendUnavailable(LedgerError):
    """The database server cannot be reached, or the connection to it was lost.

    A technical failure, not a refusal: the message says whether anything may have been
    written (the CLI exits 3 on it).
    """


class StorageFull(LedgerError):
    """The database's storage is full (SQLite's 'database or disk is full', PostgreSQL's
    disk_full): nothing was written. The same error from the ledger and the registry, so a
    caller handles a full disk once; free space (or move the database) and retry. A
    technical failure, not a refusal (the CLI exits 3 on it)."""


class CommitMismatch(LedgerError, ValueError):
    """A commit named a set of rollouts other than exactly what its update reserved."""


class UpdatePoisoned(CommitMismatch):
    """A commit of an update the ledger recorded as poisoned (a commit of it was refused, a
    lease of one of its rollouts expired, or it held a rollout of a retired version): it may
    have trained on a rollout another update consumes, so nothing of it is consumed, now or
    later. Abort it (its rollouts return) and train a new update on fresh reservations."""

    def __init__(self, message: str, *, update_id: str, cause: str) -> None:
        self.update_id, self.cause = update_id, cause
        super().__init__(message)


class DispatchRefused(LedgerError, ValueError):
    """An `add` that the deployment's recorded pacing policy refuses (over the live budget,
    or its prompt's attempt chain is live, trained or exhausted): nothing was written. The
    `reason` is the one `ledger.dispatch` would return; dispatch waits for capacity."""

    def __init__(self, message: str, *, reason: str) -> None:
        self.reason = reason
        super().__init__(message)


class NotOwner(LedgerError, ValueError):
    """An operation on a reservation held by another update (or by none)."""


class GateConfigError(RolloutLifecycleError, ValueError):
    """Bad admission-gate parameters or inputs (shapes, dtypes, non-finite values)."""


class ActivationError(RolloutLifecycleError, ValueError):
    """An activation request that the protocol refuses before any state changes."""


class ArtifactError(RolloutLifecycleError):
    """An artifact that cannot be written, read or trusted (path, hash, immutability)."""


class BackendURLError(RolloutLifecycleError, ValueError):
    """A backend URL this project cannot open."""


class OutputError(RolloutLifecycleError):
    """A file could not be written where asked (missing folder, a file in the way, full disk);
    nothing was left half-written."""


class InvalidLedgerArgument(LedgerError, ValueError):
    """An argument of a ledger call of the wrong type or range (nothing was read or written)."""


class RoleRefused(LedgerError, ActivationError):
    """The database refused an operation outside the caller's role (PostgreSQL roles, see
    docs/postgres.md): nothing was written. A ledger and an activation error both, so the
    handlers of either layer see it; not a technical failure (the CLI exits 2).

    `operation` is what was asked (a ledger step such as 'reserve', a registry step such as
    'set_policy', or a read), `needed` the roles that may run it, `login` who asked.
    """

    def __init__(
        self, message: str, *, operation: str, needed: tuple[str, ...], login: str
    ) -> None:
        self.operation, self.needed, self.login = operation, needed, login
        super().__init__(message)


_BRIEF = reprlib.Repr()
_BRIEF.maxstring = 80
_BRIEF.maxother = 80
_BRIEF.maxlevel = 3
_BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxdict = _BRIEF.maxset = 6


def newer_schema(where: str, component: str, stored: int, version: int) -> str:
    """The message for a schema written by a newer rollout-lifecycle."""
    return (
        f"{where} has {component} schema version {stored}, this program expects {version}: "
        "it was written by a newer rollout-lifecycle; upgrade this one to use it"
    )


def schema_steps(
    where: str,
    component: str,
    stored: int,
    version: int,
    migrations: Mapping[int, str] | None,
    remedy: str,
) -> list[str]:
    """The migration scripts, one per version step, that take `component`'s schema from
    `stored` up to `version`; every store refuses alike (LedgerError) a schema written by a
    newer program and one that no migration covers (`remedy` says what to use instead)."""
    if stored > version:
        raise LedgerError(newer_schema(where, component, stored, version))
    steps = migrations or {}
    if any(v not in steps for v in range(stored, version)):
        raise LedgerError(
            f"{where} has {component} schema version {stored}, this program expects {version} "
            f"and cannot migrate it; {remedy}"
        )
    return [steps[v] for v in range(stored, version)]


def brief(value: object) -> str:
    """A short, safe repr for an error message: bounded in size and depth, so a hostile value
    (a 100k-deep list, a 10**400 int, a huge string) never breaks the message itself."""
    try:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
            return f"an integer of {len(str(abs(value)))} digits"
        return _BRIEF.repr(value)
    except (RecursionError, ValueError, TypeError):
        return f"<{type(value).__name__}>"
