"""`gpu-check train`: verl's v1 trainer for real, with both kills and the resumes, judged.

Nothing heavy is imported until the command runs (verl, Ray and torch load in the run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from rollout_lifecycle.cli import exitcodes
from rollout_lifecycle.cli.output import (
    check_report_path,
    emit_report,
    make_console,
    quiet_option,
    report_options,
)


def verdict(result: dict[str, Any]) -> list[str]:
    """Why a judged run fails the issue's bar (empty: it passes)."""
    t = result["trajectories"]
    bad = []
    if t["lost"]:
        bad.append(f"{t['lost']} trajectories lost")
    if t["trained_twice"]:
        bad.append(f"{t['trained_twice']} trained twice")
    if result["max_lag_trained"] > result["policy"]["max_lag"]:
        bad.append(f"trained at lag {result['max_lag_trained']} > {result['policy']['max_lag']}")
    if result["spec"]["violations"]:
        bad.append(f"{result['spec']['violations']} spec violations")
    kinds = {k["what"] for k in result["kills"]}
    for need in ("trainer", "rollout_replica"):
        if need not in kinds:
            bad.append(f"no SIGKILL of the {need} happened")
    if result["checkpoint_step"] < result["steps"]:
        bad.append(f"verl reached step {result['checkpoint_step']} of {result['steps']}")
    pacing = result.get("pacing", {})
    if not pacing.get("dispatch_refusals"):
        bad.append("the dispatch budget never refused a prompt in verl's loop")
    if pacing.get("never_trained", 0):
        bad.append(f"{pacing['never_trained']} prompt chains ended without ever training")
    bound = result["policy"].get("max_attempts")
    if bound is not None and pacing.get("max_attempts", 0) > bound:
        bad.append(f"a prompt took {pacing['max_attempts']} attempts > {bound}")
    uncounted = result.get("activations", {}).get("survivor_acks_not_counted", [])
    if uncounted:
        bad.append(f"surviving replicas' acks not counted: {uncounted}")
    if result.get("reserved_when_verl_ended", 0):
        bad.append(f"{result['reserved_when_verl_ended']} rollouts still reserved when verl ended")
    return bad


def summary(result: dict[str, Any]) -> str:
    """The run's one-line verdict (docs/verl-v1.md quotes the reference's; a test checks)."""
    bad = result.get("verdict", {}).get("why_not") or verdict(result)
    t = result["trajectories"]
    p = result["pacing"]
    return (
        f"train: {'passed' if not bad else 'FAILED: ' + '; '.join(bad)} | groups dispatched "
        f"{t['dispatched']} consumed {t['consumed']} retired {t['retired']} live {t['live']} "
        f"lost {t['lost']} trained twice {t['trained_twice']} | max lag "
        f"{result['max_lag_trained']} | dispatch refusals {p['dispatch_refusals']} requeued "
        f"{p['requeued']} never trained {p['never_trained']} max attempts "
        f"{p['max_attempts']} | kills {result['kills']}"
    )


@click.command("train")
@click.option(
    "--output",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="A new folder for the run (model, data, ledger, verl checkpoints, logs).",
)
@click.option("--steps", type=click.IntRange(6), default=6, show_default=True)
@click.option("--replicas", type=click.IntRange(2), default=2, show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@report_options
@quiet_option
def train(
    output: Path,
    steps: int,
    replicas: int,
    device: str,
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """verl's v1 trainer (separate_async) on the ledger: SIGKILL the trainer, resume from
    verl's checkpoint with one replica SIGKILLed, resume until done; judge from the ledger.
    Exit 0 when the judged run passes, 1 when it does not (the reasons are in the report);
    `--report docs/gpu-check/trainer-cpu-reference.json` writes the reference."""
    from rollout_lifecycle.gpu_check.verl_v1_train import TrainPlan, run_train

    check_report_path(report_path)
    plan = TrainPlan(out=output, steps=steps, replicas=replicas, device=device)
    result = run_train(
        plan, progress=(lambda _m: None) if quiet else (lambda m: click.echo(m, err=True))
    )
    bad = verdict(result)
    result["verdict"] = {"passed": not bad, "why_not": bad}
    emit_report(result, as_json=as_json, report_path=report_path, console=make_console(True))
    if not as_json:
        click.echo(summary(result))
    if bad:
        raise click.exceptions.Exit(exitcodes.FINDINGS)
