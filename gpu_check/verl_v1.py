"""verl's v1 trainer, backed by the ledger: adapter, replay buffer and two-phase weight sync.

One import path, three pieces a verl 0.9.1 user switches on with config keys only
(docs/verl-v1.md):

* the adapter (`trajectory_rollouts`, `admit_batch`, `commit_update`, `release_update`):
  from a verl `DataProto`, a `TensorDict` or a TransferQueue `KVBatchMeta` + fields to
  ledger decisions. Rollout ids are verl's own TransferQueue keys `{uid}_{session}_{index}`
  (verl's `uid` names a prompt, not a sample), behaviour versions are the trajectory's
  `[min_global_steps, max_global_steps]` (judged by the oldest), generation conditions come
  from the rollout config, the reward from `rm_scores` with the reward function's identity;
  admission reads the registry's recorded policy and pointer (model.admission), reservation
  is a compare-and-set, commit consumes exactly what an update reserved, release returns it.
* `LedgerReplayBuffer`: a `ReplayBufferAsync` for `trainer.v1.sampler.custom_sampler`. Every
  trajectory verl writes to TransferQueue becomes a ledger rollout; `sample` evicts stale
  groups through the lifecycle (retired with their cause, `refill_fn` called for each),
  reserves the chosen groups by CAS (two trainers on one ledger never take one trajectory),
  commits a step's reservations when the next step starts (its update landed) and releases
  those of steps a resumed trainer will redo.
* `LedgerCheckpointEngine`: a checkpoint-engine backend registered in verl's
  `CheckpointEngineRegistry` as "rollout_lifecycle". The actor publishes each weight version
  as a committed, content-hashed artifact; each rollout worker loads it through a verifying
  loader and acks (version, hash, attempt token); the pointer moves only when every required
  worker acked, else the distribution fails with its stage and the version's rollouts are
  quarantined.

Drift and verl's bypass mode: `sample` runs before the trainer computes any log-probs, so
the only log-probs there are the rollout engine's. With `algorithm.rollout_correction.
bypass_mode=True` verl makes them the update's old log-probs, i.e. the behaviour policy IS
the proximal policy of the update: the drift the loss sees between the two is 0 by verl's
definition, and that is the figure `sample` stamps (`drift_source="bypass"`, reported in the
metrics). It is not a measurement of the learner: the measured gate is `admit_batch` on a
batch that carries the actor's recomputed `old_log_probs` (bypass off).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import threading
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np
import numpy.typing as npt
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

from rollout_lifecycle.gpu_check.errors import GpuCheckError
from rollout_lifecycle.model import rules
from rollout_lifecycle.model.admission import Admitted, admit_and_reserve
from rollout_lifecycle.model.artifacts import ArtifactStore, WorkerLoader
from rollout_lifecycle.model.backends import Backend, open_backend
from rollout_lifecycle.model.coordinator import (
    MISSING_ATTEMPT_TOKEN,
    STALE_ATTEMPT_TOKEN,
    ActivationCoordinator,
)
from rollout_lifecycle.model.errors import RolloutLifecycleError
from rollout_lifecycle.model.gate import classify_lag
from rollout_lifecycle.model.ledger import (
    NOT_DISPATCHED,
    LandedStep,
    Landing,
    Ledger,
    StepPremise,
)
from rollout_lifecycle.model.pacing import DispatchOutcome, stale_disposition
from rollout_lifecycle.model.records import (
    ActionEvidence,
    AdmissionPolicy,
    AdmissionStamp,
    ArtifactRecord,
    BehaviorPolicy,
    Disposition,
    GenerationConditions,
    LedgerEntry,
    Reward,
    Rollout,
    RolloutIdentity,
)
from rollout_lifecycle.model.registry import RegistryStore, activated_hash

BACKEND_NAME = "rollout_lifecycle"
SAMPLER_PATH = "pkg://rollout_lifecycle.gpu_check.verl_v1"
SAMPLER_NAME = "LedgerReplayBuffer"
_KEY = re.compile(r"^([^_]+)_(\d+)_(\d+)$")


class VerlIntegrationError(GpuCheckError, ValueError):
    """A verl batch, tag or setting the integration cannot use as given (says which, why)."""


class WeightSyncError(GpuCheckError):
    """A weight version could not be published, loaded or acknowledged (stage in the text)."""


# ---- (a) the adapter: verl's forms -> ledger decisions -------------------------------------


@attrs.frozen
class TrajectoryKey:
    """verl's TransferQueue key `{uid}_{session}_{index}`: prompt, GRPO session, output."""

    uid: str
    session: int
    index: int

    @classmethod
    def parse(cls, key: str) -> TrajectoryKey:
        """The parts of a trajectory key; VerlIntegrationError for a prompt key or junk."""
        m = _KEY.match(key) if isinstance(key, str) else None
        if m is None:
            raise VerlIntegrationError(
                f"{key!r} is not a trajectory key {{uid}}_{{session}}_{{index}} (a uid must not "
                "contain '_': verl's buffer groups keys by key.split('_')[0])"
            )
        return cls(m.group(1), int(m.group(2)), int(m.group(3)))

    @property
    def key(self) -> str:
        """The key as verl writes it, which is also the ledger's rollout id."""
        return f"{self.uid}_{self.session}_{self.index}"


def conditions_from_rollout_config(
    rollout: Mapping[str, Any], tokenizer_id: str
) -> GenerationConditions:
    """Generation conditions from `actor_rollout_ref.rollout` (temperature, top_p, top_k,
    response_length, optional seed): what a rollout must match to be admitted."""
    try:
        seed = rollout.get("seed")
        return GenerationConditions(
            tokenizer_id=str(tokenizer_id),
            temperature=float(rollout["temperature"]),
            top_p=float(rollout.get("top_p", 1.0)),
            top_k=int(rollout.get("top_k", -1)),
            max_tokens=int(rollout["response_length"]),
            seed=None if seed is None else int(seed),
        )
    except (KeyError, TypeError, ValueError, RolloutLifecycleError) as exc:
        raise VerlIntegrationError(f"rollout config gives no usable conditions: {exc}") from None


@attrs.frozen
class RewardIdentity:
    """Which reward function scored the trajectories (CONTRACT: never a bare number)."""

    function_id: str
    function_version: str


def _rows(value: Any, n: int, what: str) -> list[Any]:
    """n per-sample items of a tensor (padded or jagged), a numpy array or a list."""
    if value is None:
        raise VerlIntegrationError(f"the batch has no {what!r}")
    if getattr(value, "is_nested", False):
        items = list(value.unbind(0))
    elif hasattr(value, "tolist") and not isinstance(value, np.ndarray):
        items = list(value) if getattr(value, "ndim", 1) > 1 else list(value.tolist())
    else:
        items = list(np.asarray(value, dtype=object).reshape(len(value), -1)) if n else []
        if items and np.asarray(value).ndim == 1:
            items = list(np.asarray(value, dtype=object))
    if len(items) != n:
        raise VerlIntegrationError(f"{what!r} has {len(items)} rows for {n} samples")
    return items


def _np(row: Any) -> npt.NDArray[Any]:
    if hasattr(row, "detach"):
        row = row.detach().to("cpu")
        if str(row.dtype) == "torch.bfloat16":
            row = row.float()
        return np.asarray(row.numpy())
    return np.asarray(row)


def _field(source: Any, key: str) -> Any:
    try:
        return source[key] if key in source.keys() else None  # noqa: SIM118
    except (AttributeError, TypeError, KeyError):
        return None


def group_reward(identity: RewardIdentity, rewards: Sequence[float] | None) -> Reward | None:
    """A GRPO group's reward: the mean of its trajectories' rewards (in the order given),
    with the reward function's identity; None without any. The buffer and the agent-loop
    worker both land a group with it, so either records the very same float."""
    if not rewards:
        return None
    return Reward(identity.function_id, identity.function_version, sum(rewards) / len(rewards))


@attrs.frozen(eq=False)
class Trajectory:
    """One verl trajectory as the ledger sees it (built from a batch row)."""

    key: TrajectoryKey
    min_version: int
    max_version: int
    response_ids: npt.NDArray[np.int64]
    action_mask: npt.NDArray[np.bool_]
    behavior_log_probs: npt.NDArray[np.float64] | None
    reward: float | None

    @property
    def rollout_id(self) -> str:
        """The ledger id: verl's own key, stable across processes and resumes."""
        return self.key.key


