"""What the SQLite and PostgreSQL ledger stores' units of work share: the statements that
read sets of rows, count states and mark bad versions, written once with ``?`` placeholders
(PostgreSQL's unit sets `mark` to ``%s``; the tables and their columns are the same on both).
"""

from __future__ import annotations

import functools
import itertools
import json
import operator
from collections.abc import Sequence
from typing import Any

import attrs

from rollout_lifecycle.model.events import (
    ENTRY_FIELDS,
    ENTRY_VALUES,
    EntryChanged,
    RowRecorded,
    TraceEvent,
    UpdateChange,
    changed_payload,
    entry_changes,
    entry_payload,
    field_differs,
    json_scalar,
    row_event,
    stored_payload,
)
from rollout_lifecycle.model.ledger import (
    NESTED_IN_ENTRY,
    dump_entry,
    read_entry,
    stored_shapes,
    update_from_row,
)
from rollout_lifecycle.model.pacing import PacingRow, rows_from_columns
from rollout_lifecycle.model.records import (
    AdmissionPolicy,
    AdmissionStamp,
    LedgerEntry,
    Reward,
    UpdateRecord,
    to_jsonable,
)

# the ledger's update records (issue 31): the same table on SQLite and PostgreSQL
UPDATE_COLUMNS = "update_id, status, cause, detail"
_UPDATE_UPSERT = (
    f"INSERT INTO ledger_updates({UPDATE_COLUMNS}) VALUES (?, ?, ?, ?) "
    "ON CONFLICT (update_id) DO UPDATE SET status = excluded.status, "
    "cause = excluded.cause, detail = excluded.detail"
)


def read_bad(conn: Any) -> frozenset[int]:
    """The versions marked bad (one statement, no parameters: the same on both servers)."""
    return frozenset(int(r[0]) for r in conn.execute("SELECT version FROM ledger_bad_versions"))


# What a reservation (and most writes) changes of an entry: the top-level fields between
# "state" and "lease_expires_at", and "admission". `splice_entry` rewrites just these in a
# stored text; every other field must be the very same object before and after.
_CHAINS_PER_READ = 500  # chains per IN (...) list, well under SQLite's bound-parameter limit
_SPLICED = ("state", "revision", "reserved_by", "lease_expires_at", "admission")
_SPLICED_VALUES = operator.attrgetter(*_SPLICED)
_KEPT = operator.attrgetter(*(a.name for a in attrs.fields(LedgerEntry) if a.name not in _SPLICED))
# A landing that is reserved in the same step (land_and_reserve) also sets the reward and
# the tokens: `splice_landed` rewrites those too; every other field must be the same object.
_LANDED = (*_SPLICED, "reward", "tokens")
_LANDED_KEPT = operator.attrgetter(
    *(a.name for a in attrs.fields(LedgerEntry) if a.name not in _LANDED)
)


def splice_entry(before_text: str, fields: tuple[str, str, str], admission_json: str) -> str | None:
    """`dump_entry(after)` made from `before_text`, the exact `dump_entry` of an entry that
    differs from `after` in `_SPLICED` fields only: `fields` are after's ',"state":...'
    up to the revision, its revision, and ',"reserved_by":...' through the lease, as
    `dump_entry` encodes them (see `reservation_fields`), `admission_json` its stamp's JSON;
    None when the text is not laid out as expected.

    The keys are found by text: a compact JSON string never holds an unescaped quote, so
    ',"state":' and the like can only be the top-level keys; the fields in between are
    scalars, and no record nested in an entry has a field named "admission" or "releases".
    """
    i = before_text.find(',"state":')
    j = before_text.find(',"reward":', i)
    k = before_text.rfind(',"releases":')
    m = before_text.rfind(',"admission":', j, k)
    if i < 0 or j < 0 or m < 0:
        return None
    head, revision, tail = fields
    return (
        f'{before_text[:i]}{head}{revision}{tail}{before_text[j:m]},"admission":'
        f"{admission_json}{before_text[k:]}"
    )


