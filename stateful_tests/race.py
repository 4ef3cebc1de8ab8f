"""The README's pattern raced in real processes: activators move the pointer while learners
admit, reserve and commit, each process on its own connection to one database.

Every learner records every call it makes (what it asked, when it started and returned,
what it got). At the end the whole stored trace is replayed through the spec, the stored
rows are compared with it, and each recorded call's outcome is judged against the
sequential specification at some moment inside its own call window (a history check in
the Wing-Gong sense, per rollout, with the trace as the witness of the write order): a
success must be the one reservation event the trace shows for it, a refusal must be true
of the rollout at some moment while the call was running. A compare-and-set that is atomic
on one connection but not across several, or a reservation that is judged against a
stale pointer, shows up as a violation, not only in a unit test.

Dispatchers (issue 21) ask `ledger.dispatch` for permission to start attempts on shared
prompt chains under the recorded pacing policy, finish or fail what they started, and
retire what went stale. The spec judges the budget and the chains from the trace
(`dispatch_paced`, `dispatched_accounted_for`); each dispatch call is judged too: a
`dispatched` answer must be the trace's one write of that attempt inside the call's
window, a refusal must be true at some moment of it.

On PostgreSQL, when the race's login may create roles, every party runs under its own
login in its own role (stateful_tests/race_roles.py: an operator, the coordinators, one
worker process per worker id acking with the token only it can read, the generators, the
learners, and a hostile learner trying every operation outside its role, which the server
must refuse); the trace is judged through an auditor's login.

    rollout-lifecycle race --backend sqlite:///race.db --learners 4 --seconds 60
    rollout-lifecycle race --backend postgresql://user@host/racedb --learners 4 --seconds 60
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from rollout_lifecycle.model.backends import open_backend, redact_url
from rollout_lifecycle.model.errors import (
    ActivationError,
    BackendURLError,
    DispatchRefused,
    RevisionConflict,
    RolloutLifecycleError,
    UpdatePoisoned,
)
from rollout_lifecycle.model.events import (
    ArtifactChanged,
    EntryChanged,
    PolicyChanged,
    TraceEvent,
)
from rollout_lifecycle.model.gate import AdmissionGate, GatePolicy
from rollout_lifecycle.model.ledger import ReserveRequest
from rollout_lifecycle.model.pacing import identity_chain
from rollout_lifecycle.model.records import (
    ActionEvidence,
    AdmissionPolicy,
    AdmissionStamp,
    BehaviorPolicy,
    Disposition,
    GenerationConditions,
    LedgerEntry,
    Reward,
    Rollout,
    RolloutIdentity,
    WorkerAck,
    from_jsonable,
    to_jsonable,
)
from rollout_lifecycle.spec.invariants import (
    OPEN_STATES,
    PacingIndex,
    Violation,
    check_trace,
    compare_with_store,
    stored_world,
    violated_names,
)
from rollout_lifecycle.spec.linearizability import LinReport, check_calls
from rollout_lifecycle.spec.linearizability import parse as parse_calls
from rollout_lifecycle.stateful_tests import race_roles
from rollout_lifecycle.stateful_tests.history import (
    CallLog,
    RecordingLedger,
    RecordingRegistry,
    attach,
    entries_json,
    history_header,
    operator_sets_policy,
    write_history,
)
from rollout_lifecycle.stateful_tests.infrastructure import infrastructure_cause

WORKERS = ("gen-0", "gen-1")
REWARD = Reward("race-rm", "1", 1.0)
CONDITIONS = GenerationConditions("race-tok", 1.0, 1.0, -1, 4)
EVIDENCE = ActionEvidence((1, 2, 3, 4), (True, True, True, True), (-1.0, -1.0, -1.0, -1.0))
BATCH = 16
SCHEMA = "rollout-lifecycle/race-report/1"
ACK_WAIT_S = 3.0  # with roles, how long a coordinator waits for its workers' acks


def version_hash(v: int) -> str:
    """The artifact hash of version v in a race."""
    return f"{v:x}".rjust(64, "d")


@attrs.frozen
class RaceConfig:
    """What to race: how many processes of each kind, how long, and the admission bounds."""

    url: str
    learners: int = 4
    activators: int = 1
    seconds: float = 60.0
    max_lag: int = 1
    max_drift: float = 0.2
    seed: int = 0
    pool: int = 64  # the generator keeps about this many rollouts waiting
    # the first `hostile` learners are misconfigured: their gate admits at any lag and
    # drift; the deployment's recorded policy must refuse what they would let through
    hostile: int = 0
    # activators also roll back (retiring the rolled-back version) and churn the worker set
    churn: bool = False
    mutant: str | None = None  # a catalogue mutant every child process runs with
    # paced dispatch: processes dispatching attempts of `chains` shared prompts under the
    # recorded budget of (max_lag + 1) x batch_size live rollouts and max_attempts per
    # chain (0 dispatchers: no pacing policy is recorded, the race of before)
    dispatchers: int = 2
    batch_size: int = 8
    max_attempts: int = 3
    chains: int = 32
    # the required workers (gen-0, gen-1, ...)
    workers: int = 2
    # PostgreSQL roles, a login per party (race_roles): None = when the login may create
    # roles and no mutant is entered; True = required; False = one login for all
    roles: bool | None = None

    def worker_ids(self) -> tuple[str, ...]:
        """The deployment's required workers."""
        return WORKERS if self.workers == 2 else tuple(f"gen-{i}" for i in range(self.workers))

    # each distribution attempt's ack deadline: an attempt left awaiting acks (its
    # try_activate refused after a membership change) is failed by the next distribute
    # once it passes, so an activator never stalls for the rest of the run
    ack_timeout: float = 2.0

    def policy(self) -> AdmissionPolicy:
        """The deployment's admission policy this race records."""
        if self.dispatchers == 0:
            return AdmissionPolicy(self.max_lag, self.max_drift)
        return AdmissionPolicy(self.max_lag, self.max_drift, self.batch_size, self.max_attempts)


