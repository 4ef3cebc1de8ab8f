"""The negative controls: three ways a weight sync can lie, each a flag of `gpu-check run`.

Each control breaks the generation side's handling of the UPDATE's sync (version 1) only,
so everything before it (sampling, admission, the update itself) runs as in a clean run,
and each must fail exactly the checks named here, in both groups, and nothing else. The
tests run every control and compare the failed checks with these sets; a control whose
failures differ from its declaration is reported as not behaving as expected.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Control:
    """One negative control: its flag, what it breaks, and the checks it must fail."""

    name: str
    fault: str  # the generation side's Fault value (gpu_check.rollout.Fault)
    breaks: str
    expected_failures: frozenset[str]


CONTROLS: dict[str, Control] = {
    c.name: c
    for c in (
        Control(
            "stale-generation-copy",
            "stale_copy",
            "the v1 tensors reach the generation side but are never written into its copy; "
            "it announces v1 and honestly acks the hash of what it holds (v0's weights)",
            frozenset(
                {
                    "activation_flipped_pointer",
                    "generation_holds_artifact",
                    "version_matches_weights",
                }
            ),
        ),
        Control(
            "version-before-load",
            "version_before_load",
            "the generation side announces v1 first and loads the v1 tensors afterwards "
            "(samples stamped v1 in between came from v0's weights)",
            frozenset({"version_matches_weights"}),
        ),
        Control(
            "ack-registered-hash",
            "ack_registered_hash",
            "one v1 tensor is lost in transfer (the error is swallowed) and the generation "
            "side acks the hash the registry holds instead of hashing what it received",
            frozenset({"ack_matches_held", "generation_holds_artifact", "version_matches_weights"}),
        ),
    )
}

GROUPS = ("release_resume", "resident")


def expected_failed_checks(control: str | None) -> set[str]:
    """Group-qualified names of the checks a run with `control` must fail (none without)."""
    if control is None:
        return set()
    return {f"{g}/{name}" for g in GROUPS for name in CONTROLS[control].expected_failures}
