"""Pace, don't discard (issue 21): a discrete-event simulation through the real ledger.

G generator slots and one learner share a memory backend (`open_backend("memory://")`: the
real MemoryLedger attached to the real MemoryRegistry). Every rollout is written to the
ledger, every batch is reserved with an honest AdmissionStamp and committed, and every new
version is activated through the ActivationCoordinator, so the pointer moves exactly as it
does in a deployment and each reservation is judged by the ledger against it.

Prompts have long-tailed lengths: a prompt's length is lognormal (hard prompts are long),
each attempt varies around it, and the sampler caps it at `max_tokens`. Generating takes
time proportional to the tokens (one slot, `tokens_per_time` tokens per unit of time), so
the slow rollouts are the long ones. An update takes `update_time` on `batch_size`
rollouts and activates the next version. Three strategies, same prompts, same seed:

* `discard`: the generators are always busy; a rollout whose lag to the pointer exceeds
  max_lag is retired (stale, with its cause) and its prompt requeued, without a bound; the
  learner takes the first B admissible rollouts in completion order.
* `capacity`: AReaL's rule at dispatch, capacity = (max_lag + version + 1) x B - (accepted
  + running), also capped by the G slots; stale ones are discarded and requeued as above.
* `ours`: generators ask `ledger.dispatch` (the durable budget of (max_lag + 1) x B live
  rollouts; attempt chains bounded by `max_attempts`); the learner reserves
  `oldest_admissible` and paces: before an update that would make an in-flight rollout of
  the oldest admissible version stale, it waits for it (it then joins the batch, oldest
  first). It waits at most `max_wait` update times for a straggler with attempts left and
  without limit for one on its last attempt (so every prompt trains within the bound), and
  not at all while a second batch is already waiting (the learner is then the bottleneck).
  Strict pacing (no limit) wastes nothing, but one straggler then holds the whole window:
  the budget fills with finished rollouts behind it and the generators idle; the report's
  `frontier` shows that trade. The defaults (2 attempts, a quarter update's wait: one
  cheap try, then the chain is paced) came from a small sweep of ours' own two bounds at
  max_lag 1, with the deployment's parameters fixed first; the frontier reruns others.
  A straggler given up on is doomed (the update makes it stale before it can land), so its
  generation is stopped (`generation_failed`, cause `cancelled`, with the tokens spent)
  rather than finished; whatever goes stale anyway is retired by `ledger.retire_stale`;
  either way its chain is dispatched again, within the bound.

Why a fixed pool: the question is which prompts get trained at all. A fixed-update run
would leave whatever is in flight at the end untrained for every strategy alike, hiding
starvation; so every strategy gets the same pool of prompts and runs until each prompt is
trained (or, for `ours`, its attempts are exhausted), or until no update has landed for
`stall_factor` x (longest generation + update time): nothing can be waiting for a slow
rollout that long, so the learner is starved. Requeued prompts go to the back of the
queue, the order that least hurts the baselines (a starving prompt does not hog a slot
while fresh prompts wait). The run's cost is read at its last update: throughput is
trained rollouts per unit of time up to it, and wasted generation counts the tokens of
generations finished by then that were never trained (the starved tail a baseline spends
after its last update is not charged to it). The final batch may be smaller than B only
when fewer than B prompts are left to train.

`ks_length` compares one length per dispatched prompt (its first attempt, what the stream
asked for) with the lengths of the trained rollouts: the length bias of what got trained.

The pool's end flatters the baselines: when it runs dry the learner starves, the pointer
stops, and their starving long prompts finally fit the bound, which a continuous stream
never allows. So their `never_trained` and `ks_length` are lower bounds; each run's
`details` also gives the steady-state figures, taken when the last new prompt is dispatched
(`never_trained_steady`, `ks_length_steady`, over the first half of the pool).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from rollout_lifecycle.model.backends import Backend, open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.ledger import ManualClock, ReserveRequest
from rollout_lifecycle.model.pacing import (
    ATTEMPTS_EXHAUSTED,
    LIVE_STATES,
    NO_CAPACITY,
    pacing_metrics,
    stale_disposition,
)
from rollout_lifecycle.model.records import (
    AdmissionPolicy,
    AdmissionStamp,
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

STRATEGIES = ("discard", "capacity", "ours")
LAGS = (1, 2, 4)
WORKER = "generators"  # the generator fleet acks each version as one worker
REWARD = Reward("sim-reward", "1", 1.0)
CONDITIONS = GenerationConditions("sim-tok", 1.0, 1.0, -1, 8192)
MAX_DRIFT = 1.0  # drift is not simulated: every stamp carries drift 0


@attrs.frozen
class SimConfig:
    """The simulated deployment; time is in units of one median-length generation.

    Defaults: B = 64 rollouts per update, G = 128 slots (two batches in flight), prompt
    lengths lognormal with median 1024 tokens and sigma 1 (mean ~1690), each attempt within
    sigma 0.25 of its prompt, capped at 8192 tokens; the update takes as long as the
    generators need to produce one batch of mean-length rollouts (B x mean / G), so
    generation and training are balanced and neither side hides the other's losses.
    `requeue_after` puts a prompt to retry behind that many queued prompts (None: behind the
    whole pool: the baselines' best throughput and waste). `max_attempts` and `max_wait`
    are ours' bounds.
    """

    prompts: int = 64 * 150
    batch_size: int = 64
    generators: int = 128
    median_tokens: float = 1024.0
    sigma: float = 1.0
    attempt_sigma: float = 0.25
    max_tokens: int = 8192
    update_time: float | None = None  # None: B x mean generation time / G
    max_attempts: int = 2
    requeue_after: int | None = None  # None: at the back of the pool
    max_wait: float = 0.25  # ours: updates' time to wait for a straggler not on its last attempt
    stall_factor: float = 3.0
    seed: int = 0

    @property
    def tokens_per_time(self) -> float:
        """Tokens one slot generates per unit of time (a median prompt takes 1)."""
        return self.median_tokens

    @property
    def mean_generation_time(self) -> float:
        """Mean generation time of the lognormal (before the cap)."""
        return math.exp(self.sigma**2 / 2)

    @property
    def update_seconds(self) -> float:
        """The update time: given, or balanced against the generators."""
        if self.update_time is not None:
            return self.update_time
        return self.batch_size * self.mean_generation_time / self.generators

    @property
    def stall_time(self) -> float:
        """No update for this long: the learner is starved and the run ends."""
        return self.stall_factor * (self.max_tokens / self.tokens_per_time + self.update_seconds)


FULL = SimConfig()
QUICK = SimConfig(prompts=32 * 30, batch_size=32, generators=64)  # the same shape, smaller


@attrs.frozen
class Prompts:
    """The pool: one base length per prompt and a seeded draw per (prompt, attempt)."""

    base: np.ndarray[Any, np.dtype[np.float64]]
    config: SimConfig

    @classmethod
    def draw(cls, config: SimConfig) -> Prompts:
        """The same pool for every strategy and lag of one seed."""
        rng = np.random.default_rng([config.seed, 0])
        base = rng.lognormal(math.log(config.median_tokens), config.sigma, config.prompts)
        return cls(base, config)

    def tokens(self, prompt: int, attempt: int) -> int:
        """The tokens attempt `attempt` (1-based) of `prompt` generates; the same in every run."""
        noise = np.random.default_rng([self.config.seed, 1, prompt, attempt]).normal()
        n = self.base[prompt] * math.exp(self.config.attempt_sigma * noise)
        return int(min(self.config.max_tokens, max(1, round(n))))


def ks_distance(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical
    distribution functions, evaluated at every observed value (1.0 when one is empty)."""
    xa = np.sort(np.asarray(a, dtype=np.float64))
    xb = np.sort(np.asarray(b, dtype=np.float64))
    if xa.size == 0 or xb.size == 0:
        return 1.0
    grid = np.concatenate([xa, xb])
    fa = np.searchsorted(xa, grid, side="right") / xa.size
    fb = np.searchsorted(xb, grid, side="right") / xb.size
    return float(np.max(np.abs(fa - fb)))


@attrs.define
class Flight:
    """A rollout being generated: its prompt, attempt, behaviour version and tokens."""

    prompt: int
    attempt: int
    version: int
    tokens: int
    started: float


@attrs.frozen
class RunResult:
    """One strategy at one lag: the report row and what the accounting check needs."""

    row: dict[str, Any]
    detail: dict[str, Any]
    dispatched_ids: tuple[str, ...]
    entries: dict[str, LedgerEntry]


def artifact_hash(version: int) -> str:
    """A stand-in for the checkpoint's content hash."""
    return hashlib.sha256(f"pacing-sim/v{version}".encode()).hexdigest()


def _freshness(lag: int, max_lag: int) -> str:
    return "fresh" if lag == 0 else "tolerated" if lag <= max_lag else "stale"


class Simulation:
    """One run: the event loop, the strategy's dispatch and batch rules, the ledger calls."""

    def __init__(self, config: SimConfig, prompts: Prompts, strategy: str, max_lag: int) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.cfg = config
        self.prompts = prompts
        self.strategy = strategy
        self.max_lag = max_lag
        self.B = config.batch_size
        self.clock = ManualClock()
        self.backend: Backend = open_backend("memory://", clock=self.clock)
        self.ledger = self.backend.ledger
        ours = strategy == "ours"
        self.policy = AdmissionPolicy(
            max_lag=max_lag,
            max_drift=MAX_DRIFT,
            batch_size=self.B if ours else None,
            max_attempts=config.max_attempts if ours else None,
        )
        set_admission_policy(self.backend.registry, self.policy, "the simulated operator's")
        self.coord = ActivationCoordinator(
            self.backend.registry,
            (WORKER,),
            ledger=self.ledger,
            clock=self.clock,
            policy=self.policy,
        )
        self.version = -1
        self._activate(0, ())
        self.events: list[tuple[float, int, str, str]] = []
        self._seq = 0
        self.queue: deque[int] = deque(range(config.prompts))
        self.attempts = [0] * config.prompts
        self.first_tokens: dict[int, int] = {}
        self.flights: dict[str, Flight] = {}
        self.buffer: dict[str, Flight] = {}  # rewarded, not reserved: insertion = completion
        self.trained: set[int] = set()
        self.exhausted: set[int] = set()
        self.dispatched: list[str] = []
        self.finished_at: dict[str, float] = {}
        self.accepted = 0  # AReaL's counter: completions accepted (not stale), ever
        self.learning: tuple[str, list[str]] | None = None
        self.updates = 0
        self.last_update_at = 0.0
        self.waiting_since: float | None = None
        self.fresh_done_at = math.inf
        self.trained_at: dict[int, float] = {}
        self.trained_tokens: dict[int, int] = {}

    # ---- registry -------------------------------------------------------------------------

    def _activate(self, version: int, trained_by: Sequence[str]) -> None:
        """Take `version` through prepare, commit, distribute, the fleet's ack, activate."""
        h = artifact_hash(version)
        self.coord.prepare(version, trained_by=trained_by)
        self.coord.commit_artifact(version, h)
        self.coord.distribute(version)
        token = self.coord.attempt_token(WORKER, version)
        self.coord.record_ack(WorkerAck(WORKER, version, h, token=token))
        result = self.coord.try_activate(version)
        if not result.activated:
            raise RuntimeError(f"v{version} did not activate: {result.reason}")
        self.version = version

    # ---- events ---------------------------------------------------------------------------

    def _at(self, when: float, kind: str, key: str) -> None:
        self._seq += 1
        heapq.heappush(self.events, (when, self._seq, kind, key))

    def run(self) -> RunResult:
        """Dispatch, then process events in time order until done or starved."""
        self._fill()
        while self.events:
            when, _, kind, key = heapq.heappop(self.events)
            if when - self.last_update_at > self.cfg.stall_time:
                break
            self.clock.advance(when - self.clock.now)
            if kind == "done":
                if key in self.flights:  # not cancelled meanwhile
                    self._generated(key)
            elif kind == "update":
                self._updated()
            self._fill()
            self._learn()
            if len(self.trained) + len(self.exhausted) == self.cfg.prompts:
                break
        return self._result()

    # ---- generators -----------------------------------------------------------------------

    def _remaining(self) -> int:
        return self.cfg.prompts - len(self.trained) - len(self.exhausted)

    def _fill(self) -> None:
        """Start rollouts on free slots as the strategy allows."""
        while self.queue and len(self.flights) < self.cfg.generators:
            if self.strategy == "capacity":
                budget = (self.max_lag + self.version + 1) * self.B
                if budget - (self.accepted + len(self.flights)) <= 0:
                    return
            prompt = self.queue.popleft()
            attempt = self.attempts[prompt] + 1
            rid = f"p{prompt}/a{attempt}"
            entry = LedgerEntry(rid, self.version, artifact_hash(self.version))
            if self.strategy == "ours":  # the prompt's identity names its attempt chain
                identity = RolloutIdentity(rid, f"p{prompt}", "sim", 0)
                behavior = BehaviorPolicy(entry.behavior_version, entry.artifact_hash)
                out = self.ledger.dispatch(Rollout(identity, behavior, CONDITIONS))
                if out.reason == NO_CAPACITY:
                    self.queue.appendleft(prompt)  # its turn comes after the next update
                    return
                if out.reason == ATTEMPTS_EXHAUSTED:
                    self.exhausted.add(prompt)
                    continue
                if not out.dispatched or out.attempt != attempt:
                    raise RuntimeError(f"dispatch of {rid}: {out.reason} {out.detail}")
            else:
                self.ledger.add(entry)
            self.attempts[prompt] = attempt
            if prompt == self.cfg.prompts - 1 and attempt == 1:
                self.fresh_done_at = self.clock.now  # the stream of new prompts ran dry
            tokens = self.prompts.tokens(prompt, attempt)
            self.first_tokens.setdefault(prompt, tokens)
            self.flights[rid] = Flight(prompt, attempt, self.version, tokens, self.clock.now)
            self.dispatched.append(rid)
            self._at(self.clock.now + tokens / self.cfg.tokens_per_time, "done", rid)

    def _generated(self, rid: str) -> None:
        """A generation finished: record its tokens and reward; retire it if already stale."""
        f = self.flights.pop(rid)
        e = self.ledger.transition(rid, "generation_done", 0, tokens=f.tokens)
        e = self.ledger.transition(rid, "reward_ready", e.revision, reward=REWARD)
        lag = self.version - f.version
        self.finished_at[rid] = self.clock.now
        self.buffer[rid] = f
        if lag > self.max_lag:
            if self.strategy == "ours":
                self._retire_stale()
            else:
                d = stale_disposition(lag, self.max_lag, self.version)
                del self.buffer[rid]
                self.ledger.transition(rid, "retire_stale", e.revision, disposition=d)
                self._requeue(f.prompt)
            return
        self.accepted += 1

    def _retire_stale(self) -> None:
        """The ledger retires every rewarded rollout now too old; requeue their prompts."""
        for e in self.ledger.retire_stale():
            f = self.buffer.pop(e.rollout_id)
            self._requeue(f.prompt)

    # ---- learner --------------------------------------------------------------------------

    def _learn(self) -> None:
        """Start the next update when the strategy's batch is ready."""
        if self.learning is not None:
            return
        need = min(self.B, self._remaining())
        if need <= 0 or len(self.buffer) < need:
            return
        if self.strategy == "ours":
            batch = self._paced_batch(need)
            if batch is None:
                return
        else:
            batch = list(self.buffer)[:need]
        uid = f"update-{self.updates + 1}"
        requests = []
        for rid in batch:
            e = self.ledger.get(rid)
            lag = self.version - e.behavior_version
            stamp = AdmissionStamp(
                current_version=self.version,
                behavior_version=e.behavior_version,
                max_lag=self.max_lag,
                max_drift=MAX_DRIFT,
                drift=0.0,
                freshness=_freshness(lag, self.max_lag),
                reason="ok",
                accepted=True,
            )
            requests.append(ReserveRequest(rid, e.revision, stamp))
        outcomes = self.ledger.reserve_batch(uid, requests)
        refused = [(o.rollout_id, o.reason, o.detail) for o in outcomes if not o.reserved]
        if refused:
            raise RuntimeError(f"{uid}: the ledger refused {refused[:3]}")
        for rid in batch:
            del self.buffer[rid]
        self.learning = (uid, batch)
        if self.strategy == "ours":
            self._cancel_doomed()
        self._at(self.clock.now + self.cfg.update_seconds, "update", uid)

    def _paced_batch(self, need: int) -> list[str] | None:
        """The oldest admissible batch, or None to wait.

        After this update the oldest version the window holds now falls out of it, so a
        rollout of that version still generating would arrive stale. One on its chain's
        last attempt is always waited for (it then goes first: oldest version, most
        attempts), so no chain runs out of attempts while it is generating. Others are
        waited for at most `max_wait` updates' time, and only if they could still join the
        batch (it is not that version's rollouts anyway) and no second batch is waiting.
        """
        floor = self.version - self.max_lag
        late = [f for f in self.flights.values() if f.version <= floor]
        if any(f.attempt >= self.cfg.max_attempts for f in late):
            return None
        backlog = len(self.buffer) >= 2 * need  # a second batch is ready: the learner is behind
        old_ready = sum(1 for f in self.buffer.values() if f.version <= floor)
        if late and not backlog and old_ready < need:
            patience = self.cfg.max_wait * self.cfg.update_seconds
            if self.waiting_since is None:
                self.waiting_since = self.clock.now
                if math.isfinite(patience):
                    self._at(self.clock.now + patience, "wake", "")
            if self.clock.now - self.waiting_since < patience:
                return None
        self.waiting_since = None
        batch = [e.rollout_id for e in self.ledger.oldest_admissible(need)]
        return batch if len(batch) == need else None

    def _cancel_doomed(self) -> None:
        """Stop the rollouts this update makes stale before they can land: the ledger
        records the failure with its cause and the tokens spent, the chain is requeued."""
        floor = self.version - self.max_lag
        for rid, f in list(self.flights.items()):
            if f.version > floor:
                continue
            spent = min(f.tokens, round((self.clock.now - f.started) * self.cfg.tokens_per_time))
            d = Disposition("generation", "cancelled", f"v{f.version} is stale after this update")
            self.ledger.transition(rid, "generation_failed", 0, disposition=d, tokens=spent)
            del self.flights[rid]
            self.finished_at[rid] = self.clock.now
            self._requeue(f.prompt)

    def _requeue(self, prompt: int) -> None:
        """A prompt to try again: behind the next `requeue_after` prompts of the stream."""
        d = self.cfg.requeue_after
        if d is None or d >= len(self.queue):
            self.queue.append(prompt)
        else:
            self.queue.insert(d, prompt)

    def _updated(self) -> None:
        """The update finished: commit exactly its batch, activate the next version."""
        assert self.learning is not None
        uid, batch = self.learning
        self.ledger.commit(uid, batch)
        for rid in batch:
            prompt = int(rid[1:].split("/")[0])
            self.trained.add(prompt)
            self.trained_at[prompt] = self.clock.now
            self.trained_tokens[prompt] = self.ledger.get(rid).tokens or 0
        self.learning = None
        self.updates += 1
        self.last_update_at = self.clock.now
        self._activate(self.version + 1, (uid,))
        if self.strategy == "ours":
            self._retire_stale()
        else:
            for e in self.ledger.retire_stale():
                f = self.buffer.pop(e.rollout_id)
                self.accepted -= 1  # AReaL does not count a rollout it discards
                self._requeue(f.prompt)

    # ---- the report -----------------------------------------------------------------------

    def _result(self) -> RunResult:
        entries = self.ledger.snapshot()
        t_end = self.last_update_at
        generated = wasted = 0
        trained_lengths = []
        for e in entries.values():
            if e.tokens is None:
                continue
            if e.state == "consumed":
                trained_lengths.append(e.tokens)
                generated += e.tokens
                continue
            if self.finished_at.get(e.rollout_id, math.inf) <= t_end:
                generated += e.tokens
                wasted += e.tokens
        started = [p for p in range(self.cfg.prompts) if self.attempts[p] > 0]
        row = {
            "strategy": self.strategy,
            "max_lag": self.max_lag,
            "never_trained": sum(1 for p in started if p not in self.trained),
            "max_attempts": max(self.attempts),
            "wasted_fraction": round(wasted / generated, 4) if generated else 0.0,
            "ks_length": round(
                ks_distance([self.first_tokens[p] for p in started], trained_lengths), 4
            ),
            "throughput": round(len(self.trained) / t_end, 3) if t_end > 0 else 0.0,
        }
        by_state: dict[str, int] = {}
        for e in entries.values():
            by_state[e.state] = by_state.get(e.state, 0) + 1
        detail = {
            "strategy": self.strategy,
            "max_lag": self.max_lag,
            "prompts": self.cfg.prompts,
            "dispatched": len(self.dispatched),
            "trained": len(self.trained),
            "attempts_exhausted": len(self.exhausted),
            "updates": self.updates,
            "last_update_at": round(t_end, 3),
            "stopped_at": round(self.clock.now, 3),
            "by_state": dict(sorted(by_state.items())),
            **self._steady(),
        }
        stats = self.ledger.statistics().pacing
        if self.strategy == "ours" and stats is not None:  # what a trainer logs, from the ledger
            detail["ledger_metrics"] = {k: round(v, 4) for k, v in pacing_metrics(stats).items()}
        self.backend.close()
        return RunResult(row, detail, tuple(self.dispatched), entries)

    def _steady(self) -> dict[str, Any]:
        """Starvation in steady state, before the pool runs dry: of the first half of the
        prompts, how many were not trained by the time the last new prompt was dispatched,
        and the KS distance of their lengths to the lengths of those that were. When the pool
        runs dry the learner starves, the pointer stops and late long rollouts fit the bound
        at last: a drain a continuous stream never has, which the run's own figures include."""
        half = range(self.cfg.prompts // 2)
        done = [p for p in half if self.trained_at.get(p, math.inf) <= self.fresh_done_at]
        first = [self.first_tokens[p] for p in half if p in self.first_tokens]
        return {
            "never_trained_steady": len(half) - len(done),
            "ks_length_steady": round(
                ks_distance(first, [self.trained_tokens[p] for p in done]), 4
            ),
        }


def unaccounted(result: RunResult) -> list[str]:
    """What breaks issue 21's invariant: every dispatched rollout is in the ledger, and is
    consumed, live, or ended with a recorded cause (empty: all accounted for)."""
    problems = []
    if len(result.entries) != len(result.dispatched_ids):
        problems.append(
            f"{len(result.entries)} ledger entries for {len(result.dispatched_ids)} dispatches"
        )
    for rid in result.dispatched_ids:
        e = result.entries.get(rid)
        if e is None:
            problems.append(f"{rid}: dispatched but not in the ledger")
        elif e.state != "consumed" and e.state not in LIVE_STATES and e.disposition is None:
            problems.append(f"{rid}: {e.state} with no recorded cause")
    return problems


def simulate(config: SimConfig, strategy: str, max_lag: int) -> RunResult:
    """One strategy at one lag on the pool of `config.seed`."""
    return Simulation(config, Prompts.draw(config), strategy, max_lag).run()


# ours' own bounds, (max_attempts, max_wait), rerun beside the defaults: strict pacing
# (never give up on a straggler), a longer wait, more attempts
FRONTIER = ((2, math.inf), (2, 1.0), (3, 0.5), (4, 0.5))


def bench_pacing(
    config: SimConfig = FULL,
    lags: Sequence[int] = LAGS,
    strategies: Sequence[str] = STRATEGIES,
    progress: Callable[[str], None] = lambda _: None,
    frontier: Sequence[tuple[int, float]] = FRONTIER,
) -> dict[str, Any]:
    """Every strategy at every lag on the same pool: the `pacing` part of the bench report.

    `frontier` reruns `ours` at the smallest lag with other bounds (max_attempts, max_wait;
    an infinite wait is strict pacing): the trade between waste and throughput they set,
    shown rather than hidden behind the one choice the table uses.
    """
    t0 = time.perf_counter()
    prompts = Prompts.draw(config)
    rows, details, trade = [], [], []

    def one(cfg: SimConfig, strategy: str, lag: int) -> RunResult:
        progress(f"pacing: {strategy} at max_lag {lag}")
        r = Simulation(cfg, prompts, strategy, lag).run()
        problems = unaccounted(r)
        if problems:
            raise RuntimeError(f"{strategy} max_lag {lag}: " + "; ".join(problems[:5]))
        return r

    for lag in lags:
        for strategy in strategies:
            r = one(config, strategy, lag)
            rows.append(r.row)
            details.append(r.detail)
    if frontier and "ours" in strategies:
        for bound, wait in frontier:
            alt = attrs.evolve(config, max_attempts=bound, max_wait=wait)
            r = one(alt, "ours", min(lags))
            trade.append({"attempt_bound": bound, "max_wait": _finite_or_none(wait), **r.row})
    cfg = {k: _finite_or_none(v) for k, v in attrs.asdict(config).items()}
    cfg["update_time"] = config.update_seconds
    return {
        "what": "discrete-event simulation of G generator slots and one learner through the "
        "memory ledger and registry (issue 21)",
        "config": cfg,
        "results": rows,
        "details": details,
        "frontier": trade,
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }


def _finite_or_none(v: Any) -> Any:
    """JSON has no infinity: an unbounded figure is written as null."""
    return None if isinstance(v, float) and math.isinf(v) else v


def goals(pacing: dict[str, Any], goal: Callable[[str, float | None, str], Any]) -> list[Any]:
    """Issue 21's done-when at the smallest lag, `ours` against `discard`, through the bench's
    `goal(what, measured, target)`."""
    rows = pacing["results"]
    lag = min(r["max_lag"] for r in rows)
    by = {r["strategy"]: r for r in rows if r["max_lag"] == lag}
    ours, base = by.get("ours"), by.get("discard")
    if ours is None or base is None:
        return []
    bound = pacing["config"]["max_attempts"]

    def ratio(a: float, b: float) -> float | None:
        return None if b == 0 else a / b

    what = f"pacing (issue 21) max_lag {lag}: ours"
    return [
        goal(f"{what} prompts never trained", ours["never_trained"], "<= 0"),
        goal(f"{what} max attempts per prompt", ours["max_attempts"], f"<= {bound}"),
        goal(f"{what} KS distance, dispatched vs trained lengths", ours["ks_length"], "<= 0.05"),
        goal(
            f"{what} wasted generation / discard's",
            ratio(ours["wasted_fraction"], base["wasted_fraction"]),
            "<= 0.5",
        ),
        goal(
            f"{what} throughput / discard's",
            ratio(ours["throughput"], base["throughput"]),
            ">= 0.95",
        ),
    ]


def markdown(pacing: dict[str, Any]) -> list[str]:
    """The bench README's pacing section: parameters, the table, ours' frontier."""
    c = pacing["config"]
    lines = [
        "## Pacing (issue 21)",
        "",
        f"The {pacing['what']}, {pacing['elapsed_s']} s. A pool of {c['prompts']} prompts, "
        f"B = {c['batch_size']} rollouts per update, G = {c['generators']} generator slots; "
        f"lengths lognormal (median {c['median_tokens']:g} tokens, sigma {c['sigma']:g}; "
        f"attempts within sigma {c['attempt_sigma']:g}; cap {c['max_tokens']}); generation "
        f"time proportional to tokens (a median prompt takes 1 unit), update time "
        f"{c['update_time']:.3g} units; ours: at most {c['max_attempts']} attempts per "
        f"prompt, waits at most {c['max_wait']} update times for a straggler not on its last "
        f"attempt; seed {c['seed']}. Throughput is trained rollouts per unit of time; wasted is "
        "the share of generated tokens never trained; KS is the Kolmogorov-Smirnov distance "
        "between dispatched prompts' lengths and trained rollouts' lengths.",
        "",
        table(pacing),
    ]
    if pacing.get("frontier"):
        lines += [
            "",
            "`ours` at the smallest lag with other bounds on attempts and on the wait for a "
            "straggler (none: strict pacing, never give up on one):",
            "",
            table({"results": pacing["frontier"]}, wait=True),
        ]
    return lines


def table(report: dict[str, Any], *, wait: bool = False) -> str:
    """The results as a Markdown table (with `wait`, the frontier's bound columns)."""
    head = "| strategy | max_lag | never trained | max attempts | wasted | KS length | throughput |"
    lines = [
        ("| attempt bound | max_wait " if wait else "") + head,
        ("|---:|---:" if wait else "") + "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        w = r.get("max_wait")
        first = f"| {r.get('attempt_bound')} | {'none' if w is None else w} " if wait else ""
        lines.append(
            first + f"| {r['strategy']} | {r['max_lag']} | {r['never_trained']} | "
            f"{r['max_attempts']} | {r['wasted_fraction']:.3f} | {r['ks_length']:.3f} | "
            f"{r['throughput']:.2f} |"
        )
    return "\n".join(lines)
