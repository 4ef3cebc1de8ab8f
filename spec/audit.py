"""A store's history and rows, audited: is the trace intact, and is every stored column what
replaying it gives?

`ledger check` judges one consistent snapshot of a store (`StoredRows`) three ways:

1. The hash chain. Every event a writer stores carries its predecessor's hash and its own,
   hash_n = sha256(hash_{n-1} || seq || txn || kind || subject || payload) over the row as
   stored; the store keeps the head (last seq, last hash) beside it. The hash is recomputed
   here, on its own (PostgreSQL's writer computes it in SQL, SQLite's and memory's in
   model.events; this module shares neither), so an edited, deleted, reordered or cut-off
   event is named with its seq, and so is a last event replaced in place with its hash
   recomputed (the head is compared by seq AND hash). Events stored before the chain
   existed are an unchained prefix, not a violation; the head records how many there were.
   The chain cannot be switched off: a store that had one (its seal, its schema versions,
   its events' hashes, or events only a chaining program writes say so) and lost its head,
   its hashes or its hash columns is a violation (`history_missing`), never "not verified".
   With anchors (heads the operator wrote down elsewhere, `ledger anchor`), the chain must
   still pass through every one: a history rewritten with every hash recomputed is caught.
2. The replay of the trace through the invariants (`spec.invariants.check_trace`).
3. Every stored table, through one declared list (`VERIFIED`): the deployment's tables
   compared column by column with the replayed world (an edited column, a row with no
   history, history with no row); the bookkeeping tables whose rows no other event
   determines (schema versions, the host clock's origin, versions marked bad) compared with
   the rows their own events record; the counters with the counts of recorded writes; the
   commit marks by shape. Tables (or columns) not in the list are listed as not compared,
   never passed silently.

All three are linear in the number of events and rows. A hash chain without a key is
tamper-EVIDENT against edits that do not recompute every later hash and the head; whoever
can rewrite the whole events table and its head can forge a consistent history, unless an
anchor from before the rewrite is checked.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import struct
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from rollout_lifecycle.model.errors import RolloutLifecycleError
from rollout_lifecycle.model.events import (
    CHANGED,
    ChainHead,
    EntryChanged,
    RowRecorded,
    StoredEvent,
    StoredRows,
    TraceEvent,
    event_from_jsonable,
)
from rollout_lifecycle.model.records import (
    ArtifactRecord,
    Disposition,
    LedgerEntry,
    WorkerAck,
    from_jsonable,
)
from rollout_lifecycle.spec.invariants import (
    STORE_INVARIANTS,
    TraceReport,
    Violation,
    World,
    check_trace,
)

HISTORY_INVARIANTS: dict[str, str] = {
    "history_edited": "Every chained event still matches the hash it was written with: none "
    "of its columns (seq, txn, kind, subject, payload) was edited.",
    "history_deleted": "Every chained event names the hash of the event stored before it: "
    "no event was deleted between them.",
    "history_reordered": "Chained events are stored in the order they were chained.",
    "history_truncated": "The chain ends where its head (last seq and hash) says: no event "
    "was cut off the end, and none was added past it.",
    "history_unchained": "Every event after the chain began carries its hash, the "
    "unchained prefix (events stored before the chain existed) is as large as it was then, "
    "and holds no event only a chaining program writes.",
    "history_rewritten": "The chain ends in the very event its head names, by seq and by "
    "hash: no event was replaced and the chain recomputed after it.",
    "history_missing": "A store that has a hash chain keeps it: its head and its events' "
    "hashes (its seal, its schema versions, hashes stored or events only a chaining program "
    "writes say that it has one).",
    "history_unreadable": "Every stored event reads back as a trace event.",
}
# checked only when anchors are given (`ledger check --anchor FILE`)
ANCHOR_INVARIANT = (
    "history_anchor",
    "The chain still passes through every head anchored outside the store (seq and hash): a "
    "history rewritten with every hash recomputed no longer does.",
)

_GENESIS = bytes(32)  # the predecessor of the first chained event


# ---- 1. the hash chain -----------------------------------------------------------------


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _prefixed(value: object) -> bytes | None:
    if not isinstance(value, str):
        return None
    raw = value.encode("utf-8", "surrogatepass")
    return struct.pack(">q", len(raw)) + raw


def row_hash(ev: StoredEvent) -> bytes | None:
    """The hash `ev`'s row must carry, chained to the predecessor it names; None when a
    column holds a value no writer stores there (itself an edit)."""
    seq, txn, prev = _int(ev.seq), _int(ev.txn), ev.prev_hash
    texts = [_prefixed(ev.kind), _prefixed(ev.subject), _prefixed(ev.payload)]
    if seq is None or txn is None or not isinstance(prev, bytes) or None in texts:
        return None
    try:
        numbers = struct.pack(">qq", seq, txn)
    except struct.error:
        return None
    return hashlib.sha256(prev + numbers + b"".join(t for t in texts if t)).digest()


@attrs.frozen
class Anchor:
    """A head the operator wrote down outside the store (`ledger anchor`): the chain must
    still pass through it. `line` and `time` only name it in findings."""

    seq: int
    hash: bytes
    time: str = ""
    line: int = 0

    def label(self) -> str:
        """How a finding names it."""
        when = f", {self.time}" if self.time else ""
        return f"anchor #{self.line} (event #{self.seq}, hash {self.hash.hex()[:16]}...{when})"


@attrs.frozen
class HistoryReport:
    """What the chain says: its findings, how many events it verified, the unchained
    prefix, the head's last seq and hash, whether the store has a chain at all, why it
    must have one (None: it may predate the chain), and how many anchors were checked."""

    violations: tuple[Violation, ...]
    chained: int
    unchained_prefix: int
    head_seq: int | None
    has_chain: bool
    head_hash: bytes | None = None
    required: str | None = None
    anchors: int = 0

    def summary(self) -> dict[str, Any]:
        """The report's `history` object."""
        return {
            "chained_events": self.chained,
            "unchained_prefix": self.unchained_prefix,
            "head_seq": self.head_seq,
            "head_hash": None if self.head_hash is None else self.head_hash.hex(),
            "has_chain": self.has_chain,
            "required": self.required,
            "anchors_checked": self.anchors,
        }


