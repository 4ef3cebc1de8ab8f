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
the premise inside its transaction. The single reservation takes the server-side write
only when its update is already recorded (the first reservation of an update records it
in a step of its own, since issue 31), so each single round first reserves a primer
rollout in the same update, from the main thread (no pause there). While a learner thread
(its own connection) sleeps there, the activator switches the pointer to the next
version, with the admission policy at max_lag 0: with the lock, the switch waits and the
reservation lands first; without it, the switch lands first and the reservation writes a
rollout that is stale at its own step. The spec judges the trace
(`reserved_against_current_version`) and the stored rows.
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
from rollout_lifecycle.model.registry import set_admission_policy
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
ATTEMPTS = 4  # tries per round to get the switch into the window (a loaded machine)


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

    def read_then_pause(self: Any, versions: Any = None) -> Any:
        premise = read(self, versions)
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
    """Rounds of (learner paused in the window, pointer switch), then the spec's verdict.

    A round counts only when the switch started while the learner was still in its window
    (it started before the reservation returned); on a loaded machine the learner can
    sleep through its pause unseen, and such an attempt proved nothing: it is retried (up
    to ATTEMPTS times, counted in the facts' `missed`), and a round that never gets its
    switch into the window is a failure, never a pass."""
    url = durable_url(ctx.backend, ctx.workdir)
    failures: list[str] = []
    facts: dict[str, Any] = {"pause_s": PAUSE_S, "rounds": [], "missed": 0}
    with open_backend(url) as admin:
        set_admission_policy(admin.registry, POLICY, "set by the operator")
        coord = ActivationCoordinator(admin.registry, WORKERS, ledger=admin.ledger, policy=POLICY)
        _stage_version(coord, 0)
        if not coord.try_activate(0).activated:
            raise AssertionError("v0 did not activate")
        inside = threading.Event()
        with entered(ctx.mutant), paused_window(PAUSE_S, inside):
            from rollout_lifecycle.model import postgres_ledger as pl

            paused_fn = pl.WRITE_ONE
            v = 0  # the active version; each switch moves it on
            n = 0  # attempts so far (their update and rollout ids)
            staged = 0  # the latest version staged
            with open_backend(url) as learner:  # opened in the test build: its own function
                for k, path in enumerate(PATHS):
                    for _attempt in range(ATTEMPTS):
                        n += 1
                        if staged <= v:  # an attempt that missed before its switch staged it
                            _stage_version(coord, v + 1)
                            staged = v + 1
                        got = _start_and_switch(
                            admin, learner, coord, path, v, n, inside, paused_fn
                        )
                        won = [
                            rid
                            for rid, ok in (
                                *got.get("primed", {}).items(),
                                *got.get("reserved", {}).items(),
                            )
                            if ok
                        ]
                        if won:
                            learner.ledger.commit(f"L.{n}", won)
                        if "error" in got:
                            failures.append(f"round {k} ({path}): learner: {got['error']}")
                        switched = got.get("switch")
                        if switched is not None and switched.activated:
                            v += 1
                        elif switched is not None:
                            failures.append(
                                f"round {k}: v{v + 1} did not activate: {switched.reason}"
                            )
                        if switched is not None and got.get("in_window"):
                            facts["rounds"].append(
                                {
                                    "path": path,
                                    "switch": switched.reason,
                                    "switch_waited_s": round(got["waited"], 3),
                                    "reserved": got.get("reserved"),
                                }
                            )
                            break
                        facts["missed"] += 1
                        ctx.say(f"round {k} ({path}): the switch missed the window; again")
                    else:
                        failures.append(
                            f"round {k} ({path}): in {ATTEMPTS} attempts the switch never "
                            "started while the learner was in its window"
                        )
        trace = admin.trace()
        report = check_trace(trace, with_registry=True)
        store = compare_with_store(report.final, stored_world(admin.ledger, admin.registry))
    failures.extend(f"spec: {v}" for v in (*report.violations, *store))
    facts["events"] = len(trace)
    return StageReport(STAGE, ctx.backend, ran=True, failures=tuple(failures), facts=facts)


def _start_and_switch(
    admin: Any,
    learner: Any,
    coord: ActivationCoordinator,
    path: str,
    v: int,
    n: int,
    inside: threading.Event,
    paused_fn: str,
) -> dict[str, Any]:
    """One attempt: fresh rollouts of v, the learner's reservation paused in its window,
    and the switch to v+1 once the learner is seen there (none when the learner finished
    unseen). `in_window`: the switch started before the reservation returned."""
    ids = [f"w{n}.{i}" for i in range(1 if path == "single" else 2)]
    primer = [f"w{n}.p"] if path == "single" else []
    for rid in ids + primer:
        admin.ledger.add(
            LedgerEntry(
                rollout_id=rid,
                behavior_version=v,
                artifact_hash=version_hash(v),
                state="rewarded",
                reward=REWARD,
            )
        )
    inside.clear()
    got: dict[str, Any] = {}
    for rid in primer:  # records the update, here in the main thread: no pause
        led = learner.ledger
        got["primed"] = {rid: led.reserve(rid, led.get(rid).revision, f"L.{n}", _stamp(v)).reserved}
    thread = threading.Thread(
        target=_reserve, args=(learner, path, ids, v, f"L.{n}", got), name=LEARNER
    )
    thread.start()
    seen = _wait_inside(admin, path, inside, paused_fn, thread)
    if not seen or not thread.is_alive():
        thread.join(WAIT_S)
        if thread.is_alive():
            got["error"] = f"the reservation did not return in {WAIT_S:.0f}s"
        return got
    t0 = time.perf_counter()
    got["switch"] = coord.try_activate(v + 1)
    got["waited"] = time.perf_counter() - t0
    thread.join(WAIT_S)
    if thread.is_alive():
        got["error"] = f"the reservation did not return in {WAIT_S:.0f}s"
    got["in_window"] = got.get("done_at", 0.0) > t0
    return got


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
    finally:
        got["done_at"] = time.perf_counter()


def _wait_inside(
    admin: Any, path: str, inside: threading.Event, fn: str, thread: threading.Thread
) -> bool:
    """Until the learner sleeps in its window: the batch's pause sets `inside`; the single
    write's pause is a server-side pg_sleep inside the test build's function. False when
    the learner finished first (it slept through its pause unseen) or never got there."""
    deadline = time.monotonic() + WAIT_S
    if path == "batch":
        while time.monotonic() < deadline:
            if inside.wait(0.05):
                return True
            if not thread.is_alive():
                return inside.is_set()
        return False
    sql = (
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' "
        "AND position(%s in query) > 0"
    )
    while time.monotonic() < deadline and thread.is_alive():
        n = admin.ledger.db.read(lambda conn: conn.execute(sql, (fn,)).fetchone()[0], "activity")
        if n:
            return True
        time.sleep(0.01)
    return False


__all__ = ["paused_window", "run_window_stage"]
