"""Least privilege on PostgreSQL: the roles of a deployment, what each may do, and the SQL
that makes the server refuse everything else.

Five group roles, named for what the protocol lets each party do, and one that only reads:

    operator     policy, worker set, rollback, retirement, clearing bad versions
    coordinator  prepare, commit artifacts, distribute, retry, activate (and quarantine
                 the versions that failed); the operator may settle (activate an attempt
                 every worker acked, fail one past its ack deadline)
    worker       ack or report for its own worker id only; reads only its own tokens
    generator    add and dispatch rollouts, their generation and reward transitions
    learner      reserve, renew, commit, release and fail its updates (and route away
                 what its gate rejects); read
    auditor      read everything `ledger check` and `deployment show` need

Enforcement is the server's: every table, sequence and function of the schema belongs to
a NOLOGIN owner role; no deployment role may INSERT, UPDATE, DELETE or TRUNCATE anything.
Every write goes through a SECURITY DEFINER function (model.postgres_functions) that the
roles of the operations using it may EXECUTE, and that refuses, itself, an operation the
caller's role may not run (`rl_check`) and a row change outside the operation (a lifecycle
or activation edge it does not fire, an event kind it does not record, a registry part it
does not write). The client goes through the same functions with or without roles, so a
database without roles (one login does everything, as before) runs the same code.

Roles are cluster-wide while a deployment is a schema of a database, so the group roles
are named `<prefix><role>`; the default prefix is `rl_<database>_<schema>_` (two
deployments on one server never share a role), and `deployment roles --prefix` names
another. The prefix is recorded in the schema (`rl_roles`), which also switches the
functions' role checks on: a schema without it runs with roles off.

Adding a table: nothing here (every table of the schema is owner-only, and readable by
every role: `ledger check` reads them all), unless its rows are secret (READERS,
ROW_POLICIES). Adding an operation: one line in OPERATIONS (the function it calls then
grants itself to the operation's roles through CALLED_BY).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs

from rollout_lifecycle.model.errors import RoleRefused
from rollout_lifecycle.model.ledger import ADDABLE_STATES, CLOSING_EVENTS, DIRECT_EVENTS
from rollout_lifecycle.model.machines import ACTIVATION, LIFECYCLE

ROLES = ("operator", "coordinator", "worker", "generator", "learner", "auditor")
WRITERS = ROLES[:5]
OWNER = "owner"  # NOLOGIN: owns every table, sequence and function of the schema
MAX_NAME = 63  # PostgreSQL's identifier limit (NAMEDATALEN - 1)
_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


@attrs.frozen
class Operation:
    """What one operation may do, as the server-side functions check it.

    `events` are the machine events (lifecycle for ledger rows, activation for artifacts)
    its row writes may take, `inserts` the states a new row may start in, `kinds` the
    event kinds it may append to the trace, `parts` the registry parts it may write,
    `bad` whether it marks or clears bad versions, `updates` the changes of the ledger's
    update records (ledger_updates) it may make, as 'stored status>new status' ('' for
    none stored), `every` whether the login needs every one of `roles` (else any one).
    """

    roles: tuple[str, ...]
    machine: Literal["lifecycle", "activation"] | None = None
    events: tuple[str, ...] = ()
    inserts: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    parts: tuple[str, ...] = ()
    bad: bool = False
    updates: tuple[str, ...] = ()
    every: bool = False

    def edges(self) -> tuple[str, ...]:
        """'source>dest' of every path of its events (a step may fire several on one row:
        a landing generates, rewards and reserves it), and '>state' of every state a new
        row may be written in (an insert, then its events): what the functions compare a
        row's stored and new state with."""
        spec = ACTIVATION if self.machine == "activation" else LIFECYCLE
        step = {(e.source, e.dest) for e in spec.edges if e.event in self.events}
        reach = set(step)
        while True:  # the transitive closure of the operation's own edges
            more = {(a, d) for a, b in reach for c, d in step if b == c} - reach
            if not more:
                break
            reach |= more
        moves = sorted(f"{a}>{b}" for a, b in reach)
        born = set(self.inserts) | {b for a, b in reach if a in self.inserts}
        return (*moves, *(f">{s}" for s in sorted(born)))


_GEN = ("generator",)
_LEARN = ("learner",)
_COORD = ("coordinator",)
_OP = ("operator",)
_SETTLE = ("coordinator", "operator")
_ENTRY = ("entry",)


