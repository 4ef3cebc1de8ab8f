"""One behaviour suite, run unchanged on every ledger backend in tests/ledger_backends.py.

Each test states CONTRACT sections 2 and 6 as observable behaviour: a failed step must leave
the snapshot, the history and the write counter exactly as they were.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout_lifecycle.model.errors import (
    CommitMismatch,
    DuplicateRollout,
    IllegalTransition,
    InvalidLedgerArgument,
    LedgerError,
    RevisionConflict,
    UnknownRollout,
    UpdatePoisoned,
)
from rollout_lifecycle.model.events import EntryChanged
from rollout_lifecycle.model.ledger import (
    DIRECT_EVENTS,
    Ledger,
    ManualClock,
    RecoveryRule,
    ReserveOutcome,
    ReserveRequest,
)
from rollout_lifecycle.model.machines import LIFECYCLE
from rollout_lifecycle.model.records import AdmissionStamp, Disposition, LedgerEntry, UpdateRecord
from tests.helpers_ledger import (
    HASH,
    REWARD,
    add_rewarded,
    drive_to,
    ids,
    rewarded,
    stamp,
)
from tests.ledger_backends import BACKENDS

MakeLedger = Callable[..., Ledger]


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> str:
    """The backend name; every test below runs once per registered backend."""
    name: str = request.param
    return name


@pytest.fixture
def clock() -> ManualClock:
    """Time that moves only when a test says so."""
    return ManualClock(1000.0)


@pytest.fixture
def make_ledger(backend: str, tmp_path: Path, clock: ManualClock) -> Iterator[MakeLedger]:
    """Factory for ledgers with non-default options; all are closed at teardown."""
    made: list[Ledger] = []

    def make(**options: Any) -> Ledger:
        led = BACKENDS[backend](tmp_path, clock, **options)
        made.append(led)
        return led

    yield make
    for led in made:
        led.close()


@pytest.fixture
def ledger(make_ledger: MakeLedger) -> Ledger:
    """A ledger with default options on the ManualClock."""
    return make_ledger()


class Frozen:
    """What 'changed nothing' means: same entries, same history, same write count."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.snapshot = ledger.snapshot()
        self.history = len(ledger.history())
        self.writes = ledger.statistics().writes

    def assert_unchanged(self) -> None:
        """Fail if any entry, event or write appeared since construction."""
        assert self.ledger.snapshot() == self.snapshot
        assert len(self.ledger.history()) == self.history
        assert self.ledger.statistics().writes == self.writes


def entry_changes(ledger: Ledger, rollout_id: str | None = None) -> list[EntryChanged]:
    """The ledger's history as EntryChanged events (the only kind a ledger writes)."""
    out = []
    for ev in ledger.history(rollout_id):
        assert isinstance(ev, EntryChanged)
        out.append(ev)
    return out


def reserve_one(ledger: Ledger, rid: str, update_id: str, version: int = 1) -> ReserveOutcome:
    """Read the current revision, then reserve with an accepted stamp."""
    return ledger.reserve(rid, ledger.get(rid).revision, update_id, stamp(version))


# ---- basics ----------------------------------------------------------------------------


def test_backend_implements_the_ledger_protocol(ledger: Ledger) -> None:
    """Every registered backend satisfies the runtime-checkable Ledger protocol."""
    assert isinstance(ledger, Ledger)


def test_in_state_lists_a_state_in_id_order_on_every_backend(ledger: Ledger) -> None:
    """`in_state` (a learner's 'what is waiting') answers alike on every backend: the
    entries in the state by rollout id, at most `limit`; an unknown state or a bad limit is
    a ValueError that reads nothing."""
    for rid in ("c", "a", "b"):
        ledger.add(LedgerEntry(rollout_id=rid, behavior_version=1, artifact_hash=HASH))
    ledger.transition("b", "generation_done", 0)
    assert [e.rollout_id for e in ledger.in_state("dispatched")] == ["a", "c"]
    assert [e.rollout_id for e in ledger.in_state("dispatched", 1)] == ["a"]
    assert ledger.in_state("dispatched", 0) == []
    assert [e.rollout_id for e in ledger.in_state("generated")] == ["b"]
    assert ledger.in_state("consumed") == []
    for bad in ({"state": "nope"}, {"state": "dispatched", "limit": -1}):
        with pytest.raises(ValueError):
            ledger.in_state(**bad)  # type: ignore[arg-type]


