"""Admit and reserve from evidence: the learner's one call across the trust boundary.

A ledger cannot re-check a drift figure it is told, so the safe path never lets the caller
state one. `admit_and_reserve` reads the deployment's recorded admission policy and active
pointer from the registry (never from the caller's configuration), computes lag and drift
itself from the rollouts' stored behaviour log-probs and the learner's current log-probs,
and reserves what passed; the reservation's own atomic step then judges each stamp again
against the policy and pointer of that moment (a pointer that moved meanwhile refuses
with 'pointer_moved': call again, the rollouts are re-admitted).

What a bare `AdmissionStamp` passed to `reserve` is still trusted for: the drift figure
(the ledger never sees the log-probs) and that the stamp describes this rollout's evidence.
Everything else in it is checked against durable state inside the write: its bounds
against the recorded policy, its lag against the pointer, its versions against the
activation history, its figures against each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from rollout_lifecycle.model import rules
from rollout_lifecycle.model.errors import GateConfigError
from rollout_lifecycle.model.gate import AdmissionDecision, AdmissionGate, GatePolicy
from rollout_lifecycle.model.ledger import Ledger, ReserveOutcome, ReserveRequest, check_update_id
from rollout_lifecycle.model.records import GenerationConditions, Rollout
from rollout_lifecycle.model.registry import RegistryStore, activated_hash, backend_url


@attrs.frozen
class Admitted:
    """What one `admit_and_reserve` call decided and reserved.

    `decisions` has one entry per rollout, in order; `outcomes` one per accepted rollout;
    `reserved` the ids the update now holds (train on these, then commit exactly them).
    """

    current_version: int
    decisions: tuple[AdmissionDecision, ...]
    outcomes: tuple[ReserveOutcome, ...]

    @property
    def reserved(self) -> list[str]:
        """Ids reserved by this update (new reservations and idempotent retries)."""
        return [o.rollout_id for o in self.outcomes if o.reserved]

    @property
    def refused(self) -> dict[str, str]:
        """Rollout id -> why it is not reserved (the gate's or the ledger's reason)."""
        out = {d.rollout_id: d.reason for d in self.decisions if not d.accepted}
        out.update({o.rollout_id: o.reason for o in self.outcomes if not o.reserved})
        return out


def admit_and_reserve(
    ledger: Ledger,
    registry: RegistryStore,
    update_id: str,
    rollouts: Sequence[Rollout],
    current_log_probs: Any,
    *,
    conditions: GenerationConditions | None = None,
) -> Admitted:
    """Gate `rollouts` from their evidence against the deployment's recorded policy and the
    active version, then reserve the admitted ones for `update_id` in one batch.

    `current_log_probs` is B x T (numpy or torch), the learner's log-probs of each
    rollout's response tokens, right-padded. `conditions` (optional) are the experiment's
    generation conditions a rollout must match. Raises GateConfigError when the deployment
    records no admission policy or no version is active.
    """
    check_update_id(update_id)
    # the policy, the pointer and the rows from ONE consistent view, so each decision is
    # true at one instant (issue 33); the reservation step judges them again at its own
    ids = [ro.rollout_id for ro in rollouts]
    premise, rows = ledger.premise_and_rows(ids)
    if premise.was_active is None:  # a ledger that does not share the registry's state
        policy, pointer = registry.policy(), registry.pointer()
        current = None if pointer is None else pointer.version
        ever: frozenset[int] | None = None
    else:
        policy, current, ever = premise.policy, premise.pointer_version, premise.was_active
    if policy is None:
        raise GateConfigError(rules.no_policy_detail(backend_url(registry)))
    if current is None:
        raise GateConfigError("no policy version is active yet: nothing can be admitted")

    def hash_of(v: int) -> str | None:
        # a version active by the view's instant keeps its hash for good: reading it now
        # answers for that instant; one activated later was not active then
        return None if ever is not None and v not in ever else activated_hash(registry, v)

    gate = AdmissionGate(GatePolicy(policy.max_lag, policy.max_drift, conditions), registry=hash_of)
    entries = [rows.get(i) for i in ids]
    decisions = gate.assess_batch(rollouts, current_log_probs, current, entries)
    requests = [
        ReserveRequest(d.rollout_id, e.revision, d.stamp())
        for d, e in zip(decisions, entries, strict=True)
        if d.accepted and e is not None
    ]
    outcomes = ledger.reserve_batch(update_id, requests) if requests else []
    return Admitted(current, tuple(decisions), tuple(outcomes))
