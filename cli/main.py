"""`rollout-lifecycle`: the command line, the top floor (nothing imports it).

Each sub-command lives in its own module and is registered here. User mistakes (bad files,
bad options, refused operations) surface as one clear line and exit 2; findings of a
checking command exit 1; failures of the environment exit 3 (`cli/exitcodes.py` lists
them all). A traceback is reserved for bugs in this program.
"""

from __future__ import annotations

import importlib
import signal
import sys
import threading
from collections.abc import Sequence
from importlib import metadata
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
from rollout_lifecycle.model.atomic import cleanup_temporaries, describe_os_error
from rollout_lifecycle.model.errors import (
    BackendUnavailable,
    RolloutLifecycleError,
    StorageFull,
)

EXIT_CODES_HELP = (
    "Exit codes: 0 clean; 1 findings (a violation, a failed or surviving check, stale "
    "docs); 2 usage or input error; 3 technical failure; 4 gpu-check preflight/run: only "
    "the model weights are missing; 5 campaign: no violation but a coverage goal missed; "
    "130 interrupted."
)


def _version() -> str:
    try:
        return metadata.version("rollout-lifecycle")
    except metadata.PackageNotFoundError:
        return "0+unknown (not installed)"


# Every sub-command: its module, imported only when that command runs (so `--help` and
# each command load only what they need: no Hypothesis, no torch, no measurement code), and
# the summary `--help` lists for it, which is the first paragraph of the command's
# docstring (tests/test_cli_lazy.py checks they agree). campaign, fuzz and mutants need Hypothesis,
# the [campaign] extra; the others work without it.
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "activation-drill": (
        "rollout_lifecycle.cli.drill_cmd",
        "Activate policy versions across Ray workers under faults; judge the trace by the spec.",
    ),
    "admit": (
        "rollout_lifecycle.cli.admit_cmd",
        "Admit rollouts by version lag AND behaviour drift; write one decision per line.",
    ),
    "bench": (
        "rollout_lifecycle.cli.bench_cmd",
        "Measure admission, ledgers and checkers against their baselines, and simulate pacing "
        "(issue 21), in one run.",
    ),
    "campaign": (
        "rollout_lifecycle.cli.campaign_cmd",
        "Check the checkers, fuzz, explore and race; report; write coverage JSON and diagrams.",
    ),
    "demo": (
        "rollout_lifecycle.cli.demo_cmd",
        "Run the whole protocol once on SQLite with real artifacts, then check the trace.",
    ),
    "deployment": (
        "rollout_lifecycle.cli.deployment_cmd",
        "The deployment's durable state: admission policy, pointer, workers, retired versions.",
    ),
    "diagram": (
        "rollout_lifecycle.cli.diagram_cmd",
        "Draw the lifecycle/activation machines as Mermaid, DOT, SVG or PNG.",
    ),
    "explore": (
        "rollout_lifecycle.cli.explore_cmd",
        "Explore every interleaving of the protocol models and check the spec's invariants.",
    ),
    "fuzz": (
        "rollout_lifecycle.cli.fuzz_cmd",
        "Fuzz the protocol machines against the spec; exit 1 on a violation.",
    ),
    "gpu-check": (
        "rollout_lifecycle.cli.gpu_check_cmd",
        "The real-run check: one verl update, judged by the spec's invariants (CPU or GPU).",
    ),
    "ledger": (
        "rollout_lifecycle.cli.ledger_cmd",
        "Inspect a stored ledger: counts, one rollout, its history, an invariant check.",
    ),
    "mutants": (
        "rollout_lifecycle.cli.mutants_cmd",
        "Kill every mutant of the catalogue with the fuzzer and the explorer; exit 1 on a "
        "survivor.",
    ),
    "race": (
        "rollout_lifecycle.cli.race_cmd",
        "Race activators against learners running the README pattern; judge everything.",
    ),
    "verl": (
        "rollout_lifecycle.cli.verl_cmd",
        "verl's v1 trainer on the ledger: record a run's policy on its ledger, print the "
        "overrides.",
    ),
}
NEEDS_HYPOTHESIS = ("campaign", "fuzz", "mutants")


