"""The README pattern raced under the faults deployments meet, judged from the durable record.

Issue 31's last test: the README's own forms, in separate processes on one SQLite file or
PostgreSQL database, with

* learners that train past their lease (another learner's reaper sweep expires it, takes
  the rollouts and commits them; the slow learner then commits what it still holds, the
  natural recovery),
* an activator that also rolls back, and now and then names a poisoned update as a new
  version's lineage (a careless `trained_by`),
* SIGKILLs of learners and of the activator at random moments (mid-reservation,
  mid-training, mid-distribution), each replaced by a fresh process,

and nothing to help them but what the README shows: `admit_and_reserve`, `commit`,
`ActivationCoordinator` with the operator's recorded policy. After the race a last sweep
(`expire_leases`, `settle`) runs, as any surviving process would, and the verdict is read
from the durable trace alone:

* rollouts in two published versions' gradients: a rollout reserved (so trained on) by two
  updates that are both in the lineage of activated versions;
* stale rollouts consumed: a commit of a rollout whose behaviour version was more than
  `max_lag` behind the version active when it was reserved;
* lost rollouts: reserved with no live owner after the last sweep, or in no final state;
* versions awaiting acks past their deadline after the last `settle`, and the longest any
  attempt stayed past its deadline during the race;
* the spec's invariants over the whole trace and the stored rows.

Its counts include the lineage fence's refusals (commits of poisoned updates, careless
lineages), so a race that never lost a lease or never killed anything says so rather than
passing quietly. A SIGKILLed process's recorded calls die with it, so the race's
linearizability check does not run here: `race` checks call histories; this judges the
durable trace, which no kill can shorten.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from rollout_lifecycle.model.admission import admit_and_reserve
from rollout_lifecycle.model.backends import open_backend, redact_url
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.errors import (
    ActivationError,
    CommitMismatch,
    GateConfigError,
    RolloutLifecycleError,
    UpdatePoisoned,
)
from rollout_lifecycle.model.events import ArtifactChanged, EntryChanged, UpdateChanged
from rollout_lifecycle.model.gate import AdmissionGate, GatePolicy
from rollout_lifecycle.model.ledger import ReserveRequest
from rollout_lifecycle.model.records import (
    ActionEvidence,
    AdmissionPolicy,
    BehaviorPolicy,
    Disposition,
    GenerationConditions,
    LedgerEntry,
    Reward,
    Rollout,
    RolloutIdentity,
    WorkerAck,
)
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.spec.invariants import check_trace, compare_with_store, stored_world

WORKERS = ("gen-0", "gen-1")
CONDITIONS = GenerationConditions("tok-v1", temperature=1.0, top_p=1.0, top_k=-1, max_tokens=4)
REWARD = Reward("math-verify", "1.0", 1.0)
LOGP = np.array([-0.5, -1.2, 0.0], dtype=np.float32)
CURRENT = np.array([-0.52, -1.18, 0.0])  # the learner's log-probs: drift 0.02, admitted
SCHEMA = "rollout-lifecycle/fault-race-report/1"
START_TIMEOUT_S = 180.0  # a child still importing after this is taken as dead
FINAL_STATES = frozenset(
    {"consumed", "stale", "quarantined", "generation_failed", "reward_timed_out",
     "reward_errored", "update_failed"}
)  # fmt: skip


LOOSE = AdmissionPolicy(max_lag=1000, max_drift=1e9)  # item 1's misconfigured coordinator
FORGED = "e" * 64  # an artifact hash no version of the race ever has


def version_hash(v: int) -> str:
    """The artifact hash of version v in this race."""
    return f"{v:x}".rjust(64, "f")


@attrs.frozen
class FaultRaceConfig:
    """What to race and which faults to inject."""

    url: str
    workdir: Path
    learners: int = 3
    seconds: float = 60.0
    kill_every: float = 3.0  # mean seconds between two SIGKILLs (0: none)
    lease_seconds: float = 2.0  # short, so a slow learner loses its lease in a short race
    ack_timeout: float = 1.5
    slow: float = 0.25  # chance a learner's update runs past its first batch's lease
    rollback_every: int = 4  # the activator rolls back after every Nth activation
    careless: float = 0.25  # chance an activation names a poisoned update as its lineage
    # chance a learner process is misconfigured (its own gate admits any lag and drift and
    # never checks hashes; it reserves with those bare stamps), and a coordinator starts
    # with a loose policy= (item 1): the recorded policy must refuse both
    hostile: float = 0.3
    forged: float = 0.05  # chance a generated rollout carries a hash its version never had
    restores: float = 0.1  # chance a worker restores its old weights after acking (item 3)
    max_lag: int = 1
    max_drift: float = 0.2
    pool: int = 48  # the generator keeps about this many rollouts waiting
    seed: int = 0
    mutant: str | None = None  # a catalogue mutant every child process runs with
    # after the verdict: `ledger check` of the faulted store must pass, then one tampering
    # of issue 31's item 7 (chosen by the seed) is applied and must be named
    tamper: bool = True

    def policy(self) -> AdmissionPolicy:
        """The operator's policy, as the README records it."""
        return AdmissionPolicy(max_lag=self.max_lag, max_drift=self.max_drift)


