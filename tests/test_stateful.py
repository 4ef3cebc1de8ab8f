"""The stateful machines under the active Hypothesis profile, the campaign runner's report,
and proof that a seeded race bug is caught, shrunk and saved as a replayable program."""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from rollout_lifecycle.model.ledger import Clock, Ledger, MemoryLedger, ReserveOutcome
from rollout_lifecycle.model.machines import ACTIVATION, LIFECYCLE
from rollout_lifecycle.model.records import AdmissionStamp
from rollout_lifecycle.spec.invariants import SOMETIMES
from rollout_lifecycle.stateful_tests.activation_machine import make_activation_machine
from rollout_lifecycle.stateful_tests.artifact_machine import make_artifact_machine
from rollout_lifecycle.stateful_tests.e2e_machine import make_e2e_machine
from rollout_lifecycle.stateful_tests.ledger_machine import INVARIANT_NAMES, make_ledger_machine
from rollout_lifecycle.stateful_tests.mutants import BY_NAME
from rollout_lifecycle.stateful_tests.runner import (
    MACHINES,
    README_EXAMPLES,
    README_SEED,
    program_steps,
    run_campaign,
)
from rollout_lifecycle.stateful_tests.seams_machine import make_seams_machine

# a known-long module: a larger limit than the suite's default (pyproject.toml)
pytestmark = pytest.mark.timeout(1200)


def _active() -> settings:
    """The loaded profile (conftest selects it)."""
    active = settings.default
    assert active is not None
    return active


def profile_settings(**overrides: Any) -> settings:
    """The active profile (CI: Hypothesis's derandomized `ci`) with campaign-friendly checks.

    Swarm testing aborts some examples (every runnable rule switched off), and SQLite steps
    are slow by design, so those two health checks would only report the search's shape.
    """
    return settings(
        _active(),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        **overrides,
    )


def test_ledger_machine_memory(tmp_path: Path) -> None:
    """Racing learners on the in-memory ledger satisfy the reference model and the spec."""
    run_state_machine_as_test(
        make_ledger_machine("memory", workdir=tmp_path), settings=profile_settings()
    )


# examples per durable backend: each step is real I/O (a PostgreSQL step is a few round
# trips to the server), so the durable runs are smaller than the memory ones
DURABLE_EXAMPLES = {"sqlite": 50, "postgresql": 30}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_ledger_machine_durable(backend: str, tmp_path: Path) -> None:
    """The same race machine on a SQLite file / a PostgreSQL schema, closed and reopened
    mid-run."""
    run_state_machine_as_test(
        make_ledger_machine(backend, workdir=tmp_path),
        settings=profile_settings(
            max_examples=min(_active().max_examples, DURABLE_EXAMPLES[backend])
        ),
    )


def test_activation_machine(tmp_path: Path) -> None:
    """Acks delivered, dropped, duplicated and delayed; restarts; corrupt loads."""
    run_state_machine_as_test(
        make_activation_machine("memory", workdir=tmp_path), settings=profile_settings()
    )


def test_e2e_machine(tmp_path: Path) -> None:
    """Generation, rewards, batch admission, updates and activation, with ghost truth."""
    run_state_machine_as_test(
        make_e2e_machine("memory", workdir=tmp_path), settings=profile_settings()
    )


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
def test_seams_machine(backend: str, tmp_path: Path) -> None:
    """The README composition: activation racing two learners, two coordinators, hostile
    clients; on SQLite every party has its own connection."""
    run_state_machine_as_test(
        make_seams_machine(backend, workdir=tmp_path),
        settings=profile_settings(max_examples=min(_active().max_examples, 50)),
    )


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
def test_artifact_machine(backend: str, tmp_path: Path) -> None:
    """Real artifacts written, damaged on disk, loaded and hashed by the real loader."""
    run_state_machine_as_test(
        make_artifact_machine(backend, workdir=tmp_path),
        settings=profile_settings(max_examples=min(_active().max_examples, 50)),
    )


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
@pytest.mark.parametrize("maker", [make_activation_machine, make_e2e_machine])
def test_registry_machines_durable(maker: Any, backend: str, tmp_path: Path) -> None:
    """Ledger and registry share one SQLite file / PostgreSQL schema (one trace); the
    coordinator restarts."""
    n = 25 if backend == "sqlite" else 15
    run_state_machine_as_test(
        maker(backend, workdir=tmp_path),
        settings=profile_settings(max_examples=min(_active().max_examples, n)),
    )


@pytest.mark.parametrize("backend", ["postgresql"])
def test_seams_machine_durable(backend: str, tmp_path: Path) -> None:
    """The composition machine with a connection per party on PostgreSQL (SQLite above)."""
    run_state_machine_as_test(
        make_seams_machine(backend, workdir=tmp_path),
        settings=profile_settings(max_examples=min(_active().max_examples, 10)),
    )


def test_readme_campaign_covers_everything(tmp_path: Path) -> None:
    """The README campaign's fuzz budget (runner.README_EXAMPLES / README_SEED) on memory:
    no violation, every declared edge, every sometimes-property (SQLite is checked by the
    campaign command's test)."""
    report = run_campaign(
        MACHINES, "memory", examples=README_EXAMPLES, seed=README_SEED, workdir=tmp_path
    )
    assert report.violations == 0, report.failure
    assert report.uncovered() == {"lifecycle": [], "activation": []}
    assert report.unreached() == []
    doc = json.loads(json.dumps(report.to_json()))
    for name, spec in (("lifecycle", LIFECYCLE), ("activation", ACTIVATION)):
        cov = doc["machines"][name]
        assert set(cov) == {"edges", "declared", "covered"}
        assert set(cov["edges"]) == {spec.edge_id(e) for e in spec.edges}
        assert cov["declared"] == cov["covered"] == len(spec.edges)
    assert set(doc["sometimes"]) == set(SOMETIMES)
    assert doc["invariants"]["declared_edges"] > 0
    assert {m: r["steps"] > 0 for m, r in doc["runs"].items()} == dict.fromkeys(MACHINES, True)


