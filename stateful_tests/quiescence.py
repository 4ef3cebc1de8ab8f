"""Bounded liveness, checked on a COPY of a machine's state, never on the machine itself.

The copy is rebuilt from records (`MemoryRegistry.restore`, `MemoryLedger.restore`) rather
than deep-copied (a deep copy of a machine is very slow) and then driven to quiescence:
every ack in flight is delivered, every healthy worker loads and acks what is awaited,
every pending version is committed, distributed and activated or failed, and leases run
out. Afterwards every activation attempt must be resolved and the spec's eventually
invariants must hold. A version that every worker acked correctly must activate unless it is
older than the pointer: a coordinator that refuses it is stuck, not safe.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import rollout_lifecycle.model.coordinator as coord_mod
import rollout_lifecycle.model.ledger as ledger_mod
import rollout_lifecycle.model.registry as registry_mod
from rollout_lifecycle.model.errors import RolloutLifecycleError
from rollout_lifecycle.model.events import EventLog, TraceEvent
from rollout_lifecycle.model.ledger import Ledger, RecoveryRule
from rollout_lifecycle.model.records import WorkerAck
from rollout_lifecycle.model.registry import RegistryStore
from rollout_lifecycle.spec.invariants import check_quiescent
from rollout_lifecycle.stateful_tests.recording import (
    EVENTUALLY_NAMES,
    Recorder,
    TraceChecker,
    world_of,
)
from rollout_lifecycle.stateful_tests.workers import WorkerTruth, activation_ghost_violations

QUIESCE_CAUSE = "quiescence: cannot activate"


def quiesce_copy(
    recorder: Recorder,
    ledger: Ledger,
    registry: RegistryStore,
    workers: Mapping[str, WorkerTruth],
    in_flight: Sequence[WorkerAck],
    *,
    now: float,
    lease_seconds: float,
    recovery: RecoveryRule,
    true_hash: Callable[[int], str],
    corrupt_hash: Callable[[int], str],
) -> list[str]:
    """Drive a rebuilt copy to quiescence; return every violation found on the way."""
    snapshot = ledger.snapshot()
    artifacts = registry.artifacts()
    pointer = registry.pointer()
    log = EventLog()
    clock = ledger_mod.ManualClock(now)
    required = registry.required_workers() or tuple(sorted(workers))
    reg = registry_mod.MemoryRegistry.restore(
        artifacts,
        pointer,
        registry.workers().values(),
        event_log=log,
        membership=required,
        policy=registry.policy(),
        tokens=registry.attempt_tokens(),
    )
    updates = ledger.updates()
    led = ledger_mod.MemoryLedger.restore(
        snapshot.values(),
        getattr(ledger, "bad_versions", frozenset()),
        updates.values(),
        clock=clock,
        lease_seconds=lease_seconds,
        recovery=recovery,
        event_log=log,
        activation=reg,
    )
    coord = coord_mod.ActivationCoordinator(reg, ledger=led, clock=clock)
    truth = {w: t.copy() for w, t in workers.items()}
    checker = TraceChecker(
        recorder, with_registry=True, world=world_of(snapshot, artifacts, pointer, reg, led)
    )
    problems: list[str] = []
    try:
        for ack in in_flight:
            coord.record_ack(ack)
        problems.extend(_resolve_activations(coord, reg, truth, true_hash, corrupt_hash))
        clock.advance(lease_seconds)
        led.expire_leases()
    except RolloutLifecycleError as exc:
        problems.append(f"liveness driver was refused: {type(exc).__name__}: {exc}")
    events = log.events()
    problems.extend(str(v) for v in checker.feed(events, observe=False))
    final = world_of(led.snapshot(), reg.artifacts(), reg.pointer(), reg, led)
    recorder.checked(EVENTUALLY_NAMES)
    problems.extend(str(v) for v in check_quiescent(final))
    return [f"liveness: {p}" for p in problems]


def log_of(reg: RegistryStore) -> list[TraceEvent]:
    """The copy's trace so far (a MemoryRegistry shares its log with the ledger copy)."""
    return list(reg.trace())


def _resolve_activations(
    coord: coord_mod.ActivationCoordinator,
    reg: RegistryStore,
    truth: dict[str, WorkerTruth],
    true_hash: Callable[[int], str],
    corrupt_hash: Callable[[int], str],
) -> list[str]:
    """Bring every pending version to active or failed, one distribution at a time."""
    problems: list[str] = []
    for _ in range(4 * (len(reg.artifacts()) + 1)):  # each pass resolves one step
        arts = reg.artifacts()
        awaiting = [a for a in arts if a.state == "awaiting_acks"]
        committed = [a for a in arts if a.state == "committed"]
        prepared = [a for a in arts if a.state == "prepared"]
        if awaiting:
            rec = awaiting[0]
            v = rec.version
            tokens = coord.attempt_tokens(v)  # sent with the weights, one per required worker
            spent = False
            for w in sorted(truth):
                if w not in tokens:
                    continue  # not in the worker set: nothing is asked of it
                ack = truth[w].answer(w, v, true_hash(v), corrupt_hash(v), rec.attempts, tokens[w])
                res = coord.record_ack(ack)
                if res.reason in (coord_mod.SPENT_ATTEMPT_TOKEN, coord_mod.CONFLICTING):
                    # its token counted once already (or a garbled copy of this very answer
                    # was counted): only a new attempt's fresh token can count its reload
                    spent = True
                elif not res.counted and res.reason != "duplicate":  # a re-sent answer
                    problems.append(f"{w}'s fresh ack of v{v} was not counted ({res.reason})")
            if spent:
                coord.fail_distribution(v, QUIESCE_CAUSE, "a worker's token was spent")
                coord.retry(v)
                continue
            before = len(log_of(reg))
            result = coord.try_activate(v)
            # the ghost is judged at the moment of activation, not after later loads
            problems.extend(activation_ghost_violations(log_of(reg)[before:], truth))
            if not result.activated:
                pointer = reg.pointer()
                healthy = not any(truth[w].broken for w in tokens if w in truth)
                if healthy and (pointer is None or v > pointer.version):
                    problems.append(
                        f"v{v} did not activate ({result.reason}) although every worker "
                        "loaded and acked it"
                    )
                coord.fail_distribution(v, QUIESCE_CAUSE, result.reason)
        elif committed:
            v = committed[0].version
            pointer = reg.pointer()
            if pointer is not None and v <= pointer.version:
                coord.abandon(v, QUIESCE_CAUSE, "overtaken by a newer active version")
            else:
                coord.distribute(v)
        elif prepared:
            v = prepared[0].version
            coord.commit_artifact(v, true_hash(v))
        else:
            return problems
    problems.append("pending activations did not resolve within the bound")
    return problems
