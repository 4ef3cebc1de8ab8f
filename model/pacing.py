"""Pace, don't discard: the dispatch-side staleness budget, attempt chains and their metrics.

Rejecting stale rollouts at training time starves the long prompts: they take longest to
generate, arrive stale, are regenerated, and rarely reach a batch. So the ledger also
bounds staleness where it is cheap, at dispatch. A generator asks `ledger.dispatch` for
permission to start a rollout; inside one atomic step the ledger reads the deployment's
pointer and policy and counts what is live, and writes the dispatched entry only if

* its behaviour version is active or was, within `max_lag` of the pointer;
* the live rollouts that can still be trained (behaviour version >= pointer - max_lag)
  number fewer than (max_lag + 1) x batch_size: one batch per version that can still
  train it, so a rollout started now has a slot before it goes stale (the learner takes
  the oldest first: `oldest_admissible`);
* its prompt's attempt chain has no live or trained attempt and fewer than
  `max_attempts` attempts; the new entry records its chain and 1-based attempt.

A rollout that goes stale anyway is retired with its cause (`retire_stale`) and its chain
may be dispatched again, up to the bound. Every dispatched rollout is therefore consumed,
live, or retired with a cause; the spec checks that from the history, on its own.

This module holds what every backend shares: the decision (`plan_dispatch`) over what the
backend read inside its atomic step, and the statistics built from stored rows.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np

from rollout_lifecycle.model.errors import InvalidRecord, brief
from rollout_lifecycle.model.machines import LIFECYCLE
from rollout_lifecycle.model.records import (
    MAX_ID_LENGTH,
    AdmissionPolicy,
    Disposition,
    LedgerEntry,
    RolloutIdentity,
)

DISPATCHED = "dispatched"
NO_CAPACITY = "no_capacity"
CHAIN_LIVE = "chain_live"
CHAIN_DONE = "chain_done"
ATTEMPTS_EXHAUSTED = "attempts_exhausted"
NOT_ACTIVE = "not_active"
STALE = "stale"
VERSION_RETIRED = "version_retired"  # rolled back (the registry's, read in the same step)
DISPATCH_REASONS = (
    DISPATCHED,
    NO_CAPACITY,
    CHAIN_LIVE,
    CHAIN_DONE,
    ATTEMPTS_EXHAUSTED,
    NOT_ACTIVE,
    VERSION_RETIRED,
    STALE,
)

# live: not terminal (read off the machine: dispatched, generated, rewarded, reserved)
LIVE_STATES = tuple(s for s in LIFECYCLE.states if s not in LIFECYCLE.terminal)
_LIVE = frozenset(LIVE_STATES)


@attrs.frozen
class DispatchPremise:
    """What a dispatch step read inside its own atomic step.

    `pointer` and `policy` are the registry's (None: none); `was_active` the versions ever
    active (None: no registry attached, so no budget and no bound apply); `live_window` the
    live entries with behaviour version >= pointer - max_lag; `chain_states` the states of
    the chain's earlier attempts; `retired` the rolled-back versions.
    """

    pointer: int | None
    was_active: frozenset[int] | None
    policy: AdmissionPolicy | None
    live_window: int
    chain_states: tuple[str, ...]
    retired: frozenset[int] = frozenset()


@attrs.frozen
class DispatchOutcome:
    """The answer to one dispatch request; nothing was written unless `dispatched`.

    `capacity` is the free budget before this request (None: unbounded), `live` the live
    rollouts counted against it, `attempt` the attempt number written (or that would have
    been). `no_capacity` is the pacing signal: ask again after the next update lands.
    """

    rollout_id: str
    dispatched: bool
    reason: str
    entry: LedgerEntry | None
    attempt: int
    capacity: int | None
    live: int
    detail: str = ""


def window_floor(pointer: int | None, policy: AdmissionPolicy | None) -> int | None:
    """The oldest behaviour version that can still be trained (None: no bound known)."""
    if pointer is None or policy is None:
        return None
    return max(0, pointer - policy.max_lag)


def identity_chain(identity: RolloutIdentity) -> str:
    """The attempt chain a rollout's identity names: its dataset, prompt id and sample index
    (as a compact JSON list, so no two identities share a key); a key over the records'
    length limit for ids is replaced by its sha256."""
    key = json.dumps([identity.dataset, identity.prompt_id, identity.sample_index])
    if len(key) > MAX_ID_LENGTH:
        key = "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()
    return key


def check_chain(chain: object) -> str:
    """A chain key: the same rules as any identifier (validated by the record)."""
    if not isinstance(chain, str):
        raise InvalidRecord(f"chain must be a string (the prompt's key), got {brief(chain)}")
    return chain


def plan_dispatch(
    entry: LedgerEntry, chain: str, premise: DispatchPremise, *, chained: bool = True
) -> tuple[DispatchOutcome, LedgerEntry | None]:
    """Decide a dispatch from what the step read: (outcome, entry to insert or None).

    Order: the behaviour version (not retired, active, not stale), then the chain (one live
    attempt at a time, none after a trained one, at most max_attempts), then the budget.
    Not `chained` (an add under chain_key 'caller'): no chain rule, no chain written.
    """
    policy, pointer = premise.policy, premise.pointer
    attempt = len(premise.chain_states) + 1
    free: int | None = None
    if policy is not None and policy.batch_size is not None and pointer is not None:
        free = (policy.max_lag + 1) * policy.batch_size - premise.live_window

    def refuse(reason: str, detail: str) -> tuple[DispatchOutcome, None]:
        out = DispatchOutcome(
            entry.rollout_id, False, reason, None, attempt, free, premise.live_window, detail
        )
        return out, None

    v = entry.behavior_version
    if premise.was_active is not None:
        if v in premise.retired:  # before the pointer: a rollback leaves it above the pointer
            return refuse(VERSION_RETIRED, f"v{v} was rolled back; its rollouts are retired")
        if pointer is None or v > pointer or v not in premise.was_active:
            return refuse(NOT_ACTIVE, f"v{v} is not a version that was active (pointer {pointer})")
        if policy is not None and pointer - v > policy.max_lag:
            return refuse(
                STALE, f"v{v} is {pointer - v} behind the pointer v{pointer} > {policy.max_lag}"
            )
    if chained and any(s == "consumed" for s in premise.chain_states):
        return refuse(CHAIN_DONE, f"chain {brief(chain)} already trained an attempt")
    if chained and any(s in _LIVE for s in premise.chain_states):
        return refuse(CHAIN_LIVE, f"chain {brief(chain)} has a live attempt")
    bound = None if premise.was_active is None or policy is None else policy.max_attempts
    if chained and bound is not None and attempt > bound:
        return refuse(ATTEMPTS_EXHAUSTED, f"chain {brief(chain)} used its {bound} attempt(s)")
    if free is not None and free <= 0:
        return refuse(
            NO_CAPACITY,
            f"{premise.live_window} live rollouts fill the budget "
            f"({policy.max_lag if policy else 0} + 1) x {policy.batch_size if policy else 0}",
        )
    new = attrs.evolve(entry, chain=chain, attempt=attempt) if chained else entry
    return (
        DispatchOutcome(
            entry.rollout_id, True, DISPATCHED, new, attempt, free, premise.live_window
        ),
        new,
    )


def stale_disposition(lag: int, max_lag: int, pointer: int) -> Disposition:
    """The recorded cause of a rollout retired because it went stale before training."""
    return Disposition("admission", "stale", f"lag {lag} > max_lag {max_lag} at pointer v{pointer}")


def oldest_first(entries: Iterable[LedgerEntry]) -> list[LedgerEntry]:
    """Oldest behaviour version first; then the most-retried chain; then the id."""
    return sorted(entries, key=lambda e: (e.behavior_version, -e.attempt, e.rollout_id))


# ---- statistics -----------------------------------------------------------------------------


@attrs.frozen
class PacingStatistics:
    """What a trainer logs about pacing, from the stored rows.

    Staleness is the lag each trained rollout was admitted with; attempts are per chain
    (a rollout dispatched without a chain is its own chain of one); wasted tokens were
    generated by rollouts that ended without training; `ks_length` is the two-sample
    Kolmogorov-Smirnov distance between one generated length per prompt (its latest
    attempt) and the lengths of trained rollouts: the length bias of what gets trained.
    """

    trained: int
    trained_lag_mean: float | None
    trained_lag_max: int | None
    chains: int
    chains_trained: int
    chains_live: int
    attempts_histogram: dict[int, int]
    max_attempts: int
    generated_tokens: int
    wasted_tokens: int
    wasted_fraction: float
    ks_length: float | None


@attrs.frozen
class PacingRow:
    """The fields pacing statistics need from one stored entry (no full decode)."""

    rollout_id: str
    state: str
    chain: str | None
    attempt: int
    tokens: int | None
    lag: int | None  # admitted lag (consumed or reserved), else None


def row_of(e: LedgerEntry) -> PacingRow:
    """The pacing fields of a decoded entry (the memory ledger's path)."""
    lag = None if e.admission is None else e.admission.current_version - e.behavior_version
    return PacingRow(e.rollout_id, e.state, e.chain, e.attempt, e.tokens, lag)


def ks_distance(a: Iterable[float], b: Iterable[float]) -> float | None:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical
    distribution functions (None when either sample is empty)."""
    xa = np.sort(np.asarray(list(a), dtype=np.float64))
    xb = np.sort(np.asarray(list(b), dtype=np.float64))
    if xa.size == 0 or xb.size == 0:
        return None
    grid = np.concatenate([xa, xb])
    fa = np.searchsorted(xa, grid, side="right") / xa.size
    fb = np.searchsorted(xb, grid, side="right") / xb.size
    return float(np.max(np.abs(fa - fb)))


def pacing_from(rows: Iterable[PacingRow]) -> PacingStatistics:
    """Build the pacing statistics from stored rows (shared by every backend)."""
    chains: dict[str, list[PacingRow]] = defaultdict(list)
    lags: list[int] = []
    generated = wasted = 0
    trained_lengths: list[int] = []
    for r in rows:
        chains[r.chain if r.chain is not None else f"\0{r.rollout_id}"].append(r)
        if r.state == "consumed":
            if r.lag is not None:
                lags.append(r.lag)
            if r.tokens is not None:
                trained_lengths.append(r.tokens)
        if r.tokens is not None:
            generated += r.tokens
            if r.state not in _LIVE and r.state != "consumed":
                wasted += r.tokens
    hist: Counter[int] = Counter()
    prompt_lengths: list[int] = []
    chains_trained = chains_live = 0
    for attempts in chains.values():
        hist[max(max(r.attempt for r in attempts), 1)] += 1
        chains_trained += any(r.state == "consumed" for r in attempts)
        chains_live += any(r.state in _LIVE for r in attempts)
        known = [r for r in attempts if r.tokens is not None]
        if known:
            prompt_lengths.append(max(known, key=lambda r: r.attempt).tokens or 0)
    return PacingStatistics(
        trained=len([r for a in chains.values() for r in a if r.state == "consumed"]),
        trained_lag_mean=(sum(lags) / len(lags)) if lags else None,
        trained_lag_max=max(lags) if lags else None,
        chains=len(chains),
        chains_trained=chains_trained,
        chains_live=chains_live,
        attempts_histogram=dict(sorted(hist.items())),
        max_attempts=max(hist) if hist else 0,
        generated_tokens=generated,
        wasted_tokens=wasted,
        wasted_fraction=(wasted / generated) if generated else 0.0,
        ks_length=ks_distance(prompt_lengths, trained_lengths),
    )


def pacing_metrics(stats: PacingStatistics, prefix: str = "pacing/") -> dict[str, float]:
    """The statistics as a verl-style flat metrics dict (what `logger.log(data=...)` takes);
    figures that do not exist yet (nothing trained) are left out rather than logged as 0."""
    out: dict[str, float] = {
        "trained": float(stats.trained),
        "chains": float(stats.chains),
        "chains_trained": float(stats.chains_trained),
        "chains_live": float(stats.chains_live),
        "attempts_max": float(stats.max_attempts),
        "generated_tokens": float(stats.generated_tokens),
        "wasted_tokens": float(stats.wasted_tokens),
        "wasted_fraction": stats.wasted_fraction,
    }
    if stats.trained_lag_mean is not None and stats.trained_lag_max is not None:
        out["staleness_mean"] = stats.trained_lag_mean
        out["staleness_max"] = float(stats.trained_lag_max)
    if stats.ks_length is not None:
        out["length_bias_ks"] = stats.ks_length
    for attempts, n in stats.attempts_histogram.items():
        out[f"attempts_hist/{attempts}"] = float(n)
    return {prefix + k: v for k, v in out.items() if math.isfinite(v)}


def rows_from_columns(
    items: Iterable[tuple[Any, Any, Any, Any, Any, Any, Any]],
) -> list[PacingRow]:
    """Pacing rows from a durable store's query: (rollout_id, state, behavior_version,
    chain, attempt, tokens, admission's current_version), the last four read out of the
    entry's JSON by the database (NULL where absent)."""
    out = []
    for rid, state, version, chain, attempt, tokens, current in items:
        out.append(
            PacingRow(
                str(rid),
                str(state),
                None if chain is None else str(chain),
                0 if attempt is None else int(attempt),
                None if tokens is None else int(tokens),
                None if current is None else int(current) - int(version),
            )
        )
    return out