@attrs.frozen
class FaultRaceReport:
    """The verdict and what the race exercised."""

    config: FaultRaceConfig
    elapsed_s: float
    counts: dict[str, int]
    kills: dict[str, int]
    findings: tuple[str, ...]
    errors: tuple[str, ...]
    events: int
    facts: dict[str, Any]

    @property
    def ok(self) -> bool:
        """No finding and no process failed on its own (a SIGKILL is not a failure)."""
        return not self.findings and not self.errors

    def to_json(self) -> dict[str, Any]:
        """The report as JSON (schema rollout-lifecycle/fault-race-report/1)."""
        cfg = attrs.asdict(self.config)
        cfg.update(url=redact_url(self.config.url), workdir=str(self.config.workdir))
        return {
            "schema": SCHEMA,
            "config": cfg,
            "elapsed_s": round(self.elapsed_s, 2),
            "ok": self.ok,
            "events": self.events,
            "kills": self.kills,
            "counts": self.counts,
            "facts": self.facts,
            "findings": list(self.findings),
            "errors": list(self.errors),
        }


class _Stats:
    """A child's counters, rewritten atomically after every step: a SIGKILL loses at most
    the step it interrupted, never the file."""

    def __init__(self, workdir: Path, role: str) -> None:
        self.path = workdir / "stats" / f"{role}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.c: Counter[str] = Counter()
        self.notes: list[str] = []

    def bump(self, key: str, n: int = 1) -> None:
        self.c[key] += n

    def note(self, text: str) -> None:
        """Keep the last few refusal messages (what a reader of the report asks first)."""
        self.notes = [*self.notes[-4:], text[:300]]

    def flush(self, **extra: Any) -> None:
        tmp = self.path.with_suffix(".tmp")
        doc = {"stats": dict(self.c), "notes": self.notes, **extra}
        tmp.write_text(json.dumps(doc), encoding="utf-8")
        os.replace(tmp, self.path)


def _entered(cfg: FaultRaceConfig) -> Any:
    import contextlib

    if cfg.mutant is None:
        return contextlib.nullcontext()
    from rollout_lifecycle.stateful_tests.mutants import BY_NAME

    return BY_NAME[cfg.mutant]()


def _child(kind: str, cfg: FaultRaceConfig, role: str, seed: int, line: Any) -> None:
    """A child process's body; its counters go to its stats file, an error too. The race's
    clock starts when every first process has imported and stands at the line (a loaded
    machine's start-up would otherwise eat a short race); a replacement joins at once."""
    ready, start, _phase = line
    with ready.get_lock():
        ready.value += 1
    waited = time.time()
    while start.value == 0.0 and time.time() - waited < START_TIMEOUT_S:
        time.sleep(0.02)
    deadline = (start.value or time.time()) + cfg.seconds
    stats = _Stats(cfg.workdir, role)
    loop: Callable[[FaultRaceConfig, random.Random, float, _Stats, Any], None] = {
        "generator": _generate,
        "activator": _activate,
        "learner": _learn,
    }[kind]
    try:
        with _entered(cfg):
            loop(cfg, random.Random(seed), deadline, stats, _phase)
        stats.flush(done=True)
    except Exception as exc:  # reported by the parent; not a SIGKILL, so a finding
        stats.flush(done=True, error=repr(exc))


