"""The ledger conformance kit on the built-in backends, on a user's ledger named by the
environment, and on a broken ledger it must reject."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from rollout_lifecycle.model.ledger import Clock, Ledger, MemoryLedger
from rollout_lifecycle.model.records import LedgerEntry
from rollout_lifecycle.stateful_tests.conformance import (
    CHECKS,
    ENV_VAR,
    ConformanceFailure,
    run_conformance,
)


@pytest.mark.parametrize("backend", ["memory", "sqlite", "postgresql"])
def test_builtin_backend_conforms(backend: str, tmp_path: Path) -> None:
    """Protocol checks and the race machine pass on the shipped backends."""
    report = run_conformance(
        backend, examples=30 if backend == "postgresql" else 50, workdir=tmp_path
    )
    assert report.ok, report.summary()
    assert set(report.problems) == set(CHECKS)


def test_user_ledger_conforms(tmp_path: Path) -> None:
    """ROLLOUT_LIFECYCLE_LEDGER=package.module:factory runs the whole kit on that ledger."""
    spec = os.environ.get(ENV_VAR)
    if not spec:
        pytest.skip(f"set {ENV_VAR}=package.module:factory to check your own ledger class")
    report = run_conformance(spec, workdir=tmp_path)
    assert report.ok, report.summary()


class NeverExpiringLedger(MemoryLedger):
    """A crashed learner's slots are never returned (peer bug 10)."""

    def expire_leases(self) -> list[LedgerEntry]:
        return []


def never_expiring(tmp_path: Path, clock: Clock, **options: Any) -> Ledger:
    """Factory for the broken ledger."""
    return NeverExpiringLedger(clock=clock, **options)


def test_kit_rejects_a_broken_ledger(tmp_path: Path) -> None:
    """A ledger whose leases never expire fails a protocol check and the race machine."""
    report = run_conformance(never_expiring, examples=100, workdir=tmp_path, shrink=False)
    assert not report.ok
    assert report.problems["recovery"], report.problems
    with pytest.raises(ConformanceFailure, match="does not conform"):
        report.raise_on_failure()
