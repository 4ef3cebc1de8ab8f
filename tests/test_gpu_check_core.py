"""The parts of the real-run check that need no verl: hashes, model folders, controls, the CLI
without the extra, and the committed CPU reference result (re-judged and replayed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from rollout_lifecycle.cli import exitcodes
from rollout_lifecycle.cli.main import cli
from rollout_lifecycle.gpu_check import extra
from rollout_lifecycle.gpu_check.controls import CONTROLS, GROUPS, expected_failed_checks
from rollout_lifecycle.gpu_check.errors import ExtraMissing, ModelAssetsError
from rollout_lifecycle.gpu_check.evidence import (
    CHECK_ORDER,
    judge_result,
    load_trace,
    trace_report,
    validate,
)
from rollout_lifecycle.gpu_check.hashing import policy_files, policy_hash, tensors_sha256
from rollout_lifecycle.gpu_check.model_assets import inspect_model_dir
from rollout_lifecycle.model.artifacts import ArtifactStore, WorkerLoader

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "gpu-check" / "cpu-reference.json"


def _adapter() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": rng.standard_normal(
            (4, 8), dtype=np.float32
        ),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros(
            (8, 4), np.float32
        ),
    }


def test_tensor_hash_is_order_free_and_sees_names_dtypes_shapes_values() -> None:
    """Same tensors in another order hash alike; any change of name/dtype/shape/value does not."""
    a = _adapter()
    h = tensors_sha256(a)
    assert tensors_sha256(dict(reversed(list(a.items())))) == h
    k0, k1 = list(a)
    assert tensors_sha256({k0 + "x": a[k0], k1: a[k1]}) != h
    assert tensors_sha256({k0: a[k0].astype(np.float64), k1: a[k1]}) != h
    assert tensors_sha256({k0: a[k0].reshape(8, 4), k1: a[k1]}) != h
    b = {k: v.copy() for k, v in a.items()}
    b[k1][0, 0] = np.float32(1e-30)
    assert tensors_sha256(b) != h
    with pytest.raises(ValueError, match="twice"):
        tensors_sha256([(k0, a[k0]), (k0, a[k0])])


def test_the_acked_hash_is_the_artifact_stores_hash(tmp_path: Path) -> None:
    """What a generation side computes from held tensors equals the committed artifact's hash."""
    a = _adapter()
    store = ArtifactStore(tmp_path)
    stored = store.write(0, files=policy_files(a, "b" * 64))
    assert stored.artifact_hash == policy_hash(a, "b" * 64)
    loaded, ack = WorkerLoader(store, "w").load(0, stored.artifact_hash)
    assert ack.artifact_hash == stored.artifact_hash
    assert tensors_sha256(loaded.tensors) == tensors_sha256(a)
    assert policy_hash(a, "c" * 64) != stored.artifact_hash  # the base is part of the policy


def _folder(tmp_path: Path, *, weights: bytes | None, config: bool = True) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    if config:
        (d / "config.json").write_text(
            json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
        )
    (d / "tokenizer.json").write_text("{}")
    if weights is not None:
        (d / "model.safetensors").write_bytes(weights)
    return d


def test_model_folder_only_weights_missing_is_told_apart(tmp_path: Path) -> None:
    """No weights, or a git-lfs pointer in their place: 'only the model weights are missing'."""
    with pytest.raises(ModelAssetsError) as e1:
        inspect_model_dir(_folder(tmp_path, weights=None))
    assert e1.value.only_weights_missing and "only the model weights are missing" in str(e1.value)
    lfs = tmp_path / "lfs"
    lfs.mkdir()
    d = _folder(lfs, weights=b"version https://git-lfs.github.com/spec/v1\noid sha256:00\n")
    with pytest.raises(ModelAssetsError) as e2:
        inspect_model_dir(d)
    assert e2.value.only_weights_missing


