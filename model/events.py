"""The event trace: every successful write, as a before/after pair, in one global order.

Ledgers and the activation coordinator append here; spec/ replays a trace and checks the
invariants after each transaction (`txn`): a batch reservation, a commit, or a pointer switch
that steps one artifact down and another up is one atomic step, and invariants are judged
between atomic steps, never inside one.
"""

from __future__ import annotations

import hashlib
import json
import json.encoder
import math
import operator
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import attrs

from rollout_lifecycle.model.errors import InvalidRecord
from rollout_lifecycle.model.records import (
    ActivePointer,
    AdmissionPolicy,
    ArtifactRecord,
    AttemptToken,
    LedgerEntry,
    UpdateRecord,
    WorkerAck,
    from_jsonable,
    plain_maker,
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


_make_entry_changed = plain_maker(EntryChanged)  # EntryChanged(...), once per written row


def entry_events(changes: Sequence[Change], at: float) -> list[EntryChanged]:
    """A ledger step's events before a store numbers them (seq and txn 0: the durable
    stores stamp both as they append, under their events lock)."""
    make = _make_entry_changed
    return [make(0, 0, at, a.rollout_id, ev, b, a, u) for ev, b, a, u in changes]


@attrs.frozen
class ArtifactChanged:
    """An artifact's activation state changed; the pointer before/after is carried along.

    A distribution attempt (`distribute`, `retry`) carries the tokens it issued, one per
    required worker: the spec replays them to judge which acks an activation may use.
    `tokens` is None only on an event recorded before attempt tokens existed (its stored
    payload has no such field): the spec judges that attempt by its attempt number.
    """

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
    tokens: tuple[AttemptToken, ...] | None = ()


@attrs.frozen
class MembershipChanged:
    """The deployment's required worker set was set or changed: an explicit, recorded step.

    Every coordinator on the registry activates against this durable set (never its own
    copy), and the spec reads the premise of "every required worker acked" from it. A worker
    that leaves loses its acks and tokens in the same step; one that joins while a version
    awaits acks is issued a token of its own (`tokens`), so it must ack afresh. `tokens` is
    None only on a change recorded before attempt tokens existed (it voided nothing).
    """

    seq: int
    txn: int
    at: float
    before: tuple[str, ...] | None
    after: tuple[str, ...]
    reason: str
    kind: str = "membership"
    tokens: tuple[AttemptToken, ...] | None = ()


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


@attrs.frozen
class PolicyChanged:
    """The deployment's admission policy was set or changed: an explicit, recorded step.

    Every reservation is judged against the policy of its own moment; the spec reads the
    policy history from these events, never from a stamp a learner wrote.
    """

    seq: int
    txn: int
    at: float
    before: AdmissionPolicy | None
    after: AdmissionPolicy
    reason: str
    kind: str = "policy"


@attrs.frozen
class RowRecorded:
    """A row of a table that no other event determines was written (`row`: its columns) or
    deleted (`row` None): a schema version, the host clock's origin, a version marked bad.

    Recorded in the chain in the same transaction as the row, so `ledger check` replays
    these tables too and an edit of one of them no longer matches its history. `key` is
    the row's key column as text (RECORDED_TABLES names the column)."""

    seq: int
    txn: int
    at: float
    table: str
    key: str
    row: tuple[tuple[str, Any], ...] | None
    reason: str = ""
    kind: str = "row"

    def columns(self) -> dict[str, Any] | None:
        """The row as column -> value (None: deleted)."""
        return None if self.row is None else dict(self.row)


def row_event(
    table: str, key: object, row: Mapping[str, Any] | None, reason: str, at: float = 0.0
) -> RowRecorded:
    """The RowRecorded of one row written (or deleted) in a step, before a store numbers it."""
    cols = None if row is None else tuple((str(k), v) for k, v in row.items())
    return RowRecorded(0, 0, at, table, str(key), cols, reason)


# Tables whose rows no entry or registry event determines, by their key column: every write
# of one appends a RowRecorded in the same transaction (and the first writer of a store
# that predates this records the rows it finds: the seal, see SEAL).
RECORDED_TABLES: dict[str, str] = {
    "schema_meta": "component",
    "host_clock": "boot_id",
    "ledger_bad_versions": "version",
}

# The schema_meta row that says the store's recorded tables are in its chain (written with
# the RowRecorded events of every row those tables held then, and recorded itself).
SEAL = ("history", 1)

# Component schema versions only programs that chain their events ever wrote (the chain
# arrived with ledger 1 / registry 3 on SQLite, 2 on PostgreSQL; 3 is the bound for both): a
# store at one of these (or newer) without its chain had the chain removed.
CHAINED_SINCE: dict[str, int] = {"ledger": 2, "registry": 3}


def recorded_rows(conn: Any, present: set[str], why: str) -> list[TraceEvent]:
    """A RowRecorded of every row of every RECORDED_TABLES table in `present`, read through
    `conn` (a SQLite or PostgreSQL connection: plain SELECTs of fixed names), for a store
    that seals itself (see SEAL)."""
    at = time.time()
    out: list[TraceEvent] = []
    for table, key in RECORDED_TABLES.items():
        if table not in present:
            continue
        cur = conn.execute(f"SELECT * FROM {table} ORDER BY {key}")
        names = [str(d[0]) for d in cur.description or ()]
        for r in cur.fetchall():
            row = dict(zip(names, r, strict=True))
            out.append(row_event(table, row[key], row, why, at))
    return out


@attrs.frozen
class UpdateChanged:
    """An update's status in the ledger changed, or it was first recorded (`before` None).

    `event` is `open` (its first reservation), `land` (a commit of it consumed rollouts) or
    `poison` (with the record's cause). Written in the ledger step that caused it, so the
    spec replays every update's status from the trace.
    """

    seq: int
    txn: int
    at: float
    update_id: str
    event: str
    before: UpdateRecord | None
    after: UpdateRecord
    kind: str = "update"


# One update's change in a ledger step: (event, before, after).
UpdateChange = tuple[str, UpdateRecord | None, UpdateRecord]


def update_events(changes: Sequence[UpdateChange], at: float) -> list[UpdateChanged]:
    """A ledger step's update events before a store numbers them (seq and txn 0)."""
    return [UpdateChanged(0, 0, at, a.update_id, ev, b, a) for ev, b, a in changes]


TraceEvent = (
    EntryChanged
    | ArtifactChanged
    | MembershipChanged
    | WorkerReported
    | PolicyChanged
    | RowRecorded
    | UpdateChanged
)


def event_to_jsonable(ev: TraceEvent) -> dict[str, Any]:
    """One event as a JSON-able dict (the `kind` field tells which record it is)."""
    out = to_jsonable(ev)
    assert isinstance(out, dict)
    if isinstance(ev, RowRecorded):
        out["row"] = ev.columns()
    return out


def _tokens_from(data: dict[str, Any]) -> tuple[AttemptToken, ...] | None:
    """An event's attempt tokens; None when it was recorded before tokens existed."""
    if "tokens" not in data:
        return None
    return tuple(from_jsonable(AttemptToken, t) for t in data["tokens"])


def event_from_jsonable(data: dict[str, Any]) -> TraceEvent:
    """Inverse of `event_to_jsonable`."""
    kind = data.get("kind")
    if kind == "entry":
        if CHANGED in data:
            raise InvalidRecord(
                f"entry event of {data.get('rollout_id')!r} stores only what changed: it is "
                "read with the rollout's earlier events (EntryStates.event), not on its own"
            )
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
            tokens=_tokens_from(data),
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
            tokens=_tokens_from(data),
        )
    if kind == "update":
        before = data.get("before")
        return UpdateChanged(
            seq=int(data["seq"]),
            txn=int(data["txn"]),
            at=float(data["at"]),
            update_id=str(data["update_id"]),
            event=str(data["event"]),
            before=None if before is None else from_jsonable(UpdateRecord, before),
            after=from_jsonable(UpdateRecord, data["after"]),
        )
    if kind == "policy":
        before = data.get("before")
        return PolicyChanged(
            seq=int(data["seq"]),
            txn=int(data["txn"]),
            at=float(data["at"]),
            before=None if before is None else from_jsonable(AdmissionPolicy, before),
            after=from_jsonable(AdmissionPolicy, data["after"]),
            reason=str(data.get("reason", "")),
        )
    if kind == "row":
        row = data["row"]
        if row is not None and not isinstance(row, dict):
            raise InvalidRecord(f"row event: 'row' must be a JSON object or null, got {row!r}")
        return RowRecorded(
            seq=int(data["seq"]),
            txn=int(data["txn"]),
            at=float(data["at"]),
            table=str(data["table"]),
            key=str(data["key"]),
            row=None if row is None else tuple((str(k), v) for k, v in row.items()),
            reason=str(data.get("reason", "")),
        )
    raise ValueError(f"unknown trace event kind {kind!r}")