def test_normal_path_dispatch_to_consumed(ledger: Ledger) -> None:
    """dispatched -> generated -> rewarded -> reserved -> consumed, revision +1 per step."""
    e0 = ledger.add(LedgerEntry(rollout_id="a", behavior_version=2, artifact_hash=HASH))
    e1 = ledger.transition("a", "generation_done", 0)
    e2 = ledger.transition("a", "reward_ready", 1, reward=REWARD)
    out = ledger.reserve("a", 2, "u1", stamp(2))
    (e4,) = ledger.commit("u1", ["a"])
    assert [e0.state, e1.state, e2.state] == ["dispatched", "generated", "rewarded"]
    assert out.reserved and out.reason == "reserved" and out.entry is not None
    assert out.entry.state == "reserved" and out.entry.reserved_by == "u1"
    assert out.entry.admission == stamp(2)
    assert e4.state == "consumed" and e4.reserved_by is None and e4.revision == 4
    assert e2.reward == REWARD and e4.reward == REWARD
    assert ledger.get("a") == e4
    assert [(ev.event, ev.update_id) for ev in entry_changes(ledger, "a")] == [
        ("add", None),
        ("generation_done", None),
        ("reward_ready", None),
        ("reserve", "u1"),
        ("commit", "u1"),
    ]


def test_add_refuses_duplicates_and_non_initial_entries(ledger: Ledger) -> None:
    """A second add of an id raises DuplicateRollout; a reserved or revised entry is refused."""
    ledger.add(rewarded("a"))
    frozen = Frozen(ledger)
    with pytest.raises(DuplicateRollout):
        ledger.add(rewarded("a"))
    with pytest.raises(LedgerError, match="revision 0"):
        ledger.add(LedgerEntry(rollout_id="b", behavior_version=1, artifact_hash=HASH, revision=3))
    with pytest.raises(LedgerError, match="revision 0"):
        ledger.add(
            LedgerEntry(
                rollout_id="c",
                behavior_version=1,
                artifact_hash=HASH,
                state="reserved",
                reserved_by="u",
            )
        )
    frozen.assert_unchanged()


def test_unknown_rollout(ledger: Ledger) -> None:
    """get/transition raise UnknownRollout, find gives None, reserve says missing_rollout."""
    assert ledger.find("nope") is None
    with pytest.raises(UnknownRollout):
        ledger.get("nope")
    with pytest.raises(UnknownRollout):
        ledger.transition("nope", "generation_done", 0)
    out = ledger.reserve("nope", 0, "u", stamp())
    assert (out.reserved, out.reason, out.entry) == (False, "missing_rollout", None)
    assert ledger.statistics().refused == 1


# ---- direct events from every state ----------------------------------------------------


@pytest.mark.parametrize("state", LIFECYCLE.states)
def test_every_direct_event_from_every_state(ledger: Ledger, state: str) -> None:
    """Legal events move to the machine's destination with revision + 1; illegal ones raise
    IllegalTransition and change nothing."""
    for event in sorted(DIRECT_EVENTS):
        rid = f"{state}:{event}"
        entry = drive_to(ledger, rid, state)
        reward = REWARD if event == "reward_ready" else None
        if LIFECYCLE.is_legal(state, event):
            new = ledger.transition(rid, event, entry.revision, reward=reward)
            assert new.state == LIFECYCLE.next_state(state, event)
            assert new.revision == entry.revision + 1
            assert ledger.get(rid) == new
            assert entry_changes(ledger, rid)[-1].after == new
        else:
            frozen = Frozen(ledger)
            with pytest.raises(IllegalTransition):
                ledger.transition(rid, event, entry.revision, reward=reward)
            frozen.assert_unchanged()


def test_direct_event_argument_errors_change_nothing(ledger: Ledger) -> None:
    """Wrong stage, reward on a non-reward event, missing reward, or a non-direct event raise
    LedgerError before anything is written."""
    drive_to(ledger, "g", "generated")
    frozen = Frozen(ledger)
    with pytest.raises(LedgerError, match="stage"):
        ledger.transition("g", "reward_timeout", 1, disposition=Disposition("update", "x"))
    with pytest.raises(LedgerError, match="only reward_ready"):
        ledger.transition("g", "reward_error", 1, reward=REWARD)
    with pytest.raises(LedgerError, match="needs the reward"):
        ledger.transition("g", "reward_ready", 1)
    for event in ("reserve", "commit", "abort", "expire_lease", "update_failed"):
        with pytest.raises(LedgerError, match="cannot be fired directly"):
            ledger.transition("g", event, 1)
    frozen.assert_unchanged()


