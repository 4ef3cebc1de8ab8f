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
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

from rollout_lifecycle.gpu_check.errors import GpuCheckError
from rollout_lifecycle.model.admission import Admitted, admit_and_reserve
from rollout_lifecycle.model.artifacts import ArtifactStore, WorkerLoader
from rollout_lifecycle.model.backends import Backend, open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.errors import RolloutLifecycleError
from rollout_lifecycle.model.ledger import Ledger
from rollout_lifecycle.model.pacing import pacing_metrics
from rollout_lifecycle.model.records import (
    ActionEvidence,
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

_UPDATE = re.compile(r"^(?P<run>.+)\.s(?P<step>\d+)\.m(?P<mini>\d+)\.a(?P<attempt>\d+)$")


def update_id_for(run_id: str, step: int, mini: int, attempt: int) -> str:
    """`{run}.s{step}.m{mini-batch}.a{attempt}`: which step's update holds a reservation."""
    return f"{run_id}.s{step:08d}.m{mini}.a{attempt}"


def step_of(update_id: str, run_id: str) -> int | None:
    """The global step an update id of `run_id` belongs to (None: another run's)."""
    m = _UPDATE.match(update_id)
    if m is None or m.group("run") != run_id:
        return None
    return int(m.group("step"))


@attrs.frozen
class BufferSettings:
    """What the buffer reads from `trainer.v1.sampler.sampler_kwargs`."""

    ledger_url: str
    run_id: str
    conditions: GenerationConditions
    reward: RewardIdentity
    dataset: str = "verl"
    lease_seconds: float = 3600.0
    drift_source: str = "bypass"
    owns_ledger: bool = False

    @classmethod
    def from_kwargs(cls, kw: Mapping[str, Any]) -> BufferSettings:
        """Typed settings; VerlIntegrationError names the missing key."""
        kw = dict(kw or {})
        need = ("ledger_url", "run_id", "tokenizer_id", "temperature", "response_length")
        missing = [k for k in need if kw.get(k) in (None, "")]
        if missing:
            raise VerlIntegrationError(
                "trainer.v1.sampler.sampler_kwargs lacks "
                + ", ".join(missing)
                + " (see docs/verl-v1.md for the keys)"
            )
        if kw.get("drift_source", "bypass") != "bypass":
            raise VerlIntegrationError(
                "drift_source must be 'bypass': sample() runs before any learner log-prob exists"
            )
        return cls(
            ledger_url=str(kw["ledger_url"]),
            run_id=str(kw["run_id"]),
            conditions=conditions_from_rollout_config(kw, str(kw["tokenizer_id"])),
            reward=RewardIdentity(
                str(kw.get("reward_fn_id", "verl-reward-loop")),
                str(kw.get("reward_fn_version", "1")),
            ),
            dataset=str(kw.get("dataset", "verl")),
            lease_seconds=float(kw.get("lease_seconds", 3600.0)),
            owns_ledger=str(kw.get("owns_ledger", False)).lower() in ("true", "1"),
        )


def _tq() -> Any:
    import transfer_queue

    return transfer_queue


class LedgerReplayBuffer(ReplayBufferAsync):  # type: ignore[misc]
    """verl's `ReplayBufferAsync` whose every decision goes through the ledger.

    Built by verl's trainer (`_build_replay_buffer`) with the standard custom-sampler
    arguments; everything of ours comes from `sampler_kwargs` (BufferSettings).
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
        *,
        backend: Backend | None = None,
    ) -> None:
        super().__init__(
            trainer_mode=trainer_mode,
            trainer_config=trainer_config,
            max_off_policy_threshold=max_off_policy_threshold,
            max_off_policy_strategy=max_off_policy_strategy,
            sampler_kwargs=sampler_kwargs,
            poll_interval=poll_interval,
            refill_fn=refill_fn,
        )
        self.settings = BufferSettings.from_kwargs(sampler_kwargs)
        self.backend = backend or open_backend(
            self.settings.ledger_url, lease_seconds=self.settings.lease_seconds
        )
        self.ledger: Ledger = self.backend.ledger
        self.registry: RegistryStore = self.backend.registry
        self._tags: dict[str, dict[str, Any]] = {}  # key -> tag, this poll's train partition
        self._known: set[str] = set()  # trajectory keys already in the ledger
        self._items: dict[str, Trajectory] = {}  # registered, not yet reserved: no refetch
        self._evict_cause: dict[str, tuple[str, str]] = {}  # uid -> (event, cause)
        self._mine: set[str] = set()  # update ids this object created
        self._open: dict[int, set[str]] = defaultdict(set)  # step -> update ids not settled
        self._minis: Counter[int] = Counter()
        self._settled_once = False
        self.counters: Counter[str] = Counter()
        self.ledger_seconds = 0.0

    # -- metadata: every trajectory verl wrote becomes a ledger rollout --------------------

    def _sync_metadata_from_transfer_queue(self) -> None:
        super()._sync_metadata_from_transfer_queue()
        t0 = time.perf_counter()
        part = self.partitions.get("train", {})
        terminal = self.finished_keys["train"] | self.failure_keys["train"]
        new = [k for k in part if k not in self._known and k.split("_")[0] in terminal]
        if new:
            self._register(new, part)
        self.ledger_seconds += time.perf_counter() - t0

    def _register(self, keys: list[str], part: Mapping[str, Mapping[str, Any]]) -> None:
        fields = ["responses", "response_mask", "rollout_log_probs", "rm_scores"]
        td = _tq().kv_batch_get(keys=keys, partition_id="train", select_fields=fields)
        items = trajectories(td, keys=keys, tags=[part[k] for k in keys])
        failed_groups = self.failure_keys["train"]
        added = register_trajectories(self.ledger, self.registry, items, self.settings.reward)
        self.counters["registered"] += len(added)
        for t in items:
            self._known.add(t.rollout_id)
            self._items[t.rollout_id] = t
            if t.key.uid in failed_groups:
                self._retire(t.rollout_id, "failure", "group_failure")

    def _retire(self, rollout_id: str, kind: str, cause: str, detail: str = "") -> None:
        """Take a trajectory out of the normal path with its cause (never silently).

        `kind` is 'stale' (retire_stale, an offline-buffer candidate), 'failure' (its group
        failed to generate) or 'quarantine'. A reserved or terminal entry is left alone:
        its own record already says where it is.
        """
        self._items.pop(rollout_id, None)
        e = self.ledger.find(rollout_id)
        if e is None or e.state not in ("dispatched", "generated", "rewarded"):
            return
        if kind == "stale" and e.state == "rewarded":
            event, stage = "retire_stale", "admission"
        elif kind == "failure" and e.state == "dispatched":
            event, stage = "generation_failed", "generation"
        else:  # the direct quarantine event is recorded at stage admission
            event, stage = "quarantine", "admission"
        self.ledger.transition(
            rollout_id, event, e.revision, disposition=Disposition(stage, cause, detail)
        )
        self.counters[f"retired/{cause}"] += 1

    # -- eviction: our lag gate joins verl's, and every eviction is recorded --------------

    def _pointer_version(self) -> int | None:
        p = self.registry.pointer()
        return None if p is None else p.version

    def _stale_terminal_keys(self, global_steps: int, partition_id: str) -> set[str]:
        stale: set[str] = set(super()._stale_terminal_keys(global_steps, partition_id))
        for uid in stale:
            self._evict_cause[uid] = ("stale", "verl_off_policy_threshold")
        if partition_id == "val":
            return stale
        policy = self.registry.policy()
        pointer = self._pointer_version()
        if policy is None or pointer is None:
            return stale
        bad = self.ledger.bad_versions
        by_uid: dict[str, list[str]] = defaultdict(list)
        for key in self.partitions[partition_id]:
            by_uid[key.split("_")[0]].append(key)
        for uid in self.finished_keys[partition_id]:
            for key in by_uid.get(uid, []):
                tag = self.partitions[partition_id][key]
                low = tag.get("min_global_steps")
                if low is None:
                    continue
                lag = pointer - int(low)
                if int(low) in bad:
                    self._evict_cause[uid] = ("quarantine", "failed_version")
                elif lag > policy.max_lag:
                    self._evict_cause.setdefault(uid, ("stale", f"lag_{lag}_over_{policy.max_lag}"))
                elif lag < 0:
                    self._evict_cause[uid] = ("quarantine", "future_policy")
                else:
                    continue
                stale.add(uid)
                break
        return stale

    def _evict_terminal_groups(
        self, global_steps: int, partition_id: str, eviction_reasons: Any
    ) -> Any:
        if partition_id != "val":
            stale_uids, dapo_uids, failed_uids, _counts = eviction_reasons
            t0 = time.perf_counter()
            for key in list(self.partitions[partition_id]):
                uid = key.split("_")[0]
                if uid in failed_uids:
                    self._retire(key, "failure", "group_failure")
                elif uid in stale_uids:
                    kind, cause = self._evict_cause.get(uid, ("stale", "stale"))
                    self._retire(key, kind, cause)
                elif uid in dapo_uids:
                    self._retire(key, "quarantine", "filter_groups")
            self.ledger_seconds += time.perf_counter() - t0
            evicted = stale_uids | dapo_uids | failed_uids
            self.counters["evicted_groups"] += len(evicted)
            self.counters["refilled"] += len(evicted) if self.refill_fn is not None else 0
        return super()._evict_terminal_groups(global_steps, partition_id, eviction_reasons)

    def _sampleable_terminal_keys(self, partition_id: str, eviction_reasons: Any) -> set[str]:
        keys: set[str] = set(super()._sampleable_terminal_keys(partition_id, eviction_reasons))
        if partition_id == "val":
            return keys
        # a group another trainer holds (or consumed) is not ours to take
        taken = set()
        for key in self.partitions[partition_id]:
            uid = key.split("_")[0]
            if uid in keys and uid not in taken:
                e = self.ledger.find(key)
                if e is not None and e.state not in ("rewarded",):
                    taken.add(uid)
        return keys - taken

    # -- settle: commit landed updates, release those a resumed trainer redoes ------------

    def settle(self, global_steps: int) -> dict[str, int]:
        """Commit every reservation of this run from steps < `global_steps` (the trainer
        moved past them: their update landed) and release those of steps >= it made by
        an earlier process (a resumed trainer redoes that step)."""
        t0 = time.perf_counter()
        run = self.settings.run_id
        if not self._settled_once:
            self._settled_once = True
            for e in self.ledger.snapshot().values():
                if e.state == "reserved" and e.reserved_by is not None:
                    s = step_of(e.reserved_by, run)
                    if s is not None:
                        self._open[s].add(e.reserved_by)
        committed = released = 0
        for step in sorted(self._open):
            for uid in sorted(self._open[step]):
                if step < global_steps:
                    committed += len(commit_update(self.ledger, uid))
                elif uid not in self._mine:
                    released += len(release_update(self.ledger, uid))
                else:
                    continue
                self._open[step].discard(uid)
        for step in [s for s, ids in self._open.items() if not ids]:
            del self._open[step]
        self.counters["committed"] += committed
        self.counters["released"] += released
        self.ledger_seconds += time.perf_counter() - t0
        return {"committed": committed, "released": released}

    def _reconcile(self) -> int:
        """On a run's own ledger, at the first sample of a process: a trajectory the ledger
        holds as reservable but TransferQueue no longer has (verl restored its checkpoint
        from before it was written) can never be trained; retire it with that cause."""
        self._sync_metadata_from_transfer_queue()
        present = set(self.partitions.get("train", {}))
        gone = [
            rid
            for rid, e in self.ledger.snapshot().items()
            if e.state in ("generated", "rewarded") and rid not in present
        ]
        for rid in gone:
            self._retire(rid, "quarantine", "dropped_by_resume")
        return len(gone)

    def finish(self, global_steps: int) -> dict[str, int]:
        """After the last step landed (verl calls nothing after it): commit it."""
        return self.settle(global_steps + 1)

    def fail_step(self, global_steps: int) -> int:
        """The step's update failed: release its reservations (typed cause in the ledger)."""
        n = 0
        for uid in list(self._open.get(global_steps, ())):
            n += len(release_update(self.ledger, uid))
            self._open[global_steps].discard(uid)
        self.counters["released"] += n
        return n

    # -- sample -------------------------------------------------------------------------

    def sample(
        self, global_steps: int, partition_id: str, batch_size: int
    ) -> tuple[Any, dict[str, Any]]:
        """Evict (with causes, refilling), then reserve `batch_size` groups by CAS."""
        if partition_id == "val":
            meta, extra = super().sample(global_steps, partition_id, batch_size)
            return meta, dict(extra)
        if not self._settled_once and self.settings.owns_ledger:
            self._reconcile()
        settled = self.settle(global_steps)
        mini = self._minis[global_steps]
        self._minis[global_steps] += 1
        metrics: dict[str, Any] = {}
        attempt = 0
        while True:
            sampleable, evict_metrics = self.wait_for_sampleable(
                global_steps, partition_id, batch_size
            )
            for k, v in evict_metrics.items():
                metrics[k] = metrics.get(k, 0) + v if isinstance(v, int | float) else v
            chosen, snapshot, _steps = self._select_prompt_uids(
                partition_id, sampleable, batch_size
            )
            keys = sorted(k for k in snapshot if k.split("_")[0] in set(chosen))
            t0 = time.perf_counter()
            uid = update_id_for(self.settings.run_id, global_steps, mini, attempt)
            admitted = self._reserve(uid, keys, snapshot)
            self.ledger_seconds += time.perf_counter() - t0
            refused = admitted.refused
            if not refused:
                break
            # someone else won a CAS, or the pointer moved: give back, skip, try again
            self.ledger.abort(uid)
            lost = {k.split("_")[0] for k in refused}
            self.counters["cas_lost_groups"] += len(lost)
            for k, why in refused.items():
                if why in (
                    "stale_policy",
                    "future_policy",
                    "unregistered_version",
                    "artifact_hash_mismatch",
                    "policy_drift",
                    "conditions_mismatch",
                ):
                    self._evict_cause[k.split("_")[0]] = (
                        "stale" if why == "stale_policy" else "quarantine",
                        why,
                    )
            attempt += 1
            if attempt > 20:
                raise VerlIntegrationError(f"step {global_steps}: no reservation after 20 tries")
        self._mine.add(uid)
        self._open[global_steps].add(uid)
        for k in admitted.reserved:
            self._items.pop(k, None)
        self.counters["reserved"] += len(admitted.reserved)
        lags = [d.lag for d in admitted.decisions]
        metrics.update(
            {
                "rollout_lifecycle/reserved": len(admitted.reserved),
                "rollout_lifecycle/committed": settled["committed"],
                "rollout_lifecycle/released": settled["released"],
                "rollout_lifecycle/lag_max": max(lags, default=0),
                "rollout_lifecycle/pointer": admitted.current_version,
                "rollout_lifecycle/drift_measured": 0,
                "rollout_lifecycle/cas_retries": attempt,
            }
        )
        # staleness of what was trained, attempts per prompt, wasted generation, length bias
        pacing = self.ledger.statistics().pacing
        if pacing is not None:
            metrics.update(pacing_metrics(pacing, prefix="rollout_lifecycle/pacing/"))
        meta = self._materialize_batch(partition_id, chosen, snapshot)
        return meta, metrics

    def _reserve(self, update_id: str, keys: list[str], snapshot: Mapping[str, Any]) -> Admitted:
        if all(k in self._items for k in keys):
            items = [self._items[k] for k in keys]
        else:  # registered by an earlier process: read the evidence back from TransferQueue
            td = _tq().kv_batch_get(
                keys=keys,
                partition_id="train",
                select_fields=["responses", "response_mask", "rollout_log_probs", "rm_scores"],
            )
            items = trajectories(td, keys=keys, tags=[snapshot[k] for k in keys])
        width = max((t.action_mask.size for t in items), default=0)
        # bypass mode: the behaviour log-probs are the update's old log-probs (see module doc)
        current = _padded([t.behavior_log_probs for t in items], width)
        return admit_batch(
            self.ledger,
            self.registry,
            update_id,
            items,
            current,
            conditions=self.settings.conditions,
            dataset=self.settings.dataset,
        )

    def close(self) -> None:
        """Close the ledger connection."""
        self.backend.close()


# ---- (c) two-phase activation around verl's weight sync -----------------------------------


def replica_worker_id(rank: int) -> str:
    """The registry's name for rollout worker `rank` of the checkpoint topology."""
    return f"rollout-{rank}"


@CheckpointEngineRegistry.register(BACKEND_NAME)
class LedgerCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """verl checkpoint engine: publish a committed artifact, ack (version, hash), then flip.

    engine_kwargs (`actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rollout_lifecycle`):
    `ledger_url` (sqlite:///... shared by every process), `artifact_root` (a directory every
    process reads), `ack_timeout_s`. The actor master writes the version, waits for every
    required rollout worker's ack and tries to activate; any failure keeps the old pointer,
    is recorded at its stage and quarantines the version's rollouts.
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
        self.incarnation = int(time.time() * 1000) % (2**31)
        self.last: dict[str, Any] = {}

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
                if rec.state == "awaiting_acks":
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

    def _ack(self, ack: Any) -> None:
        backend = self._backend()
        try:
            ActivationCoordinator(backend.registry).record_ack(ack)
        finally:
            backend.close()


def iter_named(tensors: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs in name order: the generator verl's actor hands send_weights."""
    yield from sorted(tensors.items())
