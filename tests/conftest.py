"""Test-session setup: Hypothesis profile selection (CI keeps the deterministic `ci` one)."""

from rollout_lifecycle.stateful_tests.profiles import load_selected_profile

load_selected_profile()
