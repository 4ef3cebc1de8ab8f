"""Issue 22: one ledger over three stores, each store small.

The protocol (planning, rules, events, counters, the premise) lives once, in
`model.ledger.StoreLedger`; a backend is a store that makes one step atomic its own way.
Before that, each backend was a ledger class of 750 to 900 lines; the issue asks each store
to stay well under half of that. These tests hold the line, so a store that starts to grow
its own copy of the protocol fails here rather than in a later duplicate scan.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

MODEL = Path(__file__).resolve().parents[1] / "model"
# half of the smallest of the old ledger classes (750 lines)
HALF_OLD_LEDGER = 375
STORES = {
    "memory": ("ledger.py", ("MemoryStore", "MemoryLedger")),
    "sqlite": ("sqlite_ledger.py", None),  # every class of the module
    "postgresql": ("postgres_ledger.py", None),
}


def _class_lines(module: str, names: tuple[str, ...] | None) -> dict[str, int]:
    tree = ast.parse((MODEL / module).read_text())
    return {
        node.name: (node.end_lineno or node.lineno) - node.lineno + 1
        for node in tree.body
        if isinstance(node, ast.ClassDef) and (names is None or node.name in names)
    }


@pytest.mark.parametrize("backend", sorted(STORES))
def test_each_store_is_well_under_half_an_old_ledger(backend: str) -> None:
    module, names = STORES[backend]
    lines = _class_lines(module, names)
    assert lines, f"no store classes found in model/{module}"
    assert names is None or set(lines) == set(names), lines
    assert sum(lines.values()) < HALF_OLD_LEDGER, (backend, lines)


def test_the_protocol_lives_once() -> None:
    """Every store's ledger class is the one StoreLedger bound to its store: none of them
    defines a method of the ledger's protocol (model.ledger.Ledger) again."""
    from rollout_lifecycle.model.ledger import Ledger, MemoryLedger, StoreLedger
    from rollout_lifecycle.model.postgres_ledger import PostgresLedger
    from rollout_lifecycle.model.sqlite_ledger import SQLiteLedger

    steps = [k for k, v in vars(Ledger).items() if not k.startswith("_") and callable(v)]
    assert {"reserve", "reserve_batch", "commit", "transition"} <= set(steps)
    assert all(callable(getattr(StoreLedger, name)) for name in steps)
    for cls in (MemoryLedger, SQLiteLedger, PostgresLedger):
        assert issubclass(cls, StoreLedger), cls
        own = [name for name in steps if name in vars(cls)]
        assert not own, f"{cls.__name__} defines {own} itself"