class _LazyGroup(click.Group):
    """A group that imports a LAZY_COMMANDS module only when that command is used (the
    command object is the module's attribute of the command's name, `-` read as `_`)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY_COMMANDS and cmd_name not in self.commands:
            try:
                module = importlib.import_module(LAZY_COMMANDS[cmd_name][0])
            except ModuleNotFoundError as exc:
                if (exc.name or "").partition(".")[0] != "hypothesis":
                    raise
                # Hypothesis is the [campaign] extra: embedding never needs it, these do;
                # a missing optional dependency is a technical failure (exit 3), as for
                # every other extra
                raise exitcodes.TechnicalError(
                    f"'{cmd_name}' needs Hypothesis, which is not installed: "
                    "pip install 'rollout-lifecycle[campaign]' (from a checkout: "
                    "pip install -e '.[campaign]')"
                ) from None
            self.add_command(getattr(module, cmd_name.replace("-", "_")))
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        limit = formatter.width - 6 - max(len(n) for n in self.list_commands(ctx))
        rows = []
        for name in self.list_commands(ctx):
            if name in LAZY_COMMANDS and name not in self.commands:
                stub = click.Command(name, help=LAZY_COMMANDS[name][1])
                rows.append((name, stub.get_short_help_str(limit)))
            else:
                cmd = self.get_command(ctx, name)
                if cmd is not None and not cmd.hidden:
                    rows.append((name, cmd.get_short_help_str(limit)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(
    cls=_LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=EXIT_CODES_HELP,
)
@click.version_option(_version(), "--version", "-V", prog_name="rollout-lifecycle")
def cli() -> None:
    """Stale- and duplicate-safe rollout lifecycle for online RL post-training."""


@cli.command("version")
@report_options
@quiet_option
def version(as_json: bool, report_path: Path | None, quiet: bool) -> None:
    """Print the installed version and the libraries the model is declared with."""
    import transitions

    del quiet  # nothing to silence: accepted like on every command
    check_report_path(report_path)
    data = {
        "schema": "rollout-lifecycle/version/1",
        "rollout_lifecycle": _version(),
        "transitions": getattr(transitions, "__version__", "?"),
        "python": sys.version.split()[0],
    }
    emit_report(data, as_json=as_json, report_path=report_path, console=make_console(True))
    if not as_json:
        click.echo(f"rollout-lifecycle {data['rollout_lifecycle']}")
        click.echo(f"transitions {data['transitions']}")
        click.echo(f"python {data['python']}")


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through every atomic write, which removes its temporary


def _install_sigterm() -> Any:
    """Turn SIGTERM into an orderly unwind (main thread only; elsewhere signals can't be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _on_sigterm)


def run(argv: Sequence[str] | None = None) -> int:
    """Run the command line and return its exit code (see `rollout_lifecycle.cli.exitcodes`).

    click's non-standalone mode RETURNS the code of `click.exceptions.Exit` instead of
    exiting, so it is taken from the return value here: dropping it would make every
    checking command exit 0 on a finding.
    """
    previous = _install_sigterm()
    try:
        rv = cli.main(args=argv, prog_name="rollout-lifecycle", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return exitcodes.INTERRUPTED
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except (BackendUnavailable, StorageFull) as exc:  # the database is down or full: not the input
        click.echo(f"error: {exc}", err=True)
        return exitcodes.TECHNICAL
    except RolloutLifecycleError as exc:
        click.echo(f"error: {exc}", err=True)
        return exitcodes.USAGE
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return exitcodes.INTERRUPTED
    except OSError as exc:
        click.echo(f"error: {describe_os_error(exc)}: {exc}", err=True)
        return exitcodes.TECHNICAL
    finally:
        cleanup_temporaries()  # a temporary of an interrupted write never stays behind
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return rv if isinstance(rv, int) and not isinstance(rv, bool) else exitcodes.OK


def main() -> None:
    """Console-script entry point: exit with `run`'s code."""
    sys.exit(run())


if __name__ == "__main__":
    main()
