"""Policy artifacts as real files: atomic publish, immutability, hashing, safe names, loading."""

from __future__ import annotations

import hashlib
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from rollout_lifecycle.model.artifacts import (
    MANIFEST_NAME,
    TEMP_PREFIX,
    WEIGHTS_NAME,
    ArtifactStore,
    FileEntry,
    WorkerLoader,
    check_name,
    content_hash,
)
from rollout_lifecycle.model.errors import ArtifactError

REPO = Path(__file__).resolve().parents[1]


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "layer.0.weight": rng.standard_normal((8, 4)).astype(np.float32),
        "layer.0.bias": rng.standard_normal(8).astype(np.float32),
        "embed": rng.integers(0, 100, (5, 3)).astype(np.int64),
    }


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    """A fresh store under a temp root."""
    return ArtifactStore(tmp_path / "artifacts")


def test_write_then_load_round_trips_tensors(store: ArtifactStore) -> None:
    """Weights written as safetensors come back bit-identical, with an ack of the real hash."""
    t = _tensors()
    stored = store.write(1, tensors=t, label="run-a")
    loaded, ack = WorkerLoader(store, "w0").load(1, stored.artifact_hash)
    assert set(loaded.tensors) == set(t)
    for k, v in t.items():
        assert loaded.tensors[k].dtype == v.dtype
        assert np.array_equal(loaded.tensors[k], v)
    assert (ack.worker_id, ack.version, ack.artifact_hash) == ("w0", 1, stored.artifact_hash)
    assert (ack.incarnation, ack.seq) == (0, 0)
    assert store.open(1) == stored
    assert store.read_manifest(1).label == "run-a"


def test_hash_is_the_documented_canonical_manifest(store: ArtifactStore) -> None:
    """The hash is sha256 of the canonical sorted (name, size, sha256) listing, recomputable."""
    files = {"b.txt": b"bee", "a.json": b"{}"}
    stored = store.write(3, files=files)
    rows = sorted([n, len(d), hashlib.sha256(d).hexdigest()] for n, d in files.items())
    canon = '{"files":' + str(rows).replace("'", '"').replace(" ", "") + ","
    canon += '"format":"rollout-lifecycle-artifact/1"}'
    assert stored.artifact_hash == hashlib.sha256(canon.encode()).hexdigest()
    assert store.verify(3, stored.artifact_hash).artifact_hash == stored.artifact_hash
    assert store.read_manifest(3).artifact_hash == stored.artifact_hash


def test_hash_covers_names_not_version(store: ArtifactStore) -> None:
    """Same bytes under another name hash differently; same content in two versions hashes equal."""
    a = store.write(1, files={"x": b"data"})
    b = store.write(2, files={"y": b"data"})
    c = store.write(3, files={"x": b"data"})
    assert a.artifact_hash != b.artifact_hash
    assert a.artifact_hash == c.artifact_hash


def test_second_write_of_a_version_is_refused(store: ArtifactStore) -> None:
    """A committed artifact is immutable: writing the same version again raises, bytes unchanged."""
    first = store.write(5, tensors=_tensors(0))
    with pytest.raises(ArtifactError, match="immutable"):
        store.write(5, tensors=_tensors(1))
    with pytest.raises(ArtifactError, match="immutable"):
        store.write(5, files={"other": b"x"})
    assert store.verify(5, first.artifact_hash) == first
    assert not [p for p in store.root.iterdir() if p.name.startswith(TEMP_PREFIX)]


