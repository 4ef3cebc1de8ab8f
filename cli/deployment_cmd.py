"""`deployment`: the durable state every learner and coordinator of a deployment is judged by.

The admission policy (L_max, D_max) is deployment state, like the required worker set: it
is set by a recorded step (`set-policy`), and every reservation is judged against it inside
its own atomic step, whatever a learner was configured with. `show` prints that state, and
on PostgreSQL whether roles are on and which the connected login acts as. `roles` sets a
PostgreSQL deployment up for least privilege (model.postgres_roles), `grant` maps a login
to one of its roles.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from rollout_lifecycle.cli.exitcodes import InputError, TechnicalError
from rollout_lifecycle.cli.ledger_cmd import _opened, backend_option
from rollout_lifecycle.cli.output import (
    check_report_path,
    emit_report,
    make_console,
    quiet_option,
    report_options,
)
from rollout_lifecycle.model.backends import Backend, redact_url, sqlite_path
from rollout_lifecycle.model.errors import BackendUnavailable, RolloutLifecycleError
from rollout_lifecycle.model.records import (
    CHAIN_KEYS,
    LINEAGE_MODES,
    AdmissionPolicy,
    text_problem,
    to_jsonable,
)
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.model.rules import retired_versions

__all__ = ["deployment"]


def _drift(_ctx: click.Context, _param: click.Parameter, value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise click.BadParameter(f"must be a finite number >= 0, got {value}")
    return value


@click.group("deployment")
def deployment() -> None:
    """The deployment's durable state: admission policy, pointer, workers, retired versions."""


