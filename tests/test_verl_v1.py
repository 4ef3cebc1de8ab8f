"""verl v1 integration against real verl 0.9.1 classes and a real in-process TransferQueue.

Nothing of verl is mocked: the buffer is verl's ReplayBufferAsync subclass loaded the way
the trainer loads it, TransferQueue runs its Ray actors, the checkpoint engine is built by
verl's CheckpointEngineRegistry. Skipped only where verl or transferqueue is missing.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")
torch = pytest.importorskip("torch")

from rollout_lifecycle.gpu_check import verl_v1  # noqa: E402
from rollout_lifecycle.gpu_check.verl_v1 import (  # noqa: E402
    LedgerCheckpointEngine,
    LedgerReplayBuffer,
    RewardIdentity,
    TrajectoryKey,
    VerlIntegrationError,
    admit_batch,
    admit_dataproto,
    commit_update,
    conditions_from_rollout_config,
    register_trajectories,
    release_update,
    trajectories,
)
from rollout_lifecycle.model.backends import Backend, open_backend  # noqa: E402
from rollout_lifecycle.model.coordinator import ActivationCoordinator  # noqa: E402
from rollout_lifecycle.model.ledger import Landing  # noqa: E402
from rollout_lifecycle.model.records import (  # noqa: E402
    AdmissionPolicy,
    AdmissionStamp,
    LedgerEntry,
    Reward,
    WorkerAck,
)
from rollout_lifecycle.model.registry import set_admission_policy  # noqa: E402

ROLLOUT_CFG = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "response_length": 8}
REWARD = RewardIdentity("gsm8k-rule", "1")
H = {v: f"{v:x}".rjust(64, "a") for v in range(20)}


@pytest.fixture(scope="module")
def tq() -> Iterator[Any]:
    """A real TransferQueue (its controller and one storage unit as Ray actors)."""
    import ray
    import transfer_queue
    from omegaconf import OmegaConf

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    transfer_queue.init(
        OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    )
    yield transfer_queue
    transfer_queue.close()
    ray.shutdown()


@pytest.fixture
def clean(tq: Any) -> Any:
    """An empty train partition for each test."""
    items = (tq.kv_list("train") or {}).get("train", {})
    if items:
        tq.kv_clear(keys=list(items), partition_id="train")
    return tq


def deployment(
    path: Path, versions: int, max_lag: int = 1
) -> tuple[Backend, ActivationCoordinator]:
    """A SQLite ledger + registry with v0..v{versions-1} activated by one worker's acks."""
    be = open_backend(f"sqlite:///{path}")
    set_admission_policy(be.registry, AdmissionPolicy(max_lag, 0.5), "set by the operator")
    coord = ActivationCoordinator(
        be.registry, ["rollout-0"], ledger=be.ledger, policy=AdmissionPolicy(max_lag, 0.5)
    )
    for v in range(versions):
        activate(coord, v)
    return be, coord


def activate(coord: ActivationCoordinator, v: int) -> None:
    coord.prepare(v)
    coord.commit_artifact(v, H[v])
    coord.distribute(v)
    token = coord.attempt_token("rollout-0", v)
    assert coord.record_ack(WorkerAck("rollout-0", v, H[v], token=token)).counted
    assert coord.try_activate(v).activated


def put_group(
    tq: Any,
    uid: str,
    low: int,
    high: int | None = None,
    n: int = 2,
    status: str = "finished",
    partition_id: str = "train",
) -> list[str]:
    """A GRPO group as verl's agent loop writes it: n trajectories, then the prompt key."""
    keys = []
    for s in range(n):
        key = f"{uid}_{s}_0"
        lp = torch.tensor([-0.5, -0.25, -1.0])
        tq.kv_put(
            key=key,
            partition_id=partition_id,
            fields={
                "responses": torch.tensor([5, 6, 7]),
                "response_mask": torch.tensor([1, 1, 1]),
                "rollout_log_probs": lp,
                "rm_scores": torch.tensor([0.0, 0.0, float(s)]),
            },
            tag={
                "status": "success",
                "global_steps": low,
                "min_global_steps": low,
                "max_global_steps": low if high is None else high,
                "prompt_len": 3,
                "response_len": 3,
                "seq_len": 6,
            },
        )
        keys.append(key)
    tq.kv_put(
        key=uid,
        partition_id=partition_id,
        tag={"is_prompt": True, "status": status, "global_steps": low},
    )
    return keys


def buffer(
    be: Backend,
    run_id: str,
    refills: list[int] | None = None,
    threshold: int | None = None,
    *,
    mode: str = "separate_async",
    strategy: str = "drop",
    filter_groups_metric: str | None = None,
    sync_refill_failed_groups: bool = False,
    **kwargs: Any,
) -> LedgerReplayBuffer:
    from verl.utils.import_utils import load_extern_type

    cls = load_extern_type(verl_v1.SAMPLER_PATH, verl_v1.SAMPLER_NAME)
    assert cls is LedgerReplayBuffer
    sink = refills if refills is not None else []
    buf: LedgerReplayBuffer = cls(
        trainer_mode=mode,
        trainer_config={},
        max_off_policy_threshold=threshold,
        max_off_policy_strategy=strategy,
        sampler_kwargs={
            "ledger_url": be.url,
            "run_id": run_id,
            "tokenizer_id": "tok",
            **ROLLOUT_CFG,
            "reward_fn_id": REWARD.function_id,
            "reward_fn_version": REWARD.function_version,
            **kwargs,
        },
        poll_interval=0.05,
        refill_fn=sink.append,
        filter_groups_metric=filter_groups_metric,
        sync_refill_failed_groups=sync_refill_failed_groups,
        backend=be,
    )
    return buf


# ---- (a) the adapter ------------------------------------------------------------------


def test_trajectory_key_is_verls_key_and_refuses_prompt_keys() -> None:
    k = TrajectoryKey.parse("a1b2_3_0")
    assert (k.uid, k.session, k.index, k.key) == ("a1b2", 3, 0, "a1b2_3_0")
    with pytest.raises(VerlIntegrationError, match="trajectory key"):
        TrajectoryKey.parse("a1b2")
    with pytest.raises(VerlIntegrationError, match="rollout config"):
        conditions_from_rollout_config({"top_p": 1.0}, "tok")


def _dataproto(old: Any, lows: list[int]) -> Any:
    from verl import DataProto

    b = len(lows)
    return DataProto.from_dict(
        tensors={
            "responses": torch.tensor([[5, 6, 7, 0]] * b),
            "response_mask": torch.tensor([[1, 1, 1, 0]] * b),
            "rollout_log_probs": torch.full((b, 4), -0.5),
            "old_log_probs": old,
            "rm_scores": torch.tensor([[0.0, 0.0, 1.0, 0.0]] * b),
        },
        non_tensors={
            "uid": np.array([f"p{i}" for i in range(b)], dtype=object),
            "session_id": np.array([0] * b, dtype=object),
            "index": np.array([0] * b, dtype=object),
            "min_global_steps": np.array(lows, dtype=object),
            "max_global_steps": np.array(lows, dtype=object),
        },
    )