def event_subject(ev: TraceEvent) -> str:
    """The indexed subject of an event: rollout id, artifact version, worker id, update id,
    'policy', 'membership', or table/key of a recorded row."""
    if isinstance(ev, EntryChanged):
        return ev.rollout_id
    if isinstance(ev, ArtifactChanged):
        return str(ev.version)
    if isinstance(ev, WorkerReported):
        return ev.worker_id
    if isinstance(ev, PolicyChanged):
        return "policy"
    if isinstance(ev, RowRecorded):
        return f"{ev.table}/{ev.key}"
    if isinstance(ev, UpdateChanged):
        return ev.update_id
    return "membership"


# ---- the hash chain ------------------------------------------------------------------------
# Every stored event carries the hash of its predecessor and its own:
#     hash_n = sha256(hash_{n-1} || seq || txn || kind || subject || payload)
# over the row exactly as stored (seq and txn as 8-byte big-endian integers, each text
# length-prefixed so no two rows encode alike), starting from GENESIS. The chain covers
# every event kind alike, because it hashes the stored row, not fields of one kind. A
# store keeps its head (last seq, last hash) beside it, so a cut-off tail is seen too.

GENESIS = bytes(32)


def chain_hash(prev: bytes, seq: int, txn: int, kind: str, subject: str, payload: str) -> bytes:
    """The hash of one stored event row, chained to its predecessor's hash `prev`."""
    k = kind.encode("utf-8", "surrogatepass")
    s = subject.encode("utf-8", "surrogatepass")
    p = payload.encode("utf-8", "surrogatepass")
    # prev || seq || txn || len(kind) kind || len(subject) subject || len(payload) payload
    head = _PACK3(seq, txn, len(k))
    return _sha256(b"".join((prev, head, k, _PACK1(len(s)), s, _PACK1(len(p)), p))).digest()


