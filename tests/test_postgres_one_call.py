"""The PostgreSQL one-call reservation (issue 36): a reservation of a recorded update is ONE
call of the write-one function, which writes only a certain win, byte for byte what the
full path writes; every other answer comes from the full path's own read, unchanged."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import attrs
import psycopg
import pytest

from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.errors import LedgerError
from rollout_lifecycle.model.events import EntryChanged, stored_payload
from rollout_lifecycle.model.ledger import NO_REGISTRY, dump_entry, plan_reserve
from rollout_lifecycle.model.postgres_ledger import PostgresLedger, PostgresStore
from rollout_lifecycle.model.records import AdmissionPolicy, LedgerEntry
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.model.sql_unit import one_call_texts
from rollout_lifecycle.spec.audit import audit
from tests.helpers_ledger import activate as _activate
from tests.helpers_ledger import add_rewarded, rewarded, stamp

pytestmark = pytest.mark.postgres

POLICY = AdmissionPolicy(max_lag=1, max_drift=0.2)


def _stored(url: str, rid: str) -> tuple[str, str]:
    """The row's stored text and the payload of its newest event."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT entry FROM rollouts WHERE rollout_id = %s", (rid,)).fetchone()
        ev = conn.execute(
            "SELECT payload FROM events WHERE subject = %s ORDER BY seq DESC LIMIT 1", (rid,)
        ).fetchone()
    assert row is not None and ev is not None
    return str(row[0]), str(ev[0])


def _expected(before: LedgerEntry, after: LedgerEntry, at: float) -> tuple[str, str]:
    ev = EntryChanged(0, 0, at, after.rollout_id, "reserve", before, after, after.reserved_by)
    return dump_entry(after), stored_payload(ev, None)


@pytest.fixture
def deployment(postgres_url: str) -> Iterator[Any]:
    with open_backend(postgres_url) as b:
        set_admission_policy(b.registry, POLICY, "set by the operator")
        coord = ActivationCoordinator(b.registry, ["w0"], ledger=b.ledger, policy=POLICY)
        _activate(coord, 1)
        yield b, coord, postgres_url


def _calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What each call of `reserve_one` answered (None: it wrote nothing)."""
    got: list[Any] = []
    real = PostgresStore.reserve_one

    def spy(self: Any, *args: Any) -> Any:
        out = real(self, *args)
        got.append(out)
        return out

    monkeypatch.setattr(PostgresStore, "reserve_one", spy)
    return got


@pytest.mark.parametrize(
    "entry",
    [
        rewarded("plain"),
        attrs.evolve(rewarded("paced"), tokens=512, releases=3),
        attrs.evolve(rewarded('odd \u00e9"\\ id'), tokens=0),
    ],
    ids=["plain", "paced", "escaped"],
)
def test_the_one_call_stores_byte_for_byte_what_the_step_would(
    deployment: Any, entry: LedgerEntry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spliced entry and the event payload the server writes are `dump_entry(after)`
    and `stored_payload(event)` of the entry the full path would plan, the lease as
    Python's repr writes the server's float8; `ledger check` verifies the store after."""
    b, _, url = deployment
    b.ledger.add(rewarded("primer"))
    b.ledger.add(entry)
    assert b.ledger.reserve("primer", 0, "u", stamp()).reserved  # records u
    calls = _calls(monkeypatch)
    out = b.ledger.reserve(entry.rollout_id, 0, "u", stamp())
    assert out.reserved and out.reason == "reserved" and calls and calls[0] is not None
    assert out.entry is not None and out.entry.lease_expires_at is not None
    at = b.ledger.history(entry.rollout_id)[-1].at
    planned, after = plan_reserve(
        entry,
        entry.rollout_id,
        0,
        "u",
        stamp(),
        premise=NO_REGISTRY,  # the plan's write does not depend on the premise
        lease_expires_at=out.entry.lease_expires_at,
    )
    assert after is not None and planned.entry == out.entry == b.ledger.get(entry.rollout_id)
    assert _stored(url, entry.rollout_id) == _expected(entry, after, at)
    assert audit(b.ledger.stored_rows()).violations == []


def _poison(b: Any, update_id: str) -> None:
    """A commit that is not what the update reserved is refused and poisons it."""
    with contextlib.suppress(LedgerError):
        b.ledger.commit(update_id, ["a"])
    assert b.ledger.update(update_id).status == "poisoned"


def _lag0() -> Any:
    return attrs.evolve(stamp(), max_lag=0)


