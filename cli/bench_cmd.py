"""`bench`: the benchmark suite, side by side in one run.

The measurements are in cli/benchmarks.py and what is written in cli/bench_report.py, both
imported only when the command runs. It writes bench.json, README.md (the tables) and
admission.png (when matplotlib is installed) into --out, default docs/benchmarks.
Benchmarks are not tests: the command reports every ratio against its goal and exits 0
whether or not the goals were met on this machine.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from rollout_lifecycle.cli.output import make_console, progress_printer
from rollout_lifecycle.model.atomic import check_target
from rollout_lifecycle.model.errors import OutputError

PARTS = (
    "admission",
    "ledgers",
    "checkers",
    "pacing",
    "gate",
    "admit",
    "startup",
    "ledger-check",
    "fleet",
)
FILES = ("bench.json", "README.md", "admission.png")


@click.command("bench")
@click.option("--quick", is_flag=True, help="CI-sized run: seconds, figures not comparable.")
@click.option(
    "--part",
    "parts",
    multiple=True,
    type=click.Choice(PARTS),
    help="Run only these parts (repeatable; default all).",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("docs/benchmarks"),
    show_default=True,
    help="Folder for bench.json, README.md and admission.png (created if missing).",
)
@click.option("--no-docs", is_flag=True, help="Write nothing into --out.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
@click.option(
    "--report",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Also write the JSON report to this file.",
)
@click.option("--quiet", is_flag=True, help="No progress lines on stderr.")
@click.option(
    "--fleet-seconds",
    type=click.FloatRange(min=0.1, max=3600),
    default=None,
    help="fleet: seconds per cell (default 2; 0.3 with --quick). Longer: steadier figures.",
)
@click.option(
    "--fleet-rounds",
    type=click.IntRange(min=1, max=100),
    default=None,
    help="fleet: rounds of every cell, medians reported (default 1).",
)
@click.option(
    "--fleet-dir",
    type=click.Path(path_type=Path, file_okay=False, exists=True),
    default=None,
    help="fleet: folder for the SQLite files on disk (default: the system's temp folder); "
    "tmpfs (/dev/shm) is measured too where it exists.",
)
@click.option(
    "--fleet-postgres",
    metavar="URL",
    default=None,
    help="fleet: also measure PostgreSQL at this URL (a schema per cell, dropped after).",
)
def bench(
    quick: bool,
    parts: tuple[str, ...],
    out: Path,
    no_docs: bool,
    as_json: bool,
    report: Path | None,
    quiet: bool,
    fleet_seconds: float | None,
    fleet_rounds: int | None,
    fleet_dir: Path | None,
    fleet_postgres: str | None,
) -> None:
    """Measure admission, ledgers and checkers against their baselines, and simulate pacing
    (issue 21), in one run.

    Reports ratios measured side by side (goals of issue 13), never pass/fail on time;
    exits 0 whether or not a goal was met.
    """
    try:
        if not no_docs:
            if out.exists() and not out.is_dir():
                raise click.UsageError(f"--out {out} is a file, not a folder")
            out.mkdir(parents=True, exist_ok=True)
            for name in FILES:
                check_target(out / name)
        if report is not None:
            check_target(report)
    except OutputError as exc:
        raise click.UsageError(str(exc)) from None
    except OSError as exc:
        raise click.UsageError(f"--out {out}: {exc}") from None
    console = make_console(stderr=True)
    tick = None if quiet else progress_printer(console, "bench", every_s=0.0)

    def progress(text: str) -> None:
        if tick is not None:
            tick(text, True)

    from rollout_lifecycle.cli import bench_report

    bench_report.run_and_write(
        quick=quick,
        parts=parts or PARTS,
        out=None if no_docs else out,
        report=report,
        as_json=as_json,
        command=_command_line(quick, parts, out, no_docs, fleet_seconds, fleet_rounds),
        progress=progress,
        fleet={
            "seconds": fleet_seconds,
            "rounds": fleet_rounds,
            "folder": fleet_dir,
            "postgres_url": fleet_postgres,
        },
    )


def _command_line(
    quick: bool,
    parts: tuple[str, ...],
    out: Path,
    no_docs: bool,
    fleet_seconds: float | None = None,
    fleet_rounds: int | None = None,
) -> str:
    """The options that shape the figures, as a command someone can run again (the
    PostgreSQL URL is left out: it may hold a password)."""
    args = ["rollout-lifecycle", "bench"]
    args += ["--quick"] if quick else []
    args += [f"--part={p}" for p in parts]
    args += [] if fleet_seconds is None else [f"--fleet-seconds={fleet_seconds:g}"]
    args += [] if fleet_rounds is None else [f"--fleet-rounds={fleet_rounds}"]
    args += (
        ["--no-docs"] if no_docs else ([] if out == Path("docs/benchmarks") else [f"--out={out}"])
    )
    return shlex.join(args)