@deployment.command("set-policy")
@backend_option
@click.option(
    "--max-lag",
    type=click.IntRange(0, 2**63 - 1),
    required=True,
    help="L_max: the most versions a trained rollout may lag the active version.",
)
@click.option(
    "--max-drift",
    type=float,
    required=True,
    callback=_drift,
    help="D_max: the largest mean |log-ratio| over action tokens a rollout may drift.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(1, 2**63 - 1),
    default=None,
    help="Rollouts per update: turns on the dispatch budget of (max_lag + 1) x batch_size "
    "live rollouts (ledger.dispatch refuses 'no_capacity' beyond it). Default: no budget.",
)
@click.option(
    "--max-attempts",
    type=click.IntRange(1, 2**63 - 1),
    default=None,
    help="The most attempts per prompt chain (a stale attempt is retired and its prompt "
    "requeued up to this many times). Default: unbounded.",
)
@click.option(
    "--create",
    is_flag=True,
    help="Start a new deployment here: create the SQLite file, which must not exist yet "
    "(or the tables in a PostgreSQL database that holds none). Without it the backend must "
    "already hold this project's ledger: a mistyped path, an empty file or another "
    "application's database is refused (exit 2) and nothing is created.",
)
@click.option(
    "--lineage",
    type=click.Choice(LINEAGE_MODES),
    default="ledger",
    show_default=True,
    help="'ledger': a version's lineage is read from the ledger (its landed updates no "
    "version claims) and every update it names must have landed, unpoisoned and unclaimed; "
    "'off': the recorded opt-out, a version records what it is given, unfenced.",
)
@click.option(
    "--chain-key",
    type=click.Choice(CHAIN_KEYS),
    default="identity",
    show_default=True,
    help="What a prompt's attempts are counted by: 'identity' (its dataset, prompt id and "
    "sample index) or 'caller' (the chain key a generator passes to ledger.dispatch).",
)
@click.option(
    "--reason",
    default="set by the operator (rollout-lifecycle deployment set-policy)",
    show_default=True,
    help="Why, recorded in the trace with the change.",
)
@report_options
@quiet_option
def set_policy(
    url: str,
    max_lag: int,
    max_drift: float,
    batch_size: int | None,
    max_attempts: int | None,
    create: bool,
    lineage: str,
    chain_key: str,
    reason: str,
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """Record the admission policy every reservation of this deployment is judged by.

    The operator's step: coordinators and learners never write the policy (a coordinator
    given another one refuses to start, naming this command). The backend must already
    hold a ledger, unless --create starts a new deployment.
    """
    del quiet  # one write, no progress to silence: accepted like on every command
    if not reason.strip():
        raise click.BadParameter("must not be empty", param_hint="--reason")
    problem = text_problem(reason, max_length=None)
    if problem is not None:
        raise click.BadParameter(problem, param_hint="--reason")
    check_report_path(report_path)
    _writable_deployment(url, create)
    with _opened(url, create=True) as b:
        before = b.registry.policy()
        wanted = AdmissionPolicy(max_lag, max_drift, batch_size, max_attempts, lineage, chain_key)
        after = set_admission_policy(b.registry, wanted, reason)
    data: dict[str, Any] = {
        "changed": before != after,
        "before": None if before is None else to_jsonable(before),
        "policy": to_jsonable(after),
    }
    emit_report(data, as_json=as_json, report_path=report_path, console=make_console(True))
    if as_json:
        return
    if before == after:
        click.echo(f"policy unchanged: {_described(after)}")
    else:
        was = "none" if before is None else _described(before)
        click.echo(f"policy recorded: {_described(after)} (was: {was})")


def _writable_deployment(url: str, create: bool) -> None:
    """Refuse (exit 2, nothing created) a backend that holds no ledger of this project,
    unless `create` names a SQLite file that does not exist yet (or a PostgreSQL database,
    whose tables are created): a typo must never become a new deployment."""
    if url.startswith("memory:"):
        raise click.UsageError(
            "--backend: memory:// lives in one process: a policy recorded there is gone when "
            "this command exits; name the sqlite:/// file or postgresql:// database in use"
        )
    if create:
        try:
            path = sqlite_path(url) if url.startswith("sqlite:") else None
        except RolloutLifecycleError as exc:
            raise click.UsageError(f"--backend: {exc}") from None
        if path is None or not (path.exists() or path.is_symlink()):
            return  # a new file, or a server database (its tables are created)
    try:
        with _opened(url):  # read-only: refuses a missing file, an empty or foreign database
            pass
    except click.UsageError as exc:
        if create:
            raise
        raise click.UsageError(
            f"{exc.message}; to start a new deployment in a file that does not exist yet, "
            "add --create"
        ) from None


def _described(p: AdmissionPolicy | Mapping[str, Any]) -> str:
    """max_lag and max_drift, and the pacing bounds where set."""
    d = to_jsonable(p) if isinstance(p, AdmissionPolicy) else p
    out = f"max_lag {d['max_lag']}, max_drift {d['max_drift']}"
    if d.get("batch_size") is not None:
        out += f", batch_size {d['batch_size']}"
    if d.get("max_attempts") is not None:
        out += f", max_attempts {d['max_attempts']}"
    out += f", lineage {d.get('lineage', 'ledger')}, chain_key {d.get('chain_key', 'identity')}"
    return out


def _roles(b: Backend) -> dict[str, Any]:
    """The roles line of `show`: on PostgreSQL read from the schema; a SQLite file (or a
    process's memory) is one trust domain."""
    db = getattr(b.ledger, "db", None)
    if db is None or not hasattr(db, "conninfo"):
        return {
            "on": False,
            "text": "roles: none (one trust domain: whoever can write the file is the operator)",
        }
    from rollout_lifecycle.model.postgres_setup import roles_info

    info = roles_info(db)
    return {
        "on": info.on,
        "login": info.login,
        "you_are": list(info.mine),
        "worker_id": info.worker_id,
        "names": info.names,
        "text": info.describe(),
    }


def _state(b: Backend) -> dict[str, Any]:
    reg = b.registry
    arts = reg.artifacts()
    policy = reg.policy()
    return {
        "roles": _roles(b),
        # the lineage and chain-key modes shown even at their defaults: an opt-out is visible
        "policy": None
        if policy is None
        else {**to_jsonable(policy), "lineage": policy.lineage, "chain_key": policy.chain_key},
        "pointer": to_jsonable(reg.pointer()),
        "required_workers": reg.required_workers(),
        "artifacts": {str(a.version): a.state for a in arts},
        "retired_versions": sorted(retired_versions(arts)),
        "bad_versions": sorted(b.ledger.bad_versions),
    }


@deployment.command("show")
@backend_option
@report_options
@quiet_option
def show(url: str, as_json: bool, report_path: Path | None, quiet: bool) -> None:
    """Print the deployment's recorded policy, pointer, worker set and versions."""
    del quiet  # one read, no progress to silence: accepted like on every command
    check_report_path(report_path)
    with _opened(url) as b:
        state = _state(b)
    emit_report(state, as_json=as_json, report_path=report_path, console=make_console(True))
    if as_json:
        return
    pol = state["policy"]
    click.echo(
        "admission policy: "
        + (
            "none recorded (every reservation is refused; set one with set-policy)"
            if pol is None
            else _described(pol)
        )
    )
    ptr = state["pointer"]
    click.echo(
        "active version:   "
        + ("none" if ptr is None else f"v{ptr['version']} ({ptr['artifact_hash'][:16]}...)")
    )
    workers = state["required_workers"]
    click.echo("required workers: " + ("none recorded" if not workers else ", ".join(workers)))
    arts = state["artifacts"]
    click.echo(
        "versions:         "
        + (", ".join(f"v{v} {s}" for v, s in arts.items()) if arts else "none registered")
    )
    retired = state["retired_versions"]
    click.echo("retired (rolled back): " + (", ".join(f"v{v}" for v in retired) or "none"))
    click.echo(state["roles"]["text"])


@deployment.command("lineage")
@click.argument("version", type=click.IntRange(0, 2**63 - 1))
@backend_option
@report_options
@quiet_option
def lineage(version: int, url: str, as_json: bool, report_path: Path | None, quiet: bool) -> None:
    """Show what VERSION contains: its parents, the updates it records, their rollouts."""
    del quiet  # one read, no progress to silence: accepted like on every command
    check_report_path(report_path)
    with _opened(url) as b:
        chain = []
        rec = b.registry.artifact(version)
        if rec is None:
            raise InputError(f"v{version} is not registered in this deployment")
        seen: set[int] = set()
        while rec is not None and rec.version not in seen:
            seen.add(rec.version)
            chain.append(rec)
            rec = None if rec.parent_version is None else b.registry.artifact(rec.parent_version)
        wanted = {u for r in chain for u in r.trained_by}
        consumed: dict[str, list[str]] = {u: [] for u in sorted(wanted)}
        for ev in b.ledger.history():
            if ev.event == "commit" and ev.update_id in consumed:
                consumed[ev.update_id].append(ev.rollout_id)
        statuses = {u: _status(b, u) for u in consumed}
    data: dict[str, Any] = {
        "version": version,
        "chain": [
            {
                "version": r.version,
                "state": r.state,
                "parent_version": r.parent_version,
                "trained_by": list(r.trained_by),
            }
            for r in chain
        ],
        "updates": {
            u: {"landed": bool(ids), "rollouts": ids, "status": statuses[u]}
            for u, ids in consumed.items()
        },
    }
    emit_report(data, as_json=as_json, report_path=report_path, console=make_console(True))
    if as_json:
        return
    for r in chain:
        updates = ", ".join(r.trained_by) or "no recorded updates"
        click.echo(f"v{r.version} ({r.state}): trained by {updates}")
    for u, ids in consumed.items():
        shown = ", ".join(ids[:10]) + (f" (+{len(ids) - 10} more)" if len(ids) > 10 else "")
        click.echo(
            f"  {u} ({statuses[u]}): "
            + (f"{len(ids)} rollouts: {shown}" if ids else "NO landed commit")
        )


def _status(b: Backend, update_id: str) -> str:
    """The ledger's record of an update: open, landed, poisoned (cause), or unknown."""
    rec = b.ledger.update(update_id)
    if rec is None:
        return "not recorded"
    return rec.status if rec.cause is None else f"{rec.status}: {rec.cause}"


def _postgres(url: str) -> Any:
    """A PostgreSQL database handle for the set-up commands (held until released)."""
    from rollout_lifecycle.model.postgres_common import PostgresDatabase, is_postgres_url

    if not is_postgres_url(url):
        raise click.UsageError(
            "--backend: roles are PostgreSQL's (a SQLite file is one trust domain: whoever "
            "can write it is the operator); give a postgresql:// URL"
        )
    try:
        return PostgresDatabase(url).acquire()
    except BackendUnavailable as exc:
        raise TechnicalError(f"--backend: {exc}") from None
    except RolloutLifecycleError as exc:
        raise click.UsageError(f"--backend: {exc}") from None


def _run_setup(fn: Any) -> Any:
    """Project errors of a set-up step as one-line CLI errors (exit 3 or 2)."""
    try:
        return fn()
    except BackendUnavailable as exc:
        raise TechnicalError(str(exc)) from None
    except (RolloutLifecycleError, ValueError) as exc:
        raise InputError(str(exc)) from None


@deployment.command("roles")
@backend_option
@click.option(
    "--prefix",
    default=None,
    help="Names of the group roles: <prefix>operator, <prefix>learner ... Roles are "
    "cluster-wide, so the default rl_<database>_<schema>_ keeps deployments apart.",
)
@click.option(
    "--sql",
    "as_sql",
    is_flag=True,
    help="Print the SQL (for a new schema) for a DBA to apply, instead of running it.",
)
@report_options
@quiet_option
def roles(
    url: str,
    prefix: str | None,
    as_sql: bool,
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """Set a PostgreSQL deployment up for least privilege (idempotent).

    Creates (or migrates) the tables and server-side functions, the NOLOGIN group roles
    (operator, coordinator, worker, generator, learner, auditor) and their owner, and the
    grants: no role may write a table; each may EXECUTE the functions of its operations,
    which refuse any other operation. Run it as the deployment's administrator (a
    superuser, or a login with CREATEROLE that owns the schema); map logins to roles with
    `deployment grant`.
    """
    from rollout_lifecycle.model import postgres_setup as ps
    from rollout_lifecycle.model.postgres_roles import (
        OWNER,
        ROLES,
        check_prefix,
        default_prefix,
        role_names,
    )

    del quiet  # one step, no progress to silence: accepted like on every command
    check_report_path(report_path)
    if as_sql:
        try:
            database, schema = ps.connect_names(url)
        except BackendUnavailable as exc:
            raise TechnicalError(f"--backend: {exc}") from None
        except RolloutLifecycleError as exc:
            raise click.UsageError(f"--backend: {exc}") from None
        statements = _run_setup(lambda: ps.setup_script(database, schema, prefix))
        chosen = check_prefix(prefix) if prefix else default_prefix(database, schema)
    else:
        db = _postgres(url)
        try:
            chosen, statements = _run_setup(lambda: ps.setup_roles(db, prefix))
        finally:
            db.release()
    names = role_names(chosen)
    data: dict[str, Any] = {
        "applied": not as_sql,
        "prefix": chosen,
        "owner": names[OWNER],
        "roles": {r: names[r] for r in ROLES},
        "statements": [f"{st.rstrip().rstrip(';')};" for st in statements],
    }
    emit_report(data, as_json=as_json, report_path=report_path, console=make_console(True))
    if as_json:
        return
    if as_sql:
        click.echo("\n".join(data["statements"]))
        return
    applied = sum(1 for st in statements if not st.startswith("--"))
    click.echo(
        f"roles on for {redact_url(url)}: {', '.join(names[r] for r in ROLES)} (owner "
        f"{names[OWNER]}); {applied} statements applied"
    )
    click.echo(
        "map a login to each: rollout-lifecycle deployment grant ROLE LOGIN --backend URL "
        "(a worker login with --worker-id)"
    )


@deployment.command("grant")
@click.argument(
    "role",
    type=click.Choice(["operator", "coordinator", "worker", "generator", "learner", "auditor"]),
)
@click.argument("login")
@backend_option
@click.option("--worker-id", default=None, help="The worker id a worker login acks for.")
@click.option("--sql", "as_sql", is_flag=True, help="Print the SQL instead of running it.")
@report_options
@quiet_option
def grant(
    role: str,
    login: str,
    url: str,
    worker_id: str | None,
    as_sql: bool,
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """Let LOGIN act as ROLE in this deployment (a worker login for --worker-id only)."""
    from rollout_lifecycle.model import postgres_setup as ps

    del quiet  # one step, no progress to silence: accepted like on every command
    check_report_path(report_path)
    if (role == "worker") != (worker_id is not None):
        raise click.UsageError(
            "a worker login is granted with the worker id it acks for (--worker-id ID), and "
            "only a worker login is"
        )
    db = _postgres(url)
    try:
        statements = _run_setup(
            lambda: ps.grant_login(db, role, login, worker_id, apply=not as_sql)
        )
    finally:
        db.release()
    data: dict[str, Any] = {
        "applied": not as_sql,
        "login": login,
        "role": role,
        "worker_id": worker_id,
        "statements": [f"{st};" for st in statements],
    }
    emit_report(data, as_json=as_json, report_path=report_path, console=make_console(True))
    if as_json:
        return
    if as_sql:
        click.echo("\n".join(data["statements"]))
        return
    wid = f" for worker id {worker_id}" if worker_id else ""
    click.echo(f"{login} acts as {role}{wid}")
