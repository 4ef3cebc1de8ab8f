"""Hypothesis settings profiles: the built-in deterministic "ci" one, and real fuzzing.

With CI set, Hypothesis loads its own "ci" profile (derandomized, no database); we keep it.
`fuzz` is for bug hunting: many examples, long programs, random seeds, and an example
database so a failure found once is replayed first next time. Select it with
ROLLOUT_LIFECYCLE_PROFILE=fuzz or the CLI's `fuzz --profile fuzz`.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

PROFILE_ENV = "ROLLOUT_LIFECYCLE_PROFILE"
DEFAULT_DB = ".hypothesis/rollout-lifecycle"


def register_profiles(database_dir: str = DEFAULT_DB) -> None:
    """Register `dev` (quick local runs) and `fuzz` (long campaigns) next to the built-in `ci`."""
    settings.register_profile(
        "dev",
        max_examples=60,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.register_profile(
        "fuzz",
        max_examples=2_000,
        stateful_step_count=120,
        deadline=None,
        derandomize=False,
        database=DirectoryBasedExampleDatabase(database_dir),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


def selected_profile_name() -> str:
    """The profile the environment asks for: $ROLLOUT_LIFECYCLE_PROFILE, else ci under CI,
    else dev (the one rule the test session and the CLI share)."""
    return os.environ.get(PROFILE_ENV) or ("ci" if os.environ.get("CI") else "dev")


def load_selected_profile() -> str:
    """Load the profile named by the environment; CI keeps Hypothesis's own `ci` profile."""
    register_profiles()
    name = selected_profile_name()
    if not (name == "ci" and os.environ.get("CI")):  # Hypothesis already loaded it then
        settings.load_profile(name)
    return name