# (name, what to do to the deployment first, the request, the full path's answer)
_DOUBTS: list[tuple[str, Any, tuple[str, int, str, Any], str]] = [
    ("missing", None, ("nope", 0, "u", stamp()), "missing_rollout"),
    ("stale revision", None, ("a", 1, "u", stamp()), "revision_conflict"),
    ("unrecorded update", None, ("a", 0, "fresh", stamp()), "reserved"),
    ("poisoned update", lambda b, c: _poison(b, "u"), ("a", 0, "u", stamp()), "update_poisoned"),
    ("looser", None, ("a", 0, "u", attrs.evolve(stamp(), max_lag=2)), "looser_than_policy"),
    ("never active", None, ("v0", 0, "u", stamp(0)), "version_not_active"),
    ("hash mismatch", None, ("bad-hash", 0, "u", stamp()), "artifact_hash_mismatch"),
    ("stamped against", None, ("a", 0, "u", stamp(1, current=2)), "stamp_contradicts_itself"),
    ("pointer moved", lambda b, c: _activate(c, 2), ("a", 0, "u", _lag0()), "pointer_moved"),
    ("stamp refused", None, ("a", 0, "u", stamp(accepted=False)), "not_admitted"),
]


@pytest.mark.parametrize("name, setup, request_, reason", _DOUBTS, ids=[d[0] for d in _DOUBTS])
def test_anything_but_a_certain_win_writes_nothing_and_the_full_path_answers(
    deployment: Any,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    setup: Any,
    request_: tuple[str, int, str, Any],
    reason: str,
) -> None:
    """Each refusal (and a win the one call cannot be sure of: the update's first
    reservation records it) is answered by the full path, as before: the one call wrote
    nothing (None), or was not tried at all for a stamp that fails on its own."""
    _doubt(deployment, monkeypatch, setup, request_, reason)


_JUDGED = ("        -- `reservation_refusal` with the registry's facts now", "        IF q.seconds")


