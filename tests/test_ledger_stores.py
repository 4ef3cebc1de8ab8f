"""The one ledger over stores: what the stores share (stored entries' JSON, the step
declaration) behaves the same on every path."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import struct
from pathlib import Path
from typing import Any

import attrs
import pytest

from rollout_lifecycle.model.errors import InvalidRecord
from rollout_lifecycle.model.events import (
    CHANGED,
    EntryChanged,
    EntryStates,
    chain_hash,
    entry_payload,
    event_from_jsonable,
    stored_payload,
)
from rollout_lifecycle.model.ledger import (
    MemoryLedger,
    Step,
    _decode,
    _evolve,
    dump_entry,
    load_entry,
    read_entry,
)
from rollout_lifecycle.model.records import (
    AdmissionStamp,
    Disposition,
    LedgerEntry,
    Reward,
    from_jsonable,
    to_jsonable,
)
from rollout_lifecycle.model.sql_unit import (
    SqlUnit,
    reservation_fields,
    reward_text,
    splice_entry,
    splice_landed,
)
from rollout_lifecycle.model.sqlite_ledger import SQLiteLedger

STAMP = AdmissionStamp(3, 3, 1, 0.5, 0.01, "fresh", "ok", True)


def _entries() -> list[LedgerEntry]:
    base = LedgerEntry("r1", 3, "a" * 64, state="rewarded", reward=Reward("f", "1", 0.5))
    return [
        base,
        attrs.evolve(
            base,
            state="reserved",
            revision=2,
            reserved_by="u",
            lease_expires_at=1e-5,
            admission=STAMP,
        ),
        attrs.evolve(
            base,
            state="update_failed",
            revision=4,
            releases=2,
            disposition=Disposition("update", "nan loss", "é"),
        ),
        # the pacing fields, written only where set (records._entry_jsonable)
        attrs.evolve(base, chain="prompt-7", attempt=2),
        attrs.evolve(base, tokens=0),
        attrs.evolve(base, state="consumed", revision=3, chain="p", attempt=1, tokens=512),
    ]


@pytest.mark.parametrize("entry", _entries())
def test_stored_entries_load_as_the_validating_reader_would(entry: LedgerEntry) -> None:
    """An entry read back without its validators equals the validated one, field for field."""
    text = dump_entry(entry)
    fast, slow = load_entry(text), from_jsonable(LedgerEntry, json.loads(text))
    assert fast == slow == entry and repr(fast) == repr(slow) and hash(fast) == hash(slow)
    assert dump_entry(fast) == text


@pytest.mark.parametrize("entry", _entries())
def test_every_shape_this_program_writes_takes_the_trusted_path(entry: LedgerEntry) -> None:
    """Entries with or without the optional pacing keys (chain and attempt together, tokens
    alone) load without their validators, and their stored text is reused as written."""
    text = dump_entry(entry)
    loaded, trusted = read_entry(text)
    assert trusted and loaded == entry and dump_entry(loaded) == text


def _loads_outcome(decode: Any, text: Any) -> tuple[str, Any]:
    try:
        return "value", decode(text)
    except Exception as exc:  # the type and the message, to compare with json.loads'
        return type(exc).__name__, str(exc)


def test_stored_text_decodes_exactly_as_json_loads() -> None:
    """The entry decoder's shortcut (json's scanner, called directly) gives json.loads'
    value for every text, and json.loads' own error for a text that is no single JSON
    value: space around it, a byte-order mark, trailing data, bytes, NaN, a huge int."""
    text = dump_entry(_entries()[3])
    texts: list[Any] = [
        text,
        f" {text}",
        f"{text}\n",
        f"\ufeff{text}",
        f"{text} x",
        f"{text}{text}",
        text[:-1],
        "",
        "   ",
        "[1, 2]",
        '{"a": NaN, "b": -Infinity, "c": 1e400}',
        '{"big": 123456789012345678901234567890}',
        '"\\ud800"',
        text.encode(),
    ]
    for t in texts:
        ours, theirs = _loads_outcome(_decode, t), _loads_outcome(json.loads, t)
        assert repr(ours) == repr(theirs), t
    with pytest.raises(json.JSONDecodeError, match="Extra data"):
        read_entry(f"{text} x")


def test_a_pacing_shape_this_program_never_writes_is_validated() -> None:
    """A chain without its attempt (or an attempt alone) is no shape the ledger writes: it
    takes the validating path, which refuses the record."""
    data = json.loads(dump_entry(_entries()[3]))
    for missing in ("attempt", "chain"):
        odd = {k: v for k, v in data.items() if k != missing}
        with pytest.raises(InvalidRecord):
            read_entry(json.dumps(odd))
    reordered = {k: data[k] for k in sorted(data)}
    assert read_entry(json.dumps(reordered)) == (_entries()[3], False)


def test_a_row_of_another_shape_takes_the_validating_path() -> None:
    """A row with a field missing, an unknown field or a bad value is judged by the
    validators, with their typed errors, as before."""
    data = json.loads(dump_entry(_entries()[0]))
    del data["releases"]
    assert load_entry(json.dumps(data)).releases == 0  # a default, as from_jsonable gives
    with pytest.raises(InvalidRecord):
        load_entry(json.dumps({**data, "surprise": 1}))
    with pytest.raises(InvalidRecord):
        load_entry(json.dumps({**data, "releases": 0, "disposition": "not a record"}))


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
def test_a_new_operation_is_one_step_on_the_ledger(backend: str, tmp_path: Path) -> None:
    """A step written once on the ledger (here: count what is live in a version window, the
    premise of a dispatch) runs on every store through the same primitives."""
    led = MemoryLedger() if backend == "memory" else SQLiteLedger(tmp_path / "l.db")
    led.add_many([_entries()[0], attrs.evolve(_entries()[0], rollout_id="r2", behavior_version=1)])
    live = ("generated", "rewarded")
    got = [led._step(lambda uow, _, v=v: uow.count(live, v), Step("count")) for v in (None, 2, 4)]
    assert got == [2, 1, 0]
    led.close()


def test_the_memory_stores_counts_follow_every_write() -> None:
    """The memory store counts by (state, version) from an index kept with each write and
    each white-box record; it agrees with a scan of the entries, and with the index rebuilt."""
    led = MemoryLedger()
    base = _entries()[0]
    led.add_many([attrs.evolve(base, rollout_id=f"r{i}", behavior_version=i % 4) for i in range(8)])
    led.reserve("r3", 0, "u", STAMP)
    led.abort("u")
    led.transition("r1", "retire_stale", 0)
    assert led.reserve("r7", 0, "u2", STAMP).reserved
    led.commit("u2", ["r7"])
    led._record(
        [
            (
                "quarantine",
                None,
                attrs.evolve(
                    led.get("r2"),
                    state="quarantined",
                    revision=led.get("r2").revision + 1,
                    disposition=Disposition("admission", "quarantined"),
                ),
                None,
            )
        ]
    )
    store = led.store

    def scan(states: tuple[str, ...], low: int | None) -> int:
        floor = -1 if low is None else low
        return sum(
            1 for e in store.entries.values() if e.state in states and e.behavior_version >= floor
        )

    cases = [
        (s, v)
        for s in (("rewarded",), ("consumed", "quarantined"), ("rewarded", "reserved", "x"))
        for v in (None, 1, 3)
    ]
    counted = [store.count(s, v) for s, v in cases]
    assert counted[:3] == [5, 3, 1]  # rewarded: r0, r3 (returned), r4, r5, r6
    assert counted == [scan(s, v) for s, v in cases]
    store.reindex()
    assert [store.count(s, v) for s, v in cases] == counted
    led.close()


@pytest.mark.parametrize("txn", [None, 7])
def test_an_event_payload_from_stored_texts_is_byte_for_byte_the_same(txn: int | None) -> None:
    """Reusing an entry's stored JSON for its creation event, or a splice's texts for a
    reservation's changed fields, changes no byte of the payload (the hash chain and
    `ledger check` read it)."""
    a, b, c, d, _, f = _entries()
    created = EntryChanged(0, 0, 3, "r1", "add", None, a, None)
    assert entry_payload(created, txn, dump_entry(a)) == stored_payload(created, txn)
    unit = SqlUnit(None)
    five = attrs.evolve(a, lease_expires_at=5)
    shapes = [
        (b, a),  # a reservation undone: every spliced field back
        (a, attrs.evolve(a, revision=1)),  # the revision alone
        (a, attrs.evolve(a, lease_expires_at=5.0)),  # not the revision
        (a, five),
        (five, attrs.evolve(a, lease_expires_at=5.0)),  # an equal value of another type
    ]
    for before, after in [*_tricky(), *shapes, *_tricky()[:3]]:
        loaded = unit.load(dump_entry(before))
        planned = _evolve(loaded, **_reservation_of(after))
        unit.dump_after(loaded, planned)
        assert unit.spliced[id(planned)] == (planned, loaded)  # the splice path, not a fallback
        for at, event, update in ((1.5e9 + 0.25, "reserve", "u\u00e9"), (0.0, "release", None)):
            ev = EntryChanged(0, 0, at, loaded.rollout_id, event, loaded, planned, update)
            assert unit.payload(ev, txn) == stored_payload(ev, txn)
    for ev in (
        EntryChanged(0, 0, 0.0, "r1", "update_failed", b, c, "u"),
        EntryChanged(0, 0, 2.0, "r1", "commit", d, f, "u"),
    ):
        assert SqlUnit(None).payload(ev, txn) == stored_payload(ev, txn)


@pytest.mark.parametrize("txn", [None, 7])
def test_any_change_written_field_by_field_is_byte_for_byte_stored_payload(
    txn: int | None,
) -> None:
    """A change that is not a splice (a landing: tokens and reward; a failure: releases and
    a disposition; pacing fields; an int lease where a float was) has its changed fields
    written one by one, each record once per step: the same bytes as `stored_payload`, also
    when a step interleaves events of several kinds and records are shared or equal but
    distinct objects."""
    entries = _entries()
    dispatched = LedgerEntry("r1", 3, "a" * 64, state="dispatched", chain="p", attempt=1)
    generated = attrs.evolve(dispatched, state="generated", revision=1, tokens=512)
    scored = attrs.evolve(generated, state="rewarded", revision=2, reward=Reward("f", "1", 0.5))
    pairs = [
        (dispatched, generated),
        (generated, scored),
        (generated, attrs.evolve(scored, reward=Reward("f", "1", 1))),  # an int value
        (
            scored,
            attrs.evolve(
                scored,
                state="reserved",
                revision=3,
                reserved_by="u",
                lease_expires_at=9,
                admission=STAMP,
            ),
        ),
        *itertools.permutations(entries, 2),
        *((a, b) for b, a in _tricky()),
        (entries[0], entries[0]),  # nothing changed: an empty object
    ]
    unit = SqlUnit(None)
    for round_ in range(2):  # the second round reuses the texts the first one kept
        for i, (before, after) in enumerate(pairs):
            event = ("generation_done", "reward_ready", "reserve")[(i + round_) % 3]
            ev = EntryChanged(0, 0, 1.5e9 + round_, before.rollout_id, event, before, after, "u")
            assert unit.payload(ev, txn) == stored_payload(ev, txn), (before, after)


def test_a_change_stores_only_the_fields_that_differ() -> None:
    """An entry event over an existing entry stores the differing top-level fields (as
    `dump_entry` encodes them) and the event's own fields; a creation stores the whole entry."""
    a, b, c, d, _, f = _entries()
    data = json.loads(stored_payload(EntryChanged(0, 0, 2.0, "r1", "reserve", a, b, "u"), 5))
    assert data == {
        "txn": 5,
        "at": 2.0,
        "rollout_id": "r1",
        "event": "reserve",
        CHANGED: {
            "state": "reserved",
            "revision": 2,
            "reserved_by": "u",
            "lease_expires_at": 1e-5,
            "admission": to_jsonable(STAMP),
        },
        "update_id": "u",
        "kind": "entry",
    }
    # fields left out of JSON at their defaults are stored when they change
    data = json.loads(stored_payload(EntryChanged(0, 0, 2.0, "r1", "commit", d, f, "u"), None))
    assert "txn" not in data
    assert data[CHANGED] == {
        "state": "consumed",
        "revision": 3,
        "chain": "p",
        "attempt": 1,
        "tokens": 512,
    }
    data = json.loads(stored_payload(EntryChanged(0, 0, 2.0, "r1", "add", None, c, None), 1))
    assert data["before"] is None and data["after"] == to_jsonable(c) and CHANGED not in data


