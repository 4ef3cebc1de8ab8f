"""Frozen attrs records, validated at the boundary (CONTRACT section 1).

A rollout carries five kinds of information: identity and task source, behaviour-policy
identity, generation conditions, lifecycle and reward state, and action evidence. Records
refuse wrong types and ranges when built; alignment of the evidence is judged by the
admission gate instead, so a misaligned rollout becomes a rejection with a reason rather than
a crash in the middle of a batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeVar

import attrs

from rollout_lifecycle.model.errors import InvalidRecord
from rollout_lifecycle.model.machines import ACTIVATION, LIFECYCLE

T = TypeVar("T")

# ---- validators ----------------------------------------------------------------------------


INT64_MAX = 2**63 - 1  # every stored integer fits a signed 64-bit column


def _nonneg_int(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRecord(f"{attribute.name} must be a non-negative int, got {value!r}")
    if value > INT64_MAX:
        raise InvalidRecord(f"{attribute.name} must fit in 64 bits (<= 2**63 - 1), got {value}")


def _opt_nonneg_int(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _nonneg_int(inst, attribute, value)


def _nonempty_str(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidRecord(f"{attribute.name} must be a non-empty string, got {value!r}")


def _opt_nonempty_str(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _nonempty_str(inst, attribute, value)


def _finite(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    try:
        ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    except OverflowError:  # an int too large for a float
        ok = False
    if not ok:
        raise InvalidRecord(f"{attribute.name} must be a finite number, got {str(value)[:40]}")


def _opt_finite(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _finite(inst, attribute, value)


def _one_of(*allowed: str) -> Any:
    def check(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in allowed:
            raise InvalidRecord(f"{attribute.name} must be one of {allowed}, got {value!r}")

    return check


# Evidence arrays are long: check element types with one set() over their types (fast
# path), and walk the elements only to name the offending one.


def _int_tuple(value: Any) -> tuple[int, ...]:
    out = tuple(value)
    if not set(map(type, out)) <= {int}:
        for v in out:
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidRecord(f"token ids must be ints, got {v!r}")
    return out


def _bool_tuple(value: Any) -> tuple[bool, ...]:
    out = tuple(value)
    if not set(map(type, out)) <= {bool}:
        for v in out:
            if not isinstance(v, bool):
                raise InvalidRecord(f"action mask entries must be booleans, got {v!r}")
    return out


def _float_tuple(value: Any) -> tuple[float, ...]:
    items = tuple(value)
    if set(map(type, items)) <= {float, int}:
        return tuple(map(float, items))
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise InvalidRecord(f"log-probs must be numbers, got {v!r}")
    return tuple(float(v) for v in items)


# ---- the five kinds of rollout information -------------------------------------------------


@attrs.frozen
class RolloutIdentity:
    """Which sampling run and which task: without it a rollout cannot be deduplicated."""

    rollout_id: str = attrs.field(validator=_nonempty_str)
    prompt_id: str = attrs.field(validator=_nonempty_str)
    dataset: str = attrs.field(validator=_nonempty_str)
    sample_index: int = attrs.field(validator=_nonneg_int)


@attrs.frozen
class BehaviorPolicy:
    """The immutable policy artifact that produced the rollout, stamped at dispatch."""

    version: int = attrs.field(validator=_nonneg_int)
    artifact_hash: str = attrs.field(validator=_nonempty_str)


@attrs.frozen
class GenerationConditions:
    """How the rollout was tokenized and sampled; must match the experiment's conditions."""

    tokenizer_id: str = attrs.field(validator=_nonempty_str)
    temperature: float = attrs.field(validator=_finite)
    top_p: float = attrs.field(validator=_finite)
    top_k: int = attrs.field()
    max_tokens: int = attrs.field(validator=_nonneg_int)
    seed: int | None = attrs.field(default=None)

    @temperature.validator
    def _t(self, _a: attrs.Attribute[Any], v: float) -> None:
        if v < 0:
            raise InvalidRecord(f"temperature must be >= 0, got {v!r}")

    @top_p.validator
    def _p(self, _a: attrs.Attribute[Any], v: float) -> None:
        if not 0 < v <= 1:
            raise InvalidRecord(f"top_p must be in (0, 1], got {v!r}")

    @top_k.validator
    def _k(self, _a: attrs.Attribute[Any], v: int) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or v < -1:
            raise InvalidRecord(f"top_k must be an int >= -1 (-1 or 0: disabled), got {v!r}")

    @seed.validator
    def _s(self, _a: attrs.Attribute[Any], v: int | None) -> None:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise InvalidRecord(f"seed must be an int or null, got {v!r}")


