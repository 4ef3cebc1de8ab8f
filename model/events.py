"""The event trace: every successful write, as a before/after pair, in one global order.

Ledgers and the activation coordinator append here; spec/ replays a trace and checks the
invariants after each transaction (`txn`): a batch reservation, a commit, or a pointer switch
that steps one artifact down and another up is one atomic step, and invariants are judged
between atomic steps, never inside one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import attrs

from rollout_lifecycle.model.records import (
    ActivePointer,
    ArtifactRecord,
    LedgerEntry,
    WorkerAck,
    from_jsonable,
    to_jsonable,
)

# One rollout's change in a ledger step: (event, before, after, update_id).
Change = tuple[str, LedgerEntry | None, LedgerEntry, str | None]


@attrs.frozen
class EntryChanged:
    """A rollout's ledger entry was written (or created, when `before` is None)."""

    seq: int
    txn: int
    at: float
    rollout_id: str
    event: str
    before: LedgerEntry | None
    after: LedgerEntry
    update_id: str | None = None
    kind: str = "entry"


def entry_events(changes: Sequence[Change], at: float) -> list[EntryChanged]:
    """A ledger step's events before a store numbers them (seq and txn 0: the durable
    stores stamp both as they append, under their events lock)."""
    return [EntryChanged(0, 0, at, a.rollout_id, ev, b, a, u) for ev, b, a, u in changes]


@attrs.frozen
class ArtifactChanged:
    """An artifact's activation state changed; the pointer before/after is carried along."""

    seq: int
    txn: int
    at: float
    version: int
    event: str
    before: ArtifactRecord | None
    after: ArtifactRecord
    pointer_before: ActivePointer | None
    pointer_after: ActivePointer | None
    acks: tuple[WorkerAck, ...] = ()
    required_workers: tuple[str, ...] = ()
    kind: str = "artifact"


@attrs.frozen
class MembershipChanged:
    """The deployment's required worker set was set or changed: an explicit, recorded step.

    Every coordinator on the registry activates against this durable set (never its own
    copy), and the spec reads the premise of "every required worker acked" from it.
    """

    seq: int
    txn: int
    at: float
    before: tuple[str, ...] | None
    after: tuple[str, ...]
    reason: str
    kind: str = "membership"


@attrs.frozen
class WorkerReported:
    """A worker's stored report changed: a counted ack, or a restart that raised its floor.

    Recorded in the trace so that the spec judges an activation against the acks that were
    really stored, not against the acks the coordinator says it used.
    """

    seq: int
    txn: int
    at: float
    worker_id: str
    floor: int
    ack: WorkerAck | None
    kind: str = "worker"


TraceEvent = EntryChanged | ArtifactChanged | MembershipChanged | WorkerReported


def event_to_jsonable(ev: TraceEvent) -> dict[str, Any]:
    """One event as a JSON-able dict (the `kind` field tells which record it is)."""
    out = to_jsonable(ev)
    assert isinstance(out, dict)
    return out


def event_from_jsonable(data: dict[str, Any]) -> TraceEvent:
    """Inverse of `event_to_jsonable`."""
    kind = data.get("kind")
    if kind == "entry":
        return EntryChanged(
            seq=int(data["seq"]),
            txn=int(data["txn"]),
            at=float(data["at"]),
            rollout_id=str(data["rollout_id"]),
            event=str(data["event"]),
            before=None if data["before"] is None else from_jsonable(LedgerEntry, data["before"]),
            after=from_jsonable(LedgerEntry, data["after"]),
            update_id=data.get("update_id"),
        )
    if kind == "artifact":
        return ArtifactChanged(
            seq=int(data["seq"]),
            txn=int(data["txn"]),
            at=float(data["at"]),
            version=int(data["version"]),
            event=str(data["event"]),
            before=None
            if data["before"] is None
            else from_jsonable(ArtifactRecord, data["before"]),
            after=from_jsonable(ArtifactRecord, data["after"]),
            pointer_before=None
            if data["pointer_before"] is None
            else from_jsonable(ActivePointer, data["pointer_before"]),
            pointer_after=None
            if data["pointer_after"] is None
            else from_jsonable(ActivePointer, data["pointer_after"]),
            acks=tuple(from_jsonable(WorkerAck, a) for a in data.get("acks", ())),
            required_workers=tuple(data.get("required_workers", ())),
        )
    if kind == "worker":
        ack = data.get("ack")
        return WorkerReported(
            seq=int(data["seq"]),
            txn=int(data["txn"]),
            at=float(data["at"]),
            worker_id=str(data["worker_id"]),
            floor=int(data["floor"]),
            ack=None if ack is None else from_jsonable(WorkerAck, ack),
        )
    if kind == "membership":
        before = data.get("before")
        return MembershipChanged(
            seq=int(data["seq"]),
            txn=int(data["txn"]),
            at=float(data["at"]),
            before=None if before is None else tuple(str(w) for w in before),
            after=tuple(str(w) for w in data["after"]),
            reason=str(data.get("reason", "")),
        )
    raise ValueError(f"unknown trace event kind {kind!r}")


class EventLog:
    """An in-memory, thread-safe, append-only trace; share one between ledger and coordinator
    so their events land in one global order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[TraceEvent] = []
        self._txn = 0

    def record(self, events: Sequence[TraceEvent]) -> list[TraceEvent]:
        """Append the events of one atomic step, stamping one txn number and consecutive seqs."""
        with self._lock:
            self._txn += 1
            base = len(self._events)
            stamped: list[TraceEvent] = [
                attrs.evolve(e, seq=base + i + 1, txn=self._txn) for i, e in enumerate(events)
            ]
            self._events.extend(stamped)
            return stamped

    def record_entries(self, at: float, changes: Sequence[Change]) -> None:
        """`record` for a ledger step of (event, before, after, update_id) changes: each
        EntryChanged is built once, already stamped, instead of built then copied."""
        with self._lock:
            self._txn += 1
            txn, base = self._txn, len(self._events)
            self._events.extend(
                EntryChanged(base + i, txn, at, after.rollout_id, event, before, after, update)
                for i, (event, before, after, update) in enumerate(changes, 1)
            )

    def events(self) -> list[TraceEvent]:
        """A copy of the whole trace, in order."""
        with self._lock:
            return list(self._events)

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

    def __bool__(self) -> bool:
        # an empty log is still a log: `log or EventLog()` must not swap in a fresh one
        return True