def _payloads(events: list[EntryChanged]) -> list[dict[str, object]]:
    out = []
    for i, ev in enumerate(events, 1):
        data = json.loads(stored_payload(ev, i))
        data["seq"] = i
        out.append(data)
    return out


def test_readers_rebuild_every_change_from_what_was_stored() -> None:
    """Laying each stored change over the rollout's previous entry gives back the very
    before/after pairs written, also where a change of an earlier entry was stored whole
    (an older program's event) and where the reader starts mid-history (`fold`)."""
    a, b, c, d, _, f = _entries()
    chain = [a, b, c, d, f, attrs.evolve(f, tokens=None, revision=9)]
    events = [EntryChanged(0, 0, 1.0, "r1", "add", None, a, None)]
    events += [EntryChanged(0, 0, 1.0, "r1", "x", x, y, None) for x, y in itertools.pairwise(chain)]
    want = [(e.before, e.after) for e in events]
    payloads = _payloads(events)
    old = json.loads(json.dumps({**payloads[2], "before": to_jsonable(b), "after": to_jsonable(c)}))
    del old[CHANGED]
    for stored in (payloads, [*payloads[:2], old, *payloads[3:]]):
        states = EntryStates()
        got = [states.event(dict(p)) for p in stored]
        assert [(e.before, e.after) for e in got] == want  # type: ignore[union-attr]
        assert all(
            type(g.after.lease_expires_at) is type(w.lease_expires_at)  # type: ignore[union-attr]
            for g, (_, w) in zip(got, want, strict=True)
        )
        late = EntryStates()
        assert late.unknown(stored[3:]) == {"r1"}
        for p in stored[:3]:
            late.fold(p)
        assert late.unknown(stored[3:]) == set()
        assert [(e.before, e.after) for e in map(late.event, stored[3:])] == want[3:]  # type: ignore[union-attr]


