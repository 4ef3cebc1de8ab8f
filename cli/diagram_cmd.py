"""`diagram`: draw the declared machines, optionally with a fuzz/explore coverage overlay.

Why a thin wrapper: all drawing and validation lives in `spec.diagrams`; this module only
maps options to calls and turns the typed `DiagramError`s into `click.ClickException`s, so
a user sees one clear line (how to install Graphviz, which edge ids are stale) and never a
traceback. The engine defaults from the format (mermaid for mermaid, graphviz otherwise);
it is never swapped for another one when a tool is missing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from rollout_lifecycle.cli.exitcodes import InputError, TechnicalError, findings
from rollout_lifecycle.cli.output import (
    check_report_path,
    emit_report,
    ensure_dir,
    make_console,
    quiet_option,
    report_options,
)
from rollout_lifecycle.model.atomic import atomic_write, check_target
from rollout_lifecycle.model.errors import OutputError
from rollout_lifecycle.model.machines import MACHINES, MachineSpec
from rollout_lifecycle.spec.diagrams import (
    FORMAT_ENGINE,
    FORMATS,
    DiagramError,
    GraphvizNotFound,
    check_docs,
    render,
    write_docs,
)

__all__ = ["diagram"]

_EXTENSIONS = {"mermaid": "mmd", "dot": "dot", "svg": "svg", "png": "png"}


def _load_coverage(path: Path) -> dict[str, Any]:
    """Read a fuzz/explore JSON, refusing missing, unreadable or non-object files plainly."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise click.UsageError(f"--coverage {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise click.UsageError(f"--coverage {path}: cannot read it ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.UsageError(f"--coverage {path}: not valid JSON ({exc})") from None
    except RecursionError:  # hostile nesting: no coverage report is more than a few deep
        raise click.UsageError(
            f"--coverage {path}: nested too deeply to be a coverage report; give the JSON "
            "that `fuzz`, `explore` or `campaign` wrote"
        ) from None
    if not isinstance(data, dict):
        raise click.UsageError(f"--coverage {path}: expected a JSON object")
    return data


def _targets(
    machines: list[MachineSpec], out: Path, ext: str, covered: bool
) -> list[tuple[MachineSpec, Path]]:
    """Where each drawing goes: `out` itself for one machine, `out/<name>.<ext>` for several."""
    suffix = "-coverage" if covered else ""
    if len(machines) == 1 and not out.is_dir():
        return [(machines[0], out)]
    if out.exists() and not out.is_dir():
        raise click.UsageError(f"--out {out}: is a file; --machine all needs a directory")
    return [(m, out / f"{m.name}{suffix}.{ext}") for m in machines]


@click.command("diagram")
@click.option(
    "--machine",
    "machine_name",
    type=click.Choice([*MACHINES, "all"]),
    default="all",
    show_default=True,
    help="Which declared machine to draw.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default="mermaid",
    show_default=True,
    help="Output format; svg and png need Graphviz `dot`.",
)
@click.option(
    "--engine",
    type=click.Choice(sorted(set(FORMAT_ENGINE.values()))),
    default=None,
    help="Drawing engine [default: mermaid for --format mermaid, graphviz otherwise].",
)
@click.option(
    "--coverage",
    "coverage_path",
    type=click.Path(path_type=Path),
    default=None,
    help="fuzz/explore JSON: label edges with counts, mark never-exercised ones.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="File (one machine) or directory (all); text formats go to stdout without it.",
)
@click.option(
    "--dot-path",
    type=click.Path(path_type=Path),
    default=None,
    help="Graphviz `dot` executable [default: `dot` on PATH].",
)
@click.option(
    "--check-docs",
    "check_dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Exit 1 listing committed diagram files in DIR that no longer match the machines.",
)
@click.option(
    "--write-docs",
    "write_dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Regenerate the committed diagram files in DIR (.mmd, .dot, .svg).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace existing files at --out even if they do not look like diagrams.",
)
@report_options
@quiet_option
def diagram(
    machine_name: str,
    fmt: str,
    engine: str | None,
    coverage_path: Path | None,
    out: Path | None,
    dot_path: Path | None,
    check_dir: Path | None,
    write_dir: Path | None,
    force: bool,
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """Draw the lifecycle/activation machines as Mermaid, DOT, SVG or PNG."""
    del quiet  # drawing reports no progress: accepted like on every command
    check_report_path(report_path)
    if write_dir is not None:
        ensure_dir(write_dir, "--write-docs")
    coverage = None if coverage_path is None else _load_coverage(coverage_path)
    # the report: what was drawn or written, or which committed files are stale
    data: dict[str, Any] = {"schema": "rollout-lifecycle/diagram/1"}
    try:
        if check_dir is not None or write_dir is not None:
            data |= _docs_mode(check_dir, write_dir, coverage, dot_path, out, as_json)
        else:
            engine = engine or FORMAT_ENGINE[fmt]
            data |= _draw(machine_name, fmt, engine, coverage, out, dot_path, force, as_json)
    except GraphvizNotFound as exc:
        raise TechnicalError(str(exc)) from None
    except DiagramError as exc:
        raise InputError(str(exc)) from None
    emit_report(data, as_json=as_json, report_path=report_path, console=make_console(True))
    if data.get("stale"):
        raise findings()


def _docs_mode(
    check_dir: Path | None,
    write_dir: Path | None,
    coverage: dict[str, Any] | None,
    dot_path: Path | None,
    out: Path | None,
    as_json: bool = False,
) -> dict[str, Any]:
    say = (lambda _m, err=False: None) if as_json else click.echo
    if check_dir is not None and write_dir is not None:
        raise click.UsageError("--check-docs and --write-docs are separate runs; pass one")
    if out is not None:
        raise click.UsageError("--out does not apply to --check-docs/--write-docs")
    if write_dir is not None:
        written = write_docs(write_dir, coverage, dot_path=dot_path)
        for path in written:
            say(f"wrote {path}")
        return {"mode": "write-docs", "written": [str(p) for p in written], "stale": []}
    assert check_dir is not None
    if coverage is not None:
        raise click.UsageError("--check-docs reads each -coverage.json it finds; drop --coverage")
    if not check_dir.is_dir():  # a usage error, not six "stale" files
        raise click.BadParameter(
            f"{check_dir}: no such folder; give the folder the diagrams were written to",
            param_hint="--check-docs",
        )
    stale = check_docs(check_dir)
    report = {"mode": "check-docs", "written": [], "stale": [str(check_dir / n) for n in stale]}
    if not stale:
        say(f"{check_dir}: diagrams match the machines")
        return report
    for name in stale:
        say(f"stale: {check_dir / name}")
    say(
        f"{len(stale)} diagram file(s) in {check_dir} no longer match the machines; "
        f"regenerate with `rollout-lifecycle diagram --write-docs {check_dir}` "
        "(add --coverage RUN.json for coverage pictures, or delete stale *-coverage.* files)",
        err=True,
    )
    return report


def _draw(
    machine_name: str,
    fmt: str,
    engine: str,
    coverage: dict[str, Any] | None,
    out: Path | None,
    dot_path: Path | None,
    force: bool = False,
    as_json: bool = False,
) -> dict[str, Any]:
    machines = list(MACHINES.values()) if machine_name == "all" else [MACHINES[machine_name]]
    if coverage is not None and "machines" not in coverage and len(machines) > 1:
        raise click.UsageError(
            "a bare edge-id -> count mapping belongs to one machine; "
            "pass --machine lifecycle or --machine activation"
        )
    if out is None and fmt in ("svg", "png"):
        raise click.UsageError(f"--format {fmt} writes an image; pass --out PATH")
    # Draw everything first, so an error (missing dot, stale coverage) writes nothing.
    drawn = [
        (m, render(m, fmt, engine=engine, coverage=coverage, dot_path=dot_path)) for m in machines
    ]
    report: dict[str, Any] = {"mode": "draw", "format": fmt, "written": [], "stale": []}
    if out is None:
        text = {m.name: data.decode("utf-8") for m, data in drawn}
        if as_json:  # stdout carries the report, and the text inside it
            return report | {"text": text}
        click.echo("\n".join(text.values()), nl=False)
        return report
    covered = coverage is not None
    targets = {m.name: p for m, p in _targets(machines, out, _EXTENSIONS[fmt], covered)}
    for path in targets.values():  # every target checked before anything is written
        ensure_dir(path.parent, "--out")
        try:
            check_target(path, force=force, written_by=GENERATED_MARKERS[fmt])
        except OutputError as exc:
            raise click.BadParameter(str(exc), param_hint="--out") from None
    for m, data in drawn:
        path = targets[m.name]
        atomic_write(path, data)
        report["written"].append(str(path))
        if not as_json:
            click.echo(f"wrote {path}")
    return report


# what a file this command wrote contains near its start: anything else at --out is a file
# of the user's, never replaced without --force
GENERATED_MARKERS = {
    "mermaid": "Generated from model.machines",
    "dot": "Generated from model.machines",
    "svg": "<svg",
    "png": "PNG",  # inside the PNG signature
}
