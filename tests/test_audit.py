"""The tamper-evident history and the store audit (spec/audit.py) on every backend: an
untouched store passes, and each edit of the issue's reproductions is named."""

from __future__ import annotations

import itertools
import json
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from click.testing import CliRunner

from rollout_lifecycle.cli.main import cli
from rollout_lifecycle.model.backends import Backend, open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.errors import HistoryTampered
from rollout_lifecycle.model.events import (
    GENESIS,
    EntryChanged,
    EntryStates,
    StoredEvent,
    chain_hash,
    event_to_jsonable,
)
from rollout_lifecycle.model.ledger import MemoryLedger, ReserveRequest
from rollout_lifecycle.model.records import (
    AdmissionPolicy,
    AdmissionStamp,
    LedgerEntry,
    Reward,
    WorkerAck,
)
from rollout_lifecycle.model.registry import MemoryRegistry, set_admission_policy
from rollout_lifecycle.model.sql_unit import SqlUnit
from rollout_lifecycle.model.sqlite_common import read_events as sqlite_read_events
from rollout_lifecycle.spec.audit import AuditReport, audit, row_hash
from rollout_lifecycle.stateful_tests.backends import fresh_schema, postgres_url, with_schema
from rollout_lifecycle.stateful_tests.tamperings import TAMPERINGS

H0 = "a" * 64
REWARD = Reward("rm", "1", 1.0)
IDS = ("r0", "r1", "r2")
STAMP = AdmissionStamp(
    current_version=0,
    behavior_version=0,
    max_lag=1,
    max_drift=0.2,
    drift=0.01,
    freshness="fresh",
    reason="ok",
    accepted=True,
)


def build(b: Backend) -> None:
    """v0 active under a recorded policy; each rollout added at dispatch and driven through
    generation_done and reward_ready; r0 and r1 reserved and consumed by u1, r2 rewarded."""
    c = ActivationCoordinator(b.registry, ["w0"], ledger=b.ledger)
    set_admission_policy(b.registry, AdmissionPolicy(1, 0.2), "audit test")
    c.prepare(0)
    c.commit_artifact(0, H0)
    c.distribute(0)
    assert c.record_ack(WorkerAck("w0", 0, H0, token=c.attempt_token("w0", 0))).counted
    assert c.try_activate(0).activated
    for rid in IDS:
        e = b.ledger.add(LedgerEntry(rollout_id=rid, behavior_version=0, artifact_hash=H0))
        e = b.ledger.transition(rid, "generation_done", e.revision)
        b.ledger.transition(rid, "reward_ready", e.revision, reward=REWARD)
    won = b.ledger.reserve_batch("u1", [ReserveRequest(r, 2, STAMP) for r in IDS[:2]])
    assert all(o.reserved for o in won), won
    b.ledger.commit("u1", list(IDS[:2]))