def _hashes(registry: Any) -> Callable[[int], str | None]:
    from rollout_lifecycle.model.registry import activated_hash

    return lambda v: activated_hash(registry, v)


def _with_mutant(cfg: RaceConfig) -> Any:
    """The mutant's patch, entered in this (child) process; a no-op context without one."""
    if cfg.mutant is None:
        return contextlib.nullcontext()
    from rollout_lifecycle.stateful_tests.mutants import BY_NAME

    return BY_NAME[cfg.mutant]()


def _start(cfg: RaceConfig, line: Any) -> float:
    """Wait at the start line until every process has started, then race `cfg.seconds`
    (see `race_roles.start_line`)."""
    return race_roles.start_line(cfg.seconds, line)


def _activator(cfg: RaceConfig, index: int, line: Any, out: Any, url: str = "") -> None:
    """Publish version after version (and, without roles, generate rollouts at the version
    workers serve, ack for the workers, and churn as the operator)."""
    with _with_mutant(cfg):
        _activate_loop(cfg, index, _start(cfg, line), out, url or cfg.url)


def _learner(cfg: RaceConfig, index: int, line: Any, out: Any, url: str = "") -> None:
    """The README pattern in a loop: pointer -> assess_batch -> reserve_batch -> commit."""
    with _with_mutant(cfg):
        _learn_loop(cfg, index, _start(cfg, line), out, url or cfg.url)


def _dispatcher(cfg: RaceConfig, index: int, line: Any, out: Any, url: str = "") -> None:
    """Paced generation: dispatch attempts on shared chains, finish them, retire the stale."""
    with _with_mutant(cfg):
        _dispatch_loop(cfg, index, _start(cfg, line), out, url or cfg.url)


def _generator(cfg: RaceConfig, line: Any, out: Any, url: str) -> None:
    """With roles: the generator's login keeps the pool of rewarded rollouts filled at the
    version the workers serve (without roles the first activator does it)."""
    deadline = _start(cfg, line)
    rng = random.Random(cfg.seed * 31337)
    stats: Counter[str] = Counter()
    log = CallLog("generator")
    try:
        with open_backend(url) as raw:
            b = _recorded(raw, log)
            serving = b.registry.pointer()
            n = 0
            while time.time() < deadline:
                n += _fill_pool(cfg, b, serving, n, stats)
                now = b.registry.pointer()
                # generators switch a little later: rollouts in flight lag behind
                serving = now if rng.random() < 0.7 else serving
                time.sleep(rng.uniform(0.02, 0.2))
        out.put({"role": "generator", "stats": dict(stats), "history": log.calls})
    except Exception as exc:
        out.put(
            {"role": "generator", "stats": dict(stats), "history": log.calls, "error": repr(exc)}
        )


def _operator(cfg: RaceConfig, line: Any, out: Any, url: str) -> None:
    """With roles and churn: the operator's login rolls back, changes the worker set and
    the policy, on the cadence of `_churn` (without roles the activators do)."""
    deadline = _start(cfg, line)
    rng = random.Random(cfg.seed * 7907)
    stats: Counter[str] = Counter()
    log = CallLog("operator")
    try:
        with open_backend(url) as raw:
            b = _recorded(raw, log)
            coord = attach(log, raw.registry, ledger=b.ledger)
            while time.time() < deadline:
                time.sleep(rng.uniform(0.1, 0.4))
                try:
                    _churn(coord, rng, stats, cfg.max_lag, cfg.worker_ids())
                except ActivationError as exc:  # e.g. a rollback while acks are awaited
                    stats[f"refused:{type(exc).__name__}"] += 1
        out.put({"role": "operator", "stats": dict(stats), "history": log.calls})
    except Exception as exc:
        out.put(
            {"role": "operator", "stats": dict(stats), "history": log.calls, "error": repr(exc)}
        )


def _fill_pool(
    cfg: RaceConfig, b: Any, serving: Any, n: int, stats: Counter[str], tag: str = "a0"
) -> int:
    """Add a batch of rewarded rollouts at the served version while the pool runs low;
    how many ids were used."""
    waiting = b.ledger.statistics().by_state.get("rewarded", 0)
    if waiting >= cfg.pool or serving is None:
        return 0
    entries = [
        _generated(f"{tag}.{n + i}", serving.version, serving.artifact_hash) for i in range(BATCH)
    ]
    try:  # under a pacing policy the budget covers these adds too
        b.ledger.add_many(entries)
        stats["generated"] += BATCH
    except DispatchRefused as exc:
        stats[f"generator:{exc.reason}"] += 1
    return BATCH


