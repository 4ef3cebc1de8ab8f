"""Diagrams are drawn from the declared machines only, stay in sync with docs, fail loudly."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from rollout_lifecycle.cli.diagram_cmd import diagram
from rollout_lifecycle.model.machines import MACHINES, MachineSpec
from rollout_lifecycle.spec import diagrams
from rollout_lifecycle.spec.diagrams import (
    DOCS_DIR,
    DiagramError,
    EngineMismatch,
    GraphvizNotFound,
    StaleCoverage,
    check_docs,
    edge_counts,
    render,
    to_dot,
    to_mermaid,
    write_docs,
)

GOLDEN = Path(__file__).parent / "golden"
HAVE_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(not HAVE_DOT, reason="Graphviz `dot` not installed")
MACHINE_PARAMS = pytest.mark.parametrize("machine", list(MACHINES.values()), ids=list(MACHINES))

EdgeKey = tuple[str, str, str, str]  # source, event, guard, dest
_MERMAID_EDGE = re.compile(r"^\s*(\S+) --> (\S+)(?: : (.*))?$")
_DOT_EDGE = re.compile(r'^\s*"([^"]+)" -> "([^"]+)" \[(.*)\]$')
_LABEL = re.compile(r"^(\w+)(?: \[(.+)\])?$")
_KIND_PREFIX = {"✗ ": "failure", "↺ ": "recovery"}


def _declared(machine: MachineSpec) -> Counter[EdgeKey]:
    return Counter((e.source, e.event, e.guard, e.dest) for e in machine.edges)


def _split_label(text: str) -> tuple[str, str]:
    found = _LABEL.match(text)
    assert found, f"label {text!r} is not 'event [guard]'"
    return found.group(1), found.group(2) or ""


def _mermaid_edges(text: str) -> list[tuple[EdgeKey, str, str]]:
    """(edge, kind from the label prefix, coverage suffix) for every non-[*] transition."""
    edges = []
    for line in text.splitlines():
        found = _MERMAID_EDGE.match(line)
        if not found or "[*]" in (found.group(1), found.group(2)):
            continue
        label = found.group(3) or ""
        kind = "normal"
        for prefix, k in _KIND_PREFIX.items():
            if label.startswith(prefix):
                label, kind = label.removeprefix(prefix), k
        cov = re.search(r" (×\d+|⚠ 0 NEVER)$", label)
        suffix = cov.group(1) if cov else ""
        label = label[: cov.start()] if cov else label
        event, guard = _split_label(label)
        edges.append(((found.group(1), event, guard, found.group(2)), kind, suffix))
    return edges


def _dot_attr(attrs: str, name: str) -> str:
    found = re.search(rf'\b{name}="((?:[^"\\]|\\.)*)"', attrs)
    return found.group(1) if found else ""


def _dot_edges(text: str) -> list[tuple[EdgeKey, dict[str, str]]]:
    """(edge, attributes) for every edge except the initial-state marker."""
    edges = []
    for line in text.splitlines():
        found = _DOT_EDGE.match(line)
        if not found or found.group(1) == "__start__":
            continue
        attrs = {k: _dot_attr(found.group(3), k) for k in ("label", "style", "color", "tooltip")}
        event, guard = _split_label(attrs["label"].split("\\n")[0])
        edges.append(((found.group(1), event, guard, found.group(2)), attrs))
    return edges


def _coverage_with_zeros(machine: MachineSpec) -> dict[str, Any]:
    """A run-shaped coverage JSON: every third edge never exercised, the rest counted."""
    counts = {
        machine.edge_id(e): (0 if i % 3 == 0 else 100 + i) for i, e in enumerate(machine.edges)
    }
    return {"machines": {machine.name: {"edges": counts}}}


# ---- text output --------------------------------------------------------------------------


@MACHINE_PARAMS
def test_mermaid_matches_golden(machine: MachineSpec) -> None:
    """Mermaid text is deterministic and equal to the reviewed golden file."""
    golden = (GOLDEN / f"{machine.name}.mmd").read_text(encoding="utf-8")
    assert to_mermaid(machine) == golden, (
        f"tests/golden/{machine.name}.mmd is out of date; if the change is intended, "
        "regenerate it from spec.diagrams.to_mermaid and review the diff"
    )
    assert to_mermaid(machine) == to_mermaid(machine)


@MACHINE_PARAMS
def test_mermaid_draws_every_declared_edge_once(machine: MachineSpec) -> None:
    """Parsing the Mermaid back yields exactly the declared edges, each with its kind."""
    text = to_mermaid(machine)
    parsed = _mermaid_edges(text)
    assert Counter(key for key, _, _ in parsed) == _declared(machine)
    kinds = {(e.source, e.event, e.guard, e.dest): e.kind for e in machine.edges}
    assert all(kinds[key] == kind for key, kind, _ in parsed)
    assert f"[*] --> {machine.initial}" in text
    ends = {m.group(1) for m in re.finditer(r"^\s*(\S+) --> \[\*\]$", text, re.M)}
    assert ends == set(machine.terminal)


@MACHINE_PARAMS
def test_dot_draws_every_declared_edge_once(machine: MachineSpec) -> None:
    """Parsing the DOT back yields exactly the declared edges, styled by kind."""
    text = to_dot(machine)
    parsed = _dot_edges(text)
    assert Counter(key for key, _ in parsed) == _declared(machine)
    by_key = {(e.source, e.event, e.guard, e.dest): e for e in machine.edges}
    styles = {"normal": "solid", "failure": "dashed", "recovery": "dotted"}
    for key, attrs in parsed:
        edge = by_key[key]
        assert attrs["style"] == styles[edge.kind]
        assert attrs["tooltip"] == machine.edge_id(edge)
    assert f'"__start__" -> "{machine.initial}"' in text
    for state in machine.terminal:
        assert re.search(rf'^\s*"{state}" \[shape="doubleoctagon"', text, re.M)


def test_shared_source_and_dest_edges_are_drawn_separately() -> None:
    """abort and expire_lease both go reserved -> rewarded and each keeps its own label."""
    machine = MACHINES["lifecycle"]
    pairs = Counter((e.source, e.dest) for e in machine.edges)
    shared = [pair for pair, n in pairs.items() if n > 1]
    assert ("reserved", "rewarded") in shared
    for text_edges in (
        [key for key, _, _ in _mermaid_edges(to_mermaid(machine))],
        [key for key, _ in _dot_edges(to_dot(machine))],
    ):
        drawn = Counter((s, d) for s, _, _, d in text_edges)
        assert all(drawn[pair] == pairs[pair] for pair in shared)


def test_mermaid_label_escapes_separators() -> None:
    """':' ';' '#' would end or corrupt a Mermaid label, so they become entity codes."""
    assert diagrams._mermaid_text("a:b;c#d") == "a#58;b#59;c#35;d"


@MACHINE_PARAMS
def test_dot_groups_states_into_clusters_by_tag(machine: MachineSpec) -> None:
    """Each state sits in the cluster its tags choose (failure, terminal outcome, normal)."""
    text = to_dot(machine)
    for group in ("normal", "failure", "terminal"):
        block = re.search(rf'subgraph "cluster_{group}" \{{(.*?)\n    \}}', text, re.S)
        members = set(re.findall(r'^\s*"(\w+)" \[', block.group(1), re.M)) if block else set()
        expected = {s for s in machine.states if diagrams.state_group(machine, s) == group}
        assert members == expected


# ---- coverage overlay ---------------------------------------------------------------------


@MACHINE_PARAMS
def test_coverage_overlay_shows_counts_and_marks_zero_edges(machine: MachineSpec) -> None:
    """Every label carries its count; never-exercised edges are marked in both formats."""
    coverage = _coverage_with_zeros(machine)
    counts = coverage["machines"][machine.name]["edges"]
    ids = {(e.source, e.event, e.guard, e.dest): machine.edge_id(e) for e in machine.edges}
    for key, _, suffix in _mermaid_edges(to_mermaid(machine, coverage)):
        n = counts[ids[key]]
        assert suffix == (f"×{n}" if n else "⚠ 0 NEVER")
    dot_text = to_dot(machine, coverage)
    for key, attrs in _dot_edges(dot_text):
        n = counts[ids[key]]
        second = attrs["label"].split("\\n")[1]
        assert second == (f"×{n}" if n else "×0 NEVER")
        assert (attrs["color"] == diagrams._NEVER_COLOUR) == (n == 0)
    never = sum(1 for n in counts.values() if n == 0)
    assert f"{never} never" in to_mermaid(machine, coverage)


def test_bare_mapping_equals_run_json() -> None:
    """A bare edge-id -> count mapping draws the same as the run JSON it came from."""
    machine = MACHINES["activation"]
    coverage = _coverage_with_zeros(machine)
    bare = coverage["machines"]["activation"]["edges"]
    assert to_dot(machine, bare) == to_dot(machine, coverage)
    assert to_mermaid(machine, bare) == to_mermaid(machine, coverage)


def test_absent_edge_counts_as_never_exercised() -> None:
    """An edge missing from the counts is drawn as ×0, not skipped."""
    machine = MACHINES["lifecycle"]
    first = machine.edge_id(machine.edges[0])
    counts = edge_counts(machine, {first: 5})
    assert counts[first] == 5
    assert sum(counts.values()) == 5 and len(counts) == len(machine.edges)


def test_unknown_edge_id_in_coverage_raises() -> None:
    """A stale coverage file naming undeclared edges is refused, naming them."""
    machine = MACHINES["lifecycle"]
    bogus = "dispatched --teleport--> consumed"
    coverage = {"machines": {"lifecycle": {"edges": {bogus: 3}}}}
    for draw in (to_mermaid, to_dot):
        with pytest.raises(StaleCoverage, match="teleport") as info:
            draw(machine, coverage)
        assert info.value.unknown == (bogus,)
        assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "coverage",
    [
        {"dispatched --generation_done--> generated": "7"},
        {"dispatched --generation_done--> generated": True},
        {"dispatched --generation_done--> generated": -1},
        {"machines": {"activation": {"edges": {}}}},
        {"machines": {"lifecycle": {"nodes": {}}}},
        {"machines": []},
    ],
    ids=["string-count", "bool-count", "negative", "other-machine", "no-edges", "bad-machines"],
)
def test_malformed_coverage_raises(coverage: dict[str, Any]) -> None:
    """Malformed coverage is a typed error, never drawn as all-zero."""
    with pytest.raises(DiagramError):
        to_dot(MACHINES["lifecycle"], coverage)


# ---- render: engines, Graphviz ------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "engine"),
    [("mermaid", "graphviz"), ("svg", "mermaid"), ("png", "mermaid"), ("dot", "mermaid")],
)
def test_engine_format_mismatch_raises(fmt: str, engine: str) -> None:
    """A format asked of the wrong engine is an error, not a silent substitution."""
    with pytest.raises(EngineMismatch, match="engine"):
        render(MACHINES["lifecycle"], fmt, engine=engine)


def test_unknown_format_or_engine_raises() -> None:
    """Unknown format/engine names are typed errors."""
    with pytest.raises(DiagramError):
        render(MACHINES["lifecycle"], "jpeg", engine="graphviz")
    with pytest.raises(DiagramError):
        render(MACHINES["lifecycle"], "svg", engine="plantuml")


def test_text_formats_need_no_graphviz(monkeypatch: pytest.MonkeyPatch) -> None:
    """mermaid and dot text are produced without any `dot` binary."""
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    machine = MACHINES["activation"]
    assert render(machine, "mermaid", engine="mermaid") == to_mermaid(machine).encode()
    assert render(machine, "dot", engine="graphviz") == to_dot(machine).encode()


def _assert_install_hint(message: str) -> None:
    assert "apt-get install graphviz" in message
    assert "brew install graphviz" in message
    assert "--format mermaid" in message


@pytest.mark.parametrize("fmt", ["svg", "png"])
def test_missing_dot_says_how_to_install(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No `dot` (bad explicit path, or none on PATH) raises with install instructions."""
    with pytest.raises(GraphvizNotFound) as info:
        render(MACHINES["lifecycle"], fmt, engine="graphviz", dot_path=tmp_path / "no-dot")
    _assert_install_hint(str(info.value))
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    with pytest.raises(GraphvizNotFound) as info:
        render(MACHINES["lifecycle"], fmt, engine="graphviz")
    _assert_install_hint(str(info.value))