def _ledger(
    roles: tuple[str, ...],
    *events: str,
    inserts: Sequence[str] = (),
    updates: Sequence[str] = (),
    every: bool = False,
) -> Operation:
    kinds = (*_ENTRY, "update") if updates else _ENTRY
    return Operation(
        roles, "lifecycle", events, tuple(inserts), kinds, updates=tuple(updates), every=every
    )


def _registry(roles: tuple[str, ...], *events: str, parts: Sequence[str] = ()) -> Operation:
    kinds = ("artifact",) if events else ()
    inserts = ("prepared",) if events == ("register",) else ()
    moves = () if inserts else events
    return Operation(roles, "activation", moves, inserts, kinds, ("artifacts", *parts))


# the events of a landing (model.ledger.plan_landing) and of what a trainer closes
_LANDING = frozenset(
    {"generation_done", "reward_ready", "generation_failed", "reward_timeout", "reward_error"}
    | {"quarantine", "retire_stale"}
)

# who fires each direct lifecycle event (`ledger.transition`): the generation and reward
# edges are the generator's; a learner routes what its gate rejects (retire_stale,
# quarantine), as the README's pattern does
_DIRECT: dict[str, tuple[str, ...]] = {
    "generation_done": _GEN,
    "reward_ready": _GEN,
    "generation_failed": _GEN,
    "reward_timeout": _GEN,
    "reward_error": _GEN,
    "quarantine": ("generator", "learner", "operator"),
    "retire_stale": ("generator", "learner", "operator"),
}

# the update records' changes (model.ledger: open_change, land_change, poison_change): a
# reservation opens its update, a commit lands it or (refused) poisons it, an expired lease
# poisons its holder's; a poisoned update stays poisoned
_OPEN = (">open",)
_POISON = (">poisoned", "open>poisoned", "landed>poisoned")
_LAND = (">landed", "open>landed", *_POISON)
# a row written with the events that record it (model.events.RowRecorded)
_ROW = ("entry", "row")

# THE declared list: operation -> what it may do. Ledger operations are named as the
# ledger's steps are (`Step.what`); registry operations by `registry_operation`.
OPERATIONS: dict[str, Operation] = {
    # ---- ledger
    "add": _ledger(_GEN, inserts=(*ADDABLE_STATES, "quarantined")),
    "dispatch": _ledger(_GEN, inserts=("dispatched", "quarantined")),
    **{f"transition {e}": _ledger(roles, e) for e, roles in sorted(_DIRECT.items())},
    "reserve": _ledger(_LEARN, "reserve", updates=_OPEN),
    "reserve_batch": _ledger(_LEARN, "reserve", updates=_OPEN),
    "commit": _ledger(_LEARN, "commit", updates=_LAND),
    "abort": _ledger(_LEARN, "abort"),
    "fail_update": _ledger(_LEARN, "update_failed"),
    "renew_leases": _ledger(_LEARN, "renew_lease"),
    "expire_leases": _ledger(
        ("learner", "coordinator", "operator"), "expire_lease", updates=_POISON
    ),
    # it also quarantines the open rollouts of a rolled-back version (`ledger.retire_stale`)
    "retire_stale": _ledger(("generator", "learner", "operator"), "retire_stale", "quarantine"),
    # a trainer's step (verl): it lands its generations (the generator's edges, adds
    # included), closes what must not train and reserves (the learner's): its login needs
    # both roles
    "land_and_reserve": _ledger(
        ("generator", "learner"),
        *sorted(_LANDING),
        "reserve",
        inserts=(*ADDABLE_STATES, "quarantined"),
        updates=_OPEN,
        every=True,
    ),
    "quarantine_version": attrs.evolve(
        _ledger(("coordinator", "operator"), "quarantine"), bad=True, kinds=_ROW
    ),
    # a coordinator lifts the mark of a version it just activated (the server checks that
    # it is active); the operator any
    "clear_bad_version": Operation(("coordinator", "operator"), kinds=("row",), bad=True),
    # ---- registry
    "register": _registry(_COORD, "register"),
    "commit_artifact": _registry(_COORD, "commit_artifact"),
    "fail_commit": _registry(_COORD, "fail_commit"),
    "distribute": _registry(_COORD, "distribute", parts=("tokens",)),
    "retry": _registry(_COORD, "retry", parts=("tokens",)),
    # what `settle` resolves (an attempt all acked: activate; one past its ack deadline:
    # fail it) is also the operator's, whose rollback settles first (model.coordinator)
    "fail_distribution": _registry(_SETTLE, "fail_distribution"),
    "abandon": _registry(_COORD, "abandon"),
    "activate": _registry(_SETTLE, "activate", "supersede", parts=("pointer",)),
    "rollback": _registry(_OP, "roll_back", "reinstate", parts=("pointer",)),
    "set_policy": Operation(_OP, "activation", kinds=("policy",), parts=("policy",)),
    "change_membership": Operation(
        _OP,
        "activation",
        kinds=("membership", "worker"),
        parts=("membership", "revoked", "tokens", "workers"),
    ),
    "report": Operation(("worker",), "activation", kinds=("worker",), parts=("workers",)),
}

