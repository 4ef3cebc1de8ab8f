"""Ledger conformance kit: run the protocol checks and the race machine on ANY ledger class.

A backend passes when every protocol-level check below holds and the ledger race machine
(a reference model, the spec's invariants on every atomic step, `check_reservation` on every
reserve call) finds nothing. The factory is ``factory(tmp_path, clock, **options)``, with
the options ``lease_seconds`` and ``recovery``; give it a
``reopen(ledger, tmp_path, clock, **options)`` method and the machine also closes and
reopens the ledger mid-run.

One command checks your own ledger class::

    ROLLOUT_LIFECYCLE_LEDGER=mypkg.ledgers:make_ledger pytest tests/test_conformance_kit.py

or, from Python, ``run_conformance(make_ledger).raise_on_failure()``.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from rollout_lifecycle.model.errors import (
    CommitMismatch,
    IllegalTransition,
    RevisionConflict,
    RolloutLifecycleError,
    UpdatePoisoned,
)
from rollout_lifecycle.model.ledger import Ledger, ManualClock, RecoveryRule, ReserveRequest
from rollout_lifecycle.model.records import LedgerEntry
from rollout_lifecycle.spec.invariants import check_trace
from rollout_lifecycle.stateful_tests.backends import LedgerFactory, resolve_factory
from rollout_lifecycle.stateful_tests.builders import REWARD, artifact_hash, fresh_stamp
from rollout_lifecycle.stateful_tests.runner import CampaignReport, run_campaign

LEASE = 10.0
ENV_VAR = "ROLLOUT_LIFECYCLE_LEDGER"

Check = Callable[[Ledger, ManualClock], list[str]]


class ConformanceFailure(AssertionError):
    """A ledger backend broke the protocol; the message lists every problem found."""


@attrs.define
class ConformanceReport:
    """Protocol-check problems (by check name) and the race machine's campaign report."""

    backend: str
    problems: dict[str, list[str]]
    campaign: CampaignReport

    @property
    def ok(self) -> bool:
        """True when no check found a problem and the machine found no violation."""
        return not any(self.problems.values()) and self.campaign.violations == 0

    def summary(self) -> str:
        """A readable account of everything that failed (empty when ok)."""
        lines = [f"{name}: {p}" for name, ps in self.problems.items() for p in ps]
        f = self.campaign.failure
        if f is not None:
            lines.append(f"race machine: {f.exception.splitlines()[0]}")
            # the program itself: a saved file may be in a folder its caller removes
            lines.append(f"shrunk program ({f.program_steps} steps), saved as {f.program_path}:")
            lines += [f"    {line}" for line in f.program.splitlines()]
        return "\n".join(lines)

    def raise_on_failure(self) -> None:
        """Raise ConformanceFailure with the summary when the backend does not conform."""
        if not self.ok:
            raise ConformanceFailure(f"{self.backend} does not conform:\n{self.summary()}")


def _entry(rollout_id: str, state: str = "rewarded", version: int = 0) -> LedgerEntry:
    return LedgerEntry(
        rollout_id=rollout_id,
        behavior_version=version,
        artifact_hash=artifact_hash(version),
        state=state,
        reward=REWARD if state == "rewarded" else None,
    )


STAMP = fresh_stamp(0, 1, 0.2)


def _unchanged(led: Ledger, rid: str, before: LedgerEntry | None, what: str) -> list[str]:
    after = led.find(rid)
    return [] if after == before else [f"{what} changed {rid}: {before} -> {after}"]


# ---- protocol-level checks: each gets a fresh ledger and returns its problems ---------------


def check_protocol_shape(led: Ledger, _clock: ManualClock) -> list[str]:
    """Every method of the Ledger protocol is there."""
    if isinstance(led, Ledger):
        return []
    missing = [m for m in dir(Ledger) if not m.startswith("_") and not hasattr(led, m)]
    return [f"not a Ledger: missing {missing}"]


