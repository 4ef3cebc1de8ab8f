"""Exhaustive model of two-phase activation over the real coordinator, for the BFS explorer.

A state holds the registry's records (artifacts, pointer, worker reports), the ledger's
entries, what each worker REALLY has loaded (ghost truth), and the acks in flight. Each step
rebuilds a real `MemoryRegistry`, `MemoryLedger` and `ActivationCoordinator` from the state
(`restore`), performs one action through production code, and reads everything back. The
network is explicit: acks are delivered, dropped, duplicated or left in flight (delay) in
every order; workers crash and restart, load the wrong bytes, or generate rollouts with
whatever they loaded. Invariants come from spec/invariants.py; the one ghost property
(a version activates only when every required worker truly holds it) needs the truth that
only this model has.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from rollout_lifecycle.model import coordinator as coord_mod
from rollout_lifecycle.model import gate as gate_mod
from rollout_lifecycle.model import ledger as ledger_mod
from rollout_lifecycle.model import registry as registry_mod
from rollout_lifecycle.model.errors import ActivationError
from rollout_lifecycle.model.events import ArtifactChanged, EventLog
from rollout_lifecycle.model.records import (
    ActionEvidence,
    ActivePointer,
    AdmissionPolicy,
    ArtifactRecord,
    AttemptToken,
    BehaviorPolicy,
    Disposition,
    GenerationConditions,
    LedgerEntry,
    Reward,
    Rollout,
    RolloutIdentity,
    WorkerAck,
)
from rollout_lifecycle.model.registry import WorkerReport
from rollout_lifecycle.spec.coverage import count_edges
from rollout_lifecycle.spec.explorer import Property
from rollout_lifecycle.spec.invariants import (
    World,
    check_at_rest,
    check_quiescent,
    replay,
)

CORRUPT = "corrupt"
REWARD = Reward("rm", "1", 1.0)
CONDITIONS = GenerationConditions(
    tokenizer_id="tok", temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8
)
EVIDENCE = ActionEvidence(
    response_token_ids=(1, 2), action_mask=(True, True), behavior_log_probs=(-0.5, -0.5)
)


def artifact_hash(version: int) -> str:
    """The (stand-in) content hash of version v's artifact."""
    return f"sha-v{version}"


def attempt_token(version: int, attempt: int, worker_id: str) -> str:
    """The explorer's token source: a function of (version, attempt, worker), so equal
    histories give equal states (production tokens are random)."""
    return f"{worker_id}:v{version}a{attempt}"


def _token_attempt(token: str | None) -> str | None:
    """A token without its worker's name (the attempt it answers), for worker symmetry."""
    return None if token is None else token.split(":", 1)[1]


@attrs.frozen
class Worker:
    """Ghost truth for one worker: its incarnation, what it really loaded, its ack counter."""

    worker_id: str
    incarnation: int = 0
    loaded: tuple[int, str] | None = None
    seq: int = 0


@attrs.frozen
class ActState:
    """Registry records, ledger entries, ghost worker truth, the network, fault budgets."""

    artifacts: tuple[ArtifactRecord, ...]
    pointer: ActivePointer | None
    reports: tuple[WorkerReport, ...]
    workers: tuple[Worker, ...]
    network: tuple[WorkerAck, ...] = ()
    entries: tuple[LedgerEntry, ...] = ()
    tokens: tuple[AttemptToken, ...] = ()  # the registry's attempt tokens
    bad_versions: frozenset[int] = frozenset()
    next_version: int = 1
    faults: tuple[int, int, int] = (0, 0, 0)  # crashes, corrupt loads, duplicates used
    step_violations: tuple[str, ...] = ()


@attrs.frozen
class Act:
    """One action with its arguments."""

    kind: str
    version: int = -1
    worker: int = -1
    index: int = -1
    rollout: str = ""

    def __str__(self) -> str:
        parts = [self.kind]
        if self.version >= 0:
            parts.append(f"v{self.version}")
        if self.worker >= 0:
            parts.append(f"w{self.worker}")
        if self.index >= 0:
            parts.append(f"#{self.index}")
        if self.rollout:
            parts.append(self.rollout)
        return " ".join(parts)