def _dispatch_loop(cfg: RaceConfig, index: int, deadline: float, out: Any, url: str) -> None:
    rng = random.Random(cfg.seed * 15485863 + index)
    stats: Counter[str] = Counter()
    calls: list[dict[str, Any]] = []
    started: list[str] = []  # dispatched by this process, not yet rewarded or ended
    opened = deadline - cfg.seconds  # the race's start, as _start set it
    n = 0
    log = CallLog(f"dispatcher-{index}")
    try:
        with open_backend(url) as raw:
            b = _recorded(raw, log)
            clock: Callable[[], float] = getattr(raw.ledger, "clock", time.time)
            while time.time() < deadline:
                time.sleep(rng.uniform(0.005, 0.03))  # a generator's pace, not a busy loop
                pointer = b.registry.pointer()
                if pointer is None:
                    continue
                if started and rng.random() < 0.6:  # move one of ours a step on
                    _advance_attempt(b.ledger, started, rng, stats)
                    continue
                # a generator that has not switched yet runs the previous weights
                v = max(0, pointer.version - (1 if rng.random() < 0.2 else 0))
                # a sliding window of `chains` prompts, the same in every process: chains
                # are retried, run out of attempts, and new prompts keep arriving
                base = int((time.time() - opened) * 4)
                rid = f"d{index}.{n}"
                n += 1
                # the prompt's identity names its chain (the deployment's chain_key)
                identity = RolloutIdentity(rid, f"c{base + rng.randrange(cfg.chains)}", "race", 0)
                chain = identity_chain(identity)
                ro = Rollout(identity, BehaviorPolicy(v, version_hash(v)), CONDITIONS)
                t0 = clock()
                got = b.ledger.dispatch(ro)
                calls.append(
                    {
                        "kind": "dispatch",
                        "rollout_id": rid,
                        "chain": chain,
                        "version": v,
                        "start": t0,
                        "end": clock(),
                        "reason": got.reason,
                        "attempt": got.attempt,
                    }
                )
                stats[f"dispatch:{got.reason}"] += 1
                if got.dispatched:
                    started.append(rid)
                if rng.random() < 0.05:
                    stats["retired_stale"] += len(b.ledger.retire_stale())
                if rng.random() < 0.05:  # a learner's pick of what to train next
                    b.ledger.oldest_admissible(8)
        out.put(
            {
                "role": f"dispatcher-{index}",
                "stats": dict(stats),
                "calls": calls,
                "history": log.calls,
            }
        )
    except Exception as exc:  # reported with the calls made so far, which are judged too
        out.put(
            {
                "role": f"dispatcher-{index}",
                "stats": dict(stats),
                "calls": calls,
                "history": log.calls,
                "error": repr(exc),
                "infrastructure": infrastructure_cause(exc) is not None,
            }
        )


def _advance_attempt(
    ledger: Any, started: list[str], rng: random.Random, stats: Counter[str]
) -> None:
    """One step of one attempt this process started: generation ends (1 in 6 fails, and
    its chain may be requeued), or its reward arrives; a rollout something else ended
    (a rollback retired it, its version was quarantined) is dropped."""
    rid = started[rng.randrange(len(started))]
    e = ledger.get(rid)
    try:
        if e.state == "dispatched":
            failed = rng.random() < 1 / 6
            event = "generation_failed" if failed else "generation_done"
            ledger.transition(rid, event, e.revision, tokens=rng.choice((8, 64, 512)))
            stats[f"attempt:{event}"] += 1
            if not failed:
                return
        elif e.state == "generated":
            ledger.transition(rid, "reward_ready", e.revision, reward=REWARD)
            stats["attempt:rewarded"] += 1
    except RolloutLifecycleError:
        stats["attempt:lost_race"] += 1
        return
    started.remove(rid)


def _generated(rid: str, version: int, digest: str) -> Rollout:
    """A rollout the activators' generator adds already rewarded: its own prompt (so its
    identity names a chain of its own), its entry at `rewarded`."""
    status = LedgerEntry(
        rollout_id=rid,
        behavior_version=version,
        artifact_hash=digest,
        state="rewarded",
        reward=REWARD,
    )
    identity = RolloutIdentity(rid, f"g-{rid}", "race", 0)
    return Rollout(identity, BehaviorPolicy(version, digest), CONDITIONS, status=status)


def _activate_loop(cfg: RaceConfig, index: int, deadline: float, out: Any, url: str) -> None:
    rng = random.Random(cfg.seed * 7919 + index)
    stats: Counter[str] = Counter()
    log = CallLog(f"activator-{index}")
    roles = url != cfg.url  # its own login: the other parties generate, ack and churn
    try:
        with open_backend(url) as raw:
            b = _recorded(raw, log)
            coord = attach(log, raw.registry, ledger=b.ledger, ack_timeout=cfg.ack_timeout)
            serving = coord.pointer()
            n = 0
            while time.time() < deadline:
                if index == 0 and not roles:  # the generator: rollouts of the served weights
                    n += _fill_pool(cfg, b, serving, n, stats, tag=f"a{index}")
                try:
                    top = coord.registry.max_version() or 0
                    v = top + 1
                    coord.prepare(v)
                    coord.commit_artifact(v, version_hash(v))
                    coord.distribute(v)
                    if roles:
                        res = _await_acks(coord, v, stats)
                    else:
                        for w, token in coord.attempt_tokens(v).items():  # sent with weights
                            coord.record_ack(WorkerAck(w, v, version_hash(v), token=token))
                        res = coord.try_activate(v)
                    stats[f"activate:{res.reason}"] += 1
                    if res.activated:
                        # generators switch a little later: rollouts in flight lag behind
                        serving = coord.pointer() if rng.random() < 0.7 else serving
                    if cfg.churn and not roles:
                        _churn(coord, rng, stats, cfg.max_lag, cfg.worker_ids())
                except ActivationError as exc:
                    stats[f"refused:{type(exc).__name__}"] += 1
                time.sleep(rng.uniform(0.02, 0.2))
        out.put({"role": f"activator-{index}", "stats": dict(stats), "history": log.calls})
    except Exception as exc:  # the parent reports why a child failed (no child traceback)
        out.put(
            {
                "role": f"activator-{index}",
                "stats": dict(stats),
                "history": log.calls,
                "error": repr(exc),
                "infrastructure": infrastructure_cause(exc) is not None,
            }
        )


def _await_acks(coord: Any, v: int, stats: Counter[str]) -> Any:
    """With roles: try to activate `v` while its workers' acks arrive; give the attempt up
    (the version's rollouts quarantined) when they do not within ACK_WAIT_S."""
    until = time.time() + ACK_WAIT_S
    while True:
        res = coord.try_activate(v)
        if res.activated or time.time() > until or res.reason == "not_awaiting_acks":
            break
        time.sleep(0.01)
    if not res.activated and coord.artifact(v).state == "awaiting_acks":
        coord.fail_distribution(v, "acks did not arrive in time")
        stats["distribution_failed"] += 1
    return res