assert set(_DIRECT) == set(DIRECT_EVENTS), "every direct lifecycle event has its roles"
assert CLOSING_EVENTS <= _LANDING
assert all(set(op.roles) <= set(WRITERS) for op in OPERATIONS.values())


def _rows(op: Operation) -> bool:
    return op.machine == "lifecycle" and bool(op.events)


# which operations call each server-side function: their roles may EXECUTE it (every
# function also checks, itself, that the operation it is asked for is the caller's)
CALLED_BY: dict[str, Callable[[Operation], bool]] = {
    "ledger_write_one_v7": _rows,
    "rl_write_rows": _rows,
    "rl_lock_rows": _rows,
    "rl_insert_rows": lambda op: op.machine == "lifecycle" and bool(op.inserts),
    "rl_append": lambda op: op.machine == "lifecycle" or op.bad,
    "rl_bad_version": lambda op: op.bad,
    "rl_registry_write": lambda op: op.machine == "activation",
    "rl_mark": lambda op: True,
    "rl_prune_marks": lambda op: True,
    "rl_check_chain": lambda op: True,
}
# functions every login calls whatever it does: a step's commit mark (a step that writes
# nothing, an auditor's included, still ends with one: it inserts nothing then)
# and the event chain's check at open (HistoryTampered on an edited history)
EVERY_LOGIN = ("rl_mark", "rl_prune_marks", "rl_check_chain")

# table -> the roles that may SELECT it; a table not listed here is readable by every
# role. Workers do not read the events: registry events carry every worker's tokens.
READERS: dict[str, tuple[str, ...]] = {
    "events": tuple(r for r in ROLES if r != "worker"),
}

# tables whose rows a role sees only in part: table -> role -> the rows it sees (SQL);
# a role not named sees none of them. The owner (so every SECURITY DEFINER function)
# sees all.
ROW_POLICIES: dict[str, dict[str, str]] = {
    "registry_attempt_tokens": {
        "coordinator": "true",
        "operator": "true",
        "auditor": "true",
        "worker": "worker_id = (SELECT l.worker_id FROM rl_logins l "
        "WHERE l.login = session_user AND l.role = 'worker')",
    },
}


def grantees(function: str) -> tuple[str, ...]:
    """The roles that may EXECUTE `function`: those of the operations that call it."""
    if function in EVERY_LOGIN:
        return ROLES
    uses = CALLED_BY[function]
    return tuple(
        r for r in WRITERS if any(r in op.roles and uses(op) for op in OPERATIONS.values())
    )


OperationRow = tuple[str, list[str], list[str], list[str], list[str], bool, list[str], bool]


def operation_rows() -> list[OperationRow]:
    """The rows of `rl_operations`, the server's copy of OPERATIONS."""
    return [
        (
            name,
            list(op.roles),
            list(op.edges()),
            list(op.kinds),
            list(op.parts),
            op.bad,
            list(op.updates),
            op.every,
        )
        for name, op in sorted(OPERATIONS.items())
    ]


def needed_roles(operation: str) -> tuple[str, ...]:
    """The roles that may run `operation` (a read names none: the auditor may)."""
    op = OPERATIONS.get(operation)
    return op.roles if op is not None else ()


def registry_operation(
    *,
    policy: bool,
    membership: bool,
    artifact_events: Sequence[str],
    workers: bool,
) -> str | None:
    """The operation a registry step is, from what it writes (None: it writes nothing)."""
    if policy:
        return "set_policy"
    if membership:
        return "change_membership"
    if artifact_events:
        events = set(artifact_events)
        if "activate" in events:
            return "activate"
        if "roll_back" in events:
            return "rollback"
        return sorted(events)[0]
    return "report" if workers else None


