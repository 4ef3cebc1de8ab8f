"""`campaign`: the README's main job: check the checkers, fuzz, explore, race, report.

Stages, in order: every checker shown its known-bad and known-good histories and the
enforcing rules compared with the spec (stateful_tests/checkers.py, seconds); the stateful
machines on the chosen backend (SQLite by default: the embedded default a user runs without
a server; a postgresql:// URL runs them on that server); the verl adapter fuzzed against the
reference gate (when verl is installed); the explorer at the README bounds; scripted
interleavings of two connections on the same backend, each answer judged at the instant of
its step (stateful_tests/interleavings.py); real processes racing on the same backend
(SQLite file, or a fresh PostgreSQL schema), every call recorded and the whole history
checked for linearizability; the targeted stages of stateful_tests/stages.py (verl's v1
buffer on a real TransferQueue; on PostgreSQL, clients with skewed clocks and the premise
lock's window held open). It writes into `--out` the reports, the merged coverage JSON (the
format `rollout-lifecycle diagram --coverage` reads), the race's call history, and
coverage-annotated diagrams. Exit 1 on any violation; exit 5 when
nothing was violated but a coverage goal was missed (the report names the budget that
reaches it).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import click

from rollout_lifecycle.cli.exitcodes import findings, missed_goals
from rollout_lifecycle.cli.explore_cmd import explore_models, print_explore_report
from rollout_lifecycle.cli.fuzz_cmd import print_fuzz_report, progress_callback
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
from rollout_lifecycle.spec.bounds import EXPLORER_MODELS, README_MODELS
from rollout_lifecycle.spec.coverage import merge_coverage, uncovered
from rollout_lifecycle.spec.diagrams import DiagramError, render
from rollout_lifecycle.stateful_tests.backends import DB_NAME, durable_url
from rollout_lifecycle.stateful_tests.checkers import run_checker_checks
from rollout_lifecycle.stateful_tests.interleavings import run_interleavings
from rollout_lifecycle.stateful_tests.profiles import selected_profile_name
from rollout_lifecycle.stateful_tests.race import RaceConfig, lin_line, run_race
from rollout_lifecycle.stateful_tests.runner import MACHINES as FUZZ_MACHINES
from rollout_lifecycle.stateful_tests.runner import (
    PROFILES,
    README_EXAMPLES,
    README_RACE_SECONDS,
    README_SEED,
    run_campaign,
)
from rollout_lifecycle.stateful_tests.stages import STAGES, StageContext, run_stage


@click.command("campaign")
@click.option(
    "--backend",
    default="sqlite",
    show_default=True,
    help="Backend for the fuzz machines: sqlite (default), memory, or a postgresql:// URL "
    "(each machine instance gets a fresh schema on that server).",
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
    default=README_EXAMPLES,
    show_default=True,
    help="Fuzz examples per machine.",
)
@click.option("--seed", type=SEED, default=README_SEED, show_default=True)
@click.option(
    "--profile",
    type=click.Choice(PROFILES),
    default=None,
    help="Hypothesis profile (default: ci when CI is set, else dev).",
)
@click.option(
    "--model",
    "models",
    multiple=True,
    type=click.Choice(sorted(EXPLORER_MODELS)),
    help="Explorer model(s) (repeatable); default: the README set.",
)
@click.option("--no-explore", is_flag=True, help="Fuzz only.")
@click.option(
    "--race-seconds",
    type=FiniteFloat(0.0, 3600.0),
    default=README_RACE_SECONDS,
    show_default=True,
    help="Real processes racing on the campaign's backend (1 activator that also rolls back "
    "and churns the worker set, 3 learners, one of them misconfigured), each with its own "
    "connection, every call judged; 0 skips.",
)
@click.option(
    "--stage",
    "stages",
    multiple=True,
    type=click.Choice([*STAGES, "none"]),
    help="Targeted stages after the race (repeatable): "
    + "; ".join(f"{s.name}: {s.seconds_hint}, on {'/'.join(s.backends)}" for s in STAGES.values())
    + ". Default: every stage that runs on the campaign's backend; 'none' skips them.",
)
@report_options
@quiet_option
def campaign(
    backend: str,
    out_dir: Path,
    examples: int,
    seed: int,
    profile: str | None,
    models: tuple[str, ...],
    no_explore: bool,
    race_seconds: float,
    stages: tuple[str, ...],
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """Check the checkers, fuzz, explore and race; report; write coverage JSON and diagrams.

    Exit 1 on a violation; 5 when nothing was violated but a coverage goal was missed.
    """
    check_report_path(report_path)
    console = make_console(quiet=as_json)
    ensure_dir(out_dir, "--out")
    chosen = profile or selected_profile_name()
    show = not quiet
    console.rule("checkers")
    checked = run_checker_checks(seed=seed)
    checkers_json = checked.to_json()
    write_json_atomic(out_dir / "checkers-report.json", checkers_json)
    console.print(
        f"checkers: {checked.bad_cases:,} known-bad and {checked.good_cases:,} known-good "
        f"inputs ({', '.join(f'{k} {n}' for k, n in checked.cases.items())}), "
        f"{len(checked.failures)} got wrong"
    )
    for f in checked.failures[:20]:
        console.print(f"[red]{f}[/]")
    console.rule("fuzz")
    try:
        report = run_campaign(
            list(FUZZ_MACHINES),
            backend,
            examples=examples,
            seed=seed,
            profile=chosen,
            progress=progress_callback(quiet=quiet),
            workdir=out_dir / "fuzz-work",
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    print_fuzz_report(report, console)
    fuzz_json = report.to_json()
    write_json_atomic(out_dir / "fuzz-report.json", fuzz_json)
    # when each goal was first reached: at the README's settings this file is what
    # stateful_tests/first_reached.json holds (the budget hints of smaller runs read it)
    write_json_atomic(
        out_dir / "first-reached.json",
        {
            "schema": "rollout-lifecycle/first-reached/1",
            "seed": seed,
            "examples": examples,
            "profile": chosen,
            "backend": report.backend,
            "first_reached": fuzz_json["first_reached"],
        },
    )
    docs = [fuzz_json]
    violations = len(report.failures) + len(checked.failures)
    adapter_json = _adapter_stage(console, seed, examples)
    if adapter_json is not None:
        write_json_atomic(out_dir / "adapter-report.json", adapter_json)
        violations += len(adapter_json["failures"])
    if not no_explore:
        console.rule("explore")
        names = list(models) or list(README_MODELS)
        try:
            ex = explore_models(names, max_states=None, show_progress=show, console=console)
        except KeyError as exc:
            raise click.UsageError(f"unknown explorer model {exc}") from None
        print_explore_report(ex, console)
        write_json_atomic(out_dir / "explore-report.json", ex)
        docs.append(ex)
        violations += ex["violations"]
    scripted = None
    if backend != "memory":
        console.rule("interleavings")
        try:
            scripted = run_interleavings(backend, out_dir / "interleavings")
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        wrong = [p for problems in scripted.values() for p in problems]
        console.print(
            f"interleavings: {len(scripted)} scripted gaps between two connections, "
            f"{len(wrong)} answers untrue at the instant of their step"
        )
        for w in wrong[:20]:
            console.print(f"[red]{w}[/]")
        violations += len(wrong)
    race_json = None
    lin_undecided: list[str] = []
    if race_seconds > 0 and backend == "memory":
        console.print(
            "race skipped: memory:// lives in one process; the race needs state shared by "
            "processes (--backend sqlite or a postgresql:// URL)"
        )
    elif race_seconds > 0:
        console.rule("race")
        try:
            url = _race_url(backend, out_dir)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        tick = Progress("race", quiet=quiet)
        raced = run_race(
            RaceConfig(
                url=url,
                learners=3,
                seconds=race_seconds,
                seed=seed,
                hostile=1,
                churn=True,
            ),
            progress=tick,
            history_path=out_dir / "race" / "history.jsonl",
        )
        tick("done", True)
        race_json = raced.to_json()
        write_json_atomic(out_dir / "race-report.json", race_json)
        totals = race_json["totals"]
        console.print(
            f"race on {race_json['config']['url']}: {race_json['events']:,} events, "
            f"{race_json['calls_judged']:,} calls judged, {totals.get('committed', 0):,} "
            f"consumed, {totals.get('reserve:pointer_moved', 0):,} refused as pointer_moved, "
            f"{totals.get('reserve:looser_than_policy', 0):,} as looser_than_policy, "
            f"{race_json['violation_count']} violations"
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
            console.print(f"[red]{v}[/]")
        for e in raced.errors[:5]:
            console.print(f"[red]{e}[/]")
        violations += len(raced.violations) + len(raced.errors)
    staged = run_targeted_stages(
        console, backend, out_dir, seed, stages or tuple(STAGES), quiet=quiet
    )
    violations += sum(len(r["failures"]) for r in staged)
    coverage = merge_coverage(*docs)
    write_json_atomic(out_dir / "coverage.json", coverage)
    console.rule("coverage")
    for name, c in coverage["machines"].items():
        console.print(f"{name}: {c['covered']}/{c['declared']} declared edges exercised")
    for name, ids in uncovered(coverage).items():
        if ids:
            console.print(f"[yellow]{name}: never exercised:[/] {', '.join(ids)}")
    _draw(coverage, out_dir, console)
    console.print(f"reports, coverage.json and diagrams written to {out_dir}/")
    goals = campaign_goals(fuzz_json, docs[1] if len(docs) > 1 else None)
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
        console.print(f"  {goal}: {hint}")
    summary = {
        "schema": "rollout-lifecycle/campaign-report/1",
        "backend": backend,
        "profile": chosen,
        "seed": seed,
        "examples": examples,
        "violations": violations,
        "fuzz": fuzz_json,
        "explore": docs[1] if len(docs) > 1 else None,
        "coverage": coverage,
        "race": race_json,
        "interleavings": scripted,
        "checkers": checkers_json,
        "adapter": adapter_json,
        "stages": staged,
        "goals_missed": goals,
        "budget_hints": hints,
        "out": str(out_dir),
    }
    emit_report(summary, as_json=as_json, report_path=report_path, console=console)
    if violations:
        console.print(f"[bold red]{violations} violation(s)[/]")
        raise findings()
    if missed:
        console.print(
            f"[bold yellow]no violation, but {missed} coverage goal(s) missed (exit 5)[/]"
        )
        raise missed_goals()


def run_targeted_stages(
    console: object,
    backend: str,
    out_dir: Path,
    seed: int,
    names: tuple[str, ...],
    *,
    quiet: bool = False,
) -> list[dict[str, Any]]:
    """The targeted stages of stateful_tests/stages.py, each on its own fresh state under
    `out_dir/stages/<name>`: a stage that does not apply to the backend, or whose extra is
    missing, says so (loudly, with what to install) and is not counted as run."""
    from rich.console import Console

    assert isinstance(console, Console)
    out: list[dict[str, Any]] = []
    for name in dict.fromkeys(n for n in names if n != "none"):
        stage = STAGES[name]
        if not stage.applies_to(backend):
            console.print(
                f"[yellow]{name} stage skipped: it runs on {'/'.join(stage.backends)} only "
                "(--backend postgresql://... runs it)[/]"
            )
            continue
        console.rule(name)
        tick = Progress(name, quiet=quiet)
        rep = run_stage(name, StageContext(backend, _stage_dir(out_dir, name), seed, progress=tick))
        tick("done", True)
        data = rep.to_json()
        write_json_atomic(out_dir / f"stage-{name}-report.json", data)
        out.append(data)
        if rep.skipped is not None:
            console.print(f"[bold yellow]{name} stage skipped: {rep.skipped}[/]")
            continue
        facts = ", ".join(f"{k} {v}" for k, v in rep.facts.items() if not isinstance(v, list))
        console.print(f"{name}: {len(rep.failures)} violation(s) in {rep.seconds:.1f}s ({facts})")
        for f in rep.failures[:20]:
            console.print(f"[red]{f}[/]")
    return out


def _stage_dir(out_dir: Path, name: str) -> Path:
    """A fresh work directory for one stage (an earlier run's files removed)."""
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


def _adapter_stage(console: object, seed: int, examples: int) -> dict[str, Any] | None:
    """The verl adapter fuzzed against the reference gate, when verl is installed."""
    from rich.console import Console

    assert isinstance(console, Console)
    try:
        from rollout_lifecycle.stateful_tests.adapter_fuzz import run_adapter_fuzz
    except ImportError as exc:
        console.print(f"[yellow]adapter stage skipped: {exc} (pip install '.[verl]')[/]")
        return None
    console.rule("verl adapter")
    rep = run_adapter_fuzz(seed=seed, examples=examples)
    console.print(
        f"adapter: {rep['batches']} generated batches ({rep['rows']:,} rows; "
        f"{', '.join(rep['kinds'])}), {len(rep['failures'])} disagreements with the "
        "reference gate"
    )
    for f in rep["failures"][:10]:
        console.print(f"[red]{f}[/]")
    return rep


def budget_hints(missed: list[str], explorer: list[str] | None = None) -> dict[str, str]:
    """For each missed goal, the budget that reaches it: the example that first reached it
    in the README campaign (recorded in stateful_tests/first_reached.json), or that even
    the README budget does not."""
    if not missed:
        return {}
    ref = load_first_reached()
    out = {}
    for goal in missed:
        hit = ref["first_reached"].get(goal)
        if goal in (explorer or ()):
            out[goal] = (
                "an explorer witness: the README models at README bounds reach every one "
                "(run without --model, or add this model)"
            )
        elif hit is not None:
            machine, n = hit
            out[goal] = (
                f"the README campaign (seed {ref['seed']}, profile {ref.get('profile')}, "
                f"--backend {ref['backend']}) reaches "
                f"it at example {n} of the {machine} machine: rerun with --examples {n} or more"
            )
        else:
            out[goal] = (
                f"not reached by the README budget either (--examples {ref['examples']}): "
                "raise --examples or run `rollout-lifecycle fuzz --time-budget`"
            )
    return out


def load_first_reached() -> dict[str, Any]:
    """The README campaign's record of when each goal was first reached."""
    import json
    from importlib import resources

    text = (
        resources.files("rollout_lifecycle.stateful_tests")
        .joinpath("first_reached.json")
        .read_text(encoding="utf-8")
    )
    data: dict[str, Any] = json.loads(text)
    return data


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


def _draw(coverage: dict[str, object], out_dir: Path, console: object) -> None:
    """Coverage diagrams: Mermaid always, SVG when Graphviz is installed (said, not hidden)."""
    from rich.console import Console

    assert isinstance(console, Console)
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
                console.print(f"[yellow]no SVG for {name}: {exc}[/]")
    if not have_dot:
        console.print(
            "[yellow]Graphviz `dot` not found: wrote Mermaid coverage diagrams only "
            "(apt-get install graphviz for SVG)[/]"
        )


__all__ = ["campaign"]
