"""Executable model of the rollout lifecycle and policy activation (the ground floor).

The four functions of the small API are importable from here; the records, machines, gate
and ledgers live in their own modules.
"""

from model.api import (
    activate_policy_version,
    assess_policy_compatibility,
    compare_and_reserve,
    transition_lifecycle,
)
from model.machines import ACTIVATION, LIFECYCLE, MACHINES

__all__ = [
    "ACTIVATION",
    "LIFECYCLE",
    "MACHINES",
    "activate_policy_version",
    "assess_policy_compatibility",
    "compare_and_reserve",
    "transition_lifecycle",
]
