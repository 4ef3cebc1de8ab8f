"""`rollout-lifecycle`: the command line, the top floor (nothing imports it).

Each sub-command lives in its own module and is registered here. User mistakes (bad files,
bad options, refused operations) surface as one clear line through click's exceptions and
exit with status 1 or 2; a traceback is reserved for bugs in this program.
"""

from __future__ import annotations

import sys
from importlib import metadata

import click

from cli.admit_cmd import admit
from cli.campaign_cmd import campaign
from cli.demo_cmd import demo
from cli.diagram_cmd import diagram
from cli.explore_cmd import explore
from cli.fuzz_cmd import fuzz
from cli.ledger_cmd import ledger
from cli.mutants_cmd import mutants
from model.errors import RolloutLifecycleError


def _version() -> str:
    try:
        return metadata.version("rollout-lifecycle")
    except metadata.PackageNotFoundError:
        return "0+unknown (not installed)"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Stale- and duplicate-safe rollout lifecycle for online RL post-training."""


@cli.command("version")
def version() -> None:
    """Print the installed version and the pinned libraries the model is declared with."""
    import transitions

    click.echo(f"rollout-lifecycle {_version()}")
    click.echo(f"transitions {getattr(transitions, '__version__', '?')}")
    click.echo(f"python {sys.version.split()[0]}")


for command in (campaign, fuzz, explore, mutants, admit, ledger, demo, diagram):
    cli.add_command(command)


def main() -> None:
    """Entry point: run the group; typed project errors that escape become one-line messages."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except RolloutLifecycleError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
