"""The `rollout-lifecycle` command line (top floor: nothing imports it)."""
