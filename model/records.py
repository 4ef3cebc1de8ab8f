"""Frozen attrs records, validated at the boundary (CONTRACT section 1).

A rollout carries five kinds of information: identity and task source, behaviour-policy
identity, generation conditions, lifecycle and reward state, and action evidence. Records
refuse wrong types and ranges when built; alignment of the evidence is judged by the
admission gate instead, so a misaligned rollout becomes a rejection with a reason rather than
a crash in the middle of a batch.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np
import numpy.typing as npt

from rollout_lifecycle.model.errors import InvalidRecord, brief
from rollout_lifecycle.model.machines import ACTIVATION, LIFECYCLE

T = TypeVar("T")

# ---- validators ----------------------------------------------------------------------------


INT64_MAX = 2**63 - 1  # every stored integer fits a signed 64-bit column


def _nonneg_int(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    check_int64(value, attribute.name)


def _opt_nonneg_int(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _nonneg_int(inst, attribute, value)


# One limit for every identifier on every backend (memory, SQLite, PostgreSQL), so a record
# one backend stores is never refused by another: PostgreSQL text cannot hold NUL, SQLite
# cannot encode a lone surrogate, and an unbounded id slows every later lookup.
MAX_ID_LENGTH = 1024


def text_problem(value: object, *, max_length: int | None = MAX_ID_LENGTH) -> str | None:
    """Why `value` cannot be stored as an id (or, without a length limit, as text); None if
    it can. Shared by the record validators and the ledger's argument checks."""
    if not isinstance(value, str) or not value:
        return f"must be a non-empty string, got {brief(value)}"
    if max_length is not None and len(value) > max_length:
        return f"must be at most {max_length} characters, got {len(value)}"
    if "\x00" in value:
        return f"must not contain a NUL character, got {brief(value)}"
    if value.isascii():  # no surrogate to find: skip the encoding copy
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"must be valid Unicode text (a lone surrogate at position {exc.start} cannot be "
            "stored), decode its bytes with errors='replace' first"
        )
    return None


def texts_pass(values: Sequence[object], *, max_length: int | None = MAX_ID_LENGTH) -> bool:
    """True when `text_problem` finds nothing wrong with any of `values`, judged a column at
    a time (a batch's ids, a chunk's ids) in a few C-level passes: all plain non-empty
    strings, none too long, no NUL; a column that is not all ASCII is judged value by value.
    False means only that some value needs `text_problem`'s judgement one by one."""
    if not values:
        return True
    if set(map(type, values)) != {str}:
        return False
    texts: Sequence[str] = values  # type: ignore[assignment]
    if min(map(len, texts)) == 0 or (max_length is not None and max(map(len, texts)) > max_length):
        return False
    joined = "".join(texts)
    if "\x00" in joined:
        return False
    return joined.isascii() or all(text_problem(v, max_length=max_length) is None for v in texts)


def ints64_pass(values: Sequence[object]) -> bool:
    """True when `check_int64` accepts every one of `values` (exact ints, never bools, in
    [0, 2**63 - 1]), judged a column at a time."""
    if not values:
        return True
    if set(map(type, values)) != {int}:
        return False
    ints: Sequence[int] = values  # type: ignore[assignment]
    return min(ints) >= 0 and max(ints) <= INT64_MAX