def test_model_folder_other_problems_are_not_weights(tmp_path: Path) -> None:
    """A missing folder, missing config, or an index with a lost shard name what is wrong."""
    with pytest.raises(ModelAssetsError, match="not a directory") as e:
        inspect_model_dir(tmp_path / "nope")
    assert not e.value.only_weights_missing
    with pytest.raises(ModelAssetsError, match=r"config\.json is missing") as e:
        inspect_model_dir(_folder(tmp_path, weights=b"x", config=False))
    assert not e.value.only_weights_missing
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    d = _folder(sharded, weights=None)
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001.safetensors", "b": "model-00002.safetensors"}})
    )
    (d / "model-00001.safetensors").write_bytes(b"x" * 16)
    with pytest.raises(ModelAssetsError, match="model-00002") as e:
        inspect_model_dir(d)
    assert e.value.only_weights_missing
    (d / "model-00002.safetensors").write_bytes(b"y" * 16)
    assets = inspect_model_dir(d)
    assert assets.weight_files == ("model-00001.safetensors", "model-00002.safetensors")


def test_controls_name_real_checks_and_differ() -> None:
    """Every expected failure is a check a run records; no two controls fail alike."""
    recorded = {c["name"] for c in json.loads(REFERENCE.read_text())["checks"]}
    sets = [c.expected_failures for c in CONTROLS.values()]
    assert all(s <= set(CHECK_ORDER) for s in sets)
    assert {n.split("/", 1)[-1] for n in recorded} == {*CHECK_ORDER, "groups_same_initial_adapter"}
    for control in CONTROLS:
        assert expected_failed_checks(control) <= recorded, control
    assert all(sets) and len(set(sets)) == len(sets)
    assert expected_failed_checks(None) == set()
    assert expected_failed_checks("version-before-load") == {
        f"{g}/version_matches_weights" for g in GROUPS
    }


def _hide_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("verl", "peft"):
        monkeypatch.setitem(sys.modules, name, None)