def test_a_change_that_cannot_be_rebuilt_is_a_typed_error() -> None:
    """A change with no earlier event of its rollout, one naming a field no entry has, and
    one whose value does not decode: InvalidRecord naming what is wrong."""
    a, b = _entries()[:2]
    add, reserve = _payloads(
        [
            EntryChanged(0, 0, 1.0, "r1", "add", None, a, None),
            EntryChanged(0, 0, 1.0, "r1", "reserve", a, b, "u"),
        ]
    )
    with pytest.raises(InvalidRecord, match="no earlier event of that rollout"):
        EntryStates().event(dict(reserve))
    with pytest.raises(InvalidRecord, match="stores only what changed"):
        event_from_jsonable(dict(reserve))  # a change is never read on its own
    for changed, match in (
        ({"colour": "red"}, r"unknown field\(s\) \['colour'\]"),
        ({"revision": "two"}, "revision"),
        ({"state": "nowhere"}, "state"),
        ([1, 2], "must be a JSON object"),
    ):
        states = EntryStates()
        states.event(dict(add))
        with pytest.raises(InvalidRecord, match=match):
            states.event({**reserve, CHANGED: changed})


def test_evolve_validates_what_changed_as_attrs_evolve_would() -> None:
    """The planners' evolve re-checks only the changed fields (the rest passed when the
    record was built): same records, and the same typed refusals, as attrs.evolve."""
    e = _entries()[0]
    good = {"state": "reserved", "revision": 1, "reserved_by": "u", "lease_expires_at": 3.0}
    for changes in ({**good, "admission": STAMP}, {"revision": 5}):
        a, v = _evolve(e, **changes), attrs.evolve(e, **changes)
        assert a == v and repr(a) == repr(v) and hash(a) == hash(v)
    for bad in (
        {**good, "lease_expires_at": math.inf},
        {**good, "reserved_by": None},
        {"revision": 2**63},
        {"state": "bogus"},
    ):
        with pytest.raises(InvalidRecord) as ours:
            _evolve(e, **bad)
        with pytest.raises(InvalidRecord) as theirs:
            attrs.evolve(e, **bad)
        assert str(ours.value) == str(theirs.value)


