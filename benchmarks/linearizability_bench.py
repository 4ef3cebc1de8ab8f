"""What checking a call history for linearizability costs per call, at 1k, 10k and 100k
calls (issue 33). Ratios within one run; not a timed test.

    python benchmarks/linearizability_bench.py                 # 1000 10000 100000 calls
    python benchmarks/linearizability_bench.py 1000 20000
    python benchmarks/linearizability_bench.py --history race/history.jsonl

Each history is recorded live: threads race on one memory deployment (a publisher moving
the pointer and adding rollouts, learners reserving in batches and alone, committing and
aborting, dispatchers on shared prompt chains), every call through the recorders
(stateful_tests/history.py), until the processes made the asked number of calls. The
check runs in this process after the recording stops; one JSON line per size: calls,
partitions, the largest partition, seconds, microseconds per call, and the CPU seconds of
the check alone. `--history FILE` checks a recorded history instead (a race's).
"""

from __future__ import annotations

import json
import random
import resource
import sys
import threading
import time
from typing import Any

from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.errors import RolloutLifecycleError
from rollout_lifecycle.model.ledger import ReserveRequest
from rollout_lifecycle.model.records import (
    AdmissionPolicy,
    AdmissionStamp,
    LedgerEntry,
    Reward,
    WorkerAck,
)
from rollout_lifecycle.spec.linearizability import check_calls, parse, read_history
from rollout_lifecycle.stateful_tests.history import (
    CallLog,
    RecordingLedger,
    RecordingRegistry,
    attach,
    history_header,
    operator_sets_policy,
)

REWARD = Reward("bench-rm", "1", 1.0)
WORKERS = ("w0", "w1")


def h(v: int) -> str:
    return f"{v:x}".rjust(64, "a")


def record(
    calls: int, seed: int = 0, learners: int = 4, dispatchers: int = 2
) -> list[dict[str, Any]]:
    """Record a live history of about `calls` calls (see the module doc)."""
    logs: list[CallLog] = []
    stop = threading.Event()
    with open_backend("memory://") as raw:
        setup = CallLog("setup")
        logs.append(setup)
        policy = AdmissionPolicy(1, 0.2, 16, 3)
        operator_sets_policy(setup, raw.registry, policy, "the operator's")
        coord0 = attach(
            setup,
            raw.registry,
            WORKERS,
            ledger=RecordingLedger(raw.ledger, setup),
            policy=policy,
        )
        _publish(coord0, 0)

        def publisher() -> None:
            log = CallLog("publisher")
            logs.append(log)
            ledger = RecordingLedger(raw.ledger, log)
            coord = attach(log, raw.registry, ledger=ledger)
            rng = random.Random(seed)
            v, n = 0, 0
            while not stop.is_set():
                pointer = coord.pointer()
                if ledger.statistics().by_state.get("rewarded", 0) < 64 and pointer is not None:
                    entries = [
                        LedgerEntry(
                            rollout_id=f"a{n + i}",
                            behavior_version=pointer.version,
                            artifact_hash=pointer.artifact_hash,
                            state="rewarded",
                            reward=REWARD,
                        )
                        for i in range(16)
                    ]
                    n += 16
                    ledger.add_many(entries)
                if rng.random() < 0.3:
                    v = max(v, coord.registry.max_version() or 0) + 1
                    try:
                        _publish(coord, v)
                        if rng.random() < 0.1:
                            coord.rollback(keep_rollouts=rng.random() < 0.5)
                    except RolloutLifecycleError:
                        pass
                time.sleep(0.002)

        def learner(i: int) -> None:
            log = CallLog(f"learner-{i}")
            logs.append(log)
            ledger = RecordingLedger(raw.ledger, log)
            registry = RecordingRegistry(raw.registry, log)
            rng = random.Random(seed * 31 + i)
            k = 0
            while not stop.is_set():
                pointer = registry.pointer()
                waiting = ledger.oldest_admissible(32)
                if pointer is None or not waiting:
                    time.sleep(0.001)
                    continue
                rng.shuffle(waiting)
                update = f"L{i}.u{k}"
                k += 1
                reqs = [
                    ReserveRequest(
                        e.rollout_id, e.revision, _stamp(e.behavior_version, pointer.version)
                    )
                    for e in waiting[: rng.randint(1, 8)]
                ]
                if rng.random() < 0.3:
                    outs = [
                        ledger.reserve(r.rollout_id, r.expected_revision, update, r.admission)
                        for r in reqs
                    ]
                else:
                    outs = ledger.reserve_batch(update, reqs)
                won = [o.rollout_id for o in outs if o.reserved]
                if not won:
                    continue
                if rng.random() < 0.1:
                    ledger.reserve_batch(update, [r for r in reqs if r.rollout_id in won][:2])
                if rng.random() < 0.1:
                    ledger.renew_leases(update)
                if rng.random() < 0.1:
                    ledger.abort(update)
                else:
                    ledger.commit(update, won)

        def dispatcher(i: int) -> None:
            log = CallLog(f"dispatcher-{i}")
            logs.append(log)
            ledger = RecordingLedger(raw.ledger, log)
            registry = RecordingRegistry(raw.registry, log)
            rng = random.Random(seed * 97 + i)
            mine: list[str] = []
            n = 0
            while not stop.is_set():
                pointer = registry.pointer()
                if pointer is None:
                    continue
                try:
                    if mine and rng.random() < 0.6:
                        rid = mine[rng.randrange(len(mine))]
                        e = ledger.get(rid)
                        if e.state == "dispatched":
                            ledger.transition(rid, "generation_done", e.revision, tokens=8)
                        elif e.state == "generated":
                            ledger.transition(rid, "reward_ready", e.revision, reward=REWARD)
                            mine.remove(rid)
                        else:
                            mine.remove(rid)
                        continue
                except RolloutLifecycleError:
                    continue
                v = pointer.version
                rid = f"d{i}.{n}"
                n += 1
                got = ledger.dispatch(
                    LedgerEntry(rollout_id=rid, behavior_version=v, artifact_hash=h(v)),
                    chain=f"c{rng.randrange(48)}",
                )
                if got.dispatched:
                    mine.append(rid)
                if rng.random() < 0.03:
                    ledger.retire_stale()

        threads = [threading.Thread(target=publisher)]
        threads += [threading.Thread(target=learner, args=(i,)) for i in range(learners)]
        threads += [threading.Thread(target=dispatcher, args=(i,)) for i in range(dispatchers)]
        for t in threads:
            t.start()
        while sum(len(log.calls) for log in list(logs)) < calls:
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join()
    return [c for log in logs for c in log.calls]


