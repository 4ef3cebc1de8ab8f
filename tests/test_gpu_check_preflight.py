"""`gpu-check preflight`: ready (0), only the weights missing (4), anything else non-zero."""

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

CLI = [sys.executable, "-m", "rollout_lifecycle", "gpu-check", "preflight"]


@pytest.fixture(scope="module")
def weightless_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small model's folder with its config and tokenizer but no weights."""
    from rollout_lifecycle.gpu_check.model_assets import build_small_model

    d = tmp_path_factory.mktemp("weightless")
    build_small_model(d)
    (d / "model.safetensors").unlink()
    return d


@pytest.fixture(scope="module")
def preflights(
    tmp_path_factory: pytest.TempPathFactory, weightless_model: Path
) -> dict[str, subprocess.CompletedProcess[str]]:
    """A full preflight on the small model and one on a folder without weights, in parallel."""
    root = tmp_path_factory.mktemp("preflight-out")
    args = {
        "ready": [*CLI, "--run-label", "p1", "--output", str(root), "--device", "cpu", "--json"],
        "weightless": [
            *CLI,
            "--run-label",
            "p2",
            "--output",
            str(root),
            "--device",
            "cpu",
            "--model",
            str(weightless_model),
            "--json",
        ],
    }
    procs = {
        k: subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for k, a in args.items()
    }
    out = {}
    for k, p in procs.items():
        so, se = p.communicate(timeout=600)
        out[k] = subprocess.CompletedProcess(args[k], p.returncode, so, se)
    return out


def test_ready_on_the_small_model(preflights: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """Exit 0; versions, device, memory and every CPU check of the run's logic pass."""
    p = preflights["ready"]
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(p.stdout)
    status = {i["name"]: i["status"] for i in report["items"]}
    assert report["ready"] is True
    for name in (
        "extra",
        "versions",
        "device",
        "host_memory",
        "model_assets",
        "tokenizer",
        "loss",
        "scored_positions",
        "init_reproducible",
        "run_label",
        "disk",
    ):
        assert status[name] == "ok", (name, report)
    assert report["versions"]["verl"] == "0.9.1"
    detail = {i["name"]: i["detail"] for i in report["items"]}
    assert "EOS included" in detail["scored_positions"]
    assert "identical" in detail["init_reproducible"]


def test_only_weights_missing_exits_4(
    preflights: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    """Config and tokenizer present, weights absent: exit 4, said plainly, nothing else fails."""
    p = preflights["weightless"]
    assert p.returncode == 4, p.stderr[-2000:]
    report = json.loads(p.stdout)
    status = {i["name"]: i["status"] for i in report["items"]}
    assert status["model_assets"] == "weights_missing"
    assert "only the model weights are missing" in next(
        i["detail"] for i in report["items"] if i["name"] == "model_assets"
    )
    assert status["tokenizer"] == "ok"
    assert {status[n] for n in ("loss", "scored_positions", "init_reproducible")} == {"skipped"}
    assert "fail" not in status.values()


def test_other_problems_are_another_code(tmp_path: Path, weightless_model: Path) -> None:
    """A used label is an input error (2); a folder without config is one too; never 0 or 4.

    Each preflight runs in a fresh process, as users run it: the CPU platform must be set up
    before verl's FSDP engine is imported, and other tests in this process import it."""
    (tmp_path / "used.json").write_text("{}")
    base = [*CLI, "--output", str(tmp_path), "--device", "cpu", "--json"]
    used = subprocess.run(
        [*base, "--run-label", "used", "--model", str(weightless_model)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert used.returncode == 2, used.stderr[-2000:]
    items = {i["name"]: i for i in json.loads(used.stdout)["items"]}
    assert items["run_label"]["status"] == "fail"
    empty = tmp_path / "empty-model"
    empty.mkdir()
    bare = subprocess.run(
        [*base, "--run-label", "fresh", "--model", str(empty)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    items = {i["name"]: i for i in json.loads(bare.stdout)["items"]}
    item = items["model_assets"]
    assert bare.returncode == 2, bare.stderr[-2000:]
    assert item["status"] == "fail" and "config.json" in item["detail"]
