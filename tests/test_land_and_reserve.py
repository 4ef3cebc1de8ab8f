"""The trainer's per-step write in one step (issue 34): `dispatch_many` paces a batch of
dispatches as dispatching them one by one would, and `land_and_reserve` lands a step's
generations, closes what must not train and reserves, identically on every backend, with a
history the spec accepts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from rollout_lifecycle.model.backends import Backend, open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.errors import InvalidLedgerArgument
from rollout_lifecycle.model.ledger import (
    ALREADY_DISPATCHED,
    RESERVED,
    ActivationPremise,
    Landing,
    ReserveRequest,
)
from rollout_lifecycle.model.pacing import CHAIN_LIVE, DISPATCHED, NO_CAPACITY
from rollout_lifecycle.model.records import (
    AdmissionPolicy,
    AdmissionStamp,
    Disposition,
    LedgerEntry,
    Reward,
    WorkerAck,
)
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.model.rules import (
    ARTIFACT_HASH_MISMATCH,
    POINTER_MOVED,
    VERSION_NOT_ACTIVE,
    VERSION_RETIRED,
)
from rollout_lifecycle.model.sql_unit import SqlUnit
from rollout_lifecycle.spec.invariants import check_trace
from rollout_lifecycle.stateful_tests.backends import durable_url

KINDS = ["memory", "sqlite", "postgresql"]
H = {v: f"{v:x}".rjust(64, "c") for v in range(320)}
R = Reward("rm", "1", 0.5)
PACED = AdmissionPolicy(max_lag=1, max_drift=0.2, batch_size=2, max_attempts=2)
LOOSE = AdmissionPolicy(max_lag=1, max_drift=0.2)  # no pacing: an absent rollout is added
# the generator names each chain (a LedgerEntry names no prompt)
BY_CALLER = AdmissionPolicy(
    max_lag=1, max_drift=0.2, batch_size=2, max_attempts=2, chain_key="caller"
)


@contextlib.contextmanager
def deployment(
    kind: str, tmp_path: Path, policy: AdmissionPolicy = PACED
) -> Iterator[tuple[Backend, ActivationCoordinator]]:
    url = "memory://" if kind == "memory" else durable_url(kind, tmp_path)
    with open_backend(url) as b:
        set_admission_policy(b.registry, policy, "set by the operator")
        coord = ActivationCoordinator(b.registry, ["w0"], ledger=b.ledger, policy=policy)
        activate(coord, 0)
        yield b, coord


def activate(coord: ActivationCoordinator, v: int) -> None:
    coord.prepare(v)
    coord.commit_artifact(v, H[v])
    coord.distribute(v)
    assert coord.record_ack(WorkerAck("w0", v, H[v], token=coord.attempt_token("w0", v))).counted
    assert coord.try_activate(v).activated


def stamp(current: int, behavior: int, policy: AdmissionPolicy = PACED) -> AdmissionStamp:
    lag = current - behavior
    fresh = "fresh" if lag == 0 else "tolerated"
    return AdmissionStamp(
        current, behavior, policy.max_lag, policy.max_drift, 0.0, fresh, "ok", True
    )


@pytest.mark.parametrize("kind", KINDS)
def test_dispatch_many_paces_like_one_by_one(kind: str, tmp_path: Path) -> None:
    """Budget (1 + 1) x 2 = 4 live: a batch of 6 dispatches 4, refuses 2 for capacity, a
    second attempt on a live chain is refused, and an id already stored is returned as is."""
    with deployment(kind, tmp_path, BY_CALLER) as (b, _):
        led = b.ledger
        got = led.dispatch_many(
            [(LedgerEntry(f"g{i}", 0, H[0]), f"p{i}") for i in range(4)]
            + [(LedgerEntry("g0b", 0, H[0]), "p0"), (LedgerEntry("g5", 0, H[0]), "p5")]
        )
        assert [o.reason for o in got] == [DISPATCHED] * 4 + [CHAIN_LIVE, NO_CAPACITY]
        assert [o.attempt for o in got[:4]] == [1, 1, 1, 1]
        again = led.dispatch_many([(LedgerEntry("g1", 0, H[0]), "p1")])
        assert again[0].reason == ALREADY_DISPATCHED and again[0].entry is not None
        assert again[0].entry.state == "dispatched" and again[0].entry.chain == "p1"
        assert led.statistics().by_state["dispatched"] == 4
        assert not check_trace(b.trace()).violations


@pytest.mark.parametrize(
    "kind",
    [
        "memory",
        "sqlite",
        "postgresql",
    ],
)
def test_land_and_reserve_in_one_step(kind: str, tmp_path: Path) -> None:
    """A dispatched rollout is landed (generation_done, reward_ready) and reserved; an absent
    one is added and reserved; a failed one is closed at stage generation; a stale one is
    retired with its cause; one already landed is left alone; all in one step."""
    with deployment(kind, tmp_path, LOOSE) as (b, coord):
        led = b.ledger
        led.dispatch_many([(LedgerEntry(f"d{i}", 0, H[0]), f"c{i}") for i in range(3)])
        led.add(LedgerEntry("old", 0, H[0], state="rewarded", reward=R))
        activate(coord, 1)
        activate(coord, 2)  # v0 is now 2 behind (max_lag 1)
        fail = Disposition("generation", "group_failure", "a session raised")
        step = led.land_and_reserve(
            "u.s1",
            [
                Landing("d0", 0, H[0], reward=R, tokens=7),
                Landing("d1", 0, H[0], failure=fail),
                Landing("new", 2, H[2], reward=R, tokens=3),
                Landing("d2", 0, H[0], reward=R, tokens=5),
            ],
            close=[("d2", "retire_stale", Disposition("admission", "stale", "lag 2 > 1"))],
            reserve={"new": stamp(2, 2), "d0": stamp(2, 0)},
        )
        assert step.reserved == ["new"]
        by = {o.rollout_id: o for o in step.outcomes}
        assert not by["d0"].reserved  # lag 2 > max_lag 1: the premise refuses the stamp
        assert step.entries["new"].state == "reserved"
        assert step.entries["new"].reserved_by == "u.s1" and step.entries["new"].tokens == 3
        assert led.get("d0").state == "rewarded" and led.get("d0").tokens == 7
        assert led.get("d1").state == "generation_failed"
        assert led.get("d2").state == "retired_stale"
        assert led.get("d2").disposition == Disposition("admission", "stale", "lag 2 > 1")
        assert led.get("new").chain is None  # added, never dispatched
        assert led.get("d0").chain == "c0" and led.get("d0").attempt == 1
        again = led.land_and_reserve(
            "u.s2", [Landing("d0", 0, H[0], reward=R, tokens=7)], reserve={"old": stamp(2, 0)}
        )
        assert again.skipped == {"d0": "rewarded"} and again.reserved == []
        assert led.commit("u.s1", ["new"])[0].state == "consumed"
        assert not check_trace(b.trace()).violations


@pytest.mark.parametrize("kind", KINDS)
def test_under_pacing_only_dispatch_makes_entries(kind: str, tmp_path: Path) -> None:
    """A pacing policy counts every entry on the budget and its prompt's chain: a landing of
    a rollout never dispatched adds nothing ('not_dispatched'); a dispatched one lands."""
    with deployment(kind, tmp_path, BY_CALLER) as (b, _):
        led = b.ledger
        led.dispatch_many([(LedgerEntry("d0", 0, H[0]), "c0")])
        step = led.land_and_reserve(
            "u.s1",
            [Landing("d0", 0, H[0], reward=R), Landing("stray", 0, H[0], reward=R)],
            reserve={"d0": stamp(0, 0), "stray": stamp(0, 0)},
        )
        assert step.reserved == ["d0"] and step.skipped == {"stray": "not_dispatched"}
        assert led.find("stray") is None
        assert not check_trace(b.trace()).violations


@pytest.mark.parametrize("kind", KINDS)
def test_land_and_reserve_quarantines_a_bad_version_and_refuses_bad_input(
    kind: str, tmp_path: Path
) -> None:
    with deployment(kind, tmp_path, LOOSE) as (b, _):
        led = b.ledger
        led.quarantine_version(3, "distribution failed")
        step = led.land_and_reserve(
            "u.s1", [Landing("late", 3, H[3], reward=R)], reserve={"late": stamp(0, 0)}
        )
        assert step.entries["late"].state == "quarantined" and step.reserved == []
        with pytest.raises(InvalidLedgerArgument, match="close takes"):
            led.land_and_reserve(None, close=[("late", "commit", Disposition("admission", "y"))])
        with pytest.raises(InvalidLedgerArgument, match="update id"):
            led.land_and_reserve(None, reserve={"late": stamp(0, 0)})
        assert led.land_and_reserve(None).entries == {}
        assert not check_trace(b.trace()).violations


@pytest.mark.parametrize("kind", KINDS)
def test_dispatch_many_counts_attempts_by_prompt_identity(kind: str, tmp_path: Path) -> None:
    """Under the default chain_key 'identity' a batch's chains are the rollouts' prompt
    identities, as `dispatch` chooses them: fresh ids of one prompt share its chain."""
    from rollout_lifecycle.model.pacing import identity_chain
    from rollout_lifecycle.model.records import (
        BehaviorPolicy,
        GenerationConditions,
        Rollout,
        RolloutIdentity,
    )

    cond = GenerationConditions("tok", 1.0, 1.0, -1, 8)

    def rollout(rid: str, prompt: str) -> Rollout:
        return Rollout(RolloutIdentity(rid, prompt, "ds", 0), BehaviorPolicy(0, H[0]), cond)

    with deployment(kind, tmp_path) as (b, _):
        led = b.ledger
        got = led.dispatch_many([(rollout("a1", "p"), None), (rollout("a2", "p"), None)])
        assert [o.reason for o in got] == [DISPATCHED, CHAIN_LIVE]
        chain = identity_chain(RolloutIdentity("a1", "p", "ds", 0))
        assert led.get("a1").chain == chain
        with pytest.raises(InvalidLedgerArgument, match="LedgerEntry names no prompt"):
            led.dispatch_many([(LedgerEntry("bare", 0, H[0]), "mine")])
        assert not check_trace(b.trace()).violations


@pytest.mark.parametrize("kind", KINDS)
def test_step_premise_is_the_separate_reads_in_one(kind: str, tmp_path: Path) -> None:
    """`step_premise` answers what the registry's pointer and policy, the bad versions and
    `reserved_by` of each asked-for update answer, in one read, on every backend; it checks
    the update ids it is given."""
    with deployment(kind, tmp_path, LOOSE) as (b, coord):
        led = b.ledger
        activate(coord, 1)
        led.dispatch_many([(LedgerEntry(f"d{i}", 1, H[1]), f"c{i}") for i in range(3)])
        led.land_and_reserve(
            "u.s1",
            [Landing(f"d{i}", 1, H[1], reward=R, tokens=4) for i in range(3)],
            reserve={"d2": stamp(1, 1), "d0": stamp(1, 1)},
        )
        led.quarantine_version(0, "a failed activation")
        got = led.step_premise(["u.s1", "u.s9", "u.s1"])
        pointer = b.registry.pointer()
        assert got.pointer == (None if pointer is None else pointer.version) == 1
        assert got.policy == b.registry.policy() == LOOSE
        assert got.bad == led.bad_versions == frozenset({0})
        assert got.held == {"u.s1": led.reserved_by("u.s1"), "u.s9": []}
        assert got.held["u.s1"] == ["d0", "d2"]
        assert led.step_premise().held == {}
        with pytest.raises(InvalidLedgerArgument):
            led.step_premise([""])


def test_step_premise_without_a_registry(tmp_path: Path) -> None:
    """A ledger file with no registry reads no pointer and no policy (as its premise)."""
    from rollout_lifecycle.model.sqlite_ledger import SQLiteLedger

    led = SQLiteLedger(tmp_path / "alone.db")
    try:
        got = led.step_premise(["u.s1"])
        assert (got.pointer, got.policy, got.bad, got.held) == (
            None,
            None,
            frozenset(),
            {"u.s1": []},
        )
    finally:
        led.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_dispatched_batch_reads_its_chains_at_once(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dispatch_many` reads every chain of the batch in one `chain_states` call (one
    statement per 500 chains on the SQL stores), with the answers of one by one: 600
    first attempts, then a batch holding the second attempt of each failed chain, a chain
    still live, a new chain and a repeat of a chain within the batch."""
    from rollout_lifecycle.model import ledger as ledger_module

    policy = AdmissionPolicy(
        max_lag=1, max_drift=0.2, batch_size=1000, max_attempts=3, chain_key="caller"
    )
    with deployment(kind, tmp_path, policy) as (b, _):
        led = b.ledger
        first = led.dispatch_many([(LedgerEntry(f"a{i}", 0, H[0]), f"c{i}") for i in range(600)])
        assert [o.reason for o in first] == [DISPATCHED] * 600
        fail = Disposition("generation", "group_failure", "a session raised")
        led.land_and_reserve(  # type: ignore[attr-defined]
            None, [Landing(f"a{i}", 0, H[0], failure=fail) for i in range(0, 600, 2)]
        )
        unit = ledger_module.MemoryStore if kind == "memory" else SqlUnit
        orig = unit.chain_states
        seen: list[list[str]] = []

        def spy(self: object, chains: list[str]) -> dict[str, tuple[str, ...]]:
            seen.append(list(chains))
            return orig(self, chains)  # type: ignore[arg-type]

        monkeypatch.setattr(unit, "chain_states", spy)
        batch = [(LedgerEntry(f"b{i}", 0, H[0]), f"c{i}") for i in range(0, 600, 2)]
        batch += [(LedgerEntry("b1", 0, H[0]), "c1"), (LedgerEntry("bnew", 0, H[0]), "cnew")]
        batch += [(LedgerEntry("bnew2", 0, H[0]), "cnew")]
        got = led.dispatch_many(batch)
        assert len(seen) == 1 and len(seen[0]) == 302, [len(s) for s in seen]
        assert [o.reason for o in got[:300]] == [DISPATCHED] * 300
        assert {o.attempt for o in got[:300]} == {2}
        assert [o.reason for o in got[300:]] == [CHAIN_LIVE, DISPATCHED, CHAIN_LIVE]
        assert got[301].attempt == 1
        assert not check_trace(b.trace()).violations


