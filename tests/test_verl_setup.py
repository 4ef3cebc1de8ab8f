"""verl set-up in one command and one config group (issue 34, item 8): `rollout-lifecycle
verl setup` records the policy on the run's own ledger and prints overrides that compose
with verl's own ppo_trainer.yaml into every key the integration reads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from rollout_lifecycle.cli.main import cli
from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.records import AdmissionPolicy


def setup_run(tmp_path: Path, *extra: str) -> Any:
    url = f"sqlite:///{tmp_path / 'run' / 'ledger.db'}"
    (tmp_path / "run").mkdir(exist_ok=True)
    res = CliRunner().invoke(
        cli,
        [
            "verl", "setup", "--backend", url, "--run-id", "exp-7",
            "--artifact-root", str(tmp_path / "art"), "--max-lag", "2", "--max-drift", "0.3",
            "--batch-size", "8", "--max-attempts", "3", "--json", *extra,
        ],
    )  # fmt: skip
    return url, res


def test_setup_records_the_policy_on_the_runs_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    url, res = setup_run(tmp_path)
    assert res.exit_code == 0, res.output
    with open_backend(url, create=False) as b:
        assert b.registry.policy() == AdmissionPolicy(2, 0.3, 8, 3)
    assert not (tmp_path / "rollout-lifecycle.db").exists()  # nothing in a default file
    bad = CliRunner().invoke(
        cli, ["verl", "setup", "--backend", url, "--run-id", "a_b", "--artifact-root", "x",
               "--max-lag", "1", "--max-drift", "0.1"],
    )  # fmt: skip
    assert bad.exit_code == 2 and "--run-id" in bad.output
    missing = CliRunner().invoke(cli, ["verl", "setup", "--run-id", "r", "--artifact-root", "x"])
    assert missing.exit_code == 2 and "--backend" in missing.output


def test_setup_refuses_a_file_that_holds_no_ledger(tmp_path: Path) -> None:
    """Issue 31 item 9, as for `deployment set-policy`: an empty file or another
    application's SQLite database is refused (exit 2) and nothing is created in it."""
    import sqlite3

    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE notes(x)")
    for path in (empty, other):
        before = path.read_bytes()
        res = CliRunner().invoke(
            cli, ["verl", "setup", "--backend", f"sqlite:///{path}", "--run-id", "r",
                   "--artifact-root", str(tmp_path / "art"), "--max-lag", "1",
                   "--max-drift", "0.1"],
        )  # fmt: skip
        assert res.exit_code == 2, res.output
        assert "holds no rollout-lifecycle ledger" in res.output or "not a" in res.output
        assert path.read_bytes() == before


def test_printed_overrides_compose_with_verls_ppo_trainer(tmp_path: Path) -> None:
    """The config group carries every key, each resolving to the rollout config it names."""
    verl = pytest.importorskip("verl")
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from rollout_lifecycle.gpu_check.verl_v1 import BufferSettings

    url, res = setup_run(tmp_path)
    keys = json.loads(res.output)["overrides"]
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(
            config_name="ppo_trainer",
            overrides=[
                *keys,
                "actor_rollout_ref.model.path=/models/tiny",
                "actor_rollout_ref.rollout.temperature=0.7",
                "actor_rollout_ref.rollout.response_length=64",
            ],
        )
    OmegaConf.resolve(cfg)
    kw = cfg.trainer.v1.sampler.sampler_kwargs
    assert (kw.ledger_url, kw.run_id, kw.tokenizer_id) == (url, "exp-7", "/models/tiny")
    assert (kw.temperature, kw.response_length) == (0.7, 64)
    assert kw.filter_groups is False
    s = BufferSettings.from_kwargs(kw)
    assert s.conditions is not None and s.conditions.temperature == 0.7
    sampler = cfg.trainer.v1.sampler.custom_sampler
    assert (sampler.path, sampler.name) == (
        "pkg://rollout_lifecycle.gpu_check.verl_v1",
        "LedgerReplayBuffer",
    )
    ce = cfg.actor_rollout_ref.rollout.checkpoint_engine
    assert ce.backend == "rollout_lifecycle"
    assert ce.custom_backend_module == "rollout_lifecycle.gpu_check.verl_v1"
    eng = ce.engine_kwargs.rollout_lifecycle
    assert (eng.ledger_url, eng.run_id) == (url, "exp-7")
    assert eng.artifact_root == str((tmp_path / "art").resolve())
    agent = cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class
    assert agent == "rollout_lifecycle.gpu_check.verl_v1_pacing.LedgerAgentLoopManager"
    assert cfg.actor_rollout_ref.rollout.calculate_log_probs is True
    assert cfg.algorithm.rollout_correction.bypass_mode is True
    assert cfg.trainer.use_v1 is True
    # DAPO switched on in verl's config reaches the buffer, which refuses it
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        dapo = compose(
            config_name="ppo_trainer",
            overrides=[*keys, "algorithm.filter_groups.enable=true"],
        )
    assert dapo.trainer.v1.sampler.sampler_kwargs.filter_groups is True