def chain_broken(
    head_hash: object, tail_hash: object, tail_seq: object, base_seq: object
) -> str | None:
    """Why a writer must not chain onto this history (None: it may), from the head's hash and
    base seq and the newest stored event's hash and seq (None where missing).

    It may when the newest event is the one the head names, when there is no event and the
    head is the chain's start, or when the chain holds no event yet and every stored event
    predates it (seq within the base a pre-chain store's head recorded). Anything else is a
    history edited behind the writers' backs, which a writer must not seal by chaining on."""
    if not isinstance(head_hash, bytes):
        return "has no head (its events_chain row is missing: deleted, or the table dropped)"
    if tail_seq is None:
        if head_hash == GENESIS:
            return None
        return "names a last event, but no event is stored (the history was deleted)"
    if isinstance(tail_hash, bytes) and tail_hash == head_hash:
        return None
    if (
        head_hash == GENESIS
        and tail_hash is None
        and isinstance(base_seq, int)
        and isinstance(tail_seq, int)
        and tail_seq <= base_seq
    ):
        return None
    if tail_hash is None:
        return (
            f"ends in event #{tail_seq}, which carries no hash (hashes stripped, or added by hand)"
        )
    return (
        f"does not end in the event its head names (event #{tail_seq} is stored last): events "
        "were cut off, replaced or added by hand"
    )