def check_int64(value: object, what: str) -> int:
    """A non-negative int that fits the signed 64-bit columns versions and revisions live in;
    InvalidRecord otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRecord(f"{what} must be a non-negative int, got {brief(value)}")
    if value > INT64_MAX:
        raise InvalidRecord(f"{what} must fit in 64 bits (<= 2**63 - 1), got {brief(value)}")
    return value


def _nonempty_str(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    problem = text_problem(value)
    if problem is not None:
        raise InvalidRecord(f"{attribute.name} {problem}")


def _text(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """Free text (a failure's cause or detail): any length, but storable everywhere."""
    if isinstance(value, str) and value == "" and attribute.name == "detail":
        return
    problem = text_problem(value, max_length=None)
    if problem is not None:
        raise InvalidRecord(f"{attribute.name} {problem}")


def _opt_pos_int(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise InvalidRecord(f"{attribute.name} must be None or an integer >= 1, got {brief(value)}")


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
            raise InvalidRecord(f"{attribute.name} must be one of {allowed}, got {brief(value)}")

    return check


# ---- evidence arrays --------------------------------------------------------------------
#
# Evidence is what RL code already holds: numpy arrays, torch tensors, numpy scalars, lists.
# It is converted ONCE here into read-only numpy arrays, with vectorised checks (no Python
# work per element of an array; a Python list is type-checked with one C-level pass over
# its element types, and walked element by element only to name the offending position).
#
#   response_token_ids  int64
#   action_mask         bool (bool arrays, np.bool_, or integers that are all 0 or 1)
#   behavior_log_probs  float32 when the input is float32 (or float16 / bfloat16, which
#                       float32 holds exactly), else float64: an inference engine's float32
#                       log-probs are not made more exact by widening them, and keeping
#                       them halves the memory. Python floats and float64 stay float64.
#
# Non-finite log-probs are allowed here (masked positions may hold anything); the gate
# judges the action positions.

# element types a Python list may hold without a walk over its elements (the array check
# that follows still validates the values, e.g. that integer mask entries are 0 or 1)
_NP_INTS: frozenset[type] = frozenset(
    {np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32}
)
_INT_TYPES: frozenset[type] = frozenset({int}) | _NP_INTS
_MASK_TYPES: frozenset[type] = frozenset({bool, np.bool_, int}) | _NP_INTS
_LP_TYPES: frozenset[type] = frozenset({float, int, np.float64, np.float32, np.float16}) | _NP_INTS


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _tensor_to_numpy(t: Any) -> npt.NDArray[Any]:
    """A torch tensor on any device -> a numpy array on the host (one transfer)."""
    t = t.detach()
    if t.device.type == "meta":  # shapes only: there are no values to check or keep
        raise InvalidRecord(
            "a tensor on torch's 'meta' device holds no values; pass the tensor that holds them"
        )
    if t.device.type != "cpu":
        t = t.cpu()
    if str(t.dtype) == "torch.bfloat16":  # numpy has no bfloat16; float32 holds it exactly
        t = t.float()
    return np.asarray(t.numpy())


def _first_bad(seq: Sequence[Any], ok: Callable[[Any], bool]) -> tuple[int, Any] | None:
    for i, v in enumerate(seq):
        if not ok(v):
            return i, v
    return None


def _raw_array(value: Any, field: str, allowed: frozenset[type], ok: Callable[[Any], bool]) -> Any:
    """numpy array, tensor -> as is; a Python sequence -> checked by element type first."""
    if isinstance(value, np.ndarray):
        return value
    if _is_torch(value):
        return _tensor_to_numpy(value)
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise InvalidRecord(f"{field} must be a 1-D sequence or array, got {type(value).__name__}")
    seq = value if isinstance(value, list | tuple) else list(value)
    types = set(map(type, seq))
    if not types <= allowed:
        bad = _first_bad(seq, ok)
        if bad is not None:
            raise InvalidRecord(f"{field}[{bad[0]}] {_WANT[field]}, got {brief(bad[1])}")
    return seq


_WANT = {
    "response_token_ids": "must be an int",
    "action_mask": "must be a boolean (or 0/1)",
    "behavior_log_probs": "must be a number",
}


def _ok_id(v: Any) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)


def _ok_mask(v: Any) -> bool:
    return isinstance(v, bool | np.bool_) or (isinstance(v, int | np.integer) and v in (0, 1))


def _ok_lp(v: Any) -> bool:
    return isinstance(v, int | float | np.integer | np.floating) and not isinstance(
        v, bool | np.bool_
    )


def _one_dim(arr: npt.NDArray[Any], field: str) -> None:
    if arr.ndim != 1:
        raise InvalidRecord(f"{field} must be 1-D, got shape {arr.shape}")


def _frozen(arr: npt.NDArray[Any], dtype: Any) -> npt.NDArray[Any]:
    """A read-only C-contiguous array of `dtype` that nobody else can write through.

    An array that is already read-only, owns its data and has the dtype (one this converter
    made, e.g. passed again by attrs.evolve) is kept; anything else is copied exactly once.
    """
    if (
        arr.dtype == dtype
        and not arr.flags.writeable
        and arr.flags.owndata
        and arr.flags.c_contiguous
    ):
        return arr
    out = np.array(arr, dtype=dtype, order="C", copy=True)
    out.flags.writeable = False
    return out


def _token_ids(value: Any) -> npt.NDArray[np.int64]:
    field = "response_token_ids"
    raw = _raw_array(value, field, _INT_TYPES, _ok_id)
    if not isinstance(raw, np.ndarray):
        try:
            raw = np.asarray(raw, dtype=np.int64) if raw else np.zeros(0, np.int64)
        except OverflowError:
            raise InvalidRecord(f"{field}: a token id does not fit in int64") from None
    _one_dim(raw, field)
    if raw.size == 0:
        return _frozen(np.zeros(0, np.int64), np.int64)
    if raw.dtype == np.bool_ or not np.issubdtype(raw.dtype, np.integer):
        if raw.dtype == object:
            bad = _first_bad(raw.tolist(), _ok_id)
            if bad is not None:
                raise InvalidRecord(f"{field}[{bad[0]}] must be an int, got {brief(bad[1])}")
        raise InvalidRecord(f"{field} must hold integers, got dtype {raw.dtype}")
    if raw.dtype == np.uint64:
        big = np.flatnonzero(raw > np.iinfo(np.int64).max)
        if big.size:
            i = int(big[0])
            raise InvalidRecord(f"{field}[{i}] does not fit in int64, got {int(raw[i])}")
    return _frozen(raw, np.int64)


def _mask_array(value: Any) -> npt.NDArray[np.bool_]:
    field = "action_mask"
    raw = _raw_array(value, field, _MASK_TYPES, _ok_mask)
    if not isinstance(raw, np.ndarray):
        raw = np.asarray(raw) if raw else np.zeros(0, np.bool_)
    _one_dim(raw, field)
    if raw.dtype == np.bool_:
        return _frozen(raw, np.bool_)
    if raw.size == 0:
        return _frozen(np.zeros(0, np.bool_), np.bool_)
    if not np.issubdtype(raw.dtype, np.integer):
        if raw.dtype == object:
            bad = _first_bad(raw.tolist(), _ok_mask)
            if bad is not None:
                raise InvalidRecord(
                    f"{field}[{bad[0]}] must be a boolean (or 0/1), got {brief(bad[1])}"
                )
        raise InvalidRecord(f"{field} must be booleans or 0/1 integers, got dtype {raw.dtype}")
    bad_at = np.flatnonzero((raw != 0) & (raw != 1))
    if bad_at.size:
        i = int(bad_at[0])
        raise InvalidRecord(f"{field}[{i}] must be a boolean (or 0/1), got {brief(raw[i].item())}")
    out: npt.NDArray[np.bool_] = np.not_equal(raw, 0)
    out.flags.writeable = False
    return out


_NARROW_FLOATS = frozenset({np.dtype(np.float16), np.dtype(np.float32)})


def _log_probs(value: Any) -> npt.NDArray[np.floating[Any]]:
    field = "behavior_log_probs"
    raw = _raw_array(value, field, _LP_TYPES, _ok_lp)
    if not isinstance(raw, np.ndarray):
        if not raw:
            return _frozen(np.zeros(0, np.float64), np.float64)
        raw = np.asarray(raw)
        if raw.dtype == object:  # mixed Python ints too large for a float, or other objects
            try:
                raw = np.asarray(raw, dtype=np.float64)
            except (TypeError, ValueError, OverflowError):
                raise InvalidRecord(f"{field} must hold numbers") from None
    _one_dim(raw, field)
    dt = raw.dtype
    if dt in _NARROW_FLOATS:
        return _frozen(raw, np.float32)
    if dt == np.bool_ or not (np.issubdtype(dt, np.floating) or np.issubdtype(dt, np.integer)):
        if raw.size == 0:
            return _frozen(np.zeros(0, np.float64), np.float64)
        raise InvalidRecord(f"{field} must hold real numbers, got dtype {dt}")
    return _frozen(raw, np.float64)


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
            raise InvalidRecord(f"temperature must be >= 0, got {brief(v)}")

    @top_p.validator
    def _p(self, _a: attrs.Attribute[Any], v: float) -> None:
        if not 0 < v <= 1:
            raise InvalidRecord(f"top_p must be in (0, 1], got {brief(v)}")

    @top_k.validator
    def _k(self, _a: attrs.Attribute[Any], v: int) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or v < -1:
            raise InvalidRecord(f"top_k must be an int >= -1 (-1 or 0: disabled), got {brief(v)}")

    @seed.validator
    def _s(self, _a: attrs.Attribute[Any], v: int | None) -> None:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise InvalidRecord(f"seed must be an int or null, got {brief(v)}")


@attrs.frozen(eq=False)
class ActionEvidence:
    """Tokens, action mask and behaviour log-probs; their alignment is judged by the gate.

    Built from numpy arrays, torch tensors (moved to the host once), lists or numpy scalars;
    held as read-only numpy arrays (see the converters above for the dtypes). Equality is by
    value: same token ids, same mask, same log-probs (NaN equals NaN, float32 -0.5 equals
    float64 -0.5), so a record equals its JSON round trip. The hash reads only the token ids
    and the mask, which have one canonical dtype each, so equal records hash equally.
    """

    response_token_ids: npt.NDArray[np.int64] = attrs.field(converter=_token_ids)
    action_mask: npt.NDArray[np.bool_] = attrs.field(converter=_mask_array)
    behavior_log_probs: npt.NDArray[np.floating[Any]] = attrs.field(converter=_log_probs)

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if not isinstance(other, ActionEvidence):
            return NotImplemented
        return (
            np.array_equal(self.response_token_ids, other.response_token_ids)
            and np.array_equal(self.action_mask, other.action_mask)
            and np.array_equal(self.behavior_log_probs, other.behavior_log_probs, equal_nan=True)
        )

    def __hash__(self) -> int:
        return hash(
            (
                self.response_token_ids.tobytes(),
                self.action_mask.tobytes(),
                self.behavior_log_probs.size,
            )
        )


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
    cause: str = attrs.field(validator=_text)
    detail: str = attrs.field(default="", validator=_text)


def _nonneg_finite(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    _finite(inst, attribute, value)
    if value < 0:
        raise InvalidRecord(f"{attribute.name} must be >= 0, got {brief(value)}")


def _opt_nonneg_finite(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _nonneg_finite(inst, attribute, value)


def _strict_bool(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidRecord(f"{attribute.name} must be True or False, got {brief(value)}")


# the freshness classes of CONTRACT section 3; None: no action position, nothing classified
FRESHNESS_CLASSES = ("future", "fresh", "tolerated", "stale")


def _opt_freshness(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and value not in FRESHNESS_CLASSES:
        raise InvalidRecord(
            f"{attribute.name} must be one of {FRESHNESS_CLASSES} or None, got {brief(value)}"
        )


# the recorded policy's lineage modes and attempt-chain keys (see AdmissionPolicy)
LINEAGE_MODES = ("ledger", "off")
CHAIN_KEYS = ("identity", "caller")


@attrs.frozen(repr=False)
class AdmissionPolicy:
    """The deployment's admission bounds (L_max, D_max), recorded durably in the registry.

    Every reservation is judged against the policy recorded at the moment of its write; a
    learner's own configuration may be stricter, never looser.
    """

    max_lag: int = attrs.field(validator=_nonneg_int)
    max_drift: float = attrs.field(validator=_nonneg_finite)
    # pacing (issue 21): rollouts per update, which turns on the dispatch budget of
    # (max_lag + 1) x batch_size live rollouts; and the bound on attempts per prompt chain.
    # None: no budget / no bound. Omitted from JSON when None, so older records read the same.
    batch_size: int | None = attrs.field(
        default=None, validator=_opt_pos_int, metadata={"omit_default": True}
    )
    max_attempts: int | None = attrs.field(
        default=None, validator=_opt_pos_int, metadata={"omit_default": True}
    )
    # issue 31: "ledger" (a version's lineage is the ledger's landed updates, and each update
    # it names must be landed, unpoisoned and unclaimed) or "off" (the operator's recorded
    # opt-out: a version records what it is given, unfenced); "identity" (a prompt's attempt
    # chain is its rollout identity) or "caller" (the key a generator passes to dispatch).
    # Omitted from JSON at their defaults, so older records read the same.
    lineage: str = attrs.field(
        default="ledger", validator=_one_of(*LINEAGE_MODES), metadata={"omit_default": True}
    )
    chain_key: str = attrs.field(
        default="identity", validator=_one_of(*CHAIN_KEYS), metadata={"omit_default": True}
    )

    @property
    def paced(self) -> bool:
        """Whether pacing bounds are recorded (a dispatch budget or an attempts bound)."""
        return self.batch_size is not None or self.max_attempts is not None

    def __repr__(self) -> str:
        """The bounds that are set (the pacing ones only when set, as in its JSON)."""
        shown = ", ".join(f"{k}={v!r}" for k, v in _record_jsonable(self).items())
        return f"AdmissionPolicy({shown})"


@attrs.frozen
class AdmissionStamp:
    """The admission decision a reservation was made on, kept so the spec can re-check it.

    Typed strictly at construction (a bool `accepted`, a known freshness, a drift that is
    None or a finite number >= 0): a stamp that is malformed is refused before it is
    offered. Whether its figures agree with each other and with the deployment is judged
    by the reservation's atomic step (model.rules.reservation_refusal).
    """

    current_version: int = attrs.field(validator=_nonneg_int)
    behavior_version: int = attrs.field(validator=_nonneg_int)
    max_lag: int = attrs.field(validator=_nonneg_int)
    max_drift: float = attrs.field(validator=_nonneg_finite)
    drift: float | None = attrs.field(validator=_opt_nonneg_finite)
    freshness: str | None = attrs.field(validator=_opt_freshness)
    reason: str = attrs.field(validator=_nonempty_str)
    accepted: bool = attrs.field(validator=_strict_bool)

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
    # the prompt's attempt chain and this rollout's 1-based attempt in it (set by `dispatch`;
    # None / 0 for a rollout added directly), and the tokens it generated (set on
    # generation_done): what pacing bounds and reports. Omitted from JSON at their defaults.
    chain: str | None = attrs.field(
        default=None, validator=_opt_nonempty_str, metadata={"omit_default": True}
    )
    attempt: int = attrs.field(default=0, validator=_nonneg_int, metadata={"omit_default": True})
    tokens: int | None = attrs.field(
        default=None, validator=_opt_nonneg_int, metadata={"omit_default": True}
    )

    def __attrs_post_init__(self) -> None:
        if (self.chain is None) != (self.attempt == 0):
            raise InvalidRecord(
                f"rollout {brief(self.rollout_id)}: a chain needs an attempt >= 1 and an "
                f"attempt needs a chain (chain {brief(self.chain)}, attempt {self.attempt})"
            )
        if (self.reserved_by is not None) != (self.state == "reserved"):
            raise InvalidRecord(
                f"rollout {brief(self.rollout_id)}: reserved_by must be set exactly when the state "
                f"is 'reserved' (state {brief(self.state)}, reserved_by {brief(self.reserved_by)})"
            )


# an update's status in the ledger (issue 31): `open` from its first reservation, `landed`
# once a commit of it consumed rollouts, `poisoned` (absorbing) when it may have trained on a
# rollout another update consumes: a refused commit, a lost lease, a retired version
UPDATE_STATES = ("open", "landed", "poisoned")


@attrs.frozen
class UpdateRecord:
    """An update as the ledger records it: a durable object, so lineage is read from the
    ledger, never from what a learner says it trained on.

    `cause` (with `detail`) says why a poisoned update is poisoned, and is set only then.
    """

    update_id: str = attrs.field(validator=_nonempty_str)
    status: str = attrs.field(validator=_one_of(*UPDATE_STATES))
    cause: str | None = attrs.field(default=None, validator=_opt_nonempty_str)
    detail: str = attrs.field(default="", validator=_text)

    def __attrs_post_init__(self) -> None:
        if (self.cause is not None) != (self.status == "poisoned"):
            raise InvalidRecord(
                f"update {brief(self.update_id)}: a cause is recorded exactly when it is "
                f"poisoned (status {brief(self.status)}, cause {brief(self.cause)})"
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
                f"rollout {brief(self.identity.rollout_id)}: status belongs to "
                f"{brief(st.rollout_id)} v{st.behavior_version}; identity and behaviour must agree"
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


def _update_ids(value: Any) -> tuple[str, ...]:
    """A version's lineage: distinct, non-empty update ids (a list or tuple of them)."""
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise InvalidRecord(f"trained_by must be a list of update ids, got {brief(value)}")
    out = tuple(value)
    for u in out:
        problem = text_problem(u)
        if problem is not None:
            raise InvalidRecord(f"trained_by holds update ids: each {problem}")
    if len(set(out)) != len(out):
        raise InvalidRecord(f"trained_by names an update more than once: {brief(out)}")
    return out


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
    # lineage: the updates whose gradients this version contains; each must have a landed
    # commit in the ledger before the version is prepared, committed or activated
    trained_by: tuple[str, ...] = attrs.field(default=(), converter=_update_ids)
    # when the current (or last) distribution attempt stops waiting for acks, on the
    # deployment's clock: past it, the next coordinator action fails the attempt
    # ('ack_deadline_passed') unless every required worker's ack is in (it activates then)
    ack_deadline: float | None = attrs.field(
        default=None, validator=_opt_finite, metadata={"omit_default": True}
    )

    @property
    def committed(self) -> bool:
        """Whether the artifact's files and hash are final (it left `prepared` successfully)."""
        return self.artifact_hash is not None and self.state not in ("prepared", "commit_failed")


@attrs.frozen
class WorkerAck:
    """What a worker reports it actually loaded, and which distribution attempt it answers.

    (incarnation, seq) orders a worker's reports, so a delayed ack from before a restart can
    never count. `token` echoes the opaque token the coordinator issued to this worker for
    the distribution attempt it answers (`ActivationCoordinator.attempt_token`): after a
    failed attempt, a membership change or a retry, a delayed ack no longer proves what the
    worker holds now, and only an ack echoing the CURRENT attempt's token counts toward
    activation. A report of a version that is not awaiting acks ("I restored v0") needs no
    token: it is stored as what the worker holds and can only block an activation.

    `seq` may be left unset (the coordinator numbers it by arrival). `attempt` is the
    worker's own note of the attempt number, kept for logs: the coordinator never fills it
    in and never counts on it (an arrival-numbered attempt is what let late acks win).
    """

    worker_id: str = attrs.field(validator=_nonempty_str)
    version: int = attrs.field(validator=_nonneg_int)
    artifact_hash: str = attrs.field(validator=_nonempty_str)
    incarnation: int = attrs.field(default=0, validator=_nonneg_int)
    # left None by a worker, numbered by the coordinator when it records the ack
    seq: int | None = attrs.field(default=None, validator=_opt_nonneg_int)
    attempt: int | None = attrs.field(default=None, validator=_opt_nonneg_int)
    token: str | None = attrs.field(default=None, validator=_opt_nonempty_str)


@attrs.frozen
class AttemptToken:
    """The token one distribution attempt issued to one required worker, stored durably.

    Random (never derived from anything a worker could guess or replay); a new attempt, or
    a worker joining while a version awaits acks, issues a new one. An ack counts only if it
    echoes the token stored for its worker and version at the moment of the decision, and
    only once (`spent`).
    """

    version: int = attrs.field(validator=_nonneg_int)
    worker_id: str = attrs.field(validator=_nonempty_str)
    attempt: int = attrs.field(validator=_nonneg_int)
    token: str = attrs.field(validator=_nonempty_str)
    # an ack echoing it was counted: a token counts once, so no later ack echoing it is
    # ever stored (a network duplicate of an ack the worker has since replaced is refused)
    spent: bool = attrs.field(
        default=False, validator=_strict_bool, metadata={"omit_default": True}
    )


# ---- (de)serialisation ---------------------------------------------------------------------


_SCALARS = (str, int, float, bool, type(None))


def _entry_jsonable(e: LedgerEntry) -> dict[str, Any]:
    """to_jsonable of a LedgerEntry, written out: every written row and every event's
    before/after goes through it, and the generic walk costs several times more."""
    r, d, a = e.reward, e.disposition, e.admission
    out = {
        "rollout_id": e.rollout_id,
        "behavior_version": e.behavior_version,
        "artifact_hash": e.artifact_hash,
        "state": e.state,
        "revision": e.revision,
        "reserved_by": e.reserved_by,
        "lease_expires_at": e.lease_expires_at,
        "reward": None
        if r is None
        else {
            "function_id": r.function_id,
            "function_version": r.function_version,
            "value": r.value,
        },
        "disposition": None
        if d is None
        else {"stage": d.stage, "cause": d.cause, "detail": d.detail},
        "admission": None
        if a is None
        else {
            "current_version": a.current_version,
            "behavior_version": a.behavior_version,
            "max_lag": a.max_lag,
            "max_drift": a.max_drift,
            "drift": a.drift,
            "freshness": a.freshness,
            "reason": a.reason,
            "accepted": a.accepted,
        },
        "releases": e.releases,
    }
    if e.chain is not None:  # pacing fields, only where set (see LedgerEntry)
        out["chain"] = e.chain
        out["attempt"] = e.attempt
    if e.tokens is not None:
        out["tokens"] = e.tokens
    return out


def _record_jsonable(obj: Any) -> dict[str, Any]:
    """An attrs record's fields, less those marked `omit_default` that are at their default
    (fields added later, so records written before them keep their exact JSON)."""
    out: dict[str, Any] = {}
    for f in attrs.fields(type(obj)):
        v = getattr(obj, f.name)
        if f.metadata.get("omit_default") and v == f.default:
            continue
        out[f.name] = to_jsonable(v)
    return out


def to_jsonable(obj: Any) -> Any:
    """attrs record -> plain JSON-able dict/list/scalars (tuples become lists)."""
    if isinstance(obj, _SCALARS):  # most values: skip the attrs lookup (hot in SQLite writes)
        return obj
    if type(obj) is LedgerEntry:
        return _entry_jsonable(obj)
    if attrs.has(type(obj)):
        return _record_jsonable(obj)
    if isinstance(obj, tuple | list):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray | np.generic):  # evidence arrays: one C-level tolist()
        return obj.tolist()
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


# ---- building records without attrs' per-call work ------------------------------------------
# A ledger step builds a few records per row it writes; these build them the way attrs'
# __init__ does, minus the per-call look-up of each field's name on the class.


def slot_setter(cls: type[Any], name: str) -> Callable[[Any, Any], None] | None:
    """The `__set__` of `cls`'s slot for field `name` (what `object.__setattr__` ends up
    calling, without looking the name up on every call); None when the field is no slot."""
    for klass in cls.__mro__:
        if name in vars(klass):
            found = vars(klass)[name]
            if type(found) is types.MemberDescriptorType:
                setter: Callable[[Any, Any], None] = found.__set__
                return setter
            return None
    return None


def plain_maker(cls: type[T]) -> Callable[..., T]:
    """`cls(*values)` for an attrs class whose __init__ only stores its arguments (no
    validator, converter, factory default, pre- or post-init): each field positional in
    declaration order, defaults as declared, stored through its slot. TypeError for a class
    whose __init__ does more, so a check added to it later is never skipped."""
    fields = attrs.fields(cls)  # type: ignore[arg-type]
    does_more = [
        a.name
        for a in fields
        if a.validator is not None
        or a.converter is not None
        or not a.init
        or isinstance(a.default, attrs.Factory)  # type: ignore[arg-type]
    ]
    hooks = [h for h in ("__attrs_pre_init__", "__attrs_post_init__") if hasattr(cls, h)]
    if does_more or hooks:
        raise TypeError(f"{cls.__name__}'s __init__ does more than store: {does_more + hooks}")
    scope: dict[str, Any] = {"cls": cls, "new": object.__new__, "put": object.__setattr__}
    params, lines = [], ["    o = new(cls)"]
    for i, a in enumerate(fields):
        if a.default is attrs.NOTHING:
            params.append(a.name)
        else:
            scope[f"d{i}"] = a.default
            params.append(f"{a.name}=d{i}")
        setter = slot_setter(cls, a.name)
        if setter is None:
            lines.append(f"    put(o, {a.name!r}, {a.name})")
        else:
            scope[f"s{i}"] = setter
            lines.append(f"    s{i}(o, {a.name})")
    bound = "".join(f", s{i}=s{i}" for i in range(len(fields)) if f"s{i}" in scope)
    head = f"def make({', '.join(params)}, *, cls=cls, new=new, put=put{bound}):"
    exec("\n".join([head, *lines, "    return o"]) + "\n", scope)
    fn: Callable[..., T] = scope["make"]
    return fn
