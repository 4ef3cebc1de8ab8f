"""A SQLite ledger file deleted, replaced or overwritten while open (issue 17, item 7).

SQLite ties a database to its -wal and -shm by name only: a fresh open of a file moved in
under the name reads the old file's pages from the old -wal and, on close, writes them into
the new one. These tests do to the file what users do (mv, cp over, rm, restore a backup,
kill -9) and require: every read and write of the ledger, the registry and the coordinator
fails closed with FileReplaced and a message that says what happened and what to do; the
old file keeps its last transactions; the reopen shows the new file or is refused.
"""

from __future__ import annotations

import inspect
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout_lifecycle.model.backends import Backend, open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.records import LedgerEntry
from rollout_lifecycle.model.registry import RegistryStore
from rollout_lifecycle.model.sqlite_common import FileReplaced
from rollout_lifecycle.model.sqlite_files import WAL_MARK, parse_header, wal_page_one
from rollout_lifecycle.model.sqlite_ledger import SQLiteLedger

H = "a" * 64
WORKERS = ["w0", "w1"]
CLI = Path(sys.executable).parent / "rollout-lifecycle"

# a learner in another process: it writes, then waits; on each line it reads stdin it
# makes one more call and prints what happened
HOLDER = """
import sys
from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.records import LedgerEntry
b = open_backend(sys.argv[1])
b.ledger.add_many(
    [LedgerEntry(rollout_id=f"late{i:03d}", behavior_version=0, artifact_hash="a" * 64)
     for i in range(int(sys.argv[2]))]
)
print("ready", flush=True)
for _ in sys.stdin:
    try:
        b.ledger.find("late000")
        print("answered", flush=True)
    except Exception as exc:
        print(type(exc).__name__, flush=True)
"""


def url(path: Path) -> str:
    return f"sqlite:///{path}"


def entries(prefix: str, n: int) -> list[LedgerEntry]:
    return [
        LedgerEntry(rollout_id=f"{prefix}{i:03d}", behavior_version=0, artifact_hash=H)
        for i in range(n)
    ]


def wal(path: Path) -> Path:
    return Path(f"{path}-wal")


def shm(path: Path) -> Path:
    return Path(f"{path}-shm")


def ids_in(path: Path) -> list[str]:
    """The rollout ids in a ledger file, read with plain sqlite3 (not the code under test)."""
    conn = sqlite3.connect(path)
    try:
        return sorted(r[0] for r in conn.execute("SELECT rollout_id FROM rollouts"))
    finally:
        conn.close()


def make_file(path: Path, prefix: str, n: int) -> list[str]:
    """A closed ledger file with a registry (a worker set) and `n` rollouts."""
    with open_backend(url(path)) as b:
        ActivationCoordinator(b.registry, WORKERS)
        b.ledger.add_many(entries(prefix, n))
    return [e.rollout_id for e in entries(prefix, n)]


def ledger_calls(b: Backend) -> list[tuple[str, Callable[[], object]]]:
    led = b.ledger
    return [
        ("add", lambda: led.add(entries("x", 1)[0])),
        ("find", lambda: led.find("old000")),
        ("get", lambda: led.get("old000")),
        ("snapshot", led.snapshot),
        ("history", led.history),
        ("statistics", led.statistics),
        ("reserved_by", lambda: led.reserved_by("u")),
        ("bad_versions", lambda: led.bad_versions),
        ("expire_leases", led.expire_leases),
    ]


def registry_calls(reg: RegistryStore) -> list[tuple[str, Callable[[], object]]]:
    """Every method of the registry protocol (reads found by introspection, so one added
    later is covered too), called with 0 for each required argument."""
    out: list[tuple[str, Callable[[], object]]] = []
    names = sorted(n for n in dir(RegistryStore) if not n.startswith("_") and n != "close")
    for name in names:
        fn = getattr(reg, name)
        if name == "transact":
            out.append((name, lambda fn=fn: fn(lambda view: (None, None))))
            continue
        params = inspect.signature(fn).parameters.values()
        args = [0 for p in params if p.default is inspect.Parameter.empty]
        out.append((name, lambda fn=fn, args=args: fn(*args)))
    return out


def coordinator_calls(coord: ActivationCoordinator) -> list[tuple[str, Callable[[], object]]]:
    return [
        ("pointer", coord.pointer),
        ("artifacts", coord.artifacts),
        ("required_workers", lambda: coord.required_workers),
        ("statistics", coord.statistics),
        ("history", coord.history),
        ("trace", coord.trace),
        ("resume", coord.resume),
        ("change_membership", lambda: coord.change_membership(["w0", "w1", "w2"], "grow")),
    ]


