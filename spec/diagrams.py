"""Diagrams of the declared machines, drawn only from `MachineSpec` objects.

Why this module exists: a hand-drawn state diagram drifts from the code the first time an
edge is added. Here every state, tag and edge comes from `model.machines` (`LIFECYCLE`,
`ACTIVATION`), the output is deterministic text (golden-testable), and `check_docs` tells
when the committed pictures in ``docs/diagrams`` no longer match the machines.

Two engines, chosen explicitly, never swapped in silently:

* ``mermaid`` writes Mermaid ``stateDiagram-v2`` text (``.mmd``), which needs nothing to
  produce and renders on GitHub.
* ``graphviz`` writes DOT text, and SVG/PNG by running Graphviz ``dot``. When ``dot`` is
  missing this raises `GraphvizNotFound` with install instructions; it never writes Mermaid
  text where an image was asked for.

Grouping (from state tags, never from names): a state tagged ``failure`` is in the failure
group; any other terminal state (no outgoing edge) is a terminal outcome; the rest is the
normal path. DOT draws the groups as clusters. Mermaid cannot: stateDiagram forbids
transitions between states of two different composite states, and our failure edges cross
groups, so Mermaid groups by colour (``classDef`` + ``class``) and by declaration order.

Edge kinds: DOT draws failure edges red dashed and recovery edges blue dotted. Mermaid's
stateDiagram cannot style a single transition (``linkStyle`` is flowchart-only), so the
kind is carried in the label: ``✗ `` marks a failure edge and ``↺ `` a recovery edge.

Coverage overlay: counts per edge id (``machine.edge_id(edge)``) from a fuzz/explore run.
Each label gets ``×N``; a never-exercised edge gets ``×0 NEVER`` in bold orange in DOT and a
trailing ``⚠ 0 NEVER`` in Mermaid (text, for the same linkStyle reason). An edge id the machine
does not declare raises `StaleCoverage`: a stale coverage file is never drawn silently.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from rollout_lifecycle.model.atomic import atomic_write
from rollout_lifecycle.model.errors import RolloutLifecycleError
from rollout_lifecycle.model.machines import MACHINES, Edge, MachineSpec

__all__ = [
    "DOCS_DIR",
    "ENGINES",
    "FORMATS",
    "FORMAT_ENGINE",
    "DiagramError",
    "EngineMismatch",
    "GraphvizNotFound",
    "StaleCoverage",
    "check_docs",
    "edge_counts",
    "edge_label",
    "render",
    "state_group",
    "to_dot",
    "to_mermaid",
    "write_docs",
]

DOCS_DIR: Final = Path(__file__).resolve().parent.parent / "docs" / "diagrams"
FORMATS: Final = ("mermaid", "dot", "svg", "png")
ENGINES: Final = ("mermaid", "graphviz")
# Which engine draws which format. A mismatch is an error, never a quiet substitution.
FORMAT_ENGINE: Final[Mapping[str, str]] = {
    "mermaid": "mermaid",
    "dot": "graphviz",
    "svg": "graphviz",
    "png": "graphviz",
}
INSTALL_HINT: Final = (
    "install Graphviz (`apt-get install graphviz` on Debian/Ubuntu, "
    "`brew install graphviz` on macOS), or use --format mermaid, which needs nothing"
)
# Stamped into every SVG as an XML comment (dot -Gcomment) so drift checks can tell which DOT
# source an SVG was drawn from without comparing SVG bytes, which differ across Graphviz
# versions. No dashes: Graphviz escapes '-' inside comments.
_SOURCE_TAG: Final = "diagram_source_sha256 "
_SOURCE_RE: Final = re.compile(r"diagram_source_sha256 ([0-9a-f]{64})")
_MERMAID_ID: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PNG_MAGIC: Final = b"\x89PNG\r\n\x1a\n"

GROUPS: Final = ("normal", "failure", "terminal")
# DOT emits clusters in this order: with normal first and failures last, dot lays the failure
# cluster above the normal path and terminal outcomes below it, which keeps the many failure
# edges short (tried all six orders on both machines; this one crosses least).
_DOT_CLUSTER_ORDER: Final = ("normal", "terminal", "failure")
GROUP_TITLES: Final[Mapping[str, str]] = {
    "normal": "normal path",
    "failure": "failures",
    "terminal": "terminal outcomes",
}
# Fill / border per state colour class, shared by DOT and Mermaid so both read alike.
_STATE_COLOURS: Final[Mapping[str, tuple[str, str]]] = {
    "normal": ("#e8f5e9", "#2e7d32"),
    "failure": ("#ffebee", "#c62828"),
    "offline": ("#eceff1", "#546e7a"),
    "recovery": ("#e3f2fd", "#1565c0"),
}
_CLUSTER_STYLE: Final[Mapping[str, tuple[str, str]]] = {
    "normal": ("#f6fbf6", "#81c784"),
    "failure": ("#fff7f7", "#e57373"),
    "terminal": ("#f7f7f7", "#9e9e9e"),
}
# colour, style, penwidth, label prefix (Mermaid only: it cannot style single edges)
_EDGE_STYLE: Final[Mapping[str, tuple[str, str, str, str]]] = {
    "normal": ("#263238", "solid", "1.6", ""),
    "failure": ("#c62828", "dashed", "1.4", "✗ "),
    "recovery": ("#1565c0", "dotted", "2.2", "↺ "),
}
_NEVER_COLOUR: Final = "#ff6d00"


class DiagramError(RolloutLifecycleError, ValueError):
    """A diagram that cannot be drawn as asked; the message says what to do instead."""


class EngineMismatch(DiagramError):
    """A format asked of the engine that does not draw it (explicit, so no fallback hides)."""


class GraphvizNotFound(DiagramError):
    """Graphviz `dot` is needed for SVG/PNG and is not installed (or not at the given path)."""


class StaleCoverage(DiagramError):
    """Coverage names edges the machine does not declare: it was recorded against old code."""

    def __init__(self, machine: str, unknown: list[str]) -> None:
        self.machine = machine
        self.unknown = tuple(unknown)
        super().__init__(
            f"{machine}: coverage names {len(unknown)} edge(s) the machine does not declare "
            f"(stale coverage file? re-run fuzz/explore): {', '.join(unknown)}"
        )


# ---- shared helpers -----------------------------------------------------------------------


def state_group(machine: MachineSpec, state: str) -> str:
    """Cluster of a state: 'failure' if tagged so, else 'terminal' if terminal, else 'normal'."""
    tags = machine.tags[state]
    if "failure" in tags:
        return "failure"
    if state in machine.terminal:
        return "terminal"
    return "normal"


def _colour_class(machine: MachineSpec, state: str) -> str:
    """Colour of a state: its most telling tag (failure > offline > recovery > normal)."""
    tags = machine.tags[state]
    for tag in ("failure", "offline", "recovery"):
        if tag in tags:
            return tag
    return "normal"


def _grouped_states(
    machine: MachineSpec, order: tuple[str, ...] = GROUPS
) -> list[tuple[str, list[str]]]:
    """States per group, groups in `order` and states in declaration order."""
    return [(g, [s for s in machine.states if state_group(machine, s) == g]) for g in order]


def edge_label(edge: Edge) -> str:
    """``event [guard]`` (or just ``event``): the text every drawing labels an edge with."""
    return f"{edge.event} [{edge.guard}]" if edge.guard else edge.event


def edge_counts(machine: MachineSpec, coverage: Mapping[str, Any]) -> dict[str, int]:
    """Count per declared edge id, from a run's JSON or from a bare edge-id -> count mapping.

    Raises `StaleCoverage` for ids the machine does not declare, and `DiagramError` for a
    malformed mapping, so a wrong file is refused instead of drawn as all-zero.
    """
    raw: Any = coverage
    if "machines" in coverage:
        machines = coverage["machines"]
        if not isinstance(machines, Mapping):
            raise DiagramError("coverage['machines'] must be a mapping of machine name -> data")
        if machine.name not in machines:
            raise DiagramError(
                f"coverage has no edge counts for machine {machine.name!r}; it covers "
                f"{sorted(map(str, machines))} (draw only those, e.g. with --machine)"
            )
        entry = machines[machine.name]
        raw = entry.get("edges") if isinstance(entry, Mapping) else None
        if not isinstance(raw, Mapping):
            raise DiagramError(
                f"coverage['machines'][{machine.name!r}]['edges'] must be a mapping "
                "of edge id -> count"
            )
    for key, value in raw.items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, int):
            raise DiagramError(
                f"{machine.name}: coverage must map edge ids to integer counts, got "
                f"{key!r}: {value!r}"
            )
        if value < 0:
            raise DiagramError(f"{machine.name}: negative coverage count {key!r}: {value}")
    ids = [machine.edge_id(e) for e in machine.edges]
    unknown = sorted(set(raw) - set(ids))
    if unknown:
        raise StaleCoverage(machine.name, unknown)
    return {i: int(raw.get(i, 0)) for i in ids}


def _counts_or_none(
    machine: MachineSpec, coverage: Mapping[str, Any] | None
) -> dict[str, int] | None:
    return None if coverage is None else edge_counts(machine, coverage)


def _coverage_summary(counts: Mapping[str, int], source: str | None = None) -> str:
    hit = sum(1 for c in counts.values() if c > 0)
    text = f"coverage {hit}/{len(counts)} edges exercised, {len(counts) - hit} never"
    return f"{text}; counts: {source}" if source else text


def coverage_source(coverage: Mapping[str, Any] | None) -> str | None:
    """What a coverage document's counts count, when it says so."""
    if coverage is None:
        return None
    src = coverage.get("source")
    return str(src) if isinstance(src, str) and src else None


