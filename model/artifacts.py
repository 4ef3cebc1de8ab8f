"""Policy artifacts as real, immutable files, and the worker-side loader that acks them.

Layout: ``<root>/v<version:012d>/`` holds the weights (``model.safetensors``) or the user's
raw files, plus ``manifest.json``. A writer builds everything in a hidden temp directory
beside it, fsyncs every file and the directory, and only then renames the directory into
place: ``rename(2)`` onto an existing, non-empty directory fails, so the rename is both the
atomic "publish" and the "a version is written once" check. A killed writer leaves only a
hidden temp directory that readers never look at and `sweep_temp` removes.

The content hash (`content_hash`) is sha256 over a canonical JSON listing of every file's
name, size and sha256, in code-point order of the names. It covers names, so renaming or
swapping files changes it; it does not cover the version, so identical weights published
twice hash the same (the version travels next to the hash in every ack).

No pickle anywhere: weights are parsed only with ``safetensors.numpy.load(bytes)``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import attrs
import numpy as np
import numpy.typing as npt
import safetensors.numpy as st_numpy

from rollout_lifecycle.model.errors import ArtifactError, brief
from rollout_lifecycle.model.records import WorkerAck

FORMAT = "rollout-lifecycle-artifact/1"
MANIFEST_NAME = "manifest.json"
WEIGHTS_NAME = "model.safetensors"
TEMP_PREFIX = ".tmp-"
CHUNK_BYTES = 8 << 20  # write in slices so a huge tensor never needs one giant syscall

_DIR_RE = re.compile(r"^v(\d{12})$")
_TEMP_RE = re.compile(r"^\.tmp-(\d+)-v\d+-")
# conservative on purpose: every name must be safe as one path component on any filesystem
_NAME_RE = re.compile(r"^[A-Za-z0-9_+-][A-Za-z0-9._+-]{0,199}$")

# temp dirs this process is writing right now, so sweep_temp never removes a live one
_LIVE_TEMPS: set[str] = set()
_LIVE_LOCK = threading.Lock()


def check_name(name: object, what: str) -> str:
    """Validate a file name or label used as one path component; ArtifactError names the rule.

    Names come from users (file names, labels): anything that could climb out of the root
    ('..', absolute paths, separators, NUL) is refused before it reaches the filesystem.
    """
    if not isinstance(name, str) or not name:
        raise ArtifactError(f"{what} must be a non-empty string, got {brief(name)}")
    if "\0" in name:
        raise ArtifactError(f"{what} {brief(name)} contains a NUL byte")
    if "/" in name or "\\" in name or os.sep in name:
        raise ArtifactError(f"{what} {brief(name)} contains a path separator; use a plain name")
    if name in (".", ".."):
        raise ArtifactError(f"{what} {brief(name)} would leave its directory")
    if not _NAME_RE.match(name):
        raise ArtifactError(
            f"{what} {brief(name)} is not allowed: use 1-200 of "
            f"[A-Za-z0-9._+-], not starting with '.'"
        )
    return name


def _check_version(version: object) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ArtifactError(f"version must be a non-negative int, got {brief(version)}")
    if version >= 10**12:
        raise ArtifactError(f"version {version} is too large for the directory layout")
    return version


def _check_sha(value: object, what: str) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{64}", value):
        raise ArtifactError(f"{what} must be 64 lowercase hex digits, got {brief(value)}")
    return value


@attrs.frozen
class FileEntry:
    """One file of an artifact: the three facts the content hash is built from."""

    name: str
    size: int
    sha256: str


def content_hash(entries: Iterable[FileEntry]) -> str:
    """The artifact hash: sha256 of the canonical JSON listing of (name, size, sha256).

    Canonical: ``{"files":[[name,size,sha256],...],"format":FORMAT}`` with names sorted in
    code-point order, keys sorted, no whitespace, ASCII only. Every reader and writer calls
    this one function, so the definition cannot drift between them.
    """
    listed = sorted(entries, key=lambda e: e.name)
    rows: list[list[str | int]] = [[e.name, e.size, e.sha256] for e in listed]
    names = [e.name for e in listed]
    if len(set(names)) != len(names):
        raise ArtifactError(f"file names listed more than once: {sorted(names)}")
    canon = json.dumps(
        {"format": FORMAT, "files": rows}, sort_keys=True, separators=(",", ":"), ensure_ascii=True
    )
    return hashlib.sha256(canon.encode("ascii")).hexdigest()


@attrs.frozen
class ArtifactManifest:
    """What ``manifest.json`` records; informative only: readers trust the expected hash."""

    version: int
    artifact_hash: str
    files: tuple[FileEntry, ...]
    label: str | None = None
    format: str = FORMAT

    def to_json(self) -> str:
        """Stable, human-readable JSON."""
        return json.dumps(
            {
                "format": self.format,
                "version": self.version,
                "label": self.label,
                "artifact_hash": self.artifact_hash,
                "hash_definition": "sha256 of canonical JSON "
                '{"files":[[name,size,sha256]...sorted by name],"format":...}',
                "files": [attrs.asdict(f) for f in self.files],
            },
            indent=2,
            sort_keys=True,
        )

    @classmethod
    def parse(cls, raw: bytes, where: str) -> ArtifactManifest:
        """Strictly parse a manifest; any surprise is an ArtifactError naming the file."""
        try:
            data = json.loads(raw.decode("utf-8"))
            if data.get("format") != FORMAT:
                raise ValueError(f"format {brief(data.get('format'))}, expected {brief(FORMAT)}")
            label = data.get("label")
            files = tuple(
                FileEntry(
                    name=check_name(f["name"], "file name"),
                    size=_size(f["size"]),
                    sha256=_check_sha(f["sha256"], "file sha256"),
                )
                for f in data["files"]
            )
            return cls(
                version=_check_version(data["version"]),
                artifact_hash=_check_sha(data["artifact_hash"], "artifact_hash"),
                files=files,
                label=None if label is None else check_name(label, "label"),
            )
        except (ValueError, KeyError, TypeError, AttributeError, ArtifactError) as exc:
            raise ArtifactError(f"{where}: unreadable manifest ({exc})") from None
        except RecursionError:
            raise ArtifactError(f"{where}: unreadable manifest (nested too deeply)") from None


def _size(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"bad size {brief(v)}")
    return v


@attrs.frozen
class StoredArtifact:
    """A committed artifact on disk: what the coordinator's commit_artifact needs."""

    version: int
    artifact_hash: str
    path: Path
    label: str | None = None
    files: tuple[str, ...] = ()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_chunk(f: BinaryIO, chunk: memoryview) -> None:
    """One slice of a file write; a separate function so fault tests can slow or kill here."""
    f.write(chunk)


