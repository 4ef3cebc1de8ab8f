"""Edits of a stored ledger that need no hash computation (issue 31, item 7), the finding
`ledger check` must name for each, and the backends with that table: shared by the audit
tests and the fault race, which applies one to its own store after its verdict and runs
`ledger check` as a user does."""

from __future__ import annotations

# Each edit a user with sqlite3 or psql can make without computing a hash, the finding
# `ledger check` must name, and the backends with that table. Before issue 31, a stripped
# head (with its hashes) and every bookkeeping edit exited 0; hashes NULLed or added under
# an intact head were already named.
TAMPERINGS: dict[str, tuple[tuple[str, ...], str, frozenset[str]]] = {
    "the head dropped with every hash": (
        ("DROP TABLE events_chain", "UPDATE events SET hash = NULL, prev_hash = NULL"),
        "history_missing",
        frozenset({"sqlite", "postgresql"}),
    ),
    "the head row deleted with every hash": (
        ("DELETE FROM events_chain", "UPDATE events SET hash = NULL, prev_hash = NULL"),
        "history_missing",
        frozenset({"sqlite", "postgresql"}),
    ),
    "every hash NULLed": (
        ("UPDATE events SET hash = NULL, prev_hash = NULL",),
        "history_unchained",
        frozenset({"sqlite", "postgresql"}),
    ),
    "one hash NULLed": (
        ("UPDATE events SET hash = NULL WHERE seq = (SELECT MIN(seq) + 5 FROM events)",),
        "history_unchained",
        frozenset({"sqlite", "postgresql"}),
    ),
    "an unchained suffix": (
        (
            "INSERT INTO events(seq, txn, kind, subject, payload) SELECT seq + 1, txn + 1, "
            "kind, subject, payload FROM events WHERE seq = (SELECT MAX(seq) FROM events)",
        ),
        "history_unchained",
        frozenset({"sqlite", "postgresql"}),
    ),
    "the host clock's origin moved by 1e6 s": (
        ("UPDATE host_clock SET origin = origin + 1e6",),
        "stored_matches_trace",
        frozenset({"sqlite"}),  # PostgreSQL's clock is the server's: no table
    ),
    "a bad-version mark edited": (
        ("UPDATE ledger_bad_versions SET reason = 'nothing wrong'",),
        "stored_matches_trace",
        frozenset({"sqlite", "postgresql"}),
    ),
    "a bad-version mark lifted by hand": (
        ("DELETE FROM ledger_bad_versions",),
        "stored_matches_trace",
        frozenset({"sqlite", "postgresql"}),
    ),
    "the writes counter edited": (
        ("UPDATE events_chain SET writes = writes - 3",),
        "stored_matches_trace",
        frozenset({"sqlite"}),
    ),
    "the writes counter edited (a shard)": (
        ("UPDATE ledger_counters SET n = n + 3 WHERE name = 'writes'",),
        "stored_matches_trace",
        frozenset({"postgresql"}),
    ),
    "a schema version edited": (
        ("UPDATE schema_meta SET version = 1 WHERE component = 'ledger'",),
        "stored_matches_trace",
        frozenset({"sqlite", "postgresql"}),
    ),
    # the lineage index (model.lineage_index): a forged claim keeps an update out of every
    # later version's default lineage and fences it from a version that trained on it
    "a lineage claim forged": (
        ("INSERT INTO registry_claims(update_id, version) VALUES ('forged-update', 0)",),
        "stored_matches_trace",
        frozenset({"sqlite", "postgresql"}),
    ),
    "the seal deleted": (
        ("DELETE FROM schema_meta WHERE component = 'history'",),
        "stored_matches_trace",
        frozenset({"sqlite", "postgresql"}),
    ),
}


def sql(url: str, statements: tuple[str, ...]) -> list[tuple[object, ...]]:
    """Run `statements` against the store `url` names, outside the program (a user with
    sqlite3 or psql); the last statement's rows."""
    rows: list[tuple[object, ...]] = []
    if url.startswith("sqlite:"):
        import sqlite3

        from rollout_lifecycle.model.backends import sqlite_path

        conn = sqlite3.connect(str(sqlite_path(url)))
        try:
            for s in statements:
                rows = conn.execute(s).fetchall()
            conn.commit()
        finally:
            conn.close()
        return rows
    import psycopg

    with psycopg.connect(url, autocommit=True) as pg:
        for s in statements:
            cur = pg.execute(s)
            rows = cur.fetchall() if cur.description else []
    return rows