def assert_all_refused(calls: list[tuple[str, Callable[[], object]]], match: str) -> None:
    """Each call raises FileReplaced whose message says what happened; none answers."""
    answered = []
    for name, call in calls:
        try:
            call()
        except FileReplaced as exc:
            assert match in str(exc), (name, str(exc))
        else:
            answered.append(name)
    assert not answered, f"answered from a file that is gone: {answered}"


@pytest.fixture
def open_file(tmp_path: Path) -> Iterator[tuple[Path, Backend, ActivationCoordinator]]:
    """A ledger file in use: a backend and a coordinator on it, the last writes still in
    its -wal."""
    db = tmp_path / "ledger.db"
    b = open_backend(url(db))
    coord = ActivationCoordinator(b.registry, WORKERS)
    b.ledger.add_many(entries("old", 5))
    assert wal(db).stat().st_size > 0
    try:
        yield db, b, coord
    finally:
        b.close()


def test_a_replaced_file_gives_its_wal_back_and_reopens_as_the_new_file(
    open_file: tuple[Path, Backend, ActivationCoordinator], tmp_path: Path
) -> None:
    """mv other.db over an open ledger: every ledger, registry and coordinator call is
    refused; the old file (moved aside) gets its last transactions from the -wal beside
    the new file; the new file then opens as itself and stays so."""
    db, b, coord = open_file
    new_ids = make_file(tmp_path / "other.db", "new", 2)
    os.replace(db, tmp_path / "moved.db")
    os.replace(tmp_path / "other.db", db)
    assert wal(db).stat().st_size > 0 and shm(db).exists()  # the old file's, beside the new
    with pytest.raises(FileReplaced, match="was replaced while open; nothing was written") as e:
        b.ledger.add(entries("x", 1)[0])
    assert "nothing is lost" in str(e.value) and f"at {tmp_path / 'moved.db'}" in str(e.value)
    assert_all_refused(ledger_calls(b), "ledger")
    assert_all_refused(registry_calls(b.registry), "registry")
    assert_all_refused(coordinator_calls(coord), "was replaced while open")
    assert wal(db).stat().st_size == 0  # handed back
    assert ids_in(tmp_path / "moved.db") == [f"old{i:03d}" for i in range(5)]
    with open_backend(url(db)) as again:
        assert sorted(again.ledger.snapshot()) == new_ids
        assert again.registry.required_workers() == tuple(WORKERS)
        again.ledger.add(entries("more", 1)[0])
    b.close()
    assert ids_in(db) == sorted([*new_ids, "more000"])


def test_a_wal_that_cannot_be_given_back_stays_and_the_message_says_where_it_goes(
    open_file: tuple[Path, Backend, ActivationCoordinator], tmp_path: Path
) -> None:
    """Another program is reading the old file, so its -wal cannot be written back: the
    message says so and where the -wal belongs; the new file is not opened with it, and
    moving it there, as told, completes the old file."""
    db, b, _ = open_file
    reader = sqlite3.connect(db)  # plain sqlite3, in the middle of a read
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM rollouts").fetchall()
    new_ids = make_file(tmp_path / "other.db", "new", 2)
    os.replace(db, tmp_path / "moved.db")
    os.replace(tmp_path / "other.db", db)
    with pytest.raises(FileReplaced, match="writing them back failed") as e:
        b.ledger.add(entries("x", 1)[0])
    moved_wal = wal(tmp_path / "moved.db")
    assert f"move ledger.db-wal to {moved_wal} and remove ledger.db-shm" in str(e.value)
    reader.close()
    b.close()
    assert wal(db).stat().st_size > 0  # SQLite left it: its file was moved
    if _xattrs_work(tmp_path):
        with pytest.raises(FileReplaced, match="is not that file's"):
            open_backend(url(db))
    os.replace(wal(db), moved_wal)
    shm(db).unlink()
    assert ids_in(tmp_path / "moved.db") == [f"old{i:03d}" for i in range(5)]
    assert ids_in(db) == new_ids


def test_reopening_in_the_same_process_shows_the_new_file(
    open_file: tuple[Path, Backend, ActivationCoordinator], tmp_path: Path
) -> None:
    """The issue's reproduction: the file is replaced and reopened while the first backend,
    untouched since, still has the old one. The reopen shows the NEW file (the stale
    backend is failed first and gives the old -wal back), and the old file loses nothing."""
    db, b, coord = open_file
    new_ids = make_file(tmp_path / "other.db", "new", 2)
    shutil.copy(db, tmp_path / "backup-without-wal.db")  # what a careless backup holds
    os.replace(db, tmp_path / "moved.db")
    os.replace(tmp_path / "other.db", db)
    with open_backend(url(db)) as again:
        assert sorted(again.ledger.snapshot()) == new_ids
    assert_all_refused([*ledger_calls(b), *coordinator_calls(coord)], "was replaced while open")
    assert ids_in(tmp_path / "moved.db") == [f"old{i:03d}" for i in range(5)]
    assert ids_in(db) == new_ids
    assert ids_in(tmp_path / "backup-without-wal.db") != ids_in(tmp_path / "moved.db")


