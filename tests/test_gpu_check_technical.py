"""A technical failure in the middle of a run is recorded apart from failed checks (exit 3)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollout_lifecycle.gpu_check.extra import INSTALL_HINT, missing_modules

pytestmark = pytest.mark.skipif(
    bool(missing_modules()),
    reason=f"the [verl] extra is not installed ({', '.join(missing_modules())}): {INSTALL_HINT}",
)


def test_update_failure_is_technical_and_the_ledger_records_its_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """update_actor raising: exit 3, the result names stage 'update', no check is claimed
    passed for the missing update, the reserved rollouts end update_failed, the spec holds."""
    from rollout_lifecycle.cli import exitcodes
    from rollout_lifecycle.cli.main import run
    from rollout_lifecycle.gpu_check import verl_driver
    from rollout_lifecycle.model.backends import open_backend

    def broken(self: Any, *_a: Any, **_k: Any) -> dict[str, float]:
        raise RuntimeError("simulated optimizer failure")

    monkeypatch.setattr(verl_driver.Trainer, "sft_step", broken)
    code = run(
        [
            "gpu-check",
            "run",
            "--run-label",
            "broken",
            "--output",
            str(tmp_path),
            "--device",
            "cpu",
            "--quiet",
        ]
    )
    assert code == exitcodes.TECHNICAL
    doc = json.loads((tmp_path / "broken.json").read_text())
    assert doc["passed"] is False and doc["incomplete"]
    assert [(t["group"], t["stage"]) for t in doc["technical"]] == [("release_resume", "update")]
    assert "simulated optimizer failure" in doc["technical"][0]["message"]
    assert len(doc["groups"]) == 1  # the second group never starts after a technical failure
    g = doc["groups"][0]
    assert "update" not in g and doc["failed_checks"] == []
    assert g["invariants"]["violated"] == {}
    with open_backend(
        f"sqlite:///{(tmp_path / 'broken' / g['protocol']['ledger']).resolve()}", create=False
    ) as b:
        states = {e.state for e in b.ledger.snapshot().values()}
        failed = [e for e in b.ledger.snapshot().values() if e.state == "update_failed"]
    assert states == {"update_failed"}
    assert all(e.disposition is not None and e.disposition.stage == "update" for e in failed)