def _churn(
    coord: Any,
    rng: random.Random,
    stats: Counter[str],
    max_lag: int,
    workers: tuple[str, ...] = WORKERS,
) -> None:
    """Every few activations roll back (the rolled-back version's rollouts are retired,
    or kept, while learners hold stamps admitted against it), shrink or restore the
    required worker set, and tighten or restore the admission policy: registry moves
    between a learner's admission and its reservation, on a steady cadence, so even a
    short race under load makes each."""
    stats["churn_turns"] += 1
    turn = stats["churn_turns"]
    if turn % 5 == 3 or rng.random() < 0.05:
        keep = rng.random() < 0.3  # the operator keeps the rolled-back version's rollouts
        reason = f"race churn {turn}.{rng.getrandbits(32):08x}"  # names this rollback
        coord.rollback(keep_rollouts=keep, reason=reason)
        stats["rolled_back"] += 1
        stats["rolled_back_kept"] += keep
        # the recorded choice, read back: what every later premise and reader goes by
        # (found by its reason: another activator may have moved the pointer meanwhile)
        want = "rolled_back_kept" if keep else "rolled_back"
        got = [a.failure for a in coord.artifacts() if a.failure and a.failure.detail == reason]
        if [f.cause for f in got] != [want]:  # not an ActivationError: that is a refusal
            raise RuntimeError(
                f"rolled back with keep_rollouts={keep}, but the record says {got or 'nothing'}"
            )
    if turn % 4 == 2 or rng.random() < 0.05:
        now = coord.required_workers
        new = workers[:-1] if len(now) == len(workers) else workers
        coord.change_membership(new, f"race churn: {len(now)} -> {len(new)} workers")
        stats["membership_changed"] += 1
    policy = coord.policy()
    if policy is not None and policy.max_lag != max_lag:  # restored after one turn
        coord.set_policy(attrs.evolve(policy, max_lag=max_lag), "race churn: restored")
        stats["policy_changed"] += 1
    elif policy is not None and turn % 3 == 1 and max_lag > 0:
        tight = attrs.evolve(policy, max_lag=0)  # the pacing bounds are kept
        coord.set_policy(tight, "race churn: max_lag tightened to 0")
        stats["policy_changed"] += 1


def _learn_loop(cfg: RaceConfig, index: int, deadline: float, out: Any, url: str) -> None:
    rng = random.Random(cfg.seed * 104729 + index)
    stats: Counter[str] = Counter()
    calls: list[dict[str, Any]] = []
    update = 0
    log = CallLog(f"learner-{index}")
    try:
        with open_backend(url) as raw:
            b = _recorded(raw, log)
            hostile = index < cfg.hostile
            clock: Callable[[], float] = getattr(raw.ledger, "clock", time.time)
            gate = AdmissionGate(
                GatePolicy(max_lag=10**6, max_drift=1e9)
                if hostile
                else GatePolicy(max_lag=cfg.max_lag, max_drift=cfg.max_drift),
                registry=_hashes(raw.registry),
            )
            reader = _reader(url)
            while time.time() < deadline:
                pointer = b.registry.pointer()
                entries = _waiting(reader, rng, log)
                if pointer is None or not entries:
                    time.sleep(0.01)
                    continue
                rollouts = [_rollout(e) for e in entries]
                current = np.full((len(rollouts), 4), -1.0)
                decisions = gate.assess_batch(rollouts, current, pointer.version)
                for d, e in zip(decisions, entries, strict=True):
                    stats[f"admission:{d.reason}"] += 1
                    event = {"offline": "retire_stale", "quarantine": "quarantine"}.get(d.route)
                    if event is not None:  # what the gate routes away never waits again
                        try:
                            b.ledger.transition(
                                e.rollout_id,
                                event,
                                e.revision,
                                disposition=Disposition("admission", d.reason),
                            )
                            stats[f"routed:{event}"] += 1
                        except RevisionConflict:
                            stats["routed:conflict"] += 1
                requests = [
                    ReserveRequest(e.rollout_id, e.revision, d.stamp())
                    for d, e in zip(decisions, entries, strict=True)
                    if d.accepted
                ]
                if not requests:
                    continue
                update_id = f"L{index}.u{update}"
                update += 1
                # call windows are measured on the ledger's clock, the one its events
                # are dated by (the host's boot clock on SQLite, see model.clocks)
                started = clock()
                if rng.random() < 0.3:  # single compare-and-sets too: one statement each
                    outs = [
                        b.ledger.reserve(r.rollout_id, r.expected_revision, update_id, r.admission)
                        for r in requests
                    ]
                else:
                    outs = b.ledger.reserve_batch(update_id, requests)
                ended = clock()
                calls.append(_call_record(update_id, started, ended, requests, outs))
                won = [o.rollout_id for o in outs if o.reserved]
                if won and rng.random() < 0.2:  # a retry of a call whose answer was lost
                    again = [r for r in requests if r.rollout_id in won][:2]
                    started = clock()
                    retried = b.ledger.reserve_batch(update_id, again)
                    calls.append(_call_record(update_id, started, clock(), again, retried))
                    outs = [*outs, *retried]
                for o in outs:
                    stats[f"reserve:{o.reason}"] += 1
                if won and rng.random() < 0.1:  # a long update's heartbeat
                    b.ledger.renew_leases(update_id)
                if won and rng.random() < 0.08:  # the update failed: its rollouts go back
                    stats["aborted"] += len(b.ledger.abort(update_id))
                elif won:
                    try:
                        b.ledger.commit(update_id, won)
                        stats["committed"] += len(won)
                    except UpdatePoisoned as exc:  # e.g. a rollback retired what it held
                        stats[f"commit_refused:{exc.cause}"] += 1
                        b.ledger.abort(update_id)
                if rng.random() < 0.05:  # a reaper's sweep (leases run 600 s: rarely due)
                    b.ledger.expire_leases()
            reader.close()
        out.put(
            {
                "role": f"learner-{index}",
                "stats": dict(stats),
                "calls": calls,
                "history": log.calls,
            }
        )
    except Exception as exc:  # reported with the calls made so far, which are judged too
        out.put(
            {
                "role": f"learner-{index}",
                "stats": dict(stats),
                "calls": calls,
                "history": log.calls,
                "error": repr(exc),
                "infrastructure": infrastructure_cause(exc) is not None,
            }
        )