def _generate(
    cfg: FaultRaceConfig, rng: random.Random, deadline: float, st: _Stats, _phase: Any
) -> None:
    """The README's generator: add rollouts stamped with the version being served, then
    generation_done and reward_ready, one call each."""
    n = 0
    with open_backend(cfg.url, lease_seconds=cfg.lease_seconds) as be:
        while time.time() < deadline:
            waiting = be.ledger.statistics().by_state.get("rewarded", 0)
            pointer = be.registry.pointer()
            if pointer is None or waiting >= cfg.pool:
                time.sleep(0.05)
                continue
            for _ in range(4):
                rid = f"g{n}"
                n += 1
                forged = rng.random() < cfg.forged  # item 5: a hash v never had
                ro = Rollout(
                    RolloutIdentity(rid, f"prompt-{n % 97}", "gsm8k", 0),
                    BehaviorPolicy(pointer.version, FORGED if forged else pointer.artifact_hash),
                    CONDITIONS,
                    ActionEvidence(np.array([5, 9, 2]), np.array([1, 1, 0]), LOGP),
                )
                be.ledger.add(ro)
                st.bump("added")
                st.bump("forged", forged)
                try:
                    be.ledger.transition(rid, "generation_done", 0)
                    be.ledger.transition(rid, "reward_ready", 1, reward=REWARD)
                    st.bump("rewarded")
                except RolloutLifecycleError as exc:  # quarantined on arrival (retired v)
                    st.bump(f"generator:{type(exc).__name__}")
            st.flush(last_id=n)
            time.sleep(rng.uniform(0.01, 0.05))


def _learn(
    cfg: FaultRaceConfig, rng: random.Random, deadline: float, st: _Stats, _phase: Any
) -> None:
    """The README's learner in a loop: admit_and_reserve, train (sometimes past the
    lease), commit what was reserved; on a refusal, the natural recovery (commit what it
    still holds), then abort. Each loop is also a reaper sweep."""
    tag = f"{rng.getrandbits(32):08x}"
    u = 0
    hostile = None
    if rng.random() < cfg.hostile:  # this process's own gate: loose, or hash-blind
        loose = rng.random() < 0.5
        bounds = (10**6, 1e9) if loose else (cfg.max_lag, cfg.max_drift)
        hostile = AdmissionGate(GatePolicy(max_lag=bounds[0], max_drift=bounds[1]))
        st.bump("hostile_learner_loose" if loose else "hostile_learner_hash_blind")
    with open_backend(cfg.url, lease_seconds=cfg.lease_seconds) as be:
        while time.time() < deadline:
            expired = be.ledger.expire_leases()  # any process may sweep; the README's reaper
            st.bump("swept", len(expired))
            waiting = be.ledger.oldest_admissible(rng.randint(2, 8))
            if not waiting:
                time.sleep(0.02)
                continue
            rollouts = rollouts_of(waiting)
            update = f"u-{tag}-{u}"
            u += 1
            current = np.tile(CURRENT, (len(rollouts), 1))
            try:
                if hostile is not None:
                    trained = _hostile_reserve(be, hostile, update, rollouts, current, rng, st)
                else:
                    got = admit_and_reserve(
                        be.ledger, be.registry, update, rollouts, current, conditions=CONDITIONS
                    )
                    for rid, reason in got.refused.items():
                        st.bump(f"refused:{reason}")
                        if reason == "artifact_hash_mismatch":  # never trainable: set aside
                            _quarantine(be, rid, reason, st)
                    trained = got.reserved
            except GateConfigError as exc:  # e.g. nothing active at this instant
                st.bump(f"admit:{type(exc).__name__}")
                continue
            if not trained:
                continue
            st.bump("reserved", len(trained))
            st.flush()
            slow = rng.random() < cfg.slow
            if slow:  # a long update: reserves a second batch later, so it can lose the
                # first batch's leases and keep the second's (issue 31's item 2)
                time.sleep(cfg.lease_seconds * 0.6)
                more = rollouts_of(be.ledger.oldest_admissible(4))
                if more:
                    again = admit_and_reserve(
                        be.ledger, be.registry, update, more,
                        np.tile(CURRENT, (len(more), 1)), conditions=CONDITIONS,
                    )  # fmt: skip
                    trained += again.reserved
                    st.bump("reserved", len(again.reserved))
                st.flush()
                time.sleep(cfg.lease_seconds * 0.7)
            else:
                time.sleep(rng.uniform(0.0, 0.1))  # "train"
            st.bump("slow_updates" if slow else "fast_updates")
            try:
                be.ledger.commit(update, trained)
                st.bump("committed", len(trained))
            except CommitMismatch as exc:  # a lease lost meanwhile; UpdatePoisoned too
                st.bump(f"commit_refused:{getattr(exc, 'cause', 'mismatch')}")
                still = be.ledger.reserved_by(update)
                if still:  # the natural recovery: commit what it still holds
                    try:
                        be.ledger.commit(update, still)
                        st.bump("recovery_committed", len(still))
                    except UpdatePoisoned as again:
                        st.bump(f"lineage_fence:commit_refused:{again.cause}")
                be.ledger.abort(update)
            st.flush()


