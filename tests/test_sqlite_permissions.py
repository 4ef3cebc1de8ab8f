"""A SQLite file is one trust domain: whoever can write it is the operator (docs/trust-
boundary.md), so the database file and its -wal and -shm are created owner-only, unless
ROLLOUT_LIFECYCLE_SQLITE_MODE says otherwise; so is the writers' queue file beside it
(`-writers`, model/sqlite_conns.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.errors import RolloutLifecycleError
from rollout_lifecycle.model.records import AdmissionPolicy, LedgerEntry, Reward
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.model.sqlite_common import FILE_MODE_ENV


def _use(path: Path, rid: str = "r") -> dict[str, int]:
    """Open a deployment in `path`, write to it, and return each file's permissions."""
    with open_backend(f"sqlite:///{path}") as b:
        policy = AdmissionPolicy(1, 0.2)
        set_admission_policy(b.registry, policy, "the operator's step")
        ActivationCoordinator(b.registry, ["w0"], ledger=b.ledger, policy=policy)
        b.ledger.add(
            LedgerEntry(
                rollout_id=rid,
                behavior_version=0,
                artifact_hash="a" * 64,
                state="rewarded",
                reward=Reward("rm", "1", 1.0),
            )
        )
        return {
            suffix: stat.S_IMODE(Path(f"{path}{suffix}").stat().st_mode)
            for suffix in ("", "-wal", "-shm", "-writers")
            if Path(f"{path}{suffix}").exists()
        }


@pytest.fixture
def umask_022() -> object:
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_files_are_created_owner_only(
    tmp_path: Path, umask_022: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a umask that lets others read, the file, -wal, -shm and -writers are still
    0600."""
    monkeypatch.delenv(FILE_MODE_ENV, raising=False)
    modes = _use(tmp_path / "l.db")
    assert set(modes) == {"", "-wal", "-shm", "-writers"}
    assert set(modes.values()) == {0o600}, modes


@pytest.mark.parametrize(("setting", "want"), [("0640", 0o640), ("umask", 0o644)])
def test_the_mode_can_be_told_otherwise(
    tmp_path: Path, umask_022: object, monkeypatch: pytest.MonkeyPatch, setting: str, want: int
) -> None:
    """ROLLOUT_LIFECYCLE_SQLITE_MODE gives another mode, or SQLite's own under the umask."""
    monkeypatch.setenv(FILE_MODE_ENV, setting)
    modes = _use(tmp_path / "l.db")
    assert set(modes.values()) == {want}, modes


def test_an_existing_file_keeps_its_permissions(
    tmp_path: Path, umask_022: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file made by someone else (a DBA's 0640) is not changed by opening it."""
    monkeypatch.delenv(FILE_MODE_ENV, raising=False)
    path = tmp_path / "l.db"
    _use(path)
    path.chmod(0o640)
    assert _use(path, "r2")[""] == 0o640


def test_a_bad_mode_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mode the owner cannot write with, or no octal at all, is refused before anything."""
    for bad in ("0400", "rw", "0o777777"):
        monkeypatch.setenv(FILE_MODE_ENV, bad)
        with pytest.raises(RolloutLifecycleError, match=FILE_MODE_ENV):
            _use(tmp_path / "l.db")
        assert not (tmp_path / "l.db").exists()