_PACK3 = struct.Struct(">qqq").pack
_PACK1 = struct.Struct(">q").pack
_sha256 = hashlib.sha256


def stored_payload(ev: TraceEvent, txn: int | None) -> str:
    """An event's payload column: its JSON without `seq`, compact, in field order, with
    `txn` set to the step's number (None: left out, where the store keeps txn only in a
    column of its own). An entry event over an existing entry stores, in place of the
    whole `before` and `after`, only what changed (`CHANGED`: see `entry_changes`)."""
    if isinstance(ev, EntryChanged) and ev.before is not None:
        data: dict[str, Any] = {
            "txn": txn,
            "at": ev.at,
            "rollout_id": ev.rollout_id,
            "event": ev.event,
            CHANGED: entry_changes(ev.before, ev.after),
            "update_id": ev.update_id,
            "kind": ev.kind,
        }
    else:
        data = event_to_jsonable(ev)
        data.pop("seq", None)
        data["txn"] = txn
    if txn is None:
        data.pop("txn", None)
    return json.dumps(data, separators=(",", ":"))


# ---- entry events that store what changed --------------------------------------------------
# An entry event's payload holds the whole `after` only where the entry is created (`before`
# None). Every later event of the rollout holds, under CHANGED, the top-level LedgerEntry
# fields whose value differs from `before`, each encoded as `dump_entry` encodes it: a
# reader rebuilds `before` from the rollout's earlier events and `after` by laying the
# changed fields over it (`EntryStates`). Events written before this format (whole `before`
# and `after`) are still read as they are, so one history may hold both.

CHANGED = "changed"

ENTRY_FIELDS = tuple(a.name for a in attrs.fields(LedgerEntry))
ENTRY_VALUES = operator.attrgetter(*ENTRY_FIELDS)  # every field's value, in that order
_ENTRY_FIELDS, _ENTRY_VALUES = ENTRY_FIELDS, ENTRY_VALUES
_ENTRY_FIELD_SET = frozenset(_ENTRY_FIELDS)


def field_differs(a: object, b: object) -> bool:
    """Whether a field's value changed between two entries: by value, and by type too (so
    1 and 1.0 stay apart), so that laying the change over `before` rebuilds `after` exactly."""
    return a is not b and (type(a) is not type(b) or a != b)


def entry_changes(before: LedgerEntry, after: LedgerEntry) -> dict[str, Any]:
    """The fields of `after` that differ from `before`, in declaration order, each JSON-able
    as `to_jsonable(after)` holds it."""
    return {
        name: to_jsonable(new)
        for name, old, new in zip(
            _ENTRY_FIELDS, _ENTRY_VALUES(before), _ENTRY_VALUES(after), strict=True
        )
        if field_differs(old, new)
    }


_encode_str = json.encoder.encode_basestring_ascii  # what json.dumps uses for a str


def json_scalar(value: object) -> str:
    """`json.dumps(value)` of a scalar, without the encoder's per-call set-up for the common
    types (a str, an int, a finite float, None): the same text."""
    t = type(value)
    if t is str:
        text: str = _encode_str(cast(str, value))
        return text
    if value is None:
        return "null"
    if t is int or (t is float and math.isfinite(value)):  # type: ignore[arg-type]
        return repr(value)  # what the encoder writes for an exact int or a finite float
    return json.dumps(value)


def _shared_parts(ev: EntryChanged, txn: int | None) -> tuple[str, str, str]:
    """The text of an entry payload around its rollout id and its entries, which a step's
    events share (its txn, time, event, update and kind): encoded once per step and event
    (a step that lands and reserves a batch interleaves a few events row by row)."""
    key = (txn, ev.at, ev.event, ev.update_id, ev.kind)
    known = _PAYLOAD_PARTS[0]
    for seen, parts in known:
        if all(map(operator.is_, seen, key)):
            return parts
    head = "{" if txn is None else f'{{"txn":{json_scalar(txn)},'
    parts = (
        f'{head}"at":{json_scalar(ev.at)},"rollout_id":',
        f',"event":{json_scalar(ev.event)},',
        f',"update_id":{json_scalar(ev.update_id)},"kind":{json_scalar(ev.kind)}}}',
    )
    _PAYLOAD_PARTS[0] = ((key, parts), *known[: _PARTS_KEPT - 1])  # one atomic replacement
    return parts


