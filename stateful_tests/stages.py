"""The campaign's targeted stages: each one a path the fuzzers and the timed race never take.

A stage is self-contained: it builds its own fresh state on the campaign's backend, runs
the real code through one scenario, judges it (the spec on the recorded trace, plus what
the scenario knows must hold), and reports. They are registered here, in one place, so
the campaign, its profiles and the mutation runner pick them by name:

* `verl-v1`: verl's v1 replay buffer (`gpu_check.verl_v1.LedgerReplayBuffer`) on a real,
  in-process TransferQueue: steps, eviction with refill, a failed group, a trainer that
  dies mid-step and a resumed one that redoes it (stateful_tests/verl_v1_stage.py);
* `clock-skew`: clients whose clocks run minutes ahead of and behind the PostgreSQL
  server's (libfaketime child processes, and clients with an injected clock that only
  dates their events), through single and batch reservations, renewals and expiries
  (stateful_tests/skew.py);
* `premise-window`: on PostgreSQL, a pause injected into a test build of the reservation's
  write, between its premise check and its compare-and-set, while a pointer switch tries
  to commit: a dropped premise lock is caught every run, not by luck
  (stateful_tests/windows.py);
* `faults`: the README pattern raced with SIGKILLs of learners and activators, lost
  leases, rollbacks and careless lineages, judged from the durable trace
  (stateful_tests/fault_race.py).

A stage that cannot run (an extra not installed, a backend it does not apply to) reports
`skipped` with the reason and what to do; a skip is never a pass of a stage that ran.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from rollout_lifecycle.stateful_tests.backends import is_postgres

SCHEMA = "rollout-lifecycle/stage-report/1"


@attrs.frozen
class StageContext:
    """Where and how a stage runs: the campaign's backend ('memory', 'sqlite' or a
    postgresql:// URL), a work directory of its own, the seed, and a catalogue mutant
    (by name) that the stage enters around its work and hands to its child processes."""

    backend: str
    workdir: Path
    seed: int = 0
    mutant: str | None = None
    progress: Callable[[str], None] | None = None

    def say(self, text: str) -> None:
        """A progress line (none without a progress callback)."""
        if self.progress is not None:
            self.progress(text)


@attrs.frozen
class StageReport:
    """What one stage did: `failures` are violations (empty: it passed), `skipped` says why
    it did not run, `facts` what it exercised."""

    stage: str
    backend: str
    ran: bool
    failures: tuple[str, ...] = ()
    skipped: str | None = None
    seconds: float = 0.0
    facts: dict[str, Any] = attrs.field(factory=dict)

    @property
    def ok(self) -> bool:
        """Ran (or was skipped) without a violation."""
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict."""
        return {
            "schema": SCHEMA,
            "stage": self.stage,
            "backend": self.backend,
            "ran": self.ran,
            "skipped": self.skipped,
            "failures": list(self.failures),
            "seconds": round(self.seconds, 2),
            "facts": dict(self.facts),
        }


StageFn = Callable[[StageContext], StageReport]


