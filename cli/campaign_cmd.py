"""`campaign`: the main job: check the checkers, fuzz, explore, race, report.

Stages, in order: every checker shown its known-bad and known-good histories and the
enforcing rules compared with the spec (stateful_tests/checkers.py, seconds); the verl
adapter fuzzed against the reference gate (when verl is installed; a skip is said loudly);
the stateful machines on the chosen backend (SQLite by default: the embedded default a user
runs without a server; a postgresql:// URL runs them on that server); the explorer;
scripted interleavings of two connections on the same backend, each answer judged at the
instant of its step (stateful_tests/interleavings.py); real processes racing on the same
backend (SQLite file, or a fresh PostgreSQL schema), every call recorded and the whole
history checked for linearizability; the profile's targeted stages of
stateful_tests/stages.py (on PostgreSQL, clients with skewed clocks and the premise lock's
window held open; in `thorough` and `ci`, verl's v1 buffer on a real TransferQueue). How
much each stage runs is the profile's (stateful_tests/campaign_profiles.py): `fast` by
default, a verdict in about five minutes on 2 cores; `thorough` the README's first budget;
`ci` the fast budget with every stage required. A progress line per stage gives its ETA.

It writes into `--out` the reports, the merged coverage JSON (the format
`rollout-lifecycle diagram --coverage` reads), the race's call history, and
coverage-annotated diagrams. Exit 1 on any violation; exit 5 when nothing was violated but
a coverage goal was missed (the report names the budget that reaches it); exit 3 when the
backend or the disk failed (not a finding: the campaign stops before the next stage, no
program is saved), or when the `ci` profile lacks what a stage needs. Every option is
checked before anything is written.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from rollout_lifecycle.cli.exitcodes import TechnicalError, findings, missed_goals
from rollout_lifecycle.cli.explore_cmd import explore_models, print_explore_report
from rollout_lifecycle.cli.fuzz_cmd import (
    checked_backend,
    print_fuzz_report,
    sqlite_url_note,
    stopped,
)
from rollout_lifecycle.cli.output import (
    Progress,
    check_report_path,
    emit_report,
    ensure_dir,
    make_console,
    quiet_option,
    report_options,
    write_json_atomic,
)
from rollout_lifecycle.cli.params import COUNT, SEED, FiniteFloat
from rollout_lifecycle.model.atomic import atomic_write
from rollout_lifecycle.model.machines import MACHINES
from rollout_lifecycle.spec.bounds import EXPLORER_MODELS
from rollout_lifecycle.spec.coverage import merge_coverage, uncovered
from rollout_lifecycle.spec.diagrams import DiagramError, render
from rollout_lifecycle.spec.explorer import ExploreProgress
from rollout_lifecycle.stateful_tests.backends import DB_NAME, durable_url, is_postgres
from rollout_lifecycle.stateful_tests.campaign_profiles import (
    DEFAULT_PROFILE,
    MODEL_STATES,
    PROFILES,
    CampaignProfile,
    load_first_reached,
)
from rollout_lifecycle.stateful_tests.checkers import run_checker_checks
from rollout_lifecycle.stateful_tests.infrastructure import (
    InfrastructureFailure,
    infrastructure_cause,
)
from rollout_lifecycle.stateful_tests.interleavings import run_interleavings
from rollout_lifecycle.stateful_tests.race import RaceConfig, lin_line, run_race
from rollout_lifecycle.stateful_tests.runner import MACHINES as FUZZ_MACHINES
from rollout_lifecycle.stateful_tests.runner import (
    README_SEED,
    ProgressEvent,
    run_campaign,
)
from rollout_lifecycle.stateful_tests.stages import STAGES, StageContext, backend_kind
from rollout_lifecycle.stateful_tests.stages import run_stage as run_targeted

SCHEMA = "rollout-lifecycle/campaign-report/2"
ADAPTER_HINT = (
    "install the [verl] extra: `make setup-dev`, or pip install torch==2.13.0 (or your CUDA "
    "build) first, then pip install -e '.[verl]'"
)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that have ended."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def fmt_s(seconds: float) -> str:
    """`42 s`, `3 min 05 s`: durations as the progress lines and the report say them."""
    s = max(0, round(seconds))
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60:02d} s"


class StageClock:
    """One progress line per stage: which stage of how many, what it has done, and the
    ETA of the stage and of the campaign. The ETAs start from the profile's reference
    seconds (measured on 2 cores at load below 2) scaled by how fast the stages done so
    far went against theirs, and, inside a stage that knows its fraction done, from it."""

    def __init__(
        self,
        plan: list[tuple[str, float]],
        *,
        quiet: bool,
        fixed: dict[str, float] | None = None,
    ) -> None:
        self.plan = plan
        # seconds of a stage that the machine's speed does not change (the race's clock)
        self.fixed = fixed or {}
        self.quiet = quiet
        self.started = time.monotonic()
        self.spent = 0.0  # actual seconds of the stages done
        self.expected_done = 0.0  # their reference seconds
        self.index = -1
        self.t0 = 0.0
        self.line: Progress | None = None
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}  # this process and its finished children
        self.cpu0 = 0.0

    def speed(self) -> float:
        """Actual over reference seconds so far (1 until stages worth 10 s are done: the
        first second-long stages say little about the machine)."""
        if self.expected_done < 10.0:
            return 1.0
        return min(20.0, max(0.25, self.spent / self.expected_done))

    def scaled(self, stage: str, seconds: float) -> float:
        """A stage's reference seconds at this run's speed (its fixed part unscaled)."""
        fixed = min(seconds, self.fixed.get(stage, 0.0))
        return fixed + self.speed() * (seconds - fixed)

    def later_s(self) -> float:
        """Seconds the stages after the current one should take at this speed."""
        return sum(self.scaled(n, s) for n, s in self.plan[self.index + 1 :])

    def start(self, stage: str) -> None:
        """A stage begins: says so at once, with the campaign's ETA."""
        self.index = next(i for i, (n, _s) in enumerate(self.plan) if n == stage)
        self.t0 = time.monotonic()
        self.cpu0 = cpu_seconds()
        self.line = Progress(
            f"campaign [{self.index + 1}/{len(self.plan)}] {stage}", quiet=self.quiet
        )
        expected = self.scaled(stage, self.plan[self.index][1])
        eta = fmt_s(expected + self.later_s())
        self.line(f"started; about {fmt_s(expected)}, campaign ETA {eta}")

    def tick(self, text: str, fraction: float | None = None) -> None:
        """Progress inside the stage (`fraction` done, when the stage knows it)."""
        if self.line is None:
            return
        elapsed = time.monotonic() - self.t0
        if fraction is not None and fraction > 0.02:
            left = elapsed * (1.0 - min(fraction, 0.99)) / min(fraction, 0.99)
        else:
            name, seconds = self.plan[self.index]
            left = max(0.0, self.scaled(name, seconds) - elapsed)
        self.line(f"{text}; stage ETA {fmt_s(left)}, campaign ETA {fmt_s(left + self.later_s())}")

    def done(self, text: str) -> None:
        """The stage ended: its time, and what it found, on one line."""
        elapsed = time.monotonic() - self.t0
        name, expected = self.plan[self.index]
        self.seconds[name] = round(elapsed, 1)
        self.cpu_seconds[name] = round(cpu_seconds() - self.cpu0, 1)
        fixed = min(expected, self.fixed.get(name, 0.0))
        self.spent += max(0.0, elapsed - fixed)
        self.expected_done += expected - fixed
        if self.line is not None:
            self.line(f"done in {fmt_s(elapsed)}: {text}", True)
        self.line = None

    def not_started(self) -> list[str]:
        """The stages after the current one."""
        return [n for n, _s in self.plan[self.index + 1 :]]


