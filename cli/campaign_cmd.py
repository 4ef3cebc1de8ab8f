"""`campaign`: the README's main job, fuzz and explore both machines, report, coverage.

It runs the three stateful machines on the chosen backend (SQLite by default: the embedded
default a user runs without a server), then the explorer at the README bounds, prints both
reports, and writes into `--out`: the fuzz and explore reports, the merged coverage JSON
(the format `rollout-lifecycle diagram --coverage` reads), and coverage-annotated diagrams
of both machines. Exit 1 on any violation; never-exercised edges are listed in yellow.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import click

from rollout_lifecycle.cli.exitcodes import findings
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
from rollout_lifecycle.stateful_tests.profiles import selected_profile_name
from rollout_lifecycle.stateful_tests.race import RaceConfig, run_race
from rollout_lifecycle.stateful_tests.runner import MACHINES as FUZZ_MACHINES
from rollout_lifecycle.stateful_tests.runner import (
    PROFILES,
    README_EXAMPLES,
    README_RACE_SECONDS,
    README_SEED,
    run_campaign,
)


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
    help="Real processes racing on the SQLite file (1 activator, 3 learners), every call "
    "judged; 0 skips. Only on sqlite.",
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
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """Fuzz and explore both machines, print the report, write coverage JSON and diagrams."""
    check_report_path(report_path)
    console = make_console(quiet=as_json)
    ensure_dir(out_dir, "--out")
    chosen = profile or selected_profile_name()
    show = not quiet
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
    docs = [fuzz_json]
    violations = len(report.failures)
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
    race_json = None
    if race_seconds > 0 and backend != "sqlite":
        console.print(
            f"race skipped: the campaign races on its own SQLite file, not on {backend!r}; "
            "race a server with `rollout-lifecycle race --backend URL` on an empty database"
        )
    if race_seconds > 0 and backend == "sqlite":
        console.rule("race")
        db = out_dir / "race.db"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)  # the campaign's own work file
        tick = Progress("race", quiet=quiet)
        raced = run_race(
            RaceConfig(url=f"sqlite:///{db}", learners=3, seconds=race_seconds, seed=seed),
            progress=tick,
        )
        tick("done", True)
        race_json = raced.to_json()
        write_json_atomic(out_dir / "race-report.json", race_json)
        totals = race_json["totals"]
        console.print(
            f"race: {race_json['events']:,} events, {race_json['calls_judged']:,} calls judged, "
            f"{totals.get('committed', 0):,} consumed, {totals.get('reserve:pointer_moved', 0):,} "
            f"refused as pointer_moved, {race_json['violation_count']} violations"
        )
        for v in raced.violations[:20]:
            console.print(f"[red]{v}[/]")
        violations += len(raced.violations) + len(raced.errors)
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
    missed = sum(len(v) for v in goals.values())
    for what, names in goals.items():
        if names:
            console.print(f"[bold red]goal missed, {what}:[/] {', '.join(names)}")
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
        "goals_missed": goals,
        "out": str(out_dir),
    }
    emit_report(summary, as_json=as_json, report_path=report_path, console=console)
    if violations:
        console.print(f"[bold red]{violations} violation(s)[/]")
    if violations or missed:
        raise findings()


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
