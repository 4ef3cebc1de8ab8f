"""Kill the mutation catalogue: each mutant against the fuzzer and against the explorer.

A mutant is killed when the checker reports a failure while the mutant is active: a spec
invariant, the reference model, or a ghost check. The fuzzer runs the mutant's machine with
a fixed seed (deterministic, so "examples until the kill" is a repeatable figure); the
explorer runs the mutant's model at CI bounds (so "states until the kill" is too).
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from rollout_lifecycle.spec.bounds import CI_MODELS, EXPLORER_MODELS
from rollout_lifecycle.spec.explorer import explore
from rollout_lifecycle.stateful_tests.backends import durable_url
from rollout_lifecycle.stateful_tests.campaign_profiles import (
    DEFAULT_PROFILE,
    PROFILES,
    CampaignProfile,
)
from rollout_lifecycle.stateful_tests.checkers import CaseFailure, run_checker_checks
from rollout_lifecycle.stateful_tests.interleavings import run_interleavings
from rollout_lifecycle.stateful_tests.mutants import CATALOGUE, Mutant
from rollout_lifecycle.stateful_tests.race import RaceConfig, run_race
from rollout_lifecycle.stateful_tests.runner import (
    MACHINES as FUZZ_MACHINES,
)
from rollout_lifecycle.stateful_tests.runner import (
    README_BACKEND,
    run_campaign,
)
from rollout_lifecycle.stateful_tests.stages import STAGES, StageContext, run_stage


@attrs.frozen
class Kill:
    """One checker's verdict on one mutant; `killed` is None when its bounds cannot reach it."""

    checker: str
    killed: bool | None
    effort: int | None
    unit: str
    seconds: float
    detail: str = ""
    # the campaign's stage that killed it ("checkers", "interleavings", "adapter", "race",
    # "verl-v1", "fuzz e2e", "explore seams"); None for the other checkers and a survivor
    stage: str | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict."""
        return attrs.asdict(self)


@attrs.frozen
class MutantResult:
    """Both verdicts on one mutant."""

    name: str
    description: str
    peer_bug: int | None
    fuzz: Kill
    explore: Kill
    campaign: Kill = Kill("campaign", None, None, "examples", 0.0, "not run")
    klass: str = "protocol"

    @property
    def kills(self) -> tuple[Kill, Kill, Kill]:
        """The three verdicts: fuzzer, explorer, the README campaign."""
        return (self.fuzz, self.explore, self.campaign)

    @property
    def killed_by(self) -> tuple[str, ...]:
        """Checkers that killed it."""
        return tuple(k.checker for k in self.kills if k.killed)

    @property
    def survived(self) -> bool:
        """True when a checker that reaches the mutant (the campaign reaches all) missed it."""
        return any(k.killed is False for k in self.kills)

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict."""
        return {
            "name": self.name,
            "class": self.klass,
            "description": self.description,
            "peer_bug": self.peer_bug,
            "killed_by": list(self.killed_by),
            "killed_by_stage": self.campaign.stage,
            "fuzz": self.fuzz.to_json(),
            "explore": self.explore.to_json(),
            "campaign": self.campaign.to_json(),
        }


def _first_line(text: str) -> str:
    """The failure's headline (Hypothesis appends its explanation after it)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[0][:300] if lines else ""


def fuzz_kill(
    mutant: Mutant,
    *,
    workdir: Path,
    seed: int = 0,
    max_examples: int = 300,
    steps: int | None = None,
    profile: str = "ci",
    backend: str = "memory",
) -> Kill:
    """Run the mutant's machine with a fixed seed until the first failure or the cap."""
    if "fuzz" not in mutant.reach:
        return Kill("fuzz", None, None, "examples", 0.0, "outside the fuzzer's machines")
    t0 = time.perf_counter()
    report = run_campaign(
        [mutant.fuzz_machine],
        backend,
        examples=max_examples,
        seed=seed,
        profile=profile,
        steps=steps,
        workdir=workdir,
        mutant=mutant(),
        mutant_name=mutant.name,
        shrink=False,  # the replay minimiser still yields a short program, in a second
    )
    run = report.runs[mutant.fuzz_machine]
    seconds = time.perf_counter() - t0
    if run.failure is None:
        return Kill(
            "fuzz",
            False,
            run.examples,
            "examples",
            seconds,
            f"survived {run.examples} examples of {mutant.fuzz_machine}",
        )
    return Kill(
        "fuzz",
        True,
        run.examples_until_failure,
        "examples",
        seconds,
        _first_line(run.failure.exception),
    )


