"""The protocol's per-record and per-step rules, written once: enforced, then checked.

Every ledger and registry write path calls these predicates on the records it is about to
write and refuses the write with a typed error (or a refusal reason) before anything lands;
spec/invariants.py wraps the very same functions as named invariants for the checkers
(stateful tests, explorer, trace replay, `ledger check`). They live on the ground floor
because the write paths must not import spec/; spec/ imports them, never retypes them.

Which states need a reward, an admission stamp or a failure stage is read off the declared
machines' rule tags (model/machines.py), never listed here.
"""

from __future__ import annotations

import math

from rollout_lifecycle.model.errors import brief
from rollout_lifecycle.model.machines import ACTIVATION, LIFECYCLE
from rollout_lifecycle.model.records import AdmissionStamp, ArtifactRecord, LedgerEntry

# ---- state classes, read off the machines' tags -------------------------------------------

START_STATES = frozenset(LIFECYCLE.states_tagged("start"))
REWARD_STATES = frozenset(LIFECYCLE.states_tagged("carries_reward"))
ADMITTED_STATES = frozenset(LIFECYCLE.states_tagged("admitted"))
REWARD_FAILURE_STATES = frozenset(LIFECYCLE.states_tagged("reward_failure"))
OPEN_STATES = frozenset(s for s in LIFECYCLE.states if s not in LIFECYCLE.terminal)
WAS_ACTIVE_STATES = frozenset(ACTIVATION.states_tagged("was_active"))
UNRESOLVED_STATES = frozenset(ACTIVATION.states_tagged("unresolved"))
FAILED_ACTIVATION_STATES = frozenset(ACTIVATION.states_tagged("failure"))

# refusal reasons of a reservation whose premise does not hold at the moment of the write
NOT_ADMITTED = "not_admitted"
POINTER_MOVED = "pointer_moved"
VERSION_NOT_ACTIVE = "version_not_active"


# ---- one ledger entry --------------------------------------------------------------------


def ownership_problems(e: LedgerEntry) -> list[str]:
    """reserved_by is set if and only if the state is reserved."""
    if (e.reserved_by is not None) != (e.state == "reserved"):
        return [f"{e.rollout_id}: state {brief(e.state)} with reserved_by {brief(e.reserved_by)}"]
    return []


def reward_problems(e: LedgerEntry) -> list[str]:
    """A reward failure carries no reward value; what can be trained carries a real one."""
    out = []
    if e.state in REWARD_FAILURE_STATES and e.reward is not None:
        out.append(f"{e.rollout_id}: {e.state} carries reward value {e.reward.value}")
    if e.state in REWARD_STATES and e.reward is None:
        out.append(f"{e.rollout_id}: {e.state} without a reward value")
    if e.state in ADMITTED_STATES and e.disposition is not None:
        out.append(f"{e.rollout_id}: {e.state} yet marked failed ({e.disposition.cause})")
    return out


def stamp_problems(a: AdmissionStamp, behavior_version: int) -> list[str]:
    """What is wrong with an admission stamp that is offered as a pass (empty: it passes).

    The stamp must be self-consistent: accepted with reason 'ok', for this rollout's
    behaviour version, 0 <= lag <= L_max and a finite drift <= D_max. A stamp that says
    accepted while its own figures say stale or drifted is refused, not trusted.
    """
    problems = []
    if not a.accepted or a.reason != "ok":
        problems.append(f"decision {brief(a.reason)} (accepted={a.accepted})")
    if a.behavior_version != behavior_version:
        problems.append(f"admitted for v{a.behavior_version}, stamped v{behavior_version}")
    if not 0 <= a.lag <= a.max_lag:
        problems.append(f"lag {a.lag} outside [0, {a.max_lag}]")
    if a.drift is None or not math.isfinite(a.drift) or a.drift > a.max_drift:
        problems.append(f"drift {a.drift} over {a.max_drift}")
    return problems


def admission_problems(e: LedgerEntry) -> list[str]:
    """Every reserved or consumed rollout carries a stamp that passed admission."""
    if e.state not in ADMITTED_STATES:
        return []
    if e.admission is None:
        return [f"{e.rollout_id}: {e.state} with no admission record"]
    problems = stamp_problems(e.admission, e.behavior_version)
    return [f"{e.rollout_id}: {e.state} but " + "; ".join(problems)] if problems else []


def stage_problems(e: LedgerEntry) -> list[str]:
    """A failure state records its cause at one of the stages its state allows."""
    want = LIFECYCLE.stages(e.state)
    if not want:
        return []
    if e.disposition is None:
        return [f"{e.rollout_id}: {e.state} with no recorded stage/cause"]
    if e.disposition.stage not in want:
        return [f"{e.rollout_id}: {e.state} recorded at stage {brief(e.disposition.stage)}"]
    return []


def entry_problems(e: LedgerEntry) -> list[str]:
    """Every per-record rule on one entry: what a write path refuses to store."""
    return [*ownership_problems(e), *reward_problems(e), *admission_problems(e), *stage_problems(e)]


def artifact_stage_problems(a: ArtifactRecord) -> list[str]:
    """A failed activation records its cause at one of the stages its state allows."""
    want = ACTIVATION.stages(a.state)
    if not want:
        return []
    if a.failure is None:
        return [f"artifact v{a.version}: {a.state} with no recorded stage/cause"]
    if a.failure.stage not in want:
        return [f"artifact v{a.version}: {a.state} recorded at stage {brief(a.failure.stage)}"]
    return []


# ---- one reservation step ------------------------------------------------------------------


def reservation_refusal(
    stamp: AdmissionStamp | None,
    behavior_version: int,
    pointer_version: int | None,
    was_active: bool | None,
) -> tuple[str, str] | None:
    """Why a reservation may not land NOW, or None: (reason, detail).

    Judged inside the reservation's own atomic step, with the active pointer and the
    behaviour version's activation history read in that same step (`pointer_version` None
    and `was_active` None mean "no registry attached": only the stamp itself is judged).
    The lag bound is re-evaluated against the pointer of that moment, so a pointer that
    moved after admission cannot carry a rollout past its bound; the caller re-admits.
    """
    if stamp is None:
        return NOT_ADMITTED, "no admission stamp"
    problems = stamp_problems(stamp, behavior_version)
    if problems:
        return NOT_ADMITTED, "; ".join(problems)
    if was_active is False:
        return VERSION_NOT_ACTIVE, f"v{behavior_version} never became the active version"
    if was_active is not None and pointer_version is None:
        return VERSION_NOT_ACTIVE, "no version is active"
    if pointer_version is not None:
        lag = pointer_version - behavior_version
        if not 0 <= lag <= stamp.max_lag:
            return (
                POINTER_MOVED,
                f"admitted against v{stamp.current_version}, the active version is now "
                f"v{pointer_version}: lag {lag} outside [0, {stamp.max_lag}]; re-admit",
            )
    return None
