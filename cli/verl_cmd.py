"""`verl setup`: record a verl run's admission policy on ITS ledger and print the overrides.

One command instead of a dozen hand-copied keys: the policy goes into the ledger the run
names (`--backend` is required, so nothing lands in a default file by accident), and the
printed overrides switch verl's v1 trainer onto the ledger through the config group shipped
in the package (`+rollout_lifecycle=ledger`, gpu_check/verl_config). Nothing of verl is
imported here.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

import click

from rollout_lifecycle.cli.deployment_cmd import _writable_deployment
from rollout_lifecycle.cli.ledger_cmd import _opened
from rollout_lifecycle.cli.output import (
    check_report_path,
    emit_report,
    make_console,
    quiet_option,
    report_options,
)
from rollout_lifecycle.gpu_check.verl_config import GROUP, OPTION, SEARCHPATH
from rollout_lifecycle.model.records import AdmissionPolicy, to_jsonable
from rollout_lifecycle.model.registry import set_admission_policy

__all__ = ["overrides", "verl"]

_RUN_ID = re.compile(r"^[A-Za-z0-9-]+$")


def overrides(url: str, run_id: str, artifact_root: str) -> list[str]:
    """The verl overrides that put a run on the ledger (the config group carries the rest)."""
    return [
        f"hydra.searchpath=[{SEARCHPATH}]",
        f"+{GROUP}={OPTION}",
        f"{GROUP}.ledger_url={url}",
        f"{GROUP}.run_id={run_id}",
        f"{GROUP}.artifact_root={artifact_root}",
    ]


@click.group("verl")
def verl() -> None:
    """verl's v1 trainer on the ledger: record a run's policy on its ledger, print the
    overrides.

    docs/verl-v1.md explains the config group the overrides switch on."""


def _finite(_ctx: click.Context, _param: click.Parameter, value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise click.BadParameter(f"must be a finite number >= 0, got {value}")
    return value


def _run_id(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    if not _RUN_ID.match(value):
        raise click.BadParameter(
            "letters, digits and '-' only (update ids are {run}.s{step}.m{mini}; verl splits "
            "keys on '_')"
        )
    return value


@verl.command("setup")
@click.option(
    "--backend",
    "url",
    required=True,
    help="The run's ledger URL, reachable from every verl process: sqlite:////abs/ledger.db "
    "or postgresql://... (a SQLite file is created if absent; an existing one must hold "
    "this project's ledger).",
)
@click.option("--run-id", required=True, callback=_run_id, help="Names this run's updates.")
@click.option(
    "--artifact-root",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="A directory every verl process reads: where published weight versions go.",
)
@click.option("--max-lag", type=click.IntRange(0, 2**63 - 1), required=True)
@click.option("--max-drift", type=float, required=True, callback=_finite)
@click.option(
    "--batch-size",
    type=click.IntRange(1, 2**63 - 1),
    default=None,
    help="Prompt groups per step: turns on the dispatch budget of (max_lag + 1) x batch_size "
    "live groups, which the agent-loop manager asks before verl generates.",
)
@click.option("--max-attempts", type=click.IntRange(1, 2**63 - 1), default=None)
@report_options
@quiet_option
def setup(
    url: str,
    run_id: str,
    artifact_root: Path,
    max_lag: int,
    max_drift: float,
    batch_size: int | None,
    max_attempts: int | None,
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """Record the admission policy on the run's ledger, then print verl's overrides."""
    del quiet
    check_report_path(report_path)
    wanted = AdmissionPolicy(max_lag, max_drift, batch_size, max_attempts)
    # as `deployment set-policy --create`: a new file is created, an existing one must hold
    # this project's ledger (an empty file or another application's database is refused)
    _writable_deployment(url, create=True)
    with _opened(url, create=True) as b:
        policy = set_admission_policy(b.registry, wanted, f"verl setup of run {run_id}")
        canonical = b.url
    keys = overrides(canonical, run_id, str(artifact_root.resolve()))
    data = {"backend": canonical, "policy": to_jsonable(policy), "overrides": keys}
    emit_report(data, as_json=as_json, report_path=report_path, console=make_console(True))
    if as_json:
        return
    click.echo(f"# policy recorded on {canonical}: {to_jsonable(policy)}", err=True)
    click.echo(" \\\n".join(shlex.quote(k) for k in keys))
