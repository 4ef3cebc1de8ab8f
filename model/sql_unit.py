"""What the SQLite and PostgreSQL ledger stores' units of work share: the statements on bad
versions and state counts, written once with ``?`` placeholders (PostgreSQL's unit sets
`mark` to ``%s``; the tables and their columns are the same on both)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any


def read_bad(conn: Any) -> frozenset[int]:
    """The versions marked bad (one statement, no parameters: the same on both servers)."""
    return frozenset(int(r[0]) for r in conn.execute("SELECT version FROM ledger_bad_versions"))


@functools.cache
def _marked(sql: str, mark: str) -> str:
    return sql if mark == "?" else sql.replace("?", mark)


class SqlUnit:
    """A step's access to a SQL store, inside the transaction the store opened for it."""

    mark = "?"  # the driver's placeholder

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def run(self, sql: str, args: Sequence[Any] = ()) -> Any:
        """Execute `sql` (written with ``?``) with this driver's placeholder."""
        return self.conn.execute(_marked(sql, self.mark), args)

    def count(self, states: Sequence[str]) -> int:
        marks = ",".join("?" * len(states))
        row = self.run(f"SELECT COUNT(*) FROM rollouts WHERE state IN ({marks})", states)
        return int(row.fetchone()[0])

    def bad_versions(self) -> frozenset[int]:
        return read_bad(self.conn)

    def mark_bad(self, version: int, reason: str) -> None:
        self.run(
            "INSERT INTO ledger_bad_versions(version, reason) VALUES (?, ?) "
            "ON CONFLICT (version) DO NOTHING",
            (version, reason),
        )

    def clear_bad(self, version: int) -> None:
        self.run("DELETE FROM ledger_bad_versions WHERE version = ?", (version,))