def test_concurrent_publish_loses_cleanly(
    store: ArtifactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If another writer publishes between the existence check and the rename, the loser raises."""

    real_rename = os.rename

    def racing_rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        other = ArtifactStore(store.root)
        monkeypatch.setattr(os, "rename", real_rename)
        other.write(7, files={"winner": b"1"})
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", racing_rename)
    with pytest.raises(ArtifactError, match="concurrently"):
        store.write(7, files={"loser": b"2"})
    assert store.open(7).files == ("winner",)
    assert not [p for p in store.root.iterdir() if p.name.startswith(TEMP_PREFIX)]


@pytest.mark.parametrize("name", ["../x", "/abs", "a/b", "a\0b", "..", ".", "a\\b", "", ".hidden"])
def test_path_escapes_are_refused(store: ArtifactStore, name: str) -> None:
    """File names and labels that could leave the root are refused before touching disk."""
    with pytest.raises(ArtifactError):
        store.write(1, files={name: b"x"})
    with pytest.raises(ArtifactError):
        store.write(1, files={"ok": b"x"}, label=name)
    assert store.versions() == []
    assert list(store.root.iterdir()) == []


@pytest.mark.parametrize("version", [-1, True, "1", 1.0, 10**12])
def test_bad_versions_are_refused(store: ArtifactStore, version: object) -> None:
    """Only non-negative ints that fit the layout name a directory."""
    with pytest.raises(ArtifactError):
        store.write(version, files={"ok": b"x"})  # type: ignore[arg-type]


def test_reserved_and_conflicting_names(store: ArtifactStore) -> None:
    """The manifest name is reserved, and weights cannot be given twice."""
    with pytest.raises(ArtifactError, match="reserved"):
        store.write(1, files={MANIFEST_NAME: b"{}"})
    with pytest.raises(ArtifactError, match="both"):
        store.write(1, tensors=_tensors(), files={WEIGHTS_NAME: b"x"})
    with pytest.raises(ArtifactError, match="needs"):
        store.write(1)


def test_symlinked_file_outside_root_is_refused(store: ArtifactStore, tmp_path: Path) -> None:
    """A file replaced by a symlink pointing outside the root is never read."""
    s = store.write(1, files={"w": b"weights"})
    outside = tmp_path / "secret"
    outside.write_bytes(b"weights")
    target = s.path / "w"
    target.unlink()
    target.symlink_to(outside)
    with pytest.raises(ArtifactError, match="outside"):
        WorkerLoader(store, "w0").load(1, s.artifact_hash)


def test_symlinked_artifact_dir_is_refused(store: ArtifactStore, tmp_path: Path) -> None:
    """An artifact directory that is a symlink (even to a real artifact) is refused."""
    s = store.write(1, files={"w": b"weights"})
    os.symlink(s.path, store.root / "v000000000002")
    with pytest.raises(ArtifactError):
        store.open(2)
    assert store.versions() == [1]


def test_check_name_accepts_ordinary_checkpoint_names() -> None:
    """Names real checkpoints use pass the conservative name rule."""
    for n in ("model-00001-of-00002.safetensors", "tokenizer.json", "config.json", "run_2+lora"):
        assert check_name(n, "file name") == n


def test_tampered_file_is_caught_before_any_ack(store: ArtifactStore) -> None:
    """Flipping one byte makes the loader raise, and no ack sequence number is consumed."""
    s = store.write(1, tensors=_tensors())
    f = s.path / WEIGHTS_NAME
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    loader = WorkerLoader(store, "w0")
    with pytest.raises(ArtifactError, match="not acknowledging"):
        loader.load(1, s.artifact_hash)
    with pytest.raises(ArtifactError, match="sha256"):
        store.verify(1, s.artifact_hash)
    f.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 0xFF]))
    _, ack = loader.load(1, s.artifact_hash)
    assert ack.seq == 0


def test_truncated_file_is_caught_before_any_ack(store: ArtifactStore) -> None:
    """A truncated weights file never parses into an ack: the hash catches it first."""
    s = store.write(1, tensors=_tensors())
    f = s.path / WEIGHTS_NAME
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(ArtifactError, match="hash"):
        WorkerLoader(store, "w0").load(1, s.artifact_hash)
    with pytest.raises(ArtifactError, match="size"):
        store.verify(1, s.artifact_hash)


def test_tampered_manifest_cannot_vouch_for_tampered_files(store: ArtifactStore) -> None:
    """Rewriting the manifest to match altered bytes still fails against the registry's hash."""
    s = store.write(1, files={"w": b"good"})
    (s.path / "w").write_bytes(b"evil")
    entry = FileEntry("w", 4, hashlib.sha256(b"evil").hexdigest())
    from rollout_lifecycle.model.artifacts import ArtifactManifest

    forged = ArtifactManifest(1, content_hash([entry]), (entry,))
    (s.path / MANIFEST_NAME).write_text(forged.to_json())
    with pytest.raises(ArtifactError, match="expected"):
        store.verify(1, s.artifact_hash)
    with pytest.raises(ArtifactError, match="not acknowledging"):
        WorkerLoader(store, "w0").load(1, s.artifact_hash)


def test_extra_or_missing_files_fail_verification(store: ArtifactStore) -> None:
    """verify insists the directory holds exactly the manifest's files."""
    s = store.write(1, files={"a": b"1", "b": b"2"})
    (s.path / "intruder").write_bytes(b"x")
    with pytest.raises(ArtifactError, match="extra"):
        store.verify(1, s.artifact_hash)
    (s.path / "intruder").unlink()
    (s.path / "b").unlink()
    with pytest.raises(ArtifactError, match="missing"):
        store.verify(1, s.artifact_hash)
    with pytest.raises(ArtifactError, match="cannot open"):
        WorkerLoader(store, "w0").load(1, s.artifact_hash)


def test_wrong_expected_hash_gives_no_ack(store: ArtifactStore) -> None:
    """A loader told to expect another artifact's hash refuses to ack this one."""
    s1 = store.write(1, files={"w": b"one"})
    store.write(2, files={"w": b"two"})
    with pytest.raises(ArtifactError, match="not acknowledging"):
        WorkerLoader(store, "w0").load(2, s1.artifact_hash)
    with pytest.raises(ArtifactError, match="hex"):
        WorkerLoader(store, "w0").load(1, "not-a-hash")


class _Boom:
    """Unpickling this would create a marker file: proof of code execution."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (Path.write_text, (Path(self.marker), "executed"))  # type: ignore[return-value]


def test_pickle_content_is_rejected_not_executed(store: ArtifactStore, tmp_path: Path) -> None:
    """A weights file holding a pickle is refused by the safetensors parser; nothing runs."""
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Boom(str(marker)))
    s = store.write(1, files={WEIGHTS_NAME: payload, "pytorch_model.bin": payload})
    with pytest.raises(ArtifactError, match="not valid safetensors"):
        WorkerLoader(store, "w0").load(1, s.artifact_hash)
    assert not marker.exists()


def test_raw_non_weight_files_are_returned_as_bytes(store: ArtifactStore) -> None:
    """Files other than *.safetensors come back untouched, never deserialised."""
    blob = pickle.dumps({"x": 1})
    s = store.write(1, tensors=_tensors(), files={"extra.bin": blob, "config.json": b"{}"})
    loaded, _ = WorkerLoader(store, "w0").load(1, s.artifact_hash)
    assert loaded.files == {"extra.bin": blob, "config.json": b"{}"}


def test_sharded_weights_merge_and_duplicate_tensor_is_refused(store: ArtifactStore) -> None:
    """Several safetensors shards merge; a tensor name in two shards is an error."""
    import safetensors.numpy as stn

    a = stn.save({"a": np.zeros(2, np.float32)})
    b = stn.save({"b": np.ones(2, np.float32)})
    s = store.write(1, files={"m-1.safetensors": a, "m-2.safetensors": b})
    loaded, _ = WorkerLoader(store, "w0").load(1, s.artifact_hash)
    assert sorted(loaded.tensors) == ["a", "b"]
    s2 = store.write(2, files={"m-1.safetensors": a, "m-2.safetensors": a})
    with pytest.raises(ArtifactError, match="two shards"):
        WorkerLoader(store, "w0").load(2, s2.artifact_hash)


def test_ack_sequence_and_restart(store: ArtifactStore) -> None:
    """Each successful load takes the next seq; a restarted loader has a new incarnation."""
    s = store.write(1, files={"w": b"x"})
    loader = WorkerLoader(store, "w0")
    seqs = [loader.load(1, s.artifact_hash)[1].seq for _ in range(3)]
    assert seqs == [0, 1, 2]
    _, ack = loader.restarted().load(1, s.artifact_hash)
    assert (ack.incarnation, ack.seq) == (1, 0)


def test_ack_echoes_the_attempt_token(store: ArtifactStore) -> None:
    """The loader puts the attempt's token into the ack it builds; without one it is a plain
    report; a token that is not a non-empty string is refused before anything is read."""
    s = store.write(1, files={"w": b"x"})
    _, ack = WorkerLoader(store, "w0").load(1, s.artifact_hash, token="t-1")
    assert (ack.token, ack.attempt) == ("t-1", None)
    _, plain = WorkerLoader(store, "w0").load(1, s.artifact_hash)
    assert plain.token is None
    for bad in ("", 7):
        with pytest.raises(ArtifactError, match="token must be"):
            WorkerLoader(store, "w0").load(1, s.artifact_hash, token=bad)  # type: ignore[arg-type]


def test_missing_version_is_an_artifact_error(store: ArtifactStore) -> None:
    """Opening a version that was never published says so."""
    with pytest.raises(ArtifactError, match="not in"):
        store.open(9)
    assert not store.exists(9)


# ---- crash safety --------------------------------------------------------------------------

_SLOW_WRITER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import rollout_lifecycle.model.artifacts as arts

    arts.CHUNK_BYTES = 1 << 20
    real = arts._write_chunk
    count = 0

    def slow(f, chunk):
        global count
        real(f, chunk)
        f.flush()
        count += 1
        print(f"chunk {count} {f.name}", flush=True)
        time.sleep(0.05)

    arts._write_chunk = slow
    store = arts.ArtifactStore(sys.argv[1])
    big = np.arange(16 << 18, dtype=np.float32)  # 16 MiB: 16 chunks
    store.write(int(sys.argv[2]), tensors={"big": big})
    print("done", flush=True)
    """
)


