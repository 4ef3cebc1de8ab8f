"""Small output helpers shared by the commands: atomic JSON files and progress lines."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to a temp file beside `path`, fsync, rename: never a half-written report."""
    path = Path(path)
    if not path.parent.exists():
        raise click.UsageError(f"{path}: directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=False, default=str)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def progress_printer(
    console: Console, label: str, every_s: float = 1.0
) -> Callable[[str, bool], None]:
    """A throttled one-line progress reporter for long runs (stderr, one line per second)."""
    last = [0.0]

    def tick(text: str, final: bool) -> None:
        now = time.monotonic()
        if final or now - last[0] >= every_s:
            last[0] = now
            console.print(f"[dim]{label}: {text}[/]", highlight=False)

    return tick


def make_console(stderr: bool = False) -> Console:
    """A console that is wide enough for the report tables even when piped to a file."""
    import sys

    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 120)