def entry_payload(ev: EntryChanged, txn: int | None, after: str) -> str:
    """`stored_payload(ev, txn)` of an entry's creation (`ev.before` None) whose stored JSON
    text (`dump_entry(ev.after)`) is at hand: the same bytes, without encoding it again."""
    start, middle, end = _shared_parts(ev, txn)
    return f'{start}{json_scalar(ev.rollout_id)}{middle}"before":null,"after":{after}{end}'


def changed_payload(
    ev: EntryChanged, txn: int | None, changed: str, rollout_id: str | None = None
) -> str:
    """`stored_payload(ev, txn)` of a change of an existing entry, from `changed`: the
    compact JSON object of `entry_changes(ev.before, ev.after)`, made by a caller that
    knows which fields a step can have changed (`rollout_id`: the id's JSON, when the
    caller has it already: a row's events share it)."""
    start, middle, end = _shared_parts(ev, txn)
    rid = json_scalar(ev.rollout_id) if rollout_id is None else rollout_id
    return f'{start}{rid}{middle}"{CHANGED}":{changed}{end}'


# the latest steps' shared parts of entry payloads, newest first, by the identity of what
# they encode (the objects are held, so no id is reused; racing threads each store the
# parts they encoded)
_PARTS_KEPT = 4
_PAYLOAD_PARTS: list[tuple[tuple[tuple[object, ...], tuple[str, str, str]], ...]] = [()]


def events_where(
    mark: str,
    after_seq: int,
    kind: str | None,
    exclude_kind: str | None,
    subject: str | None,
) -> tuple[str, list[str | int]]:
    """The WHERE clause and its arguments with which a store reads events: after
    `after_seq`, optionally of one kind, not of another, of one subject (`mark`: the
    driver's placeholder, ``?`` or ``%s``). One filter, so the stores cannot come to
    disagree on what a read returns."""
    terms = (
        ("seq > ", after_seq),
        ("kind = ", kind),
        ("kind <> ", exclude_kind),
        ("subject = ", subject),
    )
    kept = [(column, value) for column, value in terms if value is not None]
    return " AND ".join(column + mark for column, _ in kept), [value for _, value in kept]