def explore_kill(
    mutant: Mutant, *, readme_bounds: bool = False, max_states: int | None = None
) -> Kill:
    """Explore the mutant's model (CI bounds by default) until the first violation."""
    if "explore" not in mutant.reach:
        return Kill("explore", None, None, "states", 0.0, "not in the explorer's abstraction")
    name = mutant.explorer_model if readme_bounds else CI_MODELS[mutant.explorer_model]
    t0 = time.perf_counter()
    with mutant():
        model = EXPLORER_MODELS[name][0]()
        res = explore(model, max_states=max_states)
    seconds = time.perf_counter() - t0
    if not res.violations:
        return Kill(
            "explore",
            False,
            res.distinct_states,
            "states",
            seconds,
            f"no violation in {res.distinct_states} states of {name}",
        )
    cex = res.violations[0]
    detail = f"{cex.property_name} after {len(cex.actions)} steps ({name})"
    return Kill("explore", True, res.distinct_states, "states", seconds, detail)


def _stage_kill(stage: str, effort: int, unit: str, t0: float, detail: str) -> Kill:
    seconds = time.perf_counter() - t0
    return Kill("campaign", True, effort, unit, seconds, f"{stage}: {detail}", stage)


def checker_verdicts(failures: Sequence[CaseFailure]) -> tuple[list[CaseFailure], list[str]]:
    """The checker stage's failures split into verdicts and crashes.

    A case that only crashed is no checker's verdict: the patch itself raised (a TypeError
    of a stale target), or a known-good history's builder stopped on its own assertion when
    the mutated write path misbehaved. Neither says a checker caught the bug, so a crash
    kills nothing and the later stages must."""
    verdicts, crashes = [], []
    for f in failures:
        if f.got and all(g.startswith("crashed: ") for g in f.got):
            crashes.append(str(f))
        else:
            verdicts.append(f)
    return verdicts, crashes


