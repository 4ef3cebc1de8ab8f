"""`fuzz`: stateful fuzz campaigns of the ledger, activation and end-to-end machines.

A thin layer over `stateful_tests.runner.run_campaign`: options in, a progress line per
second on stderr, a final table (steps, rules fired, declared edges covered out of all,
invariants checked, sometimes-properties reached), the JSON report on request, and on a
failure the shrunk program printed, saved as a replayable file, and exit status 1.

Infrastructure is not a finding: a backend that cannot be reached (checked before
anything is written), a server that dies or a disk that fills up mid-run is exit 3 naming
the cause, with no program saved and no machine marked failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from rollout_lifecycle.cli.exitcodes import TechnicalError, findings
from rollout_lifecycle.cli.output import (
    Progress,
    check_report_path,
    emit_report,
    ensure_dir,
    make_console,
    quiet_option,
    report_options,
)
from rollout_lifecycle.cli.params import COUNT, SEED, FiniteFloat, StrictInt
from rollout_lifecycle.model.errors import BackendUnavailable, RolloutLifecycleError
from rollout_lifecycle.stateful_tests.backends import (
    check_reachable,
    fuzz_backend,
    resolve_factory,
)
from rollout_lifecycle.stateful_tests.profiles import selected_profile_name
from rollout_lifecycle.stateful_tests.runner import MACHINES as FUZZ_MACHINES
from rollout_lifecycle.stateful_tests.runner import (
    PROFILES,
    CampaignReport,
    InfrastructureFailure,
    ProgressEvent,
    run_campaign,
)


def checked_backend(backend: str, option: str = "--backend") -> str:
    """The backend the machines run on, refused (exit 2) or found unreachable (exit 3)
    before any file is written: `sqlite:///PATH` and `memory://` are taken as every other
    command takes them; a postgresql:// server is connected to once."""
    try:
        name = fuzz_backend(backend)
        resolve_factory(name)
    except (ValueError, RolloutLifecycleError) as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None
    try:
        check_reachable(name)
    except BackendUnavailable as exc:
        raise TechnicalError(f"{option}: {exc}") from None
    except RolloutLifecycleError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None
    return name


def sqlite_url_note(backend: str, name: str, where: Path) -> str | None:
    """What a `sqlite:///PATH` backend means to a fuzz run (said once, not hidden)."""
    if name != "sqlite" or not backend.startswith("sqlite:///") or backend == "sqlite:///":
        return None
    return (
        f"{backend}: the machines run on SQLite, each instance on a fresh file under "
        f"{where}/ (a fuzz run never writes into the file the URL names)"
    )


def stopped(exc: InfrastructureFailure, what: str) -> TechnicalError:
    """Exit 3 for an infrastructure failure: the cause named, said not to be a finding."""
    cause = str(exc).rstrip()
    end = "" if cause.endswith((".", "?", "!")) else "."
    return TechnicalError(
        f"{what} stopped, not a finding: {cause}{end} Nothing was judged as a violation and "
        "no program was saved; fix the backend or free the disk and run again"
    )


def progress_callback(*, quiet: bool) -> Any:
    """A run_campaign progress callback: live on a terminal, a line every few seconds else."""
    if quiet:
        return None
    tick = Progress("fuzz")

    def on(ev: ProgressEvent) -> None:
        budget = f" / {ev.budget_s:.0f}s" if ev.budget_s else ""
        tick(
            f"{ev.machine}: {ev.examples} examples, {ev.steps} steps, {ev.elapsed_s:.0f}s{budget}",
            ev.phase in ("done", "failure"),
        )

    return on


