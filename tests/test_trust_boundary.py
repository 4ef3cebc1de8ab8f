"""The system of record decides (issue 17): a learner's word never loosens admission.

Each case of the issue's reproductions, on every backend: the deployment's recorded
admission policy and the pointer of the reservation's own step judge every stamp; a stamp
that contradicts itself is refused; a deployment with no policy admits nothing; a rolled
back version is retired unless the operator keeps it; `ledger check` agrees with the
write path on the recorded history.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from click.testing import CliRunner

from rollout_lifecycle.cli.main import cli
from rollout_lifecycle.model.admission import admit_and_reserve
from rollout_lifecycle.model.backends import Backend, open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.errors import (
    ActivationError,
    CommitMismatch,
    GateConfigError,
    InvalidRecord,
    LedgerError,
    UpdatePoisoned,
)
from rollout_lifecycle.model.gate import AdmissionGate, GatePolicy
from rollout_lifecycle.model.ledger import ManualClock, MemoryLedger, ReserveRequest
from rollout_lifecycle.model.records import (
    ActionEvidence,
    AdmissionPolicy,
    AdmissionStamp,
    BehaviorPolicy,
    GenerationConditions,
    Reward,
    Rollout,
    RolloutIdentity,
    WorkerAck,
)
from rollout_lifecycle.model.registry import activated_hash, backend_url, set_admission_policy
from rollout_lifecycle.spec.audit import audit
from rollout_lifecycle.spec.invariants import check_trace
from rollout_lifecycle.stateful_tests.backends import durable_url

KINDS = ["memory", "sqlite", "postgresql"]
WORKERS = ["gen-0", "gen-1"]
POLICY = AdmissionPolicy(max_lag=1, max_drift=0.2)
CONDITIONS = GenerationConditions("tok", 1.0, 1.0, -1, 8)
H = {v: f"{v:x}".rjust(64, "d") for v in range(16)}
REWARD = Reward("rm", "1", 1.0)


@contextlib.contextmanager
def deployment(kind: str, tmp_path: Path) -> Iterator[Backend]:
    url = "memory://" if kind == "memory" else durable_url(kind, tmp_path)
    with open_backend(url) as b:
        yield b


def activate(coord: ActivationCoordinator, version: int) -> None:
    coord.prepare(version)
    coord.commit_artifact(version, H[version])
    coord.distribute(version)
    for w in coord.required_workers:
        ack = WorkerAck(w, version, H[version], token=coord.attempt_token(w, version))
        assert coord.record_ack(ack).counted
    assert coord.try_activate(version).activated


def rollout(rid: str, version: int, old: float = -0.5) -> Rollout:
    return Rollout(
        RolloutIdentity(rid, f"p-{rid}", "d", 0),
        BehaviorPolicy(version, H[version]),
        CONDITIONS,
        ActionEvidence([1, 2, 3], [True, True, False], [old, old, 0.0]),
    )


def rewarded(b: Backend, ro: Rollout) -> int:
    """Add `ro` and bring it to `rewarded`; returns its revision."""
    b.ledger.add(ro)
    b.ledger.transition(ro.rollout_id, "generation_done", 0)
    return b.ledger.transition(ro.rollout_id, "reward_ready", 1, reward=REWARD).revision


def forged(stamp: AdmissionStamp, **fields: Any) -> AdmissionStamp:
    """A stamp with fields its validators refuse, as a buggy client could hand one over."""
    out = attrs.evolve(stamp)
    for k, v in fields.items():
        object.__setattr__(out, k, v)
    return out


def good_stamp(bv: int, cv: int, **over: Any) -> AdmissionStamp:
    lag = cv - bv
    base = {
        "current_version": cv,
        "behavior_version": bv,
        "max_lag": 1,
        "max_drift": 0.2,
        "drift": 0.0,
        "freshness": "fresh" if lag == 0 else "tolerated" if lag <= 1 else "stale",
        "reason": "ok",
        "accepted": True,
    }
    base.update(over)
    return AdmissionStamp(**base)


def operated(b: Backend) -> ActivationCoordinator:
    """The operator records POLICY; the coordinator, built expecting it, never writes it."""
    set_admission_policy(b.registry, POLICY, "set by the operator")
    return ActivationCoordinator(b.registry, WORKERS, ledger=b.ledger, policy=POLICY)


def at_v10(b: Backend) -> ActivationCoordinator:
    coord = operated(b)
    for v in range(11):
        activate(coord, v)
    return coord


def assert_clean(b: Backend) -> None:
    rep = check_trace(b.trace())
    assert rep.ok, [str(v) for v in rep.violations]


@pytest.mark.parametrize("kind", KINDS)
def test_a_learner_configured_looser_than_the_policy_is_refused(kind: str, tmp_path: Path) -> None:
    """Policy max_lag 1 / max_drift 0.2, pointer at v10: a learner with GatePolicy(1000,
    1e9) admits a v0 rollout (lag 10, drift 6) but cannot reserve it."""
    with deployment(kind, tmp_path) as b:
        at_v10(b)
        ro = rollout("old", 0, old=-6.5)
        rev = rewarded(b, ro)
        gate = AdmissionGate(
            GatePolicy(1000, 1e9), registry=lambda v: activated_hash(b.registry, v)
        )
        (d,) = gate.assess_batch([ro], np.full((1, 3), -0.5), 10, ledger=b.ledger)
        assert d.accepted and d.lag == 10 and d.drift == pytest.approx(6.0)
        out = b.ledger.reserve("old", rev, "u1", d.stamp())
        assert (out.reserved, out.reason) == (False, "looser_than_policy")
        assert "max_lag 1000" in out.detail and "max_lag 1," in out.detail
        (batch,) = b.ledger.reserve_batch("u1", [ReserveRequest("old", rev, d.stamp())])
        assert (batch.reserved, batch.reason) == (False, "looser_than_policy")
        assert b.ledger.get("old").state == "rewarded"
        assert_clean(b)


@pytest.mark.parametrize("kind", KINDS)
def test_hand_made_stamps_are_judged_against_the_deployment(kind: str, tmp_path: Path) -> None:
    """A hand-made stamp claiming current v0 at max_lag 10, or bounds of 10**9 / 1e300, or
    a current version that never was active, never reserves a lag-10 rollout."""
    with deployment(kind, tmp_path) as b:
        at_v10(b)
        rev = rewarded(b, rollout("old", 0))
        claims = {
            "looser_than_policy": [
                good_stamp(0, 0, max_lag=10),
                good_stamp(0, 10, max_lag=10**9, max_drift=1e300, freshness="tolerated"),
            ],
            "pointer_moved": [good_stamp(0, 0), good_stamp(0, 1)],
            "stamp_contradicts_itself": [good_stamp(0, 12, max_lag=1, freshness="stale")],
        }
        for reason, stamps in claims.items():
            for s in stamps:
                out = b.ledger.reserve("old", rev, "u1", s)
                assert (out.reserved, out.reason) == (False, reason), (s, out.detail)
        rejected = good_stamp(0, 13, freshness="stale", accepted=False, reason="stale_policy")
        assert b.ledger.reserve("old", rev, "u1", rejected).reason == "not_admitted"
        assert b.ledger.get("old").revision == rev
        # admitted against v11, which never was active: refused, whatever the lag says
        new_rev = rewarded(b, rollout("new", 10))
        out = b.ledger.reserve("new", new_rev, "u1", good_stamp(10, 11))
        assert (out.reserved, out.reason) == (False, "stamp_contradicts_itself")
        assert "never was the active version" in out.detail
        assert b.ledger.reserve("new", new_rev, "u1", good_stamp(10, 10)).reserved
        assert_clean(b)


@pytest.mark.parametrize("kind", KINDS)
def test_self_contradicting_stamps_are_refused(kind: str, tmp_path: Path) -> None:
    """Drift -5.0, NaN drift, accepted='yes', freshness='garbage', accepted with a
    rejection reason, a freshness the lag does not give: refused with a typed reason
    (and the record's validators refuse them at construction already)."""
    with deployment(kind, tmp_path) as b:
        coord = operated(b)
        activate(coord, 0)
        rev = rewarded(b, rollout("r", 0))
        ok = good_stamp(0, 0)
        for field, value in (
            ("drift", -5.0),
            ("drift", float("nan")),
            ("accepted", "yes"),
            ("freshness", "garbage"),
            ("max_drift", -1.0),
        ):
            with pytest.raises(InvalidRecord):
                attrs.evolve(ok, **{field: value})
            out = b.ledger.reserve("r", rev, "u", forged(ok, **{field: value}))
            assert (out.reserved, out.reason) == (False, "stamp_contradicts_itself"), field
        for bad in (
            attrs.evolve(ok, reason="stale_policy"),
            attrs.evolve(ok, freshness="tolerated"),
            attrs.evolve(ok, accepted=False),
            attrs.evolve(ok, drift=None),
        ):
            out = b.ledger.reserve("r", rev, "u", bad)
            assert (out.reserved, out.reason) == (False, "stamp_contradicts_itself"), bad
        assert b.ledger.reserve("r", rev, "u", ok).reserved
        assert_clean(b)


@pytest.mark.parametrize("kind", KINDS)
def test_no_recorded_policy_admits_nothing(kind: str, tmp_path: Path) -> None:
    """A deployment without a recorded policy refuses every reservation (fail closed), and
    the one call that admits from evidence says what to do."""
    with deployment(kind, tmp_path) as b:
        coord = ActivationCoordinator(b.registry, WORKERS, ledger=b.ledger)
        activate(coord, 0)
        ro = rollout("r", 0)
        rev = rewarded(b, ro)
        out = b.ledger.reserve("r", rev, "u", good_stamp(0, 0))
        assert (out.reserved, out.reason) == (False, "no_admission_policy")
        where = backend_url(b.registry)
        if where is None:  # memory: the library call, in this process
            assert "set_admission_policy" in out.detail
        else:  # the command names this very database, never the default file
            assert f"set-policy --backend {where} " in out.detail, out.detail
        with pytest.raises(GateConfigError, match="no admission policy") as err:
            admit_and_reserve(b.ledger, b.registry, "u", [ro], np.full((1, 3), -0.5))
        assert where is None or f"--backend {where} " in str(err.value)
        set_admission_policy(b.registry, POLICY, "the operator sets it")
        assert b.ledger.reserve("r", rev, "u", good_stamp(0, 0)).reserved
        assert [e.kind for e in b.registry.trace()].count("policy") == 1
        assert_clean(b)


@pytest.mark.parametrize("kind", KINDS)
def test_a_misconfigured_coordinator_started_first_sets_no_policy(
    kind: str, tmp_path: Path
) -> None:
    """Issue 31 item 1: a coordinator built with AdmissionPolicy(1000, 1e9) before the
    operator acted records nothing (no policy, no membership) and is refused with the
    command naming this database; the operator's policy is then the one that judges, and a
    lag-10 rollout admitted by the loose configuration is refused."""
    loose = AdmissionPolicy(1000, 1e9)
    with deployment(kind, tmp_path) as b:
        with pytest.raises(ActivationError, match="records no admission policy") as err:
            ActivationCoordinator(b.registry, WORKERS, ledger=b.ledger, policy=loose)
        where = backend_url(b.registry)
        if where is not None:
            wanted = f"set-policy --backend {where} --max-lag 1000 --max-drift 1000000000.0"
            assert wanted in str(err.value), str(err.value)
            assert "rollout-lifecycle.db" not in str(err.value)
        else:
            assert "set_admission_policy(registry, AdmissionPolicy(max_lag=1000, " in str(err.value)
        assert b.registry.policy() is None and b.registry.required_workers() is None
        assert b.registry.trace() == []
        coord = at_v10(b)  # the operator records POLICY (lag 1), then the coordinator runs
        with pytest.raises(ActivationError, match="records admission policy") as err:
            ActivationCoordinator(b.registry, ledger=b.ledger, policy=loose)
        assert where is None or f"--backend {where} --max-lag 1000 " in str(err.value)
        assert b.registry.policy() == POLICY
        ro = rollout("old", 0)
        rev = rewarded(b, ro)
        gate = AdmissionGate(
            GatePolicy(1000, 1e9), registry=lambda v: activated_hash(b.registry, v)
        )
        (d,) = gate.assess_batch([ro], np.full((1, 3), -0.5), 10, ledger=b.ledger)
        assert d.accepted and d.lag == 10
        out = b.ledger.reserve("old", rev, "u1", d.stamp())
        assert (out.reserved, out.reason) == (False, "looser_than_policy")
        got = admit_and_reserve(b.ledger, b.registry, "u2", [ro], np.full((1, 3), -0.5))
        assert got.reserved == [] and got.refused == {"old": "stale_policy"}
        assert [e.after for e in b.registry.trace() if e.kind == "policy"] == [POLICY]
        assert coord.policy() == POLICY
        assert_clean(b)


@pytest.mark.parametrize("kind", KINDS)
def test_policy_changes_are_recorded_steps_judged_at_each_reservation(
    kind: str, tmp_path: Path
) -> None:
    """Tightening the recorded policy refuses a stamp that passed under the old one; a
    second coordinator given another policy is refused; the trace holds each change."""
    with deployment(kind, tmp_path) as b:
        coord = operated(b)
        activate(coord, 0)
        activate(coord, 1)
        rev = rewarded(b, rollout("r", 0))
        stamp = good_stamp(0, 1)
        set_admission_policy(b.registry, AdmissionPolicy(0, 0.2), "tighten after a blow-up")
        out = b.ledger.reserve("r", rev, "u", stamp)
        assert (out.reserved, out.reason) == (False, "looser_than_policy")
        with pytest.raises(ActivationError, match="records admission policy"):
            ActivationCoordinator(b.registry, policy=POLICY)
        set_admission_policy(b.registry, POLICY, "relax again")
        assert b.ledger.reserve("r", rev, "u", stamp).reserved
        pols = [e for e in b.registry.trace() if e.kind == "policy"]
        assert [p.after for p in pols] == [POLICY, AdmissionPolicy(0, 0.2), POLICY]
        assert [p.reason for p in pols][1:] == ["tighten after a blow-up", "relax again"]
        assert_clean(b)


@pytest.mark.parametrize("kind", KINDS)
def test_admit_and_reserve_computes_drift_from_evidence(kind: str, tmp_path: Path) -> None:
    """The one call reads policy and pointer from the registry and drift from the
    log-probs: a rollout whose real drift is 6.0 is refused whatever a stamp would claim."""
    with deployment(kind, tmp_path) as b:
        coord = operated(b)
        activate(coord, 0)
        activate(coord, 1)
        good, far, behind = rollout("good", 1), rollout("far", 1, old=-6.5), rollout("b", 0)
        for ro in (good, far, behind):
            rewarded(b, ro)
        got = admit_and_reserve(
            b.ledger, b.registry, "u", [good, far, behind], np.full((3, 3), -0.5)
        )
        assert got.current_version == 1
        assert got.reserved == ["good", "b"]
        assert got.refused == {"far": "policy_drift"}
        activate(coord, 2)  # v0 is now 2 behind: admitted again, the same call refuses it
        rewarded(b, rollout("b2", 0))
        late = admit_and_reserve(
            b.ledger, b.registry, "u2", [rollout("b2", 0)], np.full((1, 3), -0.5)
        )
        assert late.refused == {"b2": "stale_policy"} and late.reserved == []
        # a forged drift of 0.0 on the far rollout still passes a bare stamp: that figure is
        # the one thing a stamp is trusted for (documented); the evidence path refuses it
        assert {d.rollout_id: d.drift for d in got.decisions}["far"] == pytest.approx(6.0)
        b.ledger.commit("u", got.reserved)
        assert_clean(b)


@pytest.mark.parametrize("kind", KINDS)
def test_rollback_retires_the_rolled_back_version(kind: str, tmp_path: Path) -> None:
    """After rolling v2 back to v1, v2 rollouts are quarantined on arrival and never
    reserved, not even once v3 is active (lag 1); keep_rollouts=True is recorded."""
    with deployment(kind, tmp_path) as b:
        coord = operated(b)
        for v in (0, 1, 2):
            activate(coord, v)
        open_rev = rewarded(b, rollout("before", 2))
        assert coord.rollback().version == 1
        assert b.ledger.get("before").state == "quarantined"
        b.ledger.add(rollout("after", 2))
        assert b.ledger.get("after").state == "quarantined"
        activate(coord, 3)
        assert coord.artifact(2).state == "rolled_back"
        assert coord.artifact(2).failure is not None
        assert coord.artifact(2).failure.cause == "rolled_back"
        # the mark lifted (a ledger that missed it): a late v2 rollout is still quarantined
        # on arrival (retirement is read from the registry in the add's own step), and one
        # that was never quarantined (forged into the store) is refused by the reservation
        b.ledger.clear_bad_version(2)
        b.ledger.add(rollout("late", 2))
        assert b.ledger.get("late").state == "quarantined"
        if kind == "memory":
            assert isinstance(b.ledger, MemoryLedger)
            ghost = attrs.evolve(rollout("ghost", 2).entry(), state="rewarded", reward=REWARD)
            b.ledger.store.entries["ghost"] = ghost
            out = b.ledger.reserve("ghost", ghost.revision, "u", good_stamp(2, 3))
            assert (out.reserved, out.reason) == (False, "version_retired")
            del b.ledger.store.entries["ghost"]
        assert open_rev >= 0
        assert_clean(b)


@pytest.mark.parametrize("kind", KINDS)
def test_rollback_keeping_rollouts_is_an_explicit_recorded_choice(
    kind: str, tmp_path: Path
) -> None:
    """keep_rollouts=True keeps v2's rollouts trainable and records the choice."""
    with deployment(kind, tmp_path) as b:
        coord = operated(b)
        for v in (0, 1, 2):
            activate(coord, v)
        rev = rewarded(b, rollout("kept", 2))
        coord.rollback(keep_rollouts=True, reason="v2 was fine, the eval was wrong")
        failure = coord.artifact(2).failure
        assert failure is not None and failure.cause == "rolled_back_kept"
        assert failure.detail == "v2 was fine, the eval was wrong"
        assert b.ledger.get("kept").state == "rewarded"
        # v1 is active again: lag 1 - 2 < 0 is a future rollout, so activate v3 first
        activate(coord, 3)
        assert b.ledger.reserve("kept", rev, "u", good_stamp(2, 3)).reserved
        with pytest.raises(ActivationError, match="keep_rollouts"):
            coord.rollback(keep_rollouts="yes")  # type: ignore[arg-type]
        assert_clean(b)


def test_deployment_cli_sets_and_shows_the_policy(tmp_path: Path) -> None:
    """`deployment set-policy` records the policy (a traced step); `show` prints it; bad
    values are refused without a traceback and nothing is written."""
    url = f"sqlite:///{tmp_path / 'd.db'}"
    runner = CliRunner()
    res = runner.invoke(cli, ["deployment", "show", "--backend", url])
    assert res.exit_code == 2 and "no such file" in res.output
    args = ["deployment", "set-policy", "--backend", url, "--max-lag", "1", "--max-drift", "0.2"]
    res = runner.invoke(cli, args)
    assert res.exit_code == 2 and "add --create" in res.output, res.output
    res = runner.invoke(cli, [*args, "--create"])
    assert res.exit_code == 0, res.output
    described = "max_lag 1, max_drift 0.2, lineage ledger, chain_key identity"
    assert f"policy recorded: {described} (was: none)" in res.output
    for bad in (
        ["--max-lag", "-1", "--max-drift", "0.2"],
        ["--max-lag", "1", "--max-drift", "nan"],
    ):
        res = runner.invoke(cli, ["deployment", "set-policy", "--backend", url, *bad])
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    res = runner.invoke(cli, ["deployment", "show", "--backend", url, "--json"])
    assert res.exit_code == 0, res.output
    shown = {"max_lag": 1, "max_drift": 0.2, "lineage": "ledger", "chain_key": "identity"}
    assert json.loads(res.output)["policy"] == shown  # the modes shown at their defaults too
    res = runner.invoke(cli, ["deployment", "show", "--backend", url])
    assert f"admission policy: {described}" in res.output
    # the recorded opt-outs (issue 31) are set by the operator and shown
    opted = ["--lineage", "off", "--chain-key", "caller", "--reason", "tracked elsewhere"]
    res = runner.invoke(
        cli,
        [
            "deployment",
            "set-policy",
            "--backend",
            url,
            "--max-lag",
            "1",
            "--max-drift",
            "0.2",
            *opted,
        ],
    )
    assert res.exit_code == 0 and "lineage off, chain_key caller" in res.output, res.output
    res = runner.invoke(cli, ["deployment", "show", "--backend", url, "--json"])
    assert json.loads(res.output)["policy"] == {**shown, "lineage": "off", "chain_key": "caller"}
    res = runner.invoke(
        cli,
        [
            "deployment",
            "set-policy",
            "--backend",
            url,
            "--max-lag",
            "1",
            "--max-drift",
            "0.2",
            "--lineage",
            "maybe",
        ],
    )
    assert res.exit_code == 2 and "Traceback" not in res.output
    res = runner.invoke(cli, ["ledger", "check", "--backend", url])
    assert res.exit_code == 0, res.output


# ---- one clock per deployment ------------------------------------------------------------

FAKETIME = shutil.which("faketime")
needs_faketime = pytest.mark.skipif(
    FAKETIME is None and not os.environ.get("CI"),
    reason="faketime is not installed (apt-get install faketime; .ci/run installs it)",
)

_SKEWED_LEARNER = """
import sys, time
from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.records import AdmissionStamp
url, rid, rev = sys.argv[1], sys.argv[2], int(sys.argv[3])
stamp = AdmissionStamp(0, 0, 1, 0.2, 0.0, "fresh", "ok", True)
with open_backend(url, lease_seconds=600) as b:
    out = b.ledger.reserve(rid, rev, "skewed-learner", stamp)
    print(out.reason, out.entry.lease_expires_at, time.time())
"""


def _run_skewed(shift: str, *args: str) -> list[str]:
    """Run the learner with its process clock shifted by `shift` (faketime, -700s...)."""
    assert FAKETIME is not None, "faketime is required in CI"
    cmd = [FAKETIME, "-f", shift, sys.executable, "-c", _SKEWED_LEARNER, *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


@needs_faketime
@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_learner_700s_behind_gets_a_full_lease(kind: str, tmp_path: Path) -> None:
    """A learner whose clock runs 700 s behind reserves with a 600 s lease: the deadline is
    the deployment's clock + 600, so a janitor on a correct clock expires nothing and no
    second update can take the rollout while the first one trains."""
    url = durable_url(kind, tmp_path)
    with open_backend(url) as b:
        coord = operated(b)
        activate(coord, 0)
        rev = rewarded(b, rollout("r", 0))
    reason, deadline, learner_now = _run_skewed("-700s", url, "r", str(rev))
    assert reason == "reserved"
    assert float(learner_now) < time.time() - 600  # the learner's clock really was behind
    assert float(deadline) > time.time() + 500  # ... yet its deadline is the deployment's
    with open_backend(url) as janitor:
        assert janitor.ledger.expire_leases() == []
        out = janitor.ledger.reserve("r", rev + 1, "second-update", good_stamp(0, 0))
        assert not out.reserved
        assert janitor.ledger.get("r").reserved_by == "skewed-learner"


@needs_faketime
@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_janitor_whose_clock_jumps_ahead_expires_nothing_early(kind: str, tmp_path: Path) -> None:
    """A janitor 700 s ahead (or a learner 3600 s ahead) does not move lease time: live
    leases stay live, and a crashed learner's lease ends 600 s after it was taken."""
    url = durable_url(kind, tmp_path)
    with open_backend(url) as b:
        coord = operated(b)
        activate(coord, 0)
        rev = rewarded(b, rollout("r", 0))
    _, deadline, _ = _run_skewed("+3600s", url, "r", str(rev))
    assert float(deadline) < time.time() + 700  # not 3600 s late
    janitor = (
        "import sys\nfrom rollout_lifecycle.model.backends import open_backend\n"
        "with open_backend(sys.argv[1]) as b:\n    print(len(b.ledger.expire_leases()))\n"
    )
    res = subprocess.run(
        [str(FAKETIME), "-f", "+700s", sys.executable, "-c", janitor, url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["0"]
    with open_backend(url) as b:
        assert b.ledger.get("r").state == "reserved"


# ---- fencing by lineage -----------------------------------------------------------------


def _lose_the_lease(b: Backend, coord: ActivationCoordinator) -> int:
    """Learner A reserves r (and will lose its lease). Returns r's revision before."""
    rev = rewarded(b, rollout("r", 0))
    assert b.ledger.reserve("r", rev, "update-A", good_stamp(0, 0)).reserved
    return rev


@pytest.mark.parametrize("kind", KINDS)
def test_a_version_trained_by_an_update_whose_commit_did_not_land_is_refused(
    kind: str, tmp_path: Path
) -> None:
    """A's lease is lost and B consumes the rollout; A trained on it anyway. A version
    recording A in its lineage is refused at prepare; one recording B is published, and
    a forged record that names A is refused again at commit and at activation."""
    url = "memory://" if kind == "memory" else durable_url(kind, tmp_path)
    with open_backend(url, lease_seconds=0.3) as b:
        coord = operated(b)
        activate(coord, 0)
        rev = _lose_the_lease(b, coord)
        time.sleep(0.6)
        assert [e.rollout_id for e in b.ledger.expire_leases()] == ["r"]
        got = b.ledger.reserve("r", rev + 2, "update-B", good_stamp(0, 0))
        assert got.reserved
        with pytest.raises(CommitMismatch):
            b.ledger.commit("update-A", ["r"])
        b.ledger.commit("update-B", ["r"])
        with pytest.raises(ActivationError, match=r"\['update-A: lease_expired'\] are poisoned"):
            coord.prepare(1, parent_version=0, trained_by=["update-A"])
        with pytest.raises(ActivationError, match="poisoned"):
            coord.prepare(1, trained_by=["update-B", "update-A"])
        with pytest.raises(ActivationError, match=r"\['ghost'\] have no landed commit"):
            coord.prepare(1, trained_by=["ghost"])
        assert b.registry.artifact(1) is None
        rec = coord.prepare(1, parent_version=0, trained_by=["update-B"])
        assert rec.trained_by == ("update-B",)
        coord.commit_artifact(1, H[1])
        coord.distribute(1)
        for w in WORKERS:
            assert coord.record_ack(WorkerAck(w, 1, H[1], token=coord.attempt_token(w, 1))).counted
        assert coord.try_activate(1).activated
        assert b.registry.artifact(1).trained_by == ("update-B",)
        for bad in ("x", ["u", "u"], [""], [1]):
            with pytest.raises(ActivationError):
                coord.prepare(2, trained_by=bad)  # type: ignore[arg-type]
        assert_clean(b)


@pytest.mark.parametrize("kind", KINDS)
def test_every_reservation_checks_the_behaviour_hash(kind: str, tmp_path: Path) -> None:
    """Issue 31 item 5: a rollout stamped v0 with a hash v0 never had is refused
    `artifact_hash_mismatch` by a single reservation (twice: the guarded path on
    PostgreSQL once the update is recorded), by a batch and by admit_and_reserve; a version that
    never was active is refused `version_not_active` first."""
    with deployment(kind, tmp_path) as b:
        coord = operated(b)
        activate(coord, 0)
        ok_rev = rewarded(b, rollout("ok", 0))
        assert b.ledger.reserve("ok", ok_rev, "u", good_stamp(0, 0)).reserved  # u recorded
        forged = Rollout(
            RolloutIdentity("forged", "p", "d", 0),
            BehaviorPolicy(0, "f" * 64),
            CONDITIONS,
            ActionEvidence([1, 2, 3], [True, True, False], [-0.5, -0.5, 0.0]),
        )
        rev = rewarded(b, forged)
        for update in ("u", "fresh"):
            out = b.ledger.reserve("forged", rev, update, good_stamp(0, 0))
            assert (out.reserved, out.reason) == (False, "artifact_hash_mismatch"), out
        (batch,) = b.ledger.reserve_batch("u", [ReserveRequest("forged", rev, good_stamp(0, 0))])
        assert batch.reason == "artifact_hash_mismatch"
        lp = np.array([[-0.5, -0.5, 0.0]])
        got = admit_and_reserve(b.ledger, b.registry, "u2", [forged], lp)
        assert got.refused == {"forged": "artifact_hash_mismatch"}
        never = Rollout(
            RolloutIdentity("never", "p", "d", 0), BehaviorPolicy(5, "f" * 64), CONDITIONS
        )
        never_rev = rewarded(b, never)
        out = b.ledger.reserve("never", never_rev, "u", good_stamp(5, 5))
        assert out.reason == "version_not_active"
        assert b.ledger.get("forged").state == "rewarded"
        assert_clean(b)


@pytest.mark.parametrize("kind", KINDS)
def test_a_lost_lease_poisons_its_update(kind: str, tmp_path: Path) -> None:
    """Issue 31 item 2: L1 loses its lease on r1; L2 takes r1 and commits; L1's commit gets
    CommitMismatch; L1's natural recovery, `commit(u, ['r2'])`, is refused too (poisoned);
    `prepare(v, trained_by=['u-L1'])` is refused; the default `prepare(v)` records only
    u-L2, which then cannot be named by a second version; L1's abort returns r2."""
    clock = ManualClock(1000.0)
    url = "memory://" if kind == "memory" else durable_url(kind, tmp_path)
    with open_backend(url, clock=clock, lease_seconds=10) as b:
        coord = operated(b)
        activate(coord, 0)
        revs = {rid: rewarded(b, rollout(rid, 0)) for rid in ("r1", "r2")}
        assert b.ledger.reserve("r1", revs["r1"], "u-L1", good_stamp(0, 0)).reserved
        clock.advance(5)
        assert b.ledger.reserve("r2", revs["r2"], "u-L1", good_stamp(0, 0)).reserved
        clock.advance(6)  # r1's lease ran out, r2's has 4 s left
        assert [e.rollout_id for e in b.ledger.expire_leases()] == ["r1"]
        poisoned = b.ledger.update("u-L1")
        assert poisoned is not None and poisoned.cause == "lease_expired"
        out = b.ledger.reserve("r1", revs["r1"] + 2, "u-L2", good_stamp(0, 0))
        assert out.reserved
        b.ledger.commit("u-L2", ["r1"])
        with pytest.raises(CommitMismatch):
            b.ledger.commit("u-L1", ["r1", "r2"])
        with pytest.raises(UpdatePoisoned, match="lease_expired"):
            b.ledger.commit("u-L1", ["r2"])
        assert b.ledger.get("r2").state == "reserved"
        later = rewarded(b, rollout("r3", 0))
        refused = b.ledger.reserve("r3", later, "u-L1", good_stamp(0, 0))
        assert (refused.reserved, refused.reason) == (False, "update_poisoned")
        with pytest.raises(ActivationError, match="poisoned"):
            coord.prepare(1, trained_by=["u-L1"])
        assert coord.prepare(1).trained_by == ("u-L2",)
        with pytest.raises(ActivationError, match="another version's lineage"):
            coord.prepare(2, trained_by=["u-L2"])
        assert coord.prepare(2).trained_by == ()  # nothing landed since v1 claimed u-L2
        assert [e.rollout_id for e in b.ledger.abort("u-L1")] == ["r2"]
        assert {u: r.status for u, r in b.ledger.updates().items()} == {
            "u-L1": "poisoned",
            "u-L2": "landed",
        }
        assert_clean(b)
        report = audit(b.stored_rows())
        assert report.violations == [], [str(v) for v in report.violations]


@pytest.mark.parametrize("kind", KINDS)
def test_a_recorded_lineage_opt_out(kind: str, tmp_path: Path) -> None:
    """Only the operator's recorded `lineage="off"` lets a version name what it likes (here
    a poisoned update) and records nothing by default; a poisoned commit is still refused."""
    clock = ManualClock(1000.0)
    url = "memory://" if kind == "memory" else durable_url(kind, tmp_path)
    with open_backend(url, clock=clock, lease_seconds=10) as b:
        coord = operated(b)
        activate(coord, 0)
        rev = rewarded(b, rollout("r", 0))
        assert b.ledger.reserve("r", rev, "u", good_stamp(0, 0)).reserved
        clock.advance(11)
        b.ledger.expire_leases()
        off = attrs.evolve(POLICY, lineage="off")
        set_admission_policy(b.registry, off, "lineage is tracked elsewhere")
        assert b.registry.policy() == off
        assert coord.prepare(1, trained_by=["u"]).trained_by == ("u",)
        assert coord.prepare(2).trained_by == ()
        with pytest.raises(UpdatePoisoned):
            b.ledger.commit("u", ["r"])
        assert_clean(b)


@pytest.mark.parametrize("kind", KINDS)
def test_rollback_closes_every_door(kind: str, tmp_path: Path) -> None:
    """Issue 31 item 6: v2 rolled back by a coordinator built WITHOUT the ledger. A
    reservation taken before cannot commit (and poisons its update), dispatch refuses v2
    (`version_retired`), a late v2 rollout is quarantined on arrival, `retire_stale()`
    quarantines the open one, and the poisoned update's abort quarantines what it held."""
    with deployment(kind, tmp_path) as b:
        coord = operated(b)
        for v in (0, 1, 2):
            activate(coord, v)
        held_rev = rewarded(b, rollout("held", 2))
        assert b.ledger.reserve("held", held_rev, "u-old", good_stamp(2, 2)).reserved
        rewarded(b, rollout("open", 2))
        assert ActivationCoordinator(b.registry).rollback().version == 1
        assert b.ledger.bad_versions == frozenset()  # no ledger was told
        with pytest.raises(UpdatePoisoned, match="retired_version"):
            b.ledger.commit("u-old", ["held"])
        assert b.ledger.get("held").state == "reserved"
        record = b.ledger.update("u-old")
        assert record is not None and record.cause == "retired_version"
        assert b.ledger.dispatch(rollout("d", 2)).reason == "version_retired"
        assert b.ledger.find("d") is None
        b.ledger.add(rollout("late", 2))
        assert b.ledger.get("late").state == "quarantined"
        assert b.ledger.get("open").state == "rewarded"
        assert [e.rollout_id for e in b.ledger.retire_stale()] == ["open"]
        assert b.ledger.get("open").state == "quarantined"
        (returned,) = b.ledger.abort("u-old")
        assert returned.state == "quarantined"
        activate(coord, 3)
        assert b.ledger.dispatch(rollout("d", 2)).reason == "version_retired"
        assert_clean(b)


def test_lineage_of_a_version_is_shown(tmp_path: Path) -> None:
    """`deployment lineage V` lists the version chain, each recorded update and the
    rollouts it consumed; an unknown version is a clean error."""
    url = f"sqlite:///{tmp_path / 'd.db'}"
    with open_backend(url) as b:
        coord = operated(b)
        activate(coord, 0)
        rev = rewarded(b, rollout("r", 0))
        assert b.ledger.reserve("r", rev, "update-1", good_stamp(0, 0)).reserved
        b.ledger.commit("update-1", ["r"])
        coord.prepare(1, parent_version=0, trained_by=["update-1"])
    runner = CliRunner()
    res = runner.invoke(cli, ["deployment", "lineage", "1", "--backend", url, "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert [c["version"] for c in data["chain"]] == [1, 0]
    assert data["updates"] == {"update-1": {"landed": True, "rollouts": ["r"], "status": "landed"}}
    res = runner.invoke(cli, ["deployment", "lineage", "1", "--backend", url])
    assert "v1 (prepared): trained by update-1" in res.output and "1 rollouts: r" in res.output
    res = runner.invoke(cli, ["deployment", "lineage", "7", "--backend", url])
    assert res.exit_code == 2 and "not registered" in res.output


@pytest.mark.parametrize("kind", KINDS)
def test_a_long_update_renews_its_leases(kind: str, tmp_path: Path) -> None:
    """A heartbeat gives every rollout the update holds a full lease from now (the
    deployment's clock), through the declared renew_lease edge; another update's call
    renews nothing; a renewed lease is not expired at the old deadline."""
    clock = ManualClock(1000.0)
    url = "memory://" if kind == "memory" else durable_url(kind, tmp_path)
    with open_backend(url, clock=clock, lease_seconds=10) as b:
        coord = operated(b)
        activate(coord, 0)
        revs = {rid: rewarded(b, rollout(rid, 0)) for rid in ("a", "b")}
        for rid, rev in revs.items():
            assert b.ledger.reserve(rid, rev, "long", good_stamp(0, 0)).reserved
        clock.advance(8)
        assert b.ledger.renew_leases("other") == []
        renewed = b.ledger.renew_leases("long")
        assert sorted(e.rollout_id for e in renewed) == ["a", "b"]
        assert {e.lease_expires_at for e in renewed} == {1018.0}
        assert {e.revision for e in renewed} == {revs["a"] + 2}
        clock.advance(5)  # past the first deadline (1010), before the renewed one
        assert b.ledger.expire_leases() == []
        b.ledger.commit("long", ["a", "b"])
        assert [h.event for h in b.ledger.history("a")][-2:] == ["renew_lease", "commit"]
        assert_clean(b)


def test_postgres_renews_on_the_server_clock(postgres_url: str, tmp_path: Path) -> None:
    """Without an injected clock, PostgreSQL renews on its own clock: a renewal made by a
    learner whose process clock is far behind still gets a full lease."""
    url = durable_url("postgresql", tmp_path)
    with open_backend(url, lease_seconds=600) as b:
        coord = operated(b)
        activate(coord, 0)
        rev = rewarded(b, rollout("r", 0))
        assert b.ledger.reserve("r", rev, "u", good_stamp(0, 0)).reserved
        b.ledger.clock = lambda: 0.0  # the process clock only dates events now
        (e,) = b.ledger.renew_leases("u")
        assert e.lease_expires_at is not None and e.lease_expires_at > time.time() + 590


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_set_policy_never_creates_a_deployment_by_mistake(tmp_path: Path) -> None:
    """Issue 31 item 9: `set-policy` on a missing file, an empty file or another
    application's SQLite database exits 2 and creates nothing (no file, no table, no
    -wal); --create starts a new file only where none exists."""
    import sqlite3

    foreign = tmp_path / "other.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE notes(x TEXT)")
    conn.commit()
    conn.close()
    (tmp_path / "empty.db").write_bytes(b"")
    before = _files(tmp_path)
    runner = CliRunner()
    policy = ["--max-lag", "1", "--max-drift", "0.2"]
    for name, create in (
        ("missing.db", False),
        ("empty.db", False),
        ("other.db", False),
        ("empty.db", True),
        ("other.db", True),
    ):
        url = f"sqlite:///{tmp_path / name}"
        extra = ["--create"] if create else []
        res = runner.invoke(cli, ["deployment", "set-policy", "--backend", url, *policy, *extra])
        assert res.exit_code == 2, (name, create, res.output)
        assert "Traceback" not in res.output
        assert _files(tmp_path) == before, (name, create)
    res = runner.invoke(cli, ["deployment", "set-policy", "--backend", "memory://", *policy])
    assert res.exit_code == 2 and "one process" in res.output
    new = f"sqlite:///{tmp_path / 'new.db'}"
    res = runner.invoke(cli, ["deployment", "set-policy", "--backend", new, *policy, "--create"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["deployment", "show", "--backend", new])
    assert "admission policy: max_lag 1, max_drift 0.2" in res.output


@pytest.mark.postgres
def test_set_policy_on_a_postgres_database_without_a_ledger_creates_nothing(
    tmp_path: Path,
) -> None:
    """Issue 31 item 9 on PostgreSQL: an empty schema is refused (exit 2) and stays empty
    without --create; with it, the tables are created and the policy recorded."""
    import psycopg

    url = durable_url("postgresql", tmp_path)
    runner = CliRunner()
    args = ["deployment", "set-policy", "--backend", url, "--max-lag", "1", "--max-drift", "0.2"]
    res = runner.invoke(cli, args)
    assert res.exit_code == 2 and "holds no rollout-lifecycle ledger" in res.output, res.output
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema()"
        ).fetchone()
    assert row == (0,)
    res = runner.invoke(cli, [*args, "--create"])
    assert res.exit_code == 0, res.output
    with open_backend(url, create=False) as b:
        assert b.registry.policy() == AdmissionPolicy(1, 0.2)


@pytest.mark.parametrize("kind", KINDS)
def test_out_of_range_policies_and_limits_are_refused_typed(kind: str, tmp_path: Path) -> None:
    """Issue 31 item 9: batch_size 2**63, max_attempts 2**64 and oldest_admissible(2**63)
    raise the same typed errors on every backend (ActivationError, a LedgerError), never an
    OverflowError; nothing is recorded."""
    with deployment(kind, tmp_path) as b:
        for pol in (AdmissionPolicy(1, 0.2, 2**63, None), AdmissionPolicy(1, 0.2, None, 2**64)):
            with pytest.raises(ActivationError, match="at most 2\\*\\*63 - 1"):
                set_admission_policy(b.registry, pol, "too big")
        with pytest.raises(LedgerError, match="at most 2\\*\\*63 - 1"):
            b.ledger.oldest_admissible(2**63)
        assert b.ledger.oldest_admissible(2**63 - 1) == []
        assert b.registry.policy() is None and b.registry.trace() == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_nul_in_free_text_is_refused_typed_on_every_backend(kind: str, tmp_path: Path) -> None:
    """Issue 31 item 9: a NUL in a policy-change reason, a membership reason, a failure's
    cause or detail, a rollback reason or an artifact path is refused with ActivationError
    before anything is written (PostgreSQL would store it escaped in an event's JSON)."""
    with deployment(kind, tmp_path) as b:
        with pytest.raises(ActivationError, match="NUL"):
            set_admission_policy(b.registry, POLICY, "set\x00by me")
        coord = operated(b)
        activate(coord, 0)
        activate(coord, 1)
        coord.prepare(2)
        with pytest.raises(ActivationError, match="NUL"):
            coord.commit_artifact(2, H[2], path="/weights/v2\x00.bin")
        coord.commit_artifact(2, H[2], path="/weights/v2")
        coord.distribute(2)
        calls = (
            lambda: coord.change_membership(["gen-0"], "shrink\x00"),
            lambda: coord.fail_distribution(2, "timeout\x00"),
            lambda: coord.fail_distribution(2, "timeout", "on gen-1\x00"),
            lambda: coord.abandon(2, "gave up", "\x00"),
            lambda: set_admission_policy(b.registry, AdmissionPolicy(0, 0.1), "\x00"),
        )
        trace = b.registry.trace()
        for call in calls:
            with pytest.raises(ActivationError, match="NUL"):
                call()
        coord.fail_distribution(2, "timeout", "on gen-1")
        with pytest.raises(ActivationError, match="NUL"):
            coord.rollback(reason="bad eval\x00")
        assert b.registry.trace()[: len(trace)] == trace
        assert b.registry.policy() == POLICY and coord.required_workers == tuple(WORKERS)
        assert_clean(b)


@pytest.mark.parametrize("kind", KINDS)
def test_lineage_and_awaiting_reads_answer_as_the_records_do(kind: str, tmp_path: Path) -> None:
    """Which versions claim an update, which landed updates no version claims, and which
    versions await acks are asked of the store alone (in SQL on a database, so a step's
    cost does not grow with the versions ever registered); each answer is what the records
    say, a double claim written under `lineage="off"` included, and a refusal still names
    the newest other claimant."""
    with deployment(kind, tmp_path) as b:
        coord = operated(b)
        activate(coord, 0)

        def land(i: int) -> None:
            rev = rewarded(b, rollout(f"r{i}", 0))
            assert b.ledger.reserve(f"r{i}", rev, f"u{i}", good_stamp(0, 0)).reserved
            b.ledger.commit(f"u{i}", [f"r{i}"])

        for i in range(4):
            land(i)
        assert coord.prepare(1, trained_by=["u1"]).trained_by == ("u1",)
        assert coord.prepare(2).trained_by == ("u0", "u2", "u3")  # the unclaimed ones
        land(4)
        set_admission_policy(b.registry, attrs.evolve(POLICY, lineage="off"), "tracked elsewhere")
        coord.prepare(3, trained_by=["u1", "u4"])  # u1 a second time: nothing checks it now
        coord.commit_artifact(3, H[3])
        coord.distribute(3)
        land(5)

        def asked(view: Any) -> tuple[Any, ...]:
            return (
                view.claims(["u0", "u1", "u4", "u5", "nobody"]),
                view.unclaimed_updates(),
                view.awaiting(),
            )

        claims, unclaimed, awaiting = b.registry._view_read(asked, "lineage")  # type: ignore[attr-defined]
        arts = b.registry.artifacts()
        assert claims == {"u0": (2,), "u1": (1, 3), "u4": (3,)}
        assert claims == {
            u: tuple(a.version for a in arts if u in a.trained_by)
            for u in ("u0", "u1", "u4", "u5")
            if any(u in a.trained_by for a in arts)
        }
        assert unclaimed == ["u5"]
        assert awaiting == [a for a in arts if a.state == "awaiting_acks"] and len(awaiting) == 1
        assert b.registry.awaiting() == awaiting
        set_admission_policy(b.registry, POLICY, "fenced again")
        with pytest.raises(ActivationError, match=r"u1 \(v3\)"):
            coord.prepare(4, trained_by=["u1"])