def campaign_kill(
    mutant: Mutant,
    *,
    workdir: Path,
    postgres_url: str | None = None,
    profile: CampaignProfile | str = DEFAULT_PROFILE,
) -> Kill:
    """Whether the campaign at `profile` (the fast default of `make campaign`, unless told
    otherwise), with that profile's budgets, kills the mutant; `Kill.stage` names the stage.

    Its stages run cheapest first, the first that fails kills it: the checker stage
    (known-bad histories, the differential of rules and spec); the scripted interleavings
    of two connections (on the mutant's durable backend); the verl adapter fuzz (when verl
    is installed); the race (real processes, each patched, on the mutant's backend: SQLite,
    or a fresh schema on `postgres_url` for PostgreSQL code); the targeted stages of
    stateful_tests/stages.py that both the profile runs and the mutant names in its reach
    (verl-v1 in thorough and ci; clock-skew, premise-window in every profile, on PostgreSQL
    only); the fuzz stage (every machine at the profile's examples and seed, on the
    mutant's backend, its own machine leading); the explore stage (the profile's models,
    the mutant's own family first). A checker case that only crashed kills nothing
    (`checker_verdicts`). A mutant of PostgreSQL code without a server, or of code whose
    extra is not installed, is not reached (None), never counted as killed; a mutant of the
    memory store runs its campaign on memory.
    """
    prof = PROFILES[profile] if isinstance(profile, str) else profile
    t0 = time.perf_counter()
    backend = "memory" if mutant.backend == "memory" else README_BACKEND
    if mutant.needs is not None and importlib.util.find_spec(mutant.needs) is None:
        return Kill(
            "campaign",
            None,
            None,
            "examples",
            0.0,
            f"needs {mutant.needs} (an extra not installed)",
        )
    only = [n for n in mutant.reach if n in STAGES]
    if only and only == list(mutant.reach) and not set(only) & set(prof.stages):
        # its code runs only in targeted stages this profile leaves out: not reached
        runs_in = sorted({p for n in only for p in PROFILES if n in PROFILES[p].stages})
        return Kill(
            "campaign",
            None,
            None,
            "examples",
            0.0,
            f"only the {', '.join(only)} stage reaches it, which the {prof.name} profile "
            f"does not run (--profile {' or '.join(runs_in) or 'none'} runs it)",
        )
    if mutant.backend == "postgresql":
        if postgres_url is None:
            return Kill(
                "campaign",
                None,
                None,
                "examples",
                0.0,
                "needs a PostgreSQL server (--postgres URL)",
            )
        backend = postgres_url
    with mutant():
        checked = run_checker_checks(seed=prof.seed)
    verdicts, crashes = checker_verdicts(checked.failures)
    if verdicts:
        n = checked.bad_cases + checked.good_cases
        return _stage_kill("checkers", n, "cases", t0, str(verdicts[0]))
    if backend != "memory":  # two connections need a durable store, as in the campaign
        with mutant():  # the scripted interleavings run in this process, on the backend
            scripted = run_interleavings(backend, workdir / "interleavings")
        wrong = [p for problems in scripted.values() for p in problems]
        if wrong:
            return _stage_kill("interleavings", len(scripted), "scenarios", t0, wrong[0])
    adapter = _adapter_fuzz()
    if adapter is not None:
        with mutant():
            rep = adapter(seed=prof.seed, examples=prof.adapter_examples)
        if rep["failures"]:
            return _stage_kill("adapter", rep["batches"], "batches", t0, rep["failures"][0])
    if "race" in mutant.reach and prof.race_seconds > 0 and backend != "memory":
        # the patch is entered in each child
        race_dir = workdir / "race"
        race_dir.mkdir(parents=True, exist_ok=True)
        for old in race_dir.glob("state.db*"):
            old.unlink()
        raced = run_race(
            RaceConfig(
                url=durable_url(backend, race_dir),
                learners=3,
                seconds=prof.race_seconds,
                seed=prof.seed,
                hostile=1,
                churn=True,
                mutant=mutant.name,
            )
        )
        if raced.violations or raced.errors:
            first = raced.violations[0] if raced.violations else raced.errors[0]
            return _stage_kill("race", raced.calls, "calls", t0, str(first))
    for name in prof.stages:  # the profile's targeted stages this mutant's code is on
        if name not in mutant.reach or not STAGES[name].applies_to(backend):
            continue
        staged = run_stage(name, StageContext(backend, workdir / name, prof.seed, mutant.name))
        if staged.failures:
            return _stage_kill(name, 1, "runs", t0, staged.failures[0])
    order = [mutant.fuzz_machine, *(m for m in FUZZ_MACHINES if m != mutant.fuzz_machine)]
    examples = 0
    for machine in order:
        report = run_campaign(
            [machine],
            backend,
            examples=prof.max_examples,
            stop_after=prof.examples[machine] if prof.cut else None,
            seed=prof.seed,
            profile=prof.hypothesis,
            steps=prof.steps,
            workdir=workdir / machine,
            mutant=mutant(),
            mutant_name=mutant.name,
            shrink=False,
        )
        run = report.runs[machine]
        examples += run.examples
        if run.failure is not None:
            detail = _first_line(run.failure.exception)
            return _stage_kill(f"fuzz {machine}", examples, "examples", t0, detail)
    own = {mutant.explorer_model, CI_MODELS.get(mutant.explorer_model, "")}
    models = [
        *(m for m in prof.models if m in own or m.startswith(f"{mutant.explorer_model}-")),
        *prof.models,
    ]
    states = 0
    for name in dict.fromkeys(models):
        with mutant():
            res = explore(EXPLORER_MODELS[name][0]())
        states += res.distinct_states
        if res.violations:
            prop = res.violations[0].property_name
            return _stage_kill(f"explore {name}", states, "states", t0, prop)
    return Kill(
        "campaign",
        False,
        examples,
        "examples",
        time.perf_counter() - t0,
        f"survived the {prof.name} campaign's checkers, fuzz ({examples} examples) and "
        f"explorer ({states} states)"
        + (f"; the checker stage only crashed ({len(crashes)}): {crashes[0]}" if crashes else ""),
    )