def splice_landed(
    before_text: str,
    fields: tuple[str, str, str],
    admission_json: str,
    reward_json: str,
    tokens: int | None,
) -> str | None:
    """`splice_entry`, and the reward (`reward_text`, as `dump_entry` nests it) and the
    tokens of an entry whose stored text has none (`tokens` None: it still has none); None
    when the text is not laid out as expected.

    The reward's value ends where ',"disposition":' begins: no text inside a compact JSON
    string holds an unescaped quote. `tokens` is the last field `dump_entry` writes.
    """
    text = splice_entry(before_text, fields, admission_json)
    if text is None or not text.endswith("}"):
        return None
    j = text.find(',"reward":', text.find(',"lease_expires_at":'))
    d = text.find(',"disposition":', j)
    if j < 0 or d < 0:
        return None
    tail = text[d:] if tokens is None else f'{text[d:-1]},"tokens":{json_scalar(tokens)}}}'
    return f'{text[:j]},"reward":{reward_json}{tail}'


def reward_text(r: Reward | None) -> str:
    """A reward as `dump_entry` nests it and `to_jsonable` makes it: its three fields."""
    if r is None:
        return "null"
    return (
        f'{{"function_id":{json_scalar(r.function_id)},'
        f'"function_version":{json_scalar(r.function_version)},"value":{json_scalar(r.value)}}}'
    )


def reservation_fields(after: LedgerEntry) -> tuple[str, str, str]:
    """The `fields` of `splice_entry` for `after`."""
    return (
        f',"state":{json_scalar(after.state)},"revision":',
        json_scalar(after.revision),
        f',"reserved_by":{json_scalar(after.reserved_by)}'
        f',"lease_expires_at":{json_scalar(after.lease_expires_at)}',
    )


# `"name":` of each LedgerEntry field, in declaration order (the keys of `entry_changes`)
_CHANGE_KEYS = tuple(f"{json_scalar(n)}:" for n in ENTRY_FIELDS)
_FIELD_INDEXES = range(len(ENTRY_FIELDS))
# field values `json_scalar` encodes as json.dumps does; anything else goes through
# to_jsonable and json.dumps, as `entry_changes` and `stored_payload` do
_SCALAR_TYPES = frozenset({str, int, float, type(None)})


# the stamp whose JSON was made last, by any step (held, so its id is not reused)
_LAST_STAMP: list[tuple[object, str]] = [(object(), "")]


def stamp_json(stamp: AdmissionStamp) -> str:
    """A stamp's JSON as `dump_entry` nests it (the last stamp's kept: a caller reserving
    one rollout per step mostly passes the same one)."""
    last = _LAST_STAMP[0]
    if last[0] is stamp:
        return last[1]
    text = json.dumps(to_jsonable(stamp), separators=(",", ":"))
    _LAST_STAMP[0] = (stamp, text)
    return text


# Every key layout `read_entry` trusts, as "field:key,key,..." ('' for the entry itself):
# the PostgreSQL one-call reservation splices only a row laid out as one of them
STORED_SHAPES = sorted(
    f"{where}:{','.join(shape)}"
    for where, cls in (("", LedgerEntry), *NESTED_IN_ENTRY.items())
    for shape in stored_shapes(cls)
)


def one_call_texts(
    rollout_id: str,
    expected_revision: int,
    update_id: str,
    stamp: AdmissionStamp,
    at: float,
    seconds: float | None,
    event: str = "reserve",
    state: str = "reserved",
) -> tuple[str, str, str]:
    """What the PostgreSQL one-call reservation needs to write exactly what the step would:
    (the entry's fields through '"lease_expires_at":', the event payload through the same
    key, the request JSON). The server puts the lease's value after each, splices the
    entry as `splice_entry` does (over a row whose stamp is null) and ends the payload with
    the request's tail: the bytes of `dump_entry(after)` and of `stored_payload(event)`
    (`changed_payload` with state, revision, owner, lease and stamp changed). `seconds`
    None: the caller passes the deadline itself (an injected clock)."""
    revision, owner = json_scalar(expected_revision + 1), json_scalar(update_id)
    fields = (
        f',"state":{json_scalar(state)},"revision":{revision},"reserved_by":{owner}'
        ',"lease_expires_at":'
    )
    admission = stamp_json(stamp)
    payload = (
        f'{{"at":{json_scalar(at)},"rollout_id":{json_scalar(rollout_id)},'
        f'"event":{json_scalar(event)},"changed":{{{fields[1:]}'
    )
    request = {
        "version": stamp.behavior_version,
        "stamp_current": stamp.current_version,
        "max_lag": stamp.max_lag,
        "max_drift": stamp.max_drift,
        "before": f',"state":"rewarded","revision":{json_scalar(expected_revision)}'
        ',"reserved_by":null,"lease_expires_at":null',
        "admission": admission,
        "tail": f',"admission":{admission}}},"update_id":{owner},"kind":"entry"}}',
        "seconds": seconds,
    }
    return fields, payload, json.dumps(request, separators=(",", ":"))