def _tricky() -> list[tuple[LedgerEntry, LedgerEntry]]:
    """(before, after) pairs of a reservation, with ids and texts that look like the keys
    `splice_entry` finds, an int lease, no stamp, and nested records before and after."""
    pairs = []
    for rid in ("r1", 'x,"state":y', 'q\\",\\"admission\\":', "ü\u2028", 'r,"releases":1'):
        for chain in (None, 'c,"releases":2,"admission":null'):
            before = LedgerEntry(
                rid,
                3,
                'h"',
                state="rewarded",
                reward=Reward('f,"admission":', "1", 0.1),
                chain=chain,
                attempt=0 if chain is None else 2,
                tokens=None if chain is None else 7,
            )
            for lease, stamp in ((1e9, STAMP), (3, None), (1 / 3, STAMP)):
                after = _evolve(
                    before,
                    state="reserved",
                    revision=1,
                    reserved_by='u"',
                    lease_expires_at=lease,
                    admission=stamp,
                )
                pairs.append((before, after))
    return pairs


def test_a_spliced_entry_is_byte_for_byte_its_full_encoding() -> None:
    """A write that changes only a reservation's fields reuses the row's stored text: the
    spliced JSON is exactly what `dump_entry` writes, whatever the ids and texts hold."""
    unit = SqlUnit(None)
    for before, after in _tricky():
        stamp = json.dumps(to_jsonable(after.admission), separators=(",", ":"))
        spliced = splice_entry(dump_entry(before), reservation_fields(after), stamp)
        assert spliced == dump_entry(after)
        loaded = unit.load(dump_entry(before))  # the step read the row: its text is kept
        planned = _evolve(loaded, **_reservation_of(after))
        assert unit.dump_after(loaded, planned) == dump_entry(after)


