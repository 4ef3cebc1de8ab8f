"""One update worked on from several connections at once, judged by the spec afterwards.

The race (`stateful_tests.race`) gives each learner its own updates, so no two connections
ever act on one update. A deployment does: a trainer reserves and commits an update while
its heartbeat renews the update's leases and a janitor in another process expires them.
On PostgreSQL, whose steps lock rows and updates rather than the whole store, that is where
an answer true at no instant hid: a commit that missed a reservation of its own update
landing between its read of the update's rows and its COMMIT (fixed with `_hold_update`;
`spec.invariants.commit_takes_all_held` names it). Here threads, each with its own backend
and so its own connection, reserve (singly and in batches), commit what the update holds,
abort, renew and expire on a few shared update ids, with leases short enough to expire
under them. Every answer must be one the protocol allows, and the recorded trace must keep
every invariant of the spec, replayed apart from the code that enforced them.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from rollout_lifecycle.model import ledger as ledger_module
from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.errors import CommitMismatch, UpdatePoisoned
from rollout_lifecycle.model.ledger import ReserveRequest
from rollout_lifecycle.model.records import AdmissionPolicy
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.model.sql_unit import SqlUnit
from rollout_lifecycle.spec.invariants import check_trace
from tests import pg_server
from tests.helpers_ledger import activate, add_rewarded, stamp

POLICY = AdmissionPolicy(max_lag=1, max_drift=0.2)
ROWS = 120
# answers the protocol gives when another connection moved the update first
EXPECTED = (CommitMismatch, UpdatePoisoned)


def _worker(url: str, seed: int, until: float, epoch: float, out: dict[str, Any]) -> None:
    rng = random.Random(seed)
    done: Counter[str] = Counter()
    odd: list[str] = []
    # 100 ms leases: they expire under the other connections' commits and renewals
    with open_backend(url, lease_seconds=0.1) as b:
        led = b.ledger
        while time.monotonic() < until:
            # a few updates at a time, new ones every half second (a landed or poisoned
            # update takes no more reservations)
            update = f"u{int((time.monotonic() - epoch) / 0.5)}.{rng.randrange(2)}"
            op = rng.random()
            try:
                if op < 0.3:
                    picked = [led.find(f"r{i}") for i in rng.sample(range(ROWS), 6)]
                    requests = [
                        ReserveRequest(e.rollout_id, e.revision, stamp())
                        for e in picked
                        if e is not None
                    ]
                    done["reserved"] += sum(o.reserved for o in led.reserve_batch(update, requests))
                elif op < 0.5:
                    e = led.find(f"r{rng.randrange(ROWS)}")
                    if e is not None:
                        done["reserved"] += led.reserve(
                            e.rollout_id, e.revision, update, stamp()
                        ).reserved
                elif op < 0.72:
                    held = led.reserved_by(update)
                    if held:
                        done["committed"] += len(led.commit(update, held))
                elif op < 0.8:
                    done["aborted"] += len(led.abort(update))
                elif op < 0.85:
                    done["renewed"] += len(led.renew_leases(update))
                else:
                    done["expired"] += len(led.expire_leases())
            except EXPECTED as exc:
                done[type(exc).__name__] += 1
            except Exception as exc:  # anything else is a finding
                odd.append(f"{type(exc).__name__}: {exc}")
    out[f"w{seed}"] = (done, odd)


def _stress(url: str, seconds: float, workers: int = 4) -> tuple[Counter[str], list[str]]:
    with open_backend(url) as b:
        set_admission_policy(b.registry, POLICY, "set by the operator")
        activate(ActivationCoordinator(b.registry, ["w0"], ledger=b.ledger, policy=POLICY), 1)
        add_rewarded(b.ledger, [f"r{i}" for i in range(ROWS)])
    out: dict[str, Any] = {}
    start = time.monotonic()
    threads = [
        threading.Thread(target=_worker, args=(url, seed, start + seconds, start, out))
        for seed in range(workers)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    assert len(out) == workers, "a worker never finished"
    done: Counter[str] = Counter()
    odd: list[str] = []
    for counts, found in out.values():
        done.update(counts)
        odd += found
    return done, odd


def _violations(url: str) -> list[tuple[str, str]]:
    with open_backend(url) as b:
        return [(v.invariant, v.message) for v in check_trace(b.trace()).violations]


def _check(url: str, seconds: float) -> None:
    done, odd = _stress(url, seconds)
    assert odd == []
    # the stress did what it is for: reservations and commits of shared updates
    assert done["reserved"] > 0 and done["committed"] > 0, done
    assert _violations(url) == []


def test_one_update_from_several_connections_sqlite(tmp_path: Path) -> None:
    _check(f"sqlite:///{tmp_path / 'ledger.db'}", 4.0)


@pytest.mark.postgres
def test_one_update_from_several_connections_postgres(postgres_url: str) -> None:
    _check(postgres_url, 6.0)


@pytest.mark.postgres
def test_the_stress_finds_a_commit_that_misses_a_reservation_of_its_update(
    postgres_server: pg_server.Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stress above is a checker that has been shown the fault it guards against: with
    the fix taken out (the update's record read without taking the update's lock, so
    nothing keeps a reservation of the update from committing after a commit read the
    update's rows), some commit of this run misses a reservation of its own update, and
    the trace says so."""

    def unlocked(uow: Any, update_id: str) -> Any:
        return SqlUnit.read_updates(uow, [update_id]).get(update_id)

    monkeypatch.setattr(ledger_module, "_hold_update", unlocked)
    found: list[tuple[str, str]] = []
    for _ in range(3):  # the window is narrow: a few short runs, each on a fresh database
        url = pg_server.new_database(postgres_server)
        _stress(url, 6.0)
        found = [v for v in _violations(url) if v[0] == "commit_takes_all_held"]
        postgres_server.psql(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[-1]}" WITH (FORCE)')
        if found:
            break
    assert found