def test_a_deleted_file_fails_closed_and_a_new_one_starts_empty(
    open_file: tuple[Path, Backend, ActivationCoordinator],
) -> None:
    """rm of an open ledger: reads and writes of ledger, registry and coordinator are all
    refused saying so; a new file at the path starts empty, not with the old pages."""
    db, b, coord = open_file
    db.unlink()
    assert wal(db).exists()
    assert_all_refused(ledger_calls(b), "was deleted while open; nothing was written")
    assert_all_refused(registry_calls(b.registry), "registry")
    assert_all_refused(coordinator_calls(coord), "was deleted while open")
    with open_backend(url(db)) as fresh:
        assert fresh.ledger.snapshot() == {}
        assert fresh.registry.required_workers() is None
        fresh.ledger.add(entries("n", 1)[0])
    assert ids_in(db) == ["n000"]


@pytest.mark.parametrize("how", ["cp over it", "truncate"])
def test_an_overwrite_in_place_is_detected(
    how: str, open_file: tuple[Path, Backend, ActivationCoordinator], tmp_path: Path
) -> None:
    """The same inode with other bytes (`cp other.db ledger.db`, `truncate -s 0`), done by
    another process: the next read or write of each party is refused as an overwrite."""
    db, b, coord = open_file
    make_file(tmp_path / "other.db", "new", 2)
    inode = db.stat().st_ino
    if how == "cp over it":
        subprocess.run(["cp", str(tmp_path / "other.db"), str(db)], check=True)
    else:
        subprocess.run(["truncate", "-s", "0", str(db)], check=True)
    assert db.stat().st_ino == inode
    with pytest.raises(FileReplaced, match="overwritten in place while open") as e:
        b.ledger.find("old000")
    assert ("holds the file with id" if how == "cp over it" else "header is gone") in str(e.value)
    assert_all_refused(ledger_calls(b), "overwritten in place")
    assert_all_refused(registry_calls(b.registry), "overwritten in place")
    assert_all_refused(coordinator_calls(coord), "overwritten in place")


def test_a_new_thread_never_connects_to_the_file_that_replaced_its_ledger(
    tmp_path: Path,
) -> None:
    """Each thread opens its own connection: one opened after the replacement must not
    open the new file (its first call is refused like every other)."""
    db = tmp_path / "ledger.db"
    led = SQLiteLedger(db)
    led.add_many(entries("old", 2))
    make_file(tmp_path / "other.db", "new", 2)
    os.replace(tmp_path / "other.db", db)
    seen: list[object] = []
    t = threading.Thread(target=lambda: seen.append(_outcome(lambda: led.find("new000"))))
    t.start()
    t.join()
    assert seen == ["FileReplaced"]
    led.close()


def _outcome(call: Callable[[], object]) -> object:
    try:
        return call()
    except Exception as exc:
        return type(exc).__name__


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLI), *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=120
    )


def _holder(db: Path, n: int) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url(db), str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _ask(p: subprocess.Popen[str]) -> str:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("\n")
    p.stdin.flush()
    return p.stdout.readline().strip()


@pytest.mark.parametrize("lasting", [False, True])
def test_a_process_opening_the_file_is_not_taken_for_one_holding_an_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lasting: bool
) -> None:
    """A process that holds a file's -shm but not the file is one that still has an old
    file open under this name, or one opening or closing this file, which holds the -shm
    alone for an instant (the bench's fleet, eight processes opening one new file, caught
    one there and its open was refused). The open reads /proc/locks again: a holder that
    lets go within the rechecks is no reason to refuse; one that lasts is."""
    from rollout_lifecycle.model import sqlite_files as F

    db = tmp_path / "ledger.db"
    make_file(db, "r", 1)
    shm = Path(f"{db}-shm")
    shm.write_bytes(b"")  # a -shm beside the file, as an open connection leaves it
    held = ["1:", "POSIX", "ADVISORY", "READ", "4194301", F._lock_key(shm), "128", "128"]
    reads: list[int] = []

    def proc_locks() -> list[list[str]]:
        reads.append(1)
        return [list(held)] if lasting or len(reads) == 1 else []

    monkeypatch.setattr(F, "_read_proc_locks", proc_locks)
    if lasting:
        with pytest.raises(FileReplaced, match="process 4194301 still has the old file open"):
            F.guard_open(db)
        assert len(reads) == 1 + F._RECHECKS
    else:
        F.guard_open(db)  # the instant passed: nothing refused
        assert len(reads) == 2