def _reservation_of(after: LedgerEntry) -> dict[str, object]:
    names = ("state", "revision", "reserved_by", "lease_expires_at", "admission")
    return {n: getattr(after, n) for n in names}


def test_a_landing_reserved_in_one_step_is_spliced_byte_for_byte() -> None:
    """A dispatched (or generated) row landed and reserved in one step changes its reward
    and tokens too: its stored text is spliced, the same bytes as `dump_entry`, also with
    ids, hashes, chains and reward names that look like the keys the splice finds."""
    texts = ('x,"state":y', 'q\\",\\"disposition\\":', 'r,"reward":1', "\u00fc\u2028", "r1")
    reserved = {"state": "reserved", "revision": 3, "reserved_by": 'u,"reward":'}
    n = 0
    for rid, chain, name in itertools.product(texts, (None, *texts), texts):
        attempt = 0 if chain is None else 2
        for state, tokens in (("dispatched", None), ("generated", None)):
            before = LedgerEntry(rid, 3, rid + "h", state=state, chain=chain, attempt=attempt)
            for reward, lease, stamp, toks in (
                (Reward(name, "1", 0.25), 1e9 + 0.5, STAMP, 512),
                (Reward(name, name, 1), 3, None, tokens),
                (None, 1 / 3, STAMP, 0),
            ):
                unit = SqlUnit(None)
                loaded = unit.load(dump_entry(before))
                after = _evolve(
                    loaded,
                    reward=reward,
                    tokens=toks,
                    lease_expires_at=lease,
                    admission=stamp,
                    **reserved,
                )
                text = unit.dump_after(loaded, after)
                assert text == dump_entry(after)
                assert id(after) not in unit.spliced  # its events are not a splice's
                fields = reservation_fields(after)
                stamp_json = "null" if stamp is None else json.dumps(to_jsonable(stamp))
                stamp_json = stamp_json.replace(", ", ",").replace(": ", ":")
                got = splice_landed(
                    dump_entry(loaded), fields, stamp_json, reward_text(after.reward), toks
                )
                assert got == text  # the splice path, not a fallback
                n += 1
    assert n > 100


def test_splicing_needs_the_exact_text_and_nothing_else_changed() -> None:
    """A text that is not laid out as `dump_entry` writes it is not spliced, and a write
    that changes any other field is encoded in full: both give `dump_entry`'s bytes."""
    before, after = _tricky()[0]
    spaced = json.dumps(json.loads(dump_entry(before)))  # ", " and ": " separators
    assert splice_entry(spaced, reservation_fields(after), "null") is None
    unit = SqlUnit(None)
    loaded = unit.load(dump_entry(before))
    released = _evolve(loaded, releases=1, **_reservation_of(after))
    assert unit.dump_after(loaded, released) == dump_entry(released)


def test_evolve_never_skips_a_check_for_a_value_it_has_not_passed() -> None:
    """The planners' evolve skips a field's validator only for the very object it passed
    last: a bad value after a good one, or an equal but different object, is judged."""
    e = _entries()[0]
    ok = {"state": "reserved", "revision": 1, "lease_expires_at": 3.0}
    assert _evolve(e, reserved_by="u", **ok).reserved_by == "u"
    for bad in ("", "x" * 10_000, "a\x00b"):
        with pytest.raises(InvalidRecord):
            _evolve(e, reserved_by=bad, **ok)
    with pytest.raises(InvalidRecord):
        _evolve(e, reserved_by="u", **{**ok, "lease_expires_at": math.nan})


def test_the_chain_hash_is_the_documented_formula() -> None:
    """hash_n = sha256(prev || seq || txn || len-prefixed kind, subject, payload), as the
    audit recomputes it; surrogates are hashed as stored (surrogatepass)."""

    def text(v: str) -> bytes:
        raw = v.encode("utf-8", "surrogatepass")
        return struct.pack(">q", len(raw)) + raw

    for prev, seq, txn, kind, subject, payload in (
        (bytes(32), 1, 1, "entry", "r1", '{"a":1}'),
        (b"x" * 32, 2**40, 7, "artifact", "\udcff\u00e9", "p\ud800"),
    ):
        want = struct.pack(">qq", seq, txn) + text(kind) + text(subject) + text(payload)
        assert chain_hash(prev, seq, txn, kind, subject, payload) == (
            hashlib.sha256(prev + want).digest()
        )
