"""`gpu-check preflight|run`: the real-run check through verl 0.9.1's worker path.

Nothing heavy is imported until a sub-command runs, so the rest of the CLI works without
the `[verl]` extra; without it both sub-commands say exactly what to install (exit 3).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rollout_lifecycle.cli import exitcodes
from rollout_lifecycle.cli.exitcodes import InputError, TechnicalError
from rollout_lifecycle.cli.output import (
    check_report_path,
    emit_report,
    make_console,
    quiet_option,
    report_options,
)
from rollout_lifecycle.gpu_check.errors import (
    ControlError,
    ExtraMissing,
    ModelAssetsError,
    TechnicalFailure,
)
from rollout_lifecycle.gpu_check.evidence import EvidenceError

DEFAULT_OUTPUT = Path("gpu-check-results")


def _common(fn: Callable[..., Any]) -> Callable[..., Any]:
    for opt in reversed(
        (
            click.option(
                "--run-label",
                required=True,
                help="Names the result (LABEL.json and the LABEL/ folder); never reused.",
            ),
            click.option(
                "--output",
                "output",
                type=click.Path(file_okay=False, path_type=Path),
                default=DEFAULT_OUTPUT,
                show_default=True,
                help="Folder for results (created if missing).",
            ),
            click.option(
                "--model",
                "model",
                type=click.Path(path_type=Path),
                default=None,
                help="Local folder of the model to train (e.g. Qwen2.5-0.5B-Instruct); "
                "default: a small Qwen2 model built here from a config (seed 42).",
            ),
            click.option(
                "--device",
                type=click.Choice(["auto", "cuda", "cpu"]),
                default="auto",
                show_default=True,
                help="auto: cuda when torch sees a CUDA device, else cpu.",
            ),
        )
    ):
        fn = opt(fn)
    return quiet_option(report_options(fn))  # --json, --report, --quiet as on every command


@contextlib.contextmanager
def _console_progress(quiet: bool) -> Iterator[Callable[[str], None]]:
    """Progress lines on the terminal's stderr, even while verl's output is redirected."""
    if quiet:
        yield lambda _m: None
        return
    stream: TextIO = os.fdopen(os.dup(2), "w", buffering=1)
    try:
        yield lambda m: print(f"gpu-check: {m}", file=stream)
    finally:
        stream.close()


@click.group("gpu-check")
def gpu_check() -> None:
    """The real-run check: one verl update, judged by the spec's invariants (CPU or GPU)."""