def test_write_docs_without_dot_writes_nothing(tmp_path: Path) -> None:
    """A missing `dot` aborts write_docs before any file is written (no partial docs)."""
    out = tmp_path / "docs"
    with pytest.raises(GraphvizNotFound):
        write_docs(out, dot_path=tmp_path / "no-dot")
    assert not out.exists()


@needs_dot
@MACHINE_PARAMS
def test_svg_and_png_are_real_images(machine: MachineSpec) -> None:
    """SVG output is SVG and PNG output is PNG, stamped with the DOT source hash."""
    svg = render(machine, "svg", engine="graphviz")
    assert svg.lstrip().startswith((b"<?xml", b"<svg"))
    assert b"<svg" in svg and b"diagram_source_sha256" in svg
    png = render(machine, "png", engine="graphviz")
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


def test_non_image_output_is_refused(tmp_path: Path) -> None:
    """A `dot` that prints something else is an error, not a file with the wrong content."""
    fake = tmp_path / "dot"
    fake.write_text("#!/bin/sh\necho 'stateDiagram-v2'\n")
    fake.chmod(0o755)
    with pytest.raises(DiagramError, match="did not produce PNG"):
        render(MACHINES["lifecycle"], "png", engine="graphviz", dot_path=fake)


# ---- committed docs and drift -------------------------------------------------------------


