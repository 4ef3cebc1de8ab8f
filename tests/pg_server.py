"""A throwaway PostgreSQL server for tests and benchmarks: initdb + pg_ctl on loopback.

Debian's packages put the binaries in /usr/lib/postgresql/<major>/bin (not on PATH), and
initdb/postgres refuse to run as root, so as root every server command runs as the
`postgres` user (`runuser -u postgres`), with its data in a fresh directory under /tmp
owned by that user (a root-only 0700 parent would lock it out). The server listens on
127.0.0.1 only, on a free port, with fsync off: nothing here needs to survive a power cut.
synchronous_commit stays on: every acknowledged COMMIT has reached the kernel, so a server
killed with `pg_ctl stop -m immediate` (the restart tests) loses nothing it acknowledged.

Authentication: the superuser `postgres` is trusted on loopback (tests connect without a
password); the role `rl_password` must give its password (scram-sha-256), so tests can
prove what a wrong password gives.

pytest-postgresql and testing.postgresql refuse to run as root, hence this small module.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import attrs

INSTALL_HINT = (
    "PostgreSQL server binaries not found (initdb, pg_ctl); install them with "
    "`apt-get install postgresql` (Debian/Ubuntu), or put a directory holding initdb on "
    "PATH, or set ROLLOUT_LIFECYCLE_PG_BIN to it (then only that directory is used)"
)
PASSWORD_ROLE = "rl_password"
PASSWORD = "right-password"


class ServerUnavailable(RuntimeError):
    """No PostgreSQL binaries here, or the throwaway server would not start."""


def find_bin_dir() -> Path | None:
    """The directory holding initdb and pg_ctl, or None when PostgreSQL is not installed."""
    explicit = os.environ.get("ROLLOUT_LIFECYCLE_PG_BIN")
    if explicit:  # named explicitly: that directory or nothing
        d = Path(explicit)
        return d if (d / "initdb").is_file() and (d / "pg_ctl").is_file() else None
    candidates = []
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(str(Path(on_path).parent))
    candidates += sorted(
        glob.glob("/usr/lib/postgresql/*/bin"),
        key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0,
        reverse=True,
    )
    for c in candidates:
        if c and (Path(c) / "initdb").is_file() and (Path(c) / "pg_ctl").is_file():
            return Path(c)
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_server_user(cmd: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


def _run(cmd: list[str], what: str, timeout: float = 120.0) -> None:
    res = subprocess.run(
        _as_server_user(cmd), capture_output=True, text=True, timeout=timeout, check=False
    )
    if res.returncode != 0:
        raise ServerUnavailable(f"{what} failed ({res.returncode}): {res.stderr.strip()[-800:]}")


@attrs.define
class Server:
    """A running throwaway server; `stop()` (or `restart()`) drives it with pg_ctl."""

    bin_dir: Path
    root: Path
    port: int
    host: str = "127.0.0.1"

    @property
    def data(self) -> Path:
        """The cluster's data directory."""
        return self.root / "data"

    def url(self, dbname: str = "postgres", user: str = "postgres", password: str = "") -> str:
        """A postgresql:// URL for `dbname` on this server."""
        auth = f"{user}:{password}" if password else user
        return f"postgresql://{auth}@{self.host}:{self.port}/{dbname}"

    def start(self) -> None:
        """pg_ctl start and wait until it accepts connections."""
        _run(
            [
                str(self.bin_dir / "pg_ctl"),
                "-D",
                str(self.data),
                "-l",
                str(self.root / "server.log"),
                "-w",
                "-t",
                "60",
                "-o",
                f"-p {self.port} -k {self.root}",
                "start",
            ],
            "pg_ctl start",
        )

    def stop(self, mode: str = "fast") -> None:
        """pg_ctl stop (fast: roll back open transactions, close every connection)."""
        _run(
            [str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"],
            "pg_ctl stop",
        )

    def restart(self, mode: str = "fast") -> None:
        """Stop and start again on the same port: every client connection is cut."""
        self.stop(mode)
        self.start()

    def remove(self) -> None:
        """Stop if running, then delete the data directory."""
        with contextlib.suppress(ServerUnavailable, subprocess.TimeoutExpired):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def psql(self, sql: str, dbname: str = "postgres") -> str:
        """Run SQL as the superuser through psycopg; returns the first column of rows."""
        import psycopg

        with psycopg.connect(self.url(dbname), autocommit=True) as conn:
            cur = conn.execute(sql)
            if cur.description is None:
                return ""
            return "\n".join(str(r[0]) for r in cur.fetchall())


_HBA = f"""\
local   all   all                             trust
host    all   {PASSWORD_ROLE}   127.0.0.1/32   scram-sha-256
host    all   all             127.0.0.1/32    trust
"""

_CONF = """
listen_addresses = '127.0.0.1'
fsync = off
full_page_writes = off
max_connections = 200
shared_buffers = 64MB
unix_socket_permissions = 0700
log_min_messages = warning
"""


def create_server(bin_dir: Path | None = None) -> Server:
    """initdb a new cluster in a fresh /tmp directory and start it on a free port."""
    found = bin_dir or find_bin_dir()
    if found is None:
        raise ServerUnavailable(INSTALL_HINT)
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        raise ServerUnavailable("running as root needs `runuser` to start PostgreSQL as postgres")
    root = Path(tempfile.mkdtemp(prefix="rl-pg-", dir="/tmp"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    server = Server(found, root, free_port())
    try:
        _run(
            [
                str(found / "initdb"),
                "-D",
                str(server.data),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ],
            "initdb",
        )
        conf = server.data / "postgresql.conf"
        hba = server.data / "pg_hba.conf"
        with conf.open("a") as fh:
            fh.write(_CONF)
        hba.write_text(_HBA)
        server.start()
        server.psql(f"CREATE ROLE {PASSWORD_ROLE} LOGIN SUPERUSER PASSWORD '{PASSWORD}'")
    except BaseException:
        server.remove()
        raise
    return server


@contextlib.contextmanager
def throwaway_server() -> Iterator[Server]:
    """A server for the duration of the block, removed afterwards."""
    server = create_server()
    try:
        yield server
    finally:
        server.remove()


_db_counter = 0


def new_database(server: Server, prefix: str = "t") -> str:
    """CREATE DATABASE with a fresh name; returns its postgresql:// URL."""
    global _db_counter
    _db_counter += 1
    name = f"{prefix}_{os.getpid()}_{_db_counter}_{int(time.time() * 1000) % 100000}"
    server.psql(f'CREATE DATABASE "{name}" TEMPLATE template0 STRATEGY file_copy')
    return server.url(name)