# ---- Mermaid ------------------------------------------------------------------------------


def _mermaid_text(text: str) -> str:
    """Escape the characters that end or break a Mermaid transition label."""
    return re.sub(r"[#:;]", lambda m: f"#{ord(m.group())};", text)


def to_mermaid(
    machine: MachineSpec, coverage: Mapping[str, Any] | None = None, *, source: str | None = None
) -> str:
    """Mermaid stateDiagram-v2 text: every declared edge once, grouped and coloured by tag."""
    counts = _counts_or_none(machine, coverage)
    for s in machine.states:
        if not _MERMAID_ID.match(s):
            raise DiagramError(f"{machine.name}: state {s!r} is not a valid Mermaid state id")
    src = source or coverage_source(coverage)
    title = machine.name if counts is None else f"{machine.name} ({_coverage_summary(counts, src)})"
    out = [
        "---",
        f"title: {title}",
        "---",
        "stateDiagram-v2",
        "    direction LR",
        f"    %% Generated from model.machines ({machine.name}) by spec/diagrams.py; do not edit.",
        "    %% Colours: green normal path, red failure, grey offline, blue recovery;",
        "    %% thick border: terminal. Edge labels: '✗ ' failure, '↺ ' recovery",
        "    %% (stateDiagram cannot style single edges, so the kind is in the label).",
    ]
    if counts is not None:
        out.append("    %% Coverage: '×N' times exercised; '⚠ 0 NEVER' never exercised.")
    for group, states in _grouped_states(machine):
        if states:
            out.append(f"    %% {GROUP_TITLES[group]}")
            out.extend(f"    {s}" for s in states)
    out.append(f"    [*] --> {machine.initial}")
    for e in machine.edges:
        label = _EDGE_STYLE[e.kind][3] + edge_label(e)
        if counts is not None:
            n = counts[machine.edge_id(e)]
            label += f" ×{n}" if n else " ⚠ 0 NEVER"
        out.append(f"    {e.source} --> {e.dest} : {_mermaid_text(label)}")
    out.extend(f"    {s} --> [*]" for s in machine.states if s in machine.terminal)
    classes: dict[str, list[str]] = {}
    for s in machine.states:
        cls = _colour_class(machine, s) + ("_end" if s in machine.terminal else "")
        classes.setdefault(cls, []).append(s)
    for cls, members in classes.items():
        fill, stroke = _STATE_COLOURS[cls.removesuffix("_end")]
        width = "3px" if cls.endswith("_end") else "1px"
        out.append(f"    classDef {cls} fill:{fill},stroke:{stroke},stroke-width:{width}")
        out.append(f"    class {','.join(members)} {cls}")
    return "\n".join(out) + "\n"