def check_add_and_read(led: Ledger, _clock: ManualClock) -> list[str]:
    """add stores revision 0; get/find read it; unknown ids and duplicate adds are refused."""
    out = []
    got = led.add(_entry("a", "dispatched"))
    if (got.state, got.revision) != ("dispatched", 0):
        out.append(f"add returned {got}")
    if led.get("a") != got or led.find("a") != got:
        out.append("get/find disagree with what add returned")
    if led.find("nope") is not None:
        out.append("find of an unknown id is not None")
    try:
        led.get("nope")
        out.append("get of an unknown id did not raise")
    except KeyError:
        pass
    try:
        led.add(_entry("a", "dispatched"))
        out.append("a duplicate add was accepted")
    except RolloutLifecycleError:
        pass
    out += _unchanged(led, "a", got, "a refused duplicate add")
    return out


def check_transition_cas(led: Ledger, _clock: ManualClock) -> list[str]:
    """A stale revision or an illegal event is refused and changes nothing."""
    out = []
    e = led.add(_entry("t", "generated"))
    try:
        led.transition("t", "reward_ready", e.revision + 1, reward=REWARD)
        out.append("transition on a stale revision succeeded")
    except RevisionConflict:
        pass
    try:
        led.transition("t", "generation_done", e.revision)
        out.append("an undeclared edge generated --generation_done--> was accepted")
    except IllegalTransition:
        pass
    out += _unchanged(led, "t", e, "refused transitions")
    new = led.transition("t", "reward_ready", e.revision, reward=REWARD)
    if (new.state, new.revision, new.reward) != ("rewarded", 1, REWARD):
        out.append(f"reward_ready wrote {new}")
    timed = led.add(_entry("u", "generated"))
    t2 = led.transition("u", "reward_timeout", timed.revision)
    if t2.state != "reward_timed_out" or t2.reward is not None or t2.disposition is None:
        out.append(f"a reward timeout was recorded as {t2}")
    return out


def check_reserve_outcomes(led: Ledger, _clock: ManualClock) -> list[str]:
    """Missing, conflict (before state), not rewarded, not admitted, success, idempotent."""
    out = []
    e = led.add(_entry("r"))
    led.add(_entry("d", "dispatched"))
    cases = [
        ("nope", 0, "L.1", STAMP, "missing_rollout"),
        ("r", 5, "L.1", STAMP, "revision_conflict"),
        ("d", 0, "L.1", STAMP, "not_rewarded"),
        ("r", 0, "L.1", None, "not_admitted"),
    ]
    for rid, rev, upd, stamp, want in cases:
        before = led.find(rid)
        got = led.reserve(rid, rev, upd, stamp)
        if got.reserved or got.reason != want:
            out.append(
                f"reserve({rid}, rev {rev}) gave ({got.reserved}, {got.reason}); want {want}"
            )
        out += _unchanged(led, rid, before, f"refused reserve ({want})")
    won = led.reserve("r", e.revision, "L.1", STAMP)
    after = led.get("r")
    if not won.reserved or won.reason != "reserved":
        out.append(f"a valid reserve gave ({won.reserved}, {won.reason})")
    if (after.state, after.revision, after.reserved_by) != ("reserved", 1, "L.1"):
        out.append(f"a reservation wrote {after}")
    n_events = len(led.history())
    again = led.reserve("r", 0, "L.1", STAMP)
    if not again.reserved or again.reason != "idempotent_retry":
        out.append(f"the owner's retry gave ({again.reserved}, {again.reason})")
    if led.get("r") != after or len(led.history()) != n_events:
        out.append("the owner's idempotent retry wrote something")
    lost = led.reserve("r", 0, "L.2", STAMP)
    if lost.reserved or lost.reason != "revision_conflict":
        out.append(f"a second learner's stale CAS gave ({lost.reserved}, {lost.reason})")
    return out


def check_batch_is_atomic_per_item(led: Ledger, _clock: ManualClock) -> list[str]:
    """Each batch item wins or loses on its own CAS; the winners are one atomic step."""
    out = []
    a, b = led.add(_entry("ba")), led.add(_entry("bb"))
    got = led.reserve_batch(
        "L.1",
        [ReserveRequest("ba", a.revision, STAMP), ReserveRequest("bb", b.revision + 3, STAMP)],
    )
    reasons = [(o.rollout_id, o.reason) for o in got]
    if reasons != [("ba", "reserved"), ("bb", "revision_conflict")]:
        out.append(f"batch outcomes {reasons}")
    if led.get("bb") != b:
        out.append("a losing batch item changed its record")
    evs = [ev for ev in led.history() if ev.event == "reserve"]
    if len(evs) != 1:
        out.append(f"a batch with one winner wrote {len(evs)} reserve events")
    return out