def _label(ev: StoredEvent) -> str:
    """The event by kind and subject (the finding's seq says which one)."""
    return f"the {ev.kind} event of {ev.subject!r}"


# ---- when a store must have a chain (the writers' own rule, stated here again) ------------

# component schema versions only programs that chain their events wrote (model.events.
# CHAINED_SINCE: ledger 2; registry 3 on SQLite, 2 on PostgreSQL, 3 bounds both)
_CHAINED_SINCE = {"ledger": 2, "registry": 3}
_SEAL = "history"  # the schema_meta row a sealed store holds (model.events.SEAL)


def _only_chaining(ev: StoredEvent) -> bool:
    """Whether only a program that chains its events ever writes an event like `ev`: a
    recorded row, or an entry event storing only what changed."""
    if ev.kind == "row":
        return True
    return ev.kind == "entry" and isinstance(ev.payload, str) and f'"{CHANGED}":' in ev.payload


def chain_required(stored: StoredRows) -> str | None:
    """Why this store must have a hash chain, or None where it may predate the chain."""
    if stored.head is not None:
        return "its head is stored"
    if any(isinstance(ev.hash, bytes) for ev in stored.events):
        return "its events carry hashes"
    for row in stored.tables.get("schema_meta", ()):
        component, version = row.get("component"), _int(row.get("version"))
        if component == _SEAL:
            return "its schema_meta says it was sealed"
        since = _CHAINED_SINCE.get(str(component))
        if since is not None and version is not None and version >= since:
            return (
                f"its {component} schema is version {version}, which only chaining programs write"
            )
    for ev in stored.events:
        if _only_chaining(ev):
            return f"event #{ev.seq} ({ev.kind}) is one only chaining programs write"
    return None


