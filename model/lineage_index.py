"""The lineage index: which versions claim which updates, and which landed updates no
version claims yet, answered without reading every version the run ever registered.

Every weight sync asks two lineage questions (model.registry): which landed updates no
version claims (the default lineage `prepare` records) and which versions claim the updates
a version names (the fence at register, commit and activation). Read from the artifacts'
lineage JSON, both walk every version and every landed update, so a sync's cost grew with
the run: 0.53 to 2.98 ms for `prepare` alone from 50 to 2,000 versions on SQLite.

Two structures answer them instead, both DERIVED, never the record:

- `registry_claims(update_id, version)`: one row per update a version's lineage names,
  written by triggers on `registry_artifacts` (insert, a lineage edit, a delete), so it
  equals the JSON whatever wrote the artifact, an older program included. `ledger check`
  compares it with the replayed artifacts (spec.audit), so an edit of the index is named.
- `ledger_updates.claimed`: 1 once some version claims the update, NULL otherwise; a
  partial index holds the landed updates still NULL, so the unclaimed ones are found
  without reading the claimed ones. It is a hint: the question is answered as "landed,
  not marked, and no row of registry_claims", so a mark that is missing (an update named
  before it landed, under `lineage="off"`; a mark a concurrent migration missed) costs a
  probe, never a wrong answer. A mark with no claim would hide an update from the default
  lineage: `ledger check` names that too.

On SQLite the index is created (and filled from the JSON) in one transaction the first time
a writer of this version opens the file, which needs no schema bump: the triggers live in
the file, so any later writer keeps it whole. The mark and its partial index need both the
ledger's and the registry's tables, so whichever of the two opens second links them. On
PostgreSQL, where DDL runs only when a schema is made or migrated, the registry's schema 6
and the ledger's schema 4 add them (model.postgres_registry, model.postgres_ledger).
"""

from __future__ import annotations

import sqlite3

# ---- the two questions, asked of the index ----------------------------------------------

MARK_INDEX = "ledger_updates_unclaimed"


def unclaimed_sql(indexed_by: str = "") -> str:
    """The landed updates not marked and not claimed, by the marks' partial index (SQLite's
    planner, left alone, walks every landed update by the status index instead)."""
    return (
        f"SELECT u.update_id FROM ledger_updates u {indexed_by} WHERE u.status = 'landed' "
        "AND u.claimed IS NULL "
        "AND NOT EXISTS (SELECT 1 FROM registry_claims c WHERE c.update_id = u.update_id) "
        "ORDER BY u.update_id"
    )


UNCLAIMED_SQLITE = unclaimed_sql(f"INDEXED BY {MARK_INDEX}")
UNCLAIMED_PG = unclaimed_sql()


def claims_sql(marks: str) -> str:
    """The (version, update id) rows naming the updates `marks` stands for, by version."""
    return (
        f"SELECT version, update_id FROM registry_claims WHERE update_id IN ({marks}) "
        "ORDER BY version, update_id"
    )


# ---- SQLite --------------------------------------------------------------------------------

CLAIMS_TABLE = "registry_claims"
CLAIMS_TRIGGER = "registry_claims_fill"

_SQLITE_CLAIMS = (
    """CREATE TABLE IF NOT EXISTS registry_claims (
        update_id TEXT NOT NULL,
        version   INTEGER NOT NULL,
        PRIMARY KEY (update_id, version)
    ) WITHOUT ROWID""",
    "DELETE FROM registry_claims",
    "INSERT OR IGNORE INTO registry_claims(update_id, version) SELECT j.value, a.version "
    "FROM registry_artifacts a, json_each(a.trained_by) j WHERE a.trained_by IS NOT NULL",
    """CREATE TRIGGER IF NOT EXISTS registry_claims_fill
       AFTER INSERT ON registry_artifacts WHEN NEW.trained_by IS NOT NULL
       BEGIN INSERT OR IGNORE INTO registry_claims(update_id, version)
             SELECT value, NEW.version FROM json_each(NEW.trained_by); END""",
    # the write path never edits a lineage (check_step refuses it); a raw edit or delete
    # still leaves the index equal to the JSON, which `ledger check` then judges
    """CREATE TRIGGER IF NOT EXISTS registry_claims_edit
       AFTER UPDATE OF trained_by, version ON registry_artifacts
       WHEN NEW.trained_by IS NOT OLD.trained_by OR NEW.version IS NOT OLD.version
       BEGIN DELETE FROM registry_claims WHERE version = OLD.version;
             INSERT OR IGNORE INTO registry_claims(update_id, version)
             SELECT value, NEW.version FROM json_each(NEW.trained_by)
             WHERE NEW.trained_by IS NOT NULL; END""",
    """CREATE TRIGGER IF NOT EXISTS registry_claims_drop
       AFTER DELETE ON registry_artifacts
       BEGIN DELETE FROM registry_claims WHERE version = OLD.version; END""",
)

_SQLITE_LINK = (
    "UPDATE ledger_updates SET claimed = 1 WHERE claimed IS NULL AND update_id IN "
    "(SELECT update_id FROM registry_claims)",
    f"CREATE INDEX IF NOT EXISTS {MARK_INDEX} ON ledger_updates(update_id) "
    "WHERE status = 'landed' AND claimed IS NULL",
    """CREATE TRIGGER IF NOT EXISTS registry_claims_mark
       AFTER INSERT ON registry_claims
       BEGIN UPDATE ledger_updates SET claimed = 1
             WHERE update_id = NEW.update_id AND claimed IS NULL; END""",
)