def check_commit_exactness(led: Ledger, _clock: ManualClock) -> list[str]:
    """A commit of anything but exactly what the update holds is refused, atomically, and
    poisons the update (issue 31): its exact commit is refused as well (UpdatePoisoned),
    its abort returns what it holds, and another update then commits them."""
    out = []
    for rid in ("c1", "c2"):
        e = led.add(_entry(rid))
        led.reserve(rid, e.revision, "L.1", STAMP)
    before = led.snapshot()
    for wrong in (["c1"], ["c1", "c2", "c3"], ["c1", "c1", "c2"]):
        try:
            led.commit("L.1", wrong)
            out.append(f"commit of {wrong} for holdings [c1, c2] succeeded")
        except CommitMismatch:
            pass
    if led.snapshot() != before:
        out.append("a refused commit changed records")
    record = led.update("L.1")
    if record is None or record.status != "poisoned":
        out.append(f"a refused commit left its update recorded as {record}")
    try:
        led.commit("L.1", ["c2", "c1"])
        out.append("a poisoned update's exact commit landed")
    except UpdatePoisoned:
        pass
    if led.snapshot() != before:
        out.append("a poisoned update's refused commit changed records")
    led.abort("L.1")
    for rid in ("c1", "c2"):
        led.reserve(rid, led.get(rid).revision, "L.2", STAMP)
    done = led.commit("L.2", ["c2", "c1"])
    if sorted(e.rollout_id for e in done) != ["c1", "c2"] or any(
        e.state != "consumed" or e.reserved_by is not None for e in done
    ):
        out.append(f"commit wrote {done}")
    return out


def check_recovery(led: Ledger, clock: ManualClock) -> list[str]:
    """Abort releases then quarantines a poison rollout; leases expire on the clock."""
    out = []
    e = led.add(_entry("x"))
    led.reserve("x", e.revision, "L.1", STAMP)
    (first,) = led.abort("L.1")
    if (first.state, first.releases) != ("rewarded", 1):
        out.append(f"the first abort gave {first}")
    led.reserve("x", first.revision, "L.2", STAMP)
    (second,) = led.abort("L.2")
    if second.state != "quarantined" or second.disposition is None:
        out.append(f"with max_releases=1 the second return gave {second}")
    y = led.add(_entry("y"))
    led.reserve("y", y.revision, "L.3", STAMP)
    if led.expire_leases():
        out.append("a lease expired before its time")
    clock.advance(LEASE)
    expired = led.expire_leases()
    if [(x.rollout_id, x.state) for x in expired] != [("y", "rewarded")]:
        out.append(f"expiry after a whole lease returned {expired}")
    return out


def check_quarantine_version(led: Ledger, _clock: ManualClock) -> list[str]:
    """A bad version's open rollouts are quarantined now; its reserved ones on return."""
    out = []
    led.add(_entry("q1", "dispatched", version=3))
    r = led.add(_entry("q2", "rewarded", version=3))
    led.add(_entry("q3", "rewarded", version=4))
    led.reserve("q2", r.revision, "L.1", fresh_stamp(3, 1, 0.2))
    got = led.quarantine_version(3, "activation failed")
    if [e.rollout_id for e in got] != ["q1"]:
        out.append(f"quarantine_version(3) quarantined {[e.rollout_id for e in got]}")
    (back,) = led.abort("L.1")
    if back.state != "quarantined":
        out.append(f"a returned reservation of a bad version became {back.state}")
    if led.get("q3").state != "rewarded":
        out.append("quarantine_version(3) touched a v4 rollout")
    return out


def check_reads_are_copies(led: Ledger, _clock: ManualClock) -> list[str]:
    """snapshot() is a copy; history() is in order and passes the spec's trace check."""
    out = []
    e = led.add(_entry("s"))
    snap = led.snapshot()
    snap.pop("s")
    if led.find("s") is None:
        out.append("mutating a snapshot removed a rollout from the ledger")
    led.reserve("s", e.revision, "L.1", STAMP)
    led.commit("L.1", ["s"])
    hist = led.history()
    seqs = [ev.seq for ev in hist]
    if seqs != sorted(seqs) or len(set(seqs)) != len(seqs):
        out.append(f"history is not in strictly increasing seq order: {seqs}")
    if [ev.event for ev in led.history("s")] != ["add", "reserve", "commit"]:
        out.append(f"history('s') is {[ev.event for ev in led.history('s')]}")
    report = check_trace(hist)
    out += [f"trace: {v}" for v in report.violations]
    stats = led.statistics()
    if stats.entries != 1 or stats.by_state.get("consumed") != 1:
        out.append(f"statistics disagree with the records: {stats}")
    return out