def test_failures_keep_their_stage(ledger: Ledger) -> None:
    """Generation and reward failures record their own stage and never carry a reward."""
    drive_to(ledger, "gen", "dispatched")
    drive_to(ledger, "rt", "generated")
    drive_to(ledger, "re", "generated")
    a = ledger.transition("gen", "generation_failed", 0)
    b = ledger.transition("rt", "reward_timeout", 1)
    c = ledger.transition("re", "reward_error", 1, disposition=Disposition("reward", "crash"))
    assert (a.state, a.disposition) == ("generation_failed", Disposition("generation", "error"))
    assert (b.state, b.disposition) == ("reward_timed_out", Disposition("reward", "timeout"))
    assert (c.state, c.disposition) == ("reward_errored", Disposition("reward", "crash"))
    assert a.reward is None and b.reward is None and c.reward is None


# ---- compare-and-set -------------------------------------------------------------------


def test_cas_conflict_changes_nothing(ledger: Ledger) -> None:
    """A stale revision makes transition raise RevisionConflict and reserve report
    revision_conflict; the record, history and writes are untouched."""
    add_rewarded(ledger, ["a"])
    frozen = Frozen(ledger)
    with pytest.raises(RevisionConflict) as info:
        ledger.transition("a", "retire_stale", 1)
    assert (info.value.expected, info.value.actual) == (1, 0)
    out = ledger.reserve("a", 7, "u", stamp())
    assert (out.reserved, out.reason) == (False, "revision_conflict")
    assert out.entry == ledger.get("a")
    frozen.assert_unchanged()
    assert ledger.statistics().cas_conflicts == 2


def test_revision_checked_before_state(ledger: Ledger) -> None:
    """A stale revision on a consumed rollout is a conflict, not not_rewarded (contract order)."""
    drive_to(ledger, "c", "consumed")
    out = ledger.reserve("c", 0, "u", stamp())
    assert out.reason == "revision_conflict"


def test_idempotent_retry_by_owner_writes_nothing(ledger: Ledger) -> None:
    """The owner's repeated reserve (with the old or the new revision) returns
    idempotent_retry, reserved, without a write or a revision bump."""
    add_rewarded(ledger, ["a"])
    first = ledger.reserve("a", 0, "u1", stamp())
    assert first.reason == "reserved" and first.entry is not None
    frozen = Frozen(ledger)
    for expected in (0, 1):
        again = ledger.reserve("a", expected, "u1", stamp())
        assert (again.reserved, again.reason) == (True, "idempotent_retry")
        assert again.entry == first.entry
    frozen.assert_unchanged()
    assert ledger.get("a").revision == 1
    assert ledger.statistics().idempotent_retries == 2


def test_second_update_cannot_take_a_reserved_rollout(ledger: Ledger) -> None:
    """Another update gets not_rewarded (current revision) or revision_conflict (old one)."""
    add_rewarded(ledger, ["a"])
    ledger.reserve("a", 0, "u1", stamp())
    frozen = Frozen(ledger)
    now = ledger.reserve("a", 1, "u2", stamp())
    old = ledger.reserve("a", 0, "u2", stamp())
    assert (now.reserved, now.reason) == (False, "not_rewarded")
    assert (old.reserved, old.reason) == (False, "revision_conflict")
    frozen.assert_unchanged()
    assert ledger.get("a").reserved_by == "u1"
    assert ledger.reserved_by("u2") == []


@pytest.mark.parametrize(
    "admission",
    [None, stamp(1, accepted=False), stamp(2)],
    ids=["missing", "not-accepted", "other-version"],
)
def test_not_admitted_is_refused(ledger: Ledger, admission: AdmissionStamp | None) -> None:
    """Without an accepted stamp for this rollout's version, reserve says not_admitted."""
    add_rewarded(ledger, ["a"], version=1)
    frozen = Frozen(ledger)
    out = ledger.reserve("a", 0, "u", admission)
    assert (out.reserved, out.reason) == (False, "not_admitted")
    frozen.assert_unchanged()
    assert ledger.statistics().refused == 1


