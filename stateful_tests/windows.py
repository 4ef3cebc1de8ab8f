"""The campaign's premise-window stage: the narrow window of a PostgreSQL reservation, held
open on purpose.

A reservation is judged against the active pointer of its own atomic step: on PostgreSQL
it takes the premise lock (shared) before it reads or re-checks the premise, and a pointer
switch takes it exclusive, so a switch either committed before the reservation read the
pointer or waits until the reservation committed. Drop the lock and a switch can commit
between the reservation's premise check and its compare-and-set; that window is
microseconds wide, so a timed race finds it by luck (an 8 s race missed it, a 6 s one in a
unit test caught it, sometimes).

Here the window is made wide in a test build, so the bug is caught every run: the single
reservation's server-side write is created (under another name) with a `pg_sleep` between
its guard and its compare-and-set, and the batch reservation sleeps right after it read
the premise inside its transaction. While a learner thread (its own connection) sleeps
there, the activator switches the pointer to the next version, with the admission policy
at max_lag 0: with the lock, the switch waits and the reservation lands first; without
it, the switch lands first and the reservation writes a rollout that is stale at its own
step. The spec judges the trace (`reserved_against_current_version`) and the stored rows.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.ledger import ReserveRequest
from rollout_lifecycle.model.records import (
    AdmissionPolicy,
    AdmissionStamp,
    LedgerEntry,
    Reward,
    WorkerAck,
)
from rollout_lifecycle.spec.invariants import check_trace, compare_with_store, stored_world
from rollout_lifecycle.stateful_tests.backends import durable_url
from rollout_lifecycle.stateful_tests.stages import StageContext, StageReport, entered

STAGE = "premise-window"
PAUSE_S = 0.5
PATHS = ("single", "batch", "single", "batch")
WORKERS = ("gen-0",)
POLICY = AdmissionPolicy(max_lag=0, max_drift=0.2)  # any switch makes the old version stale
REWARD = Reward("window-rm", "1", 1.0)
LEARNER = "premise-window learner"
WAIT_S = 60.0


def version_hash(v: int) -> str:
    """The artifact hash of version v in this stage."""
    return f"{v:x}".rjust(64, "9")


def _stamp(v: int) -> AdmissionStamp:
    return AdmissionStamp(v, v, 0, 0.2, 0.0, "fresh", "ok", True)


@contextlib.contextmanager
def paused_window(seconds: float, inside: threading.Event) -> Iterator[None]:
    """The test build: a pause between each reservation's premise check and its write, in
    the learner thread only (`inside` is set as the batch's pause starts; the single
    write's pause runs in the server, where `pg_stat_activity` shows it)."""
    from rollout_lifecycle.model import postgres_ledger as pl
    from rollout_lifecycle.stateful_tests.mutants import patch_everywhere, write_one_variant

    if pl._CAS_STEP not in pl._WRITE_ONE_DDL:
        raise AssertionError("the write-one function's compare-and-set step moved")
    read = pl._Unit.read_premise

    def read_then_pause(self: Any) -> Any:
        premise = read(self)
        if threading.current_thread().name == LEARNER:
            inside.set()
            time.sleep(seconds)
        return premise

    pause = f"    PERFORM pg_sleep({seconds});\n"
    with (
        write_one_variant("_paused", lambda ddl: ddl.replace(pl._CAS_STEP, pause + pl._CAS_STEP)),
        patch_everywhere(pl._Unit, "read_premise", read_then_pause),
    ):
        yield


def run_window_stage(ctx: StageContext) -> StageReport:
    """Rounds of (learner paused in the window, pointer switch), then the spec's verdict."""
    url = durable_url(ctx.backend, ctx.workdir)
    failures: list[str] = []
    facts: dict[str, Any] = {"pause_s": PAUSE_S, "rounds": []}
    with open_backend(url) as admin:
        coord = ActivationCoordinator(admin.registry, WORKERS, ledger=admin.ledger, policy=POLICY)
        _stage_version(coord, 0)
        if not coord.try_activate(0).activated:
            raise AssertionError("v0 did not activate")
        inside = threading.Event()
        with entered(ctx.mutant), paused_window(PAUSE_S, inside):
            from rollout_lifecycle.model import postgres_ledger as pl

            paused_fn = pl.WRITE_ONE
            with open_backend(url) as learner:  # opened in the test build: its own function
                for k, path in enumerate(PATHS):
                    v = k
                    ids = [f"w{k}.{i}" for i in range(1 if path == "single" else 2)]
                    for rid in ids:
                        admin.ledger.add(
                            LedgerEntry(
                                rollout_id=rid,
                                behavior_version=v,
                                artifact_hash=version_hash(v),
                                state="rewarded",
                                reward=REWARD,
                            )
                        )
                    _stage_version(coord, v + 1)
                    inside.clear()
                    got: dict[str, Any] = {}
                    thread = threading.Thread(
                        target=_reserve, args=(learner, path, ids, v, f"L.{k}", got), name=LEARNER
                    )
                    thread.start()
                    if not _wait_inside(admin, path, inside, paused_fn):
                        failures.append(f"round {k} ({path}): the learner never reached the window")
                    t0 = time.perf_counter()
                    switched = coord.try_activate(v + 1)
                    waited = time.perf_counter() - t0
                    thread.join(WAIT_S)
                    ctx.say(f"round {k} ({path}): switch waited {waited:.2f}s, learner {got}")
                    facts["rounds"].append(
                        {
                            "path": path,
                            "switch": switched.reason,
                            "switch_waited_s": round(waited, 3),
                            "reserved": got.get("reserved"),
                        }
                    )
                    if "error" in got:
                        failures.append(f"round {k} ({path}): learner: {got['error']}")
                    if not switched.activated:
                        failures.append(f"round {k}: v{v + 1} did not activate: {switched.reason}")
                    won = [rid for rid, ok in got.get("reserved", {}).items() if ok]
                    if won:
                        learner.ledger.commit(f"L.{k}", won)
        trace = admin.trace()
        report = check_trace(trace, with_registry=True)
        store = compare_with_store(report.final, stored_world(admin.ledger, admin.registry))
    failures.extend(f"spec: {v}" for v in (*report.violations, *store))
    facts["events"] = len(trace)
    return StageReport(STAGE, ctx.backend, ran=True, failures=tuple(failures), facts=facts)


def _stage_version(coord: ActivationCoordinator, v: int) -> None:
    """Prepare, commit, distribute and ack v: only the switch itself is left."""
    coord.prepare(v)
    coord.commit_artifact(v, version_hash(v))
    coord.distribute(v)
    for w in WORKERS:
        coord.record_ack(WorkerAck(w, v, version_hash(v), token=coord.attempt_token(w, v)))


def _reserve(
    learner: Any, path: str, ids: list[str], v: int, update: str, got: dict[str, Any]
) -> None:
    """The learner's reservation of rollouts of v admitted at lag 0, in its own thread."""
    try:
        led = learner.ledger
        if path == "single":
            (rid,) = ids
            out = led.reserve(rid, led.get(rid).revision, update, _stamp(v))
            got["reserved"] = {rid: out.reserved}
        else:
            reqs = [ReserveRequest(r, led.get(r).revision, _stamp(v)) for r in ids]
            got["reserved"] = {o.rollout_id: o.reserved for o in led.reserve_batch(update, reqs)}
    except Exception as exc:  # reported by the stage
        got["error"] = repr(exc)


def _wait_inside(admin: Any, path: str, inside: threading.Event, fn: str) -> bool:
    """Until the learner sleeps in its window: the batch's pause sets `inside`; the single
    write's pause is a server-side pg_sleep inside the test build's function."""
    if path == "batch":
        return inside.wait(WAIT_S)
    sql = (
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' "
        "AND position(%s in query) > 0"
    )
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        n = admin.ledger.db.read(lambda conn: conn.execute(sql, (fn,)).fetchone()[0], "activity")
        if n:
            return True
        time.sleep(0.01)
    return False


__all__ = ["paused_window", "run_window_stage"]