def _quarantine(be: Any, rid: str, reason: str, st: _Stats) -> None:
    """Set a rollout the gate can never admit aside, so it stops heading the queue."""
    e = be.ledger.find(rid)
    if e is None or e.state != "rewarded":
        return
    try:
        be.ledger.transition(
            rid, "quarantine", e.revision, disposition=Disposition("admission", reason)
        )
        st.bump("quarantined_by_learner")
    except RolloutLifecycleError:
        st.bump("quarantine_lost_race")


def _hostile_reserve(
    be: Any,
    gate: AdmissionGate,
    update: str,
    rollouts: list[Rollout],
    current: Any,
    rng: random.Random,
    st: _Stats,
) -> list[str]:
    """A misconfigured learner: its own loose gate's bare stamps, reserved one by one or in
    a batch; the ledger must judge them by the recorded policy and the registry's hashes."""
    pointer = be.registry.pointer()
    if pointer is None:
        return []
    decisions = gate.assess_batch(rollouts, current, pointer.version)
    asked = [
        ReserveRequest(ro.rollout_id, ro.status.revision, d.stamp())
        for ro, d in zip(rollouts, decisions, strict=True)
        if d.accepted and ro.status is not None
    ]
    if rng.random() < 0.5:
        outs = [be.ledger.reserve(r.rollout_id, r.expected_revision, update, r.admission)
                for r in asked]  # fmt: skip
    else:
        outs = be.ledger.reserve_batch(update, asked)
    for o in outs:
        st.bump(f"hostile:{o.reason}")
    return [o.rollout_id for o in outs if o.reserved]


def rollouts_of(entries: list[LedgerEntry]) -> list[Rollout]:
    """What a learner's buffer holds for each waiting ledger entry: the rollout and the
    behaviour log-probs its generator recorded."""
    return [
        Rollout(
            RolloutIdentity(e.rollout_id, "p", "gsm8k", 0),
            BehaviorPolicy(e.behavior_version, e.artifact_hash),
            CONDITIONS,
            ActionEvidence(np.array([5, 9, 2]), np.array([1, 1, 0]), LOGP),
            status=e,
        )
        for e in entries
    ]


