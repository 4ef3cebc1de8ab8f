"""A batch is judged as its rows would be one by one: the batch planner, the batch's input
checks, the step's rule checks and the records built without attrs' per-call work give the
same outcomes, entries, refusals and errors as the row-by-row code they stand in for."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_lifecycle.model import rules
from rollout_lifecycle.model.errors import InvalidLedgerArgument, InvalidRecord
from rollout_lifecycle.model.events import EntryChanged
from rollout_lifecycle.model.ledger import (
    NO_REGISTRY,
    ActivationPremise,
    ReserveOutcome,
    ReserveRequest,
    _plain_batch_ids,
    check_request_items,
    check_requests,
    judged_versions,
    plan_each,
    plan_reserve,
    plan_reserves,
)
from rollout_lifecycle.model.records import (
    AdmissionPolicy,
    AdmissionStamp,
    Disposition,
    LedgerEntry,
    Reward,
    plain_maker,
)

GOOD = AdmissionStamp(1, 1, 1, 0.5, 0.0, "fresh", "ok", True)
STAMPS = (
    GOOD,
    AdmissionStamp(1, 1, 1, 0.5, 0.0, "fresh", "ok", True),  # equal to GOOD, not it
    AdmissionStamp(2, 1, 1, 0.5, 0.1, "tolerated", "ok", True),
    AdmissionStamp(1, 0, 3, 0.5, 0.0, "tolerated", "ok", True),
    AdmissionStamp(1, 1, 1, 0.5, 0.9, "fresh", "drift", False),
    AdmissionStamp(1, 1, 1, 0.5, 0.0, "stale", "ok", True),  # contradicts itself
    None,
)
REWARD = Reward("rm", "1", 0.5)
PREMISES = (
    NO_REGISTRY,
    ActivationPremise(1, frozenset({0, 1}), AdmissionPolicy(2, 1.0)),
    ActivationPremise(2, frozenset({0, 1, 2}), AdmissionPolicy(1, 0.5), frozenset({0})),
    ActivationPremise(1, frozenset({1}), None),
    ActivationPremise(None, frozenset(), AdmissionPolicy(1, 1.0)),
)


@st.composite
def stored_rows(draw: Any) -> LedgerEntry | None:
    """A row a step may read: absent, or in any state, reserved by us or another update."""
    state = draw(st.sampled_from((None, "reserved", "consumed", *["rewarded"] * 4)))
    if state is None:
        return None
    owner = draw(st.sampled_from(("u", "w"))) if state == "reserved" else None
    chain = draw(st.sampled_from((None, "c")))
    return LedgerEntry(
        "x",
        draw(st.integers(0, 2)),
        "h",
        state=state,
        revision=draw(st.sampled_from((0, 1, 7, 2**63 - 2, 2**63 - 1))),
        reserved_by=owner,
        lease_expires_at=5.0 if owner else None,
        reward=REWARD,
        chain=chain,
        attempt=0 if chain is None else 2,
    )


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(st.tuples(stored_rows(), st.booleans(), st.integers(0, 6)), max_size=12),
    premise=st.sampled_from(PREMISES),
    update_id=st.sampled_from(("u", "w")),
    lease=st.sampled_from((9.5, 10, math.inf, math.nan, None)),
)
def test_the_batch_planner_plans_each_row_as_plan_reserve_does(
    rows: list[tuple[LedgerEntry | None, bool, int]],
    premise: ActivationPremise,
    update_id: str,
    lease: float | None,
) -> None:
    """Same outcomes in order, same (before, after) of each row to write, or the same error
    (a lease that is no finite time, a revision at the 64-bit limit) from the same row."""
    entries: dict[str, LedgerEntry] = {}
    requests = []
    for i, (row, current, stamp) in enumerate(rows):
        rid = f"r{i}"
        if row is not None:
            entries[rid] = attrs.evolve(row, rollout_id=rid)
        expected = row.revision if current and row is not None else 1
        requests.append(ReserveRequest(rid, expected, STAMPS[stamp]))
    want: list[ReserveOutcome] = []
    planned: dict[str, tuple[LedgerEntry, LedgerEntry]] = {}
    error: Exception | None = None
    try:  # the reference: each request through plan_reserve, in order
        want, planned = plan_each(
            plan_reserve, entries, requests, update_id, premise=premise, lease_expires_at=lease
        )
    except InvalidRecord as exc:
        error = exc
    if error is not None:
        with pytest.raises(type(error)) as got:
            plan_reserves(entries, requests, update_id, premise=premise, lease_expires_at=lease)
        assert str(got.value) == str(error)
        return
    outcomes, got_planned = plan_reserves(
        entries, requests, update_id, premise=premise, lease_expires_at=lease
    )
    assert outcomes == want
    assert got_planned == planned and list(got_planned) == list(planned)
    assert all(a.reserved_by == update_id for _, a in got_planned.values())


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.integers(-3, 3),
            st.sampled_from((2**63 - 1, 2**63, -(2**63))),
            st.booleans(),
            st.sampled_from((0.0, 1.0, 2.5, math.nan)),
            st.none(),
            st.just([1]),  # unhashable
        ),
        max_size=30,
    )
)
def test_the_versions_a_step_judges_are_those_each_value_names(values: list[object]) -> None:
    """`judged_versions` of a batch's versions (judged once per distinct value when every
    one is a plain int) is the per-value rule: every int in the registry's range, bools as
    ints, nothing else; a float equal to an int never hides that int, a list or iterator
    alike."""
    want = frozenset(int(v) for v in values if isinstance(v, int) and 0 <= v < 2**63)
    assert judged_versions(values) == want
    assert judged_versions(iter(values)) == want


class _Str(str):
    """A str subclass: an id the column checks leave to the item checks."""


BAD_IDS = ("é", "a\x00b", "", "\ud800", "x" * 1025, _Str("s"), 7, None)
BAD_REVISIONS = (-1, 2**63, True, 1.0, "1", None)
BAD_ITEMS = ((), "r", None)


@st.composite
def batches(draw: Any) -> list[Any]:
    """A batch of good requests, maybe with one bad part (or a repeated id) somewhere."""
    n = draw(st.integers(0, 5))
    items: list[Any] = [
        ReserveRequest(
            draw(st.sampled_from(("r", "x" * 1024, "q"))) + str(i),
            draw(st.sampled_from((0, 3, 2**63 - 1))),
            draw(st.sampled_from((None, GOOD))),
        )
        for i in range(n)
    ]
    if n and draw(st.booleans()):
        i = draw(st.integers(0, n - 1))
        how = draw(st.sampled_from(("id", "revision", "admission", "item", "repeat")))
        if how == "id":
            items[i] = attrs.evolve(items[i], rollout_id=draw(st.sampled_from(BAD_IDS)))
        elif how == "revision":
            bad = draw(st.sampled_from(BAD_REVISIONS))
            items[i] = attrs.evolve(items[i], expected_revision=bad)
        elif how == "admission":
            items[i] = attrs.evolve(items[i], admission=draw(st.sampled_from(("ok", 1))))
        elif how == "item":
            items[i] = draw(st.sampled_from(BAD_ITEMS))
        else:
            items.append(items[i])
    return items


@settings(max_examples=400, deadline=None)
@given(batches())
def test_a_batch_passes_or_is_refused_as_its_items_are(items: list[Any]) -> None:
    """The column checks pass a batch only when every item passes the item checks; then,
    and otherwise, check_requests accepts or refuses exactly as item by item, naming the
    first bad item."""
    ids = _plain_batch_ids(items)
    try:
        check_request_items(items)  # what the column checks stand for
        passes = True
    except InvalidLedgerArgument:
        passes = False
    if ids is not None:
        assert passes and ids == [r.rollout_id for r in items]
    try:
        check_requests(items)
    except InvalidLedgerArgument as exc:
        message: str | None = str(exc)
    else:
        message = None
    if not passes:
        assert message is not None and "more than once" not in message
    elif len({r.rollout_id for r in items}) == len(items):
        assert message is None
    else:
        assert message is not None and "more than once" in message


DISPOSITIONS = (None, Disposition("update", "nan loss"), Disposition("reward", "timeout"))


@st.composite
def judged_entries(draw: Any) -> LedgerEntry:
    """An entry that may break any per-record rule, built from a few shared objects."""
    state = draw(st.sampled_from(("rewarded", "reserved", "consumed", "update_failed")))
    return LedgerEntry(
        draw(st.sampled_from(("a", "b", "c"))),
        draw(st.integers(0, 1)),
        "h",
        state=state,
        reserved_by="u" if state == "reserved" else None,
        reward=draw(st.sampled_from((None, REWARD, Reward("rm", "1", 0.5)))),
        disposition=draw(st.sampled_from(DISPOSITIONS)),
        admission=draw(st.sampled_from((GOOD, STAMPS[1], STAMPS[3], None))),
    )


@settings(max_examples=400, deadline=None)
@given(st.lists(judged_entries(), max_size=16), st.booleans())
def test_a_step_s_rule_checks_find_what_each_entry_s_would(
    entries: list[LedgerEntry], as_generator: bool
) -> None:
    """entries_problems judges entries that agree on what the rules read once: it finds
    the same problems, in the same order, as entry_problems on each entry."""
    want = [m for e in entries for m in rules.entry_problems(e)]
    got = rules.entries_problems(iter(entries) if as_generator else entries)
    assert got == want


def test_a_plain_maker_builds_what_init_builds() -> None:
    """Records built by plain_maker equal those built by __init__ (defaults included), and
    a class whose __init__ validates, converts or runs a hook gets no plain maker."""
    e = LedgerEntry("r", 0, "h")
    make = plain_maker(EntryChanged)
    for args in ((1, 2, 3.5, "r", "add", None, e), (1, 2, 3.5, "r", "add", e, e, "u", "x")):
        built, init = make(*args), EntryChanged(*args)
        assert built == init and repr(built) == repr(init) and hash(built) == hash(init)
    out = plain_maker(ReserveOutcome)("r", True, "reserved", e)
    assert out == ReserveOutcome("r", True, "reserved", e) and out.detail == ""
    for cls in (LedgerEntry, AdmissionStamp, Reward):
        with pytest.raises(TypeError, match="does more than store"):
            plain_maker(cls)

    @attrs.frozen
    class Listed:
        items: list[int] = attrs.field(factory=list)

    with pytest.raises(TypeError, match="does more than store"):
        plain_maker(Listed)