def verify_history(stored: StoredRows, anchors: Sequence[Anchor] = ()) -> HistoryReport:
    """Walk the events in seq order once: recompute each hash, follow each link, then hold
    the end of the chain against its head (seq and hash) and against every anchor."""
    events = stored.events
    required = chain_required(stored)
    if not stored.chained and stored.head is None and required is None:
        # written by a program that predates the chain, and no writer has opened it since
        lost = tuple(_unanchorable(a, "the store has no hash chain") for a in anchors)
        return HistoryReport(lost, 0, len(events), None, False, None, None, len(anchors))
    out: list[Violation] = []
    if not stored.chained:
        out.append(
            Violation(
                "history_missing",
                f"the events table has no hash columns although {required}: the chain was "
                "removed (and every event with it is unverified)",
            )
        )
    head = stored.head
    head_edited = head is not None and not _head_readable(head)
    if head is not None and head_edited:
        out.append(
            Violation("history_truncated", f"the chain's head is unreadable ({head!r}): edited")
        )
        head = None
    # without a head, hash-less events before the first chained one count as the prefix
    base_seq = None if head is None else _int(head.base_seq)
    prefix = chained = 0
    last: StoredEvent | None = None
    broken: list[tuple[StoredEvent, StoredEvent | None]] = []
    for ev in events:
        if ev.hash is None:
            seq = _int(ev.seq)
            if last is None and seq is not None and (base_seq is None or seq <= base_seq):
                prefix += 1
                if _only_chaining(ev):
                    out.append(
                        Violation(
                            "history_unchained",
                            f"{_label(ev)} carries no hash, but only a program that chains "
                            "its events writes such an event: its hash was stripped",
                            seq,
                        )
                    )
            elif stored.chained:
                out.append(
                    Violation(
                        "history_unchained",
                        f"{_label(ev)} carries no hash although the chain began before it "
                        "(written by a program without the chain, or inserted by hand)",
                        seq,
                    )
                )
            continue
        chained += 1
        if row_hash(ev) != ev.hash:
            out.append(
                Violation(
                    "history_edited",
                    f"{_label(ev)} no longer matches the hash it was written with: a column "
                    "of it was edited",
                    _int(ev.seq),
                )
            )
        if ev.prev_hash != (_GENESIS if last is None else last.hash):
            broken.append((ev, last))
        last = ev
    out.extend(_classify_breaks(events, broken))
    if head is None and not head_edited and (events or stored.chained):
        out.insert(  # first: what the findings about single events follow from
            int(not stored.chained),
            Violation(
                "history_missing",
                f"the chain's head is missing although {required or 'the store has a chain'}"
                + (
                    f" (the last chained event is #{last.seq}): it was deleted, so a cut-off "
                    "tail could no longer be seen"
                    if last is not None
                    else ": deleted with the hashes, or never written by a writer of this program"
                ),
            ),
        )
    elif not head_edited:
        out.extend(_check_head(head, last, prefix))
    out.extend(check_anchors(events, anchors))
    head_seq = None if head is None else _int(head.last_seq)
    head_hash = None if head is None or not isinstance(head.last_hash, bytes) else head.last_hash
    return HistoryReport(
        tuple(out), chained, prefix, head_seq, True, head_hash, required, len(anchors)
    )


def _unanchorable(anchor: Anchor, why: str) -> Violation:
    return Violation(
        ANCHOR_INVARIANT[0],
        f"{anchor.label()} cannot be found: {why} (removed, or another store)",
        anchor.seq,
    )


def check_anchors(events: Sequence[StoredEvent], anchors: Sequence[Anchor]) -> list[Violation]:
    """Each anchored head against the stored event of its seq: the same hash, or the history
    up to it was rewritten (the event's hash commits to every event before it, through the
    links the walk verified); no such event, or the history was cut off or deleted."""
    if not anchors:
        return []
    by_seq = {ev.seq: ev for ev in events if _int(ev.seq) is not None}
    newest = max(by_seq, default=None)
    out = []
    for a in anchors:
        ev = by_seq.get(a.seq)
        if ev is not None and ev.hash == a.hash:
            continue
        if ev is not None:
            got = ev.hash.hex()[:16] + "..." if isinstance(ev.hash, bytes) else "no hash"
            msg = (
                f"{a.label()}: event #{a.seq} is stored with {got}: the history up to it was "
                "rewritten since it was anchored (its hashes recomputed, or stripped)"
            )
        elif newest is None or a.seq > newest:
            msg = (
                f"{a.label()}: the history ends at event #{newest}, before it: cut off since "
                "it was anchored, or an older copy of the store was put back"
            )
        else:
            msg = f"{a.label()}: event #{a.seq} is no longer stored: deleted since it was anchored"
        out.append(Violation(ANCHOR_INVARIANT[0], msg, a.seq))
    return out


def _head_readable(head: ChainHead) -> bool:
    return all(
        _int(x) is not None for x in (head.base_seq, head.base_count, head.last_seq)
    ) and isinstance(head.last_hash, bytes)


def _classify_breaks(
    events: Sequence[StoredEvent], broken: Sequence[tuple[StoredEvent, StoredEvent | None]]
) -> list[Violation]:
    """A link that names no stored event means events were deleted before it; one that
    names another stored event means the events were reordered. One more pass finds the
    events the broken links name, so the whole audit stays linear."""
    wanted = {ev.prev_hash for ev, _ in broken}
    where: dict[object, object] = {}
    for ev in events:
        if ev.hash in wanted and ev.hash is not None:
            where.setdefault(ev.hash, ev.seq)
    out = []
    for ev, before in broken:
        after = "the start of the chain" if before is None else f"event #{before.seq}"
        named = where.get(ev.prev_hash)
        if named is not None:
            out.append(
                Violation(
                    "history_reordered",
                    f"{_label(ev)} was chained right after event #{named}, but is stored "
                    f"after {after}: events were reordered",
                    _int(ev.seq),
                )
            )
        elif ev.prev_hash == _GENESIS:
            out.append(
                Violation(
                    "history_deleted",
                    f"the chain starts again at {_label(ev)} (stored after {after}): its "
                    "head was deleted or reset before it was written, or the events before "
                    "it were",
                    _int(ev.seq),
                )
            )
        else:
            out.append(
                Violation(
                    "history_deleted",
                    f"events are missing before {_label(ev)}: the hash it was chained to "
                    f"matches no stored event (it is stored after {after}); they were deleted",
                    _int(ev.seq),
                )
            )
    return out


