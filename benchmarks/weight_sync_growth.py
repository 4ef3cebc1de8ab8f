"""A weight sync's cost as the run grows: each phase of one version's activation (prepare,
commit, distribute, each worker's ack, activate) on a deployment that has published
`--versions` versions, each after landing one update, as a trainer's step does, with the
default lineage; against the same phases on a deployment that has published 30, measured in
the same run, the two taking turns activation by activation (the order alternating), so a
slow spell of the machine falls on both.

    python benchmarks/weight_sync_growth.py [--versions 2000] [--measured 100]
        [--backend URL --reference URL] [--json FILE]

The figure to read is each phase's ratio, long run over short run (flat: about 1). Without
--backend both are fresh SQLite files on tmpfs (/dev/shm) when there is one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_lifecycle.model.backends import Backend, open_backend
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

WORKERS = ("w0", "w1")
SHORT = 30  # the versions the short run has published when the measured turns begin
POLICY = AdmissionPolicy(max_lag=1, max_drift=0.2)
REWARD = Reward("rm", "1", 1.0)
PHASES = ("prepare", "commit", "distribute", "ack", "activate")


def digest(v: int) -> str:
    return f"{v:x}".rjust(64, "d")


def land(b: Backend, v: int) -> None:
    """One rollout of v's policy, reserved and committed by its own update (landed)."""
    rid = f"r{v}"
    e = b.ledger.add(LedgerEntry(rollout_id=rid, behavior_version=v, artifact_hash=digest(v)))
    e = b.ledger.transition(rid, "generation_done", e.revision)
    e = b.ledger.transition(rid, "reward_ready", e.revision, reward=REWARD)
    stamp = AdmissionStamp(v, v, 1, 0.2, 0.0, "fresh", "ok", True)
    (got,) = b.ledger.reserve_batch(f"u{v}", [ReserveRequest(rid, e.revision, stamp)])
    assert got.reserved, got
    b.ledger.commit(f"u{v}", [rid])


class Deployment:
    """One deployment being published version by version, each phase timed when asked."""

    def __init__(self, b: Backend) -> None:
        set_admission_policy(b.registry, POLICY, "weight sync growth bench")
        self.b = b
        self.c = ActivationCoordinator(b.registry, list(WORKERS), ledger=b.ledger, policy=POLICY)
        self.next = 0
        self.times: dict[str, list[float]] = {p: [] for p in PHASES}

    def publish(self, timed: bool) -> None:
        v, c = self.next, self.c
        if v:
            land(self.b, v - 1)
        spent: dict[str, float] = {}

        def phase(name: str, fn: Callable[..., Any], *args: Any) -> None:
            t0 = time.perf_counter()
            fn(*args)
            spent[name] = time.perf_counter() - t0

        phase("prepare", c.prepare, v)
        phase("commit", c.commit_artifact, v, digest(v))
        phase("distribute", c.distribute, v)
        t0 = time.perf_counter()
        for w in WORKERS:
            assert c.record_ack(WorkerAck(w, v, digest(v), token=c.attempt_token(w, v))).counted
        spent["ack"] = (time.perf_counter() - t0) / len(WORKERS)
        phase("activate", c.try_activate, v)
        lineage = self.b.registry.artifact(v).trained_by
        assert v == 0 or lineage == (f"u{v - 1}",), lineage
        self.next += 1
        if timed:
            for k, dt in spent.items():
                self.times[k].append(dt)


def run(long_url: str, short_url: str, versions: int, measured: int) -> dict[str, Any]:
    with open_backend(long_url) as lb, open_backend(short_url) as sb:
        long_run, short_run = Deployment(lb), Deployment(sb)
        for dep, upto in ((long_run, versions), (short_run, SHORT)):
            while dep.next < upto:
                dep.publish(timed=False)
        for i in range(measured):
            for dep in (long_run, short_run) if i % 2 else (short_run, long_run):
                dep.publish(timed=True)

    def ms(xs: list[float]) -> float:
        return round(statistics.median(xs) * 1e3, 3)

    long_ms = {p: ms(long_run.times[p]) for p in PHASES}
    short_ms = {p: ms(short_run.times[p]) for p in PHASES}
    whole = (sum(long_ms.values()), sum(short_ms.values()))
    return {
        "versions": [versions, versions + measured],
        "short_versions": [SHORT, SHORT + measured],
        "measured": measured,
        "long_ms": long_ms,
        "short_ms": short_ms,
        "long_over_short": {p: round(long_ms[p] / short_ms[p], 2) for p in PHASES},
        "whole_sync": {
            "long_ms": round(whole[0], 3),
            "short_ms": round(whole[1], 3),
            "ratio": round(whole[0] / whole[1], 2),
        },
        "load": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--versions", type=int, default=2000)
    ap.add_argument("--measured", type=int, default=100, help="timed activations of each")
    ap.add_argument("--backend", help="the long run's backend URL (with --reference)")
    ap.add_argument("--reference", help="the short run's backend URL (a fresh one)")
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args()
    if args.versions <= SHORT or args.measured < 1:
        ap.error(f"--versions must exceed {SHORT}, and --measured be at least 1")
    if bool(args.backend) != bool(args.reference):
        ap.error("--backend and --reference go together (two fresh deployments)")
    if args.backend:
        out = run(args.backend, args.reference, args.versions, args.measured)
    else:
        where = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        with tempfile.TemporaryDirectory(dir=where) as tmp:
            out = run(
                f"sqlite:///{tmp}/long.db",
                f"sqlite:///{tmp}/short.db",
                args.versions,
                args.measured,
            )
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