def trajectories(
    batch: Any, keys: Sequence[str] | None = None, tags: Sequence[Mapping[str, Any]] | None = None
) -> list[Trajectory]:
    """verl's per-sample rows -> `Trajectory` records.

    `batch` is a `DataProto` (tensors in `.batch`, ids/versions in `.non_tensor_batch`), or a
    `TensorDict`/mapping as TransferQueue's `kv_batch_get` returns it (then `keys` and `tags`
    are the `KVBatchMeta`'s). Ids come from `keys`, else from `uid`/`session_id`/`index`
    fields; versions from tags, else from `min_global_steps`/`max_global_steps` rows.
    """
    tensors, extras = (
        (batch.batch, batch.non_tensor_batch)
        if hasattr(batch, "non_tensor_batch")
        else (batch, batch)
    )
    responses = _field(tensors, "responses")
    n = len(keys) if keys is not None else int(responses.shape[0]) if responses is not None else 0
    if responses is None:
        raise VerlIntegrationError("the batch has no 'responses'")
    resp = _rows(responses, n, "responses")
    mask_src = _field(tensors, "response_mask")
    masks = _rows(mask_src, n, "response_mask")
    lp_src = _field(tensors, "rollout_log_probs")
    lps = _rows(lp_src, n, "rollout_log_probs") if lp_src is not None else [None] * n
    rm_src = _field(tensors, "rm_scores")
    rms = _rows(rm_src, n, "rm_scores") if rm_src is not None else [None] * n
    if keys is None:
        uids = _rows(_field(extras, "uid"), n, "uid")
        sess = _field(extras, "session_id")
        idx = _field(extras, "index")
        sessions = _rows(sess, n, "session_id") if sess is not None else list(range(n))
        indexes = _rows(idx, n, "index") if idx is not None else [0] * n
        parsed = [
            TrajectoryKey(str(u), int(s), int(i))
            for u, s, i in zip(uids, sessions, indexes, strict=True)
        ]
        for p in parsed:
            TrajectoryKey.parse(p.key)
    else:
        parsed = [TrajectoryKey.parse(k) for k in keys]
    if tags is not None:
        lows = [t.get("min_global_steps") for t in tags]
        highs = [t.get("max_global_steps") for t in tags]
    else:
        lows = _rows(_field(extras, "min_global_steps"), n, "min_global_steps")
        hs = _field(extras, "max_global_steps")
        highs = _rows(hs, n, "max_global_steps") if hs is not None else lows
    out: list[Trajectory] = []
    for i in range(n):
        lo: Any = lows[i]
        hi: Any = highs[i] if highs[i] is not None else lo
        if lo is None or isinstance(lo, bool) or int(lo) < 0 or int(hi) < int(lo):
            raise VerlIntegrationError(
                f"{parsed[i].key}: versions [{lo}, {hi}] are not a range of global steps"
            )
        mask = _np(masks[i]).reshape(-1).astype(bool)
        ids = _np(resp[i]).reshape(-1).astype(np.int64)
        if ids.size != mask.size:
            # a padded batch: response_mask marks the valid tokens of the padded row
            ids = ids[: mask.size]
        lp = None if lps[i] is None else _np(lps[i]).reshape(-1)[: mask.size].astype(np.float64)
        reward = None if rms[i] is None else float(_np(rms[i]).astype(np.float64).sum())
        out.append(Trajectory(parsed[i], int(lo), int(hi), ids, mask, lp, reward))
    return out


def rollout_record(
    t: Trajectory,
    entry: LedgerEntry,
    conditions: GenerationConditions,
    dataset: str,
) -> Rollout:
    """The gate's view of a trajectory with its ledger entry (identity, behaviour, evidence)."""
    lp = t.behavior_log_probs
    if lp is None:
        raise VerlIntegrationError(
            f"{t.rollout_id}: no rollout_log_probs; set actor_rollout_ref.rollout."
            "calculate_log_probs=True so the behaviour policy's log-probs are recorded"
        )
    return Rollout(
        identity=RolloutIdentity(t.rollout_id, t.key.uid, dataset, t.key.session),
        behavior=BehaviorPolicy(entry.behavior_version, entry.artifact_hash),
        conditions=conditions,
        evidence=ActionEvidence(t.response_ids, t.action_mask, lp),
        status=entry,
    )


def _padded(rows: Sequence[npt.NDArray[Any] | None], width: int) -> npt.NDArray[np.float64]:
    out = np.zeros((len(rows), width), dtype=np.float64)
    for i, r in enumerate(rows):
        if r is not None:
            out[i, : r.size] = r
    return out


def register_trajectories(
    ledger: Ledger,
    registry: RegistryStore,
    items: Sequence[Trajectory],
    reward: RewardIdentity,
) -> list[LedgerEntry]:
    """Add each new trajectory to the ledger as rewarded (or failed with its cause).

    The behaviour version is the oldest weights that produced any of its tokens, stamped
    with the hash the registry activated for it; a version the registry never activated
    gets a placeholder hash, which the gate refuses ('unregistered_version'). A trajectory
    with no reward enters as generated: it is never reservable until scored.
    """
    fresh: list[LedgerEntry] = []
    for t in items:
        if ledger.find(t.rollout_id) is not None:
            continue
        h = activated_hash(registry, t.min_version) or f"unregistered-v{t.min_version}"
        if t.reward is None:
            fresh.append(LedgerEntry(t.rollout_id, t.min_version, h, state="generated"))
        else:
            r = Reward(reward.function_id, reward.function_version, t.reward)
            fresh.append(LedgerEntry(t.rollout_id, t.min_version, h, state="rewarded", reward=r))
    add_many = getattr(ledger, "add_many", None)
    if callable(add_many):
        added: list[LedgerEntry] = list(add_many(fresh))
        return added
    return [ledger.add(e) for e in fresh]


def admit_batch(
    ledger: Ledger,
    registry: RegistryStore,
    update_id: str,
    items: Sequence[Trajectory],
    current_log_probs: Any,
    *,
    conditions: GenerationConditions,
    dataset: str = "verl",
) -> Admitted:
    """Admit (lag AND drift against the registry's policy and pointer) and reserve by CAS.

    `current_log_probs` is B x T: the learner's log-probs of each response token (verl's
    recomputed `old_log_probs`, right-padded). Every trajectory must be in the ledger.
    """
    entries = [ledger.find(t.rollout_id) for t in items]
    missing = [t.rollout_id for t, e in zip(items, entries, strict=True) if e is None]
    if missing:
        raise VerlIntegrationError(f"not in the ledger yet: {missing[:5]}; register them first")
    records = [
        rollout_record(t, e, conditions, dataset)
        for t, e in zip(items, entries, strict=True)
        if e is not None
    ]
    return admit_and_reserve(
        ledger, registry, update_id, records, current_log_probs, conditions=conditions
    )


def admit_dataproto(
    ledger: Ledger,
    registry: RegistryStore,
    update_id: str,
    batch: Any,
    *,
    conditions: GenerationConditions,
    reward: RewardIdentity,
    current_key: str = "old_log_probs",
) -> Admitted:
    """A verl `DataProto` (after `_compute_old_log_prob`) all the way to reservations:
    register its trajectories, admit by lag and measured drift, reserve by CAS."""
    items = trajectories(batch)
    register_trajectories(ledger, registry, items, reward)
    tensors = batch.batch if hasattr(batch, "non_tensor_batch") else batch
    current = _field(tensors, current_key)
    if current is None:
        raise VerlIntegrationError(
            f"the batch has no {current_key!r}: drift needs the learner's log-probs "
            "(bypass mode never computes them; see the module docstring)"
        )
    cur = _np(current).astype(np.float64)
    return admit_batch(
        ledger, registry, update_id, items, cur, conditions=conditions, dataset="verl"
    )


def commit_update(ledger: Ledger, update_id: str) -> list[LedgerEntry]:
    """The update landed: consume exactly what `update_id` reserved."""
    return ledger.commit(update_id, ledger.reserved_by(update_id))


def release_update(ledger: Ledger, update_id: str) -> list[LedgerEntry]:
    """The update did not land: return its reservations (the recovery rule may quarantine)."""
    return ledger.abort(update_id)


# ---- (b) the replay buffer for trainer.v1.sampler.custom_sampler --------------------------

_UPDATE = re.compile(r"^(?P<run>.+)\.s(?P<step>\d+)\.m(?P<mini>\d+)$")
REWARD_TAG = "rollout_lifecycle_reward"  # written on each trajectory by LedgerAgentLoopWorker


def update_id_for(run_id: str, step: int, mini: int) -> str:
    """`{run}.s{step}.m{mini-batch}`: the update that holds a step's mini-batch.

    Deterministic, so the checkpoint engine that publishes step N's weights can commit
    exactly what step N reserved, and a resumed trainer redoing step N re-reserves a group
    the dead process held under the same id as an idempotent retry.
    """
    return f"{run_id}.s{step:08d}.m{mini}"


def step_of(update_id: str, run_id: str) -> int | None:
    """The global step an update id of `run_id` belongs to (None: another run's)."""
    m = _UPDATE.match(update_id)
    if m is None or m.group("run") != run_id:
        return None
    return int(m.group("step"))


class VersionMismatchError(VerlIntegrationError):
    """verl generates with weights the registry never activated, past a bounded wait."""


class RefillLoopError(VerlIntegrationError):
    """One `sample` call evicted and refilled more groups than its bound (says why)."""


class UnsupportedVerlOption(VerlIntegrationError):
    """A verl option the ledger-backed buffer cannot honour (refused at construction)."""


class VerlOptionWarning(UserWarning):
    """A verl option whose meaning the ledger changes (warned at construction, documented)."""


def _flag(v: Any) -> bool:
    return str(v).strip().lower() in ("true", "1", "yes")