@attrs.frozen
class ActionEvidence:
    """Tokens, action mask and behaviour log-probs; their alignment is judged by the gate."""

    response_token_ids: tuple[int, ...] = attrs.field(converter=_int_tuple)
    action_mask: tuple[bool, ...] = attrs.field(converter=_bool_tuple)
    behavior_log_probs: tuple[float, ...] = attrs.field(converter=_float_tuple)


@attrs.frozen
class Reward:
    """A reward value together with the identity of the function that produced it."""

    function_id: str = attrs.field(validator=_nonempty_str)
    function_version: str = attrs.field(validator=_nonempty_str)
    value: float = attrs.field(validator=_finite)


# Each failure is recorded at its own stage (CONTRACT section 4): a reward timeout, an update
# failure, an artifact that never committed and a weight-distribution failure never share one.
DISPOSITION_STAGES = (
    "generation",
    "reward",
    "update",
    "admission",
    "recovery",
    "activation",
    "artifact",
    "distribution",
)


@attrs.frozen
class Disposition:
    """Why a rollout left the normal path: the stage where it happened and the cause."""

    stage: str = attrs.field(validator=_one_of(*DISPOSITION_STAGES))
    cause: str = attrs.field(validator=_nonempty_str)
    detail: str = ""


@attrs.frozen
class AdmissionStamp:
    """The admission decision a reservation was made on, kept so the spec can re-check it."""

    current_version: int = attrs.field(validator=_nonneg_int)
    behavior_version: int = attrs.field(validator=_nonneg_int)
    max_lag: int = attrs.field(validator=_nonneg_int)
    max_drift: float = attrs.field(validator=_finite)
    drift: float | None = attrs.field(validator=_opt_finite)
    freshness: str | None
    reason: str = attrs.field(validator=_nonempty_str)
    accepted: bool

    @property
    def lag(self) -> int:
        """Δv = v_current - v_behavior."""
        return self.current_version - self.behavior_version


@attrs.frozen
class LedgerEntry:
    """Lifecycle and reward state of one rollout, as a ledger stores it (kind 4 of five).

    `revision` grows by exactly one on every successful write; `reserved_by` is set if and
    only if the state is `reserved`; `releases` counts returned reservations (recovery rule).
    """

    rollout_id: str = attrs.field(validator=_nonempty_str)
    behavior_version: int = attrs.field(validator=_nonneg_int)
    artifact_hash: str = attrs.field(validator=_nonempty_str)
    state: str = attrs.field(default=LIFECYCLE.initial, validator=_one_of(*LIFECYCLE.states))
    revision: int = attrs.field(default=0, validator=_nonneg_int)
    reserved_by: str | None = attrs.field(default=None, validator=_opt_nonempty_str)
    lease_expires_at: float | None = attrs.field(default=None, validator=_opt_finite)
    reward: Reward | None = None
    disposition: Disposition | None = None
    admission: AdmissionStamp | None = None
    releases: int = attrs.field(default=0, validator=_nonneg_int)

    def __attrs_post_init__(self) -> None:
        if (self.reserved_by is not None) != (self.state == "reserved"):
            raise InvalidRecord(
                f"rollout {self.rollout_id!r}: reserved_by must be set exactly when the state "
                f"is 'reserved' (state {self.state!r}, reserved_by {self.reserved_by!r})"
            )


@attrs.frozen
class Rollout:
    """A whole rollout: identity, behaviour policy, conditions, evidence, and its ledger state."""

    identity: RolloutIdentity
    behavior: BehaviorPolicy
    conditions: GenerationConditions
    evidence: ActionEvidence | None = None
    status: LedgerEntry | None = None

    def __attrs_post_init__(self) -> None:
        st = self.status
        if st is not None and (
            st.rollout_id != self.identity.rollout_id
            or st.behavior_version != self.behavior.version
            or st.artifact_hash != self.behavior.artifact_hash
        ):
            raise InvalidRecord(
                f"rollout {self.identity.rollout_id!r}: status belongs to "
                f"{st.rollout_id!r} v{st.behavior_version}; identity and behaviour must agree"
            )

    @property
    def rollout_id(self) -> str:
        """Shortcut to the identity's id."""
        return self.identity.rollout_id

    def entry(self) -> LedgerEntry:
        """The ledger entry for this rollout: its status, or a fresh one at dispatch."""
        if self.status is not None:
            return self.status
        return LedgerEntry(
            rollout_id=self.identity.rollout_id,
            behavior_version=self.behavior.version,
            artifact_hash=self.behavior.artifact_hash,
        )