def test_admission_cannot_be_switched_off(make_ledger: MakeLedger) -> None:
    """There is no switch that lets a reservation land without a stamp that passed."""
    with pytest.raises(TypeError):
        make_ledger(require_admission=False)
    led = make_ledger()
    add_rewarded(led, ["a"])
    out = led.reserve("a", 0, "u", None)
    assert (out.reserved, out.reason) == (False, "not_admitted")


def test_self_contradicting_stamp_is_refused(ledger: Ledger) -> None:
    """A stamp saying accepted while its own figures say stale and drifted never reserves."""
    add_rewarded(ledger, ["a"], version=1)
    frozen = Frozen(ledger)
    liar = AdmissionStamp(
        current_version=11,
        behavior_version=1,
        max_lag=1,
        max_drift=0.1,
        drift=5.0,
        freshness="stale",
        reason="stale_policy",
        accepted=True,
    )
    out = ledger.reserve("a", 0, "u", liar)
    assert (out.reserved, out.reason) == (False, "stamp_contradicts_itself")
    assert "lag 10 outside [0, 1]" in out.detail and "drift 5.0 over 0.1" in out.detail
    frozen.assert_unchanged()
    (batch,) = ledger.reserve_batch("u", [ReserveRequest("a", 0, liar)])
    assert (batch.reserved, batch.reason) == (False, "stamp_contradicts_itself")
    frozen.assert_unchanged()


def test_rewarded_without_a_reward_is_refused(ledger: Ledger) -> None:
    """add() of a 'rewarded' entry without a reward value is refused, nothing written."""
    from rollout_lifecycle.model.ledger import WriteRefused

    bad = LedgerEntry(rollout_id="x", behavior_version=0, artifact_hash=HASH, state="rewarded")
    with pytest.raises(WriteRefused, match="without a reward value"):
        ledger.add(bad)
    assert ledger.find("x") is None and ledger.history("x") == []


def test_empty_update_id_is_refused(ledger: Ledger) -> None:
    """An empty update id is a ValueError on every owner-taking call, with nothing written."""
    add_rewarded(ledger, ["a"])
    frozen = Frozen(ledger)
    with pytest.raises(ValueError):
        ledger.reserve("a", 0, "", stamp())
    with pytest.raises(ValueError):
        ledger.reserve_batch("", [ReserveRequest("a", 0, stamp())])
    with pytest.raises(ValueError):
        ledger.commit("", [])
    with pytest.raises(ValueError):
        ledger.abort("")
    with pytest.raises(ValueError):
        ledger.fail_update("", "cause")
    with pytest.raises(ValueError):
        ledger.fail_update("u", "")
    frozen.assert_unchanged()


# ---- batches ---------------------------------------------------------------------------


def test_reserve_batch_mixes_winners_and_losers(ledger: Ledger) -> None:
    """Each item of a batch decides on its own CAS; winners are written in one transaction."""
    add_rewarded(ledger, ["win1", "win2", "stale", "taken", "mine", "late"], version=1)
    ledger.reserve("taken", 0, "other", stamp())
    ledger.reserve("mine", 0, "u", stamp())
    history_before = len(ledger.history())
    outs = ledger.reserve_batch(
        "u",
        [
            ReserveRequest("win1", 0, stamp()),
            ReserveRequest("stale", 5, stamp()),
            ReserveRequest("taken", 1, stamp()),
            ReserveRequest("ghost", 0, stamp()),
            ReserveRequest("late", 0, stamp(1, accepted=False)),
            ReserveRequest("mine", 0, stamp()),
            ReserveRequest("win2", 0, stamp()),
        ],
    )
    assert [(o.rollout_id, o.reserved, o.reason) for o in outs] == [
        ("win1", True, "reserved"),
        ("stale", False, "revision_conflict"),
        ("taken", False, "not_rewarded"),
        ("ghost", False, "missing_rollout"),
        ("late", False, "not_admitted"),
        ("mine", True, "idempotent_retry"),
        ("win2", True, "reserved"),
    ]
    for o in outs:
        if o.entry is not None:
            assert ledger.get(o.rollout_id) == o.entry
    new_events = entry_changes(ledger)[history_before:]
    assert sorted(ev.rollout_id for ev in new_events) == ["win1", "win2"]
    assert len({ev.txn for ev in new_events}) == 1
    assert ledger.reserved_by("u") == ["mine", "win1", "win2"]
    assert ledger.get("taken").reserved_by == "other"
    assert ledger.get("stale").revision == 0 and ledger.get("late").revision == 0
    st = ledger.statistics()
    assert (st.reservations, st.cas_conflicts, st.refused, st.idempotent_retries) == (4, 1, 3, 1)


