"""The specification: named invariants over ledger/registry snapshots and event traces, and the
exhaustive explorer that checks them. Reads model/, never the other way round."""

if __name__ != "rollout_lifecycle.spec":  # one import name, never a second copy
    raise ImportError(
        f"import rollout_lifecycle.spec, not {__name__}: this folder is part of the "
        "rollout_lifecycle package"
    )