def print_fuzz_report(report: CampaignReport, console: Console) -> None:
    """Runs per machine, coverage per declared machine, invariants, sometimes-properties."""
    runs = Table(
        title=f"fuzz campaign ({report.backend}, profile {report.profile}, seed {report.seed})"
    )
    for col in ("machine", "examples", "steps", "steps/s", "rules fired", "result"):
        runs.add_column(col, justify="left" if col in ("machine", "result") else "right")
    for name, run in report.runs.items():
        fired = sum(1 for n in run.rules.values() if n > 0)
        result = "ok" if run.failure is None else "[bold red]FAILED[/]"
        runs.add_row(
            name,
            f"{run.examples:,}",
            f"{run.steps:,}",
            f"{run.steps_per_s:,.0f}",
            f"{fired}/{len(run.rules)}",
            result,
        )
    console.print(runs)
    cov = Table(title="declared edges covered")
    for col in ("machine", "covered", "never exercised"):
        cov.add_column(col)
    for name, c in report.coverage().items():
        never = [e for e, n in c["edges"].items() if n == 0]
        cov.add_row(name, f"{c['covered']}/{c['declared']}", "\n".join(never) or "-")
    console.print(cov)
    checked = sum(report.invariants.values())
    console.print(
        f"invariant checks: {checked:,} over {len(report.invariants)} named "
        f"invariants; sometimes-properties reached: "
        f"{sum(1 for n in report.sometimes.values() if n)}/{len(report.sometimes)}"
    )
    if report.unreached():
        console.print(f"[yellow]not reached:[/] {', '.join(report.unreached())}")
    for f in report.failures:
        console.print(f"\n[bold red]{f.machine} failed on {f.backend}:[/] {f.exception}")
        console.print(f"shrunk to {f.program_steps} steps; replay with: python {f.program_path}")
        console.print(f.program, highlight=False, markup=False)


@click.command("fuzz")
@click.option(
    "--machine",
    "machines",
    multiple=True,
    type=click.Choice(FUZZ_MACHINES),
    help=f"Machine(s) to fuzz (repeatable). Default: all {len(FUZZ_MACHINES)}.",
)
@click.option(
    "--backend",
    default="sqlite",
    show_default=True,
    help="Ledger backend: memory, sqlite (or a sqlite:///PATH URL: each machine instance "
    "still gets a fresh file under --out), a postgresql:// URL (a fresh schema per "
    "instance), or module:factory for your own ledger.",
)
@click.option(
    "--examples",
    type=COUNT,
    default=None,
    help="Examples per machine (per batch with --time-budget).",
)
@click.option(
    "--time-budget",
    type=FiniteFloat(0.1, 7 * 86_400.0),
    default=None,
    help="Seconds to spend in all; batches with fresh seeds until spent.",
)
@click.option("--seed", type=SEED, default=None, help="Base seed (runs are repeatable).")
@click.option(
    "--profile",
    type=click.Choice(PROFILES),
    default=None,
    help="Hypothesis settings profile (default: ci when CI is set, else dev).",
)
@click.option(
    "--steps",
    type=StrictInt(1, 100_000),
    default=None,
    help="Steps per example (stateful_step_count).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("fuzz-out"),
    show_default=True,
    help="Work directory: ledger files and saved failing programs.",
)
@report_options
@quiet_option
def fuzz(
    machines: tuple[str, ...],
    backend: str,
    examples: int | None,
    time_budget: float | None,
    seed: int | None,
    profile: str | None,
    steps: int | None,
    out_dir: Path,
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """Fuzz the protocol machines against the spec; exit 1 on a violation."""
    chosen = profile or selected_profile_name()
    check_report_path(report_path)
    # a backend that cannot be used is refused, and one that cannot be reached found out,
    # before --out is created
    name = checked_backend(backend)
    ensure_dir(out_dir, "--out")
    console = make_console(quiet=as_json)
    note = sqlite_url_note(backend, name, out_dir)
    if note is not None:
        console.print(note, markup=False, highlight=False)
    try:
        report = run_campaign(
            list(machines) or list(FUZZ_MACHINES),
            name,
            examples=examples,
            time_budget_s=time_budget,
            seed=seed,
            profile=chosen,
            steps=steps,
            progress=progress_callback(quiet=quiet),
            workdir=out_dir,
        )
    except InfrastructureFailure as exc:
        raise stopped(exc, "fuzz") from None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    print_fuzz_report(report, console)
    emit_report(report.to_json(), as_json=as_json, report_path=report_path, console=console)
    if report.failures:
        raise findings()


__all__ = [
    "checked_backend",
    "fuzz",
    "print_fuzz_report",
    "progress_callback",
    "sqlite_url_note",
    "stopped",
]