@functools.cache
def _marked(sql: str, mark: str) -> str:
    return sql if mark == "?" else sql.replace("?", mark)


class SqlUnit:
    """A step's access to a SQL store, inside the transaction the store opened for it."""

    mark = "?"  # the driver's placeholder
    row_locks = ""  # what a store that locks rows appends to a read of rows it will write

    def field(self, *path: str, integer: bool = False) -> str:
        """SQL reading a field of the stored entry's JSON (NULL where absent); the chain's
        expression is the one the chain index is built on. `integer`: compared as one."""
        return f"json_extract(entry, '$.{'.'.join(path)}')"

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        # the stored JSON of entries this step read or wrote, so that their events' payloads
        # reuse it instead of encoding each entry again (kept with the entry: ids are reused)
        self.texts: dict[int, tuple[LedgerEntry, str]] = {}
        self.stamps: dict[int, tuple[AdmissionStamp, str]] = {}
        # nested records' JSON as an event's changed fields hold it (see `_value_json`)
        self.records: dict[int, tuple[object, str]] = {}
        # after -> before of each write `dump_after` spliced: they differ in `_SPLICED`
        # fields only, so their event's changed fields are found among those five
        self.spliced: dict[int, tuple[LedgerEntry, LedgerEntry]] = {}
        # the values `_changed` last worked out its texts for, and those texts
        self.change_key: tuple[object, ...] = (object(),) * 8
        self.change_texts = ("", "")
        # (state, owner, lease) objects last encoded, with their fields (see `_fields`)
        self.shared: tuple[tuple[object, ...], tuple[str, str, str]] = ((object(),) * 3, ("",) * 3)
        # rows of recorded tables (bad versions) this step wrote, for its events (see
        # model.events.RECORDED_TABLES)
        self.recorded: list[RowRecorded] = []

    def load(self, text: str) -> LedgerEntry:
        """An entry read in this step (its text kept when it is exactly what dump makes)."""
        entry, exact = read_entry(text)
        if exact:
            self.texts[id(entry)] = (entry, text)
        return entry

    def dump(self, entry: LedgerEntry) -> str:
        """The JSON to store of an entry this step writes (kept for its event)."""
        text = dump_entry(entry)
        self.texts[id(entry)] = (entry, text)
        return text

    def dump_after(self, before: LedgerEntry, after: LedgerEntry) -> str:
        """`dump(after)` for a write of `after` over `before`: when this step holds
        before's stored text and only the fields a reservation changes differ, the text is
        spliced instead of encoding the whole entry again (the same bytes either way)."""
        found = self.texts.get(id(before))
        if found is not None and found[0] is before:
            kept = all(map(operator.is_, _KEPT(before), _KEPT(after)))
            if kept:
                text = splice_entry(found[1], self._fields(after), self._admission_json(after))
                if text is not None:
                    self.texts[id(after)] = (after, text)
                    self.spliced[id(after)] = (after, before)
                    return text
            elif before.tokens is None and all(
                map(operator.is_, _LANDED_KEPT(before), _LANDED_KEPT(after))
            ):  # landed and reserved in one step: its event changes are not a splice's
                text = splice_landed(
                    found[1],
                    self._fields(after),
                    self._admission_json(after),
                    self._value_json(after.reward),
                    after.tokens,
                )
                if text is not None:
                    self.texts[id(after)] = (after, text)
                    return text
        return self.dump(after)

    def _fields(self, after: LedgerEntry) -> tuple[str, str, str]:
        """`reservation_fields(after)`, its state, owner and lease encoded once per step
        (a batch's rows share them)."""
        key = (after.state, after.reserved_by, after.lease_expires_at)
        known, (head, _, tail) = self.shared
        if not all(map(operator.is_, known, key)):
            head, _, tail = reservation_fields(after)
            self.shared = (key, (head, "", tail))
        return head, json_scalar(after.revision), tail

    def _admission_json(self, entry: LedgerEntry) -> str:
        """The JSON of an entry's stamp as `dump_entry` nests it, once per stamp per step
        (a batch's rows mostly share one)."""
        stamp = entry.admission
        if stamp is None:
            return "null"
        found = self.stamps.get(id(stamp))
        if found is not None and found[0] is stamp:
            return found[1]
        text = stamp_json(stamp)  # a caller reserving one rollout per step, same stamp
        self.stamps[id(stamp)] = (stamp, text)
        return text

    def _text(self, entry: LedgerEntry | None) -> str | None:
        found = None if entry is None else self.texts.get(id(entry))
        return found[1] if found is not None and found[0] is entry else None

    def payload(self, ev: TraceEvent, txn: int | None) -> str:
        """An event's payload column: a creation from the entry's stored JSON where this
        step has it, a spliced write's changed fields from the texts the splice used."""
        if isinstance(ev, EntryChanged):
            before, after = ev.before, ev.after
            if before is None:
                text = self._text(after)
                if text is not None:
                    return entry_payload(ev, txn, text)
            else:
                found = self.spliced.get(id(after))
                if found is not None and found[0] is after and found[1] is before:
                    return changed_payload(ev, txn, self._changed(before, after))
                changed = self._changes_json(before, after)
                return changed_payload(ev, txn, changed, self._value_json(ev.rollout_id))
        return stored_payload(ev, txn)

    def _changes_json(self, before: LedgerEntry, after: LedgerEntry) -> str:
        """`json.dumps(entry_changes(before, after))`, compact, written field by field: a
        scalar by `json_scalar`, a nested record's JSON once per record per step (a step's
        events of one row, or of a batch sharing one stamp, reuse it). The same bytes."""
        olds, news = ENTRY_VALUES(before), ENTRY_VALUES(after)
        parts = []
        # the fields that are not the very same object, found in C (a write changes a few
        # of some twenty); of those, the ones whose value differs (`field_differs`)
        for i in itertools.compress(_FIELD_INDEXES, map(operator.is_not, olds, news)):
            old, new = olds[i], news[i]
            if type(old) is type(new) and old == new:
                continue
            parts.append(_CHANGE_KEYS[i] + self._value_json(new))
        return "{" + ",".join(parts) + "}"

    def _value_json(self, value: object) -> str:
        """A field value as `json.dumps(to_jsonable(value))` writes it, compact, once per
        value per step: a batch's rows share their state, owner, lease and stamp, and a
        row's reward was written into its stored text first (`dump_after`)."""
        found = self.records.get(id(value))
        if found is not None and found[0] is value:
            return found[1]
        t = type(value)
        if t in _SCALAR_TYPES:
            text = json_scalar(value)
        elif t is Reward:
            text = reward_text(value)  # type: ignore[arg-type]
        else:
            text = json.dumps(to_jsonable(value), separators=(",", ":"))
            if not attrs.has(t):
                return text  # not a frozen record: not kept
        self.records[id(value)] = (value, text)  # the object is held: its id is not reused
        return text

    def _changed(self, before: LedgerEntry, after: LedgerEntry) -> str:
        """`entry_changes(before, after)` as compact JSON, for entries that differ in
        `_SPLICED` fields only. Which of them changed, and their texts, are worked out once
        per step for rows that share every value but the revision (a batch's rows do), so a
        reservation's event encodes only its revision afresh."""
        bs, br, bo, bl, ba = _SPLICED_VALUES(before)
        as_, ar, ao, al, aa = _SPLICED_VALUES(after)
        # states by value (always a str; a row read from JSON has its own copy), the rest
        # by identity, as `_fields` and `_admission_json` key theirs
        k = self.change_key
        if not (
            bs == k[0]
            and as_ == k[4]
            and bo is k[1]
            and bl is k[2]
            and ba is k[3]
            and ao is k[5]
            and al is k[6]
            and aa is k[7]
        ):
            self.change_key = (bs, bo, bl, ba, as_, ao, al, aa)
            self.change_texts = self._change_texts(before, after)
        if not field_differs(br, ar):  # rare: the revision did not move; the general form
            return json.dumps(entry_changes(before, after), separators=(",", ":"))
        opening, closing = self.change_texts
        return f"{opening}{json_scalar(ar)}{closing}"

    def _change_texts(self, before: LedgerEntry, after: LedgerEntry) -> tuple[str, str]:
        """`_changed`'s texts for rows like these two: what comes before the revision's
        value, and what comes after it."""
        head, _, tail = self._fields(after)  # ',"state":S,"revision":' and ',"reserved_by"...'
        stamp = ""
        if field_differs(before.admission, after.admission):
            stamp = f',"admission":{self._admission_json(after)}'
        state = field_differs(before.state, after.state)
        owner = field_differs(before.reserved_by, after.reserved_by)
        lease = field_differs(before.lease_expires_at, after.lease_expires_at)
        if state and owner and lease:  # a reservation: the texts `_fields` made, as they are
            return "{" + head[1:], f"{tail}{stamp}}}"
        pre = f'"state":{json_scalar(after.state)},' if state else ""
        owner_text = f',"reserved_by":{json_scalar(after.reserved_by)}' if owner else ""
        lease_text = f',"lease_expires_at":{json_scalar(after.lease_expires_at)}' if lease else ""
        return f'{{{pre}"revision":', f"{owner_text}{lease_text}{stamp}}}"

    def run(self, sql: str, args: Sequence[Any] = ()) -> Any:
        """Execute `sql` (written with ``?``) with this driver's placeholder."""
        return self.conn.execute(_marked(sql, self.mark), args)

    def select(self, where: str, args: Sequence[Any]) -> list[LedgerEntry]:
        """Entries matching `where`, by rollout id, locked where the store locks rows (in
        that order, so two steps never wait on each other's rows in a cycle)."""
        sql = f"SELECT entry FROM rollouts WHERE {where} ORDER BY rollout_id{self.row_locks}"
        return [self.load(r[0]) for r in self.run(sql, args).fetchall()]

    def lock_rows(self, rollout_ids: Sequence[str]) -> dict[str, LedgerEntry]:
        """`read_rows`, locked in rollout_id order where the store locks rows (SQLite's
        steps hold the database's write lock: nothing to add)."""
        if not self.row_locks:
            return self.read_rows(rollout_ids)  # type: ignore[attr-defined, no-any-return]
        got = self.select("rollout_id = ANY(?::text[])", (list(rollout_ids),))
        return {e.rollout_id: e for e in got}

    def owned(self, update_id: str) -> list[LedgerEntry]:
        return self.locked("owned", update_id, None)

    def due(self, now: float) -> list[LedgerEntry]:
        return self.locked("due", None, now)

    def of_version(self, version: int, states: Sequence[str]) -> list[LedgerEntry]:
        return self.locked("of_version", None, version, states)

    def older_than(self, version: int, states: Sequence[str]) -> list[LedgerEntry]:
        return self.locked("older_than", None, version, states)

    def locked(
        self, which: str, text: str | None, number: float | None, states: Sequence[str] = ()
    ) -> list[LedgerEntry]:
        """The rows a step reads to rewrite, named as PostgreSQL's `rl_lock_rows` names
        them (`which`: owned by update `text`, lease due by `number`, of or older than
        version `number` in `states`), locked where the store locks rows."""
        marks = ",".join("?" * len(states))
        if which == "owned":
            return self.select("reserved_by = ?", (text,))
        if which == "due":
            return self.select(
                "reserved_by IS NOT NULL AND lease_expires_at IS NOT NULL "
                "AND lease_expires_at <= ?",
                (number,),
            )
        op = {"of_version": "=", "older_than": "<"}[which]
        return self.select(f"behavior_version {op} ? AND state IN ({marks})", (number, *states))

    def count(self, states: Sequence[str], min_version: int | None = None) -> int:
        marks = ",".join("?" * len(states))
        sql = f"SELECT COUNT(*) FROM rollouts WHERE state IN ({marks}) AND behavior_version >= ?"
        low = -1 if min_version is None else min_version
        return int(self.run(sql, (*states, low)).fetchone()[0])

    def chain_states(self, chains: Sequence[str]) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {}
        field = self.field("chain")
        for k in range(0, len(chains), _CHAINS_PER_READ):
            part = chains[k : k + _CHAINS_PER_READ]
            marks = ",".join("?" * len(part))
            sql = f"SELECT {field}, state FROM rollouts WHERE {field} IN ({marks})"
            for chain, state in self.run(sql, tuple(part)).fetchall():
                out.setdefault(str(chain), []).append(str(state))
        return {c: tuple(states) for c, states in out.items()}

    def rewarded_between(self, low: int | None, high: int | None, limit: int) -> list[LedgerEntry]:
        # the order of model.pacing.oldest_first, so LIMIT keeps the same first rows
        attempt = f"COALESCE({self.field('attempt', integer=True)}, 0)"
        sql = (
            "SELECT entry FROM rollouts WHERE state = 'rewarded' AND behavior_version >= ? "
            f"AND behavior_version <= ? ORDER BY behavior_version, {attempt} DESC, rollout_id "
            "LIMIT ?"
        )
        args = (-1 if low is None else low, 2**62 if high is None else high, limit)
        return [self.load(r[0]) for r in self.run(sql, args).fetchall()]

    def pacing_rows(self) -> list[PacingRow]:
        """What pacing statistics need of every row, read out of the JSON by the server."""
        fields = [self.field(f) for f in ("chain", "attempt", "tokens")]
        fields.append(self.field("admission", "current_version"))
        sql = f"SELECT rollout_id, state, behavior_version, {', '.join(fields)} FROM rollouts"
        return rows_from_columns(self.run(sql).fetchall())

    def bad_versions(self) -> frozenset[int]:
        return read_bad(self.conn)

    def read_policy(self) -> tuple[int | None, AdmissionPolicy | None]:
        premise = self.read_premise(())  # type: ignore[attr-defined]  # no version's facts
        return premise.pointer_version, premise.policy

    def reserved_ids(self, update_id: str) -> list[str]:
        sql = "SELECT rollout_id FROM rollouts WHERE reserved_by = ? ORDER BY rollout_id"
        return [str(r[0]) for r in self.run(sql, (update_id,)).fetchall()]

    def read_updates(self, update_ids: Sequence[str]) -> dict[str, UpdateRecord]:
        if not update_ids:
            return {}
        marks = ",".join("?" * len(update_ids))
        sql = f"SELECT {UPDATE_COLUMNS} FROM ledger_updates WHERE update_id IN ({marks})"
        return {str(r[0]): update_from_row(r) for r in self.run(sql, list(update_ids))}

    def put_updates(self, updates: Sequence[UpdateChange]) -> None:
        """Store the records `updates` leave (inside the step, before their events)."""
        for _, _, a in updates:  # a step changes one update, or the few a lease expiry hit
            self.run(_UPDATE_UPSERT, (a.update_id, a.status, a.cause, a.detail))

    def mark_bad(self, version: int, reason: str) -> None:
        if self.bad_version(version, reason, mark=True):
            row = {"version": version, "reason": reason}
            self.recorded.append(row_event("ledger_bad_versions", version, row, "marked bad"))

    def clear_bad(self, version: int) -> None:
        if self.bad_version(version, "", mark=False):
            self.recorded.append(row_event("ledger_bad_versions", version, None, "mark lifted"))

    def bad_version(self, version: int, reason: str, *, mark: bool) -> bool:
        """Mark (or clear) a bad version: whether a row was written (a second mark keeps
        the first reason; then nothing is recorded)."""
        sql = "DELETE FROM ledger_bad_versions WHERE version = ?"
        args: tuple[object, ...] = (version,)
        if mark:
            sql = "INSERT INTO ledger_bad_versions(version, reason) VALUES (?, ?) "
            sql, args = sql + "ON CONFLICT (version) DO NOTHING", (version, reason)
        return bool(self.run(sql, args).rowcount == 1)

    def recorded_events(self, at: float) -> list[TraceEvent]:
        """The rows this step wrote to recorded tables (RowRecorded, dated `at`), taken: the
        store appends them with the step's entry events, in its one events statement."""
        out: list[TraceEvent] = [attrs.evolve(ev, at=at) for ev in self.recorded]
        self.recorded.clear()
        return out