def test_reserve_batch_refuses_duplicate_ids(ledger: Ledger) -> None:
    """A batch naming a rollout twice raises LedgerError and reserves nothing."""
    add_rewarded(ledger, ["a", "b"])
    frozen = Frozen(ledger)
    with pytest.raises(LedgerError, match="more than once"):
        ledger.reserve_batch(
            "u",
            [
                ReserveRequest("a", 0, stamp()),
                ReserveRequest("b", 0, stamp()),
                ReserveRequest("a", 0, stamp()),
            ],
        )
    frozen.assert_unchanged()
    assert ledger.reserve_batch("u", []) == []


@pytest.mark.parametrize(
    "listed",
    [["a", "b"], ["a", "b", "c", "d"], ["a", "b", "c", "c"], ["d"], ["a", "b", "c", "zz"], []],
    ids=["subset", "superset", "duplicate", "other-update", "unknown", "empty"],
)
def test_commit_must_name_exactly_what_was_reserved(ledger: Ledger, listed: list[str]) -> None:
    """Any set other than exactly the update's reservations raises CommitMismatch, entries
    unchanged; the refused commit poisons the update, so even the exact set is refused
    afterwards (UpdatePoisoned) and abort returns its rollouts. Another update commits."""
    add_rewarded(ledger, ["a", "b", "c", "d"])
    ledger.reserve_batch("u", [ReserveRequest(r, 0, stamp()) for r in ("a", "b", "c")])
    ledger.reserve("d", 0, "v", stamp())
    assert ledger.update("u") == UpdateRecord("u", "open")
    frozen = Frozen(ledger)
    with pytest.raises(CommitMismatch):
        ledger.commit("u", listed)
    frozen.assert_unchanged()
    assert ledger.statistics().commits == 0
    poisoned = ledger.update("u")
    assert poisoned is not None and poisoned.status == "poisoned"
    assert poisoned.cause == "commit_mismatch"
    with pytest.raises(UpdatePoisoned, match="poisoned"):
        ledger.commit("u", ["c", "a", "b"])
    frozen.assert_unchanged()
    assert ledger.update("u") == poisoned  # the first cause stands
    assert [e.rollout_id for e in ledger.abort("u")] == ["a", "b", "c"]
    done = ledger.commit("v", ["d"])
    assert [e.state for e in done] == ["consumed"]
    assert ledger.update("v") == UpdateRecord("v", "landed")
    assert ledger.statistics().commits == 1


def test_commit_is_exactly_once(ledger: Ledger) -> None:
    """A consumed rollout cannot be committed again, by its update or by another."""
    add_rewarded(ledger, ["a"])
    ledger.reserve("a", 0, "u", stamp())
    ledger.commit("u", ["a"])
    frozen = Frozen(ledger)
    for upd in ("u", "v"):
        with pytest.raises(CommitMismatch):
            ledger.commit(upd, ["a"])
    frozen.assert_unchanged()


# ---- returning reservations ------------------------------------------------------------


def test_abort_releases_reservations(ledger: Ledger) -> None:
    """abort puts every reservation of the update back to rewarded with releases + 1."""
    add_rewarded(ledger, ["a", "b", "c"])
    ledger.reserve_batch("u", [ReserveRequest(r, 0, stamp()) for r in ("a", "b")])
    ledger.reserve("c", 0, "v", stamp())
    back = ledger.abort("u")
    assert [(e.rollout_id, e.state, e.releases, e.reserved_by, e.revision) for e in back] == [
        ("a", "rewarded", 1, None, 2),
        ("b", "rewarded", 1, None, 2),
    ]
    assert all(e.lease_expires_at is None for e in back)
    assert ledger.get("c").reserved_by == "v"
    assert ledger.statistics().aborts == 1
    again = ledger.reserve("a", 2, "w", stamp())
    assert again.reason == "reserved"