def test_committed_docs_match_the_machines() -> None:
    """docs/diagrams is up to date (fix: `rollout-lifecycle diagram --write-docs docs/diagrams`)."""
    assert check_docs(DOCS_DIR) == []


@pytest.mark.parametrize(
    ("name", "tamper"),
    [
        ("lifecycle.mmd", lambda p: p.write_text(p.read_text() + "    a --> b\n")),
        ("activation.dot", lambda p: p.write_text(p.read_text().replace("retry", "retry2"))),
        ("lifecycle.svg", lambda p: p.write_text(re.sub("[0-9a-f]{64}", "0" * 64, p.read_text()))),
        ("activation.svg", lambda p: p.unlink()),
    ],
    ids=["mmd-edited", "dot-edited", "svg-from-other-source", "svg-missing"],
)
def test_check_docs_reports_tampered_file(name: str, tamper: Any, tmp_path: Path) -> None:
    """Editing, re-stamping or deleting one committed file reports exactly that file."""
    copy = tmp_path / "diagrams"
    shutil.copytree(DOCS_DIR, copy)
    assert check_docs(copy) == []
    tamper(copy / name)
    assert check_docs(copy) == [name]


@needs_dot
def test_coverage_docs_are_checked_against_their_counts(tmp_path: Path) -> None:
    """Coverage pictures are re-derived from their -coverage.json; stale counts are reported."""
    machine = MACHINES["lifecycle"]
    written = write_docs(tmp_path, _coverage_with_zeros(machine))
    names = sorted(p.name for p in written)
    assert "lifecycle-coverage.svg" in names and "activation-coverage.svg" not in names
    assert check_docs(tmp_path) == []
    cov = tmp_path / "lifecycle-coverage.json"
    data = json.loads(cov.read_text())
    data["machines"]["lifecycle"]["edges"]["dispatched --teleport--> consumed"] = 1
    cov.write_text(json.dumps(data))
    assert check_docs(tmp_path) == [
        "lifecycle-coverage.dot",
        "lifecycle-coverage.json",
        "lifecycle-coverage.mmd",
        "lifecycle-coverage.svg",
    ]