class ActivationModel:
    """`n_workers` workers, versions 1..`n_versions` after an active v0, bounded faults."""

    def __init__(
        self,
        n_workers: int = 3,
        n_versions: int = 2,
        *,
        max_crashes: int = 1,
        max_corrupt: int = 1,
        max_duplicates: int = 1,
        max_in_flight: int = 3,
        max_rollouts: int = 1,
        max_lag: int = 0,
        max_attempts: int = 2,
    ) -> None:
        if n_workers < 1 or n_versions < 1:
            raise ValueError("need at least one worker and one new version")
        self.worker_ids = tuple(f"w{i}" for i in range(n_workers))
        self.n_versions = n_versions
        self.max_crashes, self.max_corrupt, self.max_dups = max_crashes, max_corrupt, max_duplicates
        self.max_in_flight = max_in_flight
        self.max_rollouts = max_rollouts
        self.max_lag = max_lag
        self.policy = AdmissionPolicy(max_lag, 0.2)  # the deployment's, as recorded
        self.max_attempts = max_attempts
        self.observed: Counter[str] = Counter()
        self.edges: Counter[tuple[str, str]] = Counter()

    # ---- building real objects from a state -----------------------------------------------

    def _objects(self, s: ActState) -> tuple[Any, Any, Any, EventLog]:
        log = EventLog()
        reg = registry_mod.MemoryRegistry.restore(
            s.artifacts,
            s.pointer,
            s.reports,
            log,
            membership=self.worker_ids,
            policy=self.policy,
            tokens=s.tokens,
        )
        led = ledger_mod.MemoryLedger.restore(
            s.entries, s.bad_versions, event_log=log, clock=lambda: 0.0, activation=reg
        )
        co = coord_mod.ActivationCoordinator(
            reg, ledger=led, clock=lambda: 0.0, new_token=attempt_token
        )
        return co, reg, led, log

    def init_states(self) -> Iterable[ActState]:
        """v0 activated through the real coordinator, every worker holding it."""
        log = EventLog()
        reg = registry_mod.MemoryRegistry(log)
        led = ledger_mod.MemoryLedger(event_log=log, clock=lambda: 0.0, activation=reg)
        registry_mod.set_admission_policy(reg, self.policy, "the operator's", at=0.0)
        co = coord_mod.ActivationCoordinator(
            reg,
            self.worker_ids,
            ledger=led,
            clock=lambda: 0.0,
            policy=self.policy,
            new_token=attempt_token,
        )
        co.prepare(0)
        co.commit_artifact(0, artifact_hash(0))
        co.distribute(0)
        workers = []
        for w in self.worker_ids:
            token = co.attempt_token(w, 0)
            co.record_ack(WorkerAck(w, 0, artifact_hash(0), 0, 1, 1, token))
            workers.append(Worker(w, 0, (0, artifact_hash(0)), 1))
        res = co.try_activate(0)
        assert res.activated, res
        yield ActState(
            artifacts=tuple(reg.artifacts()),
            pointer=reg.pointer(),
            reports=tuple(sorted(reg.workers().values(), key=lambda r: r.worker_id)),
            workers=tuple(workers),
            tokens=tuple(reg.attempt_tokens()),
        )

    def actions(self, s: ActState) -> Iterable[Act]:
        """Every enabled action."""
        crashes, corrupt, dups = s.faults
        if s.next_version <= self.n_versions:
            yield Act("prepare", version=s.next_version)
        for a in s.artifacts:
            v = a.version
            if a.state == "prepared":
                yield Act("commit_artifact", version=v)
                yield Act("fail_commit", version=v)
            elif a.state == "committed":
                yield Act("distribute", version=v)
                yield Act("abandon", version=v)
            elif a.state == "awaiting_acks":
                yield Act("try_activate", version=v)
                yield Act("fail_distribution", version=v)
                for k, w in enumerate(s.workers):
                    if w.loaded != (v, artifact_hash(v)) and len(s.network) < self.max_in_flight:
                        yield Act("load", version=v, worker=k)
                        if corrupt < self.max_corrupt:
                            yield Act("load_corrupt", version=v, worker=k)
            elif a.state == "distribution_failed":
                if a.attempts < self.max_attempts:
                    yield Act("retry", version=v)
                yield Act("abandon", version=v)
        if s.pointer is not None:
            cur = next(a for a in s.artifacts if a.version == s.pointer.version)
            if cur.rollback_version is not None:
                tgt = next((a for a in s.artifacts if a.version == cur.rollback_version), None)
                if tgt is not None and tgt.state == "superseded":
                    yield Act("rollback")
        for i, _ack in enumerate(s.network):
            if i > 0 and s.network[i] == s.network[i - 1]:
                continue  # identical messages: delivering either is the same step
            yield Act("deliver", index=i)
            yield Act("drop", index=i)
            if dups < self.max_dups and len(s.network) < self.max_in_flight:
                yield Act("duplicate", index=i)
        if crashes < self.max_crashes:
            for k in range(len(s.workers)):
                yield Act("crash", worker=k)
        if len(s.entries) < self.max_rollouts:
            for k, w in enumerate(s.workers):
                if w.loaded is not None:
                    yield Act("generate", worker=k)
        for e in s.entries:
            if e.state == "rewarded":
                yield Act("train", rollout=e.rollout_id)

    def next_state(self, s: ActState, act: Act) -> ActState | None:
        """Perform `act` through real objects rebuilt from `s`; None when nothing changes."""
        if s.step_violations:
            return None
        co, reg, led, log = self._objects(s)
        workers = list(s.workers)
        network = list(s.network)
        crashes, corrupt, dups = s.faults
        next_version = s.next_version
        ghost: list[str] = []
        k, v = act.worker, act.version
        try:
            if act.kind == "prepare":
                co.prepare(v, parent_version=None if s.pointer is None else s.pointer.version)
                next_version += 1
            elif act.kind == "commit_artifact":
                co.commit_artifact(v, artifact_hash(v))
            elif act.kind == "fail_commit":
                co.fail_commit(v, "write_failed")
            elif act.kind == "distribute":
                co.distribute(v)
            elif act.kind == "abandon":
                co.abandon(v, "operator")
            elif act.kind == "retry":
                co.retry(v)
            elif act.kind == "fail_distribution":
                co.fail_distribution(v, "ack_timeout")
                self.observed["activation_failed"] += 1
            elif act.kind == "try_activate":
                res = co.try_activate(v)
                self.observed[f"try_activate:{res.reason}"] += 1
                if res.mismatched_workers:
                    self.observed["stale_ack_refused"] += 1
            elif act.kind in ("load", "load_corrupt"):
                w = workers[k]
                h = artifact_hash(v) if act.kind == "load" else CORRUPT
                if act.kind == "load_corrupt":
                    corrupt += 1
                # the worker answers the attempt it was sent: it echoes that attempt's token
                attempt = next(a.attempts for a in s.artifacts if a.version == v)
                token = next(
                    t.token for t in s.tokens if (t.version, t.worker_id) == (v, w.worker_id)
                )
                workers[k] = attrs.evolve(w, loaded=(v, h), seq=w.seq + 1)
                network.append(
                    WorkerAck(w.worker_id, v, h, w.incarnation, w.seq + 1, attempt, token)
                )
            elif act.kind == "deliver":
                ack = network.pop(act.index)
                current = next((a for a in s.artifacts if a.version == ack.version), None)
                if (
                    current is not None
                    and current.state == "awaiting_acks"
                    and ack.attempt is not None
                    and ack.attempt < current.attempts
                ):
                    self.observed["late_attempt_ack"] += 1
                res_ack = co.record_ack(ack)
                self.observed[f"ack:{res_ack.reason}"] += 1
                if res_ack.reason == coord_mod.STALE_INCARNATION:
                    self.observed["restart_ack_refused"] += 1
            elif act.kind == "drop":
                network.pop(act.index)
            elif act.kind == "duplicate":
                network.append(network[act.index])
                dups += 1
            elif act.kind == "crash":
                w = workers[k]
                workers[k] = Worker(w.worker_id, w.incarnation + 1, None, 0)
                co.worker_restarted(w.worker_id, w.incarnation + 1)
                crashes += 1
            elif act.kind == "generate":
                w = workers[k]
                assert w.loaded is not None
                ver, h = w.loaded
                rid = f"r{len(s.entries) + 1}"
                led.add(
                    LedgerEntry(
                        rollout_id=rid,
                        behavior_version=ver,
                        artifact_hash=h,
                        state="rewarded",
                        reward=REWARD,
                    )
                )
            elif act.kind == "train":
                ghost.extend(self._train(co, led, act.rollout))
            elif act.kind == "rollback":
                co.rollback()
            else:
                raise ValueError(f"unknown action {act}")
        except ActivationError:
            return None  # the coordinator refused: nothing changed
        events = log.events()
        count_edges(events, self.edges)
        for ev in events:
            if (
                isinstance(ev, ArtifactChanged)
                and ev.event == "activate"
                and ev.after.artifact_hash is not None
            ):
                want = (ev.version, ev.after.artifact_hash)
                for w in workers:
                    if w.worker_id in ev.required_workers and w.loaded != want:
                        ghost.append(
                            f"ghost: v{ev.version} activated while {w.worker_id} really holds "
                            f"{w.loaded} (an ack that no longer held was counted)"
                        )
        _, step_viol, _ = replay(self.world(s), events)
        viol = [*ghost, *(str(x) for x in step_viol)]
        new = ActState(
            artifacts=tuple(sorted(reg.artifacts(), key=lambda a: a.version)),
            pointer=reg.pointer(),
            reports=tuple(sorted(reg.workers().values(), key=lambda r: r.worker_id)),
            workers=tuple(workers),
            network=tuple(sorted(network, key=_ack_key)),
            tokens=tuple(reg.attempt_tokens()),
            entries=tuple(sorted(led.snapshot().values(), key=lambda e: e.rollout_id)),
            bad_versions=led.bad_versions,
            next_version=next_version,
            faults=(crashes, corrupt, dups),
            step_violations=tuple(viol),
        )
        return None if new == s else new

    def _train(self, co: Any, led: Any, rid: str) -> list[str]:
        """A learner admits one rollout against the active version, then reserves and commits.

        Returns problems: an admission the ledger's own rules refuse means the gate broke
        the spec (the write path caught it, the checker names it).
        """
        e = led.get(rid)
        pointer = co.pointer()
        ro = Rollout(
            identity=RolloutIdentity(rollout_id=rid, prompt_id="p", dataset="d", sample_index=0),
            behavior=BehaviorPolicy(e.behavior_version, e.artifact_hash),
            conditions=CONDITIONS,
            evidence=EVIDENCE,
            status=e,
        )
        gate = gate_mod.AdmissionGate(
            gate_mod.GatePolicy(max_lag=self.max_lag, max_drift=0.2), registry=co.activated_hash
        )
        d = gate.assess(ro, [-0.5, -0.5], pointer.version)
        self.observed[f"admission:{d.reason}"] += 1
        if d.route == gate_mod.ROUTE_QUARANTINE:
            led.transition(
                rid, "quarantine", e.revision, disposition=Disposition("admission", d.reason)
            )
        elif d.route == gate_mod.ROUTE_OFFLINE:
            led.transition(
                rid, "retire_stale", e.revision, disposition=Disposition("admission", "stale")
            )
        elif d.accepted:
            out = led.reserve(rid, e.revision, "learner", d.stamp())
            if out.reserved:
                led.commit("learner", [rid])
            elif out.reason in (
                ledger_mod.NOT_ADMITTED,
                ledger_mod.STAMP_CONTRADICTS,
                ledger_mod.LOOSER_THAN_POLICY,
            ):
                return [f"gate_contradicts_spec: {rid} admitted, yet {out.detail}"]
        return []

    # ---- properties --------------------------------------------------------------------------

    def world(self, s: ActState) -> World:
        """The spec's view of a state."""
        return World(
            entries={e.rollout_id: e for e in s.entries},
            artifacts={a.version: a for a in s.artifacts},
            pointer=s.pointer,
            required_workers=self.worker_ids,
            workers={r.worker_id: r for r in s.reports},
            policy=self.policy,
            tokens={(t.version, t.worker_id): t for t in s.tokens},
        )

    def canonical(self, s: ActState) -> Any:
        """Workers are interchangeable: a state is the same up to renaming them (symmetry).

        Each worker's signature holds everything that mentions it (truth, stored report,
        acks in flight, which of its tokens were spent) minus its name; sorting signatures
        gives one form per orbit. The token strings are left out: with a fixed worker set
        and `attempt_token` they follow from the artifacts' attempt counts, and tokens in
        acks keep only their attempt; whether a token counted already does not follow, so
        each worker's spent tokens are kept by the attempt they belong to.
        """
        reports = {r.worker_id: r for r in s.reports}
        sigs = []
        for w in s.workers:
            rep = reports.get(w.worker_id)
            rep_sig = None if rep is None else (rep.floor, _strip(rep.ack))
            flight = tuple(_strip(a) for a in s.network if a.worker_id == w.worker_id)
            spent = tuple(
                sorted(
                    (t.version, t.attempt)
                    for t in s.tokens
                    if t.worker_id == w.worker_id and t.spent
                )
            )
            sigs.append((w.incarnation, w.loaded, w.seq, rep_sig, flight, spent))
        sigs.sort(key=repr)
        return (
            tuple(sigs),
            s.artifacts,
            s.pointer,
            s.entries,
            s.bad_versions,
            s.next_version,
            s.faults,
            s.step_violations,
        )

    def action_label(self, act: Act) -> str:
        """Labels like `deliver #0` or `load v1 w2`."""
        return str(act)

    def properties(self) -> Sequence[Property[ActState]]:
        """Spec step/always/eventually invariants, plus reachability witnesses."""
        return [
            Property(
                "spec_step_invariants_and_ghost",
                "always",
                lambda s: not s.step_violations,
                "every step satisfies the spec's step invariants and the ghost check",
            ),
            Property(
                "spec_rest_invariants",
                "always",
                lambda s: not check_at_rest(self.world(s)),
                "between calls: the always invariants, and failed versions are quarantined",
            ),
            Property(
                "spec_eventually_invariants",
                "eventually",
                lambda s: not check_quiescent(self.world(s)),
            ),
            Property(
                "new_version_active",
                "sometimes",
                lambda s: s.pointer is not None and s.pointer.version > 0,
            ),
            Property(
                "rolled_back",
                "sometimes",
                lambda s: any(a.state == "rolled_back" for a in s.artifacts),
            ),
            Property(
                "activation_failed",
                "sometimes",
                lambda s: any(a.state == "distribution_failed" for a in s.artifacts),
            ),
        ]

    def violations_of(self, s: ActState) -> list[str]:
        """What is wrong in `s`, for counterexample reports."""
        return [*s.step_violations, *(str(v) for v in check_at_rest(self.world(s)))]


def _strip(
    a: WorkerAck | None,
) -> tuple[int, str, int, int | None, int | None, str | None] | None:
    if a is None:
        return None
    return (a.version, a.artifact_hash, a.incarnation, a.seq, a.attempt, _token_attempt(a.token))


def _ack_key(a: WorkerAck) -> tuple[str, int, str, int, int | None, int | None, str]:
    return (
        a.worker_id,
        a.version,
        a.artifact_hash,
        a.incarnation,
        a.seq,
        a.attempt,
        a.token or "",
    )
