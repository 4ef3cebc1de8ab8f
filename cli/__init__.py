"""The `rollout-lifecycle` command line (top floor: nothing imports it)."""

if __name__ != "rollout_lifecycle.cli":  # one import name, never a second copy
    raise ImportError(
        f"import rollout_lifecycle.cli, not {__name__}: this folder is part of the "
        "rollout_lifecycle package"
    )
