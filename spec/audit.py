"""A store's history and rows, audited: is the trace intact, and is every stored column what
replaying it gives?

`ledger check` judges one consistent snapshot of a store (`StoredRows`) three ways:

1. The hash chain. Every event a writer stores carries its predecessor's hash and its own,
   hash_n = sha256(hash_{n-1} || seq || txn || kind || subject || payload) over the row as
   stored; the store keeps the head (last seq, last hash) beside it. The hash is recomputed
   here, on its own (PostgreSQL's writer computes it in SQL, SQLite's and memory's in
   model.events; this module shares neither), so an edited, deleted, reordered or cut-off
   event is named with its seq. Events stored before the chain existed are an unchained
   prefix: reported as such, not a violation; the head records how many there were.
2. The replay of the trace through the invariants (`spec.invariants.check_trace`).
3. Every stored column of every table whose replay is known, compared with the replayed
   world: an edited column (the `state` of a consumed rollout set back to 'rewarded', a
   revision set to 99), a row with no history and history with no row. Tables (or columns)
   this module cannot replay are listed as not compared, never passed silently.

All three are linear in the number of events and rows. A hash chain without a key is
tamper-EVIDENT against edits that do not recompute every later hash and the head; whoever
can rewrite the whole events table and its head can forge a consistent history.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from rollout_lifecycle.model.errors import RolloutLifecycleError
from rollout_lifecycle.model.events import (
    CHANGED,
    ChainHead,
    EntryChanged,
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
    "history_unchained": "Every event after the chain began carries its hash, and the "
    "unchained prefix (events stored before the chain existed) is as large as it was then.",
    "history_unreadable": "Every stored event reads back as a trace event.",
}

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
class HistoryReport:
    """What the chain says: its findings, how many events it verified, the unchained
    prefix, the head's last seq, and whether the store has a chain at all."""

    violations: tuple[Violation, ...]
    chained: int
    unchained_prefix: int
    head_seq: int | None
    has_chain: bool

    def summary(self) -> dict[str, Any]:
        """The report's `history` object."""
        return {
            "chained_events": self.chained,
            "unchained_prefix": self.unchained_prefix,
            "head_seq": self.head_seq,
            "has_chain": self.has_chain,
        }


def _label(ev: StoredEvent) -> str:
    """The event by kind and subject (the finding's seq says which one)."""
    return f"the {ev.kind} event of {ev.subject!r}"


def verify_history(stored: StoredRows) -> HistoryReport:
    """Walk the events in seq order once: recompute each hash, follow each link, then hold
    the end of the chain against its head."""
    events = stored.events
    if not stored.chained:
        # written by a program that predates the chain, and no writer has opened it since
        return HistoryReport((), 0, len(events), None, False)
    out: list[Violation] = []
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
            else:
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
    if not head_edited:
        out.extend(_check_head(head, last, prefix))
    head_seq = None if head is None else _int(head.last_seq)
    return HistoryReport(tuple(out), chained, prefix, head_seq, True)


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


def _check_head(head: ChainHead | None, last: StoredEvent | None, prefix: int) -> list[Violation]:
    """The end of the stored chain against the head written with every append."""
    out = []
    if head is None:
        if last is not None:
            out.append(
                Violation(
                    "history_truncated",
                    f"the chain's head is missing (the last chained event is #{last.seq}): "
                    "it was deleted, so a cut-off tail could no longer be seen",
                )
            )
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
    if head.last_seq == last.seq and head.last_hash == last.hash:
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
        msg = (
            f"the last event #{last.seq} is not the one the head names (its hash differs): "
            "the tail was replaced"
        )
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
class _Table:
    """How one stored table follows from the replayed world: its key column, the expected
    row per key (column -> value), and decoders for columns stored as JSON."""

    name: str
    key: tuple[str, ...]
    expected: Callable[[World], Mapping[Any, Mapping[str, Any]]]
    label: Callable[[Any], str]
    decoders: Mapping[str, Decoder] = attrs.field(factory=dict)


def _fields(record: Any) -> dict[str, Any]:
    return {f.name: getattr(record, f.name) for f in attrs.fields(type(record))}


def _one(record: Any) -> dict[int, dict[str, Any]]:
    return {} if record is None else {1: _fields(record)}