@attrs.frozen
class BufferSettings:
    """What the buffer reads from `trainer.v1.sampler.sampler_kwargs` (the config group
    `+rollout_lifecycle=ledger` fills every key by interpolation; docs/verl-v1.md)."""

    ledger_url: str
    run_id: str
    reward: RewardIdentity
    conditions: GenerationConditions | None = None
    dataset: str = "verl"
    lease_seconds: float = 3600.0
    drift_source: str = "bypass"
    owns_ledger: bool = False
    version_wait_s: float = 300.0
    max_refills: int | None = None
    filter_groups: bool = False

    @classmethod
    def from_kwargs(cls, kw: Mapping[str, Any]) -> BufferSettings:
        """Typed settings; VerlIntegrationError names the missing or bad key."""
        kw = dict(kw or {})
        missing = [k for k in ("ledger_url", "run_id") if kw.get(k) in (None, "")]
        if missing:
            raise VerlIntegrationError(
                "trainer.v1.sampler.sampler_kwargs lacks "
                + ", ".join(missing)
                + ": add `+rollout_lifecycle=ledger` (docs/verl-v1.md), or run "
                "`rollout-lifecycle verl setup` for the overrides"
            )
        if kw.get("drift_source", "bypass") != "bypass":
            raise VerlIntegrationError(
                "drift_source must be 'bypass': sample() runs before any learner log-prob exists"
            )
        run_id = str(kw["run_id"])
        if not run_id or "_" in run_id or "." in run_id:
            raise VerlIntegrationError(
                f"run_id {run_id!r} must be non-empty without '_' or '.' (update ids are "
                "{run}.s{step}.m{mini}; verl splits keys on '_')"
            )
        conditions = None
        if kw.get("tokenizer_id") not in (None, "") and kw.get("temperature") is not None:
            conditions = conditions_from_rollout_config(kw, str(kw["tokenizer_id"]))
        refills = kw.get("max_refills")
        try:
            return cls(
                ledger_url=str(kw["ledger_url"]),
                run_id=run_id,
                reward=RewardIdentity(
                    str(kw.get("reward_fn_id", "verl-reward-loop")),
                    str(kw.get("reward_fn_version", "1")),
                ),
                conditions=conditions,
                dataset=str(kw.get("dataset", "verl")),
                lease_seconds=float(kw.get("lease_seconds", 3600.0)),
                owns_ledger=_flag(kw.get("owns_ledger", False)),
                version_wait_s=float(kw.get("version_wait_s", 300.0)),
                max_refills=None if refills in (None, "") else int(refills),
                filter_groups=_flag(kw.get("filter_groups", False)),
            )
        except (TypeError, ValueError) as exc:
            raise VerlIntegrationError(f"trainer.v1.sampler.sampler_kwargs: {exc}") from None


_ENDED = frozenset(
    {
        "consumed",
        "quarantined",
        "retired_stale",
        "generation_failed",
        "reward_timed_out",
        "reward_errored",
        "update_failed",
    }
)


def _tq() -> Any:
    import transfer_queue

    return transfer_queue


@attrs.frozen
class Group:
    """A GRPO group as the buffer sees it once it is terminal: the unit verl samples,
    evicts, refills and trains (never in part), and so the ledger's rollout.

    `low`/`high` are the oldest and newest weights that produced any of its tokens (verl's
    min/max_global_steps tags; None when verl's LLM server client wrote none), `rewards`
    each trajectory's reward from the tag `LedgerAgentLoopWorker` writes (None: not tagged,
    read from `rm_scores` when needed), `tokens` the response tokens of the group.
    """

    uid: str
    keys: tuple[str, ...]
    low: int | None
    high: int | None
    rewards: tuple[float, ...] | None
    tokens: int | None
    failed: bool


def _int_or_none(v: Any) -> int | None:
    return None if v is None or isinstance(v, bool) else int(v)


def group_of(
    uid: str, keys: Sequence[str], tags: Mapping[str, Mapping[str, Any]], failed: bool
) -> Group:
    """A terminal group from its trajectories' tags (no TransferQueue read)."""
    rows = [tags[k] for k in keys]
    low: int | None = None
    high: int | None = None
    rewards: list[float] = []
    tokens = 0
    for t in rows:  # verl's tags as its agent loop writes them: plain ints, a reward each
        lo, hi = t.get("min_global_steps"), t.get("max_global_steps")
        r, n = t.get(REWARD_TAG), t.get("response_len")
        if type(lo) is not int or (hi is not None and type(hi) is not int):
            return _group_of_any(uid, keys, rows, failed)
        if r is None or type(n) is not int:
            return _group_of_any(uid, keys, rows, failed)
        top = lo if hi is None else hi
        low = lo if low is None or lo < low else low
        high = top if high is None or top > high else high
        rewards.append(float(r))
        tokens += n
    if not rows:
        return _group_of_any(uid, keys, rows, failed)
    return Group(uid, tuple(keys), low, high, tuple(rewards), tokens, failed)


def _group_of_any(
    uid: str, keys: Sequence[str], rows: Sequence[Mapping[str, Any]], failed: bool
) -> Group:
    """`group_of` of tags with missing or other-typed values."""
    lows = [_int_or_none(t.get("min_global_steps")) for t in rows]
    highs = [_int_or_none(t.get("max_global_steps")) for t in rows]
    known = [v for v in lows if v is not None]
    tops = [
        v for h, lo in zip(highs, lows, strict=True) if (v := lo if h is None else h) is not None
    ]
    rewards = [r for t in rows if (r := t.get(REWARD_TAG)) is not None]
    lengths = [n for t in rows if (n := t.get("response_len")) is not None]
    return Group(
        uid,
        tuple(keys),
        min(known) if rows and len(known) == len(rows) else None,
        max(tops) if tops else None,
        tuple(float(r) for r in rewards) if rows and len(rewards) == len(rows) else None,
        sum(int(n) for n in lengths) if rows and len(lengths) == len(rows) else None,
        failed,
    )


class DispatchBook:
    """One run's dispatches in this process, shared by `LedgerAgentLoopManager` (which
    dispatches through the ledger before verl generates) and `LedgerReplayBuffer` (which
    judges a group by the version stamped at its dispatch without reading the ledger)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, LedgerEntry] = {}
        self.refused: set[str] = set()  # uids the ledger will never dispatch (no row)
        self.counters: Counter[str] = Counter()
        self.step = 0  # the trainer's global step, as the buffer last saw it
        self._retry: Callable[[], None] | None = None
        self._requeue: Callable[[str, Any], int] | None = None

    def record(self, entries: Iterable[LedgerEntry]) -> None:
        with self._lock:
            for e in entries:
                self._entries[e.rollout_id] = e

    def entry(self, uid: str) -> LedgerEntry | None:
        return self._entries.get(uid)

    def forget(self, uid: str) -> None:
        with self._lock:
            self._entries.pop(uid, None)
            self.refused.discard(uid)

    def count(self, **counts: int) -> None:
        with self._lock:
            self.counters.update(counts)

    def attach(
        self, retry: Callable[[], None], requeue: Callable[[str, Any], int] | None = None
    ) -> None:
        """Where held prompts are retried (the buffer calls it while it waits) and where an
        evicted group's prompt is dispatched again (pace, don't discard)."""
        self._retry, self._requeue = retry, requeue

    @property
    def pacing(self) -> bool:
        """Whether a `LedgerAgentLoopManager` dispatches this run's prompts."""
        return self._retry is not None

    def retry_held(self) -> None:
        if self._retry is not None:
            self._retry()

    def requeue(self, partition_id: str, uids: Sequence[str]) -> int:
        """Dispatch the prompts of evicted groups again as new attempts of their chains;
        how many went (the rest are refilled by verl with fresh prompts). A prompt the
        pacer refused for good (its chain's attempts are spent) is never sent again: it
        would be refused, failed and evicted again, without end."""
        with self._lock:
            uids = [u for u in uids if u not in self.refused]
        if self._requeue is None or not uids:
            return 0
        return int(self._requeue(partition_id, uids))

    def metrics(self, prefix: str = "rollout_lifecycle/dispatch/") -> dict[str, float]:
        with self._lock:
            return {prefix + k: float(v) for k, v in sorted(self.counters.items())}


_BOOKS: dict[tuple[str, str], DispatchBook] = {}
_BOOKS_LOCK = threading.Lock()


def book_for(ledger_url: str, run_id: str) -> DispatchBook:
    """The process's dispatch book of one run (created on first use)."""
    with _BOOKS_LOCK:
        return _BOOKS.setdefault((ledger_url, run_id), DispatchBook())


@runtime_checkable
class StepLedger(Ledger, Protocol):
    """A ledger with the one-step calls the buffer and the pacer make per step
    (`StoreLedger`, i.e. every backend `open_backend` builds)."""

    def land_and_reserve(
        self,
        update_id: str | None,
        landings: Sequence[Landing] = (),
        *,
        close: Sequence[tuple[str, str, Disposition]] = (),
        reserve: Mapping[str, AdmissionStamp] | None = None,
    ) -> LandedStep: ...

    def dispatch_many(
        self, rollouts: Sequence[tuple[Rollout | LedgerEntry, str | None]]
    ) -> list[DispatchOutcome]: ...

    def step_premise(self, update_ids: Sequence[str] = ()) -> StepPremise: ...


def step_ledger(ledger: Ledger) -> StepLedger:
    """The ledger as a StepLedger; VerlIntegrationError for one without those calls."""
    if not isinstance(ledger, StepLedger):
        raise VerlIntegrationError(
            f"{type(ledger).__name__} has no land_and_reserve/dispatch_many: open the ledger "
            "with rollout_lifecycle.model.backends.open_backend"
        )
    return ledger


