"""PostgreSQL's single reservation in one round trip (issue 36), a part of its store.

A reservation of a rollout at a revision the caller holds, for an update already recorded,
is one call of the write-one function in its one-call form (`p_guard` 3): the server judges
it under the premise lock and writes only where the full step would certainly plan exactly
this write (`postgres_functions._ONE_CALL`); anything else writes nothing and the ledger
runs the full path (peek, plan, write), so every refusal still comes from that path's own
read (issue 33). The texts it sends are `sql_unit.one_call_texts`. The counter arrays every
write function takes are formatted here too (`counter_arrays`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from rollout_lifecycle.model.errors import LedgerError
from rollout_lifecycle.model.ledger import Step, UnitOfWork, load_entry
from rollout_lifecycle.model.postgres_common import OneStatement
from rollout_lifecycle.model.postgres_functions import WRITE_ONE_CALL
from rollout_lifecycle.model.records import AdmissionStamp, LedgerEntry
from rollout_lifecycle.model.sql_unit import one_call_texts

T = TypeVar("T")

_COUNTER_TEXTS: dict[tuple[tuple[str, int], ...], tuple[str, str]] = {}
_COUNTER_NAME = re.compile(r"(?!null$)[a-z_]+")  # an array literal's bare word, not NULL
_RESERVED_COUNTS = {"writes": 1, "reservations": 1}
_RESERVE_STEP = Step("reserve", premise=True)


def counter_arrays(counts: Mapping[str, int]) -> tuple[str, str]:
    """The counters a write bumps as the text of two arrays (names, increments), by name:
    a step's counters come from a handful of constant sets, so each is formatted once."""
    key = tuple(sorted((k, v) for k, v in counts.items() if v))
    found = _COUNTER_TEXTS.get(key)
    if found is None:
        if not all(_COUNTER_NAME.fullmatch(k) for k, _ in key):
            raise LedgerError(f"counter names must be lowercase words, got {sorted(counts)}")
        found = (
            "{" + ",".join(k for k, _ in key) + "}",
            "{" + ",".join(str(int(v)) for _, v in key) + "}",
        )
        if len(_COUNTER_TEXTS) < 256:  # a bound, in case a caller makes up increments
            _COUNTER_TEXTS[key] = found
    return found


def _one_call(row: tuple[Any, ...] | None) -> str | None:
    """The one-call reservation's answer: the entry's text when it wrote, else None."""
    assert row is not None and row[0] is not None, row
    text = str(row[0])
    return text if text.startswith("{") else None


class _Store(Protocol):
    """What the one call needs of PostgreSQL's store."""

    server_clock: bool

    def atomic(self, body: Callable[[UnitOfWork], T] | OneStatement[T], step: Step) -> T: ...

    def find(self, rollout_id: str) -> LedgerEntry | None: ...


class OneCallReservations:
    """The store's one-call reservation (the ledger's `OneCallStore`)."""

    def reserve_one(
        self: _Store,
        rollout_id: str,
        expected_revision: int,
        update_id: str,
        stamp: AdmissionStamp,
        at: float,
        lease_expires_at: float,
        lease_seconds: float,
    ) -> LedgerEntry | None:
        """A whole reservation in ONE call of the write-one function: the entry written,
        or None (nothing was written: run the full path). `lease_expires_at` is the
        deadline of an injected clock (used only without the server's)."""
        seconds = lease_seconds if self.server_clock else None
        fields, payload, request = one_call_texts(
            rollout_id, expected_revision, update_id, stamp, at, seconds
        )
        params = (
            "reserve",
            3,
            request,
            "reserved",
            expected_revision + 1,
            update_id,
            None if self.server_clock else lease_expires_at,
            fields,
            rollout_id,
            expected_revision,
            "entry",
            payload,
            *counter_arrays(_RESERVED_COUNTS),
            update_id,
        )
        call: OneStatement[str | None] = OneStatement(WRITE_ONE_CALL, params, _one_call, "")
        got = self.atomic(call, _RESERVE_STEP)
        if got is None:
            return None
        if not got:  # written, but the answer was lost (the commit mark says it landed)
            return self.find(rollout_id)
        return load_entry(got)