def test_sigkill_mid_write_leaves_no_artifact_and_retry_works(store: ArtifactStore) -> None:
    """A writer killed with SIGKILL mid-file publishes nothing; sweep cleans; a retry succeeds."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_WRITER, str(store.root), "4"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    partial = None
    for line in proc.stdout:
        if line.startswith("chunk 3 "):
            partial = Path(line.split(" ", 2)[2].strip())
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert partial is not None and partial.exists()
    assert 0 < partial.stat().st_size < 16 << 20  # really half-written
    assert store.versions() == []
    assert not store.exists(4)
    with pytest.raises(ArtifactError):
        store.open(4)
    removed = store.sweep_temp()
    assert [p.name for p in removed] == [partial.parent.name]
    assert list(store.root.iterdir()) == []
    s = store.write(4, tensors={"big": np.arange(16 << 18, dtype=np.float32)})
    assert store.verify(4, s.artifact_hash) == s


def test_sweep_keeps_live_writers_temp(
    store: ArtifactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sweep_temp during a write in this process leaves that writer's temp dir alone."""
    import rollout_lifecycle.model.artifacts as arts

    seen: list[list[Path]] = []
    real = arts._write_chunk

    def sweeping(f: object, chunk: memoryview) -> None:
        seen.append(store.sweep_temp())
        real(f, chunk)  # type: ignore[arg-type]

    monkeypatch.setattr(arts, "_write_chunk", sweeping)
    s = store.write(1, files={"w": b"abc"})
    assert seen and all(r == [] for r in seen)
    assert store.verify(1, s.artifact_hash) == s


def test_failed_write_cleans_its_temp(
    store: ArtifactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error mid-write raises ArtifactError and leaves no temp dir and no artifact."""
    import rollout_lifecycle.model.artifacts as arts

    def failing(_f: object, _chunk: memoryview) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(arts, "_write_chunk", failing)
    with pytest.raises(ArtifactError, match="No space"):
        store.write(1, files={"w": b"abc"})
    assert list(store.root.iterdir()) == []


def test_stale_temp_of_dead_pid_is_swept(store: ArtifactStore) -> None:
    """A temp dir named after a process that no longer exists is removed; readers ignore it."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    stray = store.root / f"{TEMP_PREFIX}{proc.pid}-v1-abc"
    stray.mkdir()
    (stray / "model.safetensors").write_bytes(b"half")
    assert store.versions() == []
    t0 = time.monotonic()
    assert store.sweep_temp() == [stray]
    assert time.monotonic() - t0 < 5
    assert not stray.exists()