def _exists(conn: sqlite3.Connection, kind: str, name: str) -> bool:
    row = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = ? AND name = ?", (kind, name)
    ).fetchone()
    return row is not None


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {str(r[1]) for r in conn.execute(f"PRAGMA table_info({table})")}


def ensure_sqlite(conn: sqlite3.Connection, *, registry: bool) -> None:
    """Create what is missing of the lineage index on a writer's open (its own BEGIN
    IMMEDIATE ... COMMIT; nothing when the file already has it). The registry's open (after
    its own migration, so the lineage column exists) makes and fills the claims; whichever
    of the two opens when the claims and the ledger's update records both exist links the
    marks. The ledger's open never reads the registry's tables before that registry has
    been migrated by a program of this version."""
    has_claims = _exists(conn, "trigger", CLAIMS_TRIGGER)
    make_claims = registry and not has_claims
    if not (has_claims or make_claims):
        return
    has_ledger = _exists(conn, "table", "ledger_updates")
    link = has_ledger and not _exists(conn, "index", MARK_INDEX)
    if not (make_claims or link):
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        if make_claims and not _exists(conn, "trigger", CLAIMS_TRIGGER):  # another writer?
            for stmt in _SQLITE_CLAIMS:
                conn.execute(stmt)
        if link and not _exists(conn, "index", MARK_INDEX):
            if "claimed" not in _columns(conn, "ledger_updates"):
                conn.execute(
                    "ALTER TABLE ledger_updates ADD COLUMN claimed INTEGER CHECK (claimed = 1)"
                )
            for stmt in _SQLITE_LINK:
                conn.execute(stmt)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


# ---- PostgreSQL ------------------------------------------------------------------------------

# part of the registry's DDL (schema 6): the claims, kept by a trigger; the marks where the
# ledger's column exists (a registry alone in its schema has none)
PG_REGISTRY_DDL = """
-- the DDL runs before the migrations: a schema-1 registry gains its lineage column here
-- (migration 1 adds it the same way), so the trigger below can name it
ALTER TABLE registry_artifacts ADD COLUMN IF NOT EXISTS trained_by text;
CREATE TABLE IF NOT EXISTS registry_claims (
    update_id text NOT NULL,
    version   bigint NOT NULL,
    PRIMARY KEY (update_id, version)
);
CREATE OR REPLACE FUNCTION registry_claims_fill() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.trained_by IS NOT DISTINCT FROM OLD.trained_by
       AND NEW.version = OLD.version THEN
        RETURN NULL;  -- every step's UPDATE names the column; only an edit changes it
    END IF;
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        DELETE FROM registry_claims WHERE version = OLD.version;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') AND NEW.trained_by IS NOT NULL THEN
        INSERT INTO registry_claims(update_id, version)
            SELECT j, NEW.version FROM json_array_elements_text(NEW.trained_by::json) AS j
            ON CONFLICT DO NOTHING;
        IF EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('ledger_updates')
                   AND attname = 'claimed' AND NOT attisdropped) THEN
            UPDATE ledger_updates SET claimed = 1 WHERE claimed IS NULL AND update_id = ANY(
                ARRAY(SELECT json_array_elements_text(NEW.trained_by::json)));
        END IF;
    END IF;
    RETURN NULL;
END
$$;
CREATE OR REPLACE TRIGGER registry_claims_fill
    AFTER INSERT OR DELETE OR UPDATE OF trained_by, version ON registry_artifacts
    FOR EACH ROW EXECUTE FUNCTION registry_claims_fill();
"""

# registry 5 -> 6: the claims of the versions registered before, from their JSON
PG_REGISTRY_MIGRATION = (
    "INSERT INTO registry_claims(update_id, version) "
    "SELECT j, a.version FROM registry_artifacts a, json_array_elements_text(a.trained_by::json) "
    "AS j WHERE a.trained_by IS NOT NULL ON CONFLICT DO NOTHING;"
    + """
DO $$ BEGIN
    IF EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('ledger_updates')
               AND attname = 'claimed' AND NOT attisdropped) THEN
        UPDATE ledger_updates SET claimed = 1 WHERE claimed IS NULL
            AND update_id IN (SELECT update_id FROM registry_claims);
    END IF;
END $$;
"""
)

# part of the ledger's DDL (schema 4), after ledger_updates: the mark and its partial index
PG_LEDGER_DDL = f"""
ALTER TABLE ledger_updates ADD COLUMN IF NOT EXISTS claimed integer CHECK (claimed = 1);
CREATE INDEX IF NOT EXISTS {MARK_INDEX} ON ledger_updates(update_id)
    WHERE status = 'landed' AND claimed IS NULL;
"""

# ledger 3 -> 4: mark what the registry (if this schema holds one) already claims
PG_LEDGER_MIGRATION = """
DO $$ BEGIN
    IF to_regclass('registry_claims') IS NOT NULL THEN
        UPDATE ledger_updates SET claimed = 1 WHERE claimed IS NULL
            AND update_id IN (SELECT update_id FROM registry_claims);
    END IF;
END $$;
"""