def adapter_entry() -> tuple[Callable[..., dict[str, Any]] | None, str]:
    """The adapter stage's entry point, or None and why (the [verl] extra is missing)."""
    try:
        from rollout_lifecycle.stateful_tests.adapter_fuzz import run_adapter_fuzz
    except ImportError as exc:
        return None, str(exc)
    return run_adapter_fuzz, ""


@click.command("campaign")
@click.option(
    "--profile",
    "profile_name",
    type=click.Choice(sorted(PROFILES)),
    default=DEFAULT_PROFILE,
    show_default=True,
    help="How much each stage runs: fast (a verdict in about 5 minutes on 2 cores), "
    "thorough (the README's first budget, about 20 minutes idle), ci (the fast budget, "
    "every stage required: a missing extra is exit 3, not a skip). "
    "See docs/campaign.md.",
)
@click.option(
    "--backend",
    default="sqlite",
    show_default=True,
    help="Backend for the fuzz machines and the race: sqlite (or a sqlite:///PATH URL; "
    "the machines and the race still make fresh files under --out), memory, or a "
    "postgresql:// URL (each machine instance gets a fresh schema on that server).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("campaign-out"),
    show_default=True,
    help="Where reports, coverage JSON, diagrams and ledger files go.",
)
@click.option(
    "--examples",
    type=COUNT,
    default=None,
    help="Fuzz examples on every machine [default: the profile's, per machine]; the first "
    "N of the thorough profile's sequence, so first_reached.json's example numbers hold.",
)
@click.option(
    "--seed", type=SEED, default=None, help=f"Fuzz and race seed [default: {README_SEED}]."
)
@click.option(
    "--model",
    "models",
    multiple=True,
    type=click.Choice(sorted(EXPLORER_MODELS)),
    help="Explorer model(s) (repeatable) [default: the profile's].",
)
@click.option("--no-explore", is_flag=True, help="Skip the explorer stage.")
@click.option(
    "--race-seconds",
    type=FiniteFloat(0.0, 3600.0),
    default=None,
    help="Real processes racing on the campaign's backend (1 activator that also rolls back "
    "and churns the worker set, 3 learners, one of them misconfigured), each with its own "
    "connection, every call judged; 0 skips [default: the profile's, 20].",
)
@click.option(
    "--stage",
    "stages",
    multiple=True,
    type=click.Choice([*STAGES, "none"]),
    help="Targeted stages after the race (repeatable): "
    + "; ".join(f"{s.name}: {s.seconds_hint}, on {'/'.join(s.backends)}" for s in STAGES.values())
    + ". Default: the profile's (fast: clock-skew and premise-window; thorough and ci: all "
    "three), those that run on the campaign's backend; 'none' skips them.",
)
@report_options
@quiet_option
def campaign(
    profile_name: str,
    backend: str,
    out_dir: Path,
    examples: int | None,
    seed: int | None,
    models: tuple[str, ...],
    no_explore: bool,
    race_seconds: float | None,
    stages: tuple[str, ...],
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """Check the checkers, fuzz, explore and race; report; write coverage JSON and diagrams.

    Exit 1 on a violation; 5 when nothing was violated but a coverage goal was missed; 3
    when the backend or the disk failed (not a finding).
    """
    started = time.monotonic()
    load_before = _loadavg()
    profile = PROFILES[profile_name]
    check_report_path(report_path)
    # everything is checked before anything is written: a bad option writes nothing
    name = checked_backend(backend)
    seed = profile.seed if seed is None else seed
    budget = dict.fromkeys(FUZZ_MACHINES, examples) if examples else dict(profile.examples)
    chosen_models = () if no_explore else (tuple(models) or profile.models)
    race_s = profile.race_seconds if race_seconds is None else race_seconds
    durable = name == "sqlite" or is_postgres(name)
    # the targeted stages asked for (--stage, else the profile's); those of another backend
    # are said, and left out
    asked = () if "none" in stages else tuple(dict.fromkeys(stages or profile.stages))
    targeted = [n for n in asked if STAGES[n].applies_to(name)]
    elsewhere = {
        n: f"runs on {'/'.join(STAGES[n].backends)} only; --backend postgresql://... runs it"
        for n in asked
        if n not in targeted
    }
    adapter, adapter_missing = adapter_entry()
    if adapter is None and profile.strict:
        raise TechnicalError(
            f"the {profile.name} profile runs every stage, and the adapter stage cannot "
            f"run ({adapter_missing}): {ADAPTER_HINT}"
        )
    lacking = {n: m for n in targeted if (m := STAGES[n].missing()) is not None}
    if lacking and profile.strict:
        n, module = next(iter(lacking.items()))
        raise TechnicalError(
            f"the {profile.name} profile runs every stage, and the {n} stage cannot run "
            f"(no module named {module!r}): {STAGES[n].install}"
        )
    ensure_dir(out_dir, "--out")
    console = make_console(quiet=as_json)
    show = not quiet
    skipped: dict[str, str] = {}
    if adapter is None:
        skipped["adapter"] = f"{adapter_missing}; {ADAPTER_HINT}"
    if race_s > 0 and name == "memory":
        skipped["race"] = (
            "memory:// lives in one process; the race needs state shared by processes "
            "(--backend sqlite or a postgresql:// URL)"
        )
    elif race_s > 0 and name != "sqlite" and not is_postgres(name):
        skipped["race"] = (
            f"{name} is a ledger factory; the race needs a database its processes share "
            "(--backend sqlite or a postgresql:// URL)"
        )
    note = sqlite_url_note(backend, name, out_dir)
    if note is not None:
        console.print(note, markup=False, highlight=False)
    for stage, why in skipped.items():
        _loud_skip(console, stage, why)
    for stage, why in elsewhere.items():
        console.print(f"[yellow]{stage} stage skipped: it {escape(why)}[/]", highlight=False)
    plan = [("checkers", profile.expected_s("checkers"))]
    if adapter is not None:
        plan.append(("adapter", profile.expected_s("adapter")))
    plan.append(("fuzz", sum(_fuzz_s(m, n) for m, n in budget.items())))
    if chosen_models:
        plan.append(("explore", profile.expected_s("explore", chosen_models)))
    if durable:
        plan.append(("interleavings", profile.expected_s("interleavings")))
    if race_s > 0 and "race" not in skipped:
        plan.append(("race", race_s + 8.0))
    for n in targeted:  # a stage whose extra is missing only says so
        plan.append((n, 1.0 if n in lacking else profile.expected_s(n)))
    clock = StageClock(plan, quiet=not show, fixed={"race": race_s})
    console.print(
        f"campaign, profile {profile.name} on {name}: "
        f"{', '.join(n for n, _s in plan)}; about {fmt_s(sum(s for _n, s in plan))} on 2 "
        "cores at load below 2",
        markup=False,
        highlight=False,
    )

    def run_stage(stage: str, body: Callable[[], Any]) -> Any:
        clock.start(stage)
        try:
            return body()
        except InfrastructureFailure as exc:
            raise stopped(exc, _stopped_where(stage, clock)) from None
        except Exception as exc:
            cause = infrastructure_cause(exc)
            if cause is None:
                raise
            failure = InfrastructureFailure(f"the {stage} stage", name, cause)
            raise stopped(failure, _stopped_where(stage, clock)) from None

    # ---- checkers ----
    console.rule("checkers")
    checked = run_stage("checkers", lambda: run_checker_checks(seed=seed))
    checkers_json = checked.to_json()
    write_json_atomic(out_dir / "checkers-report.json", checkers_json)
    clock.done(f"{len(checked.failures)} got wrong")
    console.print(
        f"checkers: {checked.bad_cases:,} known-bad and {checked.good_cases:,} known-good "
        f"inputs ({', '.join(f'{k} {n}' for k, n in checked.cases.items())}), "
        f"{len(checked.failures)} got wrong"
    )
    for f in checked.failures[:20]:
        console.print(f"[red]{escape(str(f))}[/]")
    violations = len(checked.failures)
    # ---- adapter ----
    adapter_json = None
    if adapter is not None:
        console.rule("verl adapter")
        run_adapter = adapter
        adapter_json = run_stage(
            "adapter", lambda: run_adapter(seed=seed, examples=profile.adapter_examples)
        )
        write_json_atomic(out_dir / "adapter-report.json", adapter_json)
        clock.done(f"{len(adapter_json['failures'])} disagreements")
        console.print(
            f"adapter: {adapter_json['batches']} generated batches "
            f"({adapter_json['rows']:,} rows; {', '.join(adapter_json['kinds'])}), "
            f"{len(adapter_json['failures'])} disagreements with the reference gate"
        )
        for f in adapter_json["failures"][:10]:
            console.print(f"[red]{escape(str(f))}[/]")
        violations += len(adapter_json["failures"])
    # ---- fuzz ----
    console.rule("fuzz")
    total = sum(budget.values())
    finished: dict[str, int] = {}

    def on_fuzz(ev: ProgressEvent) -> None:
        if ev.phase in ("done", "failure"):
            finished[ev.machine] = budget[ev.machine]
        done = sum(finished.values()) + (
            0 if ev.machine in finished else min(ev.examples, budget[ev.machine])
        )
        clock.tick(
            f"{ev.machine} {min(ev.examples, budget[ev.machine])}/{budget[ev.machine]} "
            f"examples, {ev.steps:,} steps",
            done / total,
        )

    report = run_stage(
        "fuzz",
        lambda: run_campaign(
            list(FUZZ_MACHINES),
            name,
            # Hypothesis's max_examples shapes what it generates: a profile's cut keeps the
            # thorough run's (it builds more instances than that: the fast ledger cut, 254,
            # is past 200), so the cut run is that run cut short; only --examples past it
            # raises it
            examples=max(profile.max_examples, *budget.values())
            if examples
            else profile.max_examples,
            stop_after=budget if profile.cut or examples else None,
            seed=seed,
            profile=profile.hypothesis,
            steps=profile.steps,
            progress=on_fuzz,
            workdir=out_dir / "fuzz-work",
        ),
    )
    clock.done(f"{report.violations} machine(s) failed")
    print_fuzz_report(report, console)
    fuzz_json = report.to_json()
    write_json_atomic(out_dir / "fuzz-report.json", fuzz_json)
    # when each goal was first reached, and by which machine: at the thorough profile this
    # file is what stateful_tests/first_reached.json holds (the fast budget is read off it)
    write_json_atomic(
        out_dir / "first-reached.json",
        {
            "schema": "rollout-lifecycle/first-reached/2",
            "seed": seed,
            "examples": budget,
            "profile": profile.name,
            "hypothesis_profile": profile.hypothesis,
            "steps": profile.steps,
            "backend": report.backend,
            "first_reached": fuzz_json["first_reached"],
            "by_machine": {m: r["first_reached"] for m, r in fuzz_json["runs"].items()},
            # machine instances each run made (the fast budget's cap: a cut there is the
            # whole run)
            "instances": {m: r["examples"] for m, r in fuzz_json["runs"].items()},
        },
    )
    docs = [fuzz_json]
    violations += len(report.failures)
    # ---- explore ----
    ex = None
    if chosen_models:
        console.rule("explore")
        weights = {m: profile.expected_s("explore", (m,)) for m in chosen_models}
        whole = sum(weights.values())
        past: list[float] = [0.0]

        def on_explore(model: str, p: ExploreProgress) -> None:
            part = min(0.99, p.distinct_states / MODEL_STATES.get(model, 10**9))
            if p.final:
                past[0] += weights[model]
                part = 0.0
            clock.tick(
                f"{model}: {p.distinct_states:,} states, depth {p.depth}",
                (past[0] + part * weights[model]) / whole,
            )

        ex = run_stage(
            "explore",
            lambda: explore_models(
                list(chosen_models),
                max_states=None,
                show_progress=False,
                console=console,
                on_progress=on_explore if show else None,
            ),
        )
        clock.done(f"{ex['violations']} violation(s)")
        print_explore_report(ex, console)
        write_json_atomic(out_dir / "explore-report.json", ex)
        docs.append(ex)
        violations += ex["violations"]
    # ---- interleavings ----
    scripted = None
    if durable:
        console.rule("interleavings")
        scripted = run_stage(
            "interleavings", lambda: run_interleavings(name, out_dir / "interleavings")
        )
        wrong = [p for problems in scripted.values() for p in problems]
        clock.done(f"{len(wrong)} wrong answer(s)")
        console.print(
            f"interleavings: {len(scripted)} scripted gaps between two connections, "
            f"{len(wrong)} answers untrue at the instant of their step"
        )
        for w in wrong[:20]:
            console.print(f"[red]{escape(str(w))}[/]")
        violations += len(wrong)
    # ---- race ----
    race_json = None
    lin_undecided: list[str] = []
    if race_s > 0 and "race" not in skipped:
        console.rule("race")

        def race_tick(text: str) -> None:
            clock.tick(text, min(0.99, (time.monotonic() - clock.t0) / (race_s + 8.0)))

        raced = run_stage("race", lambda: _race(name, out_dir, seed, race_s, race_tick))
        if raced.infrastructure:
            failure = InfrastructureFailure(
                "the race", name, RuntimeError("; ".join(raced.infrastructure[:3]))
            )
            raise stopped(failure, _stopped_where("race", clock))
        clock.done(f"{len(raced.violations)} violation(s)")
        race_json = raced.to_json()
        write_json_atomic(out_dir / "race-report.json", race_json)
        totals = race_json["totals"]
        console.print(
            f"race on {race_json['config']['url']}: {race_json['events']:,} events, "
            f"{race_json['calls_judged']:,} calls judged, {totals.get('committed', 0):,} "
            f"consumed, {totals.get('reserve:pointer_moved', 0):,} refused as pointer_moved, "
            f"{totals.get('reserve:looser_than_policy', 0):,} as looser_than_policy, "
            f"{race_json['violation_count']} violations",
            markup=False,
        )
        if raced.linearizability is not None:
            console.print(lin_line(raced.linearizability, raced.history))
            lin_undecided = [
                key
                for f in raced.linearizability.findings
                if f.verdict == "unknown"
                for key in f.partitions
            ]
        for v in raced.violations[:20]:
            console.print(f"[red]{escape(str(v))}[/]")
        for e in raced.errors[:5]:
            console.print(f"[red]{escape(str(e))}[/]")
        violations += len(raced.violations) + len(raced.errors)
    # ---- targeted stages (stateful_tests/stages.py) ----
    staged: list[dict[str, Any]] = []
    for stage_name in targeted:
        console.rule(stage_name)
        ctx = StageContext(name, _stage_dir(out_dir, stage_name), seed, progress=clock.tick)
        rep = run_stage(stage_name, functools.partial(run_targeted, stage_name, ctx))
        data = rep.to_json()
        write_json_atomic(out_dir / f"stage-{stage_name}-report.json", data)
        staged.append(data)
        if rep.skipped is not None:
            clock.done("skipped")
            skipped[stage_name] = rep.skipped
            _loud_skip(console, stage_name, rep.skipped)
            continue
        clock.done(f"{len(rep.failures)} violation(s)")
        facts = ", ".join(f"{k} {v}" for k, v in rep.facts.items() if not isinstance(v, list))
        console.print(
            f"{stage_name}: {len(rep.failures)} violation(s) in {rep.seconds:.1f}s ({facts})",
            markup=False,
        )
        for f in rep.failures[:20]:
            console.print(f"[red]{escape(f)}[/]")
        violations += len(rep.failures)
    # ---- coverage, goals, report ----
    coverage = merge_coverage(*docs)
    write_json_atomic(out_dir / "coverage.json", coverage)
    console.rule("coverage")
    for machine, c in coverage["machines"].items():
        console.print(f"{machine}: {c['covered']}/{c['declared']} declared edges exercised")
    for machine, ids in uncovered(coverage).items():
        if ids:
            console.print(f"[yellow]{machine}: never exercised:[/] {', '.join(ids)}")
    _draw(coverage, out_dir, console)
    console.print(f"reports, coverage.json and diagrams written to {out_dir}/")
    goals = campaign_goals(fuzz_json, ex)
    if lin_undecided:  # a search past its time limit is no pass: name what it left open
        goals["linearizability undecided (a search ran out of time)"] = lin_undecided
    missed = sum(len(v) for v in goals.values())
    hints = budget_hints(
        [g for names in goals.values() for g in names],
        explorer=goals.get("explorer witnesses never reached", []),
    )
    for what, names in goals.items():
        if names:
            console.print(f"[bold yellow]goal missed, {what}:[/] {', '.join(names)}")
    for goal, hint in hints.items():
        console.print(f"  {goal}: {hint}", markup=False)
    wall_s = round(time.monotonic() - started, 1)
    timing = {
        "wall_s": wall_s,
        "cpu_s": round(cpu_seconds(), 1),
        "stages_s": clock.seconds,
        "stages_cpu_s": clock.cpu_seconds,
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": _loadavg(),
    }
    summary = {
        "schema": SCHEMA,
        "backend": name,
        "profile": profile.name,
        "budget": _budget_json(profile, budget, chosen_models, race_s, seed, asked),
        "seed": seed,
        "examples": budget,
        "violations": violations,
        "fuzz": fuzz_json,
        "explore": ex,
        "coverage": coverage,
        "race": race_json,
        "interleavings": scripted,
        "checkers": checkers_json,
        "adapter": adapter_json,
        "stages": staged,
        "skipped": {**skipped, **elsewhere},
        "goals_missed": goals,
        "budget_hints": hints,
        "timing": timing,
        "out": str(out_dir),
    }
    emit_report(summary, as_json=as_json, report_path=report_path, console=console)
    for stage, why in skipped.items():
        _loud_skip(console, stage, why)
    verdict = (
        f"{violations} violation(s)"
        if violations
        else f"no violation, {missed} coverage goal(s) missed"
        if missed
        else "no violation, every goal reached"
    )
    if elsewhere:
        verdict += f"; not run on {backend_kind(name)}: {', '.join(elsewhere)}"
    console.print(
        f"verdict ({profile.name} profile, {fmt_s(wall_s)}, "
        f"{timing['cpu_s']:.0f} s CPU): {verdict}"
        + (f"; SKIPPED: {', '.join(skipped)}" if skipped else ""),
        markup=False,
        highlight=False,
    )
    if violations:
        raise findings()
    if missed:
        console.print(
            f"[bold yellow]no violation, but {missed} coverage goal(s) missed (exit 5)[/]"
        )
        raise missed_goals()


def _fuzz_s(machine: str, n: int) -> float:
    from rollout_lifecycle.stateful_tests.campaign_profiles import FUZZ_S_PER_EXAMPLE

    return FUZZ_S_PER_EXAMPLE.get(machine, 0.1) * n


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _budget_json(
    profile: CampaignProfile,
    budget: dict[str, int],
    models: tuple[str, ...],
    race_s: float,
    seed: int,
    stages: tuple[str, ...],
) -> dict[str, Any]:
    """The budget this run used: the profile's, with any option that overrode it."""
    base = profile.to_json()
    used = dict(
        base,
        examples=budget,
        models=list(models),
        race_seconds=race_s,
        seed=seed,
        stages=list(stages),
    )
    keys = ("examples", "models", "race_seconds", "seed", "stages")
    used["overridden"] = sorted(k for k in keys if used[k] != base[k])
    return used


def _loud_skip(console: Console, stage: str, why: str) -> None:
    """A skipped stage is said in bold, at the start and again beside the verdict."""
    console.print(
        f"[bold yellow]{stage} stage SKIPPED:[/] {escape(why)}",
        highlight=False,
    )


def _stopped_where(stage: str, clock: StageClock) -> str:
    later = clock.not_started()
    return f"the campaign (stage {stage}" + (
        f"; not started: {', '.join(later)})" if later else ")"
    )


def _race(
    backend: str, out_dir: Path, seed: int, seconds: float, tick: Callable[[str], None]
) -> Any:
    url = _race_url(backend, out_dir)
    return run_race(
        RaceConfig(url=url, learners=3, seconds=seconds, seed=seed, hostile=1, churn=True),
        progress=tick,
        history_path=out_dir / "race" / "history.jsonl",
    )


def _stage_dir(out_dir: Path, name: str) -> Path:
    """A fresh work directory for one targeted stage (an earlier run's files removed)."""
    work = out_dir / "stages" / name
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    return work


def _race_url(backend: str, out_dir: Path) -> str:
    """Fresh durable state for the race on the campaign's backend: a new SQLite file in
    `out_dir`, or a fresh schema on the PostgreSQL server (a connection per process)."""
    race_dir = out_dir / "race"
    race_dir.mkdir(parents=True, exist_ok=True)
    if backend == "sqlite":
        for old in race_dir.glob(f"{DB_NAME}*"):
            old.unlink()  # the campaign's own work file from an earlier run
    return durable_url(backend, race_dir)


def budget_hints(missed: list[str], explorer: list[str] | None = None) -> dict[str, str]:
    """For each missed goal, the budget that reaches it: the example that first reached it
    in the thorough campaign (recorded in stateful_tests/first_reached.json), or that even
    the thorough budget does not."""
    if not missed:
        return {}
    ref = load_first_reached()
    out = {}
    for goal in missed:
        hit = ref["first_reached"].get(goal)
        if goal in (explorer or ()):
            out[goal] = (
                "an explorer witness: every profile's models reach all of theirs (run "
                "without --model, or add this model)"
            )
        elif hit is not None:
            machine, n = hit
            out[goal] = (
                f"the thorough campaign (seed {ref['seed']}, --backend {ref['backend']}) "
                f"reaches it at example {n} of the {machine} machine: rerun with "
                f"--examples {n} or more"
            )
        else:
            most = ref["examples"]
            most = max(most.values()) if isinstance(most, dict) else most
            out[goal] = (
                f"not reached by the thorough budget either (--examples {most}): "
                "raise --examples or run `rollout-lifecycle fuzz --time-budget`"
            )
    return out


def campaign_goals(fuzz: dict[str, Any], explore: dict[str, Any] | None) -> dict[str, list[str]]:
    """What the campaign was given the budget to reach and did not: every declared edge and
    every sometimes-property by the fuzzer (on the campaign's backend), and every explorer
    model's reachability witnesses. A missed goal fails the campaign: a budget that cannot
    reach an edge cannot catch a bug on it."""
    goals: dict[str, list[str]] = {
        "declared edges the fuzzer never took": [
            f"{m}: {e}"
            for m, c in fuzz["machines"].items()
            for e, n in c["edges"].items()
            if n == 0
        ],
        "sometimes-properties the fuzzer never reached": [
            k for k, n in fuzz["sometimes"].items() if n == 0
        ],
    }
    if explore is not None:
        goals["explorer witnesses never reached"] = [
            f"{name}: {prop}"
            for name, m in explore["models"].items()
            for prop, witness in m.get("sometimes", {}).items()
            if witness is None
        ]
    return goals


def _draw(coverage: dict[str, object], out_dir: Path, console: Console) -> None:
    """Coverage diagrams: Mermaid always, SVG when Graphviz is installed (said, not hidden)."""
    have_dot = shutil.which("dot") is not None
    for name, spec in MACHINES.items():
        atomic_write(
            out_dir / f"{name}-coverage.mmd",
            render(spec, "mermaid", engine="mermaid", coverage=coverage),
        )
        if have_dot:
            try:
                atomic_write(
                    out_dir / f"{name}-coverage.svg",
                    render(spec, "svg", engine="graphviz", coverage=coverage),
                )
            except DiagramError as exc:
                console.print(f"[yellow]no SVG for {name}: {escape(str(exc))}[/]")
    if not have_dot:
        console.print(
            "[yellow]Graphviz `dot` not found: wrote Mermaid coverage diagrams only "
            "(apt-get install graphviz for SVG)[/]"
        )


__all__ = ["StageClock", "budget_hints", "campaign", "campaign_goals", "load_first_reached"]
