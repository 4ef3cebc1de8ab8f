"""The campaign's clock-skew stage: clients minutes off the PostgreSQL server's clock.

CONTRACT: lease deadlines and expiry come from one clock per deployment, the database
server's on PostgreSQL, never from a client's. On one host a test that injects a clock
into the ledger (`open_backend(url, clock=...)`) turns the server clock OFF for that
ledger, so such a test cannot see a write path that reads the client's clock. Here the
clients keep the server clock on and are skewed in two honest ways:

* child processes under libfaketime (`faketime -f +300s python ...`): the process's own
  clock is shifted, the server's is not (the ledger is opened without a clock);
* in-process clients whose ledger clock is replaced AFTER opening (`ledger.clock = ...`):
  it only dates their events; the store still reads the server's clock (checked).

Each client, 5 minutes ahead or behind, reserves one rollout and a batch, runs an expiry
pass (nothing may be due), renews, reserves more on a short lease, waits (on the server's
clock) past those deadlines and expires them, then commits. Every deadline it is handed
must be the server's time at the call plus the lease; every expiry pass must return
exactly the leases the server's clock says ran out; the spec judges the whole trace and
the stored rows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.errors import RolloutLifecycleError
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

STAGE = "clock-skew"
SKEW_S = 300.0  # five minutes, ahead and behind
LONG_LEASE = 120.0
SHORT_LEASE = 1.0
TOLERANCE_S = 0.01  # float rounding only: the deadline is read between the two readings
WORKERS = ("gen-0",)
POLICY = AdmissionPolicy(max_lag=1, max_drift=0.2)
REWARD = Reward("skew-rm", "1", 1.0)
STAMP = AdmissionStamp(0, 0, 1, 0.2, 0.0, "fresh", "ok", True)
NOW_SQL = "SELECT extract(epoch FROM clock_timestamp())::float8"
HASH0 = "0".rjust(64, "f")


def _clients(faketime: str | None) -> list[tuple[str, str, float]]:
    """(name, how, skew): injected clocks always, libfaketime processes where installed."""
    out = [("inj-behind", "injected", -SKEW_S), ("inj-ahead", "injected", SKEW_S)]
    if faketime is not None:
        out += [("ft-behind", "faketime", -SKEW_S), ("ft-ahead", "faketime", SKEW_S)]
    return out


def _ids(name: str) -> dict[str, list[str]]:
    return {
        "single": [f"{name}.s"],
        "batch": [f"{name}.b{i}" for i in range(3)],
        "short": [f"{name}.t{i}" for i in range(2)],
        "short_single": [f"{name}.u"],
    }


def run_skew_stage(ctx: StageContext) -> StageReport:
    """Set up a fresh schema with v0 active, run each skewed client, judge."""
    url = durable_url(ctx.backend, ctx.workdir)
    faketime = shutil.which("faketime")
    clients = _clients(faketime)
    with open_backend(url) as admin:
        set_admission_policy(admin.registry, POLICY, "set by the operator")
        coord = ActivationCoordinator(admin.registry, WORKERS, ledger=admin.ledger, policy=POLICY)
        coord.prepare(0)
        coord.commit_artifact(0, HASH0)
        coord.distribute(0)
        coord.record_ack(WorkerAck(WORKERS[0], 0, HASH0, token=coord.attempt_token(WORKERS[0], 0)))
        coord.try_activate(0)
        for name, _how, _skew in clients:
            for rid in (r for rids in _ids(name).values() for r in rids):
                admin.ledger.add(
                    LedgerEntry(
                        rollout_id=rid,
                        behavior_version=0,
                        artifact_hash=HASH0,
                        state="rewarded",
                        reward=REWARD,
                    )
                )
    failures: list[str] = []
    calls = 0
    for name, how, skew in clients:
        ctx.say(f"client {name}: {how} clock {skew:+.0f}s against the server's")
        if how == "injected":
            with entered(ctx.mutant):
                got = client_run(url, name, skew)
        else:
            assert faketime is not None
            got = _faketime_client(faketime, url, name, skew, ctx.mutant)
        calls += len(got.get("calls", []))
        clock = got.get("process_clock")
        if clock is not None and abs(clock - time.time() - skew) > 60:
            failures.append(f"{name}: faketime did not shift the child's clock by {skew:+.0f}s")
        failures.extend(f"{name}: {f}" for f in judge_client(got))
    with open_backend(url, create=False) as b:
        trace = b.trace()
        report = check_trace(trace, with_registry=True)
        store = compare_with_store(report.final, stored_world(b.ledger, b.registry))
    failures.extend(f"spec: {v}" for v in (*report.violations, *store))
    facts = {
        "clients": [f"{n} ({h}, {s:+.0f}s)" for n, h, s in clients],
        "faketime": faketime is not None,
        "calls_judged": calls,
        "events": len(trace),
    }
    if faketime is None:
        facts["note"] = "faketime is not installed: injected clocks only (apt-get install faketime)"
    return StageReport(STAGE, ctx.backend, ran=True, failures=tuple(failures), facts=facts)


def _faketime_client(
    faketime: str, url: str, name: str, skew: float, mutant: str | None
) -> dict[str, Any]:
    """The client in a child process whose clock libfaketime shifts by `skew`."""
    args = json.dumps({"url": url, "name": name, "skew": skew, "mutant": mutant})
    cmd = [faketime, "-f", f"{skew:+.0f}s", sys.executable, "-m", __name__, args]
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, check=False, env=dict(os.environ)
    )
    if res.returncode != 0:
        return {"error": f"child exited {res.returncode}: {res.stderr.strip()[-800:]}"}
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def client_run(url: str, name: str, skew: float, *, injected: bool = True) -> dict[str, Any]:
    """One skewed client's calls, each with the server's time just before and after it.

    `injected`: the ledger's clock is set to this process's clock + `skew` after opening
    (the store keeps reading the server's clock); otherwise the process clock itself is
    skewed (libfaketime) and the ledger is used as opened."""
    ids = _ids(name)
    calls: list[dict[str, Any]] = []
    with open_backend(url, lease_seconds=LONG_LEASE) as b:
        led: Any = b.ledger
        if injected:
            led.clock = lambda: time.time() + skew  # dates events only
        if not led.store.server_clock:
            return {"error": "the ledger does not read the server's clock: nothing to judge"}

        def server_now() -> float:
            return float(led.db.read(lambda conn: conn.execute(NOW_SQL).fetchone()[0], "now"))

        def leased(op: str, fn: Any) -> list[LedgerEntry]:
            t0 = server_now()
            got = fn()
            t1 = server_now()
            entries = [e for e in got if e is not None]
            calls.append(
                {
                    "op": op,
                    "t0": t0,
                    "t1": t1,
                    "lease_seconds": led.lease_seconds,
                    "leases": {e.rollout_id: e.lease_expires_at for e in entries},
                }
            )
            return entries

        def expire(op: str) -> None:
            held = {e.rollout_id: e.lease_expires_at for e in led.in_state("reserved")}
            t0 = server_now()
            got = led.expire_leases()
            t1 = server_now()
            returned = sorted(e.rollout_id for e in got)
            calls.append({"op": op, "t0": t0, "t1": t1, "held": held, "returned": returned})

        def request(rid: str) -> ReserveRequest:
            return ReserveRequest(rid, led.get(rid).revision, STAMP)

        held, short = f"{name}.held", f"{name}.short"
        (rid,) = ids["single"]
        leased("reserve", lambda: [led.reserve(rid, led.get(rid).revision, held, STAMP).entry])
        leased(
            "reserve_batch",
            lambda: [o.entry for o in led.reserve_batch(held, [request(r) for r in ids["batch"]])],
        )
        expire("expire (nothing due)")
        leased("renew_leases", lambda: led.renew_leases(held))
        led.lease_seconds = SHORT_LEASE
        leased(
            "reserve_batch (short lease)",
            lambda: [o.entry for o in led.reserve_batch(short, [request(r) for r in ids["short"]])],
        )
        (one,) = ids["short_single"]
        leased(
            "reserve (short lease)",
            lambda: [led.reserve(one, led.get(one).revision, short, STAMP).entry],
        )
        # when the short leases run out on the server's clock if they are what they must be
        # (a wrong deadline is the judge's finding; waiting for it would only be slow)
        due = max(c["t1"] + SHORT_LEASE for c in calls if "short" in c["op"])
        deadline = time.monotonic() + 10.0
        while server_now() <= due + 0.05 and time.monotonic() < deadline:
            time.sleep(0.1)  # waiting on the SERVER's clock, whatever this one says
        expire("expire (short leases due)")
        try:
            led.commit(held, [rid, *ids["batch"]])
        except RolloutLifecycleError as exc:  # a lease lost early: judged with the calls
            return {"calls": calls, "commit": f"{type(exc).__name__}: {exc}"}
    return {"calls": calls}


def judge_client(got: dict[str, Any]) -> list[str]:
    """Every deadline handed out is server time at the call + the lease; every expiry pass
    returns exactly the leases that ran out on the server's clock."""
    if "error" in got:
        return [str(got["error"])]
    out = []
    for c in got["calls"]:
        if "leases" in c:
            low = c["t0"] + c["lease_seconds"] - TOLERANCE_S
            high = c["t1"] + c["lease_seconds"] + TOLERANCE_S
            for rid, lease in sorted(c["leases"].items()):
                if lease is None or not low <= lease <= high:
                    off = None if lease is None else round(lease - c["t1"] - c["lease_seconds"])
                    out.append(
                        f"{c['op']}: {rid}'s deadline {lease} is not the server's time + "
                        f"{c['lease_seconds']:g}s (in [{low:.3f}, {high:.3f}]; off by about "
                        f"{off}s: a deadline from the client's clock?)"
                    )
        else:
            must = {r for r, lease in c["held"].items() if lease is not None and lease <= c["t0"]}
            may = {r for r, lease in c["held"].items() if lease is not None and lease <= c["t1"]}
            returned = set(c["returned"])
            if not must <= returned:
                out.append(
                    f"{c['op']}: {sorted(must - returned)} ran out on the server's clock "
                    "but were not expired"
                )
            if not returned <= may:
                out.append(
                    f"{c['op']}: expired {sorted(returned - may)} before their deadline "
                    "on the server's clock"
                )
    if "commit" in got:  # the consequence, after its causes
        out.append(f"committing the long-lease update was refused: {got['commit']}")
    return out


def main() -> None:
    """Child entry point: one client under libfaketime, its calls as one JSON line."""
    args = json.loads(sys.argv[1])
    try:
        with entered(args.get("mutant")):
            got = client_run(args["url"], args["name"], args["skew"], injected=False)
    except Exception as exc:  # reported to the parent, judged as a failure
        got = {"error": repr(exc)}
    got["process_clock"] = time.time()
    print(json.dumps(got))


if __name__ == "__main__":
    main()


__all__ = ["client_run", "judge_client", "run_skew_stage"]
