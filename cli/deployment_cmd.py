"""`deployment`: the durable state every learner and coordinator of a deployment is judged by.

The admission policy (L_max, D_max) is deployment state, like the required worker set: it
is set by a recorded step (`set-policy`), and every reservation is judged against it inside
its own atomic step, whatever a learner was configured with. `show` prints that state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from rollout_lifecycle.cli.exitcodes import InputError
from rollout_lifecycle.cli.ledger_cmd import _opened, backend_option
from rollout_lifecycle.cli.output import (
    check_report_path,
    emit_report,
    make_console,
    quiet_option,
    report_options,
)
from rollout_lifecycle.model.backends import Backend
from rollout_lifecycle.model.records import CHAIN_KEYS, LINEAGE_MODES, AdmissionPolicy, to_jsonable
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.model.rules import retired_versions

__all__ = ["deployment"]


def _drift(_ctx: click.Context, _param: click.Parameter, value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise click.BadParameter(f"must be a finite number >= 0, got {value}")
    return value


@click.group("deployment")
def deployment() -> None:
    """The deployment's durable state: admission policy, pointer, workers, retired versions."""


@deployment.command("set-policy")
@backend_option
@click.option(
    "--max-lag",
    type=click.IntRange(0, 2**63 - 1),
    required=True,
    help="L_max: the most versions a trained rollout may lag the active version.",
)
@click.option(
    "--max-drift",
    type=float,
    required=True,
    callback=_drift,
    help="D_max: the largest mean |log-ratio| over action tokens a rollout may drift.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(1, 2**63 - 1),
    default=None,
    help="Rollouts per update: turns on the dispatch budget of (max_lag + 1) x batch_size "
    "live rollouts (ledger.dispatch refuses 'no_capacity' beyond it). Default: no budget.",
)
@click.option(
    "--max-attempts",
    type=click.IntRange(1, 2**63 - 1),
    default=None,
    help="The most attempts per prompt chain (a stale attempt is retired and its prompt "
    "requeued up to this many times). Default: unbounded.",
)
@click.option(
    "--lineage",
    type=click.Choice(LINEAGE_MODES),
    default="ledger",
    show_default=True,
    help="'ledger': a version's lineage is read from the ledger (its landed updates no "
    "version claims) and every update it names must have landed, unpoisoned and unclaimed; "
    "'off': the recorded opt-out, a version records what it is given, unfenced.",
)
@click.option(
    "--chain-key",
    type=click.Choice(CHAIN_KEYS),
    default="identity",
    show_default=True,
    help="What a prompt's attempts are counted by: 'identity' (its dataset, prompt id and "
    "sample index) or 'caller' (the chain key a generator passes to ledger.dispatch).",
)
@click.option(
    "--reason",
    default="set by the operator (rollout-lifecycle deployment set-policy)",
    show_default=True,
    help="Why, recorded in the trace with the change.",
)
@report_options
@quiet_option
def set_policy(
    url: str,
    max_lag: int,
    max_drift: float,
    batch_size: int | None,
    max_attempts: int | None,
    lineage: str,
    chain_key: str,
    reason: str,
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """Record the admission policy every reservation of this deployment is judged by."""
    del quiet  # one write, no progress to silence: accepted like on every command
    if not reason.strip():
        raise click.BadParameter("must not be empty", param_hint="--reason")
    check_report_path(report_path)
    with _opened(url, create=True) as b:
        before = b.registry.policy()
        wanted = AdmissionPolicy(max_lag, max_drift, batch_size, max_attempts, lineage, chain_key)
        after = set_admission_policy(b.registry, wanted, reason)
    data = {
        "changed": before != after,
        "before": None if before is None else to_jsonable(before),
        "policy": to_jsonable(after),
    }
    emit_report(data, as_json=as_json, report_path=report_path, console=make_console(True))
    if as_json:
        return
    if before == after:
        click.echo(f"policy unchanged: {_described(after)}")
    else:
        was = "none" if before is None else _described(before)
        click.echo(f"policy recorded: {_described(after)} (was: {was})")


def _described(p: AdmissionPolicy | Mapping[str, Any]) -> str:
    """max_lag and max_drift, and the pacing bounds where set."""
    d = to_jsonable(p) if isinstance(p, AdmissionPolicy) else p
    out = f"max_lag {d['max_lag']}, max_drift {d['max_drift']}"
    if d.get("batch_size") is not None:
        out += f", batch_size {d['batch_size']}"
    if d.get("max_attempts") is not None:
        out += f", max_attempts {d['max_attempts']}"
    out += f", lineage {d.get('lineage', 'ledger')}, chain_key {d.get('chain_key', 'identity')}"
    return out


def _state(b: Backend) -> dict[str, Any]:
    reg = b.registry
    arts = reg.artifacts()
    policy = reg.policy()
    return {
        # the lineage and chain-key modes shown even at their defaults: an opt-out is visible
        "policy": None
        if policy is None
        else {**to_jsonable(policy), "lineage": policy.lineage, "chain_key": policy.chain_key},
        "pointer": to_jsonable(reg.pointer()),
        "required_workers": reg.required_workers(),
        "artifacts": {str(a.version): a.state for a in arts},
        "retired_versions": sorted(retired_versions(arts)),
        "bad_versions": sorted(b.ledger.bad_versions),
    }


@deployment.command("show")
@backend_option
@report_options
@quiet_option
def show(url: str, as_json: bool, report_path: Path | None, quiet: bool) -> None:
    """Print the deployment's recorded policy, pointer, worker set and versions."""
    del quiet  # one read, no progress to silence: accepted like on every command
    check_report_path(report_path)
    with _opened(url) as b:
        state = _state(b)
    emit_report(state, as_json=as_json, report_path=report_path, console=make_console(True))
    if as_json:
        return
    pol = state["policy"]
    click.echo(
        "admission policy: "
        + (
            "none recorded (every reservation is refused; set one with set-policy)"
            if pol is None
            else _described(pol)
        )
    )
    ptr = state["pointer"]
    click.echo(
        "active version:   "
        + ("none" if ptr is None else f"v{ptr['version']} ({ptr['artifact_hash'][:16]}...)")
    )
    workers = state["required_workers"]
    click.echo("required workers: " + ("none recorded" if not workers else ", ".join(workers)))
    arts = state["artifacts"]
    click.echo(
        "versions:         "
        + (", ".join(f"v{v} {s}" for v, s in arts.items()) if arts else "none registered")
    )
    retired = state["retired_versions"]
    click.echo("retired (rolled back): " + (", ".join(f"v{v}" for v in retired) or "none"))


@deployment.command("lineage")
@click.argument("version", type=click.IntRange(0, 2**63 - 1))
@backend_option
@report_options
@quiet_option
def lineage(version: int, url: str, as_json: bool, report_path: Path | None, quiet: bool) -> None:
    """Show what VERSION contains: its parents, the updates it records, their rollouts."""
    del quiet  # one read, no progress to silence: accepted like on every command
    check_report_path(report_path)
    with _opened(url) as b:
        chain = []
        rec = b.registry.artifact(version)
        if rec is None:
            raise InputError(f"v{version} is not registered in this deployment")
        seen: set[int] = set()
        while rec is not None and rec.version not in seen:
            seen.add(rec.version)
            chain.append(rec)
            rec = None if rec.parent_version is None else b.registry.artifact(rec.parent_version)
        wanted = {u for r in chain for u in r.trained_by}
        consumed: dict[str, list[str]] = {u: [] for u in sorted(wanted)}
        for ev in b.ledger.history():
            if ev.event == "commit" and ev.update_id in consumed:
                consumed[ev.update_id].append(ev.rollout_id)
        statuses = {u: _status(b, u) for u in consumed}
    data = {
        "version": version,
        "chain": [
            {
                "version": r.version,
                "state": r.state,
                "parent_version": r.parent_version,
                "trained_by": list(r.trained_by),
            }
            for r in chain
        ],
        "updates": {
            u: {"landed": bool(ids), "rollouts": ids, "status": statuses[u]}
            for u, ids in consumed.items()
        },
    }
    emit_report(data, as_json=as_json, report_path=report_path, console=make_console(True))
    if as_json:
        return
    for r in chain:
        updates = ", ".join(r.trained_by) or "no recorded updates"
        click.echo(f"v{r.version} ({r.state}): trained by {updates}")
    for u, ids in consumed.items():
        shown = ", ".join(ids[:10]) + (f" (+{len(ids) - 10} more)" if len(ids) > 10 else "")
        click.echo(
            f"  {u} ({statuses[u]}): "
            + (f"{len(ids)} rollouts: {shown}" if ids else "NO landed commit")
        )


def _status(b: Backend, update_id: str) -> str:
    """The ledger's record of an update: open, landed, poisoned (cause), or unknown."""
    rec = b.ledger.update(update_id)
    if rec is None:
        return "not recorded"
    return rec.status if rec.cause is None else f"{rec.status}: {rec.cause}"
