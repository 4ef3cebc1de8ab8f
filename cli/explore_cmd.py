"""`explore`: exhaustive breadth-first search of the protocol models at small bounds.

Every interleaving of the named models (spec/bounds.py) is enumerated over the real ledger
and coordinator; the spec's invariants are judged on every step and state; a violation is
reported with its SHORTEST trace. Counts follow TLC's conventions (distinct states,
generated states, depth) so they can be pinned and compared run to run.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from rollout_lifecycle.cli.exitcodes import findings
from rollout_lifecycle.cli.output import (
    Progress,
    check_report_path,
    dumps,
    emit_report,
    make_console,
    quiet_option,
    report_options,
)
from rollout_lifecycle.cli.params import COUNT
from rollout_lifecycle.spec.bounds import EXPLORER_MODELS, README_MODELS
from rollout_lifecycle.spec.coverage import coverage_json, uncovered
from rollout_lifecycle.spec.explorer import ExplorationResult, ExploreProgress
from rollout_lifecycle.spec.explorer import explore as run_explore


def explore_models(
    names: list[str],
    *,
    max_states: int | None,
    show_progress: bool,
    console: Console,
    on_progress: Callable[[str, ExploreProgress], None] | None = None,
) -> dict[str, Any]:
    """Explore each named model; return a JSON-able report with coverage and any violations.

    `on_progress(model, progress)`, when given, is told of each model's progress too (the
    campaign's stage line)."""
    report: dict[str, Any] = {
        "schema": "rollout-lifecycle/explore-report/1",
        "models": {},
        "violations": 0,
    }
    edges: Counter[tuple[str, str]] = Counter()
    for name in names:
        factory, about = EXPLORER_MODELS[name]
        model = factory()
        tick = Progress(f"explore {name}") if show_progress else None

        def on_model_progress(p: ExploreProgress, tick: Any = tick, name: str = name) -> None:
            if on_progress is not None:
                on_progress(name, p)
            if tick is not None:
                tick(
                    f"{p.distinct_states:,} states, depth {p.depth}, queue {p.queue_size:,}",
                    p.final,
                )

        t0 = time.perf_counter()
        result: ExplorationResult[Any] = run_explore(
            model, max_states=max_states, progress=on_model_progress, progress_every=5_000
        )
        elapsed = time.perf_counter() - t0
        edges.update(model.edges)
        entry = result.to_json(render=_render_state)
        entry.update(
            about=about,
            elapsed_s=round(elapsed, 3),
            states_per_s=round(result.distinct_states / elapsed) if elapsed > 0 else None,
            observed=dict(sorted(model.observed.items())),
        )
        entry["violation_details"] = [
            model.violations_of(cex.final_state) for cex in result.violations
        ]
        report["models"][name] = entry
        report["violations"] += len(result.violations)
    report.update(
        coverage_json(edges, f"explore: {', '.join(names)} (transitions taking each edge)")
    )
    return report


def _render_state(state: Any) -> Any:
    """States are frozen attrs values; their repr is exact, so the JSON keeps it."""
    return repr(state)


def print_explore_report(report: dict[str, Any], console: Console) -> None:
    """Counts per model, the shortest counterexample of any violation, uncovered edges."""
    table = Table(title="exhaustive exploration")
    for col in (
        "model",
        "distinct",
        "generated",
        "depth",
        "complete",
        "violations",
        "s",
        "states/s",
    ):
        table.add_column(col, justify="right" if col != "model" else "left")
    for name, m in report["models"].items():
        table.add_row(
            name,
            f"{m['distinct_states']:,}",
            f"{m['generated_states']:,}",
            str(m["max_depth"]),
            "yes" if m["complete"] else "NO (bounded)",
            str(len(m["violations"])),
            f"{m['elapsed_s']:.1f}",
            f"{m['states_per_s'] or 0:,}",
        )
    console.print(table)
    for name, m in report["models"].items():
        for cex, details in zip(m["violations"], m.get("violation_details", []), strict=False):
            console.print(f"[bold red]{name}: {cex['property']} violated[/]; shortest trace:")
            for i, step in enumerate(cex["trace"]):
                console.print(f"  {i:>3}. {step['action'] or 'init'}")
            for d in details:
                console.print(f"       [red]{d}[/]")
    missing = {k: v for k, v in uncovered(report).items() if v}
    for machine, ids in missing.items():
        console.print(
            f"[yellow]{machine}: {len(ids)} declared edge(s) not reached by these "
            f"models:[/] {', '.join(ids)}"
        )


@click.command("explore")
@click.option(
    "--model",
    "models",
    multiple=True,
    type=click.Choice(sorted(EXPLORER_MODELS)),
    help=f"Model(s) to explore (repeatable). Default: the README set ({', '.join(README_MODELS)}).",
)
@click.option(
    "--max-states",
    type=COUNT,
    default=None,
    help="Stop after this many distinct states (the report says 'bounded').",
)
@click.option("--list", "list_models", is_flag=True, help="List the models and their bounds.")
@report_options
@quiet_option
def explore(
    models: tuple[str, ...],
    max_states: int | None,
    list_models: bool,
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """Explore every interleaving of the protocol models and check the spec's invariants."""
    check_report_path(report_path)
    console = make_console(quiet=as_json)
    if list_models:
        listing = {name: about for name, (_f, about) in EXPLORER_MODELS.items()}
        if as_json:
            click.echo(dumps({"models": listing}), nl=False)
            return
        for name, about in listing.items():
            console.print(f"[bold]{name}[/]: {about}")
        return
    names = list(models) or list(README_MODELS)
    report = explore_models(names, max_states=max_states, show_progress=not quiet, console=console)
    print_explore_report(report, console)
    emit_report(report, as_json=as_json, report_path=report_path, console=console)
    if report["violations"]:
        raise findings()


__all__ = ["explore", "explore_models", "print_explore_report"]