@attrs.define
class Store:
    """A built deployment on one backend, and how to edit it behind the library's back."""

    kind: str
    url: str
    backend: Backend
    path: Path | None = None

    def audit(self) -> AuditReport:
        """Read one snapshot and audit it."""
        return audit(self.backend.stored_rows())

    def sql(self, *statements: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Run statements as a user with sqlite3 or psql would; the last one's rows."""
        rows: list[tuple[Any, ...]] = []
        if self.kind == "sqlite":
            conn = sqlite3.connect(str(self.path))
            try:
                for s in statements:
                    rows = conn.execute(s, args).fetchall()
                conn.commit()
            finally:
                conn.close()
            return rows
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as pg:
            for s in statements:
                cur = pg.execute(s.replace("?", "%s"), list(args) or None)
                rows = cur.fetchall() if cur.description else []
        return rows

    def event_rows(self) -> list[tuple[Any, ...]]:
        """(seq, kind, subject, payload) of every stored event, in order."""
        if self.kind == "memory":
            return [
                (e.seq, e.kind, e.subject, e.payload) for e in self.backend.stored_rows().events
            ]
        return self.sql("SELECT seq, kind, subject, payload FROM events ORDER BY seq")


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """The deployment of `build`, on each backend."""
    path = None
    if request.param == "memory":
        url = "memory://"
    elif request.param == "sqlite":
        path = tmp_path / "ledger.db"
        url = f"sqlite:///{path}"
    else:
        base = postgres_url()
        url = with_schema(base, fresh_schema(base, tmp_path))
    s = Store(request.param, url, open_backend(url), path)
    try:
        build(s.backend)
        s.backend.stored_rows()  # memory chains its log when first read: seal it first
        yield s
    finally:
        s.backend.close()


def _memory_parts(s: Store) -> tuple[MemoryLedger, Any]:
    assert isinstance(s.backend.ledger, MemoryLedger)
    assert isinstance(s.backend.registry, MemoryRegistry)
    return s.backend.ledger, s.backend.registry.log


def found(report: AuditReport) -> dict[str, list[tuple[int | None, str]]]:
    """Findings by invariant: (seq, message)."""
    out: dict[str, list[tuple[int | None, str]]] = {}
    for v in report.violations:
        out.setdefault(v.invariant, []).append((v.seq, v.message))
    return out


# ---- good histories pass --------------------------------------------------------------------


def test_untouched_store_has_no_findings(store: Store) -> None:
    """Every event chained, the head at the last one, every compared column as replayed."""
    report = store.audit()
    assert report.violations == [], [str(v) for v in report.violations]
    events = store.event_rows()
    assert report.history.chained == len(events) == report.trace.events
    assert report.history.head_seq == events[-1][0]
    assert report.history.unchained_prefix == 0
    assert {"rollouts", "registry_artifacts", "registry_pointer"} <= set(report.store.compared)
    assert report.store.rows == len(IDS)


def test_chain_survives_concurrent_writers(store: Store) -> None:
    """Four threads writing at once still leave one unbroken chain (each step chains onto
    the step committed right before it)."""
    ledger = store.backend.ledger

    def work(t: int) -> None:
        for i in range(6):
            rid = f"t{t}-{i}"
            e = ledger.add(LedgerEntry(rollout_id=rid, behavior_version=0, artifact_hash=H0))
            ledger.transition(rid, "generation_done", e.revision)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    report = store.audit()
    assert report.violations == [], [str(v) for v in report.violations]
    assert report.history.chained == len(store.event_rows())


def test_the_checker_and_the_writers_hash_alike() -> None:
    """The spec's own hash of a row equals the writers' (the formula is stated twice)."""
    row = StoredEvent(7, 3, "entry", "r\x00é", '{"txn":3}', GENESIS, None)
    want = chain_hash(GENESIS, 7, 3, "entry", "r\x00é", '{"txn":3}')
    assert row_hash(row) == want
    assert row_hash(attrs.evolve(row, txn=4)) != want
    text: Any = "3"  # SQLite stores whatever an UPDATE puts in a column
    assert row_hash(attrs.evolve(row, txn=text)) is None


# ---- edited columns -------------------------------------------------------------------------


def test_consumed_state_set_back_to_rewarded_is_flagged(store: Store) -> None:
    """sqlite3/psql `UPDATE rollouts SET state = 'rewarded'` on a consumed rollout."""
    if store.kind == "memory":
        led, _ = _memory_parts(store)
        led._entries["r0"] = attrs.evolve(led._entries["r0"], state="rewarded")
    else:
        store.sql("UPDATE rollouts SET state = 'rewarded' WHERE rollout_id = 'r0'")
    got = found(store.audit())
    assert set(got) == {"stored_matches_trace"}, got
    ((_, msg),) = got["stored_matches_trace"]
    assert msg.startswith("r0: stored rewarded rev 4, the trace says consumed rev 4"), msg
    assert "state: stored 'rewarded', replayed 'consumed'" in msg


def test_revision_set_to_99_is_flagged(store: Store) -> None:
    """`UPDATE rollouts SET revision = 99`: the column alone, the JSON entry untouched."""
    if store.kind == "memory":
        led, _ = _memory_parts(store)
        led._entries["r0"] = attrs.evolve(led._entries["r0"], revision=99)
    else:
        store.sql("UPDATE rollouts SET revision = 99 WHERE rollout_id = 'r0'")
    got = found(store.audit())
    assert set(got) == {"stored_matches_trace"}, got
    assert "revision: stored 99, replayed 4" in got["stored_matches_trace"][0][1]


@pytest.mark.parametrize("column", ["entry", "lease_expires_at", "reserved_by"])
def test_every_rollout_column_is_compared(store: Store, column: str) -> None:
    """The JSON entry, the lease and the owner are compared like state and revision."""
    if store.kind == "memory":
        pytest.skip("memory keeps one record per rollout, not columns")
    edit = {
        "entry": "entry = replace(entry, '\"releases\":0', '\"releases\":3')",
        "lease_expires_at": "lease_expires_at = 5.0",
        "reserved_by": "state = 'reserved', reserved_by = 'intruder'",
    }[column]
    store.sql(f"UPDATE rollouts SET {edit} WHERE rollout_id = 'r1'")
    got = found(store.audit())
    assert set(got) == {"stored_matches_trace"}, got
    msg = got["stored_matches_trace"][0][1]
    assert msg.startswith("r1: ") and (column in msg or "JSON differs in releases" in msg), msg


def test_registry_columns_are_compared(store: Store) -> None:
    """The pointer and the recorded admission policy, edited in place, are named."""
    if store.kind == "memory":
        pytest.skip("memory has no columns to edit behind the registry's back")
    store.sql("UPDATE registry_pointer SET version = 7", "UPDATE registry_policy SET max_lag = 100")
    msgs = sorted(m for _, m in found(store.audit())["stored_matches_trace"])
    assert msgs == [
        "admission policy: max_lag: stored 100, replayed 1",
        "pointer: version: stored 7, replayed 0",
    ]


def test_a_row_with_no_history_is_flagged(store: Store) -> None:
    """A rollout inserted by hand: stored, but no event wrote it."""
    if store.kind == "memory":
        led, _ = _memory_parts(store)
        led._entries["zz"] = attrs.evolve(led._entries["r2"], rollout_id="zz")
    else:
        store.sql(
            "INSERT INTO rollouts SELECT 'zz', state, revision, reserved_by, lease_expires_at, "
            "behavior_version, replace(entry, '\"r2\"', '\"zz\"') FROM rollouts "
            "WHERE rollout_id = 'r2'"
        )
    got = found(store.audit())
    assert got == {
        "stored_matches_trace": [(None, "zz: stored (rewarded) but no trace event wrote it")]
    }


# ---- damaged history ------------------------------------------------------------------------


def _seqs(store: Store, subject: str, event: str | None = None) -> list[int]:
    return [
        int(seq)
        for seq, kind, subj, payload in store.event_rows()
        if kind == "entry"
        and subj == subject
        and (event is None or json.loads(payload)["event"] == event)
    ]


def _drop(store: Store, seqs: list[int]) -> None:
    """Delete these events (memory: from the log and its links alike)."""
    if store.kind == "memory":
        _, log = _memory_parts(store)
        keep = [i for i, e in enumerate(log._events) if e.seq not in seqs]
        log._events = [log._events[i] for i in keep]
        log._links = [log._links[i] for i in keep]
    else:
        marks = ",".join(str(s) for s in seqs)
        store.sql(f"DELETE FROM events WHERE seq IN ({marks})")


def test_deleted_run_of_events_is_flagged(store: Store) -> None:
    """r2's add, generation_done and reward_ready deleted: the gap is named at the next
    event, and r2's row is left without history."""
    run = _seqs(store, "r2")
    assert len(run) == 3
    after = min(s for s, *_ in store.event_rows() if s > max(run))
    _drop(store, run)
    got = found(store.audit())
    assert set(got) == {"history_deleted", "stored_matches_trace"}, got
    assert [seq for seq, _ in got["history_deleted"]] == [after]
    assert sorted(m for _, m in got["stored_matches_trace"]) == [
        "ledger counter writes: stored 13, the history records 10",  # the three writes gone
        "r2: stored (rewarded) but no trace event wrote it",
    ]


def test_swapped_payloads_are_flagged(store: Store) -> None:
    """Two events' payloads swapped: both named as edited, by seq."""
    (a,), (b,) = _seqs(store, "r0", "reserve"), _seqs(store, "r1", "reserve")
    if store.kind == "memory":
        _, log = _memory_parts(store)
        i, j = (next(k for k, e in enumerate(log._events) if e.seq == s) for s in (a, b))
        ea, eb = log._events[i], log._events[j]
        log._events[i] = attrs.evolve(eb, seq=ea.seq)
        log._events[j] = attrs.evolve(ea, seq=eb.seq)
    else:
        pa, pb = (
            store.sql("SELECT payload FROM events WHERE seq = ?", args=(s,))[0][0] for s in (a, b)
        )
        store.sql("UPDATE events SET payload = ? WHERE seq = ?", args=(pb, a))
        store.sql("UPDATE events SET payload = ? WHERE seq = ?", args=(pa, b))
    got = found(store.audit())
    assert [seq for seq, _ in got["history_edited"]] == [a, b], got
    assert not {"history_deleted", "history_reordered", "history_truncated"} & set(got)


def test_edited_payload_is_flagged(store: Store) -> None:
    """A reward value rewritten inside one event: that event is named as edited."""
    (seq,) = _seqs(store, "r2", "reward_ready")
    if store.kind == "memory":
        _, log = _memory_parts(store)
        i = next(k for k, e in enumerate(log._events) if e.seq == seq)
        ev = log._events[i]
        log._events[i] = attrs.evolve(
            ev, after=attrs.evolve(ev.after, reward=Reward("rm", "1", 0.0))
        )
    else:
        store.sql(
            "UPDATE events SET payload = replace(payload, '\"value\":1.0', '\"value\":0.0') "
            "WHERE seq = ?",
            args=(seq,),
        )
    got = found(store.audit())
    assert [s for s, _ in got["history_edited"]] == [seq], got


def test_reordered_events_are_flagged(store: Store) -> None:
    """Two whole rows swapped in place: the chain says the events were reordered."""
    a, b = _seqs(store, "r1", "generation_done")[0], _seqs(store, "r1", "reward_ready")[0]
    if store.kind == "memory":
        _, log = _memory_parts(store)
        i, j = (next(k for k, e in enumerate(log._events) if e.seq == s) for s in (a, b))
        log._events[i], log._events[j] = log._events[j], log._events[i]
        log._links[i], log._links[j] = log._links[j], log._links[i]
    else:
        cols = "txn, kind, subject, payload, prev_hash, hash"
        ra, rb = (
            store.sql(f"SELECT {cols} FROM events WHERE seq = ?", args=(s,))[0] for s in (a, b)
        )
        sets = "txn = ?, kind = ?, subject = ?, payload = ?, prev_hash = ?, hash = ?"
        store.sql(f"UPDATE events SET {sets} WHERE seq = ?", args=(*rb, a))
        store.sql(f"UPDATE events SET {sets} WHERE seq = ?", args=(*ra, b))
    got = found(store.audit())
    assert "history_reordered" in got, got
    assert {seq for seq, _ in got["history_reordered"]} >= {a, b}


def test_truncated_history_is_flagged(store: Store) -> None:
    """The last three events (u1's commit: its two rollouts and the update landing) cut off:
    the head names what is missing."""
    seqs = [int(s) for s, *_ in store.event_rows()]
    _drop(store, seqs[-3:])
    got = found(store.audit())
    assert "history_truncated" in got, got
    ((seq, msg),) = got["history_truncated"]
    assert seq == seqs[-4] and f"names event #{seqs[-1]}" in msg, msg
    # the rows still say consumed, the shortened history says reserved; the update's record
    # says landed, its history open; the counters counted the two writes cut off
    msgs = sorted(m for _, m in got["stored_matches_trace"])
    assert [m[:3] for m in msgs] == ["led", "r0:", "r1:", "upd"], msgs
    assert msgs[0] == "ledger counter writes: stored 13, the history records 11"


def test_deleted_head_is_flagged_and_no_writer_chains_on(store: Store) -> None:
    """The head deleted (so a cut-off tail would go unseen): named as a missing chain, and
    the next write is refused (HistoryTampered naming `ledger check`) instead of starting
    the chain again over the edited history; nothing is written."""
    if store.kind == "memory":
        pytest.skip("the memory log keeps its head beside the events, not in a table")
    store.sql("DELETE FROM events_chain")
    got = found(store.audit())
    assert "head is missing" in got.pop("history_missing")[0][1]
    if store.kind == "sqlite":  # the counters are columns of SQLite's head: gone with it
        assert all(m.startswith("ledger counter ") for _, m in got.pop("stored_matches_trace"))
    assert got == {}
    n = len(store.event_rows())
    with pytest.raises(HistoryTampered, match=r"has no head.*ledger check --backend"):
        store.backend.ledger.add(LedgerEntry(rollout_id="r9", behavior_version=0, artifact_hash=H0))
    assert len(store.event_rows()) == n and store.backend.ledger.find("r9") is None


# ---- databases from before the chain ------------------------------------------------------


def _unchain(store: Store) -> None:
    """Make the store look like one written before the chain existed: no chain, no seal,
    no recorded rows, schema versions of a program before the chain (ledger 1; no registry
    row: a writer creates it afresh). Every one of these is an edit a check alone cannot
    tell from the real thing: only an anchor can (test_a_forged_old_store_needs_an_anchor)."""
    store.sql(
        "DELETE FROM events WHERE kind = 'row'",
        "DELETE FROM schema_meta WHERE component <> 'ledger'",
        "UPDATE schema_meta SET version = 1",
    )
    if store.kind == "sqlite":
        store.sql(
            "ALTER TABLE events DROP COLUMN prev_hash",
            "ALTER TABLE events DROP COLUMN hash",
            "DROP TABLE events_chain",
            # ledger schema 1 kept the counters in a table of their own
            "CREATE TABLE ledger_counters (name TEXT PRIMARY KEY, n INTEGER NOT NULL)",
            "INSERT INTO ledger_counters VALUES ('writes', 13), ('reservations', 2), "
            "('commits', 1)",
        )
    else:
        store.sql(
            "ALTER TABLE events DROP COLUMN prev_hash, DROP COLUMN hash",
            "DROP TABLE events_chain",
            "DROP FUNCTION events_chain_link(bytea, bytea[])",
            "DROP FUNCTION events_chain_prev()",
        )


def _whole_store(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    """The deployment of `build`, its entry events stored whole (as before events held only
    what changed, which only chaining programs write)."""
    url = (
        f"sqlite:///{tmp_path / 'old.db'}"
        if kind == "sqlite"
        else with_schema(postgres_url(), fresh_schema(postgres_url(), tmp_path))
    )
    with monkeypatch.context() as mp:
        mp.setattr(SqlUnit, "payload", lambda self, ev, txn: _whole(ev, txn))
        with open_backend(url) as b:
            build(b)
    return Store(kind, url, open_backend(url, create=False), tmp_path / "old.db")


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_events_from_before_the_chain_are_an_unchained_prefix(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read-only, a store from before the chain has none (not a violation: nothing says it
    should); the first writer migrates it, the chain starts after the old events (sealed),
    and deleting one of those is still seen."""
    store = _whole_store(kind, tmp_path, monkeypatch)
    store.backend.close()
    _unchain(store)
    old = len(store.event_rows())
    with open_backend(store.url, create=False) as reader:
        report = audit(reader.stored_rows())
    assert report.violations == [] and not report.history.has_chain, report.violations
    assert report.history.unchained_prefix == old and report.history.required is None
    res = CliRunner().invoke(cli, ["ledger", "check", "--backend", store.url, "--quiet"])
    assert res.exit_code == 0, res.output
    assert f"no hash chain yet ({old} events written before it" in res.stdout
    with open_backend(store.url) as writer:  # a writer migrates on open, and seals
        writer.ledger.add(LedgerEntry(rollout_id="new", behavior_version=0, artifact_hash=H0))
        report = audit(writer.stored_rows())
    assert report.violations == [], [str(v) for v in report.violations]
    assert report.history.unchained_prefix == old and report.history.chained > 1
    assert report.store.not_compared == {}
    store.sql("DELETE FROM events WHERE seq = (SELECT MIN(seq) FROM events)")
    with open_backend(store.url, create=False) as reader:
        got = found(audit(reader.stored_rows()))
    assert "history_unchained" in got, got


# ---- tamper evidence that stays on (issue 31 item 7) -----------------------------------------


def _check(store: Store, *extra: str) -> Any:
    """`ledger check` of the store, as a user runs it."""
    return CliRunner().invoke(cli, ["ledger", "check", "--backend", store.url, "--quiet", *extra])


@pytest.mark.parametrize("name", sorted(TAMPERINGS))
def test_every_tampering_of_item_7_is_named_and_exits_1(store: Store, name: str) -> None:
    """Each edit needs no hash computation; `ledger check` names it and exits 1 (it said
    "not verified, not a violation" for a stripped chain, and compared none of the
    bookkeeping tables, before)."""
    statements, invariant, kinds = TAMPERINGS[name]
    if store.kind not in kinds:
        pytest.skip(f"not a table of {store.kind}")
    store.backend.ledger.quarantine_version(7, "a failed activation")  # a mark to edit
    assert _check(store).exit_code == 0
    store.sql(*statements)
    res = _check(store, "--json")
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    assert invariant in data["by_invariant"], data["violations"]
    res = _check(store)
    assert f"{invariant}: " in res.stdout and "Traceback" not in res.output


def test_memory_bookkeeping_is_compared(store: Store) -> None:
    """Memory where it applies: a bad-version mark and a counter changed behind the
    ledger's back are named (no table edits there, and no chain to strip)."""
    if store.kind != "memory":
        pytest.skip("the SQL stores: test_every_tampering_of_item_7_is_named_and_exits_1")
    led, _ = _memory_parts(store)
    led.store.counters["commits"] += 5  # counts calls: a raise is what it cannot tell
    assert store.audit().violations == []
    led.store.bad.add(9)
    led.store.counters["expirations"] += 2
    led.store.counters["commits"] -= 6  # fewer than the steps that committed: named
    msgs = sorted(m for _, m in found(store.audit())["stored_matches_trace"])
    assert msgs == [
        "bad-version mark of '9': stored {'version': 9} but no trace event wrote it",
        "ledger counter commits: stored 0, but the history holds 1 steps that committed rollouts",
        "ledger counter expirations: stored 2, the history records 0",
    ]


def test_every_stored_table_is_verified(store: Store) -> None:
    """A store using every feature (ledger, registry, policy, membership, attempt tokens, a
    bad-version mark, the host clock) leaves no table out of `spec.audit.VERIFIED`: a
    table a new feature adds fails here until it is declared (docs/design.md says how)."""
    store.backend.ledger.quarantine_version(7, "a failed activation")
    report = store.audit()
    assert report.violations == [], [str(v) for v in report.violations]
    assert report.store.not_compared == {}
    want = {"rollouts", "registry_artifacts", "registry_policy", "ledger_bad_versions"}
    want |= {"ledger_counters", "registry_attempt_tokens", "registry_workers"}
    if store.kind != "memory":
        want |= {"schema_meta"}
    if store.kind == "sqlite":
        want |= {"host_clock"}
    if store.kind == "postgresql":
        want |= {"commit_marks"}
    assert want <= set(report.store.compared), report.store.compared


def test_a_lease_clock_edit_is_refused_by_the_next_writer(store: Store) -> None:
    """The host clock's origin moved by +1e6 s would make the next janitor expire every
    live lease: the next writer to open the file checks the row against the event that
    recorded it and refuses (and `ledger check` names it, above)."""
    if store.kind != "sqlite":
        pytest.skip("the host clock is SQLite's (PostgreSQL uses the server's clock)")
    store.backend.close()
    store.sql("UPDATE host_clock SET origin = origin + 1e6")
    with pytest.raises(HistoryTampered, match="records the host_clock row"):
        open_backend(store.url)
    store.backend = open_backend(store.url, create=False)


@pytest.mark.parametrize(
    "edit",
    [
        ("DROP TABLE events_chain", "UPDATE events SET hash = NULL, prev_hash = NULL"),
        ("UPDATE events SET hash = NULL, prev_hash = NULL",),
        ("UPDATE events SET hash = NULL WHERE seq = (SELECT MAX(seq) FROM events)",),
        ("DELETE FROM events WHERE seq = (SELECT MAX(seq) FROM events)",),
    ],
    ids=["head-and-hashes", "hashes", "last-hash", "last-event"],
)
def test_no_writer_extends_a_stripped_chain(store: Store, edit: tuple[str, ...]) -> None:
    """A stripped or cut chain is never extended: a writer already open refuses its next
    write, a writer opening the store refuses to open it (HistoryTampered, naming `ledger
    check`), and nothing is written either way; the store stays as evidence."""
    if store.kind == "memory":
        pytest.skip("nothing outside the process can edit a memory store")
    store.sql(*edit)
    before = store.event_rows()
    entry = LedgerEntry(rollout_id="r9", behavior_version=0, artifact_hash=H0)
    with pytest.raises(HistoryTampered, match="ledger check --backend"):
        store.backend.ledger.add(entry)
    store.backend.close()
    with pytest.raises(HistoryTampered, match="ledger check --backend"):
        open_backend(store.url)
    store.backend = open_backend(store.url, create=False)
    assert store.event_rows() == before and store.backend.ledger.find("r9") is None


def _rechain_sql(store: Store) -> None:
    """Recompute every stored hash and the head from the rows as they now are: what a
    forger who knows the formula does after an edit (a script, not a hand edit)."""
    rows = store.sql("SELECT seq, txn, kind, subject, payload FROM events ORDER BY seq")
    prev = GENESIS
    for seq, txn, kind, subject, payload in rows:
        h = chain_hash(prev, int(seq), int(txn), kind, subject, payload)
        store.sql("UPDATE events SET prev_hash = ?, hash = ? WHERE seq = ?", args=(prev, h, seq))
        prev = h
    store.sql("UPDATE events_chain SET last_hash = ?, last_seq = ?", args=(prev, rows[-1][0]))


def test_a_rewritten_chain_is_caught_by_an_older_anchor(store: Store, tmp_path: Path) -> None:
    """The operator anchors the head; a forger then erases consumed rollout r0 (its row and
    every event of it) and recomputes every hash and the head. The store alone is
    consistent (`ledger check` exits 0: the limit of a keyless chain), and r0 could be
    trained again; with the anchor, check exits 1 naming it."""
    if store.kind == "memory":
        pytest.skip("nothing outside the process can edit a memory store")
    anchors = tmp_path / "anchors.jsonl"
    res = CliRunner().invoke(
        cli, ["ledger", "anchor", "--backend", store.url, "--to", str(anchors), "--quiet"]
    )
    assert res.exit_code == 0, res.output
    assert _check(store, "--anchor", str(anchors)).exit_code == 0
    writes = len([r for r in store.event_rows() if r[1] == "entry" and r[2] == "r0"])
    store.sql(
        "DELETE FROM events WHERE kind = 'entry' AND subject = 'r0'",
        "DELETE FROM rollouts WHERE rollout_id = 'r0'",
    )
    if store.kind == "sqlite":
        store.sql(f"UPDATE events_chain SET writes = writes - {writes}, reservations = 1")
    else:
        store.sql(
            "DELETE FROM ledger_counters WHERE name IN ('writes', 'reservations')",
            "INSERT INTO ledger_counters(name, shard, n) SELECT 'writes', 0, "
            "(SELECT COUNT(*) FROM events WHERE kind = 'entry')",
            "INSERT INTO ledger_counters(name, shard, n) VALUES ('reservations', 0, 1)",
        )
    _rechain_sql(store)
    res = _check(store)
    assert res.exit_code == 0, res.output  # what no check of the store alone can see
    res = _check(store, "--anchor", str(anchors), "--json")
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    assert set(data["by_invariant"]) == {"history_anchor"}, data["violations"]
    assert data["violations"][0]["message"].startswith("anchor #1 (event #")
    assert "rewritten since it was anchored" in data["violations"][0]["message"]
    assert data["history"]["anchors_checked"] == 1


def test_an_anchor_vouches_only_up_to_its_seq(store: Store, tmp_path: Path) -> None:
    """What an anchor cannot stop: events written after it, then rewritten with the chain
    and head recomputed, pass a check against it (anchor often)."""
    if store.kind == "memory":
        pytest.skip("nothing outside the process can edit a memory store")
    anchors = tmp_path / "anchors.jsonl"
    args = ["ledger", "anchor", "--backend", store.url, "--to", str(anchors), "--quiet"]
    assert CliRunner().invoke(cli, args).exit_code == 0
    store.backend.ledger.add(LedgerEntry(rollout_id="late", behavior_version=0, artifact_hash=H0))
    store.sql(
        "UPDATE events SET payload = replace(payload, '\"late\"', '\"gone\"') "
        "WHERE seq = (SELECT MAX(seq) FROM events)",
        "UPDATE rollouts SET rollout_id = 'gone', entry = replace(entry, '\"late\"', '\"gone\"') "
        "WHERE rollout_id = 'late'",
    )
    _rechain_sql(store)
    assert _check(store, "--anchor", str(anchors)).exit_code == 0


def test_a_forged_old_store_needs_an_anchor(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What tamper evidence cannot stop without an anchor: a store rewritten into the shape
    of one from before the chain (no hashes, no head, no seal, no recorded rows, old schema
    versions, whole payloads) is what a genuine old store looks like; the anchor taken
    before tells them apart."""
    if store.kind == "memory":
        pytest.skip("nothing outside the process can edit a memory store")
    old = _whole_store(store.kind, tmp_path, monkeypatch)
    anchors = tmp_path / "anchors.jsonl"
    args = ["ledger", "anchor", "--backend", old.url, "--to", str(anchors), "--quiet"]
    assert CliRunner().invoke(cli, args).exit_code == 0
    old.backend.close()
    _unchain(old)
    assert _check(old).exit_code == 0
    res = _check(old, "--anchor", str(anchors))
    assert res.exit_code == 1 and "history_anchor: anchor #1" in res.stdout, res.output
    assert "the store has no hash chain" in res.stdout


def test_anchor_file_usage_errors(store: Store, tmp_path: Path) -> None:
    """A missing, empty or garbled anchor file is a usage error (exit 2), never a pass; a
    garbled file is left as it was by `ledger anchor`."""
    if store.kind == "memory":
        pytest.skip("one backend is enough for the file's handling")
    missing = tmp_path / "nope.jsonl"
    res = _check(store, "--anchor", str(missing))
    assert res.exit_code == 2 and "does not exist" in res.output
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert _check(store, "--anchor", str(empty)).exit_code == 2
    garbled = tmp_path / "garbled.jsonl"
    garbled.write_text('{"seq": 3, "hash": "zz"}\n')
    res = _check(store, "--anchor", str(garbled))
    assert res.exit_code == 2 and "line 1 is not an anchor" in res.output
    res = CliRunner().invoke(
        cli, ["ledger", "anchor", "--backend", store.url, "--to", str(garbled), "--quiet"]
    )
    assert res.exit_code == 2 and garbled.read_text() == '{"seq": 3, "hash": "zz"}\n'
    res = CliRunner().invoke(
        cli,
        ["ledger", "anchor", "--backend", store.url, "--to", str(tmp_path / "no" / "a.jsonl")],
    )
    assert res.exit_code == 2 and "does not exist" in res.output


def test_anchor_appends_and_refuses_a_broken_chain(store: Store, tmp_path: Path) -> None:
    """Each anchor adds one line (the file rewritten whole), the check passes through every
    one; a chain with a finding is not anchored (exit 1, the file unchanged)."""
    if store.kind == "memory":
        pytest.skip("a memory store has no second process to anchor it")
    anchors = tmp_path / "anchors.jsonl"
    args = ["ledger", "anchor", "--backend", store.url, "--to", str(anchors), "--json"]
    first = json.loads(CliRunner().invoke(cli, args).stdout)
    store.backend.ledger.add(LedgerEntry(rollout_id="r7", behavior_version=0, artifact_hash=H0))
    second = json.loads(CliRunner().invoke(cli, args).stdout)
    assert (first["anchors"], second["anchors"]) == (1, 2) and second["seq"] > first["seq"]
    lines = [json.loads(x) for x in anchors.read_text().splitlines()]
    assert [(x["seq"], x["hash"]) for x in lines] == [
        (first["seq"], first["hash"]),
        (second["seq"], second["hash"]),
    ]
    assert _check(store, "--anchor", str(anchors)).exit_code == 0
    store.sql("UPDATE events SET payload = payload || ' ' WHERE seq = 3")
    text = anchors.read_text()
    res = CliRunner().invoke(cli, args[:-1])
    assert res.exit_code == 1 and "nothing anchored" in res.output
    assert anchors.read_text() == text


# ---- the command -------------------------------------------------------------------------


def test_ledger_check_names_findings_and_exits_1(tmp_path: Path) -> None:
    """`ledger check` on SQLite: 0 findings and exit 0 untouched; after an edited state
    column, a deleted run and a damaged event, exit 1, each named, and no traceback."""
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}"
    with open_backend(url) as b:
        build(b)
    runner = CliRunner()
    res = runner.invoke(cli, ["ledger", "check", "--backend", url, "--json", "--quiet"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["history"]["has_chain"] and data["history"]["unchained_prefix"] == 0
    assert data["history"]["chained_events"] == data["events"]
    assert data["not_compared"] == {}  # every stored table is verified (spec.audit.VERIFIED)
    assert {"ledger_bad_versions", "host_clock", "schema_meta"} <= set(data["compared"])
    assert data["history"]["head_seq"] == data["events"]
    assert len(data["history"]["head_hash"]) == 64
    assert "history_deleted" in data["checked"] and "stored_matches_trace" in data["checked"]
    assert "history_anchor" not in data["checked"]  # only with --anchor
    conn = sqlite3.connect(path)
    conn.execute("UPDATE rollouts SET state = 'rewarded' WHERE rollout_id = 'r0'")
    conn.execute("DELETE FROM events WHERE kind = 'entry' AND subject = 'r2'")
    conn.execute("UPDATE events SET payload = 'not json', txn = 'x' WHERE seq = 1")
    conn.commit()
    conn.close()
    res = runner.invoke(cli, ["ledger", "check", "--backend", url, "--quiet"])
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    for name in ("history_deleted", "history_edited", "history_unreadable", "stored_matches_trace"):
        assert f"{name}: " in res.stdout, res.stdout
    assert "history: " in res.stdout and "head: seq " in res.stdout


def test_audit_pauses_the_collector_and_restores_it(store: Store) -> None:
    """The audit runs with the garbage collector off (flat cost per event) and leaves it
    as it found it: on stays on, off stays off, also when the audit raises."""
    import gc

    from rollout_lifecycle.spec import audit as audit_mod

    seen: list[bool] = []
    real = audit_mod.check_trace

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(audit_mod, "check_trace", spy)
                assert store.audit().violations == []
            assert gc.isenabled() is enabled
        gc.enable()
        with audit_mod.collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled()
        with pytest.raises(RuntimeError), audit_mod.collector_paused():
            raise RuntimeError("boom")
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False, False]


# ---- entry events that store what changed -------------------------------------------------


def _whole(ev: Any, txn: int | None) -> str:
    """An entry event's payload as this program stored it before events held only what
    changed: the whole before and after entries."""
    data = event_to_jsonable(ev)
    data.pop("seq", None)
    if txn is None:
        data.pop("txn", None)
    else:
        data["txn"] = txn
    return json.dumps(data, separators=(",", ":"))


def _read_all(store: Store, **kw: Any) -> list[Any]:
    """`read_events` of the store's own database (SQLite or PostgreSQL)."""
    if store.kind == "sqlite":
        conn = sqlite3.connect(str(store.path))
        try:
            return sqlite_read_events(conn, **kw)
        finally:
            conn.close()
    import psycopg

    from rollout_lifecycle.model.postgres_common import read_events as pg_read_events

    with psycopg.connect(store.url, autocommit=True) as pg:
        return pg_read_events(pg, **kw)


def test_changes_store_only_what_changed_and_read_back_whole(store: Store) -> None:
    """A creation stores the whole entry, every later entry event only its changed fields
    (a reservation: state, revision, owner, lease, stamp); read back, each event is the
    before/after pair the ledger wrote, and so is every read that starts mid-history."""
    rows = [json.loads(p) for _, kind, _, p in store.event_rows() if kind == "entry"]
    assert [r["event"] for r in rows if "after" in r] == ["add"] * len(IDS)
    reserve = next(r for r in rows if r["event"] == "reserve")
    assert "before" not in reserve and "after" not in reserve
    assert list(reserve["changed"]) == [
        "state",
        "revision",
        "reserved_by",
        "lease_expires_at",
        "admission",
    ]
    if store.kind == "memory":
        return
    full = _read_all(store)
    history = store.backend.ledger.history(None)
    assert [e for e in full if isinstance(e, EntryChanged)] == history
    for rid in IDS:
        mine = [e for e in history if e.rollout_id == rid]
        assert mine[-1].after == store.backend.ledger.get(rid)
        assert all(a.after == b.before for a, b in itertools.pairwise(mine))
    seqs = [e.seq for e in full]
    for k in range(0, len(full), 3):  # a fresh reader, and one kept across reads
        assert _read_all(store, after_seq=seqs[k]) == full[k + 1 :]
    states = EntryStates()
    assert _read_all(store, after_seq=0, states=states) == full
    store.backend.ledger.add(LedgerEntry(rollout_id="r8", behavior_version=0, artifact_hash=H0))
    store.backend.ledger.transition("r8", "generation_done", 0)
    new = _read_all(store, after_seq=seqs[-1], states=states)
    assert [(e.event, e.before is None) for e in new] == [("add", True), ("generation_done", False)]


def test_a_store_written_whole_then_by_changes_audits_clean(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ledger written while events held whole entries (schema 1), then opened by this
    program: the schema moves to 2, nothing stored is rewritten, the new events store
    changes over the old ones, and `ledger check` finds nothing."""
    if store.kind == "memory":
        pytest.skip("a memory store is never older than the program holding it")
    store.backend.close()

    def as_schema_1() -> None:
        store.sql("UPDATE schema_meta SET version = 1 WHERE component = 'ledger'")
        if store.kind == "sqlite":  # schema 1 kept the counters in a table of their own
            store.sql(
                "CREATE TABLE IF NOT EXISTS ledger_counters "
                "(name TEXT PRIMARY KEY, n INTEGER NOT NULL)"
            )

    as_schema_1()
    with monkeypatch.context() as mp:
        mp.setattr(SqlUnit, "payload", lambda self, ev, txn: _whole(ev, txn))
        with open_backend(store.url) as old:
            e = old.ledger.add(LedgerEntry(rollout_id="r5", behavior_version=0, artifact_hash=H0))
            e = old.ledger.transition("r5", "generation_done", e.revision)
            old.ledger.transition("r5", "reward_ready", e.revision, reward=REWARD)
            old.ledger.reserve_batch("u2", [ReserveRequest("r2", 2, STAMP)])
    as_schema_1()
    before = store.event_rows()
    with open_backend(store.url) as new:
        new.ledger.reserve_batch("u3", [ReserveRequest("r5", 2, STAMP)])
        new.ledger.commit("u2", ["r2"])
        new.ledger.commit("u3", ["r5"])
        report = audit(new.stored_rows())
        assert report.violations == [], [str(v) for v in report.violations]
        assert new.ledger.get("r2").state == new.ledger.get("r5").state == "consumed"
        history = new.ledger.history("r5")
        assert [e.event for e in history] == [
            "add",
            "generation_done",
            "reward_ready",
            "reserve",
            "commit",
        ]
        assert all(a.after == b.before for a, b in itertools.pairwise(history))
    assert store.event_rows()[: len(before)] == before  # old payloads are kept as stored
    kinds = [
        ("after" in json.loads(p), "changed" in json.loads(p))
        for _, k, s, p in store.event_rows()
        if k == "entry" and s == "r5"
    ]
    assert kinds == [(True, False)] * 3 + [(False, True)] * 2
    from rollout_lifecycle.model import postgres_ledger, sqlite_ledger

    latest = (sqlite_ledger if store.kind == "sqlite" else postgres_ledger).SCHEMA_VERSION
    got = store.sql("SELECT version FROM schema_meta WHERE component = 'ledger'")
    assert got == [(latest,)]


def _edited(store: Store, edit: Any) -> AuditReport:
    """The audit of the store's rows with `edit` applied to its events (row by row)."""
    rows = store.backend.stored_rows()
    return audit(attrs.evolve(rows, events=[e for ev in rows.events for e in edit(ev)]))


@pytest.mark.parametrize(
    ("changed", "why"),
    [
        ({"colour": "red"}, "field(s) ['colour'] that no ledger entry has"),
        ({"revision": "four"}, "revision"),
        ({"state": "nowhere"}, "state"),
        ([1], "'changed' is list, not a JSON object"),
    ],
)
def test_a_change_that_cannot_be_laid_over_is_unreadable(
    store: Store, changed: Any, why: str
) -> None:
    """A change naming a field no entry has, or whose value does not decode: that event
    is named unreadable (and edited, its hash no longer matching), never a traceback."""
    (seq,) = _seqs(store, "r1", "commit")

    def edit(ev: StoredEvent) -> list[StoredEvent]:
        if ev.seq != seq:
            return [ev]
        data = json.loads(ev.payload)
        return [attrs.evolve(ev, payload=json.dumps({**data, "changed": changed}))]

    got = found(_edited(store, edit))
    assert [s for s, _ in got["history_edited"]] == [seq], got
    ((s, msg),) = got["history_unreadable"]
    assert s == seq and why in msg, msg


def test_a_change_without_its_creation_is_unreadable(store: Store) -> None:
    """r2's creation event deleted: its later changes have nothing to be laid over, and
    each is named unreadable, as well as the deletion."""
    add, *later = _seqs(store, "r2")
    got = found(_edited(store, lambda ev: [] if ev.seq == add else [ev]))
    assert "history_deleted" in got, got
    assert [s for s, _ in got["history_unreadable"]] == later
    assert all("no readable earlier event of 'r2'" in m for _, m in got["history_unreadable"])


def test_an_edited_change_is_flagged_and_disagrees_with_the_row(store: Store) -> None:
    """r0's commit rewritten to leave it rewarded: the hash names the edit, and the row
    (consumed) no longer matches what the changes replay to."""
    (seq,) = _seqs(store, "r0", "commit")

    def edit(ev: StoredEvent) -> list[StoredEvent]:
        if ev.seq != seq:
            return [ev]
        return [attrs.evolve(ev, payload=ev.payload.replace('"consumed"', '"rewarded"'))]

    got = found(_edited(store, edit))
    assert [s for s, _ in got["history_edited"]] == [seq], got
    assert any(m.startswith("r0: stored consumed") for _, m in got["stored_matches_trace"]), got
