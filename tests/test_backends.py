"""open_backend: URL parsing, what each scheme opens, read-only opening, and the shared trace."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from rollout_lifecycle.model import backends
from rollout_lifecycle.model.backends import DEFAULT_URL, Backend, OpenOptions, open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.errors import BackendURLError
from rollout_lifecycle.model.events import ArtifactChanged, EntryChanged, MembershipChanged
from rollout_lifecycle.model.ledger import MemoryLedger
from rollout_lifecycle.model.records import LedgerEntry
from rollout_lifecycle.model.registry import MemoryRegistry, SQLiteRegistry
from rollout_lifecycle.model.sqlite_ledger import SQLiteLedger

H0 = "a" * 64


def _entry(rid: str = "r0") -> LedgerEntry:
    return LedgerEntry(rollout_id=rid, behavior_version=0, artifact_hash=H0)


def test_default_url_is_a_relative_sqlite_file() -> None:
    """The default names rollout-lifecycle.db in the current directory."""
    assert DEFAULT_URL == "sqlite:///rollout-lifecycle.db"
    assert backends.sqlite_path(DEFAULT_URL) == Path("rollout-lifecycle.db")


def test_memory_backend_shares_one_event_log() -> None:
    """memory:// gives a MemoryLedger and MemoryRegistry writing into the same EventLog."""
    with open_backend("memory://") as b:
        assert isinstance(b.ledger, MemoryLedger)
        assert isinstance(b.registry, MemoryRegistry)
        assert b.ledger.log is b.registry.log
        assert b.path is None and b.url == "memory://"


def test_sqlite_relative_path_is_relative_to_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sqlite:///sub/x.db opens sub/x.db under the current directory, ledger and registry."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    with open_backend("sqlite:///sub/x.db") as b:
        assert isinstance(b.ledger, SQLiteLedger)
        assert isinstance(b.registry, SQLiteRegistry)
        assert b.path == Path("sub/x.db")
    assert (tmp_path / "sub" / "x.db").is_file()


def test_sqlite_absolute_path_uses_four_slashes(tmp_path: Path) -> None:
    """sqlite:////abs/x.db opens the absolute path; ledger and registry share the file."""
    url = f"sqlite:///{tmp_path / 'x.db'}"
    assert url.startswith("sqlite:////")
    with open_backend(url) as b:
        assert b.path == tmp_path / "x.db"
        b.ledger.add(_entry())
    with open_backend(url, create=False) as again:
        assert again.ledger.get("r0").state == "dispatched"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("", "empty"),
        ("memory://x", "nothing after the scheme"),
        ("sqlite://", "three slashes"),
        ("sqlite:///", "path to the database file is missing"),
        ("sqlite:///:memory:", "use memory://"),
        ("sqlite:///x.db?mode=ro", "query parameters"),
        ("postgresql+psycopg://user@localhost/rl", "drop the '+psycopg'"),
        ("postgresql://[::1/rl", "not a valid PostgreSQL URL"),
        ("postgres://localhost/rl?bogus=1", "invalid URI query parameter"),
        ("redis://localhost", "unknown scheme 'redis'"),
        ("ledger.db", "did you mean sqlite:///ledger.db"),
    ],
)
def test_bad_urls_are_refused_with_examples(url: str, why: str) -> None:
    """Every bad URL raises BackendURLError saying why and listing valid examples."""
    with pytest.raises(BackendURLError) as info:
        open_backend(url)
    msg = str(info.value)
    assert why in msg
    assert "Valid examples" in msg and "memory://" in msg and "sqlite:////" in msg


def test_reading_a_missing_sqlite_file_never_creates_it(tmp_path: Path) -> None:
    """create=False on a missing file is an error and leaves no file behind."""
    path = tmp_path / "typo.db"
    with pytest.raises(BackendURLError, match="no such file"):
        open_backend(f"sqlite:///{path}", create=False)
    assert not path.exists()


