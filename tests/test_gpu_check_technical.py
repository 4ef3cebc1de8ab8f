"""A technical failure in the middle of a run is recorded apart from failed checks (exit 3)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_lifecycle.gpu_check.extra import INSTALL_HINT, missing_modules

pytestmark = pytest.mark.skipif(
    bool(missing_modules()),
    reason=f"the [verl] extra is not installed ({', '.join(missing_modules())}): {INSTALL_HINT}",
)


def test_update_failure_is_technical_and_the_ledger_records_its_stage(tmp_path: Path) -> None:
    """update_actor raising: exit 3, the result names stage 'update', no check is claimed
    passed for the missing update, the reserved rollouts end update_failed, the spec holds.

    The run is a fresh process, as users run it: the CPU platform must be set up before
    verl's FSDP engine is imported, and other tests in this process import it."""
    from rollout_lifecycle.cli import exitcodes
    from rollout_lifecycle.model.backends import open_backend

    script = tmp_path / "broken_update.py"
    script.write_text(
        "import sys\n"
        "from rollout_lifecycle.cli.main import run\n"
        "from rollout_lifecycle.gpu_check import verl_driver\n"
        "def broken(self, *a, **k):\n"
        "    raise RuntimeError('simulated optimizer failure')\n"
        "verl_driver.Trainer.sft_step = broken\n"
        "sys.exit(run(['gpu-check', 'run', '--run-label', 'broken', '--output', sys.argv[1],\n"
        "              '--device', 'cpu', '--quiet']))\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=900
    )
    code = proc.returncode
    assert code == exitcodes.TECHNICAL, proc.stderr[-3000:]
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
