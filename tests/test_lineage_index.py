"""The lineage index (model.lineage_index): a weight sync's lineage questions cost the same
at any length of run, the answers equal the artifacts' JSON on every store, an older store
gains the index on its next writer's open, and `ledger check` names an edit of it."""

from __future__ import annotations

import sqlite3
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from click.testing import CliRunner

from rollout_lifecycle.cli.main import cli
from rollout_lifecycle.model.backends import Backend, open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.records import AdmissionPolicy
from rollout_lifecycle.model.registry import SqlView, set_admission_policy
from rollout_lifecycle.spec.audit import audit
from rollout_lifecycle.stateful_tests.backends import durable_url
from tests import helpers_ledger
from tests.helpers_ledger import LINEAGE_INDEX_DROP
from tests.test_trust_boundary import WORKERS, good_stamp, rewarded, rollout

POLICY = AdmissionPolicy(max_lag=1, max_drift=0.2)


def h(v: int) -> str:
    return f"{v:x}".rjust(64, "d")


def activate(c: ActivationCoordinator, v: int, **prep: Any) -> None:
    helpers_ledger.activate(c, v, h(v), **prep)


def land(b: Backend, v: int, update: str) -> None:
    """One rollout of v's policy, reserved and committed by `update` (which then landed)."""
    ro = rollout(f"r-{update}", 0)
    ro = attrs.evolve(ro, behavior=attrs.evolve(ro.behavior, version=v, artifact_hash=h(v)))
    rev = rewarded(b, ro)
    assert b.ledger.reserve(ro.rollout_id, rev, update, good_stamp(v, v)).reserved
    b.ledger.commit(update, [ro.rollout_id])


@pytest.fixture
def deployment(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Backend, str]]:
    kind = getattr(request, "param", "sqlite")
    url = "memory://" if kind == "memory" else durable_url(kind, tmp_path)
    with open_backend(url) as b:
        yield b, url


def _run(b: Backend) -> ActivationCoordinator:
    set_admission_policy(b.registry, POLICY, "lineage index test")
    c = ActivationCoordinator(b.registry, WORKERS, ledger=b.ledger, policy=POLICY)
    activate(c, 0)
    return c


