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
@click.option(
    "--faults",
    is_flag=True,
    help="Race the README's own forms under faults instead: learners and the activator "
    "SIGKILLed and replaced, leases lost mid-update, rollbacks, careless lineages; judged "
    "from the durable trace (no rollout in two published updates, none stale, none lost, "
    "no attempt left past its ack deadline). Takes --learners, --seconds, --max-lag, --seed.",
)
@click.option(
    "--kill-every",
    type=FiniteFloat(0.0, 3600.0),
    default=3.0,
    show_default=True,
    help="With --faults: mean seconds between two SIGKILLs (0: none).",
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
    faults: bool,
    kill_every: float,
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
    if faults:
        given = {
            "--activators": activators != 1,
            "--hostile": hostile != 0,
            "--churn": churn,
            "--history": history_path is not None,
        }
        for flag, on in given.items():
            if on:
                raise click.BadParameter(
                    "the fault race runs one activator (killed and replaced), rolls back "
                    "on its own and records no call history",
                    param_hint=f"{flag} with --faults",
                )
    try:
        check_fresh(url)
    except BackendUnavailable as exc:
        raise TechnicalError(str(exc)) from None
    except RolloutLifecycleError as exc:
        raise InputError(str(exc)) from None
    if faults:
        _fault_race(url, learners, seconds, max_lag, seed, kill_every, as_json, report_path, quiet)
        return
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
    if report.infrastructure:  # the backend failed under it: its verdict is void, not a finding
        raise TechnicalError(
            "the race stopped, not a finding: the backend or the disk failed under "
            f"{len(report.infrastructure)} process(es): {report.infrastructure[0]}"
        )
    if not report.ok:
        raise findings()


def _fault_race(
    url: str,
    learners: int,
    seconds: float,
    max_lag: int,
    seed: int,
    kill_every: float,
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """`race --faults`: the README pattern under SIGKILLs and lost leases, judged."""
    import tempfile

    from rollout_lifecycle.stateful_tests.fault_race import FaultRaceConfig, run_fault_race

    tick = Progress("race --faults", quiet=quiet)
    with tempfile.TemporaryDirectory(prefix="fault-race-") as work:
        cfg = FaultRaceConfig(
            url=url,
            workdir=Path(work),
            learners=learners,
            seconds=seconds,
            kill_every=kill_every,
            max_lag=max_lag,
            seed=seed,
        )
        try:
            report = run_fault_race(cfg, progress=tick)
        except RolloutLifecycleError as exc:
            raise TechnicalError(f"the fault race could not run: {exc}") from None
    tick("done", True)
    console = make_console(quiet=as_json)
    table = Table(title=f"fault race: {learners} learners, {seconds:.0f}s, SIGKILLs {report.kills}")
    table.add_column("counter")
    table.add_column("total", justify="right")
    for key, n in {**report.counts, **report.facts}.items():
        if isinstance(n, int):
            table.add_row(key, f"{n:,}")
    console.print(table)
    for line in report.findings[:50]:
        console.print(f"[red]{line}[/]")
    for e in report.errors:
        console.print(f"[red]process failed: {e}[/]")
    f = report.facts
    console.print(
        f"{report.events:,} events judged: {f['rollouts_in_two_published_updates']} rollouts "
        f"in two published updates, {f['stale_consumed']} stale, {f['lost']} lost, "
        f"{f['awaiting_acks_at_end']} awaiting acks at the end; {f['lease_losses']} lease "
        f"losses, {sum(report.kills.values())} SIGKILLs; {len(report.findings)} findings"
    )
    emit_report(report.to_json(), as_json=as_json, report_path=report_path, console=console)
    if not report.ok:
        raise findings()


__all__ = ["race"]