class EntryStates:
    """Each rollout's entry as the stored events read so far leave it: what turns an entry
    payload that stores only what changed back into `EntryChanged(before, after)`.

    Feed it a store's event payloads (decoded, with `seq` and `txn` set) in seq order; a
    reader that starts after the first event gives it the earlier events of the rollouts it
    meets first (`fold`), or keeps one across its reads. `before` of a rebuilt event is the
    very object the rollout's previous event left as `after`.
    """

    def __init__(self) -> None:
        # rollout id -> (its entry, or None until needed, and the entry as JSON-able dict)
        self._last: dict[str, tuple[LedgerEntry | None, dict[str, Any]]] = {}

    def unknown(self, payloads: Iterable[Mapping[str, Any]]) -> set[str]:
        """Rollouts whose first entry event among `payloads` stores only what changed and
        whose state this reader does not hold: their earlier events are needed first."""
        seen: set[str] = set()
        out: set[str] = set()
        for data in payloads:
            if data.get("kind") != "entry":
                continue
            rid = data.get("rollout_id")
            if not isinstance(rid, str) or rid in seen:
                continue
            seen.add(rid)
            if CHANGED in data and rid not in self._last:
                out.add(rid)
        return out

    def catch_up(
        self,
        payloads: Sequence[Mapping[str, Any]],
        earlier: Callable[[list[str]], Iterable[str]],
    ) -> None:
        """Before `event` reads `payloads` (a store's events after some seq): fold in the
        earlier stored payloads, in seq order, of the rollouts `unknown` names, which
        `earlier(ids)` reads from the store (one query, only when some are unknown)."""
        missing = self.unknown(payloads)
        if missing:
            for text in earlier(sorted(missing)):
                self.fold(json.loads(text))

    def fold(self, data: Mapping[str, Any]) -> None:
        """Take in an earlier entry event of a rollout without building its event: only its
        resulting entry, as JSON, is kept (decoded when a later event needs it)."""
        rid = data.get("rollout_id")
        if data.get("kind") != "entry" or not isinstance(rid, str):
            return
        self._last[rid] = (None, self._after_json(data, rid))

    def _after_json(self, data: Mapping[str, Any], rid: str) -> dict[str, Any]:
        changed = data.get(CHANGED)
        if changed is None and CHANGED not in data:
            after = data.get("after")
            if not isinstance(after, dict):
                raise InvalidRecord(f"entry event of {rid!r}: its 'after' is not a JSON object")
            return after
        if not isinstance(changed, dict):
            raise InvalidRecord(
                f"entry event of {rid!r}: {CHANGED!r} must be a JSON object of the fields "
                f"that changed, got {type(changed).__name__}"
            )
        unknown = changed.keys() - _ENTRY_FIELD_SET
        if unknown:
            raise InvalidRecord(
                f"entry event of {rid!r} changes unknown field(s) {sorted(unknown)}: not a "
                "LedgerEntry field (a payload edited, or written by a newer program)"
            )
        base = self._last.get(rid)
        if base is None:
            raise InvalidRecord(
                f"entry event of {rid!r} stores only what changed, but no earlier event of "
                "that rollout was read to lay it over: its creation event is missing"
            )
        return {**base[1], **changed}

    def event(self, data: dict[str, Any]) -> TraceEvent:
        """The trace event of one stored payload (`seq` and `txn` set), rebuilding an entry
        change from the rollout's previous state; InvalidRecord when it cannot be."""
        if data.get("kind") != "entry" or CHANGED not in data:
            ev = event_from_jsonable(data)
            if isinstance(ev, EntryChanged):
                self._last[ev.rollout_id] = (ev.after, data["after"])
            return ev
        rid = data.get("rollout_id")
        if not isinstance(rid, str):
            raise InvalidRecord(f"entry event: rollout_id must be a string, got {rid!r}")
        after_json = self._after_json(data, rid)
        before, before_json = self._last[rid]
        if before is None:
            before = from_jsonable(LedgerEntry, before_json)
        after = from_jsonable(LedgerEntry, after_json)
        self._last[rid] = (after, after_json)
        return _make_entry_changed(
            int(data["seq"]),
            int(data["txn"]),
            float(data["at"]),
            rid,
            str(data["event"]),
            before,
            after,
            data.get("update_id"),
        )


Payload = Callable[[TraceEvent, "int | None"], str]


@attrs.frozen
class StoredEvent:
    """One row of a store's events table as stored; `hash` None: written before the chain."""

    seq: int
    txn: int
    kind: str
    subject: str
    payload: str
    prev_hash: bytes | None = None
    hash: bytes | None = None


@attrs.frozen
class ChainHead:
    """The chain's head, stored beside the events and updated in the same transaction.

    `base_seq`/`base_count`: the events already stored when the chain began (an unchained
    prefix, written by a program that predates it). `last_seq`/`last_hash`: the newest
    chained event, so a history cut off at the end no longer matches its head.
    """

    base_seq: int
    base_count: int
    last_seq: int
    last_hash: bytes


@attrs.frozen
class StoredRows:
    """Everything a store holds, read in one consistent snapshot: what `ledger check` audits.

    `tables` maps each table name to its rows (column -> value, as the driver returns
    them); `chained` is False where the events table predates the chain (a database no
    writer of this version has opened yet), and `head` is None there.
    """

    events: Sequence[StoredEvent]
    head: ChainHead | None
    tables: Mapping[str, Sequence[Mapping[str, Any]]]
    chained: bool = True