def _activate(
    cfg: FaultRaceConfig, rng: random.Random, deadline: float, st: _Stats, phase: Any
) -> None:
    """The README's activator in a loop: prepare (lineage from the ledger), commit the
    artifact, distribute, collect each worker's ack with its token, try_activate; roll back
    every few activations; now and then name a poisoned update as a lineage."""
    with open_backend(cfg.url, lease_seconds=cfg.lease_seconds) as be:
        coord = ActivationCoordinator(
            be.registry,
            list(WORKERS),
            ledger=be.ledger,
            policy=cfg.policy(),
            ack_timeout=cfg.ack_timeout,
        )
        activated = 0
        while time.time() < deadline:
            v = (coord.registry.max_version() or 0) + 1
            if rng.random() < cfg.hostile / 4:  # item 1: a misconfigured coordinator starts
                try:
                    ActivationCoordinator(
                        be.registry, list(WORKERS), ledger=be.ledger, policy=LOOSE
                    )
                    st.bump("hostile_coordinator_accepted")
                except ActivationError:
                    st.bump("hostile_coordinator_refused")
            try:
                poisoned = [
                    r.update_id for r in be.ledger.updates().values() if r.status == "poisoned"
                ]
                if poisoned and rng.random() < cfg.careless:
                    st.bump("careless_lineage")
                    try:
                        coord.prepare(v, trained_by=[rng.choice(poisoned)])
                        st.bump("careless_lineage_accepted")  # the fence failed: judged too
                    except ActivationError:
                        st.bump("lineage_fence:prepare_refused")
                        continue
                else:
                    coord.prepare(v)
                coord.commit_artifact(v, version_hash(v))
                serving = coord.pointer()
                coord.distribute(v)
                phase.value = 1  # the parent's aim for a kill mid-distribution
                acks = {}
                for w in WORKERS:  # each worker acks what it loaded, echoing its token
                    time.sleep(rng.uniform(0.0, 0.15))  # loading: a kill may land here
                    acks[w] = WorkerAck(w, v, version_hash(v), token=coord.attempt_token(w, v))
                    coord.record_ack(acks[w])
                restored = serving is not None and rng.random() < cfg.restores
                if restored and serving is not None:  # item 3: w0 falls back to what it
                    # served, then the network delivers a copy of its first ack (README form)
                    w0 = WORKERS[0]
                    coord.record_ack(WorkerAck(w0, serving.version, serving.artifact_hash))
                    st.bump(f"duplicate_ack:{coord.record_ack(acks[w0]).reason}")
                phase.value = 0
                res = coord.try_activate(v)
                st.bump(f"activate:{res.reason}")
                if restored and res.activated:
                    st.bump("activated_while_a_worker_restored")
                if res.activated:
                    activated += 1
                    if activated % cfg.rollback_every == 0:
                        coord.rollback(reason=f"fault race rollback of v{v}")
                        st.bump("rolled_back")
            except ActivationError as exc:
                st.bump(f"refused:{type(exc).__name__}")
                st.note(str(exc))
            st.flush()
            time.sleep(rng.uniform(0.02, 0.15))


def _prepare(cfg: FaultRaceConfig) -> None:
    """A fresh deployment: the operator's policy, the worker set, v0 active (README)."""
    with open_backend(cfg.url, lease_seconds=cfg.lease_seconds) as be:
        set_admission_policy(be.registry, cfg.policy(), "fault race: set by the operator")
        coord = ActivationCoordinator(be.registry, list(WORKERS), ledger=be.ledger)
        coord.prepare(0)
        coord.commit_artifact(0, version_hash(0))
        coord.distribute(0)
        for w in WORKERS:
            coord.record_ack(WorkerAck(w, 0, version_hash(0), token=coord.attempt_token(w, 0)))
        if not coord.try_activate(0).activated:
            raise RuntimeError("the fault race could not activate v0")


