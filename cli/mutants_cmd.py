"""`mutants`: run the mutation catalogue and show who killed what.

Each mutant is a realistic protocol bug (most of them shipped by a peer framework) injected
by patching model/ at run time. The table says, per mutant, whether the fuzzer killed it and
after how many examples, whether the explorer killed it and after how many states, whether
the campaign at `--profile` (fast by default: what `make campaign` runs) killed it and in
which of its stages, and how long each took. Any survivor makes the command exit 1.
"""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from rollout_lifecycle.cli.exitcodes import InputError, findings
from rollout_lifecycle.cli.output import (
    Progress,
    check_report_path,
    emit_report,
    ensure_dir,
    make_console,
    quiet_option,
    report_options,
)
from rollout_lifecycle.cli.params import COUNT, SEED
from rollout_lifecycle.stateful_tests.campaign_profiles import DEFAULT_PROFILE, PROFILES
from rollout_lifecycle.stateful_tests.mutants import BY_NAME, CATALOGUE, CLASSES
from rollout_lifecycle.stateful_tests.mutation import MutantResult, run_catalogue, summary


def _cell(k: object) -> str:
    from rollout_lifecycle.stateful_tests.mutation import Kill

    assert isinstance(k, Kill)
    if k.killed is None:
        return "n/a"
    if not k.killed:
        return f"[bold red]SURVIVED[/] ({k.effort:,} {k.unit})"
    return f"{k.effort:,} {k.unit}, {k.seconds:.1f}s"


def print_mutants(
    results: list[MutantResult], console: Console, profile: str = DEFAULT_PROFILE
) -> None:
    """One row per mutant, then kill rates and median time to kill."""
    table = Table(title="mutation catalogue")
    for col in (
        "mutant",
        "class",
        "peer bug",
        "killed by",
        "fuzzer",
        "explorer",
        f"campaign ({profile})",
        "campaign stage",
    ):
        table.add_column(col)
    for r in results:
        table.add_row(
            r.name,
            r.klass,
            "-" if r.peer_bug is None else f"#{r.peer_bug}",
            ", ".join(r.killed_by) or "[bold red]nobody[/]",
            _cell(r.fuzz),
            _cell(r.explore),
            _cell(r.campaign),
            r.campaign.stage or "-",
        )
    console.print(table)
    s = summary(results)
    for checker in ("fuzz", "explore", "campaign"):
        c = s[checker]
        if not c["reached"]:
            continue
        console.print(
            f"{checker}: killed {c['killed']}/{c['reached']} it reaches; median "
            f"time to kill {c['median_seconds_to_kill']}s"
        )
    console.print(f"killed by at least one checker: {s['killed_by_any']}/{s['mutants']}")
    if s["campaign_kills_by_stage"]:
        console.print(
            f"campaign ({profile}) kills by stage: "
            + ", ".join(f"{k} {n}" for k, n in s["campaign_kills_by_stage"].items())
        )
    per = Table(title=f"per class: killed by the campaign ({profile} profile)")
    for col in ("class", "what it is", "mutants", "campaign reached", "campaign killed"):
        per.add_column(col)
    for klass, row in s["by_class"].items():
        per.add_row(
            klass,
            CLASSES.get(klass, ""),
            str(row["mutants"]),
            str(row["campaign_reached"]),
            str(row["campaign_killed"]),
        )
    console.print(per)


@click.command("mutants")
@click.option(
    "--only",
    "only",
    multiple=True,
    type=click.Choice(sorted(BY_NAME)),
    help="Run only these mutants (repeatable).",
)
@click.option(
    "--checker",
    type=click.Choice(["all", "both", "fuzz", "explore", "campaign"]),
    default="all",
    show_default=True,
    help="all: fuzzer, explorer and the campaign; both: fuzzer and explorer.",
)
@click.option(
    "--profile",
    "profile_name",
    type=click.Choice(sorted(PROFILES)),
    default=DEFAULT_PROFILE,
    show_default=True,
    help="The campaign profile whose stages (and budgets) the campaign checker runs.",
)
@click.option(
    "--examples",
    type=COUNT,
    default=300,
    show_default=True,
    help="Fuzzer examples per mutant before it counts as a survivor.",
)
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the fuzzer's work files (failing programs) here.",
)
@click.option(
    "--postgres",
    "postgres_url",
    default=None,
    metavar="URL",
    help="A PostgreSQL server (postgresql://...) for the campaign of mutants of PostgreSQL "
    "code (each run gets a fresh schema); without it they are not reached (n/a).",
)
@report_options
@quiet_option
def mutants(
    only: tuple[str, ...],
    checker: str,
    profile_name: str,
    examples: int,
    seed: int,
    out_dir: Path | None,
    postgres_url: str | None,
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """Kill every mutant of the catalogue with the fuzzer and the explorer; exit 1 on a survivor."""
    check_report_path(report_path)
    if postgres_url is not None and not postgres_url.startswith(("postgresql://", "postgres://")):
        raise InputError(f"--postgres takes a postgresql:// URL, got {postgres_url!r}")
    if out_dir is not None:
        ensure_dir(out_dir, "--out")
    chosen = [BY_NAME[n] for n in only] if only else list(CATALOGUE)
    console = make_console(quiet=as_json)
    tick = Progress("mutants", quiet=quiet, every_s=0.0)
    done = [0]

    def on_result(r: MutantResult) -> None:
        done[0] += 1
        stage = f" (campaign: {r.campaign.stage})" if r.campaign.stage else ""
        tick(
            f"{done[0]}/{len(chosen)} {r.name}: killed by "
            f"{', '.join(r.killed_by) or 'nobody'}{stage}",
            done[0] == len(chosen),
        )

    results = run_catalogue(
        chosen,
        fuzz=checker in ("all", "both", "fuzz"),
        explorer=checker in ("all", "both", "explore"),
        campaign=checker in ("all", "campaign"),
        seed=seed,
        max_examples=examples,
        workdir=out_dir,
        on_result=on_result,
        postgres_url=postgres_url,
        profile=profile_name,
    )
    print_mutants(results, console, profile_name)
    data = {
        "schema": "rollout-lifecycle/mutants-report/1",
        "campaign_profile": profile_name,
        "results": [r.to_json() for r in results],
        "summary": summary(results),
    }
    emit_report(data, as_json=as_json, report_path=report_path, console=console)
    if any(r.survived for r in results):
        raise findings()


__all__ = ["mutants", "print_mutants"]
