"""Evidence documents of a real update: validation, judgement, trace replay, no overwrite."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from rollout_lifecycle.gpu_check.evidence import (
    EvidenceError,
    Tolerances,
    judge,
    load_trace,
    save,
    validate,
)
from rollout_lifecycle.model.events import event_to_jsonable
from rollout_lifecycle.model.ledger import MemoryLedger
from rollout_lifecycle.model.records import LedgerEntry


def good() -> dict[str, Any]:
    return {
        "schema_version": 1,
        "run_label": "group-a.1",
        "initialization": {"adapter_sha256": "f18e"},
        "update": {
            "after_sha256": "a864",
            "grad_norm": 0.657,
            "delta_l2": 0.0554,
            "changed_tensors": 8,
        },
        "decision": {
            "comparisons": {
                "same_version_after": {"max_abs_error": 0.0625, "mean_abs_error": 0.00265}
            },
            "admission": [
                {"rollout": i, "accepted": i != 3, "drift": 3.6 if i == 3 else 0.05}
                for i in range(8)
            ],
        },
        "sync_rpc_and_version": {"version_before": 0, "version_after": 1},
        "generation_before": "12+7=19",
        "generation_after": "12+7=19",
    }


def test_reference_run_passes() -> None:
    """The seed's reference figures pass the tolerances fixed up front."""
    v = judge(good())
    assert v.ok and not v.technical and len(v.passed_checks) == 4


def test_missing_paths_are_technical() -> None:
    """A missing or mistyped field is a technical failure, named by its path."""
    doc = good()
    del doc["update"]["grad_norm"]
    doc["run_label"] = 7
    assert validate(doc) == ["run_label has type int", "missing update.grad_norm"]
    v = judge(doc)
    assert v.technical and not v.failed_checks and not v.ok


def test_failed_checks_are_not_technical() -> None:
    """Out-of-tolerance figures and an over-drift admission are failed checks."""
    doc = good()
    doc["decision"]["comparisons"]["same_version_after"]["max_abs_error"] = 0.3
    doc["decision"]["admission"][3]["accepted"] = True
    doc["update"]["after_sha256"] = "f18e"
    v = judge(doc, Tolerances())
    assert not v.technical
    assert len(v.failed_checks) == 3


def test_trace_replayed_through_the_spec(tmp_path: Path) -> None:
    """A trace saved as JSON lines is replayed through the spec's invariants."""
    led = MemoryLedger()
    led.add(LedgerEntry(rollout_id="r", behavior_version=0, artifact_hash="h"))
    led.transition("r", "generation_done", 0)
    lines = [__import__("json").dumps(event_to_jsonable(e)) for e in led.history()]
    events = load_trace(lines)
    assert judge(good(), trace=events).ok
    bad = (
        copy.deepcopy(lines[1])
        .replace('"revision":1', '"revision":5')
        .replace('"revision": 1', '"revision": 5')
    )
    v = judge(good(), trace=load_trace([lines[0], bad]))
    assert v.trace_violations and not v.ok
    with pytest.raises(EvidenceError, match="trace line 1"):
        load_trace(["{not json"])


def test_results_are_never_overwritten(tmp_path: Path) -> None:
    """A second result under the same label is refused; the first is intact."""
    p = save(tmp_path, good())
    first = p.read_text()
    doc = good()
    doc["update"]["grad_norm"] = 9.0
    with pytest.raises(EvidenceError, match="new label"):
        save(tmp_path, doc)
    assert p.read_text() == first
    assert [f.name for f in tmp_path.iterdir()] == ["group-a.1.json"]


@pytest.mark.parametrize("label", ["../x", "a/b", "", ".hidden", "x" * 200])
def test_bad_labels_refused(tmp_path: Path, label: str) -> None:
    """Labels that are not plain file names are refused before anything is written."""
    doc = good()
    doc["run_label"] = label
    with pytest.raises(EvidenceError):
        save(tmp_path, doc)
    assert list(tmp_path.iterdir()) == []
