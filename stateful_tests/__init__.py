"""Hypothesis rule-based state machines that race reservers and worker acks against spec/."""

if __name__ != "rollout_lifecycle.stateful_tests":  # one import name, never a second copy
    raise ImportError(
        f"import rollout_lifecycle.stateful_tests, not {__name__}: this folder is part of the "
        "rollout_lifecycle package"
    )