# ---- CLI ----------------------------------------------------------------------------------


def test_cli_prints_mermaid_to_stdout() -> None:
    """Default run prints Mermaid for both machines; --machine picks one."""
    runner = CliRunner()
    result = runner.invoke(diagram, [])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("stateDiagram-v2") == len(MACHINES)
    one = runner.invoke(diagram, ["--machine", "activation"])
    assert one.exit_code == 0 and one.stdout == to_mermaid(MACHINES["activation"])


def test_cli_out_directory_for_all(tmp_path: Path) -> None:
    """--out DIR with all machines writes one file per machine."""
    result = CliRunner().invoke(diagram, ["--format", "dot", "--out", str(tmp_path / "d")])
    assert result.exit_code == 0, result.output
    for name, machine in MACHINES.items():
        assert (tmp_path / "d" / f"{name}.dot").read_text() == to_dot(machine)


@needs_dot
def test_cli_writes_svg_file(tmp_path: Path) -> None:
    """--format svg --out FILE writes a real SVG for one machine."""
    out = tmp_path / "life.svg"
    args = ["--machine", "lifecycle", "--format", "svg", "--out", str(out)]
    result = CliRunner().invoke(diagram, args)
    assert result.exit_code == 0, result.output
    assert out.read_bytes().lstrip().startswith((b"<?xml", b"<svg"))