def _write_file(path: Path, data: bytes) -> FileEntry:
    """Create `path` (never overwrite), write, flush and fsync; return its entry."""
    view = memoryview(data)
    with open(path, "xb") as f:
        for start in range(0, len(view), CHUNK_BYTES):
            _write_chunk(f, view[start : start + CHUNK_BYTES])
        f.flush()
        os.fsync(f.fileno())
    return FileEntry(path.name, len(data), hashlib.sha256(data).hexdigest())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ArtifactStore:
    """Immutable, content-hashed policy artifacts under one root directory."""

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True) -> None:
        p = Path(root)
        for anc in (p, *p.parents):
            if anc.exists() and not anc.is_dir():
                raise ArtifactError(f"artifact root {p}: {anc} is a file, not a directory")
            if anc.exists():
                break
        if create:
            try:
                p.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ArtifactError(f"cannot create artifact root {p} ({exc.strerror})") from None
        if not p.is_dir():
            raise ArtifactError(f"artifact root {p} is not a directory")
        self.root = p.resolve()

    # ---- paths -------------------------------------------------------------------------

    def _inside(self, p: Path) -> Path:
        """`p` itself, after checking that it resolves inside the root (symlinks included).

        The unresolved path is returned so callers can still see (and refuse) a symlink.
        """
        r = p.resolve()
        if r == self.root or not r.is_relative_to(self.root):
            raise ArtifactError(f"path {p} resolves to {r}, outside the artifact root {self.root}")
        return p

    def path_for(self, version: int) -> Path:
        """Final directory of `version` (whether or not it exists)."""
        return self._inside(self.root / f"v{_check_version(version):012d}")

    def _existing_dir(self, version: int) -> Path:
        d = self.path_for(version)
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            raise ArtifactError(f"artifact v{version} is not in {self.root}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise ArtifactError(f"artifact v{version}: {d} is not a plain directory")
        return d

    # ---- writing -----------------------------------------------------------------------

    def write(
        self,
        version: int,
        tensors: Mapping[str, npt.NDArray[Any]] | None = None,
        files: Mapping[str, bytes] | None = None,
        label: str | None = None,
    ) -> StoredArtifact:
        """Publish `version` atomically: weights as safetensors and/or the given raw files.

        Refuses (ArtifactError, nothing published) a version that already exists, unsafe
        names, or an empty artifact. A crash at any point leaves no artifact under the
        final name, only a hidden temp directory.
        """
        _check_version(version)
        if label is not None:
            check_name(label, "label")
        blobs: dict[str, bytes] = {}
        for name, data in (files or {}).items():
            check_name(name, "file name")
            if name == MANIFEST_NAME:
                raise ArtifactError(
                    f"file name {brief(MANIFEST_NAME)} is reserved for the manifest"
                )
            if not isinstance(data, bytes | bytearray | memoryview):
                raise ArtifactError(f"file {brief(name)}: content must be bytes, got {type(data)}")
            blobs[name] = bytes(data)
        if tensors is not None:
            if WEIGHTS_NAME in blobs:
                raise ArtifactError(
                    f"{brief(WEIGHTS_NAME)} given both as tensors and as a raw file"
                )
            try:
                blobs[WEIGHTS_NAME] = st_numpy.save(dict(tensors))
            except Exception as exc:  # safetensors raises its own untyped errors
                raise ArtifactError(f"cannot serialise tensors as safetensors: {exc}") from None
        if not blobs:
            raise ArtifactError("an artifact needs tensors or at least one file")
        final = self.path_for(version)
        if os.path.lexists(final):
            raise ArtifactError(f"artifact v{version} already exists at {final}; it is immutable")
        tmp = Path(
            tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-v{version}-", dir=self.root)
        )
        with _LIVE_LOCK:
            _LIVE_TEMPS.add(str(tmp))
        try:
            entries = [_write_file(tmp / name, data) for name, data in sorted(blobs.items())]
            digest = content_hash(entries)
            manifest = ArtifactManifest(version, digest, tuple(entries), label)
            _write_file(tmp / MANIFEST_NAME, manifest.to_json().encode("utf-8"))
            # mkdtemp's 0700 would stay on the published folder: a worker running as another
            # user could not read it. Folder 0777 & ~umask, files 0444 & ~umask (immutable).
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)
            for child in tmp.iterdir():
                os.chmod(child, 0o444 & ~umask)
            _fsync_dir(tmp)
            try:
                os.rename(tmp, final)
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                    raise ArtifactError(
                        f"artifact v{version} was published concurrently at {final}; "
                        "it is immutable"
                    ) from None
                raise
            _fsync_dir(self.root)
        except OSError as exc:
            raise ArtifactError(f"writing artifact v{version} failed: {exc}") from exc
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
            with _LIVE_LOCK:
                _LIVE_TEMPS.discard(str(tmp))
        return StoredArtifact(version, digest, final, label, tuple(e.name for e in entries))

    def sweep_temp(self) -> list[Path]:
        """Remove temp dirs left by writers that died; live writers' dirs are kept."""
        removed: list[Path] = []
        for child in sorted(self.root.iterdir()):
            m = _TEMP_RE.match(child.name)
            if m is None or not child.is_dir() or child.is_symlink():
                continue
            pid = int(m.group(1))
            if pid == os.getpid():
                with _LIVE_LOCK:
                    if str(child) in _LIVE_TEMPS:
                        continue
            elif _pid_alive(pid):
                continue
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
        return removed

    # ---- reading -----------------------------------------------------------------------

    def versions(self) -> list[int]:
        """Published versions, ascending; temp dirs and strays are ignored."""
        out = []
        for child in self.root.iterdir():
            m = _DIR_RE.match(child.name)
            if m is not None and child.is_dir() and not child.is_symlink():
                out.append(int(m.group(1)))
        return sorted(out)

    def exists(self, version: int) -> bool:
        """Whether `version` is published."""
        return os.path.lexists(self.path_for(version))

    def read_bytes(self, version: int, name: str) -> bytes:
        """One file's bytes, read once, never through a symlink."""
        check_name(name, "file name")
        path = self._inside(self._existing_dir(version) / name)  # O_NOFOLLOW sees links
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise ArtifactError(f"artifact v{version}: cannot open {brief(name)}: {exc}") from None
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def read_manifest(self, version: int) -> ArtifactManifest:
        """The manifest as written (not trusted for integrity; see `verify`)."""
        raw = self.read_bytes(version, MANIFEST_NAME)
        m = ArtifactManifest.parse(raw, f"artifact v{version}")
        if m.version != version:
            raise ArtifactError(f"artifact v{version}: manifest claims version {m.version}")
        return m

    def open(self, version: int) -> StoredArtifact:
        """A handle on a published artifact, from its manifest; ArtifactError if absent."""
        m = self.read_manifest(version)
        names = tuple(f.name for f in m.files)
        return StoredArtifact(version, m.artifact_hash, self.path_for(version), m.label, names)

    def verify(self, version: int, expected_hash: str) -> StoredArtifact:
        """Recompute the hash from the bytes on disk; ArtifactError on any difference.

        Checks, in order: exactly the manifest's files are present, each file's size and
        sha256, the recomputed content hash against `expected_hash` (the registry's word,
        not the manifest's).
        """
        m = self.read_manifest(version)
        d = self._existing_dir(version)
        present = {c.name for c in d.iterdir()}
        listed = {f.name for f in m.files} | {MANIFEST_NAME}
        if present != listed:
            raise ArtifactError(
                f"artifact v{version}: files differ from the manifest (extra "
                f"{sorted(present - listed)}, missing {sorted(listed - present)})"
            )
        entries = []
        for f in m.files:
            data = self.read_bytes(version, f.name)
            got = FileEntry(f.name, len(data), hashlib.sha256(data).hexdigest())
            if got != f:
                raise ArtifactError(
                    f"artifact v{version}: {brief(f.name)} has size {got.size} "
                    f"sha256 {got.sha256}, "
                    f"manifest says size {f.size} sha256 {f.sha256}"
                )
            entries.append(got)
        digest = content_hash(entries)
        if digest != expected_hash:
            raise ArtifactError(
                f"artifact v{version}: content hash {digest} != expected {expected_hash}"
            )
        return StoredArtifact(version, digest, d, m.label, tuple(f.name for f in m.files))


