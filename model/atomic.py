"""The one way this project writes a file: whole, or not at all.

Every report, diagram, decision file, saved program and evidence document goes through
`atomic_write` (or `atomic_open` for streamed output): a temporary file in the same folder,
fsync, then one rename onto the target, so a reader sees the old file or the new one and a
crash, a full disk or SIGTERM leaves no half-written target. Temporaries still open when a
termination signal arrives are removed by `cleanup_temporaries` (the CLI installs a SIGTERM
handler that calls it). Files get the usual 0666 & ~umask mode, never mkstemp's 0600, so a
report or artifact is readable by the other users a pipeline runs as.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Literal, overload

from rollout_lifecycle.model.errors import OutputError

_LIVE: set[str] = set()  # temporaries not yet renamed or removed
_LIVE_LOCK = threading.Lock()


def default_mode() -> int:
    """0666 masked by the process umask (what `open()` would give a new file)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def cleanup_temporaries() -> int:
    """Remove every temporary this process still holds; returns how many were removed."""
    with _LIVE_LOCK:
        names = list(_LIVE)
        _LIVE.clear()
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(name)
    return len(names)


def describe_os_error(exc: OSError) -> str:
    """A truthful one-line cause, naming the full-disk and permission cases plainly."""
    if exc.errno == errno.ENOSPC:
        return "no space left on the device (disk full)"
    if exc.errno == errno.EDQUOT:
        return "disk quota exceeded"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exc.errno == errno.EROFS:
        return "the file system is read-only"
    if exc.errno == errno.ENAMETOOLONG:
        return "the file name is too long"
    return exc.strerror or str(exc)


def check_target(path: Path, *, force: bool = True, written_by: str | None = None) -> Path:
    """Validate where a file will go before any work starts; OutputError says what to fix.

    The parent must be an existing directory (not a file, not missing); the target must not
    be a directory; with `force` False an existing file is refused unless its first bytes
    contain `written_by` (a marker this command writes), so a data file is never clobbered.
    """
    path = Path(path)
    parent = path.parent
    for anc in (parent, *parent.parents):
        if anc.exists() and not anc.is_dir():
            raise OutputError(f"{path}: {anc} is a file, not a directory")
        if anc.exists():
            break
    if not parent.exists():
        raise OutputError(f"{path}: directory {parent} does not exist; create it first")
    if path.is_dir():
        raise OutputError(f"{path} is a directory; give a file path")
    if path.exists() and not force:
        head = b""
        with contextlib.suppress(OSError), path.open("rb") as fh:
            head = fh.read(4096)
        if written_by is None or written_by.encode() not in head:
            raise OutputError(f"{path} already exists; pass --force to replace it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{path}: cannot write into {parent} (permission denied)")
    return path


@overload
def atomic_open(
    path: Path | str, mode: Literal["w"] = "w", *, file_mode: int | None = None
) -> contextlib.AbstractContextManager[IO[str]]: ...


@overload
def atomic_open(
    path: Path | str, mode: Literal["wb"], *, file_mode: int | None = None
) -> contextlib.AbstractContextManager[IO[bytes]]: ...


def atomic_open(
    path: Path | str, mode: str = "w", *, file_mode: int | None = None
) -> contextlib.AbstractContextManager[IO[str]] | contextlib.AbstractContextManager[IO[bytes]]:
    """A file handle whose content lands at `path` only if the block completes."""
    return _atomic_open(Path(path), mode, file_mode)  # type: ignore[return-value]


@contextlib.contextmanager
def _atomic_open(path: Path, mode: str, file_mode: int | None) -> Iterator[IO[str] | IO[bytes]]:
    if mode not in ("w", "wb"):
        raise ValueError("atomic_open writes text ('w') or bytes ('wb')")
    check_target(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OutputError(
            f"{path}: cannot create a file there ({describe_os_error(exc)})"
        ) from None
    with _LIVE_LOCK:
        _LIVE.add(tmp)
    try:
        os.fchmod(fd, default_mode() if file_mode is None else file_mode)
        if mode == "w":
            fh: IO[str] | IO[bytes] = os.fdopen(fd, "w", encoding="utf-8", newline="\n")
        else:
            fh = os.fdopen(fd, "wb")
        with fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        _discard(tmp)
        raise OutputError(f"{path}: not written ({describe_os_error(exc)})") from None
    except BaseException:
        _discard(tmp)
        raise
    with _LIVE_LOCK:
        _LIVE.discard(tmp)
    _fsync_dir(path.parent)


def _discard(tmp: str) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(tmp)
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (best effort: some file systems refuse)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path | str, data: bytes | str, *, file_mode: int | None = None) -> Path:
    """Write `data` to `path` whole (temp + fsync + rename); OutputError on any failure."""
    p = Path(path)
    if isinstance(data, str):
        with atomic_open(p, "w", file_mode=file_mode) as fh:
            fh.write(data)
    else:
        with atomic_open(p, "wb", file_mode=file_mode) as fb:
            fb.write(data)
    return p