def _call_record(
    update_id: str, start: float, end: float, asked: Sequence[ReserveRequest], got: Sequence[Any]
) -> dict[str, Any]:
    """One reserve call as the history judge reads it: who, its window, asked, answered."""
    return {
        "update_id": update_id,
        "start": start,
        "end": end,
        "asked": [[r.rollout_id, r.expected_revision, to_jsonable(r.admission)] for r in asked],
        "got": [[o.rollout_id, o.reason] for o in got],
    }


class _Reader:
    """The learner's own read-only view for its 'what is waiting' query (its buffer).

    On SQLite a read-only connection to the file; on any other backend a read-only open of
    the same URL (on PostgreSQL, connections with default_transaction_read_only), asked
    for the first rollouts in state 'rewarded'.
    """

    def __init__(self, url: str) -> None:
        self._conn: Any = None
        self._backend: Any = None
        if url.startswith("sqlite:"):
            from rollout_lifecycle.model.backends import sqlite_path
            from rollout_lifecycle.model.sqlite_common import connect_read_only

            self._conn = connect_read_only(sqlite_path(url))
        else:
            self._backend = open_backend(url, create=False)

    def rewarded(self, limit: int) -> list[LedgerEntry]:
        """Up to `limit` rollouts waiting in 'rewarded', by rollout id."""
        if self._conn is not None:
            import json

            rows = self._conn.execute(
                "SELECT entry FROM rollouts WHERE state = 'rewarded' ORDER BY rollout_id LIMIT ?",
                (limit,),
            ).fetchall()
            return [from_jsonable(LedgerEntry, json.loads(r[0])) for r in rows]
        ledger = self._backend.ledger
        in_state = getattr(ledger, "in_state", None)
        if in_state is not None:
            found: list[LedgerEntry] = in_state("rewarded", limit)
            return found
        waiting = sorted(
            (e for e in ledger.snapshot().values() if e.state == "rewarded"),
            key=lambda e: e.rollout_id,
        )
        return waiting[:limit]

    def close(self) -> None:
        """Close the connection or the read-only backend."""
        if self._conn is not None:
            self._conn.close()
        if self._backend is not None:
            self._backend.close()


def _reader(url: str) -> _Reader:
    """A read-only view for the learner's own 'what is waiting' query (its buffer)."""
    return _Reader(url)


def _waiting(reader: _Reader, rng: random.Random, log: CallLog) -> list[LedgerEntry]:
    entries = log.call(
        "in_state", {"state": "rewarded", "limit": 64}, lambda: reader.rewarded(64), entries_json
    )
    rng.shuffle(entries)
    return entries[: rng.randint(1, BATCH)]


def _rollout(e: LedgerEntry) -> Rollout:
    return Rollout(
        identity=RolloutIdentity(e.rollout_id, "p", "race", 0),
        behavior=BehaviorPolicy(e.behavior_version, e.artifact_hash),
        conditions=CONDITIONS,
        evidence=EVIDENCE,
        status=e,
    )


@attrs.frozen
class RaceReport:
    """Counts per role and reason, and every violation the checks found."""

    config: RaceConfig
    elapsed_s: float
    stats: dict[str, dict[str, int]]
    events: int
    calls: int
    violations: tuple[Violation, ...]
    errors: tuple[str, ...]
    # the errors that were the backend's or the disk's (a lost server, a full disk): not
    # findings, and the race's verdict is void (exit 3, not 1)
    infrastructure: tuple[str, ...] = ()
    linearizability: LinReport | None = None
    history: str | None = None  # where the recorded calls were written (JSON lines)

    @property
    def ok(self) -> bool:
        """No violation and no process failed (an 'unknown' linearizability verdict is not
        a pass either: the report says so, apart from a violation)."""
        lin_ok = self.linearizability is None or self.linearizability.verdict == "ok"
        return not self.violations and not self.errors and lin_ok

    def totals(self) -> dict[str, int]:
        """Counters summed over every process."""
        out: Counter[str] = Counter()
        for s in self.stats.values():
            out.update(s)
        return dict(sorted(out.items()))

    def to_json(self) -> dict[str, Any]:
        """The report as JSON (schema rollout-lifecycle/race-report/1)."""
        return {
            "schema": SCHEMA,
            "config": dict(attrs.asdict(self.config), url=redact_url(self.config.url)),
            "elapsed_s": round(self.elapsed_s, 2),
            "ok": self.ok,
            "events": self.events,
            "calls_judged": self.calls,
            "totals": self.totals(),
            "per_process": self.stats,
            "violation_count": len(self.violations),
            "by_invariant": dict(violated_names(self.violations)),
            "violations": [attrs.asdict(v) for v in self.violations[:200]],
            "errors": list(self.errors),
            "infrastructure_errors": list(self.infrastructure),
            "linearizability": None
            if self.linearizability is None
            else {**self.linearizability.to_json(), "history": self.history},
        }