def head_matches(head: ChainHead, last: StoredEvent) -> bool:
    """Whether the last chained event is the one the head names: by seq and by hash (a
    head compared by seq only misses a last event replaced with its hash recomputed)."""
    return head.last_seq == last.seq and head.last_hash == last.hash


def _check_head(head: ChainHead | None, last: StoredEvent | None, prefix: int) -> list[Violation]:
    """The end of the stored chain against the head written with every append."""
    out: list[Violation] = []
    if head is None:
        return out
    if head.base_count != prefix:
        out.append(
            Violation(
                "history_unchained",
                f"the unchained prefix holds {prefix} events, {head.base_count} when the "
                "chain began: events stored before the chain were deleted or added",
            )
        )
    if last is None:
        if head.last_hash != _GENESIS:
            out.append(
                Violation(
                    "history_truncated",
                    f"the head names event #{head.last_seq}, but no chained event is stored: "
                    "the whole chain was cut off",
                )
            )
        return out
    if head_matches(head, last):
        return out
    last_seq = _int(last.seq)
    if last_seq is not None and head.last_seq > last_seq:
        msg = (
            f"the history ends at event #{last.seq}, but its head names event "
            f"#{head.last_seq}: the events after #{last.seq} were cut off"
        )
    elif last_seq is not None and head.last_seq < last_seq:
        msg = (
            f"the head names event #{head.last_seq}, but chained events run on to "
            f"#{last.seq}: events were added past the head"
        )
    else:
        out.append(
            Violation(
                "history_rewritten",
                f"the last event #{last.seq} is not the one the head names (its hash "
                "differs): an event was replaced and the chain recomputed after it",
                last_seq,
            )
        )
        return out
    out.append(Violation("history_truncated", msg, last_seq))
    return out


# ---- 2. the trace ------------------------------------------------------------------------


def read_trace(stored: StoredRows) -> tuple[list[TraceEvent], list[Violation]]:
    """The stored events as trace events, and one finding per event that cannot be read
    (it is left out of the replay, which then names what it leaves unexplained).

    An entry event that stores only what changed is rebuilt here, on its own: its fields
    laid over the entry its rollout's previous readable event left (`_rebuilt`)."""
    out: list[TraceEvent] = []
    bad: list[Violation] = []
    # rollout id -> the entry its last readable event left, and that entry as stored JSON
    last: dict[str, tuple[LedgerEntry, dict[str, Any]]] = {}
    for ev in stored.events:
        try:
            if not isinstance(ev.payload, str):
                raise TypeError(f"payload is {type(ev.payload).__name__}, not text")
            data = json.loads(ev.payload)
            if not isinstance(data, dict):
                raise TypeError("payload is not a JSON object")
            data["seq"] = ev.seq
            data.setdefault("txn", ev.txn)  # PostgreSQL keeps txn in its column only
            if data.get("kind") == "entry" and CHANGED in data:
                event: TraceEvent = _rebuilt(data, last)
            else:
                event = event_from_jsonable(data)
                if isinstance(event, EntryChanged):
                    last[event.rollout_id] = (event.after, data["after"])
            out.append(event)
        except (ValueError, TypeError, KeyError, RolloutLifecycleError) as exc:
            bad.append(
                Violation(
                    "history_unreadable",
                    f"{_label(ev)} cannot be read back ({exc})",
                    _int(ev.seq),
                )
            )
    return out, bad


_ENTRY_FIELDS = frozenset(f.name for f in attrs.fields(LedgerEntry))


def _rebuilt(
    data: dict[str, Any], last: dict[str, tuple[LedgerEntry, dict[str, Any]]]
) -> EntryChanged:
    """An entry event stored as what changed: `before` is what the rollout's previous
    readable event left, `after` that entry's JSON with the changed fields laid over it."""
    rid, changed = data["rollout_id"], data[CHANGED]
    if not isinstance(rid, str):
        raise TypeError(f"rollout_id is {type(rid).__name__}, not text")
    if not isinstance(changed, dict):
        raise TypeError(f"{CHANGED!r} is {type(changed).__name__}, not a JSON object")
    unknown = sorted(changed.keys() - _ENTRY_FIELDS)
    if unknown:
        raise ValueError(f"it changes field(s) {unknown} that no ledger entry has")
    base = last.get(rid)
    if base is None:
        raise ValueError(
            f"it stores only what changed, but no readable earlier event of {rid!r} "
            "(its creation) precedes it"
        )
    before, before_json = base
    after_json = {**before_json, **changed}
    after = from_jsonable(LedgerEntry, after_json)
    last[rid] = (after, after_json)
    return EntryChanged(
        seq=int(data["seq"]),
        txn=int(data["txn"]),
        at=float(data["at"]),
        rollout_id=rid,
        event=str(data["event"]),
        before=before,
        after=after,
        update_id=data.get("update_id"),
    )