# Each table's replay, stated here on its own: the column layout is the stores' (SQLite and
# PostgreSQL use the same names), the values come from the replayed world only.
_TABLES: tuple[_Table, ...] = (
    _Table(
        "rollouts",
        ("rollout_id",),
        lambda w: {rid: {**_fields(e), "entry": e} for rid, e in w.entries.items()},
        str,
        {"entry": _json_record(LedgerEntry)},
    ),
    _Table(
        "registry_artifacts",
        ("version",),
        lambda w: {v: _fields(a) for v, a in (w.artifacts or {}).items()},
        lambda v: f"artifact v{v}",
        # an empty lineage is stored as NULL (rows written before lineage existed too)
        {"failure": _json_record(Disposition), "trained_by": _lineage},
    ),
    _Table("registry_pointer", ("id",), lambda w: _one(w.pointer), lambda _: "pointer"),
    _Table(
        "registry_workers",
        ("worker_id",),
        lambda w: {k: _fields(r) for k, r in w.workers.items()},
        lambda k: f"worker {k!r}",
        {"ack": _json_record(WorkerAck)},
    ),
    _Table(
        "registry_membership",
        ("id",),
        lambda w: {} if w.required_workers is None else {1: {"workers": w.required_workers}},
        lambda _: "required workers",
        {"workers": _json_names},
    ),
    _Table("registry_policy", ("id",), lambda w: _one(w.policy), lambda _: "admission policy"),
    _Table(
        "ledger_updates",
        ("update_id",),
        lambda w: {u: _fields(r) for u, r in w.updates.items()},
        lambda u: f"update {u!r}",
    ),
    _Table(
        "registry_attempt_tokens",
        ("version", "worker_id"),
        lambda w: {k: _fields(t) for k, t in w.tokens.items()},
        lambda k: f"attempt token of v{k[0]} for {k[1]!r}",
    ),
)
_KNOWN = {t.name: t for t in _TABLES}

# tables a store holds whose content the trace does not determine, and why
_NOT_REPLAYABLE: dict[str, str] = {
    "ledger_bad_versions": "marking a version bad and lifting the mark write no event, so "
    "the marks cannot be replayed",
    "ledger_counters": "counters of calls (a commit or abort of nothing counts, and writes "
    "nothing), not of recorded writes",
}


@attrs.frozen
class StoreReport:
    """Stored rows against the replayed world: findings, what was compared, what was not
    (table or table.column -> why), and how many rollout rows the store holds."""

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
    table: _Table, world: World, rows: Sequence[Mapping[str, Any]], skipped: set[str]
) -> list[Violation]:
    name = "stored_matches_trace"
    want_rows = table.expected(world)
    out: list[Violation] = []
    seen: set[Any] = set()
    rollouts = table.name == "rollouts"
    for row in rows:
        if table.key == ("id",):
            key: Any = 1  # a table of one row
        elif len(table.key) == 1:
            key = row.get(table.key[0])
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


def compare_store(world: World, stored: StoredRows) -> StoreReport:
    """Every stored table whose replay is known, column by column, against `world` (the
    replayed trace); the others are listed as not compared, with the reason."""
    out: list[Violation] = []
    skipped: set[str] = set()
    compared: list[str] = []
    not_compared: dict[str, str] = {}
    for name in sorted(stored.tables):
        rows = stored.tables[name]
        table = _KNOWN.get(name)
        if table is None:
            not_compared[name] = _NOT_REPLAYABLE.get(
                name, "no replay of this table is known: the trace does not say what it holds"
            )
            continue
        compared.append(name)
        out.extend(_compare_table(table, world, rows, skipped))
    for name in sorted(_KNOWN.keys() - stored.tables.keys()):
        if _KNOWN[name].expected(world):
            # a table the replay fills is missing altogether: so is every row it should hold
            compared.append(name)
            out.extend(_compare_table(_KNOWN[name], world, (), skipped))
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
        """Names of everything judged: history, replay invariants, the store comparison."""
        return [*HISTORY_INVARIANTS, *self.trace.checked, *STORE_INVARIANTS]


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


def audit(stored: StoredRows, *, quiescent: bool = False) -> AuditReport:
    """Judge one snapshot of a store: chain, replay through the invariants, every column
    (with the garbage collector paused: see `collector_paused`)."""
    with collector_paused():
        history = verify_history(stored)
        events, unreadable = read_trace(stored)
        trace = check_trace(events, quiescent=quiescent, with_registry=True)
        store = compare_store(trace.final, stored)
    return AuditReport(history, tuple(unreadable), trace, store)