# ---- Graphviz DOT -------------------------------------------------------------------------


def _q(text: str) -> str:
    """A DOT double-quoted string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _attrs(**kw: str) -> str:
    return "[" + ", ".join(f"{k}={_q(v)}" for k, v in kw.items()) + "]"


def to_dot(
    machine: MachineSpec, coverage: Mapping[str, Any] | None = None, *, source: str | None = None
) -> str:
    """Graphviz DOT text: clustered states, styled edge kinds, optional coverage counts."""
    counts = _counts_or_none(machine, coverage)
    # One table cell per phrase: cell spacing, not spaces, keeps words apart, so the text
    # stays legible in any SVG renderer (SVG collapses and trims plain spaces).
    items = [
        '<font color="#263238">solid: normal</font>',
        '<font color="#c62828">dashed: failure</font>',
        '<font color="#1565c0">dotted: recovery</font>',
        "double octagon: terminal",
    ]
    title = [f"<b>{_html(machine.name)}</b>"]
    if counts is not None:
        title.append(_html(_coverage_summary(counts, source or coverage_source(coverage))))
        items.append(f'<font color="{_NEVER_COLOUR}"><b>bold orange ×0: never exercised</b></font>')
    row = "".join(f"<td>{c}</td>" for c in title)
    legend_row = "".join(f'<td><font point-size="10">{c}</font></td>' for c in items)
    heading = (
        f'<table border="0" cellborder="0" cellspacing="8" cellpadding="0">'
        f'<tr><td colspan="{len(items)}"><table border="0" cellspacing="8" cellpadding="0">'
        f"<tr>{row}</tr></table></td></tr><tr>{legend_row}</tr></table>"
    )
    out = [
        f"digraph {_q(machine.name)} {{",
        "    // Generated from model.machines by spec/diagrams.py; do not edit by hand.",
        '    graph [rankdir="LR", fontname="Helvetica", fontsize="12", labelloc="t", '
        'nodesep="0.35", ranksep="0.55", newrank="true", '
        f"label=<{heading}>]",
        '    node [fontname="Helvetica", fontsize="11", style="rounded,filled", shape="box", '
        'height="0.4"]',
        '    edge [fontname="Helvetica", fontsize="10", arrowsize="0.8"]',
        "    "
        + _q("__start__")
        + " "
        + _attrs(shape="point", width="0.18", label="", tooltip="initial state"),
    ]
    for group, states in _grouped_states(machine, _DOT_CLUSTER_ORDER):
        if not states:
            continue
        fill, border = _CLUSTER_STYLE[group]
        out.append(f"    subgraph {_q('cluster_' + group)} {{")
        out.append(
            "        graph "
            + _attrs(
                label=GROUP_TITLES[group],
                style="rounded,filled",
                fillcolor=fill,
                color=border,
                fontcolor="#424242",
                fontsize="11",
                labeljust="l",
            )
        )
        for s in states:
            colour = _colour_class(machine, s)
            node_fill, node_border = _STATE_COLOURS[colour]
            shape = "doubleoctagon" if s in machine.terminal else "box"
            style = "filled" if s in machine.terminal else "rounded,filled"
            tooltip = f"{s}: {', '.join(machine.display_tags(s))}"
            out.append(
                f"        {_q(s)} "
                + _attrs(
                    shape=shape,
                    style=style,
                    fillcolor=node_fill,
                    color=node_border,
                    tooltip=tooltip,
                )
            )
        out.append("    }")
    out.append(f"    {_q('__start__')} -> {_q(machine.initial)} {_attrs(tooltip='initial')}")
    for e in machine.edges:
        colour, style, width, _prefix = _EDGE_STYLE[e.kind]
        edge_id = machine.edge_id(e)
        label = edge_label(e)
        extra: dict[str, str] = {}
        if counts is not None:
            n = counts[edge_id]
            label += f"\n×{n}" if n else "\n×0 NEVER"
            if not n:
                colour, width = _NEVER_COLOUR, "3"
                extra["fontname"] = "Helvetica-Bold"
        # The normal path is pulled straight and heavy so it reads left to right.
        weight = "8" if e.kind == "normal" else "1"
        out.append(
            f"    {_q(e.source)} -> {_q(e.dest)} "
            + _attrs(
                label=label,
                color=colour,
                fontcolor=colour,
                style=style,
                penwidth=width,
                weight=weight,
                tooltip=edge_id,
                **extra,
            )
        )
    out.append("}")
    return "\n".join(out) + "\n"


# ---- rendering ----------------------------------------------------------------------------


def _dot_executable(dot_path: str | os.PathLike[str] | None) -> str:
    """The `dot` to run: the explicit path if given, else `dot` on PATH; never a substitute."""
    if dot_path is not None:
        p = Path(dot_path)
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise GraphvizNotFound(
                f"Graphviz `dot` not found at {str(p)!r} (needed for SVG/PNG); {INSTALL_HINT}"
            )
        return str(p)
    found = shutil.which("dot")
    if found is None:
        raise GraphvizNotFound(
            f"Graphviz `dot` is not on PATH (needed for SVG/PNG); {INSTALL_HINT}"
        )
    return found


def _source_hash(dot_text: str) -> str:
    return hashlib.sha256(dot_text.encode("utf-8")).hexdigest()


def _run_dot(dot_text: str, fmt: str, exe: str, timeout_s: float) -> bytes:
    """Run `dot -T<fmt>` and insist the result is really that format."""
    try:
        proc = subprocess.run(
            [exe, f"-T{fmt}", f"-Gcomment={_SOURCE_TAG}{_source_hash(dot_text)}"],
            input=dot_text.encode("utf-8"),
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DiagramError(f"running Graphviz {exe!r} failed: {exc}") from exc
    if proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace").strip()
        raise DiagramError(f"Graphviz {exe!r} exited {proc.returncode}: {err}")
    data = proc.stdout
    head = data.lstrip()[:5]
    ok = data.startswith(_PNG_MAGIC) if fmt == "png" else head in (b"<?xml", b"<svg ")
    if not ok:
        raise DiagramError(f"Graphviz {exe!r} did not produce {fmt.upper()} output")
    return data


def render(
    machine: MachineSpec,
    fmt: str,
    *,
    engine: str,
    coverage: Mapping[str, Any] | None = None,
    dot_path: str | os.PathLike[str] | None = None,
    timeout_s: float = 60.0,
) -> bytes:
    """Draw `machine` as `fmt` with the explicitly chosen `engine`.

    'mermaid' needs engine 'mermaid'; 'dot', 'svg', 'png' need engine 'graphviz'. SVG/PNG
    run Graphviz `dot` (`dot_path`, else PATH) and raise `GraphvizNotFound` when it is
    missing, rather than returning some other format.
    """
    if fmt not in FORMAT_ENGINE:
        raise DiagramError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if engine not in ENGINES:
        raise DiagramError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if FORMAT_ENGINE[fmt] != engine:
        raise EngineMismatch(
            f"format {fmt!r} is drawn by engine {FORMAT_ENGINE[fmt]!r}, not {engine!r}; "
            f"pass --engine {FORMAT_ENGINE[fmt]} (engines are never swapped silently)"
        )
    if fmt == "mermaid":
        return to_mermaid(machine, coverage).encode("utf-8")
    exe = _dot_executable(dot_path) if fmt in ("svg", "png") else ""
    dot_text = to_dot(machine, coverage)
    if fmt == "dot":
        return dot_text.encode("utf-8")
    return _run_dot(dot_text, fmt, exe, timeout_s)


# ---- committed docs -----------------------------------------------------------------------


def _stem(name: str, coverage: bool) -> str:
    return f"{name}-coverage" if coverage else name


def _coverage_json(
    machine: MachineSpec, counts: Mapping[str, int], source: str | None = None
) -> str:
    """The counts a coverage picture was drawn from, in a run's JSON shape (re-checkable)."""
    doc: dict[str, Any] = {"machines": {machine.name: {"edges": dict(counts)}}}
    if source:
        doc["source"] = source
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def write_docs(
    out_dir: str | os.PathLike[str] = DOCS_DIR,
    coverage: Mapping[str, Any] | None = None,
    *,
    dot_path: str | os.PathLike[str] | None = None,
) -> list[Path]:
    """(Re)generate ``<name>.mmd/.dot/.svg`` per machine, plus ``<name>-coverage.*``.

    Coverage must be a run's JSON (``coverage['machines'][name]['edges']``); every machine it
    names gets coverage files, including ``<name>-coverage.json`` with the counts drawn so
    `check_docs` can re-derive them. Everything is drawn before anything is written, so a
    missing `dot` or stale coverage leaves the directory untouched.
    """
    files: dict[str, bytes] = {}
    jobs: list[tuple[MachineSpec, dict[str, int] | None]] = [(m, None) for m in MACHINES.values()]
    if coverage is not None:
        covered = coverage.get("machines")
        if not isinstance(covered, Mapping):
            raise DiagramError(
                "write_docs needs a fuzz/explore run's JSON with coverage['machines']"
            )
        unknown = sorted(str(n) for n in covered if n not in MACHINES)
        if unknown:
            raise DiagramError(f"coverage names undeclared machine(s): {', '.join(unknown)}")
        jobs += [(MACHINES[n], edge_counts(MACHINES[n], coverage)) for n in sorted(covered)]
    exe = _dot_executable(dot_path)
    for machine, counts in jobs:
        stem = _stem(machine.name, counts is not None)
        src = None if counts is None else coverage_source(coverage)
        dot_text = to_dot(machine, counts, source=src)
        files[f"{stem}.mmd"] = to_mermaid(machine, counts, source=src).encode("utf-8")
        files[f"{stem}.dot"] = dot_text.encode("utf-8")
        files[f"{stem}.svg"] = _run_dot(dot_text, "svg", exe, 60.0)
        if counts is not None:
            files[f"{stem}.json"] = _coverage_json(machine, counts, src).encode("utf-8")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in files.items():
        path = out / name
        atomic_write(path, data)
        written.append(path)
    return written


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _stale_set(
    out: Path,
    stem: str,
    machine: MachineSpec,
    counts: Mapping[str, int] | None,
    source: str | None = None,
    dot_exe: str | None = None,
) -> list[str]:
    dot_text = to_dot(machine, counts, source=source)
    stale = []
    if _read_text(out / f"{stem}.mmd") != to_mermaid(machine, counts, source=source):
        stale.append(f"{stem}.mmd")
    if _read_text(out / f"{stem}.dot") != dot_text:
        stale.append(f"{stem}.dot")
    svg = _read_text(out / f"{stem}.svg")
    found = _SOURCE_RE.search(svg or "")
    if found is None or found.group(1) != _source_hash(dot_text):
        stale.append(f"{stem}.svg")
    elif dot_exe is not None and svg_text(svg or "") != svg_text(
        _run_dot(dot_text, "svg", dot_exe, 60.0).decode("utf-8", "replace")
    ):
        # the stamp is right but what the picture says is not (an edited label): the text
        # Graphviz draws is compared, never its coordinates, which vary between versions
        stale.append(f"{stem}.svg")
    return stale


