"""Setting a PostgreSQL deployment up for least privilege, and asking which mode it is in.

`setup_roles` is what `rollout-lifecycle deployment roles` runs as the deployment's
administrator (a superuser, or a login with CREATEROLE that created the schema): it
creates or migrates the ledger's and the registry's tables and the server-side functions,
then applies `postgres_roles.roles_statements` (the group roles, the owner of every object,
the grants, the row policies). `setup_script` is the same as one SQL script for a DBA who
applies it himself (on a new schema: an older one is migrated by `setup_roles`).
`grant_login` maps a login to a role; `roles_info` says whether roles are on and what the
connected login is.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from rollout_lifecycle.model import postgres_common as pc
from rollout_lifecycle.model import postgres_ledger as pl
from rollout_lifecycle.model import postgres_registry as pr
from rollout_lifecycle.model.errors import BackendURLError, LedgerError
from rollout_lifecycle.model.postgres_common import K_SCHEMA, Conn, PostgresDatabase, has_table
from rollout_lifecycle.model.postgres_functions import (
    COMPONENT as FUNCTIONS,
)
from rollout_lifecycle.model.postgres_functions import (
    callable_functions,
    functions_ddl,
    functions_version,
)
from rollout_lifecycle.model.postgres_roles import (
    ROLES,
    check_prefix,
    default_prefix,
    grant_statements,
    operation_rows,
    roles_statements,
)


@attrs.frozen
class RolesInfo:
    """Whether a schema runs with roles, their names, and who the connected login is."""

    on: bool
    names: dict[str, str]  # role -> group role name (empty when off)
    login: str
    mine: tuple[str, ...]  # the roles this login acts as
    worker_id: str | None  # the worker id a worker login acks for

    def describe(self) -> str:
        """'roles: off ...' or 'roles: on, you are ...', as `deployment show` prints it."""
        if not self.on:
            return "roles: off (one login does everything; set them up with `deployment roles`)"
        who = " and ".join(self.mine) if self.mine else "no deployment role"
        wid = f" (worker id {self.worker_id})" if self.worker_id else ""
        return f"roles: on, you are {who}{wid} (login {self.login})"


def roles_info(db: PostgresDatabase) -> RolesInfo:
    """The schema's mode and the connected login's roles."""

    def body(conn: Conn) -> RolesInfo:
        row = conn.execute("SELECT session_user").fetchone()
        login = "?" if row is None else str(row[0])
        if not has_table(conn, "rl_roles"):
            return RolesInfo(False, {}, login, (), None)
        rows = conn.execute(
            "SELECT role, name, pg_has_role(session_user, name, 'USAGE') FROM rl_roles "
            "WHERE EXISTS (SELECT 1 FROM pg_roles WHERE rolname = name) ORDER BY role"
        ).fetchall()
        names = {str(r[0]): str(r[1]) for r in rows}
        if not names:
            return RolesInfo(False, {}, login, (), None)
        mine = tuple(r for r in ROLES if any(str(x[0]) == r and x[2] for x in rows))
        found = conn.execute(
            "SELECT worker_id FROM rl_logins WHERE login = session_user AND role = 'worker'"
        ).fetchone()
        return RolesInfo(True, names, login, mine, None if found is None else str(found[0]))

    return db.read(body, "reading the deployment's roles")


def _names(conn: Conn) -> tuple[str, str]:
    row = conn.execute("SELECT current_database(), current_schema()").fetchone()
    if row is None or row[1] is None:
        raise LedgerError("the deployment's schema does not exist yet")
    return str(row[0]), str(row[1])


def setup_roles(db: PostgresDatabase, prefix: str | None = None) -> tuple[str, list[str]]:
    """Create or migrate the deployment's tables and functions, then its roles and grants
    (idempotent); returns the prefix and the statements applied."""
    pl.PostgresLedger(db).close()  # tables, migrations and functions, as the administrator
    pr.PostgresRegistry(db).close()
    database, schema = db.read(_names, "reading the deployment's names")
    chosen = check_prefix(prefix if prefix is not None else default_prefix(database, schema))
    statements = roles_statements(schema, chosen, callable_functions())

    def body(conn: Conn) -> None:
        conn.execute("SELECT pg_advisory_xact_lock(%s, 0)", (K_SCHEMA,))
        for stmt in statements:
            if not stmt.startswith("--"):
                conn.execute(stmt)

    db.write(body, "setting up the deployment's roles", ddl=True)
    return chosen, statements


def setup_script(database: str, schema: str, prefix: str | None = None) -> list[str]:
    """`setup_roles` as SQL statements, for a new schema (run as its administrator)."""
    chosen = check_prefix(prefix if prefix is not None else default_prefix(database, schema))
    ident = pc.quote_ident(schema).as_string(None)
    versions = [(pl.COMPONENT, pl.SCHEMA_VERSION), (pr.COMPONENT, pr.SCHEMA_VERSION)]
    ddl = functions_ddl(schema)
    out = [
        f"-- rollout-lifecycle: a new deployment in schema {schema} of database {database}",
        f"CREATE SCHEMA IF NOT EXISTS {ident}",
        f"SET search_path = {ident}",
        pc._META_DDL + pc._MARKS_DDL + pl._DDL + pr._DDL + pc._CHAIN_DDL,
        ddl,
        *(
            f"INSERT INTO schema_meta(component, version) VALUES ('{c}', {v}) "
            "ON CONFLICT (component) DO NOTHING"
            for c, v in [*versions, (FUNCTIONS, functions_version(ddl))]
        ),
        "DELETE FROM rl_operations",
        *(
            "INSERT INTO rl_operations(op, roles, edges, kinds, parts, bad, updates, every) "
            f"VALUES ({_lit(op)}, {_arr(r)}, {_arr(e)}, {_arr(k)}, {_arr(p)}, {str(b).lower()}, "
            f"{_arr(u)}, {str(every).lower()})"
            for op, r, e, k, p, b, u, every in operation_rows()
        ),
    ]
    return out + roles_statements(schema, chosen, callable_functions())


def _lit(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _arr(items: Sequence[str]) -> str:
    return "ARRAY[" + ", ".join(_lit(i) for i in items) + "]::text[]"


def grant_login(
    db: PostgresDatabase, role: str, login: str, worker_id: str | None, *, apply: bool = True
) -> list[str]:
    """Map `login` to `role` (a worker login to `worker_id`); the statements (run unless
    not `apply`). LedgerError when the schema has no roles yet or the login is unknown."""

    def names(conn: Conn) -> tuple[str, dict[str, str], bool]:
        _, schema = _names(conn)
        if not has_table(conn, "rl_roles"):
            return schema, {}, False
        found = {str(r[0]): str(r[1]) for r in conn.execute("SELECT role, name FROM rl_roles")}
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (login,)).fetchone()
        return schema, found, exists is not None

    schema, found, exists = db.read(names, "reading the deployment's roles")
    if not found:
        raise LedgerError(
            f"{db.where}: this deployment has no roles yet; run `rollout-lifecycle deployment "
            "roles --backend URL` as its administrator first"
        )
    if login in found.values():
        raise BackendURLError(f"{login!r} is a group role of this deployment, not a login")
    statements = grant_statements(schema, {**found, "owner": ""}, role, login, worker_id)
    if not apply:
        return statements
    if not exists:
        raise BackendURLError(
            f"{db.where} has no login {login!r}: create it first (CREATE ROLE {login} LOGIN "
            "PASSWORD '...'), then grant it a role"
        )

    def body(conn: Conn) -> None:
        for stmt in statements:
            conn.execute(stmt)

    db.write(body, f"granting {role} to {login}", ddl=True)
    return statements


def connect_names(url: str) -> tuple[str, str]:
    """(database, schema) a URL names, read from the server without writing anything: the
    schema is the first of the search path (it need not exist yet)."""
    db = PostgresDatabase(url, read_only=True).acquire()
    try:

        def body(conn: Conn) -> tuple[str, str]:
            row = conn.execute("SELECT current_database()").fetchone()
            database = "?" if row is None else str(row[0])
            return database, db._wanted_schema(conn)

        return db.read(body, "reading the deployment's names")
    finally:
        db.release()


def can_create_roles(db: PostgresDatabase) -> bool:
    """Whether the connected login may create roles (a superuser, or CREATEROLE)."""

    def body(conn: Conn) -> bool:
        row = conn.execute(
            "SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = session_user"
        ).fetchone()
        return bool(row and row[0])

    return db.read(body, "asking whether this login may create roles")


def login_url(url: str, login: str, password: str) -> str:
    """`url` with another login and password (host, port, database and options kept)."""
    from urllib.parse import quote, urlsplit, urlunsplit

    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    netloc = f"{quote(login, safe='')}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def party_logins(
    db: PostgresDatabase, url: str, parties: dict[str, tuple[str, str | None]]
) -> dict[str, str]:
    """One new login per party (name -> (role, worker id)), each with a random password and
    granted its role: name -> its URL. A login of that name is replaced. Needs roles set up
    (`setup_roles`) and a login that may create roles."""
    import secrets

    out: dict[str, str] = {}
    for name, (role, worker_id) in parties.items():
        password = secrets.token_hex(16)
        ident = pc.quote_ident(name).as_string(None)

        def body(conn: Conn, ident: str = ident, password: str = password) -> None:
            conn.execute(f"DROP ROLE IF EXISTS {ident}")
            conn.execute(f"CREATE ROLE {ident} LOGIN PASSWORD '{password}'")

        db.write(body, f"creating login {name}", ddl=True)
        grant_login(db, role, name, worker_id)
        out[name] = login_url(url, name, password)
    return out


def drop_logins(db: PostgresDatabase, names: Sequence[str]) -> None:
    """Drop the logins `party_logins` made (they own nothing; their grants go with them)."""

    def body(conn: Conn) -> None:
        for name in names:
            conn.execute(f"DROP ROLE IF EXISTS {pc.quote_ident(name).as_string(None)}")
        if has_table(conn, "rl_logins"):
            conn.execute("DELETE FROM rl_logins WHERE login = ANY(%s)", (list(names),))

    db.write(body, "dropping the party logins", ddl=True)