# ---- names --------------------------------------------------------------------------------


def default_prefix(database: str, schema: str) -> str:
    """`rl_<database>_<schema>_`, lowercased, other characters as '_'."""
    clean = re.sub(r"[^a-z0-9_]", "_", f"rl_{database}_{schema}_".lower())
    return clean


def check_prefix(prefix: str) -> str:
    """A prefix that makes plain, short enough role names (a ValueError says why not)."""
    longest = max(len(r) for r in (*ROLES, OWNER))
    if not _NAME.match(prefix):
        raise ValueError(
            f"role prefix {prefix!r} must be lowercase letters, digits and underscores, "
            "starting with a letter or underscore"
        )
    if len(prefix) + longest > MAX_NAME:
        raise ValueError(
            f"role prefix {prefix!r} is too long: '{prefix}coordinator' exceeds PostgreSQL's "
            f"{MAX_NAME} characters; give a shorter one with --prefix"
        )
    return prefix


def role_names(prefix: str) -> dict[str, str]:
    """role -> its group role's name (and 'owner' -> the owner's)."""
    return {r: f"{prefix}{r}" for r in (OWNER, *ROLES)}


def _q(name: str) -> str:
    """A plain identifier, double-quoted (names are checked to be plain first)."""
    if not re.match(r"^[A-Za-z_][A-Za-z0-9_$]*$", name):
        raise ValueError(f"{name!r} is not a plain SQL name")
    return f'"{name}"'


