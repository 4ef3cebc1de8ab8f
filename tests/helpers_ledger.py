"""Shared helpers for the ledger tests: records, driving a rollout to any state, and the
entry points that child processes run (they must be importable by module name for 'spawn')."""

from __future__ import annotations

import os
import random
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rollout_lifecycle.model.ledger import DIRECT_EVENTS, Ledger, ReserveRequest
from rollout_lifecycle.model.machines import LIFECYCLE
from rollout_lifecycle.model.records import AdmissionStamp, LedgerEntry, Reward, WorkerAck

REWARD = Reward(function_id="exact_match", function_version="1", value=1.0)
HASH = "sha256:feed"


def activate(c: Any, version: int, digest: str = HASH, **prepare: Any) -> None:
    """Take `version` through the whole activation (prepare with `prepare`'s arguments,
    commit, distribute, every required worker's ack, activate) on an ActivationCoordinator
    `c`, asserting each step."""
    c.prepare(version, **prepare)
    c.commit_artifact(version, digest)
    c.distribute(version)
    for w in c.required_workers:
        token = c.attempt_token(w, version)
        assert c.record_ack(WorkerAck(w, version, digest, token=token)).counted
    assert c.try_activate(version).activated


# what a store as a program before the lineage index (model.lineage_index) left it lacks;
# PostgreSQL's is dropped with the schema versions before it, so the next writer migrates
LINEAGE_INDEX_DROP = {
    "sqlite": (
        "DROP TRIGGER IF EXISTS registry_claims_fill",
        "DROP TRIGGER IF EXISTS registry_claims_edit",
        "DROP TRIGGER IF EXISTS registry_claims_drop",
        "DROP TRIGGER IF EXISTS registry_claims_mark",
        "DROP TABLE IF EXISTS registry_claims",
        "DROP INDEX IF EXISTS ledger_updates_unclaimed",
        "ALTER TABLE ledger_updates DROP COLUMN claimed",
    ),
    "postgresql": (
        "DROP TRIGGER registry_claims_fill ON registry_artifacts",
        "DROP FUNCTION registry_claims_fill()",
        "DROP TABLE registry_claims",
        "DROP INDEX ledger_updates_unclaimed",
        "ALTER TABLE ledger_updates DROP COLUMN claimed",
        "UPDATE schema_meta SET version = 5 WHERE component = 'registry'",
        "UPDATE schema_meta SET version = 3 WHERE component = 'ledger'",
    ),
}


def stamp(
    behavior_version: int = 1, *, accepted: bool = True, current: int | None = None
) -> AdmissionStamp:
    """An admission decision for a rollout of `behavior_version` (fresh unless `current` lags)."""
    cur = behavior_version if current is None else current
    return AdmissionStamp(
        current_version=cur,
        behavior_version=behavior_version,
        max_lag=1,
        max_drift=0.2,
        drift=0.01 if accepted else 3.6,
        freshness="fresh" if cur == behavior_version else "tolerated",
        reason="ok" if accepted else "policy_drift",
        accepted=accepted,
    )


def rewarded(rollout_id: str, version: int = 1) -> LedgerEntry:
    """A new entry that is ready to reserve (state rewarded, revision 0)."""
    return LedgerEntry(
        rollout_id=rollout_id,
        behavior_version=version,
        artifact_hash=HASH,
        state="rewarded",
        reward=REWARD,
    )


def ids(n: int, prefix: str = "r") -> list[str]:
    """n rollout ids that sort in creation order."""
    return [f"{prefix}{i:05d}" for i in range(n)]


def add_all(ledger: Ledger, entries: Sequence[LedgerEntry]) -> None:
    """Add entries, in one transaction where the backend offers `add_many` (it is much faster)."""
    add_many = getattr(ledger, "add_many", None)
    if add_many is not None:
        add_many(entries)
    else:
        for e in entries:
            ledger.add(e)


def add_rewarded(ledger: Ledger, rollout_ids: Iterable[str], version: int = 1) -> None:
    """Add ready-to-reserve entries for every id."""
    add_all(ledger, [rewarded(r, version) for r in rollout_ids])


# events the helper can fire through the public API, each without guards
_DRIVABLE = DIRECT_EVENTS | {"reserve", "commit", "update_failed"}