def test_campaign_is_deterministic_with_a_seed(tmp_path: Path) -> None:
    """The same seed gives the same steps, rules and coverage."""

    def run(sub: str) -> dict[str, Any]:
        doc = run_campaign(
            ["ledger", "activation"], "memory", examples=8, seed=7, workdir=tmp_path / sub
        ).to_json()
        return {
            "runs": {m: (r["steps"], r["rules"]) for m, r in doc["runs"].items()},
            "machines": doc["machines"],
            "sometimes": doc["sometimes"],
        }

    assert run("a") == run("b")


def test_stop_after_is_a_prefix_of_the_full_run(tmp_path: Path) -> None:
    """`stop_after=n` ends each machine after n examples of the run that `examples` would
    make (not a run with max_examples=n, which Hypothesis generates differently): every goal
    the full run first reached by example n is first reached at the same example."""

    def run(sub: str, stop: int | None) -> dict[str, Any]:
        doc = run_campaign(
            ["ledger", "activation"],
            "memory",
            examples=30,
            stop_after=stop,
            seed=7,
            workdir=tmp_path / sub,
        ).to_json()
        return doc["runs"]

    full, cut = run("full", None), run("cut", 8)
    for m in ("ledger", "activation"):
        assert cut[m]["examples"] == 8 and full[m]["examples"] >= 30
        early = {g: n for g, n in full[m]["first_reached"].items() if n <= 8}
        assert early and cut[m]["first_reached"] == early, m
    with pytest.raises(ValueError, match="stop_after"):
        run_campaign(["ledger"], "memory", examples=2, stop_after=0, workdir=tmp_path / "x")


def test_time_budget_runs_seeded_batches(tmp_path: Path) -> None:
    """A time budget runs batches with fresh seeds and reports the base seed it drew."""
    report = run_campaign(
        ["ledger"], "memory", examples=2, time_budget_s=1.0, steps=10, workdir=tmp_path
    )
    run = report.runs["ledger"]
    assert report.seed is not None and run.batches >= 1
    assert len(set(run.seeds)) == len(run.seeds) == run.batches


# ---- a deliberately broken ledger ------------------------------------------------------------


class BlindWriteLedger(MemoryLedger):
    """Availability judged on what the learner read, then an unconditional write (peer bug 1:
    two consumers take the same sample), for an update the ledger has not recorded yet (a
    recorded one, possibly poisoned, reserves through the real path). Admission is still
    respected, so only the race can expose it."""

    def reserve(
        self,
        rollout_id: str,
        expected_revision: int,
        update_id: str,
        admission: AdmissionStamp | None,
    ) -> ReserveOutcome:
        entry = self.find(rollout_id)
        if (
            entry is None
            or entry.state not in ("rewarded", "reserved")
            or entry.reserved_by == update_id
            or admission is None
            or not admission.accepted
            or self.update(update_id) is not None
        ):
            return super().reserve(rollout_id, expected_revision, update_id, admission)
        new = attrs.evolve(
            entry,
            state="reserved",
            revision=entry.revision + 1,
            reserved_by=update_id,
            admission=admission,
            lease_expires_at=self.clock() + self.lease_seconds,
        )
        self._record([("reserve", entry, new, update_id)])
        return ReserveOutcome(rollout_id, True, "reserved", new)


def blind_write_ledger(tmp_path: Path, clock: Clock, **options: Any) -> Ledger:
    """Factory for the broken ledger (module level, so the saved program can import it)."""
    return BlindWriteLedger(clock=clock, **options)


def test_blind_write_is_caught_shrunk_and_saved(tmp_path: Path) -> None:
    """The race machine catches a blind write; the shrunk program is short and replays."""
    report = run_campaign(["ledger"], blind_write_ledger, examples=200, seed=3, workdir=tmp_path)
    failure = report.failure
    assert failure is not None, "the blind-write ledger survived the race machine"
    assert failure.machine == "ledger"
    assert 1 <= failure.program_steps <= 8, failure.program
    assert failure.program_steps == program_steps(failure.program, INVARIANT_NAMES)
    saved = Path(failure.program_path)
    assert saved.is_file() and saved.parent == tmp_path / "failures"
    assert saved.read_text() == failure.program
    assert "state.cas(" in failure.program or "state.advance()" in failure.program
    with pytest.raises(AssertionError):
        runpy.run_path(str(saved), run_name="__main__")


def test_fast_minimiser_without_hypothesis_shrinking(tmp_path: Path) -> None:
    """shrink=False skips Hypothesis's shrinker; replay minimisation alone keeps it short."""
    report = run_campaign(
        ["ledger"], blind_write_ledger, examples=200, seed=0, workdir=tmp_path, shrink=False
    )
    assert report.failure is not None
    assert report.failure.program_steps <= 8, report.failure.program


def test_mutant_is_entered_and_named(tmp_path: Path) -> None:
    """`mutant=` wraps the run: version stamped at completion is caught by the ghost."""
    name = "version_stamped_at_completion"
    report = run_campaign(
        ["e2e"],
        "memory",
        examples=60,
        seed=0,
        workdir=tmp_path,
        mutant=BY_NAME[name](),
        mutant_name=name,
        shrink=False,
    )
    failure = report.failure
    assert failure is not None and "generated by the weights" in failure.exception
    assert report.runs["e2e"].examples_until_failure is not None
    assert f"with BY_NAME[{name!r}]():" in failure.program
    assert report.to_json()["mutant"] == name
