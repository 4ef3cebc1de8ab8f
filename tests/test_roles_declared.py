"""The declared list of PostgreSQL roles (model.postgres_roles) covers everything the
client can ask the server to do, and the set-up SQL follows it: no server needed."""

from __future__ import annotations

import re
from pathlib import Path

from rollout_lifecycle.model import postgres_functions as pf
from rollout_lifecycle.model.ledger import DIRECT_EVENTS
from rollout_lifecycle.model.machines import ACTIVATION, LIFECYCLE
from rollout_lifecycle.model.postgres_roles import (
    CALLED_BY,
    OPERATIONS,
    ROLES,
    grant_statements,
    grantees,
    registry_operation,
    role_names,
    roles_statements,
)

MODEL = Path(pf.__file__).parent


def test_every_ledger_step_is_a_declared_operation() -> None:
    """Each step the ledger runs (Step("...") in model/ledger.py, and a transition per
    direct event) is an operation of the list: a new step without a line is caught here."""
    steps = set(re.findall(r'Step\("(\w+)"', (MODEL / "ledger.py").read_text()))
    steps |= {f"transition {e}" for e in DIRECT_EVENTS}
    assert steps and steps <= set(OPERATIONS), sorted(steps - set(OPERATIONS))


def test_every_machine_event_is_some_operations() -> None:
    """Every lifecycle and activation event is an edge of some operation (or the ledger's
    own insert path), so no declared move is out of every role's reach."""
    edges = {e for op in OPERATIONS.values() for e in op.edges()}
    for spec in (LIFECYCLE, ACTIVATION):
        for edge in spec.edges:
            if edge.event in ("register",):
                continue
            assert f"{edge.source}>{edge.dest}" in edges, (spec.name, edge.event)


def test_registry_steps_name_their_operation() -> None:
    """A registry step is named by what it writes."""
    assert registry_operation(policy=True, membership=False, artifact_events=[], workers=False) == (
        "set_policy"
    )
    for events, op in (
        (["activate", "supersede"], "activate"),
        (["roll_back", "reinstate"], "rollback"),
        (["distribute"], "distribute"),
    ):
        got = registry_operation(
            policy=False, membership=False, artifact_events=events, workers=False
        )
        assert got == op
    assert registry_operation(policy=False, membership=False, artifact_events=[], workers=True) == (
        "report"
    )
    assert (
        registry_operation(policy=False, membership=False, artifact_events=[], workers=False)
        is None
    )


def test_grants_follow_the_list() -> None:
    """Each callable function is granted to exactly the roles of the operations calling
    it (the commit mark to every login); no role may write a table; the auditor executes
    nothing but the mark."""
    assert set(CALLED_BY) == set(pf.SIGNATURES)
    sql = roles_statements("s", "p_", pf.callable_functions())
    names = role_names("p_")
    text = "\n".join(sql)
    assert 'REVOKE ALL ON ALL TABLES IN SCHEMA "s" FROM PUBLIC' in text
    assert not re.search(r"GRANT (INSERT|UPDATE|DELETE|TRUNCATE|ALL)", text)
    for fn in pf.SIGNATURES:
        who = grantees(fn)
        line = next(s for s in sql if s.startswith(f'GRANT EXECUTE ON FUNCTION "s"."{fn}"'))
        assert sorted(re.findall(r'"(p_\w+)"', line)) == sorted(names[r] for r in who), fn
    assert grantees("rl_registry_write") == ("operator", "coordinator", "worker")
    assert "auditor" not in grantees("ledger_write_one_v7")
    assert set(grantees("rl_mark")) == set(ROLES)
    assert grant_statements("s", names, "worker", "w", "gen-0")[0] == 'GRANT "p_worker" TO "w"'