def prepare(cfg: RaceConfig, logins: race_roles.RoleLogins | None = None) -> list[dict[str, Any]]:
    """A fresh database with the operator's policy and the worker set recorded and v0
    active: by one login, or with roles by the operator, a coordinator and each worker,
    each with its own; the calls it made (the history starts from an empty deployment)."""
    workers = cfg.worker_ids()
    log = CallLog("setup")

    def url(party: str) -> str:
        return cfg.url if logins is None else logins.url(party)

    with open_backend(url("operator")) as raw:
        b = _recorded(raw, log)
        # the operator's step: coordinators and learners never write the policy
        operator_sets_policy(log, raw.registry, cfg.policy(), "race: set by the operator")
        attach(log, raw.registry, workers, ledger=b.ledger, policy=cfg.policy())
    with open_backend(url("coordinator-0")) as raw:
        b = _recorded(raw, log)
        coord = attach(log, raw.registry, ledger=b.ledger)
        if coord.pointer() is not None:
            return log.calls
        coord.prepare(0)
        coord.commit_artifact(0, version_hash(0))
        coord.distribute(0)
        if logins is None:
            for w, token in coord.attempt_tokens(0).items():
                coord.record_ack(WorkerAck(w, 0, version_hash(0), token=token))
        else:
            for w in workers:  # each worker reads its own token (only it may) and acks
                with open_backend(logins.url(f"worker-{w}")) as wb:
                    mine = attach(log, wb.registry)
                    token = mine.attempt_token(w, 0)
                    mine.record_ack(WorkerAck(w, 0, version_hash(0), token=token))
        coord.try_activate(0)
    return log.calls


def _recorded(b: Any, log: CallLog) -> Any:
    """The backend's ledger and registry, every call recorded in `log`."""
    return attrs.evolve(
        b, ledger=RecordingLedger(b.ledger, log), registry=RecordingRegistry(b.registry, log)
    )


def run_race(
    cfg: RaceConfig,
    progress: Callable[[str], None] | None = None,
    *,
    history_path: Path | None = None,
    lin_time_limit: float = 10.0,
) -> RaceReport:
    """Race the processes for `cfg.seconds`, then judge the trace, the rows and every call:
    each answer against the trace, and the whole recorded history for linearizability
    (written to `history_path` as JSON lines when given)."""
    logins = None
    if race_roles.wants_roles(cfg.url, cfg.roles, cfg.mutant):
        logins = race_roles.plan_logins(
            cfg.url,
            race_roles.parties(
                activators=cfg.activators,
                learners=cfg.learners,
                dispatchers=cfg.dispatchers,
                workers=cfg.worker_ids(),
                churn=cfg.churn,
            ),
        )
    try:
        return _run(cfg, logins, progress or (lambda _t: None), history_path, lin_time_limit)
    finally:
        if logins is not None:
            logins.drop()


def _run(
    cfg: RaceConfig,
    logins: race_roles.RoleLogins | None,
    say: Callable[[str], None],
    history_path: Path | None,
    lin_time_limit: float,
) -> RaceReport:
    setup = prepare(cfg, logins)
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    started = time.time()

    def url(party: str) -> str:
        return "" if logins is None else logins.url(party)

    targets: list[tuple[Any, tuple[Any, ...]]] = [
        *(
            (_activator, (cfg, i, None, results, url(f"coordinator-{i}")))
            for i in range(cfg.activators)
        ),
        *((_learner, (cfg, i, None, results, url(f"learner-{i}"))) for i in range(cfg.learners)),
        *(
            (_dispatcher, (cfg, i, None, results, url(f"dispatcher-{i}")))
            for i in range(cfg.dispatchers)
        ),
    ]
    if logins is not None:
        targets += [
            (_generator, (cfg, None, results, url("generator"))),
            *(
                (race_roles.worker, (cfg.seconds, url(f"worker-{w}"), w, None, results))
                for w in cfg.worker_ids()
            ),
            (race_roles.hostile_learner, (cfg.seconds, url("hostile-learner"), None, results)),
        ]
        if cfg.churn:
            targets.append((_operator, (cfg, None, results, url("operator"))))
    line = ctx.Barrier(len(targets) + 1)  # the start line: the clock starts when all stand
    procs = [
        ctx.Process(target=fn, args=tuple(line if a is None else a for a in args))
        for fn, args in targets
    ]
    for p in procs:
        p.start()
    say(f"{len(procs)} processes starting")
    deadline = _start(cfg, line)
    reports: list[dict[str, Any]] = []
    while len(reports) < len(procs):
        left = max(0.0, deadline - time.time())
        say(f"{len(procs)} processes racing, {left:.0f}s left, {len(reports)} done")
        try:
            reports.append(results.get(timeout=5.0))
        except Exception:  # queue.Empty: keep waiting while children run
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=30)
    elapsed = time.time() - started
    errors = tuple(f"{r['role']}: {r['error']}" for r in reports if "error" in r)
    infrastructure = tuple(f"{r['role']}: {r['error']}" for r in reports if r.get("infrastructure"))
    errors += tuple(f"process {p.name} exited {p.exitcode}" for p in procs if p.exitcode)
    say("judging the trace, the stored rows and every call")
    # with roles, through the auditor's login: what `ledger check` reads is its to read
    judge = cfg.url if logins is None else logins.url("auditor")
    with open_backend(judge, create=False) as b:
        trace = b.trace()
        report = check_trace(trace, with_registry=True)
        store = compare_with_store(report.final, stored_world(b.ledger, b.registry))
    every = [c for r in reports for c in r.get("calls", [])]
    calls = [c for c in every if c.get("kind") != "dispatch"]
    dispatches = [c for c in every if c.get("kind") == "dispatch"]
    history = [*judge_calls(trace, calls), *judge_dispatches(trace, dispatches)]
    recorded = [*setup, *(c for r in reports for c in r.get("history", []))]
    header = history_header(max_releases=3, registry=True)
    if history_path is not None:
        write_history(history_path, recorded, header)
    say(f"checking {len(recorded):,} recorded calls for linearizability")
    lin = check_calls(header, parse_calls(recorded)[1], time_limit=lin_time_limit)
    return RaceReport(
        config=attrs.evolve(cfg, roles=logins is not None),
        elapsed_s=elapsed,
        stats={r["role"]: r.get("stats", {}) for r in reports},
        events=len(trace),
        calls=len(every),
        violations=(*report.violations, *store, *history, *lin_violations(lin)),
        errors=errors,
        infrastructure=infrastructure,
        linearizability=lin,
        history=None if history_path is None else str(history_path),
    )


