"""rollout-lifecycle: stale- and duplicate-safe rollout lifecycle for online RL post-training.

One import name for the whole distribution. The floors live in sub-packages:
`rollout_lifecycle.model` (records, machines, gate, ledgers, coordinator: the ground floor),
`rollout_lifecycle.spec` (invariants, explorer), `rollout_lifecycle.stateful_tests`
(Hypothesis machines, campaign runner), `rollout_lifecycle.gpu_check` (the real-run check)
and `rollout_lifecycle.cli` (the command line). The small API of CONTRACT section 5 is
`rollout_lifecycle.model`'s four functions, re-exported here.
"""

from __future__ import annotations

from importlib import metadata as _metadata

from rollout_lifecycle.model import (
    activate_policy_version,
    assess_policy_compatibility,
    compare_and_reserve,
    transition_lifecycle,
)

try:
    __version__ = _metadata.version("rollout-lifecycle")
except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "__version__",
    "activate_policy_version",
    "assess_policy_compatibility",
    "compare_and_reserve",
    "transition_lifecycle",
]