def run_fault_race(
    cfg: FaultRaceConfig, progress: Callable[[str], None] | None = None
) -> FaultRaceReport:
    """Race, kill, sweep, judge."""
    say = progress or (lambda _t: None)
    _prepare(cfg)
    ctx = mp.get_context("spawn")
    rng = random.Random(cfg.seed)
    started = time.time()
    kills: Counter[str] = Counter()
    seq = Counter[str]()
    # (processes at the start line, the race's start, 1 while the activator awaits acks)
    line = (ctx.Value("i", 0), ctx.Value("d", 0.0), ctx.Value("i", 0))

    def spawn(kind: str) -> tuple[str, Any]:
        seq[kind] += 1
        role = f"{kind}-{seq[kind]}"
        p = ctx.Process(target=_child, args=(kind, cfg, role, rng.getrandbits(32), line), name=role)
        p.start()
        return role, p

    live: dict[str, tuple[str, Any]] = {"generator": spawn("generator")}
    live["activator"] = spawn("activator")
    for i in range(cfg.learners):
        live[f"learner{i}"] = spawn("learner")
    every = [p for _r, p in live.values()]
    say(f"{len(live)} processes starting")
    while line[0].value < len(every) and time.time() - started < START_TIMEOUT_S:
        if not all(p.is_alive() for p in every):
            break
        time.sleep(0.05)
    line[1].value = time.time()
    deadline = line[1].value + cfg.seconds
    say(f"{len(live)} processes racing for {cfg.seconds:.0f}s")
    while time.time() < deadline:
        wait = cfg.kill_every * rng.uniform(0.5, 1.5) if cfg.kill_every > 0 else 1.0
        time.sleep(max(0.0, min(wait, deadline - time.time())))
        if cfg.kill_every <= 0 or time.time() >= deadline - 1.0:
            continue
        learners = [s for s in live if s.startswith("learner")]
        slot = "activator" if rng.random() < 0.4 else rng.choice(learners)
        role, proc = live[slot]
        if slot == "activator" and rng.random() < 0.6:  # aim: mid-distribution
            aim = time.time() + 2.0
            while line[2].value != 1 and time.time() < aim:
                time.sleep(0.005)
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            kills[slot.rstrip("0123456789")] += 1
            say(f"SIGKILLed {role}; {deadline - time.time():.0f}s left")
        live[slot] = spawn("activator" if slot == "activator" else "learner")
        every.append(live[slot][1])
    for p in every:
        p.join(timeout=max(30.0, cfg.lease_seconds * 3))
    errors = [f"process {p.name} did not stop" for p in every if p.is_alive()]
    for p in every:
        if p.is_alive():
            p.kill()
            p.join(5)
    stats: dict[str, dict[str, Any]] = {}
    for f in sorted((cfg.workdir / "stats").glob("*.json")):
        stats[f.stem] = json.loads(f.read_text(encoding="utf-8"))
    errors += [f"{r}: {s['error']}" for r, s in stats.items() if "error" in s]
    say("the last sweep: expire leases of the dead, settle attempts past their deadline")
    waiting = _final_sweep(cfg)
    say("judging the durable trace and the stored rows")
    with open_backend(cfg.url, create=False, lease_seconds=cfg.lease_seconds) as be:
        trace = be.trace()
        spec = check_trace(trace, with_registry=True)
        store = compare_with_store(spec.final, stored_world(be.ledger, be.registry))
        rows = be.ledger.snapshot()
        arts = be.registry.artifacts()
        policy = be.registry.policy()
    judged = judge(trace, rows, arts, cfg.max_lag)
    hashes = {a.version: a.artifact_hash for a in arts}
    forged = sorted(
        rid for rid, e in rows.items()
        if e.state == "consumed" and e.artifact_hash != hashes.get(e.behavior_version)
    )  # fmt: skip
    counts: Counter[str] = Counter()
    for s in stats.values():
        counts.update(s.get("stats", {}))
    added = counts.get("added", 0)
    findings = [f"spec: {v}" for v in (*spec.violations, *store)] + judged.findings
    findings += [f"consumed with a hash its version never had: {rid}" for rid in forged[:20]]
    if policy != cfg.policy():
        findings.append(f"the recorded policy is {policy}, not the operator's {cfg.policy()}")
    if counts.get("activated_while_a_worker_restored"):
        findings.append(
            f"{counts['activated_while_a_worker_restored']} versions activated although a "
            "required worker had reported restoring the previous version (a duplicate ack "
            "counted)"
        )
    if counts.get("hostile_coordinator_accepted"):
        findings.append(
            f"{counts['hostile_coordinator_accepted']} coordinators with a loose policy= started"
        )
    if len(rows) != added:
        findings.append(f"lost: the generator added {added} rollouts, the ledger holds {len(rows)}")
    # every process had stopped and the sweep waited out ack_timeout: any attempt still
    # awaiting acks is past its deadline, and settle left it there
    findings += [f"v{v} awaits acks past its deadline after the last settle" for v, _d in waiting]
    tampering: dict[str, Any] = {}
    if cfg.tamper:
        say("ledger check of the faulted store, then one tampering it must name")
        tampering, problems = tamper_and_check(cfg.url, random.Random(cfg.seed))
        findings += problems
    facts = {
        **judged.facts,
        "tampering": tampering,
        "rollouts": len(rows),
        "by_state": dict(Counter(e.state for e in rows.values())),
        "lease_losses": judged.facts["lease_losses"],
        "processes": len(every),
    }
    return FaultRaceReport(
        config=cfg,
        elapsed_s=time.time() - started,
        counts=dict(sorted(counts.items())),
        kills=dict(kills),
        findings=tuple(findings),
        errors=tuple(errors),
        events=len(trace),
        facts=facts,
    )