def lin_line(lin: LinReport, history: str | None = None) -> str:
    """The linearizability check in one line, for a console."""
    where = f"; history in {history}" if history else ""
    return (
        f"linearizability: {lin.verdict} ({lin.calls:,} calls, {lin.checked_calls:,} checked, "
        f"{lin.partitions:,} partitions, the largest {lin.max_partition:,} calls, "
        f"{lin.seconds:.1f}s){where}"
    )


def lin_violations(lin: LinReport) -> list[Violation]:
    """The linearizability check's violations, named for the report."""
    return [Violation("linearizable", f.message) for f in lin.findings if f.verdict == "violation"]


def judge_calls(trace: Sequence[TraceEvent], calls: Sequence[dict[str, Any]]) -> list[Violation]:
    """Each recorded reserve call's per-rollout outcome against the sequential spec.

    The trace orders every write; a rollout's state and the pointer are known at each
    moment. A reported win must be the trace's reservation of that rollout by that update,
    inside the call's window; a refusal must hold at some moment inside the window.
    """
    name = "call_outcome_linearizable"
    out: list[Violation] = []
    timeline: dict[str, list[EntryChanged]] = defaultdict(list)
    pointer_at: list[tuple[float, int | None]] = []
    for ev in trace:
        if isinstance(ev, EntryChanged):
            timeline[ev.rollout_id].append(ev)
        elif isinstance(ev, ArtifactChanged) and ev.pointer_after != ev.pointer_before:
            pointer_at.append(
                (ev.at, None if ev.pointer_after is None else ev.pointer_after.version)
            )
    slack = 0.005  # clock reads around the call vs the write's own clock read
    for call in calls:
        lo, hi = call["start"] - slack, call["end"] + slack
        asked = {rid: (rev, stamp) for rid, rev, stamp in call["asked"]}
        for rid, reason in call["got"]:
            evs = timeline.get(rid, [])
            mine = [e for e in evs if e.event == "reserve" and e.update_id == call["update_id"]]
            expected_rev = asked[rid][0]
            if reason == "reserved":
                if len(mine) != 1 or not lo <= mine[0].at <= hi:
                    out.append(
                        Violation(
                            name,
                            f"{call['update_id']} won {rid}, yet the trace "
                            f"holds {len(mine)} such reservation(s) in its window",
                        )
                    )
                elif not won_over(mine[0], expected_rev):
                    out.append(
                        Violation(
                            name,
                            f"{call['update_id']} won {rid} at revision "
                            f"{expected_rev}, the trace wrote over another",
                        )
                    )
                continue
            states = _states_in(evs, lo, hi)
            if reason == "idempotent_retry":
                # the caller already held the row: its own earlier reservation, still held
                # by it at some moment of the call
                if not retry_confirmed(mine, states, call["update_id"], hi):
                    out.append(
                        Violation(
                            name,
                            f"{call['update_id']} was told idempotent_retry for {rid}, yet it "
                            "held no reservation of it during the call",
                        )
                    )
                continue
            if mine:
                out.append(
                    Violation(
                        name,
                        f"{call['update_id']} was told {reason} for {rid} "
                        "but the trace shows it reserved",
                    )
                )
                continue
            if reason == "revision_conflict":
                ok = any(e.revision != expected_rev for e in states)
            elif reason == "not_rewarded":
                ok = any(e.state != "rewarded" for e in states)
            elif reason == "pointer_moved":
                stamp = from_jsonable(AdmissionStamp, asked[rid][1])
                ok = any(
                    p is not None and not 0 <= p - stamp.behavior_version <= stamp.max_lag
                    for p in _pointers_in(pointer_at, lo, hi)
                )
            else:
                ok = True  # refusals that do not depend on the moment (a bad stamp)
            if not ok:
                out.append(
                    Violation(
                        name,
                        f"{call['update_id']} was refused {rid} with "
                        f"{reason!r}, untrue at every moment of its call",
                    )
                )
    return out


@attrs.define
class _PacingMoment:
    """What a dispatch decision depends on, replayed from the trace event by event (the
    live tally and chains are the spec's own PacingIndex)."""

    entries: dict[str, LedgerEntry] = attrs.field(factory=dict)
    index: PacingIndex = attrs.field(factory=PacingIndex)
    pointer: int | None = None
    ever_active: set[int] = attrs.field(factory=set)
    retired: set[int] = attrs.field(factory=set)
    policy: AdmissionPolicy | None = None

    def apply(self, ev: TraceEvent) -> None:
        """Move to the moment after `ev`."""
        if isinstance(ev, EntryChanged):
            self.index.apply(ev.before, ev.after)
            self.entries[ev.rollout_id] = ev.after
        elif isinstance(ev, ArtifactChanged):
            self.pointer = None if ev.pointer_after is None else ev.pointer_after.version
            if self.pointer is not None:
                self.ever_active.add(self.pointer)
            kept = ev.after.failure is not None and ev.after.failure.cause == "rolled_back_kept"
            if ev.after.state == "rolled_back" and not kept:
                self.retired.add(ev.version)
        elif isinstance(ev, PolicyChanged):
            self.policy = ev.after

    def explains(self, reason: str, chain: str, v: int) -> bool:
        """Whether refusing a dispatch of `chain` on v{v} with `reason` is true now."""
        p, pol = self.pointer, self.policy
        states = [self.entries[r].state for r in self.index.chains.get(chain, [])]
        if reason == "not_active":
            return p is None or v > p or v not in self.ever_active
        if reason == "version_retired":
            return v in self.retired
        if reason == "chain_done":
            return "consumed" in states
        if reason == "chain_live":
            return any(s in OPEN_STATES for s in states)
        if pol is None or p is None:
            return False
        if reason == "stale":
            return p - v > pol.max_lag
        if reason == "attempts_exhausted":
            return pol.max_attempts is not None and len(states) >= pol.max_attempts
        if reason == "no_capacity" and pol.batch_size is not None:
            live = self.index.live_from(p - pol.max_lag)
            return live >= (pol.max_lag + 1) * pol.batch_size
        return False


