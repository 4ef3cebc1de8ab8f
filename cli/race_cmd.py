"""`race`: the README's pattern in real processes, judged by the spec, the stored rows and a
history check of every call (see stateful_tests/race.py). Exit 1 on any violation."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from rollout_lifecycle.cli.exitcodes import InputError, TechnicalError, findings
from rollout_lifecycle.cli.output import (
    Progress,
    check_report_path,
    emit_report,
    make_console,
    quiet_option,
    report_options,
)
from rollout_lifecycle.cli.params import SEED, FiniteFloat, StrictInt
from rollout_lifecycle.model.atomic import check_target
from rollout_lifecycle.model.errors import BackendUnavailable, OutputError, RolloutLifecycleError
from rollout_lifecycle.stateful_tests.race import RaceConfig, check_fresh, lin_line, run_race


@click.command("race")
@click.option(
    "--backend",
    "url",
    default="sqlite:///race.db",
    show_default=True,
    help=(
        "A NEW SQLite file (sqlite:///path) or an empty PostgreSQL database "
        "(postgresql://...); every process opens its own connection."
    ),
)
@click.option("--learners", type=StrictInt(1, 64), default=4, show_default=True)
@click.option("--activators", type=StrictInt(1, 8), default=1, show_default=True)
@click.option("--seconds", type=FiniteFloat(1.0, 86_400.0), default=60.0, show_default=True)
@click.option("--max-lag", type=StrictInt(0, 1000), default=1, show_default=True)
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option(
    "--hostile",
    type=StrictInt(0, 64),
    default=0,
    show_default=True,
    help="How many of the learners are misconfigured (their gate admits any lag and "
    "drift): the deployment's recorded policy must refuse what they let through.",
)
@click.option(
    "--churn",
    is_flag=True,
    help="Activators also roll back (retiring versions learners admitted against) and "
    "shrink and restore the required worker set.",
)
@click.option(
    "--workers",
    type=StrictInt(1, 16),
    default=2,
    show_default=True,
    help="Required workers of the deployment (gen-0, gen-1, ...).",
)
@click.option(
    "--roles/--no-roles",
    default=None,
    help="PostgreSQL: every party under its own login in its own role, and a hostile "
    "learner that must be refused everything else. Default: when the URL's login may "
    "create roles.",
)
@click.option(
    "--history",
    "history_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write every recorded call of every process to FILE, as JSON lines "
    "(docs/design.md, 'A call history'; schema cli/schemas/call-history.schema.json): "
    "what the linearizability check read, for any other checker to read too.",
)
@report_options
@quiet_option
def race(
    url: str,
    learners: int,
    activators: int,
    seconds: float,
    max_lag: int,
    seed: int,
    hostile: int,
    churn: bool,
    workers: int,
    roles: bool | None,
    history_path: Path | None,
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """Race activators against learners running the README pattern; judge everything.

    The trace and the stored rows are judged by the spec, and every recorded call of every
    process is checked for linearizability (`--history FILE` keeps the calls)."""
    check_report_path(report_path)
    if history_path is not None:
        try:
            check_target(history_path)
        except OutputError as exc:
            raise click.BadParameter(str(exc), param_hint="--history") from None
    if hostile > learners:
        raise click.BadParameter(
            f"{hostile} hostile learners out of {learners}", param_hint="--hostile"
        )
    try:
        check_fresh(url)
    except BackendUnavailable as exc:
        raise TechnicalError(str(exc)) from None
    except RolloutLifecycleError as exc:
        raise InputError(str(exc)) from None
    cfg = RaceConfig(
        url=url,
        learners=learners,
        activators=activators,
        seconds=seconds,
        max_lag=max_lag,
        seed=seed,
        hostile=hostile,
        churn=churn,
        workers=workers,
        roles=roles,
    )
    tick = Progress("race", quiet=quiet)
    try:
        report = run_race(cfg, progress=tick, history_path=history_path)
    except RolloutLifecycleError as exc:
        raise TechnicalError(f"the race could not run: {exc}") from None
    tick("done", True)
    console = make_console(quiet=as_json)
    totals = report.totals()
    table = Table(title=f"race: {activators} activator(s), {learners} learners, {seconds:.0f}s")
    table.add_column("counter")
    table.add_column("total", justify="right")
    for key, n in totals.items():
        table.add_row(key, f"{n:,}")
    console.print(table)
    for v in report.violations[:50]:
        console.print(f"[red]{v}[/]")
    for e in report.errors:
        console.print(f"[red]process failed: {e}[/]")
    console.print(
        f"{report.events:,} events replayed, {report.calls:,} calls judged "
        "(reservations and dispatches): "
        f"{len(report.violations)} violations"
    )
    if report.linearizability is not None:
        console.print(lin_line(report.linearizability, report.history))
    emit_report(report.to_json(), as_json=as_json, report_path=report_path, console=console)
    if not report.ok:
        raise findings()


__all__ = ["race"]