def test_bad_version_quarantined_now_and_on_return(ledger: Ledger) -> None:
    """quarantine_version quarantines open rollouts of that version at once, and reserved
    ones when their reservation comes back; other versions are released as usual."""
    add_rewarded(ledger, ["open1"], version=1)
    add_rewarded(ledger, ["held1"], version=1)
    add_rewarded(ledger, ["held2"], version=2)
    drive_to(ledger, "gen1", "generated", version=1)
    drive_to(ledger, "done1", "consumed", version=1)
    ledger.reserve("held1", 0, "u", stamp(1))
    ledger.reserve("held2", 0, "u", stamp(2))
    now = ledger.quarantine_version(1, "activation of v1 failed")
    assert [e.rollout_id for e in now] == ["gen1", "open1"]
    want = Disposition("activation", "failed_version", "activation of v1 failed")
    assert all(e.state == "quarantined" and e.disposition == want for e in now)
    assert ledger.get("held1").state == "reserved"
    assert ledger.get("done1").state == "consumed"
    assert ledger.statistics().bad_versions == (1,)
    assert getattr(ledger, "bad_versions") == frozenset({1})  # noqa: B009 - not on the protocol
    back = {e.rollout_id: e for e in ledger.abort("u")}
    assert back["held1"].state == "quarantined"
    assert back["held1"].disposition is not None
    assert back["held1"].disposition.stage == "recovery"
    assert back["held1"].disposition.cause == "failed_version"
    assert (back["held2"].state, back["held2"].releases) == ("rewarded", 1)


def test_poison_rollout_quarantined_after_max_releases(make_ledger: MakeLedger) -> None:
    """A rollout released max_releases times is quarantined on its next return."""
    led = make_ledger(recovery=RecoveryRule(max_releases=2))
    add_rewarded(led, ["p"])
    for n in (1, 2):
        assert reserve_one(led, "p", f"u{n}").reserved
        (e,) = led.abort(f"u{n}")
        assert (e.state, e.releases) == ("rewarded", n)
    assert reserve_one(led, "p", "u3").reserved
    (e,) = led.abort("u3")
    assert e.state == "quarantined" and e.disposition is not None
    assert (e.disposition.stage, e.disposition.cause) == ("recovery", "too_many_releases")
    assert reserve_one(led, "p", "u4").reason == "not_rewarded"


@pytest.mark.parametrize("bad", [False, True], ids=["release", "quarantine"])
def test_lease_expiry_at_the_deadline(
    make_ledger: MakeLedger, clock: ManualClock, bad: bool
) -> None:
    """Not expired before the deadline; expired at it and after it; released or quarantined
    by the recovery rule."""
    led = make_ledger(lease_seconds=10.0)
    add_rewarded(led, ["a", "b"])
    ra = led.reserve("a", 0, "u", stamp())
    clock.advance(5.0)
    rb = led.reserve("b", 0, "v", stamp())
    assert ra.entry is not None and ra.entry.lease_expires_at == 1010.0
    assert rb.entry is not None and rb.entry.lease_expires_at == 1015.0
    if bad:
        assert led.quarantine_version(1, "bad") == []
    clock.advance(4.5)
    frozen = Frozen(led)
    assert led.expire_leases() == []
    frozen.assert_unchanged()
    clock.advance(0.5)  # exactly at a's deadline
    (ea,) = led.expire_leases()
    clock.advance(100.0)  # long after b's
    (eb,) = led.expire_leases()
    for e in (ea, eb):
        assert e.reserved_by is None and e.lease_expires_at is None
        if bad:
            assert e.state == "quarantined" and e.disposition is not None
            assert (e.disposition.stage, e.disposition.cause) == ("recovery", "failed_version")
        else:
            assert (e.state, e.releases) == ("rewarded", 1)
    assert [(ev.event, ev.update_id) for ev in entry_changes(led, "a")][-1] == ("expire_lease", "u")
    assert led.statistics().expirations == 2
    assert led.expire_leases() == []


def test_fail_update_records_stage_update(ledger: Ledger) -> None:
    """fail_update ends the update's rollouts in update_failed with stage 'update'."""
    add_rewarded(ledger, ["a", "b", "c"])
    ledger.reserve_batch("u", [ReserveRequest(r, 0, stamp()) for r in ("a", "b")])
    ledger.reserve("c", 0, "v", stamp())
    failed = ledger.fail_update("u", "nan_loss", "step 7")
    assert [e.rollout_id for e in failed] == ["a", "b"]
    for e in failed:
        assert (e.state, e.reserved_by, e.revision) == ("update_failed", None, 2)
        assert e.disposition == Disposition("update", "nan_loss", "step 7")
    assert ledger.get("c").state == "reserved"
    assert ledger.fail_update("u", "again") == []


