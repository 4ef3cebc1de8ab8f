"""Campaign profiles: how much each stage of `rollout-lifecycle campaign` runs.

* `fast` (the default, `make campaign`): a verdict in about five minutes on 2 cores. Every
  checker self-test, the verl adapter (when the [verl] extra is installed), every machine
  fuzzed to every declared edge and sometimes-property, the explorer over every model
  family at bounds that finish in about a minute, and the race. Its fuzz budget is read off
  `first_reached.json` (the example at which the thorough campaign first reached each goal,
  and which machine reached it), plus a margin: see `fast_examples`.
* `thorough`: the budget the README's first figures were measured at (200 examples per
  machine, the explorer at its README bounds: about 20 minutes on 2 idle cores).
* `ci`: the fast budget, plus the thorough profile's targeted stages, and strict: a stage
  that cannot run (its extra is not installed) stops the campaign as a technical failure
  (exit 3) instead of being skipped. `.ci/run` runs it after the test suite.

Every profile runs the scripted interleavings (seconds) before the race on a durable
backend. The targeted stages of stateful_tests/stages.py each name the profiles they belong
in (`default` is the default profile, `fast`): `clock-skew` and `premise-window` (seconds,
PostgreSQL only) in every profile; `verl-v1` (30-60 s of Ray and TransferQueue start-up)
in `thorough` and `ci`, too slow for the five-minute verdict.

Every profile fuzzes with the same Hypothesis settings (`dev`, with 50 steps per example,
Hypothesis's own default) and the same seed, whatever the environment (with `CI` set
Hypothesis would otherwise load its own `ci` profile), so a profile's counts are the same on
a laptop and in CI. 50, not `dev`'s 40: at 40 steps the activation machine never delivered
a garbled copy of an ack after its original within 243 examples, and the
`conflicting_ack_counted` mutant survived the campaign (measured on seed 20261130); at 50 it
dies at the third example.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from importlib import resources
from typing import Any

import attrs

from rollout_lifecycle.spec.bounds import README_MODELS
from rollout_lifecycle.stateful_tests.runner import MACHINES as FUZZ_MACHINES
from rollout_lifecycle.stateful_tests.runner import (
    README_EXAMPLES,
    README_RACE_SECONDS,
    README_SEED,
)
from rollout_lifecycle.stateful_tests.stages import STAGES as TARGETED

# the stages, in the order the campaign runs them (then the profile's targeted stages)
CAMPAIGN_STAGES = ("checkers", "adapter", "fuzz", "explore", "interleavings", "race")
SEED = README_SEED
HYPOTHESIS_PROFILE = "dev"
STEPS = 50  # per example (see the module docstring for why not dev's 40)
THOROUGH_EXAMPLES = README_EXAMPLES
RACE_SECONDS = README_RACE_SECONDS
ADAPTER_EXAMPLES = README_EXAMPLES
# the fast budget: the example at which a goal was first reached, plus this share, rounded up
# to a multiple of 5; never fewer than FAST_FLOOR examples on a machine, never more than the
# thorough budget (the fixed seed makes "first reached at example n" repeatable, the margin
# keeps it reached when a machine's rules change a little)
FAST_MARGIN = 0.25
FAST_FLOOR = 30
# one model of each family at bounds that finish in about a minute together (2 idle cores)
FAST_MODELS = (
    "lifecycle-small",
    "ledger-small",
    "activation-small",
    "activation-2v",
    "seams",
    "pacing",
)

# reference seconds of each stage and of each explorer model, measured on the 2-core
# development machine at load below 2 (the ETA scales them by how fast this run goes)
REFERENCE_S: dict[str, float] = {
    "checkers": 1.0,
    "adapter": 0.5,  # verl and torch are imported before the stage (to know it can run)
    "interleavings": 1.0,
    "race": RACE_SECONDS + 8.0,
    "verl-v1": 45.0,
    "clock-skew": 12.0,
    "premise-window": 3.0,
}
FUZZ_S_PER_EXAMPLE: dict[str, float] = {  # at 50 steps per example
    "ledger": 0.05,
    "activation": 0.075,
    "e2e": 0.12,
    "seams": 0.14,
    "artifacts": 0.09,
}
MODEL_S: dict[str, float] = {
    "lifecycle-small": 0.3,
    "ledger-small": 2.6,
    "activation-small": 20.3,
    "activation-2v": 1.1,
    "seams": 28.8,
    "pacing": 1.9,
    "lifecycle": 43.8,
    "ledger": 150.0,
    "activation": 300.0,
}

# distinct states of each model when explored whole (the explore stage's fraction done;
# tests/test_campaign.py holds them to the explorer's pinned counts)
MODEL_STATES: dict[str, int] = {
    "lifecycle-small": 671,
    "ledger-small": 3_340,
    "activation-small": 53_327,
    "activation-2v": 3_195,
    "seams": 33_404,
    "pacing": 2_513,
    "lifecycle": 57_597,
    "ledger": 79_455,
    "activation": 682_398,
}


@attrs.frozen
class CampaignProfile:
    """One campaign budget: fuzz examples per machine, explorer models, race seconds."""

    name: str
    about: str
    # examples per machine: with `cut`, each machine's batch ends after this many examples
    # (machine instances, as first_reached.json counts them)...
    examples: dict[str, int]
    models: tuple[str, ...]
    race_seconds: float = RACE_SECONDS
    adapter_examples: int = ADAPTER_EXAMPLES
    # ...of a Hypothesis run with this max_examples (the thorough budget's, whatever the
    # profile): Hypothesis generates another sequence under another max_examples, so the
    # fast profile stops the thorough sequence early instead, and "first reached at
    # example n" in first_reached.json holds for both
    max_examples: int = THOROUGH_EXAMPLES
    # False: Hypothesis's max_examples alone ends the batch (it also builds instances it
    # discards, so a machine makes a few more instances than `examples`): the thorough run
    cut: bool = True
    seed: int = SEED
    hypothesis: str = HYPOTHESIS_PROFILE
    steps: int = STEPS
    # a stage that cannot run is a technical failure (exit 3), not a skip
    strict: bool = False
    # the targeted stages of stateful_tests/stages.py this profile runs (where they apply)
    stages: tuple[str, ...] = ()

    def expected_s(self, stage: str, models: tuple[str, ...] | None = None) -> float:
        """Reference seconds of `stage` under this profile (the ETA's starting point)."""
        if stage == "fuzz":
            return sum(FUZZ_S_PER_EXAMPLE[m] * n for m, n in self.examples.items())
        if stage == "explore":
            return sum(MODEL_S.get(m, 10.0) for m in (models or self.models))
        return REFERENCE_S.get(stage, 1.0)

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (recorded in the campaign report)."""
        return {
            "name": self.name,
            "about": self.about,
            "examples": dict(self.examples),
            "models": list(self.models),
            "race_seconds": self.race_seconds,
            "adapter_examples": self.adapter_examples,
            "max_examples": self.max_examples,
            "cut": self.cut,
            "seed": self.seed,
            "hypothesis": self.hypothesis,
            "steps": self.steps,
            "strict": self.strict,
            "stages": list(self.stages),
        }


def load_first_reached() -> dict[str, Any]:
    """The thorough campaign's record of when each goal was first reached, and by whom."""
    text = (
        resources.files("rollout_lifecycle.stateful_tests")
        .joinpath("first_reached.json")
        .read_text(encoding="utf-8")
    )
    data: dict[str, Any] = json.loads(text)
    return data


def fast_examples(
    first_reached: dict[str, list[Any]],
    *,
    margin: float = FAST_MARGIN,
    floor: int = FAST_FLOOR,
    cap: int | Mapping[str, int] = THOROUGH_EXAMPLES,
) -> dict[str, int]:
    """Examples per machine that reach every goal the thorough run reached, with a margin.

    Each goal is charged to the machine that reached it first (`first_reached`: goal ->
    [machine, example]); a machine gets the latest example charged to it times (1 +
    margin), rounded up to a multiple of 5, at least `floor` and at most `cap` (per machine:
    the machine instances the thorough run made, recorded in first_reached.json as
    `instances`: Hypothesis builds more instances than its max_examples, since it discards
    some, and a goal first reached past the 200th is still reached by cutting there)."""
    latest = dict.fromkeys(FUZZ_MACHINES, 0)
    for machine, n in first_reached.values():
        latest[machine] = max(latest[machine], int(n))
    out = {}
    for machine, n in latest.items():
        want = 5 * math.ceil(n * (1 + margin) / 5)
        most = cap if isinstance(cap, int) else cap.get(machine, THOROUGH_EXAMPLES)
        out[machine] = min(most, max(floor, want))
    return out


def fast_budget(ref: Mapping[str, Any]) -> dict[str, int]:
    """The fast profile's examples per machine, read off a first_reached.json record."""
    return fast_examples(ref["first_reached"], cap=ref.get("instances") or THOROUGH_EXAMPLES)


DEFAULT_PROFILE = "fast"


def targeted_stages(profile: str) -> tuple[str, ...]:
    """The targeted stages (stateful_tests/stages.py) that name `profile` among theirs, in
    the registry's order; `default` in a stage's list names the default profile."""
    names = {profile, "default"} if profile == DEFAULT_PROFILE else {profile}
    return tuple(n for n, s in TARGETED.items() if names & set(s.profiles))


def _profiles() -> dict[str, CampaignProfile]:
    fast = CampaignProfile(
        name="fast",
        about="the five-minute verdict: the fuzz budget that reaches every goal (from "
        "first_reached.json, plus 25%), the explorer over every model family at small "
        "bounds, a 20 s race",
        examples=fast_budget(load_first_reached()),
        models=FAST_MODELS,
        stages=targeted_stages("fast"),
    )
    thorough = CampaignProfile(
        name="thorough",
        about="the README's first budget: 200 examples per machine, the explorer at its "
        "README bounds, a 20 s race, every targeted stage (about 20 minutes on 2 idle cores)",
        examples=dict.fromkeys(FUZZ_MACHINES, THOROUGH_EXAMPLES),
        cut=False,
        models=README_MODELS,
        stages=targeted_stages("thorough"),
    )
    ci = attrs.evolve(
        fast,
        name="ci",
        about="the fast budget plus every targeted stage; every stage must run (a missing "
        "extra is exit 3, not a skip)",
        strict=True,
        stages=targeted_stages("ci"),
    )
    return {p.name: p for p in (fast, thorough, ci)}


PROFILES: dict[str, CampaignProfile] = _profiles()


__all__ = [
    "CAMPAIGN_STAGES",
    "DEFAULT_PROFILE",
    "FAST_MODELS",
    "FUZZ_S_PER_EXAMPLE",
    "MODEL_S",
    "MODEL_STATES",
    "PROFILES",
    "CampaignProfile",
    "fast_budget",
    "fast_examples",
    "load_first_reached",
    "targeted_stages",
]
