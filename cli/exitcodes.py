"""The exit codes every command uses, so a CI job can rely on them (documented in the README).

  0  clean: the command did its work and its checks found nothing
  1  findings: a violation, a failed or surviving check, stale docs
  2  usage or input error: bad options, unreadable or invalid input, a refused operation
  3  technical failure: the environment failed (I/O, a database that cannot be reached,
     a missing optional dependency); nothing was judged
  4  gpu-check preflight: ready except that the model weights are missing (gpu-check run:
     refused for the same reason, before anything is written)
  5  campaign: no violation, but a coverage goal its budget was meant to reach was missed
     (the report names the budget that reaches it); a violation is always 1
130  interrupted (Ctrl-C or SIGTERM)
"""

from __future__ import annotations

import click

OK = 0
FINDINGS = 1
USAGE = 2
TECHNICAL = 3
MODEL_MISSING = 4
MISSED_GOAL = 5
INTERRUPTED = 130


class InputError(click.ClickException):
    """Bad input or a refused operation: one line on stderr, exit 2."""

    exit_code = USAGE


class TechnicalError(click.ClickException):
    """The environment failed (not the user's input, not a finding): one line, exit 3."""

    exit_code = TECHNICAL


def findings() -> click.exceptions.Exit:
    """The exception a checking command raises after reporting what it found (exit 1)."""
    return click.exceptions.Exit(FINDINGS)


def missed_goals() -> click.exceptions.Exit:
    """The exception `campaign` raises when nothing was violated but a goal was missed (5)."""
    return click.exceptions.Exit(MISSED_GOAL)