def _adapter_fuzz() -> Callable[..., dict[str, Any]] | None:
    """The adapter stage's entry point, or None without the [verl] extra."""
    try:
        from rollout_lifecycle.stateful_tests.adapter_fuzz import run_adapter_fuzz
    except ImportError:
        return None
    return run_adapter_fuzz


def run_catalogue(
    mutants: Sequence[Mutant] = CATALOGUE,
    *,
    fuzz: bool = True,
    explorer: bool = True,
    seed: int = 0,
    max_examples: int = 300,
    workdir: Path | None = None,
    on_result: Callable[[MutantResult], None] | None = None,
    campaign: bool = False,
    postgres_url: str | None = None,
    profile: CampaignProfile | str = DEFAULT_PROFILE,
) -> list[MutantResult]:
    """Every mutant against the chosen checkers, in catalogue order."""
    out = []
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        base = Path(workdir) if workdir is not None else Path(tmp)
        for m in mutants:
            fz = (
                fuzz_kill(m, workdir=base / m.name, seed=seed, max_examples=max_examples)
                if fuzz
                else Kill("fuzz", None, None, "examples", 0.0, "not run")
            )
            ex = (
                explore_kill(m)
                if explorer
                else Kill("explore", None, None, "states", 0.0, "not run")
            )
            cp = (
                campaign_kill(
                    m,
                    workdir=base / m.name / "campaign",
                    postgres_url=postgres_url,
                    profile=profile,
                )
                if campaign
                else Kill("campaign", None, None, "examples", 0.0, "not run")
            )
            res = MutantResult(m.name, m.description, m.peer_bug, fz, ex, cp, m.klass)
            if on_result is not None:
                on_result(res)
            out.append(res)
    return out


def summary(results: Sequence[MutantResult]) -> dict[str, Any]:
    """Kill rate and median time to kill, per checker."""
    out: dict[str, Any] = {"mutants": len(results)}
    for checker in ("fuzz", "explore", "campaign"):
        kills = [getattr(r, checker) for r in results]
        reached = [k for k in kills if k.killed is not None]
        killed = [k for k in reached if k.killed]
        out[checker] = {
            "reached": len(reached),
            "killed": len(killed),
            "median_seconds_to_kill": round(statistics.median(k.seconds for k in killed), 3)
            if killed
            else None,
            "median_effort_to_kill": statistics.median(k.effort or 0 for k in killed)
            if killed
            else None,
        }
    out["survivors"] = [r.name for r in results if r.survived]
    by_class: dict[str, dict[str, int]] = {}
    for r in results:
        row = by_class.setdefault(
            r.klass, {"mutants": 0, "campaign_reached": 0, "campaign_killed": 0}
        )
        row["mutants"] += 1
        row["campaign_reached"] += r.campaign.killed is not None
        row["campaign_killed"] += bool(r.campaign.killed)
    out["by_class"] = by_class
    out["killed_by_any"] = sum(1 for r in results if r.killed_by)
    stages: dict[str, int] = {}
    for r in results:
        if r.campaign.killed:
            stage = r.campaign.stage.split()[0] if r.campaign.stage else "?"
            stages[stage] = stages.get(stage, 0) + 1
    out["campaign_kills_by_stage"] = dict(sorted(stages.items()))
    return out