def _ledger_check(url: str) -> tuple[int, dict[str, Any]]:
    """`rollout-lifecycle ledger check --json` in a process of its own, as a user runs it."""
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "rollout_lifecycle", "ledger", "check", "--backend", url,
         "--json", "--quiet"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    try:
        doc: dict[str, Any] = json.loads(res.stdout)
    except ValueError:
        doc = {"output": (res.stdout + res.stderr)[-2000:]}
    return res.returncode, doc


def tamper_and_check(url: str, rng: random.Random) -> tuple[dict[str, Any], list[str]]:
    """`ledger check` passes the store; one edit of item 7 (needing no hash computation)
    chosen by `rng`; `ledger check` must then exit 1 naming the edit's invariant."""
    from rollout_lifecycle.stateful_tests.tamperings import TAMPERINGS, sql

    rc, doc = _ledger_check(url)
    if rc != 0:
        return {}, [f"ledger check of the faulted store exited {rc}: {str(doc)[:500]}"]
    kind = "sqlite" if url.startswith("sqlite:") else "postgresql"
    names = [n for n, (_s, _i, kinds) in sorted(TAMPERINGS.items()) if kind in kinds]
    if not sql(url, ("SELECT count(*) FROM ledger_bad_versions",))[0][0]:
        names = [n for n in names if "bad-version" not in n]  # no mark to edit
    name = rng.choice(names)
    statements, invariant, _kinds = TAMPERINGS[name]
    sql(url, statements)
    rc, doc = _ledger_check(url)
    named = doc.get("by_invariant", {})
    facts = {"edit": name, "must_name": invariant, "exit": rc, "named": sorted(named)}
    if rc != 1 or invariant not in named:
        return facts, [f"tampering {name!r}: ledger check exited {rc} naming {sorted(named)}, "
                       f"not {invariant!r}"]  # fmt: skip
    return facts, []


def _final_sweep(cfg: FaultRaceConfig) -> list[tuple[int, float | None]]:
    """What a surviving process does next: wait out the dead learners' leases and the dead
    activator's ack deadline, expire, settle. Returns attempts still awaiting acks."""
    time.sleep(max(cfg.lease_seconds, cfg.ack_timeout) + 0.5)
    with open_backend(cfg.url, lease_seconds=cfg.lease_seconds) as be:
        be.ledger.expire_leases()
        coord = ActivationCoordinator(be.registry, ledger=be.ledger, ack_timeout=cfg.ack_timeout)
        settled = coord.settle()
        return list(settled.awaiting)


@attrs.frozen
class Judged:
    """What `judge` found and counted."""

    findings: list[str]
    facts: dict[str, Any]


