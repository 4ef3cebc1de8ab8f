"""Executable model of the rollout lifecycle and policy activation (the ground floor).

The four functions of the small API are importable from here; the records, machines, gate
and ledgers live in their own modules.
"""

if __name__ != "rollout_lifecycle.model":  # one import name, never a second copy
    raise ImportError(
        f"import rollout_lifecycle.model, not {__name__}: this folder is part of the "
        "rollout_lifecycle package"
    )

from rollout_lifecycle.model.api import (
    activate_policy_version,
    assess_policy_compatibility,
    compare_and_reserve,
    transition_lifecycle,
)
from rollout_lifecycle.model.machines import ACTIVATION, LIFECYCLE, MACHINES

__all__ = [
    "ACTIVATION",
    "LIFECYCLE",
    "MACHINES",
    "activate_policy_version",
    "assess_policy_compatibility",
    "compare_and_reserve",
    "transition_lifecycle",
]