def _premise_reads(
    kind: str, b: Backend, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[tuple[object, ActivationPremise]], list[str]]:
    """From now on: each premise read of a step (the versions it asked about, what it got)
    and every statement the SQL stores send (SQLite's with its values bound)."""
    from rollout_lifecycle.model import ledger as ledger_module

    unit: Any = ledger_module.MemoryStore
    if kind == "sqlite":
        from rollout_lifecycle.model import sqlite_ledger

        unit = sqlite_ledger._Unit
    elif kind == "postgresql":
        from rollout_lifecycle.model import postgres_ledger

        unit = postgres_ledger._Unit
    reads: list[tuple[object, ActivationPremise]] = []
    statements: list[str] = []
    real = unit.read_premise

    def spy(self: Any, *args: Any) -> ActivationPremise:
        got: ActivationPremise = real(self, *args)
        reads.append((args[0] if args else None, got))
        return got

    monkeypatch.setattr(unit, "read_premise", spy)
    if kind == "sqlite":
        b.ledger._conn().set_trace_callback(statements.append)  # type: ignore[attr-defined]
    elif kind == "postgresql":
        import psycopg

        execute = psycopg.Connection.execute

        def recording(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
            statements.append(f"{query} -- {params!r}")
            return execute(self, query, params, **kwargs)

        monkeypatch.setattr(psycopg.Connection, "execute", recording)
    return reads, statements


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_reads_the_premise_of_its_versions_only(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34: after 300 activations (one per training step), a trainer's step (dispatch,
    land and reserve, commit) reads whether the versions of its own rows were ever active,
    retired and their hashes, not all 300: by primary key on the SQL stores, in the one
    premise statement of each step. Reading every ever-active version made each step cost
    more as the run went on."""
    with deployment(kind, tmp_path, BY_CALLER) as (b, coord):
        top = 300
        for v in range(1, top + 1):
            activate(coord, v)
        led = b.ledger
        reads, statements = _premise_reads(kind, b, monkeypatch)
        got = led.dispatch_many([(LedgerEntry("new", top, H[top]), "c0")])
        got += led.dispatch_many([(LedgerEntry("old", top - 1, H[top - 1]), "c1")])
        assert [o.reason for o in got] == [DISPATCHED, DISPATCHED]
        step = led.land_and_reserve(
            "u.s1",
            [Landing(r, v, H[v], reward=R) for r, v in (("new", top), ("old", top - 1))],
            reserve={"new": stamp(top, top, BY_CALLER), "old": stamp(top, top - 1, BY_CALLER)},
        )
        assert step.reserved == ["new", "old"]
        assert [e.state for e in led.commit("u.s1", ["new", "old"])] == ["consumed"] * 2
        monkeypatch.undo()
        judged = frozenset({top - 1, top})
        assert len(reads) == 4  # one premise read per step
        for asked, premise in reads:
            assert premise.was_active is not None and len(premise.was_active) <= 2
            assert premise.was_active <= judged and set(premise.hashes or ()) <= judged
            assert premise.pointer_version == top and premise.policy == BY_CALLER
            assert isinstance(asked, frozenset) and asked <= judged, asked
        assert reads[2][1].was_active == judged  # the reservation judged both versions
        assert reads[2][1].hashes == {v: H[v] for v in judged}
        registry = [q for q in statements if "registry_artifacts" in q]
        if kind == "sqlite":  # the versions bound as one JSON array, looked up by key
            assert len(registry) == 4, registry
            assert all("json_each('[" in q for q in registry), registry
            assert f"json_each('[{top - 1}, {top}]')" in registry[2]
        elif kind == "postgresql":
            assert len(registry) == 4, registry
            assert all("version = ANY(" in q for q in registry), registry
            assert f"[{top - 1}, {top}]" in registry[2]
        assert not check_trace(b.trace()).violations


@pytest.mark.parametrize("path", ["land_and_reserve", "reserve_batch", "reserve"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_premise_of_the_judged_versions_decides_as_the_whole(
    kind: str, path: str, tmp_path: Path
) -> None:
    """Each reservation path refuses and reserves as the premise of every version does:
    the active version and an older one within max_lag reserve; one beyond max_lag (the
    pointer moved), one rolled back, one registered but never active, one never
    registered and one with another hash than its version's are refused, each for its
    reason."""
    with deployment(kind, tmp_path, LOOSE) as (b, coord):
        top = 6
        for v in range(1, top + 2):
            activate(coord, v)
        led = b.ledger
        cases = {  # id: (behaviour version, hash, stamp, expected reason)
            "active": (top, H[top], stamp(top, top, LOOSE), RESERVED),
            "older": (top - 1, H[top - 1], stamp(top, top - 1, LOOSE), RESERVED),
            "stale": (top - 2, H[top - 2], stamp(top - 1, top - 2, LOOSE), POINTER_MOVED),
            "retired": (top + 1, H[top + 1], stamp(top + 1, top + 1, LOOSE), VERSION_RETIRED),
            "never": (top + 2, H[top + 2], stamp(top + 2, top + 2, LOOSE), VERSION_NOT_ACTIVE),
            "unknown": (top + 9, H[top + 9], stamp(top + 9, top + 9, LOOSE), VERSION_NOT_ACTIVE),
            "hash": (top - 1, H[top], stamp(top, top - 1, LOOSE), ARTIFACT_HASH_MISMATCH),
        }
        for rid, (v, h, _, _) in cases.items():
            led.add(LedgerEntry(rid, v, h, state="rewarded", reward=R))
        # rolled back by a coordinator without the ledger: its rows stay rewarded
        ActivationCoordinator(b.registry, ["w0"], policy=LOOSE).rollback()
        coord.prepare(top + 2)
        coord.commit_artifact(top + 2, H[top + 2])
        whole, rows = led.premise_and_rows(list(cases))
        assert whole.pointer_version == top and whole.retired == {top + 1}
        for rid, (v, h, s, reason) in cases.items():  # the whole premise's verdicts
            refused = whole.refusal(s, v, h)
            assert (RESERVED if refused is None else refused[0]) == reason, rid
        if path == "land_and_reserve":
            outcomes = list(
                led.land_and_reserve("u.s1", reserve={r: c[2] for r, c in cases.items()}).outcomes
            )
        elif path == "reserve_batch":
            requests = [ReserveRequest(r, rows[r].revision, c[2]) for r, c in cases.items()]
            outcomes = led.reserve_batch("u.s1", requests)
        else:
            outcomes = [led.reserve(r, rows[r].revision, "u.s1", c[2]) for r, c in cases.items()]
        assert {o.rollout_id: o.reason for o in outcomes} == {r: c[3] for r, c in cases.items()}
        assert led.reserved_by("u.s1") == ["active", "older"]
        assert not check_trace(b.trace()).violations


@pytest.mark.parametrize("kind", KINDS)
def test_a_dispatched_batch_sends_one_chain_statement(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34, item 2, at the store's edge: dispatching 8 or 64 prompts (a 64x8 step's
    batch) sends the same single statement that reads their chains, and one premise read
    of their one version."""
    wide = AdmissionPolicy(max_lag=1, max_drift=0.2, batch_size=64, max_attempts=2)
    with deployment(kind, tmp_path, attrs.evolve(wide, chain_key="caller")) as (b, _):
        reads, statements = _premise_reads(kind, b, monkeypatch)
        counts, totals = [], []
        for n, tag in ((1, "w"), (8, "s"), (64, "l")):  # w: the first step's probes
            statements.clear()
            batch = [(LedgerEntry(f"{tag}{i}", 0, H[0]), f"{tag}c{i}") for i in range(n)]
            got = b.ledger.dispatch_many(batch)
            assert [o.reason for o in got] == [DISPATCHED] * n
            field = ("'$.chain'", "->>'chain'")  # SQLite's and PostgreSQL's chain of a row
            reads_chains = [q for q in statements if any(f in q for f in field)]
            counts.append(sum(q.startswith("SELECT") for q in reads_chains))
            totals.append(len(statements))
        monkeypatch.undo()
        assert counts == ([0] * 3 if kind == "memory" else [1] * 3), counts
        if kind == "postgresql":  # every statement of the step: as many for 8 as for 64
            assert totals[1] == totals[2], totals
        assert [asked for asked, _ in reads] == [frozenset({0})] * 3