# ---- policy activation ---------------------------------------------------------------------


@attrs.frozen
class ActivePointer:
    """Which artifact generators must use now; switched atomically by the coordinator."""

    version: int = attrs.field(validator=_nonneg_int)
    artifact_hash: str = attrs.field(validator=_nonempty_str)


@attrs.frozen
class ArtifactRecord:
    """A policy artifact in the registry; `state` is its activation machine state."""

    version: int = attrs.field(validator=_nonneg_int)
    artifact_hash: str | None = attrs.field(validator=_opt_nonempty_str)
    parent_version: int | None = attrs.field(default=None, validator=_opt_nonneg_int)
    rollback_version: int | None = attrs.field(default=None, validator=_opt_nonneg_int)
    state: str = attrs.field(default=ACTIVATION.initial, validator=_one_of(*ACTIVATION.states))
    path: str | None = None
    failure: Disposition | None = None
    attempts: int = attrs.field(default=0, validator=_nonneg_int)

    @property
    def committed(self) -> bool:
        """Whether the artifact's files and hash are final (it left `prepared` successfully)."""
        return self.artifact_hash is not None and self.state not in ("prepared", "commit_failed")


@attrs.frozen
class WorkerAck:
    """What a worker reports it actually loaded, for which distribution attempt.

    (incarnation, seq) orders a worker's reports, so a delayed ack from before a restart can
    never count. `attempt` echoes the distribution attempt the worker answered (1 for the
    first): after a failed attempt, a delayed ack of the earlier attempt no longer proves
    what the worker holds now (it may have loaded another version since), so only acks of
    the current attempt count toward activation. A worker may leave `seq` and `attempt`
    unset: the coordinator numbers them on receipt (arrival order, current attempt).
    """

    worker_id: str = attrs.field(validator=_nonempty_str)
    version: int = attrs.field(validator=_nonneg_int)
    artifact_hash: str = attrs.field(validator=_nonempty_str)
    incarnation: int = attrs.field(default=0, validator=_nonneg_int)
    # left None by a worker, numbered by the coordinator when it records the ack
    seq: int | None = attrs.field(default=None, validator=_opt_nonneg_int)
    attempt: int | None = attrs.field(default=None, validator=_opt_nonneg_int)


# ---- (de)serialisation ---------------------------------------------------------------------


_SCALARS = (str, int, float, bool, type(None))


def to_jsonable(obj: Any) -> Any:
    """attrs record -> plain JSON-able dict/list/scalars (tuples become lists)."""
    if isinstance(obj, _SCALARS):  # most values: skip the attrs lookup (hot in SQLite writes)
        return obj
    if attrs.has(type(obj)):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in attrs.fields(type(obj))}
    if isinstance(obj, tuple | list):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    return obj


def _nested_types() -> dict[type[Any], dict[str, type[Any]]]:
    return {
        LedgerEntry: {"reward": Reward, "disposition": Disposition, "admission": AdmissionStamp},
        Rollout: {
            "identity": RolloutIdentity,
            "behavior": BehaviorPolicy,
            "conditions": GenerationConditions,
            "evidence": ActionEvidence,
            "status": LedgerEntry,
        },
        ArtifactRecord: {"failure": Disposition},
    }


_NESTED = _nested_types()  # built once: from_jsonable runs per stored record


_FIELDS: dict[type[Any], frozenset[str]] = {}


def _field_names(cls: type[Any]) -> frozenset[str]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = frozenset(f.name for f in attrs.fields(cls))
    return names


def from_jsonable(cls: type[T], data: Any) -> T:
    """Plain dict -> attrs record, with nested records rebuilt; bad shapes raise InvalidRecord."""
    if not isinstance(data, Mapping):
        raise InvalidRecord(f"{cls.__name__} must be a JSON object, got {type(data).__name__}")
    names = _field_names(cls)
    unknown = data.keys() - names
    if unknown:
        raise InvalidRecord(f"{cls.__name__}: unknown field(s) {sorted(unknown)}")
    nested = _NESTED.get(cls, {})
    kwargs: dict[str, Any] = {}
    for k, v in data.items():
        sub = nested.get(k)
        kwargs[k] = from_jsonable(sub, v) if sub is not None and v is not None else v
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise InvalidRecord(f"{cls.__name__}: {exc}") from None