def test_the_doubts_catch_a_one_call_that_does_not_judge_the_premise(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test above kills a one call built without its judgement of the stamp against the
    registry (a stamp looser than the policy then wins in one call)."""
    from rollout_lifecycle.model import postgres_ledger as pl
    from rollout_lifecycle.stateful_tests.mutants import write_one_variant

    a, b = (pl._WRITE_ONE_DDL.index(m) for m in _JUDGED)
    with write_one_variant(
        "_unjudged", lambda d: d[: d.index(_JUDGED[0])] + d[d.index(_JUDGED[1]) :]
    ):
        assert b > a
        with open_backend(postgres_url) as bk:
            set_admission_policy(bk.registry, POLICY, "set by the operator")
            coord = ActivationCoordinator(bk.registry, ["w0"], ledger=bk.ledger, policy=POLICY)
            _activate(coord, 1)
            looser = ("a", 0, "u", attrs.evolve(stamp(), max_lag=2))
            with pytest.raises(AssertionError) as caught:
                _doubt((bk, coord, postgres_url), monkeypatch, None, looser, "looser_than_policy")
            # it won, in one call, what the full path refuses
            assert "reserved=True, reason='reserved'" in str(caught.value), caught.value


def _doubt(
    deployment: Any,
    monkeypatch: pytest.MonkeyPatch,
    setup: Any,
    request_: tuple[str, int, str, Any],
    reason: str,
) -> None:
    b, coord, url = deployment
    add_rewarded(b.ledger, ["primer", "a"])
    b.ledger.add(rewarded("v0", version=0))
    b.ledger.add(attrs.evolve(rewarded("bad-hash"), artifact_hash="sha256:other"))
    assert b.ledger.reserve("primer", 0, "u", stamp()).reserved  # records u
    if setup is not None:
        setup(b, coord)
    before = {rid: _stored(url, rid) for rid in ("a", "v0", "bad-hash")}
    calls = _calls(monkeypatch)
    out = b.ledger.reserve(*request_)
    assert out.reason == reason, out
    assert all(c is None for c in calls), calls
    if reason != "reserved":
        assert {rid: _stored(url, rid) for rid in before} == before
    assert audit(b.ledger.stored_rows()).violations == []


@pytest.mark.parametrize("now", [1_700_000_000.25, 1_000.0, 12.5e-5, 1_765_051_234.123456])
def test_a_lease_from_an_injected_clock_is_written_as_python_writes_it(
    postgres_url: str, now: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With an injected clock the client passes the deadline; where the server's text of
    the float8 is not Python's repr (an integral value: '1600' for 1600.0), the one call
    answers 'moved' and the full path writes it. The stored text is dump_entry's either
    way."""
    with open_backend(postgres_url) as b:  # the registry's premise, judged by the audit
        set_admission_policy(b.registry, POLICY, "set by the operator")
        _activate(ActivationCoordinator(b.registry, ["w0"], ledger=b.ledger, policy=POLICY), 1)
    led = PostgresLedger(postgres_url, clock=lambda: now, lease_seconds=600.0)
    try:
        add_rewarded(led, ["primer", "a"])
        assert led.reserve("primer", 0, "u", stamp()).reserved
        calls = _calls(monkeypatch)
        out = led.reserve("a", 0, "u", stamp())
        assert (calls[0] is None) == (now + 600.0).is_integer(), calls
        assert out.reserved and out.entry is not None
        assert out.entry.lease_expires_at == now + 600.0
        text, _ = _stored(postgres_url, "a")
        assert text == dump_entry(out.entry)
        assert audit(led.stored_rows()).violations == []
    finally:
        led.close()


def test_the_request_texts_are_the_full_paths_encoding() -> None:
    """`one_call_texts` around a lease give `dump_entry`'s fields and `stored_payload`'s
    bytes (no server needed: the texts the server only completes)."""
    owner = 'u"q\u00e9'
    before = attrs.evolve(rewarded("r\u00e9\\"), revision=4)
    for lease in (1.5, 1_765_051_234.123456, 3e-05):
        _, after = plan_reserve(
            before,
            before.rollout_id,
            4,
            owner,
            stamp(),
            premise=NO_REGISTRY,
            lease_expires_at=lease,
        )
        assert after is not None
        fields, payload, request = one_call_texts(before.rollout_id, 4, owner, stamp(), 7.25, 600.0)
        req = json.loads(request)
        assert fields + repr(lease) in dump_entry(after)
        assert req["before"] in dump_entry(before)
        ev = EntryChanged(0, 0, 7.25, before.rollout_id, "reserve", before, after, owner)
        assert payload + repr(lease) + req["tail"] == stored_payload(ev, None)


def test_a_one_call_whose_answer_was_lost_is_resolved_by_its_mark(
    deployment: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one call committed but its answer never came: the commit mark says it landed,
    so it is not sent again, and the reservation returns the row as stored."""
    from rollout_lifecycle.model import postgres_common as pc

    b, _, _ = deployment
    add_rewarded(b.ledger, ["primer", "a"])
    assert b.ledger.reserve("primer", 0, "u", stamp()).reserved
    real = pc.PostgresDatabase._write_once
    sent: list[int] = []

    def lost(self: Any, body: Any, attempt: Any, prologue: str = "") -> Any:
        sent.append(1)
        real(self, body, attempt, prologue)  # it committed ...
        attempt.committing = True
        raise pc._ConnectionBroke("server closed the connection")  # ... the answer got lost

    monkeypatch.setattr(pc.PostgresDatabase, "_write_once", lost)
    out = b.ledger.reserve("a", 0, "u", stamp())
    monkeypatch.undo()
    assert out.reserved and out.reason == "reserved" and len(sent) == 1
    assert out.entry == b.ledger.get("a") and out.entry.reserved_by == "u"
    assert [e.event for e in b.ledger.history("a")] == ["add", "reserve"]
    assert audit(b.ledger.stored_rows()).violations == []


def test_a_row_that_kept_its_stamp_takes_the_full_path(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollout whose lease expired is rewarded again with its old stamp still stored: the
    one call splices only a row whose stamp is null, so it answers 'moved' and the full
    path writes it, dump_entry's text either way."""
    with open_backend(postgres_url) as b:  # the registry's premise, judged by the audit
        set_admission_policy(b.registry, POLICY, "set by the operator")
        _activate(ActivationCoordinator(b.registry, ["w0"], ledger=b.ledger, policy=POLICY), 1)
    now = [1_700_000_000.5]
    led = PostgresLedger(postgres_url, clock=lambda: now[0], lease_seconds=10.0)
    try:
        add_rewarded(led, ["p1", "p2", "a"])
        assert led.reserve("p1", 0, "u1", stamp()).reserved
        assert led.reserve("a", 0, "u1", stamp()).reserved
        now[0] += 60.0
        led.expire_leases()
        again = led.get("a")
        assert again.state == "rewarded" and again.admission is not None, again
        assert led.reserve("p2", 0, "u2", stamp()).reserved  # records u2
        calls = _calls(monkeypatch)
        out = led.reserve("a", again.revision, "u2", stamp())
        assert out.reserved and out.entry is not None and calls == [None]
        assert _stored(postgres_url, "a")[0] == dump_entry(out.entry)
        assert audit(led.stored_rows()).violations == []
    finally:
        led.close()
