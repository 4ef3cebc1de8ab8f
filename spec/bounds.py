"""Named explorer configurations: which model, with which bounds, and why those bounds.

The CLI's `explore`, the README campaign and the mutation runner all pick models from here,
so "the explorer at its README bounds" means one thing everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout_lifecycle.model.records import AdmissionPolicy
from rollout_lifecycle.spec.activation_model import ActivationModel
from rollout_lifecycle.spec.ledger_model import LedgerRaceModel
from rollout_lifecycle.spec.seams_model import SeamsModel

ModelFactory = Callable[[], Any]

EXPLORER_MODELS: dict[str, tuple[ModelFactory, str]] = {
    "ledger": (
        lambda: LedgerRaceModel(
            n_rollouts=3, n_learners=2, start="rewarded", allow_failures=False, max_updates=1
        ),
        "3 rollouts, 2 racing learners (read / compare-and-set split), crashes, lease expiry",
    ),
    "lifecycle": (
        lambda: LedgerRaceModel(
            n_rollouts=2, n_learners=2, start="dispatched", max_updates=1, allow_renew=True
        ),
        "2 rollouts from dispatch, 2 learners, every failure path, a heartbeat: all "
        "lifecycle edges",
    ),
    "lifecycle-small": (
        lambda: LedgerRaceModel(
            n_rollouts=1, n_learners=2, start="dispatched", max_updates=1, allow_renew=True
        ),
        "1 rollout from dispatch, 2 learners racing for it, every failure path, a heartbeat: "
        "all lifecycle edges in a second (the fast campaign's)",
    ),
    "activation": (
        lambda: ActivationModel(n_workers=3, n_versions=1, max_in_flight=2),
        "3 workers, 1 new version, one crash, one corrupt load, one duplicate, 2 acks in flight",
    ),
    "activation-2v": (
        lambda: ActivationModel(
            n_workers=2,
            n_versions=2,
            max_crashes=0,
            max_corrupt=0,
            max_duplicates=0,
            max_in_flight=2,
            max_rollouts=0,
            max_attempts=1,
        ),
        "2 workers, 2 new versions (ordering between versions), no faults, no retries",
    ),
    "seams": (
        lambda: SeamsModel(
            learners=2,
            second_coordinator=True,
            max_versions=2,
            max_rollouts=1,
            lies=1,
            bad_adds=1,
            rollbacks=1,
        ),
        "the README's composition: an activator publishing v1, v2 while 2 learners admit, "
        "reserve and commit; a second coordinator on the same registry (asks for a partial "
        "worker set, distributes its oldest version); a lying stamp, a reward-less rollout, "
        "and an operator rollback (retiring or keeping) between admission and reservation",
    ),
    "ledger-small": (
        lambda: LedgerRaceModel(
            n_rollouts=2, n_learners=2, start="rewarded", allow_failures=False, max_updates=1
        ),
        "2 rollouts, 2 learners: the quick race used in CI",
    ),
    "pacing": (
        lambda: LedgerRaceModel(
            n_rollouts=1,
            n_learners=1,
            start="rewarded",
            max_updates=1,
            allow_crash=False,
            pacing=AdmissionPolicy(0, 0.2, batch_size=1, max_attempts=2),
            dispatches=3,
            chains=1,
        ),
        "paced dispatch on a ledger with v0 active: a budget of one live rollout, one prompt "
        "chain of at most 2 attempts (failed or retired ones are requeued), a learner",
    ),
    "activation-small": (
        lambda: ActivationModel(n_workers=2, n_versions=1, max_in_flight=2, max_duplicates=0),
        "2 workers, 1 new version, one crash, one corrupt load: quick, used in CI",
    ),
}

README_MODELS = ("lifecycle", "ledger", "activation", "activation-2v", "seams")

# CI-sized stand-ins for each model name a mutant may name (tests and `mutants` use these)
CI_MODELS: dict[str, str] = {
    "ledger": "lifecycle",
    "lifecycle": "lifecycle",
    "activation": "activation-small",
    "activation-2v": "activation-2v",
    "seams": "seams",
    "pacing": "pacing",
}