def test_open_is_refused_while_another_process_holds_the_replaced_file(tmp_path: Path) -> None:
    """A learner in another process has the old file open: opening the new one (to write,
    to read, from the CLI) is refused naming that process, since its -wal is still in use;
    once the learner's next call fails closed and gives the -wal back, the new file opens
    as itself and the old one has every transaction."""
    db = tmp_path / "ledger.db"
    old_ids = make_file(db, "old", 3)
    holder = _holder(db, 4)
    try:
        new_ids = make_file(tmp_path / "other.db", "new", 2)
        os.replace(db, tmp_path / "moved.db")
        os.replace(tmp_path / "other.db", db)
        for create in (True, False):
            with pytest.raises(FileReplaced, match=f"process {holder.pid} still has the old"):
                open_backend(url(db), create=create)
        res = _cli("ledger", "counts", "--backend", url(db), cwd=tmp_path)
        assert res.returncode == 2, res.stdout + res.stderr
        assert f"process {holder.pid} still has the old file open" in res.stderr
        assert "Traceback" not in res.stderr
        assert _ask(holder) == "FileReplaced"
        with open_backend(url(db)) as again:
            assert sorted(again.ledger.snapshot()) == new_ids
    finally:
        holder.kill()
        holder.wait()
    late = [f"late{i:03d}" for i in range(4)]
    assert ids_in(tmp_path / "moved.db") == sorted([*old_ids, *late])
    assert ids_in(db) == new_ids


def _xattrs_work(folder: Path) -> bool:
    probe = folder / "xattr-probe"
    probe.touch()
    try:
        os.setxattr(probe, "user.probe", b"1")
    except OSError:
        return False
    finally:
        probe.unlink()
    return True


@pytest.mark.parametrize("how", ["same file", "another file", "a backup", "another, no mark"])
def test_a_wal_left_by_a_killed_process(how: str, tmp_path: Path) -> None:
    """kill -9 of the last process on a file leaves its -wal. On the same file SQLite
    replays it (nothing lost); when the name meanwhile holds another file (another ledger,
    or a backup of this one restored), opening is refused instead of applying the -wal, and
    doing what the message says gives both files back whole."""
    db = tmp_path / "ledger.db"
    old_ids = make_file(db, "old", 3)
    shutil.copy(db, tmp_path / "backup.db")
    # 300 rollouts make the file grow, so page 1 (the header, with the file's id) is among
    # the -wal's pages: the evidence the check uses where no mark is on the -wal
    holder = _holder(db, 300)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    late = [f"late{i:03d}" for i in range(300)]
    assert wal(db).stat().st_size > 0
    if how == "same file":
        with open_backend(url(db)) as b:
            assert sorted(b.ledger.snapshot()) == sorted([*old_ids, *late])
        return
    if how == "another, no mark" or not _xattrs_work(tmp_path):
        if how != "another, no mark":
            pytest.skip("this file system keeps no user xattrs")
        assert any(h is not None for h in wal_page_one(wal(db)) or [])
        os.removexattr(wal(db), WAL_MARK)
    os.replace(db, tmp_path / "moved.db")
    if how == "a backup":
        shutil.copy(tmp_path / "backup.db", tmp_path / "restoring.db")
        os.replace(tmp_path / "restoring.db", db)
        expected_new = old_ids
    else:
        expected_new = make_file(tmp_path / "other.db", "new", 2)
        os.replace(tmp_path / "other.db", db)
    with pytest.raises(FileReplaced, match=r"-wal beside .* is not that file's") as e:
        open_backend(url(db))
    assert "Nothing was opened" in str(e.value) and "move ledger.db-wal" in str(e.value)
    res = _cli("ledger", "counts", "--backend", url(db), cwd=tmp_path)
    assert res.returncode == 2 and "is not that file's" in res.stderr, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    # as the message says: the -wal (and -shm) go with the file they belong to
    os.replace(wal(db), wal(tmp_path / "moved.db"))
    shm(db).unlink()
    assert ids_in(tmp_path / "moved.db") == sorted([*old_ids, *late])
    with open_backend(url(db)) as b:
        assert sorted(b.ledger.snapshot()) == expected_new


def test_a_file_without_an_id_gets_one_from_its_first_writer(tmp_path: Path) -> None:
    """Files written before ids: a reader leaves them as they are (reading never writes),
    the first writer gives one an id, on disk at once, so an overwrite can be told."""
    db = tmp_path / "ledger.db"
    make_file(db, "old", 1)
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA user_version = 0")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()

    def on_disk() -> Any:
        header = parse_header(db.read_bytes()[:100])
        assert header is not None
        return header.file_id

    with open_backend(url(db), create=False) as b:
        assert b.ledger.find("old000") is not None
    assert on_disk() == 0
    with open_backend(url(db)) as b:
        b.ledger.add(entries("x", 1)[0])
        assert on_disk() != 0