def test_dataproto_to_reservations_commit_and_release(tmp_path: Path) -> None:
    be, _coord = deployment(tmp_path / "s.db", versions=4)  # pointer v3, max_lag 1
    conds = conditions_from_rollout_config(ROLLOUT_CFG, "tok")
    old = torch.full((4, 4), -0.5)
    old[1, :3] = -0.6  # drift 0.1: admitted, measured
    old[2, :3] = -2.5  # drift 2.0: refused
    batch = _dataproto(old, [3, 2, 3, 0])  # the last one is stale (lag 3)
    adm = admit_dataproto(be.ledger, be.registry, "u1", batch, conditions=conds, reward=REWARD)
    assert adm.reserved == ["p0_0_0", "p1_0_0"]
    assert adm.refused == {"p2_0_0": "policy_drift", "p3_0_0": "stale_policy"}
    stamp = be.ledger.get("p1_0_0").admission
    assert stamp is not None and stamp.drift == pytest.approx(0.1, abs=1e-6) and stamp.lag == 1
    assert be.ledger.get("p0_0_0").reward is not None
    assert be.ledger.get("p0_0_0").reward.function_id == "gsm8k-rule"  # type: ignore[union-attr]
    assert [e.state for e in commit_update(be.ledger, "u1")] == ["consumed", "consumed"]
    # a second trainer cannot take what is consumed; a failed update gives back its own
    again = admit_dataproto(be.ledger, be.registry, "u2", batch, conditions=conds, reward=REWARD)
    assert again.reserved == []
    # another batch whose update fails: released, not lost
    b2 = _dataproto(torch.full((1, 4), -0.5), [3])
    b2.non_tensor_batch["uid"] = np.array(["q9"], dtype=object)
    adm3 = admit_dataproto(be.ledger, be.registry, "u3", b2, conditions=conds, reward=REWARD)
    assert adm3.reserved == ["q9_0_0"]
    assert [e.state for e in release_update(be.ledger, "u3")] == ["rewarded"]
    be.close()


def test_concurrent_cas_gives_each_trajectory_to_one_update(tmp_path: Path) -> None:
    be, _ = deployment(tmp_path / "s.db", versions=2)
    conds = conditions_from_rollout_config(ROLLOUT_CFG, "tok")
    batch = _dataproto(torch.full((6, 4), -0.5), [1] * 6)
    items = trajectories(batch)
    register_trajectories(be.ledger, be.registry, items, REWARD)
    cur = np.full((6, 4), -0.5)
    won: dict[str, list[str]] = {}
    backends = [open_backend(be.url) for _ in range(4)]

    def run(i: int) -> None:
        b = backends[i]
        won[f"t{i}"] = admit_batch(
            b.ledger, b.registry, f"t{i}", items, cur, conditions=conds
        ).reserved

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    taken = [rid for ids in won.values() for rid in ids]
    assert sorted(taken) == sorted(t.rollout_id for t in items)  # all taken, none twice
    for b in backends:
        b.close()
    be.close()


# ---- (b) the replay buffer on a real TransferQueue -------------------------------------


def test_sample_evicts_stale_with_cause_refills_and_reserves(clean: Any, tmp_path: Path) -> None:
    be, _ = deployment(tmp_path / "s.db", versions=4)  # pointer v3, max_lag 1
    fresh = put_group(clean, "gfresh", 3)
    tol = put_group(clean, "gtol", 2, 3)
    put_group(clean, "gstale", 0)
    refills: list[int] = []
    buf = buffer(be, "run", refills)
    meta, metrics = buf.sample(global_steps=4, partition_id="train", batch_size=2)
    assert sorted(meta.keys) == sorted(fresh + tol)
    assert refills == [1]  # verl's refill_fn, once per evicted group
    e = be.ledger.get("gstale")  # one ledger rollout per GRPO group: verl's uid
    assert e.state == "retired_stale" and e.disposition is not None
    assert e.disposition.cause == "lag_3_over_1"
    for uid in ("gfresh", "gtol"):
        e = be.ledger.get(uid)
        assert e.state == "reserved" and e.reserved_by == "run.s00000004.m0"
        assert e.reward is not None and e.reward.value == pytest.approx(0.5)  # mean of 0, 1
    assert metrics["rollout_lifecycle/reserved"] == 2
    assert metrics["rollout_lifecycle/lag_max"] == 1
    # the next step starts: step 4's update landed, its reservations are consumed
    more = put_group(clean, "gnext", 3)
    meta2, m2 = buf.sample(global_steps=5, partition_id="train", batch_size=1)
    assert m2["rollout_lifecycle/committed"] == 2
    # pacing figures logged with each step: 2 groups trained at lag <= 1, one wasted
    assert m2["rollout_lifecycle/pacing/trained"] == 2.0
    assert m2["rollout_lifecycle/pacing/staleness_max"] <= 1.0
    assert m2["rollout_lifecycle/pacing/wasted_tokens"] == 6.0
    assert all(be.ledger.get(u).state == "consumed" for u in ("gfresh", "gtol"))
    assert sorted(meta2.keys) == sorted(more)
    assert buf.finish(5)["committed"] == 1
    be.close()


def test_failed_group_is_retired_with_its_cause(clean: Any, tmp_path: Path) -> None:
    be, _ = deployment(tmp_path / "s.db", versions=2)
    put_group(clean, "gfail", 1, status="failure")
    good = put_group(clean, "gok", 1)
    refills: list[int] = []
    buf = buffer(be, "run", refills)
    meta, _ = buf.sample(global_steps=2, partition_id="train", batch_size=1)
    assert sorted(meta.keys) == sorted(good)
    assert refills == [1]
    e = be.ledger.get("gfail")
    assert e.state == "quarantined" and e.disposition is not None
    assert e.disposition.cause == "group_failure"
    be.close()


def test_a_spent_chains_group_is_refilled_fresh_never_dispatched_again(
    clean: Any, tmp_path: Path
) -> None:
    """A prompt whose attempts are spent is handed back to verl as a failed group; its
    eviction asks verl for a fresh prompt and never re-dispatches the spent one (which the
    ledger would refuse, fail and evict again, without end: a CPU trainer run looped so)."""
    be, _ = deployment(tmp_path / "s.db", versions=2)
    put_group(clean, "gspent", 1, status="failure")
    put_group(clean, "gpaced", 1, status="failure")
    good = put_group(clean, "gok2", 1)
    buf = buffer(be, "run")
    requeued: list[list[str]] = []
    buf.book.attach(lambda: None, lambda pid, uids: requeued.append(list(uids)) or len(uids))
    buf.book.refused.add("gspent")  # the pacer refused it: attempts exhausted
    fresh: list[int] = []
    buf.refill_fn = buf._refill
    buf._trainer_refill = fresh.append
    meta, _ = buf.sample(global_steps=2, partition_id="train", batch_size=1)
    assert sorted(meta.keys) == sorted(good)
    assert requeued == [["gpaced"]]  # the other failed group is paced again, not the spent one
    assert fresh == [1]  # verl fetches one fresh prompt in the spent one's place
    assert "gspent" not in buf.book.refused  # forgotten once evicted
    be.close()