def _publish(coord: Any, v: int) -> None:
    coord.prepare(v)
    coord.commit_artifact(v, h(v))
    coord.distribute(v)
    for w, token in coord.attempt_tokens(v).items():
        coord.record_ack(WorkerAck(w, v, h(v), token=token))
    coord.try_activate(v)


def _stamp(v: int, current: int) -> AdmissionStamp:
    lag = current - v
    if not 0 <= lag <= 1:
        return AdmissionStamp(current, v, 1, 0.2, 0.01, "stale", "stale_policy", False)
    return AdmissionStamp(
        current, v, 1, 0.2, 0.01, "fresh" if lag == 0 else "tolerated", "ok", True
    )


def measure(
    header: dict[str, Any], lines: list[dict[str, Any]] | None, calls: Any
) -> dict[str, Any]:
    """Check one history; the figures of one JSON line."""
    cpu0, t0 = time.process_time(), time.perf_counter()
    got = check_calls(header, calls)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {
        "calls": got.calls,
        "verdict": got.verdict,
        "partitions": got.partitions,
        "max_partition": got.max_partition,
        "joint_searches": got.joint_searches,
        "check_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "us_per_call": round(1e6 * wall / max(got.calls, 1), 1),
        "cpu_us_per_call": round(1e6 * cpu / max(got.calls, 1), 1),
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def main(argv: list[str]) -> None:
    """Record and check each size (or check `--history FILE`); print a JSON line each."""
    if argv[:1] == ["--history"]:
        header, calls = read_history(argv[1])
        print(json.dumps({"history": argv[1], **measure(header, None, calls)}), flush=True)
        return
    for n in [int(a) for a in argv] or [1000, 10000, 100000]:
        t0 = time.perf_counter()
        lines = record(n)
        recorded = time.perf_counter() - t0
        header, calls = parse([history_header(), *lines])
        print(
            json.dumps(
                {"asked": n, "record_s": round(recorded, 1), **measure(header, lines, calls)}
            ),
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