def test_reading_a_foreign_sqlite_file_adds_no_tables(tmp_path: Path) -> None:
    """create=False refuses a SQLite file without a ledger and does not add tables to it."""
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (x)")
    with pytest.raises(BackendURLError, match="holds no rollout-lifecycle ledger"):
        open_backend(f"sqlite:///{path}", create=False)
    with sqlite3.connect(path) as conn:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    assert names == {"t"}


def test_reading_a_non_database_file_is_refused(tmp_path: Path) -> None:
    """A file that is not SQLite at all is a clear error, opened for reading or writing."""
    path = tmp_path / "notes.db"
    path.write_text("hello")
    for create in (False, True):
        with pytest.raises(BackendURLError, match="not a"):
            open_backend(f"sqlite:///{path}", create=create)


def test_memory_cannot_be_read_back() -> None:
    """create=False on memory:// is refused: a new process has nothing stored there."""
    with pytest.raises(BackendURLError, match="nothing stored"):
        open_backend("memory://", create=False)


def test_missing_directory_is_reported(tmp_path: Path) -> None:
    """A path in a directory that does not exist names the directory."""
    with pytest.raises(BackendURLError, match="does not exist"):
        open_backend(f"sqlite:///{tmp_path / 'nope' / 'x.db'}")


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_trace_merges_ledger_and_registry_in_global_order(kind: str, tmp_path: Path) -> None:
    """Backend.trace interleaves entry and artifact events by their one global sequence."""
    url = "memory://" if kind == "memory" else f"sqlite:///{tmp_path / 'x.db'}"
    with open_backend(url) as b:
        coord = ActivationCoordinator(b.registry, ["w0"], ledger=b.ledger)
        coord.prepare(0)
        b.ledger.add(_entry("r0"))
        coord.commit_artifact(0, H0)
        b.ledger.add(_entry("r1"))
        trace = b.trace()
    kinds = [type(e) for e in trace]
    assert kinds == [
        MembershipChanged,
        ArtifactChanged,
        EntryChanged,
        ArtifactChanged,
        EntryChanged,
    ]
    seqs = [e.seq for e in trace]
    assert seqs == sorted(seqs) and len(set(seqs)) == 5


def test_close_is_idempotent(tmp_path: Path) -> None:
    """Closing twice is harmless (the context manager may follow an explicit close)."""
    b = open_backend(f"sqlite:///{tmp_path / 'x.db'}")
    b.close()
    b.close()


def test_openers_is_the_one_extension_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new scheme plugs in by adding one opener; the URL's remainder reaches it."""
    seen: list[tuple[str, OpenOptions]] = []

    def fake(url: str, rest: str, opts: OpenOptions) -> Backend:
        seen.append((rest, opts))
        return Backend(url=url, ledger=MemoryLedger(), registry=MemoryRegistry())

    monkeypatch.setitem(backends.OPENERS, "fake", fake)
    b = open_backend("fake://host/db", lease_seconds=5.0)
    assert b.url == "fake://host/db"
    assert seen[0][0] == "host/db" and seen[0][1].lease_seconds == 5.0


def test_lease_seconds_reach_the_ledger() -> None:
    """The lease length is passed to the ledger (reservations expire after it)."""
    with open_backend("memory://", lease_seconds=7.0) as b:
        assert isinstance(b.ledger, MemoryLedger)
        assert b.ledger.lease_seconds == 7.0


def test_postgresql_without_psycopg_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without psycopg a postgresql:// URL is a technical error naming the [postgres] extra."""
    import sys

    from rollout_lifecycle.model.errors import BackendUnavailable

    for name in list(sys.modules):
        if name.startswith(("psycopg", "rollout_lifecycle.model.postgres_")):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "psycopg", None)  # import psycopg -> ImportError
    with pytest.raises(BackendUnavailable, match=r"rollout-lifecycle\[postgres\]"):
        open_backend("postgresql://user@localhost/rl")