@pytest.mark.parametrize("state", sorted(LIFECYCLE.terminal))
def test_terminal_states_absorb_everything(ledger: Ledger, clock: ManualClock, state: str) -> None:
    """No call moves a rollout out of a terminal state, and none writes anything."""
    entry = drive_to(ledger, "t", state)
    frozen = Frozen(ledger)
    for event in sorted(DIRECT_EVENTS):
        with pytest.raises(IllegalTransition):
            reward = REWARD if event == "reward_ready" else None
            ledger.transition("t", event, entry.revision, reward=reward)
    out = ledger.reserve("t", entry.revision, "x", stamp())
    assert (out.reserved, out.reason) == (False, "not_rewarded")
    batch = ledger.reserve_batch("x", [ReserveRequest("t", entry.revision, stamp())])
    assert batch[0].reason == "not_rewarded"
    for upd in ("x", "drive:t"):
        with pytest.raises(CommitMismatch):
            ledger.commit(upd, ["t"])
        assert ledger.abort(upd) == []
        assert ledger.fail_update(upd, "boom") == []
    clock.advance(10_000.0)
    assert ledger.expire_leases() == []
    assert ledger.quarantine_version(1, "bad") == []
    frozen.assert_unchanged()
    assert ledger.get("t") == entry


# ---- history and statistics ------------------------------------------------------------


def _busy_scenario(led: Ledger, clock: ManualClock) -> None:
    """A bit of everything: adds, direct events, wins, losses, commits, aborts, expiry."""
    add_rewarded(led, ids(6))
    drive_to(led, "d", "rewarded")
    drive_to(led, "x", "reward_errored")
    led.reserve_batch("u1", [ReserveRequest(r, 0, stamp()) for r in ids(3)])
    led.reserve("r00003", 0, "u2", stamp())
    led.reserve("r00003", 0, "u2", stamp())  # idempotent
    led.reserve("r00003", 0, "u3", stamp())  # conflict
    led.reserve("r00004", 0, "u3", None)  # refused: not admitted
    led.commit("u1", ids(3))
    led.abort("u2")
    led.reserve("r00004", 0, "u4", stamp())
    clock.advance(led_lease(led) + 1)
    led.expire_leases()
    led.quarantine_version(7, "never active")
    led.transition("r00005", "retire_stale", 0)


def led_lease(led: Ledger) -> float:
    """The ledger's lease length (both backends expose it as an attribute)."""
    value: float = getattr(led, "lease_seconds")  # noqa: B009 - not on the protocol
    return value


def test_history_records_every_write_with_revision_plus_one(
    ledger: Ledger, clock: ManualClock
) -> None:
    """Each event's before is the previous after, revisions step by exactly one, the last
    after is the current entry, and seq/txn are ordered."""
    _busy_scenario(ledger, clock)
    events = entry_changes(ledger)
    assert [e.seq for e in events] == sorted({e.seq for e in events})
    assert [e.txn for e in events] == sorted(e.txn for e in events)
    per: dict[str, list[EntryChanged]] = defaultdict(list)
    for ev in events:
        per[ev.rollout_id].append(ev)
    snap = ledger.snapshot()
    assert set(per) == set(snap)
    for rid, evs in per.items():
        assert evs[0].before is None and evs[0].event == "add" and evs[0].after.revision == 0
        for prev, ev in itertools.pairwise(evs):
            assert ev.before == prev.after
            assert ev.after.revision == ev.before.revision + 1
            assert ev.after.rollout_id == rid
        assert evs[-1].after == snap[rid]
        assert entry_changes(ledger, rid) == evs


