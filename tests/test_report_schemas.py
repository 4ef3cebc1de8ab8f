"""Every --json report has a published JSON Schema (rollout_lifecycle/cli/schemas/), and
what the commands print validates against it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from rollout_lifecycle.cli.main import cli

SCHEMAS = Path(__file__).resolve().parents[1] / "cli" / "schemas"


def registry() -> Registry:
    """Every schema, addressable by its $id (the campaign report refers to the others)."""
    reg: Registry = Registry()
    for f in sorted(SCHEMAS.glob("*.schema.json")):
        doc = json.loads(f.read_text())
        reg = reg.with_resource(doc["$id"], Resource.from_contents(doc))
    return reg


def validate(doc: Any) -> None:
    """Validate a report against the schema its own `schema` field names."""
    sid = doc["schema"]
    found = [json.loads(f.read_text()) for f in SCHEMAS.glob("*.schema.json")]
    (schema,) = [s for s in found if s["properties"]["schema"]["const"] == sid]
    Draft202012Validator.check_schema(schema)
    Draft202012Validator(schema, registry=registry()).validate(doc)


def run_json(args: list[str]) -> Any:
    res = CliRunner().invoke(cli, [*args, "--json"])
    assert res.exit_code in (0, 1, 5), res.output  # 5: a campaign's missed coverage goal
    return json.loads(res.stdout)


def test_every_schema_is_a_valid_schema() -> None:
    """Each file is a valid draft 2020-12 schema with a unique $id."""
    ids = []
    for f in sorted(SCHEMAS.glob("*.schema.json")):
        doc = json.loads(f.read_text())
        Draft202012Validator.check_schema(doc)
        ids.append(doc["$id"])
    assert len(ids) == len(set(ids)) >= 8


def test_fuzz_explore_mutants_reports(tmp_path: Path) -> None:
    """fuzz, explore and mutants print reports that match their schemas."""
    validate(
        run_json(
            [
                "fuzz",
                "--machine",
                "ledger",
                "--backend",
                "memory",
                "--examples",
                "3",
                "--out",
                str(tmp_path / "f"),
                "--quiet",
            ]
        )
    )
    validate(run_json(["explore", "--model", "activation-2v", "--quiet"]))
    validate(
        run_json(
            [
                "mutants",
                "--only",
                "blind_reserve",
                "--checker",
                "fuzz",
                "--examples",
                "5",
                "--quiet",
            ]
        )
    )


def test_campaign_report(tmp_path: Path) -> None:
    """The campaign's summary (with the fuzz and explore reports inside) matches."""
    doc = run_json(
        [
            "campaign",
            "--backend",
            "memory",
            "--examples",
            "2",
            "--model",
            "activation-2v",
            "--out",
            str(tmp_path / "c"),
            "--quiet",
        ]
    )
    validate(doc)
    assert doc["goals_missed"]  # 2 examples cannot reach every goal: it says so


@pytest.fixture
def demo_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    res = CliRunner().invoke(cli, ["demo", "--backend", url, "--workdir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    return url


def test_ledger_reports(demo_url: str) -> None:
    """ledger counts and ledger check print reports that match their schemas."""
    validate(run_json(["ledger", "counts", "--backend", demo_url]))
    validate(run_json(["ledger", "check", "--backend", demo_url]))


def test_ledger_anchor_reports(demo_url: str, tmp_path: Path) -> None:
    """ledger anchor and ledger check --anchor print reports that match their schemas."""
    anchors = tmp_path / "anchors.jsonl"
    anchored = run_json(["ledger", "anchor", "--backend", demo_url, "--to", str(anchors)])
    validate(anchored)
    assert anchored["anchors"] == 1 and len(anchored["hash"]) == 64
    checked = run_json(["ledger", "check", "--backend", demo_url, "--anchor", str(anchors)])
    validate(checked)
    assert checked["history"]["anchors_checked"] == 1
    assert checked["history"]["head_hash"] == anchored["hash"]
    assert "history_anchor" in checked["checked"]


def test_admit_and_race_reports(tmp_path: Path) -> None:
    """admit's summary and a short race's report match their schemas."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("")
    validate(
        run_json(
            [
                "admit",
                str(inp),
                "--out",
                str(tmp_path / "o.jsonl"),
                "--current-version",
                "0",
                "--max-lag",
                "1",
                "--max-drift",
                "0.2",
                "--quiet",
            ]
        )
    )
    history = tmp_path / "history.jsonl"
    raced = run_json(
        [
            "race",
            "--backend",
            f"sqlite:///{tmp_path / 'r.db'}",
            "--seconds",
            "2",
            "--learners",
            "1",
            "--history",
            str(history),
            "--quiet",
        ]
    )
    validate(raced)
    lin = raced["linearizability"]
    assert lin["verdict"] == "ok" and lin["history"] == str(history), lin
    # every line of the history it wrote matches the call-history schema
    (schema,) = [
        doc
        for f in SCHEMAS.glob("*.schema.json")
        if (doc := json.loads(f.read_text()))["$id"] == "urn:rollout-lifecycle:call-history:1"
    ]
    check = Draft202012Validator(schema)
    lines = [json.loads(line) for line in history.read_text().splitlines()]
    assert lines[0]["schema"] == "rollout-lifecycle/call-history/1"
    assert len(lines) - 1 == lin["calls"] > 0
    for line in lines:
        check.validate(line)


def test_version_demo_and_diagram_reports(tmp_path: Path) -> None:
    """version, demo and diagram print reports (their --json, as on every command) that
    match their schemas."""
    validate(run_json(["version"]))
    demo = run_json(["demo", "--backend", "memory://", "--workdir", str(tmp_path), "--quiet"])
    validate(demo)
    assert demo["trace"]["violations"] == [] and demo["inspect"] is None
    validate(run_json(["diagram", "--machine", "lifecycle"]))
    checked = run_json(["diagram", "--check-docs", str(SCHEMAS.parents[1] / "docs" / "diagrams")])
    validate(checked)
    assert checked["mode"] == "check-docs" and checked["stale"] == []
