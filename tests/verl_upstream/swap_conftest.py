"""Copied as `conftest.py` next to verl's own replay-buffer test file: every buffer that file
builds is a `LedgerReplayBuffer` on a throwaway SQLite ledger, and every group it writes is
dispatched through that ledger first, as `LedgerAgentLoopManager` does before verl generates.

What the swap changes, and nothing else:
* `ReplayBuffer` and `ReplayBufferAsync` in the test module build `LedgerReplayBuffer`
  (verl's constructor arguments passed through; our settings name the ledger and a fresh run).
* TransferQueue's `kv_put`, for the test's duration, dispatches a group through the ledger
  at its first trajectory (version = the registry's pointer) and adds the `rm_scores` field
  verl's agent loop writes with streaming reward (the file's trajectories carry only
  `input_ids`; tags are left exactly as the file writes them).
* Ray is started with 4 logical CPUs before the file's `tq.init()` (TransferQueue's default
  actors need 3; with 2 cores the init waits forever).
The deployment's policy is loose (max_lag 1000) and its pointer active, so verl's own
staleness threshold is what the file's staleness tests exercise.
"""

from __future__ import annotations

import itertools
import os
import re
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest

_KEY = re.compile(r"^([^_]+)_\d+_\d+$")
STRIP = "RL_VERL_TESTS_STRIP_LEDGER_METRICS"
_RUNS = itertools.count()
_STATE: dict[str, Any] = {}


def pytest_configure(config: pytest.Config) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)


def _deployment() -> dict[str, Any]:
    if _STATE:
        return _STATE
    from rollout_lifecycle.gpu_check.verl_v1 import DispatchBook, step_ledger
    from rollout_lifecycle.model.backends import open_backend
    from rollout_lifecycle.model.coordinator import ActivationCoordinator
    from rollout_lifecycle.model.records import AdmissionPolicy, WorkerAck
    from rollout_lifecycle.model.registry import set_admission_policy

    path = Path(tempfile.mkdtemp(prefix="verl-upstream-")) / "ledger.db"
    be = open_backend(f"sqlite:///{path}")
    set_admission_policy(be.registry, AdmissionPolicy(1000, 1e6), "set by the operator")
    coord = ActivationCoordinator(
        be.registry, ["rollout-0"], ledger=be.ledger, policy=AdmissionPolicy(1000, 1e6)
    )
    h = "f" * 64
    coord.prepare(0)
    coord.commit_artifact(0, h)
    coord.distribute(0)
    coord.record_ack(WorkerAck("rollout-0", 0, h, token=coord.attempt_token("rollout-0", 0)))
    assert coord.try_activate(0).activated
    _STATE.update(backend=be, ledger=step_ledger(be.ledger), book=DispatchBook(), hash=h)
    return _STATE


def _dispatching(kv_put: Any) -> Any:
    """TransferQueue's `kv_put`, dispatching a group through the ledger when its first
    trajectory is written and adding the `rm_scores` field verl's agent loop writes."""

    def put(key: str, partition_id: str, fields: Any = None, tag: Any = None, **kw: Any) -> Any:
        m = _KEY.match(key)
        if m is not None and fields is not None:
            import torch

            from rollout_lifecycle.model.records import LedgerEntry

            st = _deployment()
            uid = m.group(1)
            if st["book"].entry(uid) is None:
                outs = st["ledger"].dispatch_many(
                    [(LedgerEntry(uid, 0, st["hash"]), f"verl-tests/{uid}")]
                )
                st["book"].record(o.entry for o in outs if o.entry is not None)
            fields = dict(fields)
            fields.setdefault("rm_scores", torch.tensor([0.0, 0.0, 1.0]))
        return kv_put(key=key, partition_id=partition_id, fields=fields, tag=tag, **kw)

    put.dispatching = True  # type: ignore[attr-defined]
    return put


def _ledger_buffer(**kwargs: Any) -> Any:
    from rollout_lifecycle.gpu_check.verl_v1 import LedgerReplayBuffer

    st = _deployment()
    kwargs["sampler_kwargs"] = {
        "ledger_url": st["backend"].url,
        "run_id": f"verl{next(_RUNS)}x{uuid.uuid4().hex[:6]}",
    }
    buf = LedgerReplayBuffer(**kwargs)
    buf.book = st["book"]
    if os.environ.get(STRIP) == "1":  # show that our extra metric keys are the only change
        sample = buf.sample

        def sample_without_our_metrics(*a: Any, **kw: Any) -> Any:
            meta, metrics = sample(*a, **kw)
            return meta, {
                k: v for k, v in metrics.items() if not k.startswith("rollout_lifecycle/")
            }

        buf.sample = sample_without_our_metrics
    return buf


@pytest.fixture(autouse=True)
def _swap_in_the_ledger_buffer(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = request.module
    for name in ("ReplayBuffer", "ReplayBufferAsync"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, _ledger_buffer)
    import transfer_queue

    if not getattr(transfer_queue.kv_put, "dispatching", False):
        monkeypatch.setattr(transfer_queue, "kv_put", _dispatching(transfer_queue.kv_put))