def test_statistics_add_up(ledger: Ledger, clock: ManualClock) -> None:
    """by_state sums to entries and matches the snapshot; every counter matches the scenario."""
    _busy_scenario(ledger, clock)
    st = ledger.statistics()
    snap = ledger.snapshot()
    assert st.entries == len(snap) == sum(st.by_state.values()) == 8
    assert set(st.by_state) == set(LIFECYCLE.states)
    in_use = {s: n for s, n in st.by_state.items() if n}
    assert in_use == dict(Counter(e.state for e in snap.values()))
    assert st.writes == len(ledger.history())
    assert (
        st.reservations,
        st.idempotent_retries,
        st.cas_conflicts,
        st.refused,
        st.commits,
        st.aborts,
        st.expirations,
        st.bad_versions,
    ) == (5, 1, 1, 1, 1, 1, 1, (7,))
    assert st.by_state["consumed"] == 3 and st.by_state["retired_stale"] == 1


# ---- real threads ----------------------------------------------------------------------


def test_eight_threads_race_for_1000_rollouts(ledger: Ledger) -> None:
    """8 threads each read then reserve every rollout in its own order: exactly one winner
    per rollout, losers see revision_conflict/not_rewarded and change nothing."""
    n, k = 1000, 8
    rids = ids(n)
    add_rewarded(ledger, rids)
    start = threading.Barrier(k)
    results: dict[str, list[ReserveOutcome]] = {}
    errors: list[BaseException] = []

    def racer(t: int) -> None:
        uid = f"t{t}"
        order = list(rids)
        random.Random(t).shuffle(order)
        outs = []
        try:
            start.wait()
            for rid in order:
                seen = ledger.get(rid)
                outs.append(ledger.reserve(rid, seen.revision, uid, stamp()))
        except BaseException as exc:
            errors.append(exc)
        results[uid] = outs

    threads = [threading.Thread(target=racer, args=(t,)) for t in range(k)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    winners: dict[str, list[str]] = defaultdict(list)
    for uid, outs in results.items():
        assert len(outs) == n
        for o in outs:
            if o.reserved:
                assert o.reason == "reserved"
                winners[o.rollout_id].append(uid)
            else:
                assert o.reason in ("revision_conflict", "not_rewarded")
    assert sorted(winners) == rids and all(len(w) == 1 for w in winners.values())
    snap = ledger.snapshot()
    for rid, (uid,) in winners.items():
        assert (snap[rid].reserved_by, snap[rid].revision) == (uid, 1)
    assert sum(len(ledger.reserved_by(f"t{t}")) for t in range(k)) == n
    st = ledger.statistics()
    assert st.reservations == n
    assert st.cas_conflicts + st.refused == (k - 1) * n
    assert st.writes == len(ledger.history()) == 2 * n


def test_late_rollout_of_a_bad_version_is_quarantined_on_arrival(ledger: Ledger) -> None:
    """A rollout stamped with a version whose activation failed is quarantined as it is added."""
    ledger.quarantine_version(7, "distribution failed")
    e = ledger.add(LedgerEntry(rollout_id="late", behavior_version=7, artifact_hash="h7"))
    assert e.state == "quarantined" and e.revision == 1
    assert e.disposition is not None and e.disposition.stage == "activation"
    assert [ev.event for ev in ledger.history("late")] == ["add", "quarantine"]
    ok = ledger.add(LedgerEntry(rollout_id="fine", behavior_version=6, artifact_hash="h6"))
    assert ok.state == "dispatched" and ok.revision == 0


def test_clear_bad_version_lets_new_rollouts_in(ledger: Ledger) -> None:
    """Lifting a version's mark keeps its quarantined rollouts, admits its new ones."""
    ledger.add(LedgerEntry(rollout_id="early", behavior_version=3, artifact_hash="h3"))
    ledger.quarantine_version(3, "distribution failed")
    assert 3 in ledger.bad_versions
    ledger.clear_bad_version(3)
    assert 3 not in ledger.bad_versions
    assert ledger.get("early").state == "quarantined"
    late = ledger.add(LedgerEntry(rollout_id="late", behavior_version=3, artifact_hash="h3"))
    assert late.state == "dispatched"


@pytest.mark.parametrize("bad", [False, 0.0, -1, "0"])
def test_transition_refuses_a_revision_that_is_not_an_int(ledger: Ledger, bad: Any) -> None:
    """False == 0 in Python, but a bool (or float, negative, text) is no revision: every
    backend refuses it with the typed error, and the entry is unchanged."""
    add_rewarded(ledger, ["a"])
    before = ledger.get("a")
    with pytest.raises(InvalidLedgerArgument, match="expected_revision"):
        ledger.transition("a", "retire_stale", bad)
    assert ledger.get("a") == before