TRAINER_MODES = ("sync", "colocate_async", "separate_async")


def check_verl_options(
    trainer_mode: str,
    max_off_policy_strategy: str,
    *,
    filter_groups: bool,
    sync_refill_failed_groups: bool,
) -> None:
    """Refuse the verl options the ledger-backed buffer cannot honour, warn about the one
    whose meaning it changes (docs/verl-v1.md, "verl options")."""
    if trainer_mode not in TRAINER_MODES:
        raise UnsupportedVerlOption(
            f"trainer.v1.trainer_mode={trainer_mode!r}: the buffer knows {TRAINER_MODES}"
        )
    if filter_groups:
        raise UnsupportedVerlOption(
            "algorithm.filter_groups (DAPO) is enabled, but verl never passes the group filter "
            "to a custom sampler, so it would be silently ignored: set "
            "algorithm.filter_groups.enable=false, or train without the ledger-backed buffer"
        )
    if sync_refill_failed_groups:
        raise UnsupportedVerlOption(
            "trainer.v1.sampler.sync_refill_failed_groups=true is never passed to a custom "
            "sampler by verl; the buffer follows verl's default (failed groups are trained "
            "padded in sync mode, evicted and refilled in async modes): remove the option"
        )
    if max_off_policy_strategy == "wait":
        warnings.warn(
            VerlOptionWarning(
                "max_off_policy_strategy=wait: verl blocks sampling until stale in-flight groups "
                "finish, but the ledger still retires any group more than the deployment's "
                "max_lag behind the active version (cause lag_<n>_over_<max>); raise max_lag, "
                "or use drop and pace generation with LedgerAgentLoopManager"
            ),
            stacklevel=3,
        )


class PacingTracker:
    """Pacing figures kept from what the buffer itself did, so a step costs the same at any
    ledger size (`ledger.statistics()` reads every row). Counts are this process's since it
    started; `rollout-lifecycle ledger stats` gives the whole ledger's."""

    def __init__(self) -> None:
        self.trained = 0
        self.lag_sum = 0
        self.lag_max: int | None = None
        self.generated_tokens = 0
        self.wasted_tokens = 0
        self.trained_lengths: Counter[int] = Counter()
        self.generated_lengths: Counter[int] = Counter()

    def landed(self, tokens: int | None) -> None:
        if tokens is not None:
            self.generated_tokens += tokens
            self.generated_lengths[tokens] += 1

    def wasted(self, tokens: int | None) -> None:
        if tokens is not None:
            self.wasted_tokens += tokens

    def committed(self, lags: Iterable[int], lengths: Iterable[int | None]) -> None:
        for lag in lags:
            self.trained += 1
            self.lag_sum += lag
            self.lag_max = lag if self.lag_max is None else max(self.lag_max, lag)
        for n in lengths:
            if n is not None:
                self.trained_lengths[n] += 1

    def metrics(self, prefix: str = "rollout_lifecycle/pacing/") -> dict[str, float]:
        out = {
            "trained": float(self.trained),
            "generated_tokens": float(self.generated_tokens),
            "wasted_tokens": float(self.wasted_tokens),
            "wasted_fraction": self.wasted_tokens / self.generated_tokens
            if self.generated_tokens
            else 0.0,
        }
        if self.trained and self.lag_max is not None:
            out["staleness_mean"] = self.lag_sum / self.trained
            out["staleness_max"] = float(self.lag_max)
        ks = histogram_ks(self.generated_lengths, self.trained_lengths)
        if ks is not None:
            out["length_bias_ks"] = ks
        return {prefix + k: v for k, v in out.items()}


def histogram_ks(a: Mapping[int, int], b: Mapping[int, int]) -> float | None:
    """Two-sample Kolmogorov-Smirnov distance of two length histograms (None: one empty);
    the same figure as `model.pacing.ks_distance` on the expanded samples, in O(lengths)."""
    na, nb = sum(a.values()), sum(b.values())
    if not na or not nb:
        return None
    ca = cb = 0
    gap = 0.0
    for x in sorted(set(a) | set(b)):
        ca += a.get(x, 0)
        cb += b.get(x, 0)
        gap = max(gap, abs(ca / na - cb / nb))
    return gap