def judge_dispatches(
    trace: Sequence[TraceEvent], calls: Sequence[dict[str, Any]]
) -> list[Violation]:
    """Each recorded dispatch call's answer against the trace (see `judge_calls`).

    A `dispatched` answer must be the trace's one new entry of that rollout, written in
    the call's window with the chain and attempt answered; a refusal must leave no entry
    and its reason must be true at some moment of the window (the trace replayed event by
    event: pointer, policy, chains, live rollouts). Whether a dispatch kept the budget is
    the spec's `dispatch_paced`, judged on the trace itself.
    """
    name = "dispatch_outcome_linearizable"
    out: list[Violation] = []
    slack = 0.005
    # A write is stamped when its events are appended, before its COMMIT; a step appended
    # just before a refused call may land during it (PostgreSQL under load: tens of ms), so
    # a refusal may reflect the moment before it. Its window opens that much earlier.
    # (Whether a dispatch broke the budget is judged on the trace itself, exactly.)
    commit_lag = 0.25
    adds: dict[str, EntryChanged] = {
        ev.rollout_id: ev for ev in trace if isinstance(ev, EntryChanged) and ev.before is None
    }
    refused: list[tuple[float, float, dict[str, Any]]] = []
    for c in calls:
        lo, hi, rid = c["start"] - slack, c["end"] + slack, c["rollout_id"]
        ev = adds.get(rid)
        if c["reason"] == "dispatched":
            if ev is None or not lo <= ev.at <= hi:
                out.append(
                    Violation(
                        name,
                        f"{rid} was dispatched, yet the trace has no such "
                        "entry written in the call's window",
                    )
                )
            elif (ev.after.chain, ev.after.attempt) != (c["chain"], c["attempt"]):
                out.append(
                    Violation(
                        name,
                        f"{rid} was dispatched as attempt {c['attempt']} of {c['chain']}, the "
                        f"trace wrote attempt {ev.after.attempt} of {ev.after.chain}",
                    )
                )
        elif ev is not None:
            out.append(Violation(name, f"{rid} was refused ({c['reason']}), yet it was written"))
        else:
            refused.append((lo - commit_lag, hi, c))
    refused.sort(key=lambda t: t[0])
    moment = _PacingMoment()
    i = 0
    active: list[tuple[float, float, dict[str, Any]]] = []
    moments: list[TraceEvent | None] = [*trace, None]
    nxt = float("-inf")
    for step in moments:
        # the trace's order is the write order; times read before commit (PostgreSQL) may
        # step back a little, so a moment starts no earlier than the one before it
        nxt = float("inf") if step is None else max(nxt, step.at)
        while i < len(refused) and refused[i][0] < nxt:
            active.append(refused[i])
            i += 1
        waiting = []
        for lo, hi, c in active:
            if moment.explains(c["reason"], c["chain"], c["version"]):
                continue
            if hi < nxt:  # the window ends before the next moment: never true in it
                out.append(
                    Violation(
                        name,
                        f"{c['rollout_id']} (chain {c['chain']}, v{c['version']}) was refused "
                        f"{c['reason']!r}, untrue at every moment of its call",
                    )
                )
                continue
            waiting.append((lo, hi, c))
        active = waiting
        if step is not None:
            moment.apply(step)
    return out


def won_over(ev: EntryChanged, expected_revision: int) -> bool:
    """A win wrote over exactly the revision the caller read (its compare-and-set)."""
    return ev.before is not None and ev.before.revision == expected_revision


def retry_confirmed(
    mine: Sequence[EntryChanged], states: Sequence[LedgerEntry], update_id: str, hi: float
) -> bool:
    """An idempotent_retry answer is true: the caller's one reservation of the row was
    written before the call ended, and the caller held the row at some moment of it."""
    held = any(s.state == "reserved" and s.reserved_by == update_id for s in states)
    return len(mine) == 1 and mine[0].at <= hi and held


def _states_in(evs: Sequence[EntryChanged], lo: float, hi: float) -> list[LedgerEntry]:
    """The rollout's records that were current at some moment in [lo, hi]."""
    out = []
    current = None
    for e in evs:
        if e.at <= lo:
            current = e.after
        elif e.at <= hi:
            if current is not None:
                out.append(current)
            current = e.after
        else:
            break
    if current is not None:
        out.append(current)
    return out


def _pointers_in(
    changes: Sequence[tuple[float, int | None]], lo: float, hi: float
) -> list[int | None]:
    out: list[int | None] = []
    current: int | None = None
    for at, v in changes:
        if at <= lo:
            current = v
        elif at <= hi:
            out.append(current)
            current = v
        else:
            break
    out.append(current)
    return out


def fresh_file(url: str) -> Path:
    """The race needs a new SQLite file (its checks judge the whole trace)."""
    from rollout_lifecycle.model.backends import sqlite_path

    path = sqlite_path(url)
    if path.exists():
        raise BackendURLError(
            f"{path} already exists: a race starts from a new file; remove it or give another"
        )
    return path


def check_fresh(url: str) -> None:
    """The race needs fresh state, since its checks judge the whole trace: a new SQLite file,
    or a PostgreSQL database (schema) that holds no ledger yet; memory:// is one process."""
    if url.startswith("sqlite:"):
        fresh_file(url)
        return
    if url.startswith("memory:"):
        raise BackendURLError(
            "memory:// lives in one process; a race runs several: use sqlite:///race.db or "
            "a postgresql:// URL"
        )
    try:
        with open_backend(url, create=False):
            pass
    except BackendURLError as exc:
        if "holds no rollout-lifecycle ledger" in str(exc):
            return  # empty: the race creates its tables
        raise
    raise BackendURLError(
        f"{redact_url(url)} already holds a ledger: a race starts from an empty database "
        "(or schema); create a new one (createdb) or give another"
    )