def test_a_weight_sync_costs_the_same_at_v300_as_at_v15(
    deployment: tuple[Backend, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite's own count of virtual-machine steps (deterministic, unlike a timer) for one
    whole activation with its default lineage, on the registry's connection: within 25%
    at v290-300 of v10-20. Shown its fault: answered from the JSON, as before the index,
    the same activation costs more than twice as much at v300."""
    b, _ = deployment
    c = _run(b)
    conn: sqlite3.Connection = b.registry._conn  # type: ignore[attr-defined]
    steps = [0]

    def tick() -> int:
        steps[0] += 1
        return 0

    def cost(v: int) -> int:
        land(b, v - 1, f"u{v}")
        steps[0] = 0
        conn.set_progress_handler(tick, 20)
        try:
            activate(c, v)
        finally:
            conn.set_progress_handler(None, 0)
        return steps[0]

    costs = {v: cost(v) for v in range(1, 301)}
    early = statistics.median(costs[v] for v in range(10, 21))
    late = statistics.median(costs[v] for v in range(290, 301))
    assert late <= 1.25 * early, (early, late)
    assert b.registry.artifact(300).trained_by == ("u300",)

    monkeypatch.setattr(SqlView, "_lineage_index", lambda self: (False, False))
    unindexed = statistics.median(cost(v) for v in range(301, 306))
    assert unindexed > 2 * early, (early, unindexed)
    assert b.registry.artifact(305).trained_by == ("u305",)


@pytest.mark.parametrize("deployment", ["memory", "sqlite", "postgresql"], indirect=True)
def test_the_index_answers_as_the_json_does(deployment: tuple[Backend, str]) -> None:
    """Claims and the default lineage from the index equal those worked out from every
    version's JSON (the reads this store used before), through a double claim recorded
    under `lineage="off"`, an update named before it landed, and a poisoned one."""
    b, url = deployment
    c = _run(b)
    for i in range(3):
        land(b, 0, f"u{i}")
    activate(c, 1, trained_by=["u1"])
    set_admission_policy(b.registry, attrs.evolve(POLICY, lineage="off"), "tracked elsewhere")
    activate(c, 2, trained_by=["u1", "early"])  # u1 again; "early" has not landed yet
    land(b, 2, "early")
    land(b, 2, "u3")

    def asked(view: Any) -> tuple[Any, ...]:
        return view.claims(["u0", "u1", "u2", "early", "nobody"]), view.unclaimed_updates()

    claims, unclaimed = b.registry._view_read(asked, "lineage")  # type: ignore[attr-defined]
    assert claims == {"u1": (1, 2), "early": (2,)}
    assert unclaimed == ["u0", "u2", "u3"]
    if not url.startswith("memory"):
        json_claims, json_unclaimed = b.registry._view_read(  # type: ignore[attr-defined]
            lambda view: asked(_Unindexed(view)), "lineage"
        )
        assert (json_claims, json_unclaimed) == (claims, unclaimed)
    set_admission_policy(b.registry, POLICY, "fenced again")
    assert c.prepare(3).trained_by == ("u0", "u2", "u3")
    report = audit(b.stored_rows())
    assert report.violations == [] and report.store.not_compared == {}, report.violations
    assert "registry_claims" in report.store.compared


class _Unindexed:
    """A view that answers the lineage questions from the JSON (as without the index)."""

    def __init__(self, view: Any) -> None:
        self._view = view

    def claims(self, ids: Any) -> Any:
        return SqlView.claims(self._plain(), ids)

    def unclaimed_updates(self) -> Any:
        return SqlView.unclaimed_updates(self._plain())

    def _plain(self) -> Any:
        view = self._view
        plain = type(view).__new__(type(view))
        plain.__dict__.update(view.__dict__)
        plain._lineage_index = lambda: (False, False)
        return plain


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_an_older_store_gains_the_index_on_its_next_writers_open(kind: str, tmp_path: Path) -> None:
    """A store as a program before the index left it (no claims, no marks): read-only it
    answers from the JSON (and on SQLite, where no schema version moved, `ledger check`
    passes, listing the missing index as not compared); the next writer's open builds the
    index from the stored lineages and marks the claimed updates (PostgreSQL: by the
    registry's and the ledger's migrations), so the answers are unchanged and the audit
    compares every table."""
    url = durable_url(kind, tmp_path)
    with open_backend(url) as b:
        c = _run(b)
        for i in range(4):
            land(b, 0, f"u{i}")
        activate(c, 1, trained_by=["u1", "u2"])
    _edit(url, *LINEAGE_INDEX_DROP[kind])

    def lineage(b: Backend) -> Any:
        return b.registry._view_read(  # type: ignore[attr-defined]
            lambda v: (v.claims(["u1", "u2", "u3"]), v.unclaimed_updates()), "lineage"
        )

    want = ({"u1": (1,), "u2": (1,)}, ["u0", "u3"])
    with open_backend(url, create=False) as reader:
        assert lineage(reader) == want
        if kind == "sqlite":
            report = audit(reader.stored_rows())
            assert report.violations == [], report.violations
            assert "registry_claims" in report.store.not_compared
    with open_backend(url) as b:
        assert lineage(b) == want
        report = audit(b.stored_rows())
        assert report.violations == [] and report.store.not_compared == {}, report.violations
        rows = {r["update_id"]: r["claimed"] for r in b.stored_rows().tables["ledger_updates"]}
        assert rows == {"u0": None, "u1": 1, "u2": 1, "u3": None}
        c = ActivationCoordinator(b.registry, WORKERS, ledger=b.ledger, policy=POLICY)
        assert c.prepare(2).trained_by == ("u0", "u3")


def _edit(url: str, *statements: str) -> None:
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.removeprefix("sqlite:///"))
        for s in statements:
            conn.execute(s)
        conn.commit()
        conn.close()
        return
    import psycopg

    with psycopg.connect(url, autocommit=True) as pg:
        for s in statements:
            pg.execute(s)


@pytest.mark.parametrize("deployment", ["sqlite", "postgresql"], indirect=True)
@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (
            "DELETE FROM registry_claims WHERE update_id = 'u1'",
            "lineage claim of update 'u1' by v1: in the trace but not stored",
        ),
        (
            "INSERT INTO registry_claims(update_id, version) VALUES ('u0', 1)",
            "lineage claim of update 'u0' by v1: stored",
        ),
        (
            "UPDATE ledger_updates SET claimed = 1 WHERE update_id = 'u0'",
            "update 'u0': claimed: stored 1, replayed NULL (no version's lineage names it)",
        ),
    ],
)
def test_an_edit_of_the_index_is_named(
    deployment: tuple[Backend, str], edit: str, named: str
) -> None:
    """Each edit that would let a second version claim an update (a claim deleted) or
    hide a landed update from the default lineage (a mark or a claim forged) is named by
    `ledger check`, which exits 1; the forged mark does hide it, which is why it is named."""
    b, url = deployment
    c = _run(b)
    land(b, 0, "u0")
    land(b, 0, "u1")
    activate(c, 1, trained_by=["u1"])
    res = CliRunner().invoke(cli, ["ledger", "check", "--backend", url, "--quiet"])
    assert res.exit_code == 0, res.output
    _edit(url, edit)
    res = CliRunner().invoke(cli, ["ledger", "check", "--backend", url, "--quiet"])
    assert res.exit_code == 1 and named in res.stdout, res.output
    assert "Traceback" not in res.output
    if "claimed = 1" in edit or "INSERT" in edit:
        assert "u0" not in c.prepare(2).trained_by


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_registry_from_before_lineage_opens_and_gains_the_index(
    kind: str, tmp_path: Path
) -> None:
    """A registry from before lineage existed (no lineage column; SQLite schema 2,
    PostgreSQL schema 1), beside a ledger that landed updates: the ledger's open (first)
    leaves the registry's tables alone, the registry's migration adds the column and then
    the index, and the landed updates are the next version's default lineage."""
    url = durable_url(kind, tmp_path)
    with open_backend(url) as b:
        c = _run(b)
        for i in range(2):
            land(b, 0, f"u{i}")
    old = 2 if kind == "sqlite" else 1
    _edit(
        url,
        *LINEAGE_INDEX_DROP[kind],
        "ALTER TABLE registry_artifacts DROP COLUMN trained_by",
        f"UPDATE schema_meta SET version = {old} WHERE component = 'registry'",
    )
    with open_backend(url) as b:
        c = ActivationCoordinator(b.registry, WORKERS, ledger=b.ledger, policy=POLICY)
        assert c.prepare(1).trained_by == ("u0", "u1")
        claims = b.registry._view_read(lambda v: v.claims(["u0", "u1"]), "lineage")  # type: ignore[attr-defined]
        assert claims == {"u0": (1,), "u1": (1,)}


def test_the_growth_benchmark_runs_as_the_docs_cite_it(tmp_path: Path) -> None:
    """`python benchmarks/weight_sync_growth.py` (docs/verl-v1.md's growth table), small:
    both runs published with their default lineage, every phase timed in both, the ratios
    written; a run too short for its two bands is a usage error."""
    import json
    import subprocess
    import sys

    script = Path(__file__).parents[1] / "benchmarks" / "weight_sync_growth.py"
    out = tmp_path / "growth.json"
    args = [sys.executable, str(script), "--versions", "40", "--measured", "4"]
    res = subprocess.run([*args, "--json", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    phases = {"prepare", "commit", "distribute", "ack", "activate"}
    assert data["versions"] == [40, 44] and data["short_versions"] == [30, 34]
    assert set(data["long_over_short"]) == phases == set(data["long_ms"])
    assert all(v > 0 for v in data["long_ms"].values())
    bad = subprocess.run([*args[:2], "--versions", "10"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--versions must exceed 30" in bad.stderr