def test_cli_missing_coverage_file_is_clean_error(tmp_path: Path) -> None:
    """A missing or broken --coverage file is a usage error without a traceback."""
    runner = CliRunner()
    result = runner.invoke(diagram, ["--coverage", str(tmp_path / "nope.json")])
    assert result.exit_code == 2
    assert "no such file" in result.output and "Traceback" not in result.output
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = runner.invoke(diagram, ["--coverage", str(bad)])
    assert result.exit_code == 2 and "not valid JSON" in result.output


def test_cli_coverage_overlay_and_stale_coverage(tmp_path: Path) -> None:
    """--coverage labels counts; a stale file exits 1 naming the unknown edge."""
    machine = MACHINES["lifecycle"]
    good = tmp_path / "run.json"
    good.write_text(json.dumps(_coverage_with_zeros(machine)))
    runner = CliRunner()
    result = runner.invoke(diagram, ["--machine", "lifecycle", "--coverage", str(good)])
    assert result.exit_code == 0 and "⚠ 0 NEVER" in result.stdout
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps({"machines": {"lifecycle": {"edges": {"a --x--> b": 1}}}}))
    result = runner.invoke(diagram, ["--machine", "lifecycle", "--coverage", str(stale)])
    assert result.exit_code == 2 and "a --x--> b" in result.output
    assert "Traceback" not in result.output


def test_cli_missing_dot_and_mismatch_errors(tmp_path: Path) -> None:
    """svg without dot, svg without --out and a wrong engine are clean errors; no file."""
    runner = CliRunner()
    out = tmp_path / "x.svg"
    args = ["--format", "svg", "--out", str(out), "--dot-path", str(tmp_path / "no-dot")]
    result = runner.invoke(diagram, args)
    assert result.exit_code == 3 and "apt-get install graphviz" in result.output
    assert not out.exists() and "Traceback" not in result.output
    result = runner.invoke(diagram, ["--format", "png"])
    assert result.exit_code == 2 and "--out" in result.output
    result = runner.invoke(diagram, ["--format", "svg", "--engine", "mermaid", "--out", str(out)])
    assert result.exit_code == 2 and "engine" in result.output and not out.exists()


def test_cli_check_docs(tmp_path: Path) -> None:
    """--check-docs exits 0 on the committed docs and 1 listing a stale file."""
    runner = CliRunner()
    result = runner.invoke(diagram, ["--check-docs", str(DOCS_DIR)])
    assert result.exit_code == 0, result.output
    copy = tmp_path / "diagrams"
    shutil.copytree(DOCS_DIR, copy)
    (copy / "lifecycle.mmd").write_text("stateDiagram-v2\n")
    result = runner.invoke(diagram, ["--check-docs", str(copy)])
    assert result.exit_code == 1
    assert "lifecycle.mmd" in result.stdout and "--write-docs" in result.stderr