def test_without_the_extra_run_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """exit 3, one line naming the missing modules and the pip commands; no traceback."""
    _hide_extra(monkeypatch)
    assert {"verl", "peft"} <= set(extra.missing_modules())
    with pytest.raises(ExtraMissing, match=r"rollout-lifecycle\[verl\]"):
        extra.require_extra()
    res = CliRunner().invoke(
        cli, ["gpu-check", "run", "--run-label", "x", "--output", str(tmp_path), "--device", "cpu"]
    )
    assert res.exit_code == exitcodes.TECHNICAL, res.output
    assert "pip install torch==2.13.0" in res.output and "[verl]" in res.output
    assert "verl (verl)" in res.output and "Traceback" not in res.output
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_without_the_extra_preflight_exits_3(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The preflight reports the missing extra as an environment failure (exit 3)."""
    _hide_extra(monkeypatch)
    res = CliRunner().invoke(
        cli, ["gpu-check", "preflight", "--run-label", "x", "--output", str(tmp_path), "--json"]
    )
    assert res.exit_code == exitcodes.TECHNICAL, res.output
    report = json.loads(res.stdout)
    item = next(i for i in report["items"] if i["name"] == "extra")
    assert item["status"] == "fail" and "pip install" in item["detail"]


def test_one_control_per_run(tmp_path: Path) -> None:
    """Two negative controls at once is a usage error (exit 2)."""
    res = CliRunner().invoke(
        cli,
        [
            "gpu-check",
            "run",
            "--run-label",
            "x",
            "--output",
            str(tmp_path),
            "--control-stale-generation-copy",
            "--control-version-before-load",
        ],
    )
    assert res.exit_code == exitcodes.USAGE and "one negative control" in res.output


def test_committed_cpu_reference_rejudges_and_replays() -> None:
    """docs/gpu-check/cpu-reference.json: well-formed, every recorded check passes and is
    reproduced by re-judging the file, and its traces replay through the spec unchanged."""
    doc = json.loads(REFERENCE.read_text())
    assert validate(doc) == [] and doc["passed"] is True and doc["technical"] == []
    technical, checks = judge_result(doc)
    assert technical == [] and [c.to_json() for c in checks] == doc["checks"]
    assert all(c.passed for c in checks)
    folder = REFERENCE.parent / doc["run_folder"]
    for g in doc["groups"]:
        events = load_trace((folder / g["invariants"]["trace_file"]).read_text().splitlines())
        rep = trace_report(events)
        assert rep == {k: v for k, v in g["invariants"].items() if k != "trace_file"}
        assert rep["violated"] == {}
    assert doc["device"]["device"] == "cpu"


def test_gpu_check_doc_figures_match_the_committed_reference() -> None:
    """docs/gpu-check.md's invariant figures are the committed reference's, group by group."""
    import re

    doc = json.loads(REFERENCE.read_text())
    text = (REFERENCE.parent.parent / "gpu-check.md").read_text()
    m = re.search(
        r"(\d+) of (\d+) spec invariants\s+held over (\d+) atomic steps \((\d+) events\)", text
    )
    assert m is not None
    held, checked, steps, events = (int(x) for x in m.groups())
    for g in doc["groups"]:
        inv = g["invariants"]
        assert (len(inv["held"]), len(inv["checked"]), inv["steps"], inv["events"]) == (
            held,
            checked,
            steps,
            events,
        )


def _shown(text: str, pattern: str) -> tuple[str, ...]:
    """The figures `pattern` captures in `text` (whitespace in the pattern matches line
    breaks too); fails naming the pattern when the doc no longer says it."""
    import re

    m = re.search(pattern.replace(" ", r"\s+"), text)
    assert m is not None, f"docs/gpu-check.md no longer matches {pattern!r}"
    return m.groups()


def _agrees(shown: str, value: float) -> bool:
    """A figure printed with N digits agrees with the value rounded to N digits."""
    from decimal import Decimal

    d = Decimal(shown)
    exponent = d.as_tuple().exponent
    assert isinstance(exponent, int)
    return abs(Decimal(repr(float(value))) - d) <= Decimal(5) * Decimal(10) ** (exponent - 1)


def test_every_gpu_check_doc_figure_is_the_committed_files() -> None:
    """Each measured figure docs/gpu-check.md quotes is read back from the doc and compared
    with the committed result file it comes from (cpu-reference.json for the run,
    drift-gate-benchmark.json for the gate-vs-verl comparison), so the doc cannot drift."""
    doc = json.loads(REFERENCE.read_text())
    bench = json.loads((REFERENCE.parent / "drift-gate-benchmark.json").read_text())
    text = (REFERENCE.parent.parent / "gpu-check.md").read_text()
    groups = doc["groups"]
    g = groups[0]
    up, init, cmp = doc["update"], doc["initialization"], g["decision"]["comparisons"]
    for other in groups[1:]:  # "identical in both groups"
        assert other["update"]["after_sha256"] == up["after_sha256"]
        assert other["initialization"]["adapter_sha256"] == init["adapter_sha256"]

    head, tail = _shown(text, r"initial adapter sha256 `(\w+)\.\.\.(\w+)`")
    assert init["adapter_sha256"].startswith(head) and init["adapter_sha256"].endswith(tail)
    head, tail = _shown(text, r"after-update `(\w+)\.\.\.(\w+)`")
    assert up["after_sha256"].startswith(head) and up["after_sha256"].endswith(tail)
    checks: list[tuple[str, list[float]]] = [
        (r"loss ([\d.]+) \(verl's", [up["loss"]]),
        (r"grad norm ([\d.]+) \(pre-clip\), delta L2 ([\d.]+):", [up["grad_norm"], up["delta_l2"]]),
        (
            r"(\d+) lora_B tensors by gradient \(delta L2 ([\d.]+)\), (\d+) lora_A by weight "
            r"decay only \(delta L2 ([\d.e-]+),",
            [
                up["gradient_changed_tensors"],
                up["gradient_delta_l2"],
                up["weight_decay_only_tensors"],
                up["weight_decay_delta_l2"],
            ],
        ),
        (r"(\d+) of (\d+) tensors changed", [up["changed_tensors"], up["tensors_total"]]),
        (
            r"after the sync: max ([\d.]+), mean ([\d.]+) over (\d+) tokens",
            [cmp["same_version_after"][k] for k in ("max_abs_error", "mean_abs_error", "tokens")],
        ),
        (
            r"full forward\): max ([\d.e-]+), mean ([\d.e-]+);",
            [cmp["same_version_before"][k] for k in ("max_abs_error", "mean_abs_error")],
        ),
        (r"\(dummy weights\): max ([\d.]+)", [cmp["before_first_sync"]["max_abs_error"]]),
        (
            r"v0 vs v1 on the frozen tokens: max ([\d.]+), mean ([\d.]+);",
            [cmp["version_shift"][k] for k in ("max_abs_error", "mean_abs_error")],
        ),
        (
            r"committed reference records its own timings "
            r"\(`timings_s`\): ([\d.]+) s in all, ([\d.]+) s of it imports and setup, then per "
            r"group ([\d.]+)-([\d.]+) s building verl's worker",
            [
                doc["timings_s"]["total"],
                doc["timings_s"]["setup"],
                min(x["timings_s"]["init"] for x in groups),
                max(x["timings_s"]["init"] for x in groups),
            ],
        ),
        (r"([\d.]+) GiB peak RSS", [doc["timings_s"]["peak_rss_gib"]]),
    ]
    admitted = [a for a in g["decision"]["admission"] if a["accepted"]]
    after = g["decision"]["admission_after_update"]["rows"]
    drift_after = [r["mean_abs_log_ratio"] for r in after]
    n_adm, n_rej, bound = _shown(text, r"(\d+) admitted, (\d+) rejected \(drift <= ([\d.e-]+)\)")
    assert (int(n_adm), int(n_rej)) == (
        len(admitted),
        len(g["decision"]["admission"]) - len(admitted),
    )
    assert max(a["drift"] for a in admitted) <= float(bound)
    kept, total, lo, hi = _shown(
        text, r"(\d+) of (\d+) still within D_max \(drift ([\d.]+)-([\d.]+)\)"
    )
    assert (int(kept), int(total)) == (sum(r["accepted"] for r in after), len(after))
    assert _agrees(lo, min(drift_after)) and _agrees(hi, max(drift_after))
    # the drift-gate comparison (benchmarks/verl_drift_gate.py writes the file)
    kept_by = bench["kept"]
    ours = next(v for k, v in kept_by.items() if "this gate" in k)
    verl_mean = next(v for k, v in kept_by.items() if "seq_mean_k1" in k)
    verl_sum = next(v for k, v in kept_by.items() if "seq_sum_k1" in k)
    checks += [
        (
            r"one seeded (\d+) x (\d+) batch",
            [bench["batch"]["B"], bench["batch"]["T"]],
        ),
        (
            r"this gate kept (\d+) of (\d+) rows; verl's seq_mean_k1 kept all (\d+)\*\*",
            [ours, bench["batch"]["B"], verl_mean],
        ),
        (
            r"largest \|signed mean\| in the batch was ([\d.]+), while (\d+) rows",
            [bench["largest_abs_signed_mean"], bench["rows_with_mean_abs_over_bound"]],
        ),
        (r"kept (\d+): a sum over", [verl_sum]),
        (
            r"the gate took ([\d.]+) s and verl's seq_mean_k1 mask ([\d.]+) s",
            [
                bench["seconds_best_of_5"]["this gate"],
                bench["seconds_best_of_5"]["verl seq_mean_k1"],
            ],
        ),
    ]
    for pattern, values in checks:
        shown = _shown(text, pattern)
        assert len(shown) == len(values), pattern
        for s, v in zip(shown, values, strict=True):
            assert _agrees(s, v), f"{pattern!r}: the doc says {s}, the committed file {v}"