class EventLog:
    """An in-memory, thread-safe, append-only trace; share one between ledger and coordinator
    so their events land in one global order.

    Like the durable stores, it chains its events by hash (over the payload a SQLite store
    would write), so the same audit runs on memory, SQLite and PostgreSQL. It chains them
    when they are first read by `stored_events` (an audit), not as they are appended:
    nothing outside the process can edit them, and hashing every append would cost the
    memory ledger three times its write. An audit therefore notices any later edit,
    deletion, reordering or truncation of what an earlier read sealed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[TraceEvent] = []
        # (prev_hash, hash) of each event, and the head (last seq, last hash) kept apart
        self._links: list[tuple[bytes, bytes]] = []
        self._head: tuple[int, bytes] = (0, GENESIS)
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

    def record_entries(
        self, at: float, changes: Sequence[Change], updates: Sequence[UpdateChange] = ()
    ) -> None:
        """`record` for a ledger step of (event, before, after, update_id) changes and the
        update records it wrote (after the entries, as `record` orders them): each event is
        built once, already stamped, instead of built then copied (a batch reservation
        opens an update, and built every event twice)."""
        with self._lock:
            self._txn += 1
            txn, base = self._txn, len(self._events)
            make = _make_entry_changed
            self._events.extend(
                make(base + i, txn, at, after.rollout_id, event, before, after, update)
                for i, (event, before, after, update) in enumerate(changes, 1)
            )
            base += len(changes)
            self._events.extend(
                UpdateChanged(base + i, txn, at, after.update_id, event, before, after)
                for i, (event, before, after) in enumerate(updates, 1)
            )

    def events(self) -> list[TraceEvent]:
        """A copy of the whole trace, in order."""
        with self._lock:
            return list(self._events)

    def stored_events(self) -> tuple[list[StoredEvent], ChainHead]:
        """The trace as rows with their chain links, and the head: what an audit reads.

        Events not read before are chained now (sealed); every row's payload is rebuilt
        from the event held now, so an event replaced after it was sealed no longer
        matches its hash.
        """
        with self._lock:
            seq, prev = self._head
            for ev in self._events[len(self._links) :]:
                payload = stored_payload(ev, ev.txn)
                h = chain_hash(prev, ev.seq, ev.txn, ev.kind, event_subject(ev), payload)
                self._links.append((prev, h))
                seq, prev = ev.seq, h
            self._head = (seq, prev)
            events, links = list(self._events), list(self._links)
        rows = [
            StoredEvent(
                ev.seq, ev.txn, ev.kind, event_subject(ev), stored_payload(ev, ev.txn), p, h
            )
            for ev, (p, h) in zip(events, links, strict=False)
        ]
        return rows, ChainHead(0, 0, seq, prev)

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

    def __bool__(self) -> bool:
        # an empty log is still a log: `log or EventLog()` must not swap in a fresh one
        return True


def chain_evidence(query: Callable[[str, tuple[Any, ...]], Any], contains: str) -> str | None:
    """What in a store's own tables says it once had a hash chain (None: nothing), shared
    by both SQL stores' `chain_required`: `query(sql, args)` runs SQL written with ``?``
    marks and returns its cursor; `contains` is the dialect's "payload contains ?" test."""
    for component, version in query("SELECT component, version FROM schema_meta", ()):
        if component == SEAL[0]:
            return "its schema_meta says it was sealed"
        since = CHAINED_SINCE.get(str(component))
        if since is not None and int(version) >= since:
            return (
                f"its {component} schema is version {version}, which only chaining programs write"
            )
    if query("SELECT 1 FROM events WHERE kind = 'row' LIMIT 1", ()).fetchone():
        return "it holds recorded-row events, which only chaining programs write"
    if query(
        f"SELECT 1 FROM events WHERE kind = 'entry' AND {contains} LIMIT 1", (f'"{CHANGED}":',)
    ).fetchone():
        return "it holds entry events that store what changed, which only chaining programs write"
    return None