@attrs.frozen
class Stage:
    """A registered stage: what it checks, where it applies, the profiles it belongs in
    (a suggestion the campaign's profiles read), and its entry point (`module:function`,
    imported only when the stage runs: its extras may be missing)."""

    name: str
    what: str
    backends: tuple[str, ...]  # of 'memory', 'sqlite', 'postgresql'
    profiles: tuple[str, ...]
    entry: str
    seconds_hint: str
    # modules of an optional extra the stage imports, and how to install them: a profile
    # that requires every stage (ci) refuses to start without them, before writing anything
    needs: tuple[str, ...] = ()
    install: str = ""

    def applies_to(self, backend: str) -> bool:
        """Whether the stage runs on this backend."""
        return backend_kind(backend) in self.backends

    def missing(self) -> str | None:
        """The first module the stage needs that is not installed (None: all are)."""
        import importlib.util

        for module in self.needs:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                return module
        return None

    def load(self) -> StageFn:
        """The stage's function."""
        import importlib

        module, _, fn = self.entry.partition(":")
        run: StageFn = getattr(importlib.import_module(module), fn)
        return run


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage(
            "verl-v1",
            "verl's v1 replay buffer on a real in-process TransferQueue: steps, stale eviction "
            "with refill, a failed group, a trainer killed mid-step and a resumed one that "
            "redoes the step; the spec judges the ledger's trace",
            ("memory", "sqlite", "postgresql"),
            ("thorough", "ci"),
            "rollout_lifecycle.stateful_tests.verl_v1_stage:run_verl_v1_stage",
            "about 30-60 s (Ray and TransferQueue start-up dominate)",
            needs=("ray", "transfer_queue", "verl", "torch", "omegaconf"),
            install="install the [verl-v1] extra: pip install torch==2.13.0 (or your CUDA "
            "build) first, then pip install -e '.[verl-v1]'",
        ),
        Stage(
            "clock-skew",
            "clients 5 minutes ahead of and behind the PostgreSQL server's clock (faketime "
            "processes, and clients whose injected clock only dates events) reserve one "
            "rollout and batches, renew, and expire: every deadline is the server's",
            ("postgresql",),
            ("default", "thorough", "ci"),
            "rollout_lifecycle.stateful_tests.skew:run_skew_stage",
            "about 10-20 s",
        ),
        Stage(
            "premise-window",
            "a pause injected between a reservation's premise check and its write (test "
            "build) while a pointer switch tries to commit, on PostgreSQL: the premise lock "
            "must hold the switch back, every run",
            ("postgresql",),
            ("default", "thorough", "ci"),
            "rollout_lifecycle.stateful_tests.windows:run_window_stage",
            "about 5-10 s",
        ),
        Stage(
            "faults",
            "the README pattern in separate processes with SIGKILLed learners and "
            "activators, leases lost mid-update, rollbacks and careless lineages: no rollout "
            "in two published updates, none stale, none lost, no attempt left past its ack "
            "deadline (stateful_tests/fault_race.py)",
            ("sqlite", "postgresql"),
            ("default", "thorough", "ci"),
            "rollout_lifecycle.stateful_tests.fault_race:run_fault_stage",
            "about 20-25 s",
        ),
    )
}


def backend_kind(backend: str) -> str:
    """'memory', 'sqlite' or 'postgresql' for a campaign backend name or URL."""
    if is_postgres(backend):
        return "postgresql"
    if backend.startswith("sqlite"):
        return "sqlite"
    return backend.split("://")[0]


@contextlib.contextmanager
def entered(mutant: str | None) -> Iterator[None]:
    """The named catalogue mutant, entered in this process (nothing without one)."""
    if mutant is None:
        yield
        return
    from rollout_lifecycle.stateful_tests.mutants import BY_NAME

    with BY_NAME[mutant]():
        yield


def run_stage(name: str, ctx: StageContext) -> StageReport:
    """Run one registered stage (skipped, saying why, where it does not apply); a stage
    that crashes reports the crash as its failure, never as a pass."""
    stage = STAGES[name]
    if not stage.applies_to(ctx.backend):
        where = ", ".join(stage.backends)
        return StageReport(
            name,
            ctx.backend,
            ran=False,
            skipped=f"runs on {where} only (this campaign's backend is "
            f"{backend_kind(ctx.backend)}; --backend postgresql://... runs it)",
        )
    ctx.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        report = stage.load()(ctx)
    except ImportError as exc:
        report = StageReport(name, ctx.backend, ran=False, skipped=f"cannot import it: {exc}")
    except Exception as exc:  # a crash inside the stage is a finding, not a pass
        report = StageReport(name, ctx.backend, ran=True, failures=(f"crashed: {exc!r}",))
    return attrs.evolve(report, seconds=time.perf_counter() - t0)


__all__ = [
    "STAGES",
    "Stage",
    "StageContext",
    "StageReport",
    "backend_kind",
    "entered",
    "run_stage",
]