@gpu_check.command("preflight")
@_common
def preflight(
    run_label: str,
    output: Path,
    model: Path | None,
    device: str,
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """Versions, memory, model assets and CPU checks of the loss; exit 0 ready, 4 weights only."""
    from rollout_lifecycle.gpu_check.preflight import run_preflight

    check_report_path(report_path)

    log_fd, log = tempfile.mkstemp(prefix="gpu-check-preflight-", suffix=".log")
    os.close(log_fd)
    try:
        with _console_progress(quiet) as say, _redirected(log):
            report = run_preflight(
                run_label=run_label, output_root=output, model=model, device=device, progress=say
            )
    finally:
        Path(log).unlink(missing_ok=True)
    emit_report(
        report.to_json(), as_json=as_json, report_path=report_path, console=make_console(True)
    )
    if not as_json:
        table = Table(title="gpu-check preflight")
        for col in ("item", "status", "detail"):
            table.add_column(col)
        colour = {"ok": "green", "fail": "red", "weights_missing": "yellow", "skipped": "dim"}
        for i in report.items:
            table.add_row(i.name, f"[{colour[i.status]}]{i.status}[/]", escape(i.detail))
        Console(width=None if sys.stdout.isatty() else 140).print(table)
        verdict = {
            0: "ready",
            4: "only the model weights are missing",
        }.get(report.exit_code, "not ready")
        click.echo(f"preflight: {verdict} (exit {report.exit_code})")
    if report.exit_code:
        raise click.exceptions.Exit(report.exit_code)


@contextlib.contextmanager
def _redirected(path: str) -> Iterator[None]:
    from rollout_lifecycle.gpu_check.platform import output_to

    with output_to(path):
        yield


@gpu_check.command("run")
@_common
@click.option(
    "--control-stale-generation-copy",
    "c_stale",
    is_flag=True,
    help="Negative control: the sync's tensors are never written into the generation copy.",
)
@click.option(
    "--control-version-before-load",
    "c_early",
    is_flag=True,
    help="Negative control: the version is announced before the weights are loaded.",
)
@click.option(
    "--control-ack-registered-hash",
    "c_ack",
    is_flag=True,
    help="Negative control: a tensor is lost and the ack echoes the registered hash.",
)
def run(
    run_label: str,
    output: Path,
    model: Path | None,
    device: str,
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
    c_stale: bool,
    c_early: bool,
    c_ack: bool,
) -> None:
    """Train one verl update, sync it, judge it; write LABEL.json (never overwritten).

    Exit 0 when every check passed, 1 when a check failed (a negative control always
    fails its checks: the summary says whether they were exactly the expected ones),
    3 on a technical failure, 4 when only the model weights are missing.
    """
    flags = {
        "stale-generation-copy": c_stale,
        "version-before-load": c_early,
        "ack-registered-hash": c_ack,
    }
    chosen = [name for name, on in flags.items() if on]
    if len(chosen) > 1:
        raise click.UsageError(f"one negative control per run, got {', '.join(chosen)}")
    check_report_path(report_path)
    from rollout_lifecycle.gpu_check.experiment import RunConfig, run_experiment

    try:
        config = RunConfig(
            run_label=run_label,
            output_root=output,
            device=device,
            model_path=model,
            control=chosen[0] if chosen else None,
        )
        with _console_progress(quiet) as say:
            outcome = run_experiment(config, progress=say)
    except ExtraMissing as exc:
        raise TechnicalError(str(exc)) from None
    except ModelAssetsError as exc:
        if exc.only_weights_missing:
            click.echo(f"error: {exc}", err=True)
            raise click.exceptions.Exit(exitcodes.MODEL_MISSING) from None
        raise InputError(str(exc)) from None
    except (EvidenceError, ControlError) as exc:
        raise InputError(str(exc)) from None
    except TechnicalFailure as exc:
        raise TechnicalError(str(exc)) from None
    doc = outcome.doc
    summary = _summary(outcome.path, doc, outcome.technical)
    emit_report(summary, as_json=as_json, report_path=report_path, console=make_console(True))
    if not as_json and not quiet:
        _print(summary, doc)
    if outcome.technical:
        raise click.exceptions.Exit(exitcodes.TECHNICAL)
    if summary["failed_checks"]:
        raise exitcodes.findings()


def _summary(path: Path, doc: dict[str, Any], technical: tuple[str, ...]) -> dict[str, Any]:
    groups = {}
    for g in doc.get("groups", []):
        if "update" not in g:
            groups[g["group"]] = {"trained": False, "why": g.get("skipped")}
            continue
        admission = g["decision"]["admission"]
        groups[g["group"]] = {
            "trained": True,
            "initial_adapter_sha256": g["initialization"]["adapter_sha256"],
            "after_sha256": g["update"]["after_sha256"],
            "grad_norm": g["update"]["grad_norm"],
            "loss": g["update"]["loss"],
            "delta_l2": g["update"]["delta_l2"],
            "gradient_delta_l2": g["update"]["gradient_delta_l2"],
            "weight_decay_delta_l2": g["update"]["weight_decay_delta_l2"],
            "changed_tensors": g["update"]["changed_tensors"],
            "gradient_changed_tensors": g["update"]["gradient_changed_tensors"],
            "weight_decay_only_tensors": g["update"]["weight_decay_only_tensors"],
            "same_version_before": g["decision"]["comparisons"]["same_version_before"],
            "same_version_after": g["decision"]["comparisons"]["same_version_after"],
            "admitted": sum(r["accepted"] for r in admission),
            "rejected": sum(not r["accepted"] for r in admission),
            "pointer_after": g["protocol"]["pointer_after"],
            "invariants_held": len(g["invariants"]["held"]),
            "invariants_checked": len(g["invariants"]["checked"]),
            "timings_s": g.get("timings_s", {}),
        }
    return {
        "result": str(path),
        "run_label": doc["run_label"],
        "device": doc.get("device"),
        "passed": doc["passed"],
        "failed_checks": doc["failed_checks"],
        "checks": len(doc["checks"]),
        "technical": list(technical),
        "negative_control": doc.get("negative_control"),
        "groups": groups,
        "timings_s": doc.get("timings_s"),
    }


def _print(summary: dict[str, Any], doc: dict[str, Any]) -> None:
    console = Console(width=None if sys.stdout.isatty() else 140)
    table = Table(title=f"gpu-check run {summary['run_label']}")
    for col in ("check", "result", "detail"):
        table.add_column(col)
    for c in doc["checks"]:
        table.add_row(
            c["name"], "[green]pass[/]" if c["passed"] else "[red]FAIL[/]", escape(c["detail"])
        )
    console.print(table)
    for name, g in summary["groups"].items():
        if not g["trained"]:
            console.print(f"{name}: not trained ({g['why']})")
            continue
        console.print(
            f"{name}: grad_norm {g['grad_norm']:.5g}, delta_l2 {g['delta_l2']:.5g} "
            f"(gradient {g['gradient_delta_l2']:.5g} in {g['gradient_changed_tensors']} tensors, "
            f"weight decay only {g['weight_decay_delta_l2']:.3g} in "
            f"{g['weight_decay_only_tensors']}); same-version after: max "
            f"{g['same_version_after']['max_abs_error']:.3g} mean "
            f"{g['same_version_after']['mean_abs_error']:.3g}; admitted {g['admitted']}, "
            f"rejected {g['rejected']}; invariants {g['invariants_held']}/"
            f"{g['invariants_checked']} held",
            highlight=False,
        )
    for t in summary["technical"]:
        console.print(f"[red]technical failure[/]: {escape(t)}")
    ctl = summary["negative_control"]
    if ctl:
        state = "exactly the expected checks failed" if ctl["as_expected"] else "NOT as expected"
        console.print(f"negative control {ctl['name']}: {state}")
    console.print(f"result: {escape(summary['result'])}", highlight=False)


def _register_train() -> None:
    from rollout_lifecycle.cli.train_cmd import train

    gpu_check.add_command(train)


_register_train()