def _lit(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


# ---- the set-up, as SQL a DBA can read and apply ------------------------------------------


def roles_statements(schema: str, prefix: str, functions: Sequence[str]) -> list[str]:
    """The statements `deployment roles` runs (or prints with --sql), idempotent: the group
    roles, the owner of every object of `schema`, the grants, the row policies, and the
    record that switches the functions' role checks on. `functions` are the names of the
    schema's functions callers may EXECUTE (the others stay the owner's)."""
    names = role_names(check_prefix(prefix))
    s = _q(schema)
    owner = names[OWNER]
    everyone = ", ".join(_q(names[r]) for r in ROLES)
    out = [
        "-- rollout-lifecycle: least privilege for the deployment in schema "
        f"{schema} (roles {prefix}*)",
        "DO $$ BEGIN\n"
        + "".join(
            f"  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = {_lit(n)}) THEN "
            f"CREATE ROLE {_q(n)} NOLOGIN; END IF;\n"
            for n in names.values()
        )
        + "END $$",
        # whoever applies this must be able to hand objects to the owner (a superuser can)
        "DO $$ BEGIN IF NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) "
        f"THEN EXECUTE format('GRANT %I TO %I', {_lit(owner)}, current_user); END IF; END $$",
        "DO $$ DECLARE r record; BEGIN\n"
        "  FOR r IN SELECT c.oid::regclass AS name, c.relkind FROM pg_class c\n"
        f"    WHERE c.relnamespace = {_lit(schema)}::regnamespace "
        "AND c.relkind IN ('r', 'p', 'S') LOOP\n"
        "    EXECUTE format('ALTER %s %s OWNER TO %I', CASE r.relkind WHEN 'S' THEN "
        f"'SEQUENCE' ELSE 'TABLE' END, r.name, {_lit(owner)});\n"
        "  END LOOP;\n"
        "  FOR r IN SELECT p.oid::regprocedure AS sig FROM pg_proc p\n"
        f"    WHERE p.pronamespace = {_lit(schema)}::regnamespace LOOP\n"
        f"    EXECUTE format('ALTER FUNCTION %s OWNER TO %I', r.sig, {_lit(owner)});\n"
        "  END LOOP;\n"
        "END $$",
        f"REVOKE CREATE ON SCHEMA {s} FROM PUBLIC",
        # the owner too: its SECURITY DEFINER functions look their tables up in the schema
        f"GRANT USAGE ON SCHEMA {s} TO {_q(owner)}, {everyone}",
        f"REVOKE ALL ON ALL TABLES IN SCHEMA {s} FROM PUBLIC, {everyone}",
        f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA {s} FROM PUBLIC, {everyone}",
        f"REVOKE ALL ON ALL FUNCTIONS IN SCHEMA {s} FROM PUBLIC, {everyone}",
        f"GRANT SELECT ON ALL TABLES IN SCHEMA {s} TO {everyone}",
    ]
    for table, readers in sorted(READERS.items()):
        others = [r for r in ROLES if r not in readers]
        if others:
            out.append(
                f"REVOKE SELECT ON {s}.{_q(table)} FROM " + ", ".join(_q(names[r]) for r in others)
            )
    for fn in functions:
        who = grantees(fn)
        if who:
            out.append(
                f"GRANT EXECUTE ON FUNCTION {s}.{_q(fn)} TO " + ", ".join(_q(names[r]) for r in who)
            )
    for table, policies in sorted(ROW_POLICIES.items()):
        t = f"{s}.{_q(table)}"
        out.append(f"ALTER TABLE {t} ENABLE ROW LEVEL SECURITY")
        for role in ROLES:
            policy = _q(f"rl_read_{role}")
            out.append(f"DROP POLICY IF EXISTS {policy} ON {t}")
            if role in policies:
                out.append(
                    f"CREATE POLICY {policy} ON {t} FOR SELECT TO {_q(names[role])} "
                    f"USING ({policies[role]})"
                )
    rows = ", ".join(f"({_lit(r)}, {_lit(names[r])})" for r in ROLES)
    out += [
        f"DELETE FROM {s}.rl_roles",
        f"INSERT INTO {s}.rl_roles(role, name) VALUES {rows}",
    ]
    return out


def grant_statements(
    schema: str, names: Mapping[str, str], role: str, login: str, worker_id: str | None
) -> list[str]:
    """The statements that make `login` act as `role` (a worker login for `worker_id`)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if (role == "worker") != (worker_id is not None):
        raise ValueError(
            "a worker login is granted with the worker id it acks for (--worker-id), and "
            "only a worker login is"
        )
    s = _q(schema)
    wid = "NULL" if worker_id is None else _lit(worker_id)
    return [
        f"GRANT {_q(names[role])} TO {_q(login)}",
        f"INSERT INTO {s}.rl_logins(login, role, worker_id) VALUES ({_lit(login)}, "
        f"{_lit(role)}, {wid}) ON CONFLICT (login, role) DO UPDATE SET worker_id = "
        "excluded.worker_id",
    ]


# ---- what the server says -----------------------------------------------------------------

REFUSAL_MARK = "rollout-lifecycle refusal"  # the DETAIL of every refusal the functions raise


def refused(exc: Any, operation: str, login: str, where: str) -> RoleRefused:
    """The typed error for a server's insufficient_privilege (42501) during `operation`:
    a function's own refusal (its DETAIL names the operation and, when the caller's role is
    what is missing, the roles it needs), or a missing GRANT (the declared list names the
    roles)."""
    diag = getattr(exc, "diag", None)
    detail = str(getattr(diag, "message_detail", "") or "")
    primary = str(getattr(diag, "message_primary", "") or str(exc).splitlines()[0])
    needed = needed_roles(operation)
    op = OPERATIONS.get(operation)
    every = op is not None and op.every
    if detail.startswith(REFUSAL_MARK):
        fields = {
            k.strip(): v.strip()
            for k, v in (
                p.split("=", 1) for p in detail[len(REFUSAL_MARK) :].split(";") if "=" in p
            )
        }
        operation = fields.get("op") or operation
        needs = fields.get("needs", "")
        every = "+" in needs  # a login needs every one of them ('+'), or any (',')
        needed = tuple(r for r in re.split(r"[,+]", needs) if r)
        if not needed:  # the role may run it: what it asked is outside the operation
            return RoleRefused(
                f"{where}: refused {operation} for login {login!r}: {primary} (nothing was "
                "written)",
                operation=operation,
                needed=needed_roles(operation),
                login=login,
            )
    if needed:
        who = (" and " if every else " or ").join(needed)
        hint = " --worker-id ID" if needed[0] == "worker" else ""
        grants = "; ".join(
            f"rollout-lifecycle deployment grant {r} {login}{hint}"
            for r in (needed if every else needed[:1])
        )
        fix = f"; it needs the {who} role{'s' if every else ''} ({grants})"
    else:
        fix = "; it needs a deployment role that reads this (the auditor reads everything)"
    return RoleRefused(
        f"{where}: login {login!r} may not run {operation}: {primary}{fix}",
        operation=operation,
        needed=needed,
        login=login,
    )