def test_two_trainers_on_one_ledger_never_share_a_group(clean: Any, tmp_path: Path) -> None:
    be, _ = deployment(tmp_path / "s.db", versions=2)
    put_group(clean, "ga", 1)
    g2 = put_group(clean, "gb", 1)
    # trainer A (another process, its own TransferQueue view) took group ga through the ledger
    other = open_backend(be.url)
    r = Reward(REWARD.function_id, REWARD.function_version, 0.5)
    stamp = AdmissionStamp(1, 1, 1, 0.5, 0.0, "fresh", "ok", True)
    got = other.ledger.land_and_reserve(  # type: ignore[attr-defined]
        "A.s00000001.m0", [Landing("ga", 1, H[1], reward=r)], reserve={"ga": stamp}
    )
    assert got.reserved == ["ga"]
    buf = buffer(be, "B")
    meta, _ = buf.sample(global_steps=2, partition_id="train", batch_size=1)
    assert sorted(meta.keys) == sorted(g2)
    assert be.ledger.get("ga").reserved_by == "A.s00000001.m0"
    other.close()
    be.close()


def test_resume_releases_the_redone_step_and_commits_landed_ones(
    clean: Any, tmp_path: Path
) -> None:
    be, _ = deployment(tmp_path / "s.db", versions=3)
    g3 = put_group(clean, "gx", 2)
    first = buffer(be, "run")
    first.sample(global_steps=3, partition_id="train", batch_size=1)  # then SIGKILL
    # verl restores TransferQueue from the step-2 checkpoint: the prompt key is back
    clean.kv_put(
        key="gx",
        partition_id="train",
        tag={"is_prompt": True, "status": "finished", "global_steps": 2},
    )
    second = buffer(be, "run")
    meta, m = second.sample(global_steps=3, partition_id="train", batch_size=1)
    assert m["rollout_lifecycle/released"] == 1
    assert sorted(meta.keys) == sorted(g3)
    e = be.ledger.get("gx")
    assert e.state == "reserved" and e.releases == 1
    assert e.reserved_by == "run.s00000003.m0"
    # the step then landed and the next process resumes at step 4: committed once
    third = buffer(be, "run")
    assert third.settle(4)["committed"] == 1
    assert be.ledger.get("gx").state == "consumed"
    be.close()


# ---- (c) two-phase activation around verl's weight sync --------------------------------


def _engines(tmp_path: Path, url: str, n: int, **kw: Any) -> tuple[Any, list[Any]]:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    assert CheckpointEngineRegistry.get("rollout_lifecycle") is LedgerCheckpointEngine
    args = {"ledger_url": url, "artifact_root": str(tmp_path / "art"), **kw}
    actor = CheckpointEngineRegistry.new("rollout_lifecycle", is_master=True, bucket_size=1, **args)
    rollouts = [
        CheckpointEngineRegistry.new("rollout_lifecycle", bucket_size=1, **args) for _ in range(n)
    ]
    a_kw, r_kw = LedgerCheckpointEngine.build_topology(1, n, [{}] * (n + 1))
    actor.init_process_group(**{k: v[0] for k, v in a_kw.items()})
    for i, r in enumerate(rollouts):
        r.init_process_group(**{k: v[i] for k, v in r_kw.items()})
    return actor, rollouts


async def _sync(actor: Any, rollouts: list[Any], step: int, weights: dict[str, Any]) -> Any:
    async def receive(r: Any) -> dict[str, Any]:
        return {n: t async for n, t in r.receive_weights(global_steps=step)}

    return await asyncio.gather(
        actor.send_weights(iter(sorted(weights.items())), global_steps=step),
        *[receive(r) for r in rollouts],
    )