class LedgerReplayBuffer(ReplayBufferAsync):  # type: ignore[misc]
    """verl's replay buffer whose every decision goes through the ledger, one GRPO group
    (verl's `uid`) per ledger rollout.

    Built by verl's trainer (`_build_replay_buffer`) with the custom-sampler arguments;
    everything of ours comes from `sampler_kwargs` (BufferSettings). Per `sample` call the
    ledger does a constant amount of work for any ledger size: at most one read of the
    open update ids' holdings and one commit (what the checkpoint engine has not committed
    yet), and one `land_and_reserve` step that lands the chosen groups and reserves them
    (a second one only when groups are evicted). Nothing reads the whole ledger after a
    process's first call.

    Modes follow verl's own buffers: in `sync` no group is dropped for staleness and a
    failed group's trajectories are trained (verl pads the missing ones); in the async
    modes stale (verl's `max_off_policy_threshold`) and failed groups are evicted and
    refilled. In every mode the ledger's lag gate (the deployment's `max_lag` against the
    registry's pointer) retires what is too stale, and a group generated by weights the
    registry has not activated waits for them (bounded: VersionMismatchError).
    """

    def __init__(
        self,
        trainer_mode: str,
        trainer_config: Any,
        max_off_policy_threshold: int | None,
        max_off_policy_strategy: str,
        sampler_kwargs: Any,
        poll_interval: float = 2.0,
        refill_fn: Callable[[int], Any] | None = None,
        filter_groups_metric: str | None = None,
        train_batch_size: int | None = None,
        gen_batch_size: int | None = None,
        max_inflight_gen_batches: int = 1,
        sync_refill_failed_groups: bool = False,
        *,
        backend: Backend | None = None,
    ) -> None:
        # verl's own checks of its arguments run first (its messages, its exceptions);
        # verl never passes the DAPO / sync-refill ones to a custom sampler
        super().__init__(
            trainer_mode=trainer_mode,
            trainer_config=trainer_config,
            max_off_policy_threshold=max_off_policy_threshold,
            max_off_policy_strategy=max_off_policy_strategy,
            sampler_kwargs=sampler_kwargs,
            poll_interval=poll_interval,
            refill_fn=refill_fn,
            filter_groups_metric=filter_groups_metric,
            train_batch_size=train_batch_size,
            gen_batch_size=gen_batch_size,
            max_inflight_gen_batches=max_inflight_gen_batches,
            sync_refill_failed_groups=sync_refill_failed_groups,
        )
        settings = BufferSettings.from_kwargs(sampler_kwargs)
        check_verl_options(
            trainer_mode,
            max_off_policy_strategy,
            filter_groups=settings.filter_groups or filter_groups_metric is not None,
            sync_refill_failed_groups=sync_refill_failed_groups,
        )
        self.settings = settings
        self._trainer_refill = refill_fn
        if refill_fn is not None:
            self.refill_fn = self._refill
        self._requeued = 0  # evicted prompts dispatched again, owed against verl's refill
        self.backend = backend or open_backend(
            self.settings.ledger_url, lease_seconds=self.settings.lease_seconds
        )
        self.ledger: StepLedger = step_ledger(self.backend.ledger)
        self.registry: RegistryStore = self.backend.registry
        self.book = book_for(self.settings.ledger_url, self.settings.run_id)
        self._groups: dict[str, Group] = {}  # uid -> terminal group (immutable once terminal)
        self._landed: dict[str, LedgerEntry] = {}  # uid -> its row as the ledger last said
        self._taken: set[str] = set()  # groups another update holds
        self._gone: set[str] = set()  # groups whose row ended: verl clears them, no training
        self._gone_now: set[str] = set()
        self._reserved: dict[str, list[tuple[int, int | None]]] = defaultdict(list)
        self._evict_cause: dict[str, tuple[str, Disposition]] = {}  # uid -> (event, why)
        self._future_since: dict[str, float] = {}  # uid -> when it first waited for weights
        self._held: set[str] = set()  # groups reserved in the sample call in progress
        self._keys_of: dict[str, dict[str, list[str]]] = {}  # partition -> uid -> keys
        self._open: dict[int, set[str]] = defaultdict(set)  # step -> update ids not settled
        self._minis: Counter[int] = Counter()
        self._hashes: dict[int, str] = {}  # version -> hash the registry activated
        self._premise: tuple[int | None, AdmissionPolicy | None] = (None, None)
        self._bad: frozenset[int] = frozenset()
        self._premise_fresh = False  # `_premise` read by this sample, for its first poll
        self._refills = 0
        self._refill_causes: Counter[str] = Counter()
        self._refill_bound: int | None = None
        self._settled_once = False
        self.tracker = PacingTracker()
        self.counters: Counter[str] = Counter()
        self.ledger_seconds = 0.0
        self.ledger_calls: Counter[str] = Counter()

    def _validate_mode_config(self) -> None:
        if self.trainer_mode == "sync":  # verl's sync buffer's checks, in sync mode
            ReplayBuffer._validate_mode_config(self)

    # -- the ledger, timed and counted: the benchmark's ledger-work figure is exactly this

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            self.ledger_seconds += time.perf_counter() - t0
            self.ledger_calls[what] += 1

    def _read_premise(self, update_ids: Sequence[str] = ()) -> dict[str, list[str]]:
        """The pointer, the policy, the bad versions and what `update_ids` hold: ONE read
        of the ledger (`step_premise`), kept for the next poll's verdicts."""
        got: StepPremise = self._call("ledger.step_premise", self.ledger.step_premise, update_ids)
        self._premise = (got.pointer, got.policy)
        self._bad = got.bad
        self._premise_fresh = True
        return got.held

    def _poll_premise(self) -> tuple[int | None, AdmissionPolicy | None, frozenset[int]]:
        """The premise a poll judges its groups on: the one `sample` read at its start for
        its first poll, a fresh read for each later one (verl polls while it waits)."""
        if not self._premise_fresh:
            self._read_premise()
        self._premise_fresh = False
        return (*self._premise, self._bad)

    def _hash(self, version: int) -> str:
        h = self._hashes.get(version)
        if h is None:
            got = self._call("registry.artifact", activated_hash, self.registry, version)
            if got is None:
                return f"unregistered-v{version}"
            h = self._hashes[version] = got
        return h

    # -- terminal groups, from the tags verl's agent loop wrote (no TransferQueue read) --

    def _group(self, partition_id: str, uid: str, keys_of: Mapping[str, list[str]]) -> Group:
        g = self._groups.get(uid)
        if g is None:
            part = self.partitions[partition_id]
            keys = sorted(keys_of.get(uid, ()))
            g = group_of(uid, keys, part, uid in self.failure_keys[partition_id])
            self._groups[uid] = g
        return g

    def _sync_metadata_from_transfer_queue(self) -> None:
        super()._sync_metadata_from_transfer_queue()
        self._keys_of.clear()  # a new snapshot: its grouping is built when first asked for

    def _keys_by_uid(self, partition_id: str) -> dict[str, list[str]]:
        """Trajectory keys by group, of this poll's snapshot (built once per snapshot)."""
        out = self._keys_of.get(partition_id)
        if out is None:
            out = self._keys_of[partition_id] = defaultdict(list)
            for key in self.partitions[partition_id]:
                out[key.split("_")[0]].append(key)
        return out

    def _version(self, g: Group) -> int | None:
        """The behaviour version the ledger judges the group by: the one stamped at dispatch
        (the ledger's), else the oldest weights verl says produced any token."""
        row = self._landed.get(g.uid) or self.book.entry(g.uid)
        if row is not None:
            return row.behavior_version
        return g.low

    def _verdict(
        self, g: Group, pointer: int | None, policy: AdmissionPolicy | None, bad: frozenset[int]
    ) -> tuple[str, Disposition] | None:
        """('stale'|'quarantine'|'wait', why) for a finished group, None when it may train."""
        v = self._version(g)
        if v is None:
            raise VerlIntegrationError(
                f"group {g.uid}: no min_global_steps tag on its trajectories and no dispatch "
                "record: verl's LLM server client sets the tag (a custom server must too), or "
                "dispatch through LedgerAgentLoopManager (the config group sets it)"
            )
        if bad:  # the versions it spans matter only when one of them failed to activate
            span = {v} | set(range(g.low if g.low is not None else v, (g.high or v) + 1))
            if span & bad:
                return "quarantine", Disposition(
                    "admission", "failed_version", f"v{sorted(span & bad)} failed to activate"
                )
        if pointer is None or policy is None:
            return None
        top = max(v, g.high if g.high is not None else v)
        if top > pointer:
            return "wait", Disposition("admission", "future_policy", f"v{top} > pointer v{pointer}")
        lag = pointer - v
        if lag > policy.max_lag:
            d = stale_disposition(lag, policy.max_lag, pointer)
            return "stale", Disposition("admission", f"lag_{lag}_over_{policy.max_lag}", d.detail)
        return None

    # -- verl's hooks: eviction reasons, sampleable groups, eviction, polling -----------

    def _terminal_eviction_reasons(
        self, global_steps: int, partition_id: str
    ) -> tuple[set[str], set[str], set[str], Counter[Any]]:
        if partition_id == "val":
            return set(), set(), set(), Counter()
        stale: set[str] = set()
        failed: set[str] = set()
        if self.trainer_mode != "sync":  # verl's own async rules: drop and failure eviction
            for uid in super()._stale_terminal_keys(global_steps, partition_id):
                span = global_steps - self.prompt_global_steps[partition_id].get(uid, 0) + 1
                self._evict_cause[uid] = (
                    "stale",
                    Disposition(
                        "admission",
                        "verl_off_policy_threshold",
                        f"span {span} > {self.max_off_policy_threshold}",
                    ),
                )
                stale.add(uid)
            failed = set(self.failure_keys[partition_id])
        stale |= self._gone & (self.finished_keys[partition_id] | self.failure_keys[partition_id])
        pointer, policy, bad = self._poll_premise()
        keys_of = self._keys_by_uid(partition_id)
        terminal = self.finished_keys[partition_id] | (
            self.failure_keys[partition_id] if self.trainer_mode == "sync" else set()
        )
        now = time.monotonic()
        for uid in terminal - stale - failed - self._held - self._taken:
            g = self._group(partition_id, uid, keys_of)
            if not g.keys:
                continue
            verdict = self._verdict(g, pointer, policy, bad)
            if verdict is None:
                self._future_since.pop(uid, None)
                continue
            kind, why = verdict
            if kind == "wait":
                since = self._future_since.setdefault(uid, now)
                if now - since > self.settings.version_wait_s:
                    raise VersionMismatchError(
                        f"group {uid} was generated with weights {why.detail.split(' >')[0]} "
                        f"that the registry has not activated after "
                        f"{self.settings.version_wait_s:.0f} s (active: v{pointer}): verl "
                        "syncs weights the registry never sees. Use the ledger's checkpoint "
                        "engine (actor_rollout_ref.rollout.checkpoint_engine.backend="
                        "rollout_lifecycle, set by `+rollout_lifecycle=ledger`), and check "
                        "`rollout-lifecycle deployment show` for a failed activation"
                    )
                continue
            self._evict_cause.setdefault(uid, (kind, why))
            stale.add(uid)
        return stale, set(), failed, Counter()

    def _sampleable_terminal_keys(self, partition_id: str, eviction_reasons: Any) -> set[str]:
        keys: set[str] = set(super()._sampleable_terminal_keys(partition_id, eviction_reasons))
        if partition_id == "val":
            return keys
        return keys - self._held - self._taken - set(self._future_since)

    def _has_enough_samples(
        self, global_steps: int, partition_id: str, batch_size: int, sampleable_keys: set[str]
    ) -> bool:
        if self.trainer_mode == "sync":  # verl: off-policy strategies are a no-op in sync
            return len(sampleable_keys) >= batch_size
        return bool(
            super()._has_enough_samples(global_steps, partition_id, batch_size, sampleable_keys)
        )

    def _evict_terminal_groups(
        self, global_steps: int, partition_id: str, eviction_reasons: Any
    ) -> Any:
        if partition_id != "val":
            stale_uids, _dapo, failed_uids, _counts = eviction_reasons
            evicted = set(stale_uids) | set(failed_uids)
            if evicted:
                self._record_evictions(partition_id, evicted, set(failed_uids))
        return super()._evict_terminal_groups(global_steps, partition_id, eviction_reasons)

    def _record_evictions(self, partition_id: str, uids: set[str], failed: set[str]) -> None:
        """Every evicted group ends in the ledger with its cause before verl clears it."""
        keys_of = self._keys_by_uid(partition_id)
        groups = [self._group(partition_id, u, keys_of) for u in sorted(uids)]
        need = [g for g in groups if g.uid not in failed and g.rewards is None and g.keys]
        rewards = self._fetch_rewards(partition_id, need) if need else {}
        landings: list[Landing] = []
        close: list[tuple[str, str, Disposition]] = []
        self._gone_now = {g.uid for g in groups if g.uid in self._gone}
        for g in groups:
            v = self._version(g)
            if g.uid in self._gone:
                continue  # its row already ended with its own cause
            if g.uid in failed or not g.keys:
                why = Disposition("generation", "group_failure", f"{len(g.keys)} trajectories")
                landings.append(self._landing(g, v, None, failure=why))
                self._refill_causes["group_failure"] += 1
                continue
            kind, d = self._evict_cause.get(g.uid, ("stale", Disposition("admission", "stale")))
            r = g.rewards or rewards.get(g.uid)
            landings.append(self._landing(g, v, r))
            scored = r is not None
            event = "retire_stale" if kind == "stale" and scored else "quarantine"
            close.append((g.uid, event, d))
            self._refill_causes[d.cause] += 1
        step = (
            self._call(
                "ledger.land_and_reserve", self.ledger.land_and_reserve, None, landings, close=close
            )
            if landings or close
            else None
        )
        # the landed groups' prompts dispatched again, before `forget` drops what the book
        # knows of them (which prompts the pacer refused for good)
        again = [g.uid for g in groups if g.uid not in self._gone_now]
        if again and self.book.pacing:
            self._requeued += self.book.requeue(partition_id, again)
        for g in groups:
            self._gone.discard(g.uid)
            self._landed.pop(g.uid, None)
            self._groups.pop(g.uid, None)
            self._evict_cause.pop(g.uid, None)
            self.book.forget(g.uid)
            self.tracker.landed(g.tokens)
            self.tracker.wasted(g.tokens)
            row = None if step is None else step.entries.get(g.uid)
            self.counters[f"evicted/{row.state if row else 'ended'}"] += 1
        self._refills += len(groups)
        bound = self._refill_bound
        if bound is not None and self._refills > bound:
            raise RefillLoopError(
                f"one sample call evicted and refilled {self._refills} groups (bound {bound}); "
                f"causes {dict(self._refill_causes)}. A cause that repeats without end means "
                "the pointer, the policy or verl's threshold rejects everything generated: "
                "check `rollout-lifecycle deployment show` and the policy's max_lag"
            )

    def _refill(self, num_prompts: int) -> int:
        """verl's refill: evicted prompts already dispatched again (pace, don't discard)
        count first; verl's trainer fetches fresh prompts for the rest."""
        again = min(num_prompts, self._requeued)
        self._requeued -= again
        if num_prompts > again and self._trainer_refill is not None:
            self._trainer_refill(num_prompts - again)
        return num_prompts

    def _wait_for_next_poll(self, partition_id: str, last_debug_time: float) -> float:
        self.book.retry_held()
        return float(super()._wait_for_next_poll(partition_id, last_debug_time))

    # -- rewards --------------------------------------------------------------------------

    def _fetch_rewards(
        self, partition_id: str, groups: Sequence[Group]
    ) -> dict[str, tuple[float, ...]]:
        """Rewards of groups whose trajectories carry no reward tag: verl's `rm_scores`
        (one TransferQueue read for all of them)."""
        keys = [k for g in groups for k in g.keys]
        if not keys:
            return {}
        try:
            td = _tq().kv_batch_get(
                keys=keys, partition_id=partition_id, select_fields=["rm_scores"]
            )
            rows = _rows(_field(td, "rm_scores"), len(keys), "rm_scores")
        except (KeyError, ValueError, RuntimeError) as exc:
            raise VerlIntegrationError(
                f"no reward on trajectories {keys[:3]}...: the ledger records each group's "
                "reward before it is reserved; use verl's streaming reward (reward loop "
                "workers) so rm_scores exist at sampling time, and LedgerAgentLoopManager "
                f"(it tags each trajectory's reward). TransferQueue said: {exc}"
            ) from None
        by_key = {
            k: float(_np(r).astype(np.float64).sum()) for k, r in zip(keys, rows, strict=True)
        }
        return {g.uid: tuple(by_key[k] for k in g.keys) for g in groups}

    def _landing(
        self,
        g: Group,
        version: int | None,
        rewards: tuple[float, ...] | None,
        failure: Disposition | None = None,
    ) -> Landing:
        v = 0 if version is None else version
        reward = group_reward(self.settings.reward, rewards)
        dispatched = self.book.entry(g.uid)  # its row names the version and hash already
        h = dispatched.artifact_hash if dispatched is not None else self._hash(v)
        return Landing(g.uid, v, h, reward=reward, tokens=g.tokens, failure=failure)

    # -- settle: commit landed updates, release those a resumed trainer redoes ------------

    def _due_updates(self, global_steps: int) -> list[str]:
        """The open updates of steps before `global_steps`: what `settle` commits."""
        return [u for s in sorted(self._open) if s < global_steps for u in sorted(self._open[s])]

    def settle(
        self, global_steps: int, holdings: Mapping[str, list[str]] | None = None
    ) -> dict[str, int]:
        """Commit this run's reservations of steps < `global_steps` not committed yet (the
        checkpoint engine commits step N when it publishes N; this is the fallback), and,
        at a process's first call, release the reservations a dead process made for steps
        >= `global_steps` (a resumed trainer redoes them). `holdings`: what open updates
        hold, as `sample` read it with its premise (else read here, in one read)."""
        committed = released = 0
        if not self._settled_once:
            self._settled_once = True
            for step in range(max(global_steps - 1, 0), global_steps):
                self._open[step].update(self._probe(step))
            step = global_steps
            while True:  # the dead process's later steps, contiguous from this one
                found = self._probe(step)
                if not found:
                    break
                for uid in found:
                    released += len(self._call("ledger.abort", self.ledger.abort, uid))
                step += 1
        due = sorted(s for s in self._open if s < global_steps)
        if holdings is None and due:
            holdings = self._read_premise(self._due_updates(global_steps))
        for step in due:
            for uid in sorted(self._open[step]):
                ids = (holdings or {}).get(uid)
                if ids is None:  # found by the first call's probe, after `holdings` was read
                    ids = self._call("ledger.reserved_by", self.ledger.reserved_by, uid)
                if ids:  # else the checkpoint engine committed it when it published the step
                    committed += len(self._call("ledger.commit", self.ledger.commit, uid, ids))
                for u in ids:
                    self._landed.pop(u, None)
                held = self._reserved.pop(uid, [])
                self.tracker.committed([lag for lag, _ in held], [n for _, n in held])
            del self._open[step]
        self.counters["committed"] += committed
        self.counters["released"] += released
        return {"committed": committed, "released": released}

    def _probe(self, step: int) -> list[str]:
        """Update ids of `step` that hold reservations (minis are numbered from 0)."""
        out: list[str] = []
        mini = 0
        while True:
            uid = update_id_for(self.settings.run_id, step, mini)
            if not self._call("ledger.reserved_by", self.ledger.reserved_by, uid):
                return out
            out.append(uid)
            mini += 1

    def _reconcile(self, partition_id: str) -> int:
        """On a run's own ledger, at a process's first sample: a group the ledger holds as
        live but TransferQueue no longer has (verl restored its checkpoint from before it
        was dispatched or written) can never train; it ends with that cause. Reads the
        whole ledger once per process (`owns_ledger` only)."""
        self._sync_metadata_from_transfer_queue()
        present: set[str] = set()
        for part in (self.pending_keys, self.running_keys, self.finished_keys, self.failure_keys):
            for pid, uids in part.items():
                if pid != "val":
                    present |= uids
        for pid, items in self.partitions.items():
            if pid != "val":
                present |= {k.split("_")[0] for k in items}
        gone = [
            (rid, e)
            for rid, e in self._call("ledger.snapshot", self.ledger.snapshot).items()
            if e.state in ("dispatched", "generated", "rewarded") and rid not in present
        ]
        d = Disposition("admission", "dropped_by_resume", "not in the restored TransferQueue")
        close = [
            (
                rid,
                "generation_failed" if e.state == "dispatched" else "quarantine",
                attrs.evolve(d, stage="generation") if e.state == "dispatched" else d,
            )
            for rid, e in gone
        ]
        if close:
            self._call("ledger.land_and_reserve", self.ledger.land_and_reserve, None, close=close)
        del partition_id
        return len(close)

    def finish(self, global_steps: int) -> dict[str, int]:
        """After the last step landed (the ledger's checkpoint engine commits it when it
        publishes the step's weights; call this where another engine syncs them)."""
        return self.settle(global_steps + 1)

    def fail_step(self, global_steps: int) -> int:
        """The step's update failed: release its reservations (typed cause in the ledger)."""
        n = 0
        for uid in list(self._open.get(global_steps, ())):
            n += len(self._call("ledger.abort", self.ledger.abort, uid))
            self._open[global_steps].discard(uid)
        self.counters["released"] += n
        return n

    # -- sample -------------------------------------------------------------------------

    def sample(
        self, global_steps: int, partition_id: str, batch_size: int
    ) -> tuple[Any, dict[str, Any]]:
        """Evict (with causes, refilling), then land and reserve `batch_size` groups."""
        if partition_id == "val":
            meta, extra = super().sample(global_steps, partition_id, batch_size)
            return meta, dict(extra)
        if not self._settled_once and self.settings.owns_ledger:
            self.counters["dropped_by_resume"] += self._reconcile(partition_id)
        # one read: the premise of the first poll, and what the steps not settled hold
        settled = self.settle(global_steps, self._read_premise(self._due_updates(global_steps)))
        self.book.step = global_steps
        self.book.retry_held()
        mini = self._minis[global_steps]
        self._minis[global_steps] += 1
        update = update_id_for(self.settings.run_id, global_steps, mini)
        self._refills = 0
        self._refill_causes.clear()
        self._refill_bound = (
            self.settings.max_refills
            if self.settings.max_refills is not None
            else 16 * max(batch_size, 1) + 16
        )
        self._held = set()
        metrics: dict[str, Any] = {}
        refused: Counter[str] = Counter()
        lags: list[int] = []
        rounds = 0
        while len(self._held) < batch_size:
            rounds += 1
            if rounds > 32:
                raise VerlIntegrationError(
                    f"step {global_steps}: {len(self._held)} of {batch_size} groups reserved "
                    f"after 32 rounds; refusals {dict(refused)}"
                )
            need = batch_size - len(self._held)
            sampleable, evict_metrics = self.wait_for_sampleable(global_steps, partition_id, need)
            for k, v in evict_metrics.items():
                metrics[k] = metrics.get(k, 0) + v if isinstance(v, int | float) else v
            chosen, _snap, _steps = self._select_prompt_uids(partition_id, sampleable, need)
            got = self._reserve(partition_id, update, chosen)
            for uid, (ok, why, lag) in got.items():
                if ok:
                    self._held.add(uid)
                    lags.append(lag)
                else:
                    refused[why] += 1
        self._open[global_steps].add(update)
        selected = self._select_order(partition_id, self._held)
        if self.trainer_mode == "sync" and not any(
            self._groups[u].keys for u in selected if u in self._groups
        ):
            raise RuntimeError(
                "Sync replay buffer selected terminal groups with no materializable "
                "trajectories. Enable trainer.v1.sampler.sync_refill_failed_groups to replace "
                "failed groups."
            )
        meta = self._materialize_batch(partition_id, selected, dict(self.partitions[partition_id]))
        for uid in selected:
            self._groups.pop(uid, None)
            self._future_since.pop(uid, None)
        self._held = set()
        pointer = self._premise[0]
        metrics.update(
            {
                "rollout_lifecycle/reserved": len(selected),
                "rollout_lifecycle/committed": settled["committed"],
                "rollout_lifecycle/released": settled["released"],
                "rollout_lifecycle/lag_max": max(lags, default=0),
                "rollout_lifecycle/pointer": -1 if pointer is None else pointer,
                "rollout_lifecycle/drift_measured": 0,
                "rollout_lifecycle/refused": sum(refused.values()),
                "rollout_lifecycle/refills": self._refills,
            }
        )
        metrics.update(self.tracker.metrics())
        metrics.update(self.book.metrics())
        return meta, metrics

    def _select_order(self, partition_id: str, uids: set[str]) -> list[str]:
        steps = self.prompt_global_steps[partition_id]
        return sorted(uids, key=lambda u: (steps.get(u, 0), u))

    def _reserve(
        self, partition_id: str, update: str, chosen: Sequence[str]
    ) -> dict[str, tuple[bool, str, int]]:
        """Land the chosen groups and reserve them for `update`: ONE ledger step. Returns
        uid -> (reserved, reason, lag); a group that cannot be ours is never offered again."""
        pointer, policy = self._premise
        if pointer is None or policy is None:
            self._read_premise()
            pointer, policy = self._premise
        if policy is None or pointer is None:
            raise VerlIntegrationError(
                "the deployment records no admission policy or no active version: run "
                "`rollout-lifecycle verl setup --backend URL --run-id ID --max-lag N "
                "--max-drift X` on the run's ledger before training (it prints the overrides)"
            )
        keys_of = self._keys_by_uid(partition_id)
        groups = [self._group(partition_id, u, keys_of) for u in chosen]
        need = [g for g in groups if g.rewards is None and g.keys and g.uid not in self._landed]
        fetched = self._fetch_rewards(partition_id, need) if need else {}
        landings: list[Landing] = []
        stamps: dict[str, AdmissionStamp] = {}
        by_version: dict[int, AdmissionStamp] = {}
        out: dict[str, tuple[bool, str, int]] = {}
        for g in groups:
            v = self._version(g)
            if not g.keys:  # sync: a failed group with nothing to train (verl pads it)
                if v is not None or self.book.entry(g.uid) is not None:
                    why = Disposition("generation", "group_failure", "no trajectories")
                    landings.append(self._landing(g, v, None, why))
                out[g.uid] = (True, "empty", 0)
                continue
            assert v is not None  # _verdict refused a group without one
            if g.uid not in self._landed:
                landings.append(self._landing(g, v, g.rewards or fetched.get(g.uid)))
            stamp = by_version.get(v)
            if stamp is None:  # one stamp per version: the groups of a version share it
                stamp = by_version[v] = AdmissionStamp(
                    current_version=pointer,
                    behavior_version=v,
                    max_lag=policy.max_lag,
                    max_drift=policy.max_drift,
                    drift=0.0,  # bypass: the behaviour policy is the update's proximal policy
                    freshness=classify_lag(pointer - v, policy.max_lag),
                    reason="ok",
                    accepted=True,
                )
            stamps[g.uid] = stamp
        step = self._call(
            "ledger.land_and_reserve",
            self.ledger.land_and_reserve,
            update,
            landings,
            reserve=stamps,
        )
        if any(why == NOT_DISPATCHED for why in step.skipped.values()):
            raise VerlIntegrationError(
                "the deployment records a pacing policy, under which every group enters the "
                "ledger through dispatch, and these groups were never dispatched: "
                f"{sorted(u for u, w in step.skipped.items() if w == NOT_DISPATCHED)[:3]}. "
                "Set actor_rollout_ref.rollout.agent.agent_loop_manager_class="
                "rollout_lifecycle.gpu_check.verl_v1_pacing.LedgerAgentLoopManager (the config "
                "group `+rollout_lifecycle=ledger` does), or record a policy without "
                "batch_size/max_attempts"
            )
        for x in landings:
            g = self._groups[x.rollout_id]
            self.tracker.landed(g.tokens)
            row = step.entries.get(x.rollout_id)
            if row is not None:
                self._landed[x.rollout_id] = row
        for o in step.outcomes:
            row = step.entries.get(o.rollout_id)
            if o.reserved:
                out[o.rollout_id] = (True, o.reason, stamps[o.rollout_id].lag)
                continue
            out[o.rollout_id] = (False, o.reason, 0)
            if row is not None and row.behavior_version != stamps[o.rollout_id].behavior_version:
                self._landed[o.rollout_id] = row  # judge it by the ledger's version next time
            elif row is not None and row.state in _ENDED:
                # it can never train (consumed before a resume restored it, quarantined on
                # arrival...): verl clears it from TransferQueue and refills its slot
                self._evict_cause[o.rollout_id] = (
                    "ended",
                    row.disposition or Disposition("admission", row.state),
                )
                self._gone.add(o.rollout_id)
            elif o.reason != rules.POINTER_MOVED:
                self._taken.add(o.rollout_id)  # another update holds it
        self._reserved[update].extend(
            (stamps[u].lag, self._groups[u].tokens)
            for u, (ok, _w, _l) in out.items()
            if ok and u in stamps
        )
        return out


