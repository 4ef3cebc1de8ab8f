"""Hydra config group for verl's v1 trainer on the ledger (`+rollout_lifecycle=ledger`).

    python -m verl.trainer.main_ppo \\
        'hydra.searchpath=[pkg://rollout_lifecycle.gpu_check.verl_config]' \\
        +rollout_lifecycle=ledger rollout_lifecycle.ledger_url=... \\
        rollout_lifecycle.run_id=... rollout_lifecycle.artifact_root=...

`rollout-lifecycle verl setup` records the admission policy on the run's ledger and prints
these overrides (docs/verl-v1.md).
"""

GROUP = "rollout_lifecycle"
OPTION = "ledger"
SEARCHPATH = "pkg://rollout_lifecycle.gpu_check.verl_config"