def test_weight_sync_activates_only_after_every_replica_acked(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    actor, rollouts = _engines(tmp_path, url, 2)
    w0 = {"layer.weight": torch.ones(2, 3)}
    out = asyncio.run(_sync(actor, rollouts, 0, w0))
    assert out[0]["rollout_lifecycle/activated"] == 1.0
    assert all(torch.equal(r["layer.weight"], w0["layer.weight"]) for r in out[1:])
    w1 = {"layer.weight": torch.full((2, 3), 2.0)}
    asyncio.run(_sync(actor, rollouts, 1, w1))
    be = open_backend(url)
    p = be.registry.pointer()
    assert p is not None and p.version == 1 and p.artifact_hash == actor.last["artifact_hash"]
    rec = be.registry.artifact(1)
    assert rec is not None and rec.state == "active"
    acks = be.registry.workers()
    assert {w: r.ack.version for w, r in acks.items() if r.ack} == {"rollout-0": 1, "rollout-1": 1}
    be.close()


def test_weight_sync_failure_keeps_pointer_records_stage_quarantines(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    actor, rollouts = _engines(tmp_path, url, 2)
    asyncio.run(_sync(actor, rollouts, 0, {"w": torch.zeros(2)}))
    be = open_backend(url)
    # a rollout generated by v1 while v1 was being distributed
    be.ledger.add(LedgerEntry("early_0_0", 1, H[1], state="generated"))
    for r in (actor, *rollouts):
        r.ack_timeout_s = 1.0
    rollouts[1].fail_worker = "rollout-1"  # this replica loads v1 but never acks
    out = asyncio.run(_sync(actor, rollouts, 1, {"w": torch.ones(2)}))
    assert out[0]["rollout_lifecycle/activated"] == 0.0
    p = be.registry.pointer()
    assert p is not None and p.version == 0
    rec = be.registry.artifact(1)
    assert rec is not None and rec.state == "distribution_failed"
    assert rec.failure is not None and rec.failure.stage == "distribution"
    # rollout-1 still reports v0: its state contradicts v1, so v1 never activates
    assert rec.failure.cause == "worker_mismatch" and "rollout-1" in rec.failure.detail
    assert be.ledger.get("early_0_0").state == "quarantined"
    be.close()


def test_resumed_trainer_redistributes_only_the_same_weights(tmp_path: Path) -> None:
    """After a failed distribution, verl resumed from its checkpoint re-sends vN: the
    bit-identical weights are distributed again and activate; other weights are refused."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    actor, rollouts = _engines(tmp_path, url, 2)
    asyncio.run(_sync(actor, rollouts, 0, {"w": torch.zeros(2)}))
    for r in (actor, *rollouts):
        r.ack_timeout_s = 1.0
    rollouts[1].fail_worker = "rollout-1"
    asyncio.run(_sync(actor, rollouts, 1, {"w": torch.ones(2)}))
    rollouts[1].fail_worker = None  # the replica is back
    with pytest.raises(verl_v1.WeightSyncError, match="other weights"):
        asyncio.run(_sync(actor, rollouts, 1, {"w": torch.full((2,), 3.0)}))
    be = open_backend(url)
    rec = be.registry.artifact(1)
    assert rec is not None and rec.state == "distribution_failed"
    out = asyncio.run(_sync(actor, rollouts, 1, {"w": torch.ones(2)}))
    assert out[0]["rollout_lifecycle/activated"] == 1.0
    p = be.registry.pointer()
    assert p is not None and p.version == 1
    be.close()


def test_train_verdict_names_every_failed_criterion() -> None:
    from rollout_lifecycle.cli.train_cmd import verdict

    good = {
        "trajectories": {"lost": 0, "trained_twice": 0},
        "max_lag_trained": 1,
        "policy": {"max_lag": 2, "max_attempts": 3},
        "spec": {"violations": 0},
        "kills": [{"what": "trainer"}, {"what": "rollout_replica"}],
        "checkpoint_step": 6,
        "steps": 6,
        "pacing": {"dispatch_refusals": 5, "never_trained": 0, "max_attempts": 2},
        "activations": {"survivor_acks_not_counted": []},
        "reserved_when_verl_ended": 0,
    }
    assert verdict(good) == []
    bad = {
        **good,
        "trajectories": {"lost": 1, "trained_twice": 2},
        "max_lag_trained": 3,
        "spec": {"violations": 4},
        "kills": [{"what": "trainer"}],
        "checkpoint_step": 5,
        "pacing": {"dispatch_refusals": 0, "never_trained": 2, "max_attempts": 4},
        "activations": {"survivor_acks_not_counted": [{"version": 5, "worker": "rollout-0"}]},
        "reserved_when_verl_ended": 4,
    }
    why = verdict(bad)
    assert len(why) == 11 and "no SIGKILL of the rollout_replica happened" in why
    assert any("never refused" in w for w in why) and any("survivi" in w for w in why)
    assert any("still reserved when verl ended" in w for w in why)


def test_resume_retires_what_verls_checkpoint_no_longer_holds(clean: Any, tmp_path: Path) -> None:
    """On the run's own ledger, a group registered after verl's last checkpoint is gone
    from the restored TransferQueue: it is retired with that cause, never left 'live'."""
    be, _ = deployment(tmp_path / "s.db", versions=2)
    be.ledger.add(LedgerEntry("gone", 1, H[1], state="rewarded", reward=Reward("r", "1", 0.0)))
    kept = put_group(clean, "gkept", 1)
    buf = buffer(be, "run")
    buf.settings = attrs.evolve(buf.settings, owns_ledger=True)
    meta, _ = buf.sample(global_steps=2, partition_id="train", batch_size=1)
    assert sorted(meta.keys) == sorted(kept)
    e = be.ledger.get("gone")
    assert e.state == "quarantined" and e.disposition is not None
    assert (e.disposition.stage, e.disposition.cause) == ("admission", "dropped_by_resume")
    be.close()


# ---- (d) production: bounded waits, every partition, verl's options, flat cost ---------


def test_weights_the_registry_never_activated_raise_after_a_bounded_wait(
    clean: Any, tmp_path: Path
) -> None:
    """verl generates with v3 while the registry's pointer stays at v1 (another checkpoint
    engine syncs the weights): no endless quarantine-and-refill, a typed error naming the fix."""
    be, _ = deployment(tmp_path / "s.db", versions=2)
    put_group(clean, "gahead", 3)
    refills: list[int] = []
    buf = buffer(be, "run", refills, version_wait_s=0.3)
    with pytest.raises(verl_v1.VersionMismatchError, match=r"checkpoint_engine\.backend"):
        buf.sample(global_steps=4, partition_id="train", batch_size=1)
    assert refills == []  # nothing was evicted: the group waited for its weights
    assert be.ledger.find("gahead") is None
    be.close()


def test_a_group_waits_for_its_weights_then_trains(clean: Any, tmp_path: Path) -> None:
    """A group generated by weights still being activated is held, not quarantined."""
    be, coord = deployment(tmp_path / "s.db", versions=2)
    g = put_group(clean, "gsoon", 2)
    buf = buffer(be, "run", version_wait_s=30)
    timer = threading.Timer(0.5, activate, args=(coord, 2))
    timer.start()
    meta, _ = buf.sample(global_steps=3, partition_id="train", batch_size=1)
    timer.join()
    assert sorted(meta.keys) == sorted(g)
    assert be.ledger.get("gsoon").state == "reserved"
    be.close()


def test_refills_are_bounded_per_sample_call(clean: Any, tmp_path: Path) -> None:
    """Everything generated is too stale for the policy: the call stops with the causes."""
    be, _ = deployment(tmp_path / "s.db", versions=6)  # pointer v5, max_lag 1

    def refill(n: int) -> int:
        for _ in range(n):
            put_group(clean, f"g{uuid.uuid4().hex[:8]}", 0)
        return n

    put_group(clean, "gfirst", 0)
    buf = buffer(be, "run", max_refills=5)
    buf.refill_fn = buf._refill
    buf._trainer_refill = refill
    with pytest.raises(verl_v1.RefillLoopError, match="lag_5_over_1"):
        buf.sample(global_steps=6, partition_id="train", batch_size=1)
    be.close()


def test_every_training_partition_goes_through_the_ledger(clean: Any, tmp_path: Path) -> None:
    """A partition other than 'train' is the ledger's too; 'val' never is."""
    be, _ = deployment(tmp_path / "s.db", versions=2)
    part = f"p{uuid.uuid4().hex[:6]}"
    g = put_group(clean, "gpart", 1, partition_id=part)
    v = put_group(clean, "gval", 1, partition_id="val")
    buf = buffer(be, "run")
    meta, _ = buf.sample(global_steps=2, partition_id=part, batch_size=1)
    assert sorted(meta.keys) == sorted(g) and meta.partition_id == part
    assert be.ledger.get("gpart").state == "reserved"
    vmeta, vm = buf.sample(global_steps=2, partition_id="val", batch_size=1)
    assert sorted(vmeta.keys) == sorted(v) and vm == {}
    assert be.ledger.find("gval") is None
    clean.kv_clear(keys=g, partition_id=part)
    clean.kv_clear(keys=v, partition_id="val")
    be.close()


def test_unsupported_verl_options_are_refused_or_warned(tmp_path: Path) -> None:
    be, _ = deployment(tmp_path / "s.db", versions=1)
    with pytest.raises(verl_v1.UnsupportedVerlOption, match="filter_groups"):
        buffer(be, "run", filter_groups=True)
    with pytest.raises(verl_v1.UnsupportedVerlOption, match="filter_groups"):
        buffer(be, "run", filter_groups_metric="acc")
    with pytest.raises(verl_v1.UnsupportedVerlOption, match="sync_refill_failed_groups"):
        buffer(be, "run", sync_refill_failed_groups=True)
    with pytest.warns(verl_v1.VerlOptionWarning, match="max_lag"):
        buffer(be, "run", strategy="wait")
    with pytest.raises(VerlIntegrationError, match="run_id"):
        buffer(be, "a_b")
    be.close()


def test_sync_mode_follows_verls_sync_buffer(clean: Any, tmp_path: Path) -> None:
    """trainer_mode=sync: verl's threshold drops nothing and a failed group's trajectories
    are trained (verl pads the missing ones), as verl's own ReplayBuffer does."""
    be, _ = deployment(tmp_path / "s.db", versions=2)
    failed = put_group(clean, "gsf", 1, status="failure")
    old = put_group(clean, "gso", 1)
    buf = buffer(be, "run", threshold=1, mode="sync")
    meta, _ = buf.sample(global_steps=5, partition_id="train", batch_size=2)
    assert sorted(meta.keys) == sorted(failed + old)
    assert {be.ledger.get(u).state for u in ("gsf", "gso")} == {"reserved"}
    be.close()


def test_ledger_work_per_sample_is_the_same_at_any_ledger_size(clean: Any, tmp_path: Path) -> None:
    """The calls one sample makes do not depend on how many older rollouts the ledger
    holds: no statistics(), no snapshot(), no per-group find, one land-and-reserve step."""
    calls = []
    for n_old in (0, 300):
        be, _ = deployment(tmp_path / f"s{n_old}.db", versions=2)
        r = Reward("r", "1", 0.0)
        be.ledger.add_many(
            [LedgerEntry(f"old{i}", 1, H[1], state="rewarded", reward=r) for i in range(n_old)]
        )
        buf = buffer(be, "run")
        for step in (2, 3, 4):
            put_group(clean, f"gs{n_old}x{step}", 1)
            before = Counter(buf.ledger_calls)
            buf.sample(global_steps=step, partition_id="train", batch_size=1)
            if step > 2:  # the first call of a process probes for a dead one's updates
                calls.append(dict(Counter(buf.ledger_calls) - before))
        be.close()
    assert calls[0] == calls[1] == calls[2] == calls[3], calls
    assert calls[0]["ledger.land_and_reserve"] == 1 and calls[0]["ledger.commit"] == 1
    assert not {"ledger.snapshot", "ledger.find", "ledger.statistics"} & set(calls[0])


def test_rewards_tagged_by_the_worker_need_no_transferqueue_read(
    clean: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    be, _ = deployment(tmp_path / "s.db", versions=2)
    keys = put_group(clean, "gtag", 1)
    clean.kv_batch_put(
        keys=keys, partition_id="train", tags=[{verl_v1.REWARD_TAG: 0.25} for _ in keys]
    )
    reads: list[Any] = []
    real = clean.kv_batch_get
    monkeypatch.setattr(clean, "kv_batch_get", lambda **kw: reads.append(kw) or real(**kw))
    buf = buffer(be, "run")
    buf.sample(global_steps=2, partition_id="train", batch_size=1)
    assert reads == []
    reward = be.ledger.get("gtag").reward
    assert reward is not None and reward.value == pytest.approx(0.25)
    be.close()


def test_publishing_a_step_commits_what_it_reserved(clean: Any, tmp_path: Path) -> None:
    """verl's end-of-step weight sync (every trainer's on_step_end, the last step's too)
    commits the step: nothing of the last step stays reserved when the trainer ends."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    actor, rollouts = _engines(tmp_path, url, 1, run_id="run")
    asyncio.run(_sync(actor, rollouts, 0, {"w": torch.zeros(2)}))
    be = open_backend(url)
    set_admission_policy(be.registry, AdmissionPolicy(1, 0.5), "test", at=None)
    put_group(clean, "glast", 0)
    buf = buffer(be, "run")
    buf.sample(global_steps=1, partition_id="train", batch_size=1)
    assert be.ledger.get("glast").state == "reserved"
    asyncio.run(_sync(actor, rollouts, 1, {"w": torch.ones(2)}))  # step 1's on_step_end
    assert be.ledger.get("glast").state == "consumed"
    assert actor.committed == {0: 0, 1: 1}
    assert buf.settle(2)["committed"] == 0  # nothing left for the buffer's fallback
    be.close()


# ---- (e) pacing inside verl's generation ------------------------------------------------


def _prompts(texts: list[str]) -> Any:
    """Prompt rows as verl's trainer hands them to the agent loop; a jagged field as in a
    batch read back from TransferQueue (a resumed trainer's re-issued prompts)."""
    from verl.utils import tensordict_utils as tu

    jagged = torch.nested.nested_tensor(
        [torch.arange(2 + i % 3) for i in range(len(texts))], layout=torch.jagged
    )
    batch = tu.get_tensordict(
        {
            "input_ids": torch.zeros(len(texts), 3, dtype=torch.long),
            "prompt_ids": jagged,
            "uid": np.array([uuid.uuid4().hex for _ in texts], dtype=object),
            "data_source": np.array(["arith"] * len(texts), dtype=object),
            "raw_prompt": np.array([[{"role": "user", "content": t}] for t in texts], dtype=object),
        }
    )
    tu.assign_non_tensor_data(batch, "global_steps", 1)
    return batch


def _paced(tmp_path: Path, max_attempts: int) -> tuple[Any, Any, list[list[str]], list[str]]:
    """A deployment whose policy paces dispatch (max_lag 1, batch_size 2: 4 live groups),
    v0 active, and a Pacer over it that records what it sends to verl and what it hands
    back as failed: (backend, pacer, sent uids per send, failed uids)."""
    from rollout_lifecycle.gpu_check.verl_v1_pacing import Pacer

    url = f"sqlite:///{tmp_path / 's.db'}"
    be = open_backend(url)
    policy = AdmissionPolicy(1, 0.5, batch_size=2, max_attempts=max_attempts)
    set_admission_policy(be.registry, policy, "set by the operator")
    coord = ActivationCoordinator(be.registry, ["rollout-0"], ledger=be.ledger, policy=policy)
    activate(coord, 0)
    sent: list[list[str]] = []
    failed: list[str] = []
    settings = verl_v1.BufferSettings.from_kwargs({"ledger_url": url, "run_id": "run"})
    pacer = Pacer(
        verl_v1.step_ledger(be.ledger),
        be.registry,
        settings,
        verl_v1.DispatchBook(),
        lambda b: sent.append([str(u) for u in b["uid"]]),
        mark_failed=failed.append,
        log=tmp_path / "pacing.jsonl",
    )
    return be, pacer, sent, failed


def test_the_budget_decides_before_verl_generates(tmp_path: Path) -> None:
    """(max_lag + 1) x batch_size = 4 groups may be live: of 6 prompts 4 reach verl's
    generation, 2 are held and sent when capacity frees (a requeue); the same prompt
    fetched again (new uid) is the next attempt of its chain, up to max_attempts; a
    prompt whose attempts are spent is handed back to verl as a failed group."""
    be, pacer, sent, failed = _paced(tmp_path, max_attempts=2)
    book = pacer.book
    texts = [f"{i} + {i}" for i in range(6)]
    batch = _prompts(texts)
    pacer.submit(batch)
    assert len(sent) == 1 and len(sent[0]) == 4 and len(pacer.held) == 2
    assert book.counters["refused_no_capacity"] == 2
    first = sent[0][0]
    assert book.entry(first) is not None and book.entry(first).behavior_version == 0  # type: ignore[union-attr]
    # the first group fails to generate: its slot frees and the held prompts go out
    be.ledger.land_and_reserve(  # type: ignore[attr-defined]
        None, close=[(first, "generation_failed", verl_v1.Disposition("generation", "x"))]
    )
    pacer.retry()
    assert len(sent) == 2 and len(sent[1]) == 1 and book.counters["requeued"] == 1
    # a newer batch arrives while one prompt is still held: the held one goes first
    newer = _prompts(["7 + 7"])
    held_uid = pacer.held[0].uid
    be.ledger.land_and_reserve(  # type: ignore[attr-defined]
        None, close=[(sent[1][0], "generation_failed", verl_v1.Disposition("generation", "x"))]
    )
    pacer.submit(newer)
    assert sent[-1] == [held_uid] and [h.uid for h in pacer.held] == [str(newer["uid"][0])]
    assert book.counters["requeued"] == 2
    # the failed prompt fetched again: attempt 2 of the same chain
    again = _prompts([texts[0]])
    pacer.submit(again)
    uid2 = str(again["uid"][0])
    assert book.entry(uid2) is None and len(pacer.held) == 2  # no capacity yet: held
    for uid in sent[0][1:]:
        be.ledger.land_and_reserve(  # type: ignore[attr-defined]
            None, close=[(uid, "generation_failed", verl_v1.Disposition("generation", "x"))]
        )
    pacer.retry()
    e = be.ledger.get(uid2)
    assert e.chain is not None and e.attempt == 2
    assert be.ledger.get(first).chain == e.chain
    # attempts spent: a third fetch of the prompt is handed back to verl as failed
    be.ledger.land_and_reserve(  # type: ignore[attr-defined]
        None, close=[(uid2, "generation_failed", verl_v1.Disposition("generation", "x"))]
    )
    third = _prompts([texts[0]])
    pacer.submit(third)
    assert failed == [str(third["uid"][0])] and str(third["uid"][0]) in book.refused
    log = [json.loads(x) for x in (tmp_path / "pacing.jsonl").read_text().splitlines()]
    assert {x["what"] for x in log} >= {"dispatched", "no_capacity", "dropped:attempts_exhausted"}
    be.close()


def test_a_reissued_prompt_whose_try_went_past_dispatch_goes_again_as_its_next_attempt(
    clean: Any, tmp_path: Path
) -> None:
    """A resumed trainer re-issues in-flight prompts (same uids) whose tries had gone past
    dispatch before the trainer died: verl cleared those tries' trajectories, so they never
    train. Each prompt is dispatched again under a fresh uid as its chain's attempt 2; a
    try still live ends ('reissued_by_resume'), one a dead process's update still reserves
    ends once that update is released (the run's common case: the trainer is killed once
    its step's batch is reserved); the old uids go back to verl as failed and
    are never requeued again. Dropping them (the old code) ended the chains untrained (CI:
    2 chains). The prompts are read back from a real TransferQueue, as in a run."""
    from rollout_lifecycle.gpu_check.verl_v1_pacing import requeue_prompts

    be, pacer, sent, failed = _paced(tmp_path, max_attempts=3)
    book = pacer.book
    stored: dict[str, Any] = {}  # each prompt's row, by uid (what verl re-issues)
    tq = clean
    pacer.reissue = lambda uids: requeue_prompts(
        pacer, "train", uids, tq.kv_batch_put, tq.kv_batch_get
    )
    batch = _prompts(["1 + 1", "2 + 2", "3 + 3"])
    from tensordict import NonTensorData
    from verl.utils import tensordict_utils as tu

    stored.update(
        {str(u): tu.index_select_tensor_dict(batch, [i]) for i, u in enumerate(batch["uid"])}
    )
    # verl persists each prompt's data under its uid (what a re-issue reads back)
    uids = [str(u) for u in batch["uid"]]
    tq.kv_batch_put(
        keys=uids,
        partition_id="train",
        tags=[{"is_prompt": True, "status": "running", "global_steps": 1} for _ in uids],
        fields=batch.select(
            *[k for k in batch.keys() if not isinstance(batch.get(k), NonTensorData)]  # noqa: SIM118
        ),
    )
    pacer.submit(batch)
    done, live, held = sent[0]
    be.ledger.land_and_reserve(  # type: ignore[attr-defined]
        "run.s00000003.m0",  # the dead process's step 3 reserved `held`
        [Landing(u, 0, H[0], reward=Reward("r", "1", 1.0), tokens=3) for u in (done, live, held)],
        reserve={held: AdmissionStamp(0, 0, 1, 0.5, 0.0, "fresh", "ok", True)},
    )
    # the trainer died; its successor re-issues both in-flight prompts under their uids.
    # `done`'s try ended already (retired by the resume); `live`'s is still rewarded
    be.ledger.land_and_reserve(  # type: ignore[attr-defined]
        None, close=[(done, "quarantine", verl_v1.Disposition("admission", "dropped_by_resume"))]
    )
    pacer.submit(_restack(stored, [done, live, held]))
    assert failed == [done, live, held] and {done, live, held} <= book.refused
    old = be.ledger.get(live)
    assert old.state == "quarantined" and old.disposition is not None
    assert old.disposition.cause == "reissued_by_resume"
    fresh = sent[-1]
    assert len(fresh) == 2 and not {done, live} & set(fresh)
    for new, was in zip(fresh, (done, live), strict=True):
        e = be.ledger.get(new)
        assert e.attempt == 2 and e.chain == be.ledger.get(was).chain
    # `held`'s try is still reserved: its next attempt waits (chain_live) until the buffer
    # releases the dead update's reservations; then the try ends and the attempt goes
    assert be.ledger.get(held).state == "reserved" and len(pacer.held) == 1
    assert be.ledger.abort("run.s00000003.m0")  # the buffer's first sample releases it
    pacer.retry()
    gone = be.ledger.get(held)
    assert gone.state == "quarantined" and gone.disposition is not None
    assert gone.disposition.cause == "reissued_by_resume" and not pacer.held
    e3 = be.ledger.get(sent[-1][0])
    assert e3.attempt == 2 and e3.chain == gone.chain and not pacer.superseded
    # the failed uids' evictions never send the prompts a third time
    assert book.requeue("train", [done, live, held]) == 0
    log = [json.loads(x) for x in (tmp_path / "pacing.jsonl").read_text().splitlines()]
    assert [x["uid"] for x in log if x["what"] == "reissued"] == [done, live, held]
    be.close()


def _restack(stored: dict[str, Any], uids: list[str]) -> Any:
    """The prompts of `uids` as verl's `_reissue_inflight_prompts` hands them back."""
    from verl.utils import tensordict_utils as tu

    return tu.concat_tensordict([stored[u] for u in uids])


# ---- (f) item 9: a replica killed during a weight sync ----------------------------------


def test_a_replica_killed_mid_sync_leaves_the_survivors_ack_counted(tmp_path: Path) -> None:
    """Across a resume (fresh processes, fresh incarnations), one replica dies during v3's
    sync: v3 fails naming the dead replica only; the survivor's ack of v3 is counted."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    actor, rollouts = _engines(tmp_path, url, 2, ack_timeout_s=1.0)
    for v in range(2):
        asyncio.run(_sync(actor, rollouts, v, {"w": torch.full((2,), float(v))}))
    old = rollouts[0].incarnation
    actor, rollouts = _engines(tmp_path, url, 2, ack_timeout_s=1.0)  # the resumed processes
    assert rollouts[0].incarnation > old  # a later process's acks order after a dead one's
    asyncio.run(_sync(actor, rollouts, 1, {"w": torch.full((2,), 1.0)}))  # already active
    asyncio.run(_sync(actor, rollouts, 2, {"w": torch.full((2,), 2.0)}))
    rollouts[0].fail_worker = "rollout-0"  # its server died: it never acks v3
    asyncio.run(_sync(actor, rollouts, 3, {"w": torch.full((2,), 3.0)}))
    be = open_backend(url)
    rec = be.registry.artifact(3)
    assert rec is not None and rec.failure is not None
    assert rec.failure.detail == "missing [], mismatched ['rollout-0']"
    assert rollouts[1].acks[-1] == (3, "counted")
    survivor = be.registry.workers()["rollout-1"].ack
    assert survivor is not None and survivor.version == 3 and survivor.token is not None
    be.close()


def test_an_ack_of_a_replaced_attempt_is_sent_again_with_the_current_token(
    tmp_path: Path,
) -> None:
    """The master retried vN (new tokens) while a replica was loading vN with the previous
    attempt's token: the replica holds the very artifact the retry distributes, so its ack
    is re-sent with the current token and counts (it used to be refused as stale)."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    actor, rollouts = _engines(tmp_path, url, 1, ack_timeout_s=1.0)
    asyncio.run(_sync(actor, rollouts, 0, {"w": torch.zeros(2)}))
    rollouts[0].fail_worker = "rollout-0"
    asyncio.run(_sync(actor, rollouts, 1, {"w": torch.ones(2)}))  # v1 fails: no ack
    be = open_backend(url)
    coord = ActivationCoordinator(be.registry)
    rec = be.registry.artifact(1)
    assert rec is not None and rec.state == "distribution_failed"
    coord.retry(1)  # attempt 2: new tokens
    _loaded, ack = rollouts[0]._load(1, "rollout-0")
    coord.fail_distribution(1, "trainer_restarted", "the master died again")
    coord.retry(1)  # attempt 3 while the replica was loading
    res = rollouts[0]._ack(ack)
    assert res.counted and coord.try_activate(1).activated
    be.close()


def test_a_resumed_master_voids_the_dead_attempt_before_any_replica_can_ack_it(
    tmp_path: Path,
) -> None:
    """The master died with v1 awaiting acks. On resume verl starts the replicas' receive
    and the master's send together; here the replicas run first. They must not ack the dead
    attempt (the resumed master's retry would void that ack, and a replica acks only once
    per sync): the new master voids it when it is built, so they wait for the retry, and
    v1 activates. With the void left to `send_weights`, v1 timed out, both acks uncounted."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    be = open_backend(url)  # the buffer created the ledger: nothing distributed yet
    actor, rollouts = _engines(tmp_path, url, 2, ack_timeout_s=3.0)
    assert actor.voided == []
    asyncio.run(_sync(actor, rollouts, 0, {"w": torch.zeros(2)}))
    coord = ActivationCoordinator(be.registry, ledger=be.ledger)
    coord.prepare(1, parent_version=0)  # the dead master's attempt, as `_publish` opens it
    stored = actor.store.write(1, tensors={"w": np.ones(2, dtype=np.float32)}, label="v1")
    coord.commit_artifact(1, stored.artifact_hash, str(stored.path))
    coord.distribute(1)
    actor, rollouts = _engines(tmp_path, url, 2, ack_timeout_s=3.0)  # the resumed processes
    assert actor.voided == [1]
    rec = be.registry.artifact(1)
    assert rec is not None and rec.state == "distribution_failed"
    assert rec.failure is not None and rec.failure.cause == "trainer_restarted"

    async def master_late() -> Any:
        async def receive(r: Any) -> dict[str, Any]:
            return {n: t async for n, t in r.receive_weights(global_steps=1)}

        async def send() -> Any:
            await asyncio.sleep(0.5)  # the replicas poll the registry meanwhile
            return await actor.send_weights(iter([("w", torch.ones(2))]), global_steps=1)

        return await asyncio.gather(send(), *[receive(r) for r in rollouts])

    out = asyncio.run(master_late())
    assert out[0]["rollout_lifecycle/activated"] == 1.0
    assert [r.acks for r in rollouts] == [[(1, "counted")], [(1, "counted")]]
    p = be.registry.pointer()
    assert p is not None and p.version == 1
    # a master built over a ledger with nothing awaiting voids nothing
    assert _engines(tmp_path, url, 2)[0].voided == []
    be.close()


def test_a_group_read_from_plain_tags_is_the_group_any_tags_give() -> None:
    """`group_of`'s one pass over verl's plain int tags gives the group the checked path
    gives, and any tag that is missing, a bool or a text takes the checked path."""
    base = {
        "min_global_steps": 4,
        "max_global_steps": 5,
        "response_len": 64,
        verl_v1.REWARD_TAG: 0.5,
    }
    variants: list[dict[str, Any]] = [
        {},
        {"max_global_steps": None},
        {"min_global_steps": 2, "max_global_steps": None},
        {"min_global_steps": None},
        {"min_global_steps": True},
        {"max_global_steps": "7"},
        {"response_len": None},
        {"response_len": 3.0},
        {verl_v1.REWARD_TAG: None},
        {verl_v1.REWARD_TAG: 1},
        {"min_global_steps": 9, "max_global_steps": 3},
    ]
    for n in (0, 1, 3):
        for i, v in enumerate(variants):
            for j, w in enumerate(variants):
                keys = [f"g_{s}_0" for s in range(n)]
                tags = {k: {**base, **(v if s % 2 else w)} for s, k in enumerate(keys)}
                got = verl_v1.group_of("g", keys, tags, i == j)
                want = verl_v1._group_of_any("g", keys, [tags[k] for k in keys], i == j)
                assert got == want, (n, v, w)


def test_held_rows_of_different_shapes_go_to_verl_in_groups_it_can_concatenate() -> None:
    """A prompt read back from TransferQueue (requeued, re-issued) holds a jagged field a
    dataloader row does not; verl's concat refuses the mix, which crashed a resumed trainer
    whose re-issued prompt was released in the same retry as held dataloader prompts."""
    from verl.utils import tensordict_utils as tu

    from rollout_lifecycle.gpu_check.verl_v1_pacing import _alike, _concat

    jagged = [tu.index_select_tensor_dict(_prompts(["1 + 1", "2 + 2"]), [i]) for i in (0, 1)]
    plain = tu.get_tensordict(
        {
            "input_ids": torch.zeros(1, 3, dtype=torch.long),
            "uid": np.array(["p"], dtype=object),
            "data_source": np.array(["arith"], dtype=object),
            "raw_prompt": np.array([[{"role": "user", "content": "3 + 3"}]], dtype=object),
        }
    )
    rows = [jagged[0], plain, jagged[1]]
    with pytest.raises(AssertionError, match="same set of nested tensors"):
        tu.concat_tensordict(rows)
    groups = _alike(rows)
    assert [len(g) for g in groups] == [2, 1] and groups[1][0] is plain
    sent = [_concat(g, 3) for g in groups]
    assert [list(map(str, b["uid"])) for b in sent] == [
        [str(jagged[0]["uid"][0]), str(jagged[1]["uid"][0])],
        ["p"],
    ]


# ---- (f) a finished group landed by its producer ------------------------------------------


def test_a_group_landed_by_its_worker_is_only_reserved_by_sample(
    clean: Any, tmp_path: Path
) -> None:
    """A group LedgerAgentLoopWorker landed (generation_done, reward_ready in a step of its
    own, the reward the buffer would record) is only reserved by the trainer's `sample`: the
    sample's step writes its reservation and nothing else; a group the worker left is landed
    by the buffer as before, with the same reward."""
    from rollout_lifecycle.gpu_check.verl_v1_pacing import land_finished_group

    be, _ = deployment(tmp_path / "s.db", versions=2)
    verl_v1.step_ledger(be.ledger).dispatch_many(
        [(LedgerEntry(u, 1, H[1]), f"run/{u}") for u in ("gw", "gb")]
    )
    scores = {"gw": [0.25, 1.0], "gb": [0.25, 1.0]}
    for uid, rs in scores.items():
        keys = put_group(clean, uid, 1)
        clean.kv_batch_put(
            keys=keys, partition_id="train", tags=[{verl_v1.REWARD_TAG: r} for r in rs]
        )
    assert land_finished_group(be.ledger, "gw", scores["gw"], 6, REWARD)
    landed = be.ledger.get("gw")
    assert landed.state == "rewarded" and landed.tokens == 6
    buf = buffer(be, "run")
    buf.sample(global_steps=2, partition_id="train", batch_size=2)
    hist = be.ledger.history()
    reserve_txn = {e.rollout_id: e.txn for e in hist if e.event == "reserve"}
    assert set(reserve_txn) == {"gw", "gb"}
    in_sample = [(e.rollout_id, e.event) for e in hist if e.txn == reserve_txn["gw"]]
    assert ("gw", "reward_ready") not in in_sample and ("gb", "reward_ready") in in_sample
    gw, gb = be.ledger.get("gw"), be.ledger.get("gb")
    assert gw.state == gb.state == "reserved"
    assert gw.reward == gb.reward and gw.tokens == gb.tokens == 6
    be.close()


def test_a_worker_lands_only_a_dispatched_row(tmp_path: Path) -> None:
    """An absent row is not added by the worker (its version was never stamped), a landed
    or ended one is left as it is, and a group with no reward is not landed."""
    from rollout_lifecycle.gpu_check.verl_v1_pacing import land_finished_group

    be, _ = deployment(tmp_path / "s.db", versions=2)
    assert not land_finished_group(be.ledger, "absent", [1.0], 3, REWARD)
    assert be.ledger.find("absent") is None
    verl_v1.step_ledger(be.ledger).dispatch_many([(LedgerEntry("d", 1, H[1]), "run/d")])
    assert not land_finished_group(be.ledger, "d", [], 3, REWARD)
    assert be.ledger.get("d").state == "dispatched"
    assert land_finished_group(be.ledger, "d", [1.0, 0.0], 3, REWARD)
    before = be.ledger.get("d")
    assert not land_finished_group(be.ledger, "d", [0.5], 9, REWARD)
    assert be.ledger.get("d") == before and before.reward == Reward(
        REWARD.function_id, REWARD.function_version, 0.5
    )
    be.close()


def test_a_finished_group_completes_with_its_last_scored_session() -> None:
    from rollout_lifecycle.gpu_check.verl_v1_pacing import FinishedGroup

    g = FinishedGroup(3)
    assert not g.add(2, ["u_2_0"], 1.0, 4)
    assert not g.add(0, ["u_0_0", "u_0_1"], 0.5, 6)
    assert not g.add(0, ["u_0_0", "u_0_1"], 0.5, 0)  # a session seen again is one session
    assert g.add(1, ["u_1_0"], 0.0, 2)
    assert g.rewards_in_key_order() == [0.5, 0.5, 0.0, 1.0] and g.tokens == 12
    unscored = FinishedGroup(2)
    assert not unscored.add(0, ["v_0_0"], None, 3)
    assert not unscored.add(1, ["v_1_0"], 1.0, 3)  # an unscored session: the buffer lands it


def test_the_worker_lands_a_group_when_its_last_session_is_postprocessed(
    clean: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LedgerAgentLoopWorker's own hooks (verl's parent postprocess and prompt run stood in
    for by what they write): no landing until every session of the prompt is postprocessed,
    then one, before `_run_prompt` returns (verl marks the prompt finished after that)."""
    from omegaconf import OmegaConf

    from rollout_lifecycle.gpu_check import verl_v1_pacing as vp

    be, _ = deployment(tmp_path / "s.db", versions=2)
    verl_v1.step_ledger(be.ledger).dispatch_many([(LedgerEntry("gk", 1, H[1]), "run/gk")])
    worker = object.__new__(vp.LedgerAgentLoopWorker)
    worker.config = OmegaConf.create(
        {
            "actor_rollout_ref": {"rollout": {"n": 2}},
            "trainer": {
                "v1": {
                    "sampler": {
                        "sampler_kwargs": {
                            "ledger_url": be.url,
                            "run_id": "run",
                            "tokenizer_id": "tok",
                            **ROLLOUT_CFG,
                            "reward_fn_id": REWARD.function_id,
                            "reward_fn_version": REWARD.function_version,
                        }
                    }
                }
            },
        }
    )
    states: list[str] = []

    async def parent_postprocess(self: Any, output: Any, validate: Any, **kw: Any) -> None:
        return None

    async def parent_run_prompt(
        self: Any, prompt: Any, sp: Any, trajectory: Any, trace: Any
    ) -> None:
        for s, score in enumerate([0.5, 1.5]):
            out = type("Out", (), {"reward_score": score, "response_ids": [1, 2, 3]})()
            await self._agent_loop_postprocess(out, False, uid="gk", session_id=s)
            states.append(be.ledger.get("gk").state)

    monkeypatch.setattr(vp._PlainWorkerTQ, "_agent_loop_postprocess", parent_postprocess)
    monkeypatch.setattr(vp._PlainWorkerTQ, "_run_prompt", parent_run_prompt)
    asyncio.run(worker._run_prompt({"uid": "gk"}, {}, trajectory={"validate": False}))
    assert states == ["dispatched", "rewarded"]
    row = be.ledger.get("gk")
    assert row.tokens == 6 and row.reward is not None and row.reward.value == pytest.approx(1.0)
    assert worker._groups() == {}  # the prompt's bookkeeping ends with it
    be.close()