@attrs.frozen(eq=False)
class LoadedWeights:
    """What a worker holds after a verified load: parsed tensors plus any other raw files."""

    version: int
    artifact_hash: str
    tensors: Mapping[str, npt.NDArray[Any]]
    files: Mapping[str, bytes]


class WorkerLoader:
    """A worker's loader: acks only the (version, hash) of bytes it read, hashed and parsed.

    The ack is built last, from the hash of the very bytes that were parsed, so a swallowed
    transfer error or a tampered file can never turn into a "loaded" report.
    """

    def __init__(self, store: ArtifactStore, worker_id: str, incarnation: int = 0) -> None:
        if not isinstance(worker_id, str) or not worker_id:
            raise ArtifactError(f"worker_id must be a non-empty string, got {brief(worker_id)}")
        if isinstance(incarnation, bool) or not isinstance(incarnation, int) or incarnation < 0:
            raise ArtifactError(f"incarnation must be a non-negative int, got {brief(incarnation)}")
        self.store = store
        self.worker_id = worker_id
        self.incarnation = incarnation
        self._seq = 0
        self._lock = threading.Lock()

    def restarted(self) -> WorkerLoader:
        """The loader of this worker's next incarnation (its sequence starts over)."""
        return WorkerLoader(self.store, self.worker_id, self.incarnation + 1)

    def load(
        self,
        version: int,
        expected_hash: str,
        *,
        token: str | None = None,
        attempt: int | None = None,
    ) -> tuple[LoadedWeights, WorkerAck]:
        """Read, hash, then parse; ArtifactError (and no ack) on any mismatch or bad file.

        `token` is the one the coordinator issued this worker for the distribution attempt
        being answered (`ActivationCoordinator.attempt_token`): the ack echoes it, so it
        counts for that attempt and no other. Without one the ack is a report of what the
        worker holds (a restored version), which can never help an activation. `attempt`
        is an optional note for logs (see WorkerAck).
        """
        _check_sha(expected_hash, "expected_hash")
        if token is not None and (not isinstance(token, str) or not token):
            raise ArtifactError(f"token must be a non-empty string or None, got {brief(token)}")
        manifest = self.store.read_manifest(version)
        blobs = {f.name: self.store.read_bytes(version, f.name) for f in manifest.files}
        loaded_hash = content_hash(
            FileEntry(n, len(b), hashlib.sha256(b).hexdigest()) for n, b in blobs.items()
        )
        if loaded_hash != expected_hash:
            raise ArtifactError(
                f"worker {brief(self.worker_id)}: artifact v{version} loaded "
                f"with hash {loaded_hash}, "
                f"expected {expected_hash}; not acknowledging"
            )
        tensors: dict[str, npt.NDArray[Any]] = {}
        raw: dict[str, bytes] = {}
        for name, data in sorted(blobs.items()):
            if not name.endswith(".safetensors"):
                raw[name] = data
                continue
            try:
                parsed = st_numpy.load(data)
            except Exception as exc:  # SafetensorError is not importable as a type
                raise ArtifactError(
                    f"worker {brief(self.worker_id)}: v{version} {brief(name)} is "
                    f"not valid safetensors "
                    f"({exc}); not acknowledging"
                ) from None
            for k, arr in parsed.items():
                if k in tensors:
                    raise ArtifactError(f"v{version}: tensor {brief(k)} appears in two shards")
                tensors[k] = np.asarray(arr)
        with self._lock:
            seq = self._seq
            self._seq += 1
        ack = WorkerAck(
            worker_id=self.worker_id,
            version=version,
            artifact_hash=loaded_hash,
            incarnation=self.incarnation,
            seq=seq,
            attempt=attempt,
            token=token,
        )
        return LoadedWeights(version, loaded_hash, tensors, raw), ack