# ---- 3. every stored column ----------------------------------------------------------------

Decoder = Callable[[Any], Any]


def _json_record(cls: type[Any]) -> Decoder:
    def decode(text: Any) -> Any:
        return None if text is None else from_jsonable(cls, json.loads(text))

    return decode


def _json_names(text: Any) -> tuple[str, ...]:
    names = json.loads(text)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise TypeError("not a JSON list of worker ids")
    return tuple(names)


def _lineage(text: Any) -> tuple[str, ...]:
    return () if text is None else _json_names(text)


@attrs.frozen
class Replay:
    """What the trace says the store holds: the replayed world, each recorded table's rows
    as its RowRecorded events leave them (table -> key text -> columns), how many entry
    events of each kind and in how many steps (for the counters), the unchained prefix, and
    whether the trace holds the seal (from then on every recorded table is in the chain)."""

    world: World
    rows: Mapping[str, Mapping[str, Mapping[str, Any]]]
    events: Mapping[str, int]
    steps: Mapping[str, int]
    prefix: int
    sealed: bool


def replay_rows(events: Sequence[TraceEvent]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each recorded table's rows as the trace's RowRecorded events leave them."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for ev in events:
        if isinstance(ev, RowRecorded):
            table = out.setdefault(ev.table, {})
            if ev.row is None:
                table.pop(ev.key, None)
            else:
                table[ev.key] = dict(ev.row)
    return out


def _tallies(events: Sequence[TraceEvent]) -> tuple[dict[str, int], dict[str, int]]:
    """Entry events by event name, and the steps (txns) holding at least one of each."""
    counts: Counter[str] = Counter()
    steps: dict[str, set[int]] = {}
    for ev in events:
        if isinstance(ev, EntryChanged):
            counts[ev.event] += 1
            steps.setdefault(ev.event, set()).add(ev.txn)
    return dict(counts), {k: len(v) for k, v in steps.items()}


@attrs.frozen
class _Table:
    """How one stored table follows from the replay: its key column(s), the expected row
    per key (column -> value), decoders for columns stored as JSON, and whether its key is
    compared as text (a recorded table's key, as its events name it)."""

    name: str
    key: tuple[str, ...]
    expected: Callable[[Replay], Mapping[Any, Mapping[str, Any]]]
    label: Callable[[Any], str]
    decoders: Mapping[str, Decoder] = attrs.field(factory=dict)
    text_key: bool = False


def _fields(record: Any) -> dict[str, Any]:
    return {f.name: getattr(record, f.name) for f in attrs.fields(type(record))}


def _claimed(replay: Replay) -> dict[str, set[int]]:
    """Each update id the replayed versions' lineages name -> those versions."""
    out: dict[str, set[int]] = {}
    for v, a in (replay.world.artifacts or {}).items():
        for u in a.trained_by:
            out.setdefault(u, set()).add(v)
    return out


@attrs.frozen
class _Mark:
    """What an update's lineage mark (`ledger_updates.claimed`, a hint) may hold: 1 only
    where a version's lineage names the update, NULL anywhere (a mark not yet set costs a
    reader a probe, never a wrong answer; a mark with no claim hides the update from the
    default lineage)."""

    claimed: bool

    def __eq__(self, stored: object) -> bool:
        return stored is None or (self.claimed and stored == 1)

    def __hash__(self) -> int:
        return hash(self.claimed)

    def __repr__(self) -> str:
        return "1 or NULL" if self.claimed else "NULL (no version's lineage names it)"


def _updates(replay: Replay) -> dict[str, dict[str, Any]]:
    claimed = _claimed(replay)
    return {
        u: {**_fields(x), "claimed": _Mark(u in claimed)} for u, x in replay.world.updates.items()
    }


def _one(record: Any) -> dict[int, dict[str, Any]]:
    return {} if record is None else {1: _fields(record)}


# Each table's replay, stated here on its own: the column layout is the stores' (SQLite and
# PostgreSQL use the same names), the values come from the replayed world only.
_TABLES: tuple[_Table, ...] = (
    _Table(
        "rollouts",
        ("rollout_id",),
        lambda r: {rid: {**_fields(e), "entry": e} for rid, e in r.world.entries.items()},
        str,
        {"entry": _json_record(LedgerEntry)},
    ),
    _Table(
        "registry_artifacts",
        ("version",),
        lambda r: {v: _fields(a) for v, a in (r.world.artifacts or {}).items()},
        lambda v: f"artifact v{v}",
        # an empty lineage is stored as NULL (rows written before lineage existed too)
        {"failure": _json_record(Disposition), "trained_by": _lineage},
    ),
    _Table("registry_pointer", ("id",), lambda r: _one(r.world.pointer), lambda _: "pointer"),
    _Table(
        "registry_workers",
        ("worker_id",),
        lambda r: {k: _fields(w) for k, w in r.world.workers.items()},
        lambda k: f"worker {k!r}",
        {"ack": _json_record(WorkerAck)},
    ),
    _Table(
        "registry_membership",
        ("id",),
        lambda r: (
            {} if r.world.required_workers is None else {1: {"workers": r.world.required_workers}}
        ),
        lambda _: "required workers",
        {"workers": _json_names},
    ),
    _Table(
        "registry_policy", ("id",), lambda r: _one(r.world.policy), lambda _: "admission policy"
    ),
    _Table("ledger_updates", ("update_id",), _updates, lambda u: f"update {u!r}"),
    # the lineage index (model.lineage_index): one row per update a version's lineage names
    _Table(
        "registry_claims",
        ("update_id", "version"),
        lambda r: {(u, v): {} for u, vs in _claimed(r).items() for v in vs},
        lambda k: f"lineage claim of update {k[0]!r} by v{k[1]}",
    ),
    _Table(
        "registry_attempt_tokens",
        ("version", "worker_id"),
        lambda r: {k: _fields(t) for k, t in r.world.tokens.items()},
        lambda k: f"attempt token of v{k[0]} for {k[1]!r}",
    ),
)


def _recorded(name: str, key: str, what: str) -> _Table:
    """A table whose rows only its own RowRecorded events determine, keyed by `key`."""
    return _Table(
        name,
        (key,),
        lambda r: r.rows.get(name, {}),
        lambda k: f"{what} {k!r}",
        text_key=True,
    )


@attrs.frozen
class StoreReport:
    """Stored rows against the replay: findings, what was compared, what was not (table or
    table.column -> why), and how many rollout rows the store holds."""

    violations: tuple[Violation, ...]
    compared: tuple[str, ...]
    not_compared: Mapping[str, str]
    rows: int


def _show(value: Any) -> str:
    if isinstance(value, LedgerEntry | ArtifactRecord):
        return type(value).__name__  # the differing fields are named instead
    return repr(value)


def _json_like(expected: Any, stored: Any) -> Decoder | None:
    """A decoder for a text column holding a record or a list as JSON, where no table
    names one (a column another feature added): read it as the replayed value's type."""
    if not isinstance(stored, str) or isinstance(expected, str):
        return None
    if attrs.has(type(expected)):
        return _json_record(type(expected))
    if isinstance(expected, tuple):
        return lambda text: tuple(json.loads(text))
    return None


def _differences(
    table: _Table, want: Mapping[str, Any], row: Mapping[str, Any], skipped: set[str]
) -> list[str]:
    """Each stored column that differs from the replayed value, described."""
    out = []
    for col, got in row.items():
        if table.key == ("id",) and col == "id":
            if got != 1:
                out.append(f"id: stored {got!r}, the only row is id 1")
            continue
        if col in table.key:
            continue
        if col not in want:
            skipped.add(f"{table.name}.{col}")
            continue
        decode = table.decoders.get(col) or _json_like(want[col], got)
        if decode is not None:
            try:
                got = decode(got)
            except (ValueError, TypeError, KeyError, RolloutLifecycleError) as exc:
                out.append(f"{col} holds unreadable JSON ({exc})")
                continue
        expected = want[col]
        if got == expected:
            continue
        if isinstance(expected, LedgerEntry | ArtifactRecord) and type(got) is type(expected):
            fields = [k for k, v in _fields(expected).items() if getattr(got, k) != v]
            out.append(f"{col} JSON differs in {', '.join(fields)}")
        else:
            out.append(f"{col}: stored {_show(got)}, replayed {_show(expected)}")
    return out


def _compare_table(
    table: _Table, replay: Replay, rows: Sequence[Mapping[str, Any]], skipped: set[str]
) -> list[Violation]:
    name = "stored_matches_trace"
    want_rows = table.expected(replay)
    out: list[Violation] = []
    seen: set[Any] = set()
    rollouts = table.name == "rollouts"
    for row in rows:
        if table.key == ("id",):
            key: Any = 1  # a table of one row
        elif len(table.key) == 1:
            key = row.get(table.key[0])
            if table.text_key:
                key = str(key)
        else:
            key = tuple(row.get(c) for c in table.key)
        if key in seen:
            out.append(Violation(name, f"{table.label(key)}: stored twice"))
            continue
        seen.add(key)
        want = want_rows.get(key)
        if want is None:
            what = f"({row.get('state')})" if rollouts else str(dict(row))
            out.append(
                Violation(name, f"{table.label(key)}: stored {what} but no trace event wrote it")
            )
            continue
        diffs = _differences(table, want, row, skipped)
        if not diffs:
            continue
        if rollouts:
            head = (
                f"{key}: stored {row.get('state')} rev {row.get('revision')}, the trace says "
                f"{want['state']} rev {want['revision']}"
            )
            out.append(Violation(name, f"{head} ({'; '.join(diffs)})"))
        else:
            out.append(Violation(name, f"{table.label(key)}: {'; '.join(diffs)}"))
    for key in want_rows.keys() - seen:
        want = want_rows[key]
        what = f" ({want['state']})" if rollouts else ""
        out.append(Violation(name, f"{table.label(key)}: in the trace{what} but not stored"))
    return out


# ---- the declared list: every stored table, and how it is verified -------------------------

Check = Callable[[Replay, Sequence[Mapping[str, Any]], set[str]], list[Violation]]


@attrs.frozen
class Verified:
    """One stored table and how `ledger check` verifies it: `how` (one line, for the report
    and docs/design.md), `check` (the replay, the stored rows, a set collecting columns it
    skips -> findings), and `when` (the replay -> None to compare, or why it cannot be:
    a store sealed by no program of this version yet)."""

    name: str
    how: str
    check: Check
    when: Callable[[Replay], str | None] = lambda _: None


def _replayed(table: _Table) -> Check:
    return lambda replay, rows, skipped: _compare_table(table, replay, rows, skipped)


def _if_sealed(replay: Replay) -> str | None:
    if replay.sealed:
        return None
    return (
        "written before this program recorded its rows in the chain (the store is not "
        "sealed: its first writer of this version records them on open)"
    )


# counters a ledger stores, by what their history says: exact (each counts recorded writes
# of one kind) or a floor (each counts calls, and a commit or abort of nothing writes none)
_EXACT_COUNTERS = {"writes": None, "reservations": "reserve", "expirations": "expire_lease"}
_FLOOR_COUNTERS = {"commits": ("commit", "committed"), "aborts": ("abort", "aborted")}


def _counters(
    replay: Replay, rows: Sequence[Mapping[str, Any]], skipped: set[str]
) -> list[Violation]:
    """The durable counters (summed over the shards a store keeps them in) against the
    recorded writes: exact while the whole history is chained (an unchained prefix may
    have lost events its counts include), never fewer in any case."""
    sums: Counter[str] = Counter()
    out: list[Violation] = []
    for row in rows:
        name, n = row.get("name"), _int(row.get("n"))
        if n is None or n < 0:
            out.append(
                Violation(
                    "stored_matches_trace", f"ledger counter {name!r}: {row.get('n')!r} is no count"
                )
            )
            continue
        sums[str(name)] += n
    exact = replay.prefix == 0
    total = sum(replay.events.values())
    for name, event in _EXACT_COUNTERS.items():
        want = total if event is None else replay.events.get(event, 0)
        got = sums.pop(name, 0)
        if got < want or (exact and got != want):
            out.append(
                Violation(
                    "stored_matches_trace",
                    f"ledger counter {name}: stored {got}, the history records {want}",
                )
            )
    for name, (event, done) in _FLOOR_COUNTERS.items():
        want = replay.steps.get(event, 0)
        got = sums.pop(name, 0)
        if got < want:
            out.append(
                Violation(
                    "stored_matches_trace",
                    f"ledger counter {name}: stored {got}, but the history holds {want} steps "
                    f"that {done} rollouts",
                )
            )
    for name in sums:
        skipped.add(f"ledger_counters.{name}")
    return out


_TOKEN = frozenset("0123456789abcdef")


def _marks(replay: Replay, rows: Sequence[Mapping[str, Any]], skipped: set[str]) -> list[Violation]:
    """Commit marks by shape: one random 32-hex-digit token per writing transaction, and
    when it was written. Which marks should exist the history cannot say (a mark is the
    client's own random token; old ones are pruned)."""
    out = []
    for row in rows:
        token = row.get("token")
        if not (isinstance(token, str) and len(token) == 32 and set(token) <= _TOKEN):
            out.append(
                Violation(
                    "stored_matches_trace",
                    f"commit mark {token!r}: not a token a client writes (32 hex digits)",
                )
            )
        if row.get("at") is None:
            out.append(Violation("stored_matches_trace", f"commit mark {token!r}: no time"))
    return out


VERIFIED: tuple[Verified, ...] = (
    *(
        Verified(
            t.name, "replayed: every column equals the world the trace replays to", _replayed(t)
        )
        for t in _TABLES
    ),
    Verified(
        "schema_meta",
        "recorded: each component's schema version as its RowRecorded events (written with "
        "every create and migration, and by the seal) leave it",
        _replayed(_recorded("schema_meta", "component", "schema of")),
        _if_sealed,
    ),
    Verified(
        "host_clock",
        "recorded: each boot's origin (which every lease deadline adds to) as the RowRecorded "
        "its first writer appended with it",
        _replayed(_recorded("host_clock", "boot_id", "host clock origin of boot")),
        _if_sealed,
    ),
    Verified(
        "ledger_bad_versions",
        "recorded: each mark and its reason as the RowRecorded of quarantine_version and "
        "clear_bad_version leave them",
        _replayed(_recorded("ledger_bad_versions", "version", "bad-version mark of")),
        _if_sealed,
    ),
    Verified(
        "ledger_counters",
        "counted: writes, reservations and expirations equal the recorded writes of their "
        "kind; commits and aborts are at least the steps that committed or aborted rollouts",
        _counters,
    ),
    Verified(
        "commit_marks",
        "by shape: 32-hex-digit random tokens with a time (the history cannot say which "
        "should exist)",
        _marks,
    ),
)
_KNOWN = {v.name: v for v in VERIFIED}
# tables that only index others: a store written before them lacks them, and a reader then
# answers from what they index (dropping one hides nothing)
_DERIVED = {
    "registry_claims": "absent: a store no writer of this version has opened; lineage is "
    "read from registry_artifacts.trained_by, which is compared"
}


def compare_store(replay: Replay, stored: StoredRows) -> StoreReport:
    """Every stored table through VERIFIED; the others are listed as not compared."""
    out: list[Violation] = []
    skipped: set[str] = set()
    compared: list[str] = []
    not_compared: dict[str, str] = {}
    stored_seal = any(r.get("component") == _SEAL for r in stored.tables.get("schema_meta", ()))
    if stored_seal and not replay.sealed:
        out.append(
            Violation(
                "stored_matches_trace",
                "schema_meta holds the seal, but no stored event records it: the events "
                "that did were deleted, or the history was rewritten without them",
            )
        )
    for name in sorted(stored.tables):
        rows = stored.tables[name]
        check = _KNOWN.get(name)
        if check is None:
            not_compared[name] = (
                "not in spec.audit.VERIFIED: no replay of this table is known, so the trace "
                "does not say what it holds"
            )
            continue
        why = check.when(replay)
        if why is not None:
            not_compared[name] = why
            continue
        compared.append(name)
        out.extend(check.check(replay, rows, skipped))
    for name in sorted(_KNOWN.keys() - stored.tables.keys()):
        if name in _DERIVED:
            not_compared[name] = _DERIVED[name]
            continue
        check = _KNOWN[name]
        if check.when(replay) is None and check.check(replay, (), set()):
            # a table the replay fills is missing altogether: so is every row it should hold
            compared.append(name)
            out.extend(check.check(replay, (), skipped))
    for col in sorted(skipped):
        not_compared[col] = "no field of the replayed record names this column"
    count = len(stored.tables.get("rollouts", ()))
    return StoreReport(tuple(out), tuple(compared), not_compared, count)


# ---- all three ---------------------------------------------------------------------------


@attrs.frozen
class AuditReport:
    """The chain, the replay and the store comparison of one snapshot."""

    history: HistoryReport
    unreadable: tuple[Violation, ...]
    trace: TraceReport
    store: StoreReport

    @property
    def violations(self) -> list[Violation]:
        """Every finding: the chain's first, then unreadable events, replay, store."""
        return [
            *self.history.violations,
            *self.unreadable,
            *self.trace.violations,
            *self.store.violations,
        ]

    @property
    def checked(self) -> list[str]:
        """Names of everything judged: history (anchors when given), replay invariants, the
        store comparison."""
        anchored = [ANCHOR_INVARIANT[0]] if self.history.anchors else []
        return [*HISTORY_INVARIANTS, *anchored, *self.trace.checked, *STORE_INVARIANTS]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, back as it was after.

    An audit allocates a few objects per event (trace events, replayed entries, decoded
    rows) that all live until it returns and form no cycles worth collecting. With the
    collector on, every full collection that those allocations trigger walks all of them
    again, so the cost per event grows with the size of the history (and of whatever the
    caller holds, such as the stored rows). Paused, the audit's cost per event stays flat.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def audit(
    stored: StoredRows, *, quiescent: bool = False, anchors: Sequence[Anchor] = ()
) -> AuditReport:
    """Judge one snapshot of a store: chain (and `anchors`), replay through the invariants,
    every table (with the garbage collector paused: see `collector_paused`)."""
    with collector_paused():
        history = verify_history(stored, anchors)
        events, unreadable = read_trace(stored)
        trace = check_trace(events, quiescent=quiescent, with_registry=True)
        rows = replay_rows(events)
        sealed = _SEAL in rows.get("schema_meta", {}) or "schema_meta" not in stored.tables
        counts, steps = _tallies(events)
        replay = Replay(trace.final, rows, counts, steps, history.unchained_prefix, sealed)
        store = compare_store(replay, stored)
    return AuditReport(history, tuple(unreadable), trace, store)
