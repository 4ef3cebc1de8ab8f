"""The whole loop, end to end: generate, reward, admit a batch, reserve, update, activate.

Generators run on the weights they serve. A request is stamped with the active version AT
DISPATCH (`stamp_policy`; the catalogue's mutant patches it to stamp at completion, so it is
always called through this module's global) and completes later, possibly after a new
version activated. A learner admits a BATCH with `AdmissionGate.assess_batch` over numpy
arrays, and every row is cross-checked against the plain-Python contract function
`model.api.assess_policy_compatibility`: the two implementations must agree, which is what
exposes a vectorised gate that averages drift over masked positions. The update commits
exactly what it reserved and publishes the next version, which workers stage and ack before
the coordinator switches the pointer.

Ghost truth kept here and nowhere else: which weights really generated each rollout, which
versions really became active, what was consumed, what each worker really staged.

Pacing (issue 21): each example records a pacing policy (batch_size, max_attempts), and
generators may also ask `ledger.dispatch` for permission on a prompt's attempt chain, a
fresh one or a requeue of a chain whose last attempt ended. The machine's own model of
the budget and the chains (the ghost versions, the stored states, its own chain lists)
predicts every answer; `retire_stale` and `oldest_admissible` are checked the same way.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import rollout_lifecycle.model.api as api_mod
import rollout_lifecycle.model.coordinator as coord_mod
import rollout_lifecycle.model.gate as gate_mod
from rollout_lifecycle.model.errors import DispatchRefused, GateConfigError, UpdatePoisoned
from rollout_lifecycle.model.ledger import ManualClock, RecoveryRule, ReserveRequest
from rollout_lifecycle.model.records import (
    AdmissionPolicy,
    Disposition,
    LedgerEntry,
    Rollout,
    RolloutIdentity,
)
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.spec.invariants import OPEN_STATES, Violation
from rollout_lifecycle.stateful_tests.backends import (
    Stack,
    bind_machine,
    close_stack,
    end_example,
    open_stack,
    reopen_stack,
)
from rollout_lifecycle.stateful_tests.builders import (
    CONDITIONS,
    NAN_CURRENT,
    REWARD,
    artifact_hash,
    corrupt_hash,
    current_batch,
    make_rollout,
)
from rollout_lifecycle.stateful_tests.quiescence import quiesce_copy
from rollout_lifecycle.stateful_tests.recording import (
    Recorder,
    TraceChecker,
    check_snapshot,
    counted,
    raise_violations,
    world_of,
)
from rollout_lifecycle.stateful_tests.workers import WorkerTruth, activation_ghost_violations

WORKERS = ("g0", "g1")
TORCH = importlib.util.find_spec("torch") is not None  # the gate's torch path, when installed
MAX_LAG = 1
MAX_DRIFT = 0.25
LEASE = 10.0
MAX_OPEN = 4  # requests in flight plus rollouts not yet terminal
MAX_VERSIONS = 10
BATCH = 4
PACED_CHAINS = 4  # prompts whose attempt chains paced dispatch draws from (bounds the run)
# what the budget counts as live: the lifecycle's non-terminal states, read off the machine
LIVE = OPEN_STATES
MAX_RELEASES = 1  # a rollout returned twice is quarantined (a poison rollout)
INVARIANT_NAMES = ("spec_holds",)
# reasons the gate gives from the record alone, before lag and drift are computed
RECORD_REASONS = frozenset(
    {
        "not_finished",
        "already_reserved",
        "already_consumed",
        "terminal_state",
        "unregistered_version",
        "artifact_hash_mismatch",
        "conditions_mismatch",
        "missing_evidence",
        "evidence_misaligned",
    }
)

picks = st.integers(min_value=0, max_value=7)
worker_ids = st.sampled_from(WORKERS)


def stamp_policy(version_at_dispatch: int, version_at_completion: int) -> int:
    """The behaviour version a finished rollout is stamped with: the one active at dispatch.

    The weights that generated the tokens are the ones served when the request started; the
    version active at completion may be newer (field notes, bug 7). Always called through
    this module's global so a mutant can replace it.
    """
    return version_at_dispatch


def _chain_of(rollout: Rollout) -> str:
    """The attempt chain a rollout's identity names, as the model reads the rule (dataset,
    prompt id, sample index, as a JSON list)."""
    i = rollout.identity
    return json.dumps([i.dataset, i.prompt_id, i.sample_index])


@attrs.frozen
class Request:
    """A generation request in flight: which generator, and the weights it started on."""

    rollout_id: str
    worker: str
    dispatched_at_version: int
    weights: tuple[int, str]  # ghost truth: what really generates the tokens
    evidence: str


class EndToEndMachine(RuleBasedStateMachine):
    """Generators, reward service, one learner, coordinator and workers on one trace."""

    backend: ClassVar[str] = "memory"
    recorder: ClassVar[Recorder]
    workdir: ClassVar[Path | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.recorder.start_example()
        self.max_lag = MAX_LAG
        self.step_no = 0
        self.tmp = Path(tempfile.mkdtemp(prefix="e2e-machine-", dir=self.workdir))
        self.clock = ManualClock(0.0)
        self.options: dict[str, Any] = {
            "lease_seconds": LEASE,
            "recovery": RecoveryRule(max_releases=MAX_RELEASES),
        }
        self.stack: Stack = open_stack(
            self.backend,
            self.tmp,
            self.clock,
            WORKERS,
            policy=AdmissionPolicy(MAX_LAG, MAX_DRIFT),
            **self.options,
        )
        self.truth = {w: WorkerTruth() for w in WORKERS}
        self.in_flight: list[Request] = []
        self.generated_by: dict[str, tuple[int, str]] = {}  # ghost: weights per rollout
        self.evidence: dict[str, str] = {}
        self.judged: dict[str, int] = {}
        self.activated: set[int] = set()  # ghost: versions that really became active
        # a token counts once: the tokens an ack was counted with, and per worker the token
        # its later answer was refused for ('spent_attempt_token': the attempt needs a retry)
        self.counted_tokens: set[str] = set()
        self.voided: dict[str, str] = {}
        self.consumed: set[str] = set()  # ghost: rollouts consumed so far
        self.update_no = 0
        self.held: set[str] = set()  # what the learner believes its update reserved
        self.next_id = 0
        self.reopened_at = 0
        self.policy = AdmissionPolicy(MAX_LAG, MAX_DRIFT)  # the recorded one (choose_pacing)
        self.chains: dict[str, list[str]] = {}  # the model's attempt chains, in order
        self.checker = TraceChecker(self.recorder, with_registry=True)
        self._bootstrap()

    # ---- plumbing --------------------------------------------------------------------------

    @property
    def coord(self) -> coord_mod.ActivationCoordinator:
        """The live coordinator (a new one after each reopen)."""
        return self.stack.coordinator

    @property
    def update_id(self) -> str:
        """The learner's current update."""
        return f"update-{self.update_no}"

    def _bootstrap(self) -> None:
        """v0 active and served by every generator."""
        c = self.coord
        c.prepare(0)
        c.commit_artifact(0, artifact_hash(0))
        c.distribute(0)
        for w in WORKERS:
            self._load(w, corrupt=False)
        self._try_activate(0)

    def _retired(self) -> set[int]:
        """Rolled-back versions whose rollouts are retired (the registry's record)."""
        return {
            a.version
            for a in self.coord.artifacts()
            if a.state == "rolled_back"
            and (a.failure is None or a.failure.cause != "rolled_back_kept")
        }

    def _pointer(self) -> tuple[int, str]:
        p = self.coord.pointer()
        assert p is not None, "bootstrap activated v0"
        return p.version, p.artifact_hash

    def _artifacts(self, *states: str) -> list[int]:
        return sorted(a.version for a in self.coord.artifacts() if a.state in states)

    def _entries(self, state: str) -> list[LedgerEntry]:
        snap = self.stack.ledger.snapshot()
        return sorted((e for e in snap.values() if e.state == state), key=lambda e: e.rollout_id)

    def _open_count(self) -> int:
        """Requests in flight plus rollouts something can still move (a rollout the gate
        rejected at the current version is parked until the version changes)."""
        cv = self._pointer()[0]
        snap = self.stack.ledger.snapshot()
        moving = sum(
            1
            for e in snap.values()
            if e.state in ("dispatched", "generated", "reserved")
            or (e.state == "rewarded" and self.judged.get(e.rollout_id) != cv)
        )
        return len(self.in_flight) + moving

    def _unjudged(self) -> list[LedgerEntry]:
        cv = self._pointer()[0]
        return [e for e in self._entries("rewarded") if self.judged.get(e.rollout_id) != cv]

    def _rollout(self, e: LedgerEntry) -> Rollout:
        return make_rollout(
            e.rollout_id,
            int(e.rollout_id[1:]),
            e.behavior_version,
            e.artifact_hash,
            self.evidence[e.rollout_id],
        )

    # ---- moves shared by `advance` and the explicit rules ---------------------------------

    def _dispatch(self, worker: str, evidence: str) -> None:
        truth = self.truth[worker]
        assert truth.serving is not None
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.in_flight.append(Request(rid, worker, self._pointer()[0], truth.serving, evidence))

    def _complete(self, req: Request) -> None:
        """The request finishes: stamp it (through the module global) and record it."""
        self.in_flight.remove(req)
        now = self._pointer()[0]
        version = stamp_policy(req.dispatched_at_version, now)
        self.recorder.checked(["stamped_with_generating_version"])
        if version != req.weights[0]:
            raise self.recorder.fail(
                f"{req.rollout_id} stamped v{version} but generated by the weights of "
                f"v{req.weights[0]} (dispatched at v{req.dispatched_at_version}, "
                f"completed at v{now})"
            )
        rollout = make_rollout(
            req.rollout_id, int(req.rollout_id[1:]), version, artifact_hash(version), req.evidence
        )
        led = self.stack.ledger
        # the recorded pacing policy judges the add as a dispatch (issue 31): the model says
        # whether it fits (its identity is a chain of its own: sample index = its number)
        want, _ = self._expect_dispatch(version, _chain_of(rollout))
        try:
            entry = led.add(rollout)
        except DispatchRefused as exc:
            if exc.reason != want:
                raise self.recorder.fail(
                    f"add of {req.rollout_id} (v{version}) refused {exc.reason!r}; the model "
                    f"expects {want!r} under {self.policy} at v{self._pointer()[0]}"
                ) from None
            self.recorder.note(f"pacing:add_refused:{exc.reason}")
            return
        if want != "dispatched":
            raise self.recorder.fail(
                f"add of {req.rollout_id} (v{version}) landed; the model expects {want!r}"
            )
        if entry.state == "quarantined":
            # the ledger quarantines arrivals of a version that once failed a distribution
            # attempt, even after a retry made it active; tolerated, counted, reported
            if version not in getattr(led, "bad_versions", frozenset()):
                raise self.recorder.fail(f"{req.rollout_id} of v{version} quarantined on add")
            self.recorder.note("active_version_rollout_quarantined_on_add")
        else:
            led.transition(req.rollout_id, "generation_done", entry.revision)
        self.generated_by[req.rollout_id] = req.weights
        self.evidence[req.rollout_id] = req.evidence

    def _reward(self, e: LedgerEntry, outcome: str) -> None:
        reward = REWARD if outcome == "reward_ready" else None
        self.stack.ledger.transition(e.rollout_id, outcome, e.revision, reward=reward)

    @initialize(max_lag=st.sampled_from([1, 0]))
    def choose_max_lag(self, max_lag: int) -> None:
        """L_max per example: 1 exercises tolerated rollouts, 0 the one-version boundary."""
        self.max_lag = max_lag

    @initialize(batch_size=st.sampled_from([1, 2, 3]), max_attempts=st.sampled_from([2, 1, 3]))
    def choose_pacing(self, batch_size: int, max_attempts: int) -> None:
        """Record a pacing policy per example: a small budget of (MAX_LAG + 1) x batch_size
        live rollouts and a small attempt bound, so both refusals are reached."""
        self.policy = AdmissionPolicy(MAX_LAG, MAX_DRIFT, batch_size, max_attempts)
        set_admission_policy(
            self.stack.registry, self.policy, "pacing for this example", at=self.clock()
        )

    def _admit_batch(self, *, tensors: bool = False) -> None:
        """Admit up to BATCH rewarded rollouts at once; cross-check every row; reserve."""
        batch = self._unjudged()[:BATCH]
        cv = self._pointer()[0]
        rollouts = [self._rollout(e) for e in batch]
        current = current_batch(rollouts, cv, self.evidence)
        gate = gate_mod.AdmissionGate(
            gate_mod.GatePolicy(self.max_lag, MAX_DRIFT, CONDITIONS),
            registry=self.coord.activated_hash,
        )
        given: Any = current
        if tensors:
            given = importlib.import_module("torch").as_tensor(current)
            self.recorder.note("gate:torch")
        else:
            self.recorder.note("gate:numpy")
        try:
            decisions = gate.assess_batch(rollouts, given, cv, entries=batch)
        except GateConfigError as exc:
            self._refused_batch(batch, rollouts, current, cv, exc)
            return
        requests = []
        for i, (e, ro, d) in enumerate(zip(batch, rollouts, decisions, strict=True)):
            self.judged[e.rollout_id] = cv
            self._cross_check(ro, list(current[i]), d, cv)
            if d.accepted:
                if e.behavior_version not in self.activated or not 0 <= d.lag <= self.max_lag:
                    raise self.recorder.fail(
                        f"{e.rollout_id} of v{e.behavior_version} admitted at v{cv} "
                        f"(ever active: {sorted(self.activated)})"
                    )
                requests.append(ReserveRequest(e.rollout_id, e.revision, d.stamp()))
            elif d.route == gate_mod.ROUTE_OFFLINE:
                self.stack.ledger.transition(
                    e.rollout_id,
                    "retire_stale",
                    e.revision,
                    disposition=Disposition("admission", "stale"),
                )
            elif d.route == gate_mod.ROUTE_QUARANTINE:
                self.stack.ledger.transition(
                    e.rollout_id,
                    "quarantine",
                    e.revision,
                    disposition=Disposition("admission", d.reason),
                )
        if requests:
            outcomes = self.stack.ledger.reserve_batch(self.update_id, requests)
            for out in outcomes:
                if not out.reserved:
                    raise self.recorder.fail(
                        f"{out.rollout_id} admitted but not reserved by the only learner: "
                        f"{out.reason}"
                    )
                self.held.add(out.rollout_id)

    def _refused_batch(
        self,
        batch: list[LedgerEntry],
        rollouts: list[Rollout],
        current: Any,
        cv: int,
        exc: GateConfigError,
    ) -> None:
        """The batch gate refused the whole batch: it must be for a NaN at an action
        position, in exactly the rows the contract function refuses; those are quarantined
        (a learner cannot judge them) and the rest is left for the next admission."""
        poisoned = []
        for i, ro in enumerate(rollouts):
            try:
                self._contract(ro, list(current[i]), cv)
            except GateConfigError:
                poisoned.append(i)
        self.recorder.checked(["batch_gate_matches_contract_function"])
        if not poisoned:
            raise self.recorder.fail(f"assess_batch refused a batch the contract judges: {exc}")
        if f"row(s) {poisoned[:10]}" not in str(exc):
            raise self.recorder.fail(f"assess_batch named other rows than {poisoned}: {exc}")
        self.recorder.note("gate:non_finite_refused")
        for i in poisoned:
            e = batch[i]
            self.stack.ledger.transition(
                e.rollout_id,
                "quarantine",
                e.revision,
                disposition=Disposition("admission", "non_finite_log_probs"),
            )

    def _contract(self, ro: Rollout, current: list[float], cv: int) -> dict[str, Any]:
        """The plain-Python contract function on one row (raises on a NaN at an action)."""
        ev = ro.evidence
        assert ev is not None
        n = len(ev.behavior_log_probs)
        return api_mod.assess_policy_compatibility(
            list(ev.behavior_log_probs),
            current[:n],
            list(ev.action_mask),
            ro.behavior.version,
            cv,
            self.max_lag,
            MAX_DRIFT,
        )

    def _cross_check(self, ro: Rollout, current: list[float], d: Any, cv: int) -> None:
        """The vectorised gate and the plain-Python contract function must agree on a row."""
        if d.reason in RECORD_REASONS or ro.evidence is None:
            return
        try:
            want = self._contract(ro, current, cv)
        except GateConfigError as exc:
            raise self.recorder.fail(
                f"{ro.rollout_id}: assess_batch judged a row ({d.reason}) the contract "
                f"function refuses: {exc}"
            ) from None
        self.recorder.checked(["batch_gate_matches_contract_function"])
        same = (d.accepted, d.reason) == (want["accepted"], want["reason"])
        if same and d.drift is not None:
            w = want["mean_abs_log_ratio"]
            same = (
                w is not None
                and math.isclose(d.drift, w, rel_tol=1e-9, abs_tol=1e-12)
                and d.freshness == want["freshness"]
            )
        if not same:
            raise self.recorder.fail(
                f"{ro.rollout_id}: assess_batch says ({d.accepted}, {d.reason!r}, "
                f"{d.freshness}, drift {d.drift}); assess_policy_compatibility says {want}"
            )

    def _finish_update(self, outcome: str) -> None:
        """Commit (and publish the next version), abort, or fail the learner's update."""
        led = self.stack.ledger
        owned = set(led.reserved_by(self.update_id))
        retired = self._retired()
        snap = led.snapshot()
        if (
            outcome == "commit"
            and owned == self.held
            and any(snap[r].behavior_version in retired for r in owned)
        ):
            # a rollback retired what it holds (issue 31): the commit is refused, nothing
            # consumed, the update poisoned; it returns what it holds
            try:
                led.commit(self.update_id, sorted(owned))
            except UpdatePoisoned:
                self.recorder.note("commit_refused:retired_version")
            else:
                raise self.recorder.fail(
                    f"{self.update_id} committed rollouts of a rolled-back version"
                )
            self._returned(led.abort(self.update_id))
        elif outcome == "commit" and owned == self.held:
            got = led.commit(self.update_id, sorted(owned))
            self.recorder.checked(["consumed_once", "consumed_version_was_active"])
            for e in got:
                if e.rollout_id in self.consumed:
                    raise self.recorder.fail(f"{e.rollout_id} consumed twice")
                if e.behavior_version not in self.activated:
                    raise self.recorder.fail(
                        f"{e.rollout_id} of v{e.behavior_version} consumed, but that version "
                        f"never became active (active so far: {sorted(self.activated)})"
                    )
                self.consumed.add(e.rollout_id)
            self._publish()
        elif outcome == "fail":
            led.fail_update(self.update_id, "nan_loss")
        else:  # abort, or a commit whose reservations ran out under it
            self._returned(led.abort(self.update_id))
        self.update_no += 1
        self.held = set()

    def _publish(self) -> None:
        """The update produced new weights: register the next version."""
        top = max(a.version for a in self.coord.artifacts())
        if top + 1 < MAX_VERSIONS:
            self.coord.prepare(top + 1)

    def _load(self, worker: str, *, corrupt: bool) -> None:
        """A worker stages the version awaiting acks and acks it (delivered at once here)."""
        (v,) = self._artifacts("awaiting_acks")
        rec = self.coord.artifact(v)
        token = self.coord.attempt_token(worker, v)  # sent with the weights
        ack = self.truth[worker].answer(
            worker, v, artifact_hash(v), corrupt_hash(v), rec.attempts, token, corrupt=corrupt
        )
        res = self.coord.record_ack(ack)
        if res.counted:
            self.counted_tokens.add(token)
        elif res.reason == "spent_attempt_token" and token in self.counted_tokens:
            self.voided[worker] = token  # it counted once, then the worker moved on
        elif res.reason != "duplicate":
            raise self.recorder.fail(f"{worker}'s fresh ack {ack} was not counted: {res.reason}")

    def _try_activate(self, v: int) -> None:
        tokens = self.coord.attempt_tokens(v)  # before the call: activation closes the attempt
        res = self.coord.try_activate(v)
        staged_ok = all(
            t.loaded == (v, artifact_hash(v))
            and t.last_sent is not None
            and t.last_sent.token == tokens[w]
            and self.voided.get(w) != tokens[w]
            for w, t in self.truth.items()
        )
        p = self.coord.pointer()
        newer = res.activated or p is None or v > p.version
        self.recorder.checked(["activation_when_all_staged"])
        if staged_ok and newer and not res.activated:
            raise self.recorder.fail(
                f"v{v} refused ({res.reason}) although every worker staged and acked it"
            )
        if res.activated:
            self.activated.add(v)
            for t in self.truth.values():
                t.serving = t.loaded  # the switch: generation now runs on the new weights

    def _pending(self) -> int | None:
        for state in ("awaiting_acks", "committed", "prepared"):
            vs = self._artifacts(state)
            if vs:
                return vs[0]
        return None

    # ---- the healthy pipeline ----------------------------------------------------------------

    def _next_move(self) -> str | None:
        """The healthy system's next step (see `advance`); None when nothing is left."""
        room = self._open_count() < MAX_OPEN
        if not self.in_flight and room:
            return "dispatch"
        pending = self._pending()
        if pending is not None:
            return "activation"
        if self.held:
            return "finish"
        if self._entries("dispatched"):  # paced rollouts, recorded at dispatch
            return "generation"
        if self._entries("generated"):
            return "reward"
        if self._unjudged():
            return "admit"
        if self.in_flight:
            return "complete"
        if room:
            return "dispatch"
        return None

    @rule()
    @precondition(lambda self: self._next_move() is not None)
    @counted
    def advance(self) -> None:
        """The healthy loop's next step: keep one request in flight, push a pending version
        through (commit, distribute, every worker stages and acks, activate), commit the
        learner's update, reward, admit a batch and reserve it, complete requests.

        A request dispatched before an update usually completes after the new version is
        active, so the stamping rule is exercised by the simplest programs.
        """
        move = self._next_move()
        if move == "dispatch":
            self._dispatch(WORKERS[self.next_id % len(WORKERS)], "ok")
        elif move == "activation":
            v = self._pending()
            assert v is not None
            state = self.coord.artifact(v).state
            if state == "prepared":
                self.coord.commit_artifact(v, artifact_hash(v))
            elif state == "committed":
                self.coord.distribute(v)
            else:
                tokens = self.coord.attempt_tokens(v)
                if any(self.voided.get(w) == tokens[w] for w in WORKERS):
                    # a worker reloaded after its ack counted: its token is spent, so the
                    # activator opens a new attempt (fresh tokens) for the reload to count
                    self.coord.fail_distribution(v, "reloaded_after_ack")
                    self.coord.retry(v)
                    return
                for w in WORKERS:
                    sent = self.truth[w].last_sent
                    if sent is None or (sent.version, sent.token) != (v, tokens[w]):
                        self._load(w, corrupt=False)
                        return
                self._try_activate(v)
        elif move == "finish":
            self._finish_update("commit")
        elif move == "generation":
            self._generated(self._entries("dispatched")[0], failed=False, tokens=8)
        elif move == "reward":
            self._reward(self._entries("generated")[0], "reward_ready")
        elif move == "admit":
            self._admit_batch()
        else:
            self._complete(self.in_flight[0])

    # ---- explicit rules: the search's deviations from the happy path -------------------------

    @rule(
        worker=worker_ids,
        evidence=st.sampled_from(["ok"] * 5 + ["drifty", "drifty", "empty_mask", NAN_CURRENT]),
    )
    @precondition(lambda self: self._open_count() < MAX_OPEN)
    @counted
    def dispatch(self, worker: str, evidence: str) -> None:
        """A generator starts a request on the weights it serves."""
        self._dispatch(worker, evidence)

    @rule(pick=picks)
    @precondition(lambda self: bool(self.in_flight))
    @counted
    def complete(self, pick: int) -> None:
        """Some request in flight finishes (not necessarily the oldest)."""
        self._complete(self.in_flight[pick % len(self.in_flight)])

    @rule(pick=picks, outcome=st.sampled_from(["reward_ready"] * 3 + ["reward_timeout"]))
    @precondition(lambda self: bool(self._entries("generated")))
    @counted
    def reward(self, pick: int, outcome: str) -> None:
        """The reward service answers, or times out (its own failure, never a reward of 0)."""
        gen = self._entries("generated")
        self._reward(gen[pick % len(gen)], outcome)

    @rule(tensors=st.booleans())
    @precondition(lambda self: bool(self._unjudged()))
    @counted
    def admit(self, tensors: bool) -> None:
        """The learner admits a batch against the current version and reserves it; half the
        time its current log-probs are a torch tensor (the gate's torch path), when torch is
        installed, judged by the same cross-check."""
        self._admit_batch(tensors=tensors and TORCH)

    @rule(outcome=st.sampled_from(["commit", "commit", "abort", "fail"]))
    @precondition(lambda self: bool(self.held))
    @counted
    def finish_update(self, outcome: str) -> None:
        """The update commits (and publishes new weights), aborts, or fails."""
        self._finish_update(outcome)

    @rule()
    @precondition(lambda self: bool(self.held))
    @counted
    def crash_learner(self) -> None:
        """The learner dies mid-update; its reservations wait for their lease."""
        self.update_no += 1
        self.held = set()

    @rule()
    @precondition(lambda self: bool(self._entries("reserved")))
    @counted
    def expire(self) -> None:
        """A lease's worth of time passes and expired reservations are returned."""
        self.clock.advance(LEASE)
        led = self.stack.ledger
        got = led.expire_leases()
        self._returned(got)
        if not {e.rollout_id for e in got} & self.held:
            return
        # issue 31: the update lost a lease, so the ledger poisoned it: no commit of it
        # lands, not even of what it still holds; the learner returns the rest
        record = led.update(self.update_id)
        if record is None or record.status != "poisoned":
            raise self.recorder.fail(f"{self.update_id} lost a lease but is recorded {record}")
        try:
            led.commit(self.update_id, led.reserved_by(self.update_id))
        except UpdatePoisoned:
            self.recorder.note("commit_refused:lease_expired")
        else:
            raise self.recorder.fail(f"{self.update_id} committed after it lost a lease")
        self._returned(led.abort(self.update_id))
        self.update_no += 1
        self.held = set()

    def _returned(self, entries: list[LedgerEntry]) -> None:
        """Released rollouts are admitted afresh before anyone reserves them again."""
        for e in entries:
            self.judged.pop(e.rollout_id, None)

    # ---- pacing: dispatch on a chain, retire what went stale, oldest first ----------------

    def _expect_dispatch(self, version: int, chain: str) -> tuple[str, int]:
        """The model's answer to a dispatch (reason, attempt), in model.pacing's order:
        the version, the chain, the attempt bound, then the budget."""
        pol, p = self.policy, self._pointer()[0]
        snap = self.stack.ledger.snapshot()
        states = [snap[rid].state for rid in self.chains.get(chain, [])]
        attempt = len(states) + 1
        if version in self._retired():
            return "version_retired", attempt
        if version > p or version not in self.activated:
            return "not_active", attempt
        if p - version > pol.max_lag:
            return "stale", attempt
        if "consumed" in states:
            return "chain_done", attempt
        if any(s in LIVE for s in states):
            return "chain_live", attempt
        if pol.max_attempts is not None and attempt > pol.max_attempts:
            return "attempts_exhausted", attempt
        floor = max(0, p - pol.max_lag)
        live = sum(1 for e in snap.values() if e.state in LIVE and e.behavior_version >= floor)
        if pol.batch_size is not None and live >= (pol.max_lag + 1) * pol.batch_size:
            return "no_capacity", attempt
        return "dispatched", attempt

    @rule(
        worker=worker_ids,
        chain=st.integers(min_value=0, max_value=PACED_CHAINS - 1),
        offset=st.sampled_from([0] * 6 + [1, 2, -1]),
    )
    @counted
    def paced_dispatch(self, worker: str, chain: int, offset: int) -> None:
        """A generator asks to start an attempt of prompt `chain` on the weights it serves
        (offset 0), or on a version older or newer than the pointer (a refused probe). A
        chain whose last attempt ended is a requeue. The budget bounds what is live, and
        the chains and the attempt bound bound the rest, so the rule needs no precondition."""
        truth = self.truth[worker]
        assert truth.serving is not None
        version = max(0, self._pointer()[0] - offset)
        weights = truth.serving if offset == 0 else (version, artifact_hash(version))
        rid = f"r{self.next_id}"
        made = make_rollout(rid, self.next_id, weights[0], weights[1], "ok")
        # prompt `chain`, sample 0: its identity is the chain (the deployment's chain_key)
        rollout = attrs.evolve(made, identity=RolloutIdentity(rid, f"p{chain}", "paced", 0))
        key = _chain_of(rollout)
        want, attempt = self._expect_dispatch(weights[0], key)
        out = self.stack.ledger.dispatch(rollout)
        self.recorder.note(f"pacing:{out.reason}")
        if (out.dispatched, out.reason, out.attempt) != (want == "dispatched", want, attempt):
            raise self.recorder.fail(
                f"dispatch of {rid} on v{weights[0]}, chain {key}: got ({out.dispatched}, "
                f"{out.reason!r}, attempt {out.attempt}); the model expects ({want!r}, attempt "
                f"{attempt}) under {self.policy} at v{self._pointer()[0]}"
            )
        if not out.dispatched:
            return
        e = out.entry
        if e is None or (e.rollout_id, e.chain, e.attempt) != (rid, key, attempt):
            raise self.recorder.fail(f"dispatch of {rid} on {key} recorded {e}")
        self.next_id += 1
        self.chains.setdefault(key, []).append(rid)
        self.generated_by[rid] = weights
        self.evidence[rid] = "ok"
        if attempt > 1:
            self.recorder.note("pacing:requeued")

    def _generated(self, e: LedgerEntry, *, failed: bool, tokens: int) -> None:
        event = "generation_failed" if failed else "generation_done"
        got = self.stack.ledger.transition(e.rollout_id, event, e.revision, tokens=tokens)
        if got.tokens != tokens:
            raise self.recorder.fail(f"{event} on {e.rollout_id} recorded tokens {got.tokens}")

    @rule(
        pick=picks,
        failed=st.sampled_from([False, True]),  # a failed attempt is what gets requeued
        tokens=st.sampled_from([4, 16, 64]),
    )
    @precondition(lambda self: bool(self._entries("dispatched")))
    @counted
    def finish_paced(self, pick: int, failed: bool, tokens: int) -> None:
        """A paced rollout's generation ends (or fails), with the tokens it generated."""
        found = self._entries("dispatched")
        self._generated(found[pick % len(found)], failed=failed, tokens=tokens)

    def _window(self) -> tuple[int, int]:
        p = self._pointer()[0]
        return max(0, p - self.policy.max_lag), p

    @rule()
    @precondition(lambda self: bool(self._entries("rewarded")))
    @counted
    def retire_stale(self) -> None:
        """Retire, with their cause, the rewarded rollouts the pointer has left behind."""
        floor, _ = self._window()
        due = [e.rollout_id for e in self._entries("rewarded") if e.behavior_version < floor]
        got = self.stack.ledger.retire_stale()
        if sorted(e.rollout_id for e in got) != due:
            raise self.recorder.fail(
                f"retire_stale returned {sorted(e.rollout_id for e in got)} below v{floor}; "
                f"the model expects {due}"
            )
        for e in got:
            if e.state != "retired_stale" or e.disposition is None or not e.disposition.cause:
                raise self.recorder.fail(f"retire_stale left {e} without its cause")
            self.judged.pop(e.rollout_id, None)

    @rule(limit=st.integers(min_value=0, max_value=5))
    @precondition(lambda self: bool(self._entries("rewarded")))
    @counted
    def oldest_admissible(self, limit: int) -> None:
        """What a learner takes first: the oldest version, then the most-retried chain."""
        floor, top = self._window()
        ok = [e for e in self._entries("rewarded") if floor <= e.behavior_version <= top]
        ok.sort(key=lambda e: (e.behavior_version, -e.attempt, e.rollout_id))
        want = [e.rollout_id for e in ok[:limit]]
        got = [e.rollout_id for e in self.stack.ledger.oldest_admissible(limit)]
        if got != want:
            raise self.recorder.fail(
                f"oldest_admissible({limit}) returned {got}; the model expects {want} "
                f"(window v{floor}..v{top})"
            )

    @rule(worker=worker_ids, corrupt=st.booleans())
    @precondition(lambda self: bool(self._artifacts("awaiting_acks")))
    @counted
    def load(self, worker: str, corrupt: bool) -> None:
        """A worker stages the awaited version (maybe corrupt bytes) and acks what it read."""
        self._load(worker, corrupt=corrupt)

    @rule()
    @precondition(lambda self: bool(self._artifacts("awaiting_acks")))
    @counted
    def fail_distribution(self) -> None:
        """Distribution gives up; the old version stays active, the new one's rollouts go."""
        (v,) = self._artifacts("awaiting_acks")
        self.coord.fail_distribution(v, "ack_timeout")

    @rule(give_up=st.booleans())
    @precondition(lambda self: bool(self._artifacts("distribution_failed")))
    @counted
    def retry(self, give_up: bool) -> None:
        """Retry the failed distribution (if none is in flight), or abandon it."""
        v = self._artifacts("distribution_failed")[0]
        pointer = self.coord.pointer()
        overtaken = pointer is not None and v <= pointer.version  # it can never activate now
        if give_up or overtaken or self._artifacts("awaiting_acks"):
            self.coord.abandon(v, "operator")
        else:
            self.coord.retry(v)

    @rule()
    @precondition(lambda self: self._can_roll_back())
    @counted
    def rollback(self) -> None:
        """Explicit rollback; generators reload the reinstated weights (and say so) first."""
        p = self.coord.rollback()
        attempt = self.coord.artifact(p.version).attempts
        for w, t in self.truth.items():
            # reload and report at once: acks of a newer version staged before the rollback
            # must not keep counting (the coordinator does not void them on its own). No
            # attempt is open, so the report carries no token: it can block, never help
            res = self.coord.record_ack(t.ack(w, p.version, p.artifact_hash, attempt))
            if (res.recorded, res.reason) != (True, "reported"):
                raise self.recorder.fail(f"{w}'s reload ack after rollback: {res.reason}")
            t.serving = t.loaded
        self.recorder.reached("rollback")

    def _can_roll_back(self) -> bool:
        p = self.coord.pointer()
        if p is None:
            return False
        if any(a.state == "awaiting_acks" for a in self.coord.artifacts()):
            return False  # refused while a distribution awaits acks (see coordinator.rollback)
        rb = self.coord.artifact(p.version).rollback_version
        return rb is not None and self.coord.artifact(rb).state == "superseded"

    @rule()
    @precondition(lambda self: self.stack.durable and self.step_no - self.reopened_at >= 8)
    @counted
    def reopen(self) -> None:
        """Restart the coordinator process on the same file."""
        self.stack = reopen_stack(
            self.stack,
            self.tmp,
            self.clock,
            WORKERS,
            policy=self.policy,
            **self.options,
        )
        self.reopened_at = self.step_no
        before = self.coord.pointer()
        self.coord.resume()  # settles: an attempt whose every ack is in activates
        after = self.coord.pointer()
        if after is not None and after != before:
            self.activated.add(after.version)
            for t in self.truth.values():
                t.serving = t.loaded  # the switch, as in _try_activate

    @rule()
    @precondition(lambda self: self._pending() is not None or bool(self._entries("reserved")))
    @counted
    def quiesce(self) -> None:
        """Liveness on a rebuilt copy: activations resolve, reservations come back."""
        problems = quiesce_copy(
            self.recorder,
            self.stack.ledger,
            self.stack.registry,
            self.truth,
            (),
            now=self.clock.now,
            lease_seconds=LEASE,
            recovery=self.options["recovery"],
            true_hash=artifact_hash,
            corrupt_hash=corrupt_hash,
        )
        if problems:
            raise self.recorder.fail("; ".join(problems[:6]))

    # ---- checks after every step ---------------------------------------------------------

    @invariant()
    def spec_holds(self) -> None:
        """Spec invariants on new trace steps and the stores; ghost truth of activations."""
        rec = self.recorder
        new = self.stack.source.new_events()
        raise_violations(rec, "trace", self.checker.feed(new))
        raise_violations(
            rec,
            "ghost",
            [Violation("ghost_truth", t) for t in activation_ghost_violations(new, self.truth)],
        )
        snap = self.stack.ledger.snapshot()
        reg = self.stack.registry
        world = world_of(snap, reg.artifacts(), reg.pointer(), reg, self.stack.ledger)
        raise_violations(rec, "stores", check_snapshot(rec, world))
        rec.checked(["trace_matches_store"])
        if self.checker.world != world:
            raise rec.fail("the trace's after-images differ from the stored records")

    def teardown(self) -> None:
        """Close the stores and delete the files; never raise over the real failure."""
        end_example(self.recorder, self.tmp, [lambda: close_stack(self.stack)])


def make_e2e_machine(
    backend: str = "memory",
    *,
    recorder: Recorder | None = None,
    workdir: Path | None = None,
) -> type[RuleBasedStateMachine]:
    """The end-to-end machine on 'memory' (one EventLog), 'sqlite' (one file) or PostgreSQL
    ('postgresql' or a postgresql:// URL: one schema)."""
    return bind_machine(
        EndToEndMachine,
        backend,
        machine="end-to-end",
        recorder=recorder,
        recorder_name="e2e",
        workdir=workdir,
    )