def check_dispatch_chains(led: Ledger, _clock: ManualClock) -> list[str]:
    """dispatch numbers a chain's attempts, refuses a second live one or one after a
    trained one, and writes nothing when it refuses; retired stale rollouts keep a cause.
    (A ledger without a registry knows no pointer or policy: no budget applies.)"""
    out = []
    first = led.dispatch(_entry("d1", "dispatched"), chain="p")
    if not first.dispatched or first.entry is None or first.entry.attempt != 1:
        out.append(f"the first dispatch of a chain gave {first}")
    busy = led.dispatch(_entry("d2", "dispatched"), chain="p")
    if busy.dispatched or busy.reason != "chain_live" or led.find("d2") is not None:
        out.append(f"a second live attempt of a chain gave {busy}")
    led.transition("d1", "generation_failed", 0, tokens=4)
    again = led.dispatch(_entry("d2", "dispatched"), chain="p")
    if not again.dispatched or again.attempt != 2:
        out.append(f"the requeued chain's dispatch gave {again}")
    if led.get("d1").tokens != 4:
        out.append(f"generation_failed did not record its tokens: {led.get('d1')}")
    try:
        led.add(
            LedgerEntry(
                rollout_id="d3", behavior_version=0, artifact_hash="h", chain="p", attempt=3
            )
        )
        out.append("add accepted an entry carrying a chain (it would bypass dispatch)")
    except RolloutLifecycleError:
        pass
    return out


CHECKS: dict[str, Check] = {
    "protocol_shape": check_protocol_shape,
    "add_and_read": check_add_and_read,
    "transition_cas": check_transition_cas,
    "reserve_outcomes": check_reserve_outcomes,
    "batch_atomic_per_item": check_batch_is_atomic_per_item,
    "commit_exactness": check_commit_exactness,
    "recovery": check_recovery,
    "quarantine_version": check_quarantine_version,
    "reads_are_copies": check_reads_are_copies,
    "dispatch_chains": check_dispatch_chains,
}


def run_protocol_checks(factory: LedgerFactory, workdir: Path) -> dict[str, list[str]]:
    """Each check on a fresh ledger; an exception is a problem of that check, not a crash."""
    problems: dict[str, list[str]] = {}
    for name, check in CHECKS.items():
        tmp = Path(tempfile.mkdtemp(prefix=f"conformance-{name}-", dir=workdir))
        clock = ManualClock(0.0)
        led: Ledger | None = None
        try:
            led = factory(
                tmp,
                clock,
                lease_seconds=LEASE,
                recovery=RecoveryRule(max_releases=1),
            )
            problems[name] = check(led, clock)
        except Exception as exc:  # the backend broke the protocol: report, keep checking
            problems[name] = [f"raised {type(exc).__name__}: {exc}"]
        finally:
            if led is not None:
                with contextlib.suppress(Exception):
                    led.close()
            shutil.rmtree(tmp, ignore_errors=True)
    return problems


def run_conformance(
    factory: str | LedgerFactory,
    *,
    examples: int = 100,
    seed: int | None = 0,
    steps: int | None = None,
    workdir: Path | None = None,
    profile: str = "ci",
    **campaign: Any,
) -> ConformanceReport:
    """Protocol checks, then the ledger race machine, against one backend."""
    label, fn = resolve_factory(factory)
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix="conformance-")) if workdir is None else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    problems = run_protocol_checks(fn, work)
    report = run_campaign(
        ["ledger"],
        fn,
        examples=examples,
        seed=seed,
        steps=steps,
        profile=profile,
        workdir=work,
        **campaign,
    )
    result = ConformanceReport(label, problems, report)
    if own and result.ok:  # a failing run keeps its saved program for the user
        shutil.rmtree(work, ignore_errors=True)
    return result
