"""Hostile input gets the project's typed errors, the same on every backend (issue 23 item 11).

One limit for ids everywhere (MAX_ID_LENGTH characters, no NUL, valid Unicode) and one for
stored integers (signed 64-bit): a record one backend stores is never refused by another,
and no backend answers with a UnicodeEncodeError, an OverflowError or an AttributeError.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.errors import (
    ActivationError,
    GateConfigError,
    InvalidLedgerArgument,
    InvalidRecord,
    StorageFull,
)
from rollout_lifecycle.model.ledger import Ledger, ManualClock, ReserveRequest
from rollout_lifecycle.model.records import (
    MAX_ID_LENGTH,
    Disposition,
    LedgerEntry,
    RolloutIdentity,
    WorkerAck,
)
from rollout_lifecycle.model.registry import MemoryRegistry, RegistryStore, SQLiteRegistry
from rollout_lifecycle.stateful_tests.backends import fresh_schema, postgres_url
from tests.helpers_ledger import HASH, rewarded, stamp
from tests.ledger_backends import BACKENDS

LONE_SURROGATE = "r\ud800x"
HOSTILE_IDS = {
    "lone surrogate": LONE_SURROGATE,
    "NUL": "r\x00x",
    "too long": "r" * (MAX_ID_LENGTH + 1),
}


@pytest.fixture(params=sorted(BACKENDS))
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    """A fresh ledger of each backend (PostgreSQL on the session's throwaway server)."""
    led = BACKENDS[request.param](tmp_path, ManualClock(0.0))
    yield led
    led.close()


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def registry(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RegistryStore]:
    """A fresh registry of each backend."""
    reg: RegistryStore
    if request.param == "memory":
        reg = MemoryRegistry()
    elif request.param == "sqlite":
        reg = SQLiteRegistry(tmp_path / "state.db")
    else:
        from rollout_lifecycle.model.postgres_registry import PostgresRegistry

        url = postgres_url()
        reg = PostgresRegistry(url, schema=fresh_schema(url, tmp_path))
    yield reg
    reg.close()


@pytest.mark.parametrize("bad", sorted(HOSTILE_IDS.values()), ids=sorted(HOSTILE_IDS))
def test_records_refuse_ids_no_backend_could_store(bad: str) -> None:
    """The validators of the records are the one place the limit lives."""
    with pytest.raises(InvalidRecord):
        RolloutIdentity(bad, "p", "d", 0)
    with pytest.raises(InvalidRecord):
        LedgerEntry(bad, 0, HASH)
    with pytest.raises(InvalidRecord):
        WorkerAck(bad, 0, HASH)


def test_records_refuse_integers_beyond_64_bits_and_unstorable_text() -> None:
    """Versions and revisions live in signed 64-bit columns; free text has no length limit
    but must be storable (PostgreSQL text holds no NUL)."""
    assert LedgerEntry("r", 2**63 - 1, HASH).behavior_version == 2**63 - 1
    with pytest.raises(InvalidRecord, match="64 bits"):
        LedgerEntry("r", 2**63, HASH)
    with pytest.raises(InvalidRecord, match="64 bits"):
        LedgerEntry("r", 0, HASH, revision=2**70)
    assert Disposition("reward", "x" * 5000).cause
    with pytest.raises(InvalidRecord, match="NUL"):
        Disposition("reward", "timeout", "detail\x00")
    with pytest.raises(InvalidRecord, match="surrogate"):
        Disposition("reward", LONE_SURROGATE)


def test_ledger_stores_the_longest_id_and_refuses_hostile_ones(ledger: Ledger) -> None:
    """Every backend stores an id of exactly MAX_ID_LENGTH, and refuses the same hostile ids
    in every call that names one, with InvalidLedgerArgument and nothing written."""
    longest = "i" * MAX_ID_LENGTH
    ledger.add(rewarded(longest))
    assert ledger.get(longest).rollout_id == longest
    before = ledger.snapshot()
    for bad in HOSTILE_IDS.values():
        calls: list[Callable[[], Any]] = [
            lambda bad=bad: ledger.find(bad),
            lambda bad=bad: ledger.get(bad),
            lambda bad=bad: ledger.history(bad),
            lambda bad=bad: ledger.transition(bad, "reward_timeout", 0),
            lambda bad=bad: ledger.reserve(bad, 0, "u", stamp()),
            lambda bad=bad: ledger.reserve(longest, 0, bad, stamp()),
            lambda bad=bad: ledger.reserve_batch("u", [ReserveRequest(bad, 0, stamp())]),
            lambda bad=bad: ledger.reserve_batch(bad, [ReserveRequest(longest, 0, stamp())]),
            lambda bad=bad: ledger.commit("u", [bad]),
            lambda bad=bad: ledger.abort(bad),
        ]
        for call in calls:
            with pytest.raises(InvalidLedgerArgument):
                call()
    assert ledger.snapshot() == before


def test_ledger_refuses_malformed_batches_and_huge_revisions(ledger: Ledger) -> None:
    """reserve_batch given a str, a dict or tuples, and revisions beyond 64 bits, are typed
    refusals on every backend (PostgreSQL raised AttributeError, SQLite OverflowError)."""
    ledger.add(rewarded("r"))
    before = ledger.snapshot()
    for requests in ("r", {"r": 0}, [("r", 0, stamp())]):
        with pytest.raises(InvalidLedgerArgument):
            ledger.reserve_batch("u", requests)  # type: ignore[arg-type]
    with pytest.raises(InvalidLedgerArgument):
        ledger.reserve("r", 2**70, "u", stamp())
    with pytest.raises(InvalidLedgerArgument):
        ledger.transition("r", "reward_timeout", 2**70)
    assert ledger.snapshot() == before


def test_registry_refuses_huge_versions_and_hostile_worker_ids(registry: RegistryStore) -> None:
    """prepare(2**70) was an OverflowError on SQLite; a NUL worker id was accepted on SQLite
    and refused on PostgreSQL. Now ActivationError on all three, nothing recorded."""
    coord = ActivationCoordinator(registry, ["w0"])
    with pytest.raises(ActivationError, match="64 bits"):
        coord.prepare(2**70)
    for bad in HOSTILE_IDS.values():
        with pytest.raises(ActivationError):
            ActivationCoordinator(registry, ["w0", bad])
    assert registry.max_version() is None
    assert coord.prepare(2**63 - 1).version == 2**63 - 1


def _fill_the_disk(conn: sqlite3.Connection) -> None:
    """Make every further page allocation fail as a full disk does (SQLITE_FULL)."""
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count = {pages}")


def test_a_full_disk_is_the_same_typed_error_from_ledger_and_registry(tmp_path: Path) -> None:
    """SQLite's 'database or disk is full' surfaces as StorageFull from the ledger and the
    registry alike (the registry used to say ActivationError, as if it had refused)."""
    with open_backend(f"sqlite:///{tmp_path / 'full.db'}") as be:
        coord = ActivationCoordinator(be.registry, ["w0"], ledger=be.ledger)
        be.ledger.add(rewarded("r0"))
        _fill_the_disk(be.ledger._conn())  # type: ignore[attr-defined]
        with pytest.raises(StorageFull, match="disk is full"):
            be.ledger.add_many([rewarded(f"r{i}") for i in range(1, 2000)])  # type: ignore[attr-defined]
        _fill_the_disk(be.registry._conn)  # type: ignore[attr-defined]
        with pytest.raises(StorageFull, match="disk is full"):
            for v in range(2000):
                coord.prepare(v, rollback_version=None)
        assert be.ledger.statistics().entries == 1


def test_gate_refuses_a_meta_tensor() -> None:
    """A tensor on torch's 'meta' device has no values: GateConfigError, not
    NotImplementedError from deep inside torch."""
    torch = pytest.importorskip("torch")
    from rollout_lifecycle.model.gate import assess_arrays

    meta = torch.zeros(2, 3, device="meta")
    real = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    for args in ((meta, real, mask), (real, meta, mask), (real, real, mask.to("meta"))):
        with pytest.raises(GateConfigError, match="meta"):
            assess_arrays(*args, [0, 0], 0, 1, 0.2)


def test_diagram_coverage_nested_100000_deep_is_a_usage_error(tmp_path: Path) -> None:
    """100,000 nested brackets in --coverage: exit 2 with one line, no RecursionError."""
    deep = tmp_path / "deep.json"
    deep.write_text('{"machines": ' + "[" * 100_000 + "]" * 100_000 + "}")
    res = subprocess.run(
        [sys.executable, "-m", "rollout_lifecycle", "diagram", "--coverage", str(deep)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    assert "nested too deeply" in res.stderr and "Traceback" not in res.stderr
