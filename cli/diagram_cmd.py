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
from rollout_lifecycle.cli.output import ensure_dir
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
) -> None:
    """Draw the lifecycle/activation machines as Mermaid, DOT, SVG or PNG."""
    if write_dir is not None:
        ensure_dir(write_dir, "--write-docs")
    coverage = None if coverage_path is None else _load_coverage(coverage_path)
    try:
        if check_dir is not None or write_dir is not None:
            _docs_mode(check_dir, write_dir, coverage, dot_path, out)
            return
        _draw(machine_name, fmt, engine or FORMAT_ENGINE[fmt], coverage, out, dot_path, force)
    except GraphvizNotFound as exc:
        raise TechnicalError(str(exc)) from None
    except DiagramError as exc:
        raise InputError(str(exc)) from None


def _docs_mode(
    check_dir: Path | None,
    write_dir: Path | None,
    coverage: dict[str, Any] | None,
    dot_path: Path | None,
    out: Path | None,
) -> None:
    if check_dir is not None and write_dir is not None:
        raise click.UsageError("--check-docs and --write-docs are separate runs; pass one")
    if out is not None:
        raise click.UsageError("--out does not apply to --check-docs/--write-docs")
    if write_dir is not None:
        for path in write_docs(write_dir, coverage, dot_path=dot_path):
            click.echo(f"wrote {path}")
        return
    assert check_dir is not None
    if coverage is not None:
        raise click.UsageError("--check-docs reads each -coverage.json it finds; drop --coverage")
    stale = check_docs(check_dir)
    if not stale:
        click.echo(f"{check_dir}: diagrams match the machines")
        return
    for name in stale:
        click.echo(f"stale: {check_dir / name}")
    click.echo(
        f"{len(stale)} diagram file(s) in {check_dir} no longer match the machines; "
        f"regenerate with `rollout-lifecycle diagram --write-docs {check_dir}` "
        "(add --coverage RUN.json for coverage pictures, or delete stale *-coverage.* files)",
        err=True,
    )
    raise findings()


def _draw(
    machine_name: str,
    fmt: str,
    engine: str,
    coverage: dict[str, Any] | None,
    out: Path | None,
    dot_path: Path | None,
    force: bool = False,
) -> None:
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
    if out is None:
        click.echo("\n".join(data.decode("utf-8") for _, data in drawn), nl=False)
        return
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
        click.echo(f"wrote {path}")


# what a file this command wrote contains near its start: anything else at --out is a file
# of the user's, never replaced without --force
GENERATED_MARKERS = {
    "mermaid": "Generated from model.machines",
    "dot": "Generated from model.machines",
    "svg": "<svg",
    "png": "PNG",  # inside the PNG signature
}
