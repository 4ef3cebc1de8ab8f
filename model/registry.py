"""The durable state of policy activation: artifact records, worker reports, the active pointer.

A coordinator step is planned and written inside ONE registry transaction (`transact`): the
plan reads the state under the write lock (a Python lock in memory, ``BEGIN IMMEDIATE`` in
SQLite), returns the changed records, pointer and worker reports, and the registry writes
them together with their `ArtifactChanged` events. Because the plan runs under the lock, two
coordinators on one SQLite file can never both act on the same stale read. The shared checks
in `check_step` (hash immutability, versions never reused, before-images match) run in both
backends, so a buggy plan is refused instead of written.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import attrs

from rollout_lifecycle.model import rules
from rollout_lifecycle.model.api import activate_policy_version
from rollout_lifecycle.model.errors import ActivationError, brief
from rollout_lifecycle.model.events import (
    ArtifactChanged,
    EntryChanged,
    EventLog,
    MembershipChanged,
    TraceEvent,
    WorkerReported,
)
from rollout_lifecycle.model.ledger import ActivationPremise
from rollout_lifecycle.model.records import (
    ActivePointer,
    ArtifactRecord,
    Disposition,
    WorkerAck,
    from_jsonable,
    to_jsonable,
)
from rollout_lifecycle.model.rules import WAS_ACTIVE_STATES
from rollout_lifecycle.model.sqlite_common import (
    append_events,
    check_identity,
    connect,
    ensure_schema,
    file_identity,
    has_component,
    read_events,
)

R = TypeVar("R")

COMPONENT = "registry"
# 2: the durable required worker set (registry_membership); worker reports in the trace
SCHEMA_VERSION = 2
MIGRATIONS = {1: ""}  # 1 -> 2 only adds a table, which the DDL creates if missing


@attrs.frozen
class WorkerReport:
    """A worker's latest counted ack, and the lowest incarnation whose acks still count.

    `floor` rises when the worker restarts: it lost its weights, so every ack from an
    earlier incarnation, including one still in flight, is void.
    """

    worker_id: str
    floor: int = 0
    ack: WorkerAck | None = None


@attrs.frozen
class ArtifactChange:
    """One artifact record written by a step, with the machine event that justifies it."""

    event: str
    before: ArtifactRecord | None
    after: ArtifactRecord
    acks: tuple[WorkerAck, ...] = ()
    required_workers: tuple[str, ...] = ()


class _Unchanged:
    """Marker type: the step leaves the pointer alone."""


UNCHANGED = _Unchanged()


@attrs.frozen
class RegistryStep:
    """Everything one coordinator step writes, atomically."""

    at: float
    artifacts: tuple[ArtifactChange, ...] = ()
    pointer: ActivePointer | _Unchanged | None = UNCHANGED
    workers: tuple[WorkerReport, ...] = ()
    membership: tuple[str, ...] | _Unchanged = UNCHANGED
    membership_reason: str = ""


class RegistryView(Protocol):
    """Read access inside a transaction (what a plan may look at)."""

    def artifact(self, version: int) -> ArtifactRecord | None: ...

    def artifacts(self) -> list[ArtifactRecord]: ...

    def pointer(self) -> ActivePointer | None: ...

    def worker(self, worker_id: str) -> WorkerReport | None: ...

    def workers(self) -> dict[str, WorkerReport]: ...

    def max_version(self) -> int | None: ...

    def required_workers(self) -> tuple[str, ...] | None: ...


@runtime_checkable
class RegistryStore(Protocol):
    """What the coordinator needs from a backend; every coordinator test runs on each one."""

    def transact(
        self, plan: Callable[[RegistryView], tuple[RegistryStep, R]]
    ) -> tuple[R, list[ArtifactChanged]]: ...

    def artifact(self, version: int) -> ArtifactRecord | None: ...

    def artifacts(self) -> list[ArtifactRecord]: ...

    def pointer(self) -> ActivePointer | None: ...

    def workers(self) -> dict[str, WorkerReport]: ...

    def max_version(self) -> int | None: ...

    def required_workers(self) -> tuple[str, ...] | None: ...

    def history(self, version: int | None = None) -> list[ArtifactChanged]: ...

    def trace(self) -> list[TraceEvent]: ...

    def close(self) -> None: ...


def check_membership(workers: object) -> tuple[str, ...]:
    """A required worker set: a non-empty list of distinct, non-empty worker ids."""
    if isinstance(workers, str) or not isinstance(workers, Iterable):
        raise ActivationError(
            f"required workers must be a list of worker ids, got {brief(workers)} (a string would "
            "be split into letters)"
        )
    ws = tuple(workers)
    for w in ws:
        if not isinstance(w, str) or not w:
            raise ActivationError(f"worker id must be a non-empty string, got {brief(w)}")
    if not ws:
        raise ActivationError(
            "at least one required worker is needed: with none, a checkpoint on disk alone "
            "would activate"
        )
    dups = sorted({w for w in ws if ws.count(w) > 1})
    if dups:
        raise ActivationError(f"required workers listed more than once: {dups}")
    return ws


def counted_acks(view: RegistryView, rec: ArtifactRecord) -> dict[str, WorkerAck]:
    """Each worker's latest stored ack that can still speak for `rec`.

    An ack of `rec`'s version from an earlier distribution attempt is void: the worker may
    have loaded another version since (see WorkerAck.attempt), so it counts as missing.
    """
    return {
        w: r.ack
        for w, r in view.workers().items()
        if r.ack is not None and (r.ack.version != rec.version or r.ack.attempt == rec.attempts)
    }


def required_set(view: RegistryView) -> tuple[str, ...]:
    """The durable required worker set an activation is judged against (never a caller's)."""
    required = view.required_workers()
    if not required:
        raise ActivationError(
            "the registry records no required workers; set them with "
            "ActivationCoordinator(registry, required_workers=[...]) first"
        )
    return required


def reconcile_membership(
    stored: tuple[str, ...] | None, wanted: tuple[str, ...] | None
) -> tuple[str, ...] | None:
    """The set a coordinator attaches with: the stored one; `wanted` only if none is stored.

    Returns the set to record as the initial membership (None: nothing to record). A
    coordinator asking for another set than the stored one is refused: it must call
    `change_membership` explicitly.
    """
    if stored is None:
        if wanted is None:
            raise ActivationError(
                "this registry records no required workers yet; pass required_workers=[...] "
                "to set them"
            )
        return wanted
    if wanted is not None and set(wanted) != set(stored):
        raise ActivationError(
            f"the registry requires workers {sorted(stored)}, this coordinator was given "
            f"{sorted(wanted)}; every coordinator of a deployment uses the registry's set: "
            "omit required_workers, or change it explicitly with change_membership()"
        )
    return None


def activation_decision(view: RegistryView, rec: ArtifactRecord) -> dict[str, Any]:
    """The contract's activation decision (`activate_policy_version`) on STORED state.

    The coordinator plans with it and every registry write re-checks a pointer switch with
    it, reading the durable required worker set and the stored acks of the same step.
    """
    required = required_set(view)
    pointer = view.pointer()
    reports = counted_acks(view, rec)
    return activate_policy_version(
        None if pointer is None else attrs.asdict(pointer),
        {"version": rec.version, "artifact_hash": rec.artifact_hash, "committed": rec.committed},
        {w: {"version": a.version, "artifact_hash": a.artifact_hash} for w, a in reports.items()},
        required,
    )


def distribution_refusal(view: RegistryView, version: int) -> str | None:
    """Why `version` may not be distributed now (None: it may): only a version newer than
    the active one can ever activate, so an older one would only hold the one slot."""
    pointer = view.pointer()
    if pointer is not None and version <= pointer.version:
        return (
            f"v{version} is not newer than the active v{pointer.version}; only a newer "
            "version can be distributed (use rollback() to go back)"
        )
    return None


def activated_hash(store: RegistryStore, version: int) -> str | None:
    """The hash of `version` if it ever became the active version, else None.

    The admission gate's registry lookup: a behaviour version that never became active is
    a registration error. Reading it needs no coordinator and no worker set.
    """
    rec = store.artifact(version)
    if rec is None or rec.state not in WAS_ACTIVE_STATES:
        return None
    return rec.artifact_hash


def check_step(view: RegistryView, step: RegistryStep) -> None:
    """Refuse a step that would break a registry invariant, before anything is written.

    Before-images must equal the stored records (a plan built on a stale read is refused);
    a new version must exceed every version ever registered; a committed hash never changes;
    each version is changed at most once per step; a failure records its stage. The pointer
    moves only by an activation that `activation_decision` allows on the stored acks and the
    durable worker set, or by an explicit rollback to the recorded rollback pointer; a
    version no newer than the active one is never distributed.
    """
    seen: set[int] = set()
    top = view.max_version()
    pointer_before = view.pointer()
    if not isinstance(step.membership, _Unchanged):
        check_membership(step.membership)
        if step.artifacts or not isinstance(step.pointer, _Unchanged):
            raise ActivationError("a membership change is a step of its own")
    for ch in step.artifacts:
        v = ch.after.version
        if v in seen:
            raise ActivationError(f"one step changes artifact v{v} twice")
        seen.add(v)
        if ch.before is not None and ch.before.version != v:
            raise ActivationError(f"change of v{v} carries a before-image of v{ch.before.version}")
        current = view.artifact(v)
        if current != ch.before:
            raise ActivationError(
                f"artifact v{v} changed underneath this step (stored {current}, planned from "
                f"{ch.before}); re-read and retry"
            )
        if current is None and top is not None and v <= top:
            raise ActivationError(
                f"version {v} is not greater than every registered version (max {top}); "
                "versions are never reused"
            )
        if (
            current is not None
            and current.artifact_hash is not None
            and ch.after.artifact_hash != current.artifact_hash
        ):
            raise ActivationError(
                f"artifact v{v}: committed hash {current.artifact_hash} can never change"
            )
        problems = rules.artifact_stage_problems(ch.after)
        if problems:
            raise ActivationError("; ".join(problems))
        if ch.event in ("distribute", "retry"):
            why = distribution_refusal(view, v)
            if why is not None:
                raise ActivationError(why)
        if ch.event == "activate" and current is not None:
            decision = activation_decision(view, current)
            if not decision["activated"]:
                raise ActivationError(
                    f"refusing to activate v{v}: {decision['reason']} (missing "
                    f"{decision['missing_workers']}, mismatched {decision['mismatched_workers']})"
                )
            want = ActivePointer(v, decision["active_pointer"]["artifact_hash"])
            if step.pointer != want:
                raise ActivationError(f"activating v{v} must point at it, not at {step.pointer}")
    if not isinstance(step.pointer, _Unchanged) and step.pointer != pointer_before:
        _check_pointer_move(view, step, pointer_before)


def _check_pointer_move(
    view: RegistryView, step: RegistryStep, pointer_before: ActivePointer | None
) -> None:
    """The pointer moves only with an activation of its target, or an explicit rollback."""
    events = {ch.event: ch for ch in step.artifacts}
    new = step.pointer
    if new is None or isinstance(new, _Unchanged):
        raise ActivationError("the active pointer is never cleared")
    act = events.get("activate")
    if act is not None and act.after.version == new.version:
        return  # judged above by activation_decision
    back, up = events.get("roll_back"), events.get("reinstate")
    if (
        back is not None
        and up is not None
        and pointer_before is not None
        and back.before is not None
        and back.after.version == pointer_before.version
        and back.before.rollback_version == new.version
        and up.after.version == new.version
        and up.after.artifact_hash == new.artifact_hash
    ):
        return
    raise ActivationError(
        f"the pointer may move only by an activation or an explicit rollback to the recorded "
        f"rollback pointer (asked: {pointer_before} -> {new})"
    )


def make_events(
    step: RegistryStep,
    pointer_before: ActivePointer | None,
    membership_before: tuple[str, ...] | None = None,
) -> list[TraceEvent]:
    """The step's events, unstamped (seq/txn 0): the backend's log stamps them."""
    after = pointer_before if isinstance(step.pointer, _Unchanged) else step.pointer
    out: list[TraceEvent] = []
    if not isinstance(step.membership, _Unchanged):
        out.append(
            MembershipChanged(
                seq=0,
                txn=0,
                at=step.at,
                before=membership_before,
                after=step.membership,
                reason=step.membership_reason,
            )
        )
    out.extend(
        ArtifactChanged(
            seq=0,
            txn=0,
            at=step.at,
            version=ch.after.version,
            event=ch.event,
            before=ch.before,
            after=ch.after,
            pointer_before=pointer_before,
            pointer_after=after,
            acks=ch.acks,
            required_workers=ch.required_workers,
        )
        for ch in step.artifacts
    )
    out.extend(
        WorkerReported(seq=0, txn=0, at=step.at, worker_id=w.worker_id, floor=w.floor, ack=w.ack)
        for w in step.workers
    )
    return out


def _artifact_events(events: Sequence[TraceEvent]) -> list[ArtifactChanged]:
    return [e for e in events if isinstance(e, ArtifactChanged)]


# ---- memory --------------------------------------------------------------------------------


class _ViewReads:
    """Read methods both registries share: each reads its view under its own lock."""

    _lock: threading.RLock
    _view: RegistryView

    def artifact(self, version: int) -> ArtifactRecord | None:
        """The record of `version`, or None."""
        with self._lock:
            return self._view.artifact(version)

    def artifacts(self) -> list[ArtifactRecord]:
        """Every record, by version."""
        with self._lock:
            return self._view.artifacts()

    def pointer(self) -> ActivePointer | None:
        """The active pointer (None before the first activation)."""
        with self._lock:
            return self._view.pointer()

    def workers(self) -> dict[str, WorkerReport]:
        """Latest report per worker."""
        with self._lock:
            return self._view.workers()

    def max_version(self) -> int | None:
        """Highest version ever registered."""
        with self._lock:
            return self._view.max_version()

    def required_workers(self) -> tuple[str, ...] | None:
        """The deployment's durable required worker set (None until first set)."""
        with self._lock:
            return self._view.required_workers()


class _MemoryView:
    def __init__(self, reg: MemoryRegistry) -> None:
        self._reg = reg

    def artifact(self, version: int) -> ArtifactRecord | None:
        return self._reg._artifacts.get(version)

    def artifacts(self) -> list[ArtifactRecord]:
        return [self._reg._artifacts[v] for v in sorted(self._reg._artifacts)]

    def pointer(self) -> ActivePointer | None:
        return self._reg._pointer

    def worker(self, worker_id: str) -> WorkerReport | None:
        return self._reg._workers.get(worker_id)

    def workers(self) -> dict[str, WorkerReport]:
        return dict(self._reg._workers)

    def max_version(self) -> int | None:
        return max(self._reg._artifacts, default=None)

    def required_workers(self) -> tuple[str, ...] | None:
        return self._reg._membership


class MemoryRegistry(_ViewReads):
    """In-process registry; share `event_log` with a MemoryLedger for one global trace."""

    def __init__(self, event_log: EventLog | None = None) -> None:
        self._lock = threading.RLock()
        self._artifacts: dict[int, ArtifactRecord] = {}
        self._pointer: ActivePointer | None = None
        self._workers: dict[str, WorkerReport] = {}
        self._membership: tuple[str, ...] | None = None
        self.log = event_log if event_log is not None else EventLog()
        self._view = _MemoryView(self)

    @property
    def lock(self) -> threading.RLock:
        """The one lock of this registry's steps; an attached MemoryLedger shares it."""
        return self._lock

    def premise(self) -> ActivationPremise:
        """The active version and every ever-active version (caller holds `lock`)."""
        return ActivationPremise(
            None if self._pointer is None else self._pointer.version,
            frozenset(v for v, a in self._artifacts.items() if a.state in WAS_ACTIVE_STATES),
        )

    @classmethod
    def restore(
        cls,
        artifacts: Iterable[ArtifactRecord],
        pointer: ActivePointer | None,
        workers: Iterable[WorkerReport],
        event_log: EventLog | None = None,
        membership: Iterable[str] | None = None,
    ) -> MemoryRegistry:
        """A registry holding exactly these records, without their history.

        The explorer rebuilds a real registry from each state it expands, so the coordinator
        it checks is the production one, not a retyped copy.
        """
        reg = cls(event_log)
        reg._artifacts = {a.version: a for a in artifacts}
        reg._pointer = pointer
        reg._workers = {w.worker_id: w for w in workers}
        reg._membership = None if membership is None else check_membership(membership)
        return reg

    def transact(
        self, plan: Callable[[RegistryView], tuple[RegistryStep, R]]
    ) -> tuple[R, list[ArtifactChanged]]:
        """Plan and apply one step under the lock; a raising plan changes nothing."""
        with self._lock:
            step, result = plan(self._view)
            check_step(self._view, step)
            events = make_events(step, self._pointer, self._membership)
            for ch in step.artifacts:
                self._artifacts[ch.after.version] = ch.after
            if not isinstance(step.pointer, _Unchanged):
                self._pointer = step.pointer
            for w in step.workers:
                self._workers[w.worker_id] = w
            if not isinstance(step.membership, _Unchanged):
                self._membership = step.membership
            stamped = self.log.record(events) if events else []
            return result, _artifact_events(stamped)

    def history(self, version: int | None = None) -> list[ArtifactChanged]:
        """Artifact events in global order, optionally of one version."""
        return [
            e
            for e in self.log.events()
            if isinstance(e, ArtifactChanged) and (version is None or e.version == version)
        ]

    def trace(self) -> list[TraceEvent]:
        """Every registry event (artifacts, membership, worker reports) in global order."""
        return [e for e in self.log.events() if not isinstance(e, EntryChanged)]

    def close(self) -> None:
        """Nothing to release; protocol parity with SQLite."""


# ---- SQLite --------------------------------------------------------------------------------

_DDL = """
CREATE TABLE IF NOT EXISTS registry_artifacts (
    version          INTEGER PRIMARY KEY CHECK (version >= 0),
    artifact_hash    TEXT,
    parent_version   INTEGER,
    rollback_version INTEGER,
    state            TEXT NOT NULL,
    path             TEXT,
    failure          TEXT,
    attempts         INTEGER NOT NULL CHECK (attempts >= 0)
);
CREATE TABLE IF NOT EXISTS registry_pointer (
    id            INTEGER PRIMARY KEY CHECK (id = 1),
    version       INTEGER NOT NULL,
    artifact_hash TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS registry_workers (
    worker_id TEXT PRIMARY KEY,
    floor     INTEGER NOT NULL,
    ack       TEXT
);
CREATE TABLE IF NOT EXISTS registry_membership (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    workers TEXT NOT NULL
)
"""

# ensure_schema splits its DDL on ';', so triggers (whose bodies contain ';') go here; they
# hold the two write-once rules even against a writer that bypasses this module
_TRIGGERS = (
    """CREATE TRIGGER IF NOT EXISTS registry_hash_write_once
       BEFORE UPDATE OF artifact_hash ON registry_artifacts
       WHEN OLD.artifact_hash IS NOT NULL AND NEW.artifact_hash IS NOT OLD.artifact_hash
       BEGIN SELECT RAISE(ABORT, 'a committed artifact hash never changes'); END""",
    """CREATE TRIGGER IF NOT EXISTS registry_version_forward
       BEFORE INSERT ON registry_artifacts
       WHEN NEW.version <= (SELECT MAX(version) FROM registry_artifacts)
       BEGIN SELECT RAISE(ABORT, 'artifact versions are never reused'); END""",
)

_ART_COLS = (
    "version, artifact_hash, parent_version, rollback_version, state, path, failure, attempts"
)


def _int(x: object) -> int:
    if not isinstance(x, int):
        raise ActivationError(f"registry database holds {brief(x)} where an integer belongs")
    return x


def _opt_int(x: object) -> int | None:
    return None if x is None else _int(x)


def _opt_str(x: object) -> str | None:
    return None if x is None else str(x)


def _row_to_record(row: Sequence[object]) -> ArtifactRecord:
    version, h, parent, rollback, state, path, failure, attempts = row
    return ArtifactRecord(
        version=_int(version),
        artifact_hash=_opt_str(h),
        parent_version=_opt_int(parent),
        rollback_version=_opt_int(rollback),
        state=str(state),
        path=_opt_str(path),
        failure=None if failure is None else from_jsonable(Disposition, json.loads(str(failure))),
        attempts=_int(attempts),
    )


def _record_to_row(r: ArtifactRecord) -> tuple[object, ...]:
    failure = None if r.failure is None else json.dumps(to_jsonable(r.failure))
    return (
        r.version,
        r.artifact_hash,
        r.parent_version,
        r.rollback_version,
        r.state,
        r.path,
        failure,
        r.attempts,
    )


def _row_to_worker(row: Sequence[object]) -> WorkerReport:
    wid, floor, ack = row
    return WorkerReport(
        worker_id=str(wid),
        floor=_int(floor),
        ack=None if ack is None else from_jsonable(WorkerAck, json.loads(str(ack))),
    )


class SqlView:
    """What a registry plan may read, on the step's own connection (inside its transaction).

    One class for every SQL store: the queries are the same, only the DB-API parameter
    marker differs (`PARAM`: '?' for sqlite3, '%s' for psycopg).
    """

    PARAM = "?"

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def artifact(self, version: int) -> ArtifactRecord | None:
        row = self._conn.execute(
            f"SELECT {_ART_COLS} FROM registry_artifacts WHERE version = {self.PARAM}",
            (version,),
        ).fetchone()
        return None if row is None else _row_to_record(row)

    def artifacts(self) -> list[ArtifactRecord]:
        rows = self._conn.execute(
            f"SELECT {_ART_COLS} FROM registry_artifacts ORDER BY version"
        ).fetchall()
        return [_row_to_record(r) for r in rows]

    def pointer(self) -> ActivePointer | None:
        row = self._conn.execute(
            "SELECT version, artifact_hash FROM registry_pointer WHERE id = 1"
        ).fetchone()
        return None if row is None else ActivePointer(int(row[0]), str(row[1]))

    def worker(self, worker_id: str) -> WorkerReport | None:
        row = self._conn.execute(
            f"SELECT worker_id, floor, ack FROM registry_workers WHERE worker_id = {self.PARAM}",
            (worker_id,),
        ).fetchone()
        return None if row is None else _row_to_worker(row)

    def workers(self) -> dict[str, WorkerReport]:
        rows = self._conn.execute(
            "SELECT worker_id, floor, ack FROM registry_workers ORDER BY worker_id"
        ).fetchall()
        return {str(r[0]): _row_to_worker(r) for r in rows}

    def max_version(self) -> int | None:
        row = self._conn.execute("SELECT MAX(version) FROM registry_artifacts").fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def required_workers(self) -> tuple[str, ...] | None:
        row = self._conn.execute("SELECT workers FROM registry_membership WHERE id = 1").fetchone()
        return None if row is None else tuple(str(w) for w in json.loads(str(row[0])))


class _EmptyView:
    """A file with no registry tables, read without creating them: nothing registered."""

    def artifact(self, version: int) -> ArtifactRecord | None:
        return None

    def artifacts(self) -> list[ArtifactRecord]:
        return []

    def pointer(self) -> ActivePointer | None:
        return None

    def worker(self, worker_id: str) -> WorkerReport | None:
        return None

    def workers(self) -> dict[str, WorkerReport]:
        return {}

    def max_version(self) -> int | None:
        return None

    def required_workers(self) -> tuple[str, ...] | None:
        return None


def _sqlite_cause(exc: sqlite3.Error) -> str:
    text = str(exc)
    if "disk is full" in text or "SQLITE_FULL" in text:
        return f"{text}: no space left on the device"
    if "readonly" in text:
        return f"{text}: the file or its folder cannot be written"
    return text


def _unusable(path: Path, exc: Exception) -> ActivationError:
    return ActivationError(
        f"{path} is not a usable registry database ({exc}); give a new file, or the file "
        "this project's ledger and registry share"
    )


class SQLiteRegistry(_ViewReads):
    """The registry in a SQLite file, beside the ledger's tables (component "registry").

    Each step is one ``BEGIN IMMEDIATE ... COMMIT`` holding the record writes, the pointer
    and the events (appended to the shared `events` table), so a crash leaves either all
    of a step or none of it, and ledger and registry events share one global order.
    """

    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        """Open (creating the tables on first use) or, with `read_only`, only read: a file
        that holds no registry then reads as an empty one and nothing is ever created."""
        self.path = Path(path)
        self.read_only = read_only
        try:
            self._conn = connect(self.path, read_only=read_only)
        except sqlite3.Error as exc:
            raise _unusable(self.path, exc) from None
        view: RegistryView = SqlView(self._conn)
        try:
            if read_only:
                version = has_component(self._conn, COMPONENT)
                if version is None:
                    view = _EmptyView()
                elif version > SCHEMA_VERSION:
                    raise ActivationError(
                        f"database has registry schema version {version}, this program "
                        f"expects {SCHEMA_VERSION}: written by a newer rollout-lifecycle; upgrade"
                    )
            else:
                ensure_schema(self._conn, COMPONENT, SCHEMA_VERSION, _DDL, migrations=MIGRATIONS)
                for trig in _TRIGGERS:
                    self._conn.execute(trig)
        except sqlite3.Error as exc:
            self._conn.close()
            raise _unusable(self.path, exc) from None
        except BaseException:
            self._conn.close()
            raise
        self._lock = threading.RLock()
        self._view = view
        self._identity = file_identity(self.path)

    def transact(
        self, plan: Callable[[RegistryView], tuple[RegistryStep, R]]
    ) -> tuple[R, list[ArtifactChanged]]:
        """Plan and write one step inside BEGIN IMMEDIATE; any exception rolls it all back."""
        if self.read_only:
            raise ActivationError(f"registry {self.path} was opened read-only; nothing written")
        with self._lock:
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                check_identity(self.path, self._identity, "registry")
                step, result = plan(self._view)
                check_step(self._view, step)
                events = make_events(step, self._view.pointer(), self._view.required_workers())
                for ch in step.artifacts:
                    row = _record_to_row(ch.after)
                    if ch.before is None:
                        conn.execute(
                            f"INSERT INTO registry_artifacts({_ART_COLS}) VALUES (?,?,?,?,?,?,?,?)",
                            row,
                        )
                    else:
                        conn.execute(
                            "UPDATE registry_artifacts SET artifact_hash=?, parent_version=?, "
                            "rollback_version=?, state=?, path=?, failure=?, attempts=? "
                            "WHERE version=?",
                            (*row[1:], row[0]),
                        )
                if not isinstance(step.pointer, _Unchanged):
                    if step.pointer is None:
                        conn.execute("DELETE FROM registry_pointer")
                    else:
                        conn.execute(
                            "INSERT INTO registry_pointer(id, version, artifact_hash) "
                            "VALUES (1, ?, ?) ON CONFLICT(id) DO UPDATE SET "
                            "version=excluded.version, artifact_hash=excluded.artifact_hash",
                            (step.pointer.version, step.pointer.artifact_hash),
                        )
                for w in step.workers:
                    ack = None if w.ack is None else json.dumps(to_jsonable(w.ack))
                    conn.execute(
                        "INSERT INTO registry_workers(worker_id, floor, ack) VALUES (?,?,?) "
                        "ON CONFLICT(worker_id) DO UPDATE SET floor=excluded.floor, "
                        "ack=excluded.ack",
                        (w.worker_id, w.floor, ack),
                    )
                if not isinstance(step.membership, _Unchanged):
                    conn.execute(
                        "INSERT INTO registry_membership(id, workers) VALUES (1, ?) "
                        "ON CONFLICT(id) DO UPDATE SET workers=excluded.workers",
                        (json.dumps(list(step.membership)),),
                    )
                stamped = append_events(conn, events)
                conn.execute("COMMIT")
            except BaseException as exc:
                # SQLite may already have rolled back (a full disk does): a failing ROLLBACK
                # must not hide the real cause
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise ActivationError(
                        f"registry {self.path}: write failed, nothing written "
                        f"({_sqlite_cause(exc)})"
                    ) from exc
                raise
            return result, _artifact_events(stamped)

    def history(self, version: int | None = None) -> list[ArtifactChanged]:
        """Artifact events in global order (shared with the ledger's), optionally of one version."""
        with self._lock:
            evs = read_events(
                self._conn, kind="artifact", subject=None if version is None else str(version)
            )
        return [e for e in evs if isinstance(e, ArtifactChanged)]

    def trace(self) -> list[TraceEvent]:
        """Every registry event (artifacts, membership, worker reports) in global order."""
        with self._lock:
            evs = read_events(self._conn, exclude_kind="entry")
        return [e for e in evs if not isinstance(e, EntryChanged)]

    def close(self) -> None:
        """Close the connection; the file stays for the next coordinator."""
        with self._lock:
            self._conn.close()