def path_to(state: str) -> list[str]:
    """Shortest event path from the initial state, read off the declared machine (BFS)."""
    prev: dict[str, tuple[str, str] | None] = {LIFECYCLE.initial: None}
    todo = deque([LIFECYCLE.initial])
    while todo:
        s = todo.popleft()
        for e in LIFECYCLE.outgoing(s):
            if e.event in _DRIVABLE and not e.conditions and not e.unless and e.dest not in prev:
                prev[e.dest] = (s, e.event)
                todo.append(e.dest)
    if state not in prev:
        raise AssertionError(f"state {state!r} cannot be driven to through the API")
    events: list[str] = []
    cur = state
    while (step := prev[cur]) is not None:
        cur, ev = step
        events.append(ev)
    return events[::-1]


def drive_to(ledger: Ledger, rollout_id: str, state: str, version: int = 1) -> LedgerEntry:
    """Add a rollout at dispatch and move it to `state` through the ledger's own API."""
    entry = ledger.add(
        LedgerEntry(rollout_id=rollout_id, behavior_version=version, artifact_hash=HASH)
    )
    owner = f"drive:{rollout_id}"
    for ev in path_to(state):
        if ev == "reserve":
            out = ledger.reserve(rollout_id, entry.revision, owner, stamp(version))
            assert out.reserved and out.entry is not None, out
            entry = out.entry
        elif ev == "commit":
            (entry,) = ledger.commit(owner, [rollout_id])
        elif ev == "update_failed":
            (entry,) = ledger.fail_update(owner, "drive")
        else:
            reward = REWARD if ev == "reward_ready" else None
            entry = ledger.transition(rollout_id, ev, entry.revision, reward=reward)
    assert entry.state == state
    return entry


# ---- child-process entry points --------------------------------------------------------


def race_worker(
    path: str, update_id: str, n: int, seed: int, singles: int, chunk: int
) -> dict[str, Any]:
    """Race for all n rollouts: the first `singles` by single CAS, the rest in batches.

    Used by threads and by spawned processes alike; returns the ids won and every reason seen.
    """
    from rollout_lifecycle.model.sqlite_ledger import SQLiteLedger  # a spawned child imports lazily

    order = ids(n)
    random.Random(seed).shuffle(order)
    reasons: Counter[str] = Counter()
    won: list[str] = []
    with SQLiteLedger(path) as ledger:
        revisions = {rid: e.revision for rid, e in ledger.snapshot().items()}
        for rid in order[:singles]:
            out = ledger.reserve(rid, revisions[rid], update_id, stamp())
            reasons[out.reason] += 1
            if out.reason == "reserved":
                won.append(rid)
        for i in range(singles, n, chunk):
            part = order[i : i + chunk]
            reqs = [ReserveRequest(r, revisions[r], stamp()) for r in part]
            for out in ledger.reserve_batch(update_id, reqs):
                reasons[out.reason] += 1
                if out.reason == "reserved":
                    won.append(out.rollout_id)
    return {"update_id": update_id, "won": won, "reasons": dict(reasons)}


def race_process(path: str, update_id: str, n: int, seed: int, barrier: Any, results: Any) -> None:
    """Process body: wait for every racer to be ready, race, send the result back."""
    try:
        barrier.wait(timeout=120)
        results.put(race_worker(path, update_id, n, seed, singles=50, chunk=250))
    except BaseException as exc:  # the parent must see why a child failed
        results.put({"update_id": update_id, "error": repr(exc)})
        raise


def _signal(path: str, text: str) -> None:
    # rename is atomic: the parent never reads a half-written signal
    tmp = f"{path}.tmp"
    Path(tmp).write_text(text)
    os.replace(tmp, path)


def crash_child(path: str, update_id: str, n: int, stop_after: int | None, signal: str) -> None:
    """Run one reserve_batch of n rollouts and wait to be SIGKILLed.

    With `stop_after`, the batch stalls inside its open transaction after its compare-and-set
    has written every row, before its events are appended (`stop_after` must be > 0; the
    stall needs no per-item hook, which the planner may skip); otherwise the child stalls
    after COMMIT.
    """
    import rollout_lifecycle.model.sqlite_ledger as sl

    ledger = sl.SQLiteLedger(path)
    # A tiny page cache forces uncommitted pages out into the WAL, so recovery must really
    # ignore frames without a commit record rather than find nothing to ignore.
    ledger._conn().execute("PRAGMA cache_size = 8")
    if stop_after is not None:
        assert stop_after > 0
        real = sl._Unit.append

        def stalling(*args: Any, **kwargs: Any) -> Any:
            _signal(signal, "in-batch")
            time.sleep(600)
            return real(*args, **kwargs)

        sl._Unit.append = stalling  # type: ignore[method-assign]
    ledger.reserve_batch(update_id, [ReserveRequest(r, 0, stamp()) for r in ids(n)])
    _signal(signal, "committed")
    time.sleep(600)
