"""Output conventions every command shares: reports, JSON, progress, consoles.

* `--json` means one thing everywhere: the command's report, as JSON, on stdout (tables and
  chatter are suppressed; progress still goes to stderr). `--report PATH` writes the same
  JSON to a file (atomically, mode 0644). The shapes are JSON Schemas in
  `rollout_lifecycle/cli/schemas/`, checked by the tests.
* Progress of long runs goes to stderr: a live line on a terminal, and a plain line at least
  every `PROGRESS_EVERY_S` seconds otherwise (so `| tee` shows the run is alive); both are
  silenced by `--quiet`.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.live import Live
from rich.text import Text

from rollout_lifecycle.cli.exitcodes import InputError
from rollout_lifecycle.model.atomic import atomic_write, check_target
from rollout_lifecycle.model.errors import OutputError

F = TypeVar("F", bound=Callable[..., Any])

PROGRESS_EVERY_S = float(os.environ.get("ROLLOUT_LIFECYCLE_PROGRESS_S", "5"))


def _strict(obj: Any) -> Any:
    """Replace non-finite floats by None-with-a-note: reports are strict JSON (RFC 8259)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _strict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_strict(v) for v in obj]
    return obj


def dumps(data: Any) -> str:
    """Strict JSON text of a report (NaN/inf become null; never `Infinity`)."""
    return json.dumps(_strict(data), indent=2, default=str, allow_nan=False) + "\n"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write a report to `path` whole (temp + fsync + rename, mode 0644)."""
    try:
        atomic_write(Path(path), dumps(data))
    except OutputError as exc:
        raise InputError(str(exc)) from None


def check_report_path(path: Path | None) -> None:
    """Validate a `--report` target before any work starts (missing folder, file in the way)."""
    if path is None:
        return
    try:
        check_target(Path(path))
    except OutputError as exc:
        raise click.BadParameter(str(exc), param_hint="--report") from None


def ensure_dir(path: Path, option: str) -> Path:
    """Create a working folder before any work, or say exactly why it cannot be one."""
    p = Path(path)
    for anc in (p, *p.parents):
        if anc.exists():
            if not anc.is_dir():
                where = "is a file" if anc == p else f"is inside {anc}, which is a file"
                raise click.BadParameter(f"{p} {where}; give a folder", param_hint=option)
            break
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(f"cannot create {p} ({exc.strerror})", param_hint=option) from None
    return p


def report_options(func: F) -> F:
    """`--json` (report on stdout) and `--report PATH` (report to a file), the same everywhere."""
    func = click.option(
        "--report",
        "report_path",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Also write the JSON report to this file (atomically).",
    )(func)
    func = click.option(
        "--json",
        "as_json",
        is_flag=True,
        help="Print the JSON report on stdout instead of tables.",
    )(func)
    return func


def quiet_option(func: F) -> F:
    """`--quiet`: no progress output on stderr."""
    return click.option("--quiet", is_flag=True, help="No progress output.")(func)


def emit_report(data: Any, *, as_json: bool, report_path: Path | None, console: Console) -> None:
    """Write the report file if asked, and print the JSON when `--json` was given."""
    if report_path is not None:
        write_json_atomic(report_path, data)
        if not as_json:
            console.print(f"report written to {report_path}")
    if as_json:
        click.echo(dumps(data), nl=False)


class Progress:
    """A throttled progress reporter on stderr: live on a terminal, periodic lines otherwise."""

    def __init__(self, label: str, *, quiet: bool = False, every_s: float | None = None) -> None:
        self.label = label
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self._last = 0.0
        self._live: Live | None = None
        self._console = Console(stderr=True, width=None if self.tty else 120)

    def __call__(self, text: str, final: bool = False) -> None:
        """Report `text`; `final` always prints (and ends the live line)."""
        if self.quiet:
            return
        line = f"{self.label}: {text}"
        if self.tty:
            if self._live is None:
                self._live = Live(
                    Text(line, style="dim"), console=self._console, auto_refresh=False
                )
                self._live.start()
            now = time.monotonic()
            if final or now - self._last >= 0.1:
                self._last = now
                self._live.update(Text(line, style="dim"), refresh=True)
            if final:
                self.close()
            return
        now = time.monotonic()
        if final or now - self._last >= self.every_s:
            self._last = now
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        """End the live line (leaving its last text on screen)."""
        if self._live is not None:
            self._live.stop()
            self._live = None


def progress_printer(
    console: Console, label: str, every_s: float | None = None, *, quiet: bool = False
) -> Progress:
    """Compatibility shim: a `Progress` for `label` (the console argument is not needed)."""
    del console
    return Progress(label, quiet=quiet, every_s=every_s)


def make_console(stderr: bool = False, *, quiet: bool = False) -> Console:
    """A console wide enough for the report tables even when piped; `quiet` prints nothing."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 120, quiet=quiet)


def program() -> str:
    """The command a user can type, in the shell they ran this from, to run this program
    again: `rollout-lifecycle` only when that name on PATH is this program (after
    `make demo` it is `.venv/bin/rollout-lifecycle`, not on PATH), else the path it was
    invoked by, or `python -m rollout_lifecycle` with this interpreter."""
    argv0 = sys.argv[0] if sys.argv else ""
    if Path(argv0).name == "rollout-lifecycle":
        on_path = shutil.which("rollout-lifecycle")
        if on_path is not None and Path(on_path).resolve() == Path(argv0).resolve():
            return "rollout-lifecycle"
        if os.sep in argv0:
            return shlex.quote(argv0)
    return f"{shlex.quote(sys.executable)} -m rollout_lifecycle"