_SVG_TEXT_RE = re.compile(r"<(text|title)\b[^>]*>(.*?)</\1>", re.S)


def svg_text(svg: str) -> list[str]:
    """What an SVG says, for comparison: its <text> and <title> contents, sorted (layout,
    coordinates and Graphviz's version-specific markup left out)."""
    return sorted(html.unescape(m.group(2)).strip() for m in _SVG_TEXT_RE.finditer(svg))


def check_docs(out_dir: str | os.PathLike[str] = DOCS_DIR) -> list[str]:
    """Names of committed diagram files that no longer match what the machines draw now.

    ``.mmd`` and ``.dot`` are compared as exact text; an ``.svg`` must carry the SHA-256 of
    the current DOT text (stamped by `render`) AND, where Graphviz `dot` is installed, say
    what a fresh drawing says (its text, see `svg_text`: an edited label is caught; SVG
    bytes, which differ between Graphviz versions, are never compared). Without `dot` only
    the stamp is checked. Missing files count as stale. Coverage pictures are re-derived
    from their ``-coverage.json``; if that no longer fits the machine, all the coverage
    files are stale. A folder that does not exist is a DiagramError, not six stale files.
    """
    out = Path(out_dir)
    if not out.is_dir():
        raise DiagramError(
            f"{out}: no such folder; give the folder the diagrams were written to "
            f"(`rollout-lifecycle diagram --write-docs {out}` creates one)"
        )
    dot_exe = shutil.which("dot")
    stale: list[str] = []
    for name, machine in MACHINES.items():
        stale += _stale_set(out, name, machine, None, dot_exe=dot_exe)
    for cov in sorted(out.glob("*-coverage.json")):
        stem = cov.name.removesuffix(".json")
        machine_or_none = MACHINES.get(stem.removesuffix("-coverage"))
        try:
            if machine_or_none is None:
                raise DiagramError(f"{cov.name}: no such machine")
            data = json.loads(cov.read_text(encoding="utf-8"))
            if not isinstance(data, Mapping):
                raise DiagramError(f"{cov.name}: not a JSON object")
            counts = edge_counts(machine_or_none, data)
        except (OSError, ValueError, RecursionError):
            stale += [cov.name] + [f"{stem}.{x}" for x in ("mmd", "dot", "svg")]
            continue
        stale += _stale_set(
            out, stem, machine_or_none, counts, coverage_source(data), dot_exe=dot_exe
        )
    return sorted(set(stale))