def judge(trace: list[Any], rows: dict[str, Any], artifacts: list[Any], max_lag: int) -> Judged:
    """The race's own verdict from the durable trace (independent of the spec's checker and
    of the code that wrote it): two published updates per rollout, stale consumption,
    rollouts left reserved or in no final state, time spent past ack deadlines."""
    findings: list[str] = []
    reserved_by: dict[str, set[str]] = defaultdict(set)  # update -> rollouts it trained on
    pointer: int | None = None
    reserved_at: dict[tuple[str, str], int | None] = {}  # (rollout, update) -> active v then
    stale: list[str] = []
    lease_losses = 0
    poisoned: set[str] = set()
    published: set[str] = set()
    awaiting: dict[int, float] = {}  # version -> ack deadline of its open attempt
    past: list[float] = []
    activations = 0
    for ev in trace:
        if isinstance(ev, ArtifactChanged):
            if ev.pointer_after is not None:
                pointer = ev.pointer_after.version
            elif ev.pointer_before is not None and ev.pointer_after is None:
                pointer = None
            if ev.event == "activate":
                activations += 1
                published.update(ev.after.trained_by)
            deadline = ev.after.ack_deadline
            if ev.version in awaiting and ev.after.state != "awaiting_acks":
                past.append(max(0.0, ev.at - awaiting.pop(ev.version)))
            if ev.after.state == "awaiting_acks" and deadline is not None:
                awaiting[ev.version] = deadline
        elif isinstance(ev, EntryChanged):
            a = ev.after
            taken = ev.before is None or ev.before.reserved_by != a.reserved_by
            if a.state == "reserved" and a.reserved_by is not None and taken:
                reserved_by[a.reserved_by].add(ev.rollout_id)
                reserved_at[(ev.rollout_id, a.reserved_by)] = pointer
            if ev.event == "expire_lease":
                lease_losses += 1
            if a.state == "consumed" and ev.before is not None:
                u = ev.before.reserved_by or ev.update_id or "?"
                at = reserved_at.get((ev.rollout_id, u))
                if at is None or not 0 <= at - a.behavior_version <= max_lag:
                    stale.append(f"{ev.rollout_id} (v{a.behavior_version}, active v{at})")
        elif isinstance(ev, UpdateChanged) and ev.after.status == "poisoned":
            poisoned.add(ev.update_id)
    twice = {
        rid: sorted(u for u in published if rid in reserved_by[u])
        for u in published
        for rid in reserved_by[u]
    }
    doubled = {rid: us for rid, us in twice.items() if len(us) > 1}
    findings += [f"rollout {rid} is in the gradients of published updates {us}" for rid, us in
                 sorted(doubled.items())[:20]]  # fmt: skip
    findings += [f"stale rollout consumed: {s}" for s in stale[:20]]
    held = sorted(rid for rid, e in rows.items() if e.state == "reserved")
    findings += [f"lost: {rid} still reserved after the last sweep" for rid in held[:20]]
    nowhere = sorted(
        rid for rid, e in rows.items() if e.state not in FINAL_STATES and e.state != "rewarded"
        and e.state != "reserved"
    )  # fmt: skip
    findings += [f"lost: {rid} left in {rows[rid].state!r}" for rid in nowhere[:20]]
    open_now = [a for a in artifacts if a.state == "awaiting_acks"]
    facts = {
        "rollouts_in_two_published_updates": len(doubled),
        "stale_consumed": len(stale),
        "lost": len(held) + len(nowhere),
        "lease_losses": lease_losses,
        "updates_poisoned": len(poisoned),
        "poisoned_published": len(poisoned & published),
        "activations": activations,
        # the longest an attempt stayed past its deadline, the last sweep after the race
        # (which waits out every deadline) included
        "attempts_past_deadline_s_max": round(max(past, default=0.0), 3),
        "awaiting_acks_at_end": len(open_now),
    }  # fmt: skip
    if poisoned & published:
        findings.append(f"poisoned updates published: {sorted(poisoned & published)[:10]}")
    return Judged(findings, facts)


__all__ = [
    "FaultRaceConfig",
    "FaultRaceReport",
    "judge",
    "run_fault_race",
]


STAGE = "faults"


def run_fault_stage(ctx: Any) -> Any:
    """The campaign's `faults` stage: a short fault race on the campaign's durable
    backend (fresh state), with the catalogue mutant in every child process."""
    from rollout_lifecycle.stateful_tests.backends import durable_url
    from rollout_lifecycle.stateful_tests.stages import StageReport

    cfg = FaultRaceConfig(
        url=durable_url(ctx.backend, ctx.workdir),
        workdir=ctx.workdir,
        seconds=STAGE_SECONDS,
        kill_every=2.0,
        seed=ctx.seed,
        mutant=ctx.mutant,
    )
    rep = run_fault_race(cfg, ctx.say)
    failures = [*rep.findings, *(f"process failed: {e}" for e in rep.errors)]
    facts = {
        "kills": sum(rep.kills.values()),
        "lease_losses": rep.facts["lease_losses"],
        "activations": rep.facts["activations"],
        "lineage_fence_refusals": sum(
            n for k, n in rep.counts.items() if k.startswith("lineage_fence:")
        ),
        "events": rep.events,
    }
    return StageReport(STAGE, ctx.backend, ran=True, failures=tuple(failures), facts=facts)


STAGE_SECONDS = 15.0
