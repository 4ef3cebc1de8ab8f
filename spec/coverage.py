"""Edge coverage: which declared edge a trace event took, and the coverage JSON shape.

The fuzz campaign, the explorer and the diagram overlay all speak this one format:
`{"machines": {name: {"edges": {edge_id: count, ...}, "declared": N, "covered": M}}}` with
every declared edge listed (0 when it never fired), edge ids from `MachineSpec.edge_id`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from rollout_lifecycle.model.events import ArtifactChanged, EntryChanged, TraceEvent
from rollout_lifecycle.model.machines import MACHINES


def edge_of(event: TraceEvent) -> tuple[str, str] | None:
    """(machine name, edge id) of the declared edge an event took; None for a creation, or
    for a move no declared edge explains (the spec's step invariants report those)."""
    if not isinstance(event, EntryChanged | ArtifactChanged) or event.before is None:
        return None
    name = "lifecycle" if isinstance(event, EntryChanged) else "activation"
    spec = MACHINES[name]
    for edge in spec.candidates(event.before.state, event.event):
        if edge.dest == event.after.state:
            return name, spec.edge_id(edge)
    return None


def count_edges(
    events: Iterable[TraceEvent], into: Counter[tuple[str, str]] | None = None
) -> Counter[tuple[str, str]]:
    """Add the declared edges taken by `events` to a counter keyed by (machine, edge id)."""
    out = into if into is not None else Counter()
    for ev in events:
        key = edge_of(ev)
        if key is not None:
            out[key] += 1
    return out


def coverage_json(
    counts: Mapping[tuple[str, str], int], source: str | None = None
) -> dict[str, Any]:
    """The shared coverage document, every declared edge of both machines listed; `source`
    says what the counts count (drawn on the coverage pictures)."""
    machines: dict[str, Any] = {}
    for name, spec in MACHINES.items():
        edges = {spec.edge_id(e): int(counts.get((name, spec.edge_id(e)), 0)) for e in spec.edges}
        machines[name] = {
            "edges": edges,
            "declared": len(edges),
            "covered": sum(1 for n in edges.values() if n > 0),
        }
    out: dict[str, Any] = {"machines": machines}
    if source:
        out["source"] = source
    return out


def merge_coverage(*docs: Mapping[str, Any]) -> dict[str, Any]:
    """Sum several coverage documents (e.g. fuzz + explore) into one."""
    total: Counter[tuple[str, str]] = Counter()
    sources = [str(d["source"]) for d in docs if d.get("source")]
    for doc in docs:
        for name, m in doc.get("machines", {}).items():
            for edge_id, n in m.get("edges", {}).items():
                total[(name, edge_id)] += int(n)
    if len(sources) > 1:
        return coverage_json(total, " + ".join(sources) + " (counts summed)")
    return coverage_json(total, sources[0] if sources else None)


def uncovered(doc: Mapping[str, Any]) -> dict[str, list[str]]:
    """Edge ids never exercised, per machine."""
    return {
        name: sorted(e for e, n in m["edges"].items() if n == 0)
        for name, m in doc["machines"].items()
    }
