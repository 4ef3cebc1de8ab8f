"""Test-session setup: Hypothesis profile selection (CI keeps the deterministic `ci` one), and
a throwaway PostgreSQL server for every test that needs one.

A test needs PostgreSQL when it is marked `postgres`, or when one of its parameters names
the PostgreSQL backend ('postgresql' or a postgresql:// URL); such tests are marked
automatically. The server starts once, on first need (initdb + pg_ctl, see
tests/pg_server.py), and its URL goes into ROLLOUT_LIFECYCLE_POSTGRES_URL, so the 'postgresql'
backend of the stateful machines, the conformance kit and child processes all find it; it is
stopped and deleted when the session ends. Without PostgreSQL binaries those tests skip and
say how to install them, unless REQUIRE_POSTGRES=1 (CI), which turns the skip into a failure.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest

from rollout_lifecycle.stateful_tests.backends import POSTGRES_URL_ENV
from rollout_lifecycle.stateful_tests.profiles import load_selected_profile
from tests import pg_server

load_selected_profile()

_state: dict[str, Any] = {"server": None, "error": None}


def _names_postgres(value: object) -> bool:
    return isinstance(value, str) and (
        value == "postgresql" or value.startswith(("postgresql://", "postgres://"))
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test whose parameters name the PostgreSQL backend."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and any(_names_postgres(v) for v in callspec.params.values()):
            item.add_marker(pytest.mark.postgres)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the server up front when the run holds PostgreSQL tests, so that a test which
    walks every backend name inside its body (not by parameter) finds the server too."""
    if any(item.get_closest_marker("postgres") for item in session.items):
        _start()


def _required() -> bool:
    return os.environ.get("REQUIRE_POSTGRES", "").strip() not in ("", "0", "false", "no")


def _start() -> None:
    """Start the session's server once; remember why not when it cannot start."""
    no_driver = importlib.util.find_spec("psycopg") is None
    if _state["server"] is None and _state["error"] is None and no_driver:
        _state["error"] = (
            "psycopg 3 is not installed: pip install -e '.[dev,postgres-binary]' (or [postgres] "
            "where libpq is installed)"
        )
    if _state["server"] is None and _state["error"] is None:
        try:
            server = pg_server.create_server()
            server.psql("CREATE DATABASE rl TEMPLATE template0")
        except Exception as exc:  # any reason the server would not come up is the skip's reason
            _state["error"] = str(exc) or type(exc).__name__
        else:
            _state["server"] = server
            os.environ[POSTGRES_URL_ENV] = server.url("rl")


def postgres_server_or_skip() -> pg_server.Server:
    """The session's server, started on first call; skip (or fail, if required) without one."""
    _start()
    if _state["server"] is None:
        message = f"PostgreSQL tests need a server: {_state['error']}"
        if _required():
            pytest.fail(f"REQUIRE_POSTGRES is set: {message}")
        pytest.skip(message)
    server: pg_server.Server = _state["server"]
    return server


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop and delete the throwaway server."""
    server = _state["server"]
    if server is not None:
        _state["server"] = None
        server.remove()


@pytest.fixture(autouse=True)
def _postgres_for_marked_tests(request: pytest.FixtureRequest) -> None:
    """A test marked `postgres` runs with the server up (or skips saying how to get one)."""
    if request.node.get_closest_marker("postgres") is not None:
        postgres_server_or_skip()


@pytest.fixture
def postgres_server() -> pg_server.Server:
    """The session's throwaway PostgreSQL server (tests may restart it)."""
    return postgres_server_or_skip()


@pytest.fixture
def postgres_url(postgres_server: pg_server.Server) -> Iterator[str]:
    """A postgresql:// URL of a new, empty database, dropped after the test."""
    url = pg_server.new_database(postgres_server)
    yield url
    name = url.rsplit("/", 1)[-1]
    # a test that stopped the server for good leaves nothing to drop
    with contextlib.suppress(Exception):
        postgres_server.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
