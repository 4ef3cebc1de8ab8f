"""How `ledger check` scales: build ledgers of N rollouts through the public API, time the
check, report seconds per event (flat = linear). Ratios within one run; not a timed test.

    python benchmarks/ledger_check_scaling.py 1000 2000 4000 100000

Each rollout is added rewarded, reserved in a batch by one of several updates and
committed: three events per rollout plus the registry's activation of v0.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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

H0 = "a" * 64
REWARD = Reward("rm", "1", 1.0)
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
BATCH = 1000


def build(path: Path, n: int) -> None:
    """A ledger of `n` consumed rollouts, written through the real SQLite backend."""
    with open_backend(f"sqlite:///{path}") as b:
        c = ActivationCoordinator(b.registry, ["g0"], ledger=b.ledger)
        c.set_policy(AdmissionPolicy(1, 0.2), "benchmark")
        c.prepare(0)
        c.commit_artifact(0, H0)
        c.distribute(0)
        c.record_ack(WorkerAck("g0", 0, H0, token=c.attempt_token("g0", 0)))
        assert c.try_activate(0).activated
        led = b.ledger
        for start in range(0, n, BATCH):
            ids = [f"r{i}" for i in range(start, min(n, start + BATCH))]
            led.add_many(  # type: ignore[attr-defined]
                [
                    LedgerEntry(
                        rollout_id=r,
                        behavior_version=0,
                        artifact_hash=H0,
                        state="rewarded",
                        reward=REWARD,
                    )
                    for r in ids
                ]
            )
            upd = f"u{start}"
            won = led.reserve_batch(upd, [ReserveRequest(r, 0, STAMP) for r in ids])
            assert all(o.reserved for o in won)
            led.commit(upd, ids)


def main(sizes: list[int]) -> None:
    """Build and check each size; print one JSON line per size."""
    cli = Path(sys.executable).parent / "rollout-lifecycle"
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            db = Path(tmp) / "ledger.db"
            t0 = time.perf_counter()
            build(db, n)
            built = time.perf_counter() - t0
            t1 = time.perf_counter()
            res = subprocess.run(
                [str(cli), "ledger", "check", "--backend", f"sqlite:///{db}", "--json", "--quiet"],
                capture_output=True,
                text=True,
                check=False,
            )
            wall = time.perf_counter() - t1
            data = json.loads(res.stdout)
            print(
                json.dumps(
                    {
                        "rollouts": n,
                        "events": data["events"],
                        "exit": res.returncode,
                        "violations": data["violation_count"],
                        "check_wall_s": round(wall, 2),
                        "check_internal_s": data["elapsed_s"],
                        "us_per_event": round(1e6 * data["elapsed_s"] / data["events"], 1),
                        "build_s": round(built, 1),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1000, 2000, 4000])