# ---- (c) two-phase activation around verl's weight sync -----------------------------------


def commit_step(ledger: Ledger, run_id: str, step: int) -> int:
    """Commit every mini-batch update of `run_id`'s step `step` that still holds
    reservations (`{run}.s{step}.m0`, `.m1`, ... until one holds none); how many rollouts."""
    n = 0
    for mini in itertools.count():
        uid = update_id_for(run_id, step, mini)
        ids = ledger.reserved_by(uid)
        if not ids:
            return n
        n += len(ledger.commit(uid, ids))
    return n  # pragma: no cover - count() never ends


def replica_worker_id(rank: int) -> str:
    """The registry's name for rollout worker `rank` of the checkpoint topology."""
    return f"rollout-{rank}"


@CheckpointEngineRegistry.register(BACKEND_NAME)
class LedgerCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """verl checkpoint engine: publish a committed artifact, ack (version, hash), then flip.

    engine_kwargs (`actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rollout_lifecycle`):
    `ledger_url` (sqlite:///... shared by every process), `artifact_root` (a directory every
    process reads), `ack_timeout_s`, `run_id` (the buffer's). The actor master writes the
    version, waits for every required rollout worker's ack and tries to activate; any
    failure keeps the old pointer, is recorded at its stage and quarantines the version's
    rollouts.

    Publishing step N's weights is also where step N's reservations are committed (with
    `run_id`): verl calls `update_weights(global_steps=N)` from every trainer's
    `on_step_end`, after step N's update ran, including the last step, after which verl
    calls nothing the buffer could see. The weights published as vN hold those gradients,
    whether or not their distribution then succeeds.
    """

    def __init__(
        self,
        bucket_size: int = 0,
        is_master: bool = False,
        *,
        ledger_url: str,
        artifact_root: str,
        ack_timeout_s: float = 120.0,
        poll_s: float = 0.05,
        fail_worker: str | None = None,
        run_id: str | None = None,
    ) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.ledger_url = ledger_url
        self.store = ArtifactStore(Path(artifact_root))
        self.ack_timeout_s = float(ack_timeout_s)
        self.poll_s = float(poll_s)
        self.fail_worker = fail_worker  # a negative control: this worker never acks
        self.role = "actor"
        self.rank = 0
        self.n_rollout = 0
        # orders this process's acks after every earlier process's: microseconds since the
        # epoch, never reduced modulo anything (a wrapped counter makes a later process's
        # acks look older than a dead one's, and every one of them is refused as out of order)
        self.incarnation = time.time_ns() // 1000
        self.run_id = run_id
        self.last: dict[str, Any] = {}
        self.acks: list[tuple[int, str]] = []  # (version, how the registry took this ack)
        self.committed: dict[int, int] = {}  # step -> rollouts committed at its publication
        self.voided: list[int] = []  # versions whose dead master's attempt this one closed
        if is_master:
            self._void_orphaned_attempts()

    def _void_orphaned_attempts(self) -> None:
        """A master starting finds any attempt still awaiting acks orphaned: only the master
        that distributed it could activate it, and that process is gone (one master per run).

        It is failed here, at construction, before verl asks any replica to receive: a
        resumed replica then waits for the retry (`_load` waits out a failed distribution)
        and acks the attempt the new master awaits. Failing it later, in `send_weights`,
        raced the replicas verl starts at the same time: one could load and ack the dead
        attempt just before the retry replaced it, and never ack again (the ack timed out,
        the survivor's ack uncounted). A missing ledger, or one that never distributed, holds
        nothing to void.
        """
        try:
            open_backend(self.ledger_url, create=False).close()
        except RolloutLifecycleError:
            return
        backend = self._backend()
        try:
            if backend.registry.required_workers() is None:
                return  # nothing was ever distributed
            coord = ActivationCoordinator(backend.registry)
            for rec in coord.artifacts():
                if rec.state == "awaiting_acks":
                    coord.fail_distribution(
                        rec.version, "trainer_restarted", "its master died before it activated"
                    )
                    self.voided.append(rec.version)
        finally:
            backend.close()

    def _backend(self) -> Backend:
        return open_backend(self.ledger_url)

    # verl's topology calls: no process group, the artifact store is the transport
    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        del metadata
        actor: dict[str, list[Any]] = {
            "role": ["actor"] * actor_wg_world_size,
            "rank": list(range(actor_wg_world_size)),
            "n_rollout": [rollout_world_size] * actor_wg_world_size,
        }
        rollout: dict[str, list[Any]] = {
            "role": ["rollout"] * rollout_world_size,
            "rank": list(range(rollout_world_size)),
            "n_rollout": [rollout_world_size] * rollout_world_size,
        }
        return actor, rollout

    def init_process_group(self, role: str = "actor", rank: int = 0, n_rollout: int = 0) -> None:
        self.role, self.rank, self.n_rollout = role, int(rank), int(n_rollout)

    def finalize(self) -> None:
        return None

    # actor side ------------------------------------------------------------------------

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Master: write + commit + distribute vN, await every ack, activate or fail."""
        named = [(str(n), t) for n, t in weights]
        if not self.is_master or self.rank != 0:
            return {}
        if global_steps is None:
            raise WeightSyncError("distribution: verl passed no global_steps; nothing to version")
        return await asyncio.to_thread(self._publish, int(global_steps), named)

    def _publish(self, version: int, named: list[tuple[str, Any]]) -> dict[str, Any]:
        from rollout_lifecycle.gpu_check.hashing import to_numpy

        required = [replica_worker_id(i) for i in range(max(self.n_rollout, 1))]
        backend = self._backend()
        try:
            if self.run_id:
                self.committed[version] = commit_step(backend.ledger, self.run_id, version)
            members = backend.registry.required_workers()
            coord = ActivationCoordinator(
                backend.registry, required if members is None else None, ledger=backend.ledger
            )
            if backend.registry.required_workers() != tuple(required):
                coord.change_membership(required, f"verl rollout topology at v{version}")
            # numpy has no bfloat16: widen (exactly) to float32 for the artifact
            tensors = {
                n: to_numpy(t.float() if str(getattr(t, "dtype", "")) == "torch.bfloat16" else t)
                for n, t in named
            }
            rec = backend.registry.artifact(version)
            if rec is not None:
                return self._republish(coord, version, rec, tensors)
            coord.prepare(version, parent_version=self._parent(backend))
            try:
                stored = self.store.write(version, tensors=tensors, label=f"verl-step-{version}")
                self.store.verify(version, stored.artifact_hash)
            except RolloutLifecycleError as exc:
                coord.fail_commit(version, "artifact_write_failed", str(exc))
                raise WeightSyncError(f"artifact: v{version}: {exc}") from None
            coord.commit_artifact(version, stored.artifact_hash, str(stored.path))
            coord.distribute(version)
            return self._await_acks(coord, version, stored.artifact_hash)
        finally:
            backend.close()

    def _await_acks(
        self, coord: ActivationCoordinator, version: int, artifact_hash: str
    ) -> dict[str, Any]:
        """Activate once every required worker acked; after the timeout record the failure."""
        deadline = time.monotonic() + self.ack_timeout_s
        while True:
            res = coord.try_activate(version)
            if res.activated or time.monotonic() > deadline:
                break
            time.sleep(self.poll_s)
        if not res.activated:
            coord.fail_distribution(
                version,
                res.reason,
                f"missing {list(res.missing_workers)}, mismatched {list(res.mismatched_workers)}",
            )
        self.last = {
            "version": version,
            "artifact_hash": artifact_hash,
            "activated": res.activated,
            "reason": res.reason,
        }
        return {
            "rollout_lifecycle/activated": float(res.activated),
            "rollout_lifecycle/pointer": float(
                -1 if res.active_pointer is None else res.active_pointer.version
            ),
        }

    @staticmethod
    def _parent(backend: Backend) -> int | None:
        p = backend.registry.pointer()
        return None if p is None else p.version

    def _republish(
        self,
        coord: ActivationCoordinator,
        version: int,
        rec: ArtifactRecord,
        tensors: Mapping[str, Any],
    ) -> dict[str, Any]:
        """A resumed trainer re-sends a version number it registered before it died.

        The active version: nothing to do. One whose distribution failed or never finished:
        distributed again only if the resumed weights are bit-identical to the committed
        artifact (a checkpoint restores exactly what was published); anything else is
        refused, since a version number never names two different artifacts.
        """
        from rollout_lifecycle.gpu_check.hashing import tensors_sha256

        if rec.state == "active":
            self.last = {"version": version, "activated": True, "reason": "already_active"}
            return {"rollout_lifecycle/activated": 1.0}
        if rec.state in ("awaiting_acks", "distribution_failed") and rec.artifact_hash:
            held, _ack = WorkerLoader(self.store, "verl-actor").load(version, rec.artifact_hash)
            if tensors_sha256(held.tensors) == tensors_sha256(tensors):
                if rec.state == "awaiting_acks":  # this process's own attempt (a dead one's
                    # was voided when this master was built)
                    coord.fail_distribution(version, "trainer_restarted", "acks of a dead attempt")
                coord.retry(version)
                return self._await_acks(coord, version, rec.artifact_hash)
        raise WeightSyncError(
            f"distribution: v{version} is already registered ({rec.state}) with other weights; "
            "registry versions only move forward, so it cannot be republished under that number"
        )

    # rollout side ----------------------------------------------------------------------

    async def receive_weights(self, global_steps: int | None = None) -> Any:
        """Wait for vN to await acks, load it through the verifying loader, yield its
        tensors, then ack (version, hash of the bytes loaded, this attempt's token)."""
        import torch

        if global_steps is None:
            raise WeightSyncError("distribution: no global_steps to load")
        version = int(global_steps)
        worker = replica_worker_id(self.rank)
        loaded, ack_args = await asyncio.to_thread(self._load, version, worker)
        for name, arr in sorted(loaded.tensors.items()):
            yield name, torch.from_numpy(np.array(arr))
        if ack_args is not None and worker != self.fail_worker:
            await asyncio.to_thread(self._ack, ack_args)

    def _load(self, version: int, worker: str) -> tuple[Any, Any]:
        backend = self._backend()
        try:
            deadline = time.monotonic() + self.ack_timeout_s
            while True:
                rec = backend.registry.artifact(version)
                if rec is not None and rec.state in ("awaiting_acks", "active"):
                    break
                # a failed distribution may be retried by a resumed trainer: keep waiting
                if rec is not None and rec.state in ("commit_failed", "abandoned"):
                    raise WeightSyncError(f"distribution: v{version} is {rec.state}")
                if time.monotonic() > deadline:
                    raise WeightSyncError(f"distribution: v{version} never became loadable")
                time.sleep(self.poll_s)
            assert rec.artifact_hash is not None
            coord = ActivationCoordinator(backend.registry)
            token = coord.attempt_token(worker, version) if rec.state == "awaiting_acks" else None
            loader = WorkerLoader(self.store, worker, incarnation=self.incarnation)
            loaded, ack = loader.load(version, rec.artifact_hash, token=token, attempt=rec.attempts)
            # the coordinator numbers a worker's reports by arrival (one loader per load)
            return loaded, attrs.evolve(ack, seq=None)
        finally:
            backend.close()

    def _ack(self, ack: Any) -> Any:
        """Record the ack. One that answers an attempt the master has since replaced (a
        resumed trainer's retry of the same version issues new tokens while this replica
        was loading) is sent again with the current attempt's token: the bytes it loaded
        are the artifact the new attempt distributes (same version, same hash)."""
        backend = self._backend()
        try:
            coord = ActivationCoordinator(backend.registry)
            res = coord.record_ack(ack)
            if res.reason in (STALE_ATTEMPT_TOKEN, MISSING_ATTEMPT_TOKEN):
                rec = backend.registry.artifact(ack.version)
                if (
                    rec is not None
                    and rec.state == "awaiting_acks"
                    and rec.artifact_hash == ack.artifact_hash
                ):
                    token = coord.attempt_token(ack.worker_id, ack.version)
                    res = coord.record_ack(attrs.evolve(ack, token=token, attempt=rec.attempts))
            self.acks.append((ack.version, res.reason))
            return res
        finally:
            backend.close()


def iter_named(tensors: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs in name order: the generator verl's actor hands send_weights."""
    yield from sorted(tensors.items())
