"""`activation-drill`: atomic activation across real worker processes under faults.

The command runs `gpu_check.drill` (Ray actors, the small Qwen2 + LoRA model, real
safetensors loads), prints the summary table, writes `drill.json` to `--out`, and exits 1
when the spec finds a violation in the drill's trace: the same audit as `ledger check`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import attrs
import click
from rich import box
from rich.console import Console
from rich.table import Table

from rollout_lifecycle.cli.exitcodes import InputError, TechnicalError, findings
from rollout_lifecycle.cli.output import (
    check_report_path,
    emit_report,
    ensure_dir,
    quiet_option,
    report_options,
    write_json_atomic,
)
from rollout_lifecycle.cli.params import SEED, FiniteFloat, StrictInt
from rollout_lifecycle.model.backends import open_backend, sqlite_path
from rollout_lifecycle.model.errors import BackendUnavailable, RolloutLifecycleError

__all__ = ["activation_drill", "summary_tables"]

FAULT_NAMES = (
    "worker-killed-mid-load",
    "corrupt-artifact",
    "ack-after-retry",
    "previous-version-ack",
    "slow-load",
    "restart-resync",
    "membership-change",
    "coordinator-killed",
)


def _faults(value: str) -> tuple[str, ...]:
    if value.strip() in ("all", "none", ""):
        return FAULT_NAMES if value.strip() == "all" else ()
    names = tuple(x.strip() for x in value.split(",") if x.strip())
    unknown = [n for n in names if n not in FAULT_NAMES]
    if unknown:
        raise click.BadParameter(
            f"unknown fault kind(s) {unknown}; known: {', '.join(FAULT_NAMES)}, or 'all'",
            param_hint="--faults",
        )
    if len(set(names)) != len(names):
        raise click.BadParameter("give each fault kind once", param_hint="--faults")
    return names


def summary_tables(doc: dict[str, Any]) -> list[Table]:
    """The summary as rich tables (also what docs/activation-drill.md shows)."""
    v = doc["versions"]
    head = Table(title="activation drill", box=box.SIMPLE_HEAD)
    head.add_column("what")
    head.add_column("value")
    head.add_row("workers", str(doc["workers"]))
    head.add_row("versions attempted / activated", f"{v['attempted']} / {v['activated']}")
    for stage, n in v["failed_attempts_by_stage"].items():
        head.add_row(f"failed attempts {stage}", str(n))
    for reason, n in doc["acks"].items():
        head.add_row(f"acks {reason}", str(n))
    head.add_row("rollouts / quarantined", f"{doc['rollouts_total']} / {doc['quarantined']}")
    t = doc["time_to_activate_s"]
    for k in ("clean", "faults"):
        head.add_row(f"time to activate, {k} (p50 / max s)", f"{t[k]['p50']} / {t[k]['max']}")
    head.add_row("spec violations", str(doc["spec"]["violations"]))
    head.add_row("wall time (s)", str(doc["wall_s"]))
    if "total_s" in doc:
        head.add_row("with ray.init and shutdown (s)", str(doc["total_s"]))

    faults = Table(title="faults (each on its own version)", box=box.SIMPLE_HEAD)
    for col in ("fault", "ver", "failed at (stage: cause)", "old pointer", "quar.", "retry", "s"):
        faults.add_column(col, no_wrap=True)
    for f in doc["faults"]:
        faults.add_row(
            f["kind"],
            f"v{f['version']}",
            f"{f['stage']}: {f['cause']}",
            "kept" if f["pointer_kept"] else "MOVED",
            str(f["quarantined"]),
            "activated" if f["retry_activated"] else "NOT activated",
            str(f["seconds_to_activate"]),
        )
    per = Table(title="rollouts per version", box=box.SIMPLE_HEAD)
    per.add_column("version")
    per.add_column("by state")
    per.add_column("s to activate")
    for ver, states in doc["rollouts"].items():
        per.add_row(
            ver,
            ", ".join(f"{s} {n}" for s, n in states.items()),
            str(t["per_version"].get(ver, "-")),
        )
    return [head, faults, per]


def _check_backend(url: str) -> None:
    """Open the backend once: it must be reachable and hold no earlier drill."""
    try:
        be = open_backend(url)
    except BackendUnavailable as exc:
        raise TechnicalError(f"--backend: {exc}") from None
    except RolloutLifecycleError as exc:
        raise InputError(f"--backend: {exc}") from None
    try:
        if be.registry.artifacts() or be.ledger.snapshot():
            raise InputError(f"--backend {url}: it already holds a run; give a new database")
    finally:
        be.close()


@click.command("activation-drill")
@click.option(
    "--workers",
    type=StrictInt(3, 64),
    default=3,
    show_default=True,
    help="Generation workers (Ray actors, one process each).",
)
@click.option(
    "--versions",
    type=StrictInt(1, 1000),
    default=None,
    help="Versions after v0 [default: one per fault, plus two clean ones].",
)
@click.option(
    "--faults",
    "faults_text",
    default="all",
    show_default=True,
    help=f"Comma-separated fault kinds, each on its own version ('all' or 'none'): "
    f"{', '.join(FAULT_NAMES)}.",
)
@click.option(
    "--backend",
    "url",
    default=None,
    help="Ledger/registry URL: sqlite:///PATH (a new file) or postgresql://... "
    "[default: sqlite:///OUT/drill.db].",
)
@click.option(
    "--seed",
    type=SEED,
    default=0,
    show_default=True,
    help="Chooses the fault order, versions and victims.",
)
@click.option(
    "--address",
    default=None,
    help="Ray cluster address to join (e.g. 10.0.0.1:6379 or auto) [default: a local ray.init].",
)
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder for the model, artifacts, database and drill.json (shared by every node "
    "on a cluster) [default: a new temp dir].",
)
@click.option(
    "--deadline",
    type=FiniteFloat(0.1, 600.0),
    default=2.0,
    show_default=True,
    help="Seconds a load may take before the attempt is failed.",
)
@click.option(
    "--negative-control",
    type=click.Choice(["majority-ack", "serve-before-resync"]),
    default=None,
    help="Inject a protocol bug the spec must catch (exit 1, naming it).",
)
@report_options
@quiet_option
def activation_drill(
    workers: int,
    versions: int | None,
    faults_text: str,
    url: str | None,
    seed: int,
    address: str | None,
    out: Path | None,
    deadline: float,
    negative_control: str | None,
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """Activate policy versions across Ray workers under faults; judge the trace by the spec.

    Needs the [verl] extra (ray, torch, transformers, peft): without it, exit 3 saying so,
    before anything is written."""
    from rollout_lifecycle.gpu_check.drill import DrillConfig, DrillError, run_drill
    from rollout_lifecycle.gpu_check.errors import ControlError, ExtraMissing, TechnicalFailure
    from rollout_lifecycle.gpu_check.extra import require_drill_modules

    check_report_path(report_path)
    faults = _faults(faults_text)
    plan = DrillConfig(
        out=Path("."),
        workers=workers,
        versions=versions,
        faults=faults,
        backend_url=url,
        seed=seed,
        address=address,
        negative_control=negative_control,
        deadline_s=deadline,
    )
    try:  # every combination is judged before a file is written or Ray starts
        plan.check()
    except ControlError as exc:
        raise InputError(str(exc)) from None
    try:  # a missing module would otherwise surface as a traceback inside a Ray actor
        require_drill_modules()
    except ExtraMissing as exc:
        raise TechnicalError(str(exc)) from None
    out = (
        ensure_dir(out, "--out")
        if out is not None
        else Path(tempfile.mkdtemp(prefix="rollout-lifecycle-drill-"))
    )
    if url is None and (out / "drill.db").exists():
        raise InputError(f"--out {out}: drill.db already exists; give a new folder")
    if url is not None and url.startswith("sqlite:"):
        try:
            if sqlite_path(url).exists():
                raise InputError(f"--backend {url}: the file exists; the drill writes a new one")
        except RolloutLifecycleError as exc:
            raise InputError(f"--backend: {exc}") from None
    if url is not None and url.startswith("memory:"):
        raise InputError(
            "--backend: every worker process opens the backend: give sqlite:/// or "
            "postgresql://, not memory://"
        )
    if url is not None:  # a bad URL, an unreachable server or a used database: before Ray
        _check_backend(url)
    if (out / "artifacts").is_dir() and any((out / "artifacts").iterdir()):
        raise InputError(f"--out {out}: artifacts/ is not empty; artifacts are immutable")
    cfg = attrs.evolve(plan, out=out)

    def say(message: str) -> None:
        if not quiet:
            click.echo(message, err=True)  # progress: stderr, as for every command

    try:
        doc = run_drill(cfg, say)
    except ControlError as exc:
        raise InputError(str(exc)) from None
    except (TechnicalFailure, BackendUnavailable) as exc:
        raise TechnicalError(f"activation drill: {exc}") from None
    except DrillError as exc:
        raise TechnicalError(f"activation drill did not run as planned: {exc}") from None
    except RolloutLifecycleError as exc:
        raise TechnicalError(f"activation drill: {exc}") from None
    write_json_atomic(out / "drill.json", doc)
    violations = doc["spec"]["violations"]
    shown = doc["spec"]["first_violations"]
    probe = Console()
    console = Console(width=None if probe.is_terminal else 120, quiet=as_json)
    if not as_json:
        for table in summary_tables(doc):
            console.print(table)
        for v in shown[:20]:
            click.echo(f"VIOLATION {v}")
        click.echo(
            f"spec: replayed {doc['spec']['events']} events against {doc['spec']['invariants']} "
            f"checks: {violations} violations"
            + (f" ({', '.join(doc['spec']['by_invariant'])})" if violations else "")
        )
        click.echo(f"result: {out / 'drill.json'}")
    emit_report(doc, as_json=as_json, report_path=report_path, console=console)
    if violations:
        raise findings()
