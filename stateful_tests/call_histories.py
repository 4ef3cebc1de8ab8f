"""Call histories for the linearizability checker's own checks (issue 33).

Hand-written histories in the recorder's format (stateful_tests/history.py): each is a
small deployment set up the way the race sets one up (a worker set, a policy, v0 active),
then a few processes whose calls overlap in time. The known-bad ones answer something no
instant of their call makes true (the issue's stale-row refusal, a double reservation, a
lost commit, a retry answered differently, a batch half applied, a pointer that goes
back, a settle that activates before the ack or fails what was not awaiting acks); each
has a known-good twin that differs in the one answer. `generated_history` records a
seeded sequential workload on the memory backend through the recorders: the code's own
answers, which the model must explain call by call.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.errors import RolloutLifecycleError
from rollout_lifecycle.model.ledger import ManualClock, ReserveRequest
from rollout_lifecycle.model.records import (
    AdmissionPolicy,
    AdmissionStamp,
    LedgerEntry,
    Reward,
    WorkerAck,
    to_jsonable,
)
from rollout_lifecycle.stateful_tests.history import (
    CallLog,
    RecordingLedger,
    RecordingRegistry,
    attach,
    history_header,
    operator_sets_policy,
)

Line = dict[str, Any]
POLICY = {"max_lag": 1, "max_drift": 0.2, "batch_size": None, "max_attempts": None}


def h(v: int) -> str:
    """The artifact hash of version v in these histories."""
    return f"{v:x}".rjust(64, "b")


def stamp(behavior: int, current: int, max_lag: int = 1) -> dict[str, Any]:
    """An honest accepted stamp, as a history records it."""
    return to_jsonable(  # type: ignore[no-any-return]
        AdmissionStamp(
            current_version=current,
            behavior_version=behavior,
            max_lag=max_lag,
            max_drift=0.2,
            drift=0.01,
            freshness="fresh" if current == behavior else "tolerated",
            reason="ok",
            accepted=True,
        )
    )


def row(rid: str, state: str, rev: int, v: int = 0, by: str | None = None) -> dict[str, Any]:
    """An entry as a history records it."""
    return {"id": rid, "state": state, "rev": rev, "by": by, "v": v}


class Script:
    """Builds a history line by line; times are given by the caller (seconds)."""

    def __init__(self) -> None:
        self.lines: list[Line] = [history_header()]
        self.seq: Counter[str] = Counter()

    def call(
        self,
        proc: str,
        op: str,
        args: dict[str, Any],
        inv: float,
        ret: float,
        result: Any = None,
        error: str | None = None,
    ) -> Script:
        line: Line = {"proc": proc, "seq": self.seq[proc], "op": op, "args": args}
        line.update(inv=inv, ret=ret)
        if error is None:
            line["result"] = result
        else:
            line["error"] = {"type": error, "types": [error], "message": ""}
        self.seq[proc] += 1
        self.lines.append(line)
        return self

    def activate(
        self,
        v: int,
        at: float,
        proc: str = "activator",
        previous: int | None = None,
        until: float | None = None,
    ) -> Script:
        """Publish v through the whole protocol, one worker 'w0', calls 1 ms each from `at`
        (the activation's own call returning at `until`, when given)."""
        t = at
        art = {"v": v, "hash": None, "attempts": 0}

        def nxt() -> tuple[float, float]:
            nonlocal t
            t += 0.001
            return t - 0.001, t - 0.0005

        self.call(
            proc,
            "prepare",
            {"v": v, "parent": None, "rollback": "current", "trained_by": []},
            *nxt(),
            {**art, "state": "prepared"},
        )
        self.call(
            proc,
            "commit_artifact",
            {"v": v, "hash": h(v)},
            *nxt(),
            {**art, "state": "committed", "hash": h(v)},
        )
        self.call(
            proc,
            "distribute",
            {"v": v},
            *nxt(),
            {**art, "state": "awaiting_acks", "hash": h(v), "attempts": 1},
        )
        self.call(proc, "attempt_tokens", {"v": v}, *nxt(), {"w0": f"tok{v}"})
        ack = {
            "worker": "w0",
            "v": v,
            "hash": h(v),
            "token": f"tok{v}",
            "incarnation": 0,
            "seq": None,
        }
        self.call(
            proc,
            "record_ack",
            ack,
            *nxt(),
            {"counted": True, "reason": "counted", "recorded": True},
        )
        inv, ret = nxt()
        if until is not None:
            ret, t = until, until + 0.001
        self.call(
            proc,
            "try_activate",
            {"v": v},
            inv,
            ret,
            {
                "activated": True,
                "reason": "activated",
                "pointer": [v, h(v)],
                "missing": [],
                "mismatched": [],
            },
        )
        return self.call(proc, "clear_bad_version", {"v": v}, *nxt(), None)

    def setup(self, rollouts: Sequence[str] = ("r",)) -> Script:
        """The deployment (worker 'w0', max_lag 1, v0 active) and rewarded v0 rollouts."""
        # the operator records the policy; the coordinator attaches expecting it
        self.call("setup", "set_policy", {"policy": POLICY}, 0.0, 0.0002, POLICY)
        self.call("setup", "attach", {"workers": ["w0"], "policy": POLICY}, 0.0003, 0.0005, None)
        self.activate(0, 0.001, proc="setup")
        docs = [{"id": r, "state": "rewarded", "v": 0, "hash": h(0)} for r in rollouts]
        return self.call(
            "setup",
            "add_many",
            {"entries": docs},
            0.02,
            0.021,
            [row(r, "rewarded", 0) for r in rollouts],
        )

    def reserve(
        self,
        proc: str,
        rid: str,
        rev: int,
        update: str,
        inv: float,
        ret: float,
        reason: str,
        entry: dict[str, Any] | None,
        current: int = 0,
    ) -> Script:
        args = {"id": rid, "rev": rev, "update": update, "stamp": stamp(0, current)}
        reserved = reason in ("reserved", "idempotent_retry")
        return self.call(
            proc,
            "reserve",
            args,
            inv,
            ret,
            {"id": rid, "reserved": reserved, "reason": reason, "entry": entry},
        )


def policy_and_activation_at_once(policy_returns: float = 2.0) -> list[Line]:
    """Two processes at once: the operator tightens the policy (max_lag 1 -> 0) while an
    activator publishes v1, and a learner reserves the v0 row with a stamp made at v1.
    'reserved' is true only after the activation and before the policy change. With their
    windows overlapping that order is one of two the registry allows (the two changes
    commute there, and the registry's own search may pick the other): ok. When the policy
    change returned before the activation began, no instant makes it true."""
    s = Script().setup()
    tight = {**POLICY, "max_lag": 0}
    s.call("operator", "set_policy", {"policy": tight}, 0.9, policy_returns, tight)
    s.activate(1, 1.0, until=2.0)
    reserved = row("r", "reserved", 1, by="u1")
    return s.reserve("learner", "r", 0, "u1", 1.2, 1.3, "reserved", reserved, current=1).lines


def sweep_after_a_rollback(state: str = "quarantined") -> list[Line]:
    """v1 is activated, a v1 rollout lands, the operator rolls back to v0 (a coordinator
    without the ledger: nothing is quarantined by the rollback), then a dispatcher's
    retire_stale sweeps: the open rollouts of a rolled-back version are quarantined there
    (issue 31's item 6), never retired as stale (v1 is above the pointer, not below the
    window)."""
    s = Script().setup()
    s.activate(1, 1.0)
    doc = {"id": "r1", "state": "rewarded", "v": 1, "hash": h(1)}
    s.call("gen", "add_many", {"entries": [doc]}, 1.1, 1.11, [row("r1", "rewarded", 0, v=1)])
    s.call("operator", "rollback", {"keep": False}, 1.2, 1.21, [0, h(0)])
    return s.call("sweeper", "retire_stale", {}, 1.3, 1.31, [row("r1", state, 1, v=1)]).lines


def stale_row_refusal(answer: str = "pointer_moved") -> list[Line]:
    """Issue 33: during one reservation the pointer moves v0 -> v1, another update reserves
    and aborts the rollout (revision 0 -> 2), the pointer moves to v2. 'pointer_moved' on
    the row of revision 0 is untrue at every instant; 'revision_conflict' is the answer."""
    s = Script().setup()
    rev = 0 if answer == "pointer_moved" else 2
    s.reserve("learner", "r", 0, "u1", 1.0, 2.0, answer, row("r", "rewarded", rev))
    s.activate(1, 1.1)
    s.reserve(
        "other", "r", 0, "u2", 1.2, 1.21, "reserved", row("r", "reserved", 1, by="u2"), current=1
    )
    s.call("other", "abort", {"update": "u2"}, 1.3, 1.31, [row("r", "rewarded", 2)])
    s.activate(2, 1.4)
    return s.lines


def refusal_reason(answer: str = "pointer_moved") -> list[Line]:
    """A reservation of a row that moved on (revision 0 -> 2) while the pointer stayed
    where the stamp was admitted: its answer, with the row as it is, is a conflict; any
    other refusal (the same row, another reason) is untrue."""
    s = Script().setup()
    s.reserve("other", "r", 0, "u2", 1.0, 1.1, "reserved", row("r", "reserved", 1, by="u2"))
    s.call("other", "abort", {"update": "u2"}, 1.2, 1.3, [row("r", "rewarded", 2)])
    return s.reserve("learner", "r", 0, "u1", 1.4, 1.5, answer, row("r", "rewarded", 2)).lines


def double_reserve(second: str = "reserved") -> list[Line]:
    """Two updates both told 'reserved' for the same revision of one rollout."""
    s = Script().setup()
    s.reserve("a", "r", 0, "u1", 1.0, 1.5, "reserved", row("r", "reserved", 1, by="u1"))
    entry = (
        row("r", "reserved", 1, by="u2")
        if second == "reserved"
        else row("r", "reserved", 1, by="u1")
    )
    return s.reserve("b", "r", 0, "u2", 1.1, 1.6, second, entry).lines


def lost_commit(seen: str = "reserved") -> list[Line]:
    """A commit that answered success, and a read after it that still sees the rollout
    reserved (the commit was lost)."""
    s = Script().setup()
    s.reserve("a", "r", 0, "u1", 1.0, 1.1, "reserved", row("r", "reserved", 1, by="u1"))
    s.call("a", "commit", {"update": "u1", "ids": ["r"]}, 1.2, 1.3, [row("r", "consumed", 2)])
    got = row("r", "reserved", 1, by="u1") if seen == "reserved" else row("r", "consumed", 2)
    return s.call("b", "get", {"id": "r"}, 1.4, 1.5, got).lines


def retry_answered_differently(answer: str = "revision_conflict") -> list[Line]:
    """The owner's retry of its own reservation must be an idempotent retry."""
    s = Script().setup()
    s.reserve("a", "r", 0, "u1", 1.0, 1.1, "reserved", row("r", "reserved", 1, by="u1"))
    reserved = row("r", "reserved", 1, by="u1")
    return s.reserve("a", "r", 0, "u1", 1.2, 1.3, answer, reserved).lines


def batch_half_applied(second: str = "rewarded") -> list[Line]:
    """A batch that reserved two rollouts; a read of the first (after) sees it reserved,
    then a read of the second sees it still waiting: no one instant holds both halves."""
    s = Script().setup(["r1", "r2"])
    reqs = [{"id": r, "rev": 0, "stamp": stamp(0, 0)} for r in ("r1", "r2")]
    outs = [
        {"id": r, "reserved": True, "reason": "reserved", "entry": row(r, "reserved", 1, by="u1")}
        for r in ("r1", "r2")
    ]
    s.call("a", "reserve_batch", {"update": "u1", "requests": reqs}, 1.0, 2.0, outs)
    s.call("b", "get", {"id": "r1"}, 1.2, 1.3, row("r1", "reserved", 1, by="u1"))
    got = row("r2", "rewarded", 0) if second == "rewarded" else row("r2", "reserved", 1, by="u1")
    return s.call("b", "get", {"id": "r2"}, 1.4, 1.5, got).lines


def pointer_goes_back(second: int = 0) -> list[Line]:
    """A read of the pointer after v1 activated, then a later read that sees v0 again."""
    s = Script().setup()
    s.activate(1, 1.0)
    s.call("reader", "pointer", {}, 1.1, 1.2, [1, h(1)])
    return s.call("reader", "pointer", {}, 1.3, 1.4, [second, h(second)]).lines


def _awaiting(s: Script, v: int, at: float) -> Script:
    """v prepared, committed and distributed by the activator, its token issued to w0."""
    art = {"v": v, "hash": h(v)}
    s.call(
        "activator",
        "prepare",
        {"v": v, "parent": None, "rollback": "current", "trained_by": []},
        at,
        at + 0.001,
        {**art, "hash": None, "attempts": 0, "state": "prepared"},
    )
    s.call(
        "activator",
        "commit_artifact",
        {"v": v, "hash": h(v)},
        at + 0.002,
        at + 0.003,
        {**art, "attempts": 0, "state": "committed"},
    )
    s.call(
        "activator",
        "distribute",
        {"v": v},
        at + 0.004,
        at + 0.005,
        {**art, "attempts": 1, "state": "awaiting_acks"},
    )
    return s.call(
        "activator", "attempt_tokens", {"v": v}, at + 0.006, at + 0.007, {"w0": f"tok{v}"}
    )


def settle_before_the_ack(early: bool = True) -> list[Line]:
    """Issue 31 item 8: the next coordinator action settles an attempt its activator left
    awaiting acks. v1 is distributed; a settle, w0's ack, a settle. With `early`, the first
    settle says it activated v1, before any ack of it was counted (untrue at every instant
    of that call); the twin's first settle resolves nothing and the second activates."""
    s = Script().setup()
    _awaiting(s, 1, 1.0)
    none: dict[str, Any] = {"activated": [], "failed": []}
    done = {"activated": [[1, h(1)]], "failed": []}
    s.call("other", "settle", {}, 1.1, 1.2, done if early else none)
    ack = {"worker": "w0", "v": 1, "hash": h(1), "token": "tok1", "incarnation": 0, "seq": None}
    s.call(
        "worker",
        "record_ack",
        ack,
        1.3,
        1.4,
        {"counted": True, "reason": "counted", "recorded": True},
    )
    s.call("other", "settle", {}, 1.5, 1.6, none if early else done)
    return s.call("reader", "pointer", {}, 1.7, 1.8, [1, h(1)]).lines


def settle_fails_what_was_not_awaiting(version: int = 0) -> list[Line]:
    """A settle that says it failed a version at its ack deadline: only an attempt still
    awaiting acks can fail (v1 here); failing the active v0 is untrue."""
    s = Script().setup()
    _awaiting(s, 1, 1.0)
    s.call("other", "settle", {}, 1.1, 1.2, {"activated": [], "failed": [version]})
    return s.call("reader", "pointer", {}, 1.3, 1.4, [0, h(0)]).lines


def concurrent_reads(n: int) -> list[Line]:
    """`n` overlapping reserve calls on one rollout, every answer a conflict: a search
    whose every order is valid (for the time limit's 'unknown')."""
    s = Script().setup()
    for i in range(n):
        s.reserve(
            f"p{i}",
            "r",
            5,
            f"u{i}",
            1.0 + i * 1e-4,
            3.0,
            "revision_conflict",
            row("r", "rewarded", 0),
        )
    return s.lines


# ---- a generated sequential workload through the real code -----------------------------------


def generated_history(seed: int, steps: int = 120) -> list[Line]:
    """A seeded sequential workload on the memory backend, every call recorded: the code's
    own answers (activations, settles of attempts left awaiting acks, rollbacks, policy
    changes, reservations with honest and bad
    stamps, retries, batches, commits, aborts, renewals, lease expiry, dispatch on chains,
    retire_stale), which the model must explain."""
    rng = random.Random(seed)
    clock = ManualClock(1000.0)
    log = CallLog("gen")
    with open_backend("memory://", clock=clock, lease_seconds=30.0) as raw:
        ledger = RecordingLedger(raw.ledger, log)
        registry = RecordingRegistry(raw.registry, log)
        policy = AdmissionPolicy(1, 0.2, 4, 2)
        operator_sets_policy(log, raw.registry, policy, "the operator's")
        coord = attach(log, raw.registry, ["w0", "w1"], ledger=ledger, policy=policy)
        n, version, updates = 0, 0, 0
        held: dict[str, list[str]] = {}

        def acks(v: int) -> None:
            tokens = coord.attempt_tokens(v)
            for w, tok in tokens.items():
                k = rng.random()
                if k < 0.05:
                    continue  # a worker that never answers
                if k < 0.1:
                    tok = "not-the-token"
                elif k < 0.13 and len(tokens) > 1:
                    tok = tokens[next(x for x in tokens if x != w)]  # another worker's
                coord.record_ack(WorkerAck(w, v, h(v), token=None if rng.random() < 0.03 else tok))
            if rng.random() < 0.05:
                coord.record_ack(WorkerAck("outsider", v, h(v)))  # not a required worker

        def publish(v: int) -> None:
            coord.prepare(v)
            coord.commit_artifact(v, h(v))
            coord.distribute(v)
            acks(v)
            if rng.random() < 0.15:
                return  # left awaiting acks (its activator died): the next action settles it
            for _ in range(3):
                if coord.try_activate(v).activated:
                    return
                coord.fail_distribution(v, "gen: a worker failed")
                if rng.random() < 0.3:
                    coord.abandon(v, "gen: given up")
                    return
                coord.retry(v)
                acks(v)
            coord.fail_distribution(v, "gen: a worker failed")
            coord.abandon(v, "gen: given up")

        publish(0)
        for _ in range(steps):
            pointer = registry.pointer()
            current = 0 if pointer is None else pointer.version
            k = rng.random()
            try:
                if k < 0.12:
                    version = max(version, current) + 1
                    publish(version)
                elif k < 0.15:
                    coord.rollback(keep_rollouts=rng.random() < 0.3)
                elif k < 0.17:
                    coord.set_policy(AdmissionPolicy(rng.choice((0, 1)), 0.2, 4, 2), "gen")
                elif k < 0.18:
                    ws = rng.choice((["w0"], ["w0", "w1"], ["w1", "w0"]))
                    coord.change_membership(ws, "gen")
                elif k < 0.35:
                    # mostly served versions; some never active (a failed or future one)
                    v = max(0, current - rng.choice((0, 0, 1, 2)))
                    if rng.random() < 0.1:
                        v = version + rng.choice((0, 1))
                    docs = [
                        LedgerEntry(
                            rollout_id=f"r{n + i}",
                            behavior_version=v,
                            artifact_hash=h(v),
                            state="rewarded",
                            reward=Reward("rm", "1", 1.0),
                        )
                        for i in range(rng.randint(1, 3))
                    ]
                    n += len(docs)
                    ledger.add_many(docs)
                elif k < 0.6:
                    _reserve_some(rng, ledger, held, n, current, updates)
                    updates += 1
                elif k < 0.72 and held:
                    upd = rng.choice(sorted(held))
                    ids = held.pop(upd)
                    if rng.random() < 0.15:
                        ids = ids[:-1]  # a commit that does not list what it holds
                    ledger.commit(upd, ids)
                elif k < 0.78 and held:
                    upd = rng.choice(sorted(held))
                    del held[upd]
                    ledger.abort(upd)
                elif k < 0.82 and held:
                    ledger.renew_leases(rng.choice(sorted(held)))
                elif k < 0.86:
                    clock.advance(rng.choice((1.0, 20.0, 40.0)))
                    ledger.expire_leases()
                elif k < 0.93:
                    chain = f"c{rng.randrange(4)}"
                    rid = f"d{n}"
                    n += 1
                    v = max(0, current - rng.choice((0, 1, 2)))
                    entry = LedgerEntry(rollout_id=rid, behavior_version=v, artifact_hash=h(v))
                    got = ledger.dispatch(entry, chain=chain)
                    if got.dispatched and rng.random() < 0.7:
                        e = ledger.get(rid)
                        if rng.random() < 0.7:
                            e = ledger.transition(rid, "generation_done", e.revision)
                            ledger.transition(
                                rid, "reward_ready", e.revision, reward=Reward("rm", "1", 1.0)
                            )
                        else:
                            ledger.transition(rid, "generation_failed", e.revision)
                elif k < 0.95:
                    ledger.retire_stale()
                elif k < 0.97 and n:
                    rid = f"r{rng.randrange(n)}"
                    found = ledger.find(rid)
                    if found is not None:
                        event = rng.choice(("quarantine", "retire_stale", "reward_ready"))
                        ledger.transition(rid, event, found.revision + rng.choice((0, 0, 1)))
                else:
                    ledger.oldest_admissible(3)
                    ledger.get(f"r{rng.randrange(max(n, 1))}")
            except RolloutLifecycleError:
                pass  # refused: recorded with its error type, the model judges it too
    return [history_header(max_releases=3), *log.calls]


def _reserve_some(
    rng: random.Random, ledger: Any, held: dict[str, list[str]], n: int, current: int, k: int
) -> None:
    """A reservation of a few rollouts: honest stamps, stale ones, a wrong revision, a
    retry of the update's own."""
    if n == 0:
        return
    update = f"u{k}"
    ids = sorted({f"{rng.choice('rrd')}{rng.randrange(n)}" for _ in range(rng.randint(1, 3))})
    requests = []
    for rid in ids:
        e = ledger.find(rid)
        if e is None:
            continue
        v = e.behavior_version
        # admitted against the pointer now, or against an older one (it moved since)
        seen = current if rng.random() < 0.8 else max(v, current - rng.choice((1, 2)))
        lag = max(0, seen - v)
        st = AdmissionStamp(
            current_version=max(seen, v) if rng.random() < 0.9 else v,
            behavior_version=v,
            max_lag=1,
            max_drift=0.2,
            drift=0.01,
            freshness="fresh" if lag == 0 else "tolerated",
            reason="ok",
            accepted=lag <= 1,
        )
        if not st.accepted:
            st = AdmissionStamp(max(seen, v), v, 1, 0.2, 0.01, "stale", "stale_policy", False)
        rev = e.revision if rng.random() < 0.9 else e.revision + 1
        requests.append(ReserveRequest(rid, rev, st))
    if not requests:
        return
    if rng.random() < 0.4:
        outs = [
            ledger.reserve(r.rollout_id, r.expected_revision, update, r.admission) for r in requests
        ]
    else:
        outs = ledger.reserve_batch(update, requests)
    won = [o.rollout_id for o in outs if o.reserved]
    if won:
        held[update] = won
        if rng.random() < 0.3:
            ledger.reserve_batch(update, [r for r in requests if r.rollout_id in won])


def many_reads_one_impossible(n: int) -> list[Line]:
    """`n` overlapping reads of one rollout, each valid in any order, and one that sees a
    revision the rollout never had and returns before them: the search must try every
    subset of the reads before it can say no (a time limit makes that 'unknown')."""
    s = Script().setup()
    for i in range(n):
        s.call(f"p{i}", "get", {"id": "r"}, 1.0 + i * 1e-4, 3.0, row("r", "rewarded", 0))
    return s.call("late", "get", {"id": "r"}, 1.5, 2.0, row("r", "rewarded", 99)).lines


_SWAPPABLE = (
    "reserved",
    "idempotent_retry",
    "revision_conflict",
    "not_rewarded",
    "version_not_active",
    "looser_than_policy",
    "pointer_moved",
    "missing_rollout",
)


def corrupted(lines: Sequence[Line], rng: random.Random) -> list[Line] | None:
    """A sequential history with one answer changed to another the code could give: a
    reservation's reason, a pointer read's version, a read's revision. Calls of a
    sequential history do not overlap, so each answer is the only true one; None when
    the history has no answer to change."""
    out = [dict(line) for line in lines]
    spots: list[tuple[int, int | None]] = []
    for i, line in enumerate(out):
        if "result" not in line or line.get("result") is None:
            continue
        op = line["op"]
        if op == "reserve" and line["result"]["reason"] in _SWAPPABLE:
            spots.append((i, None))
        elif op == "reserve_batch":
            spots.extend((i, j) for j, o in enumerate(line["result"]) if o["reason"] in _SWAPPABLE)
        elif op in ("pointer", "get"):
            spots.append((i, None))
    if not spots:
        return None
    i, j = spots[rng.randrange(len(spots))]
    line = out[i]
    if line["op"] == "pointer":
        v, _hh = line["result"]
        line["result"] = [v + 1, h(v + 1)]
    elif line["op"] == "get":
        line["result"] = {**line["result"], "rev": line["result"]["rev"] + 1}
    else:
        outs = [line["result"]] if j is None else list(line["result"])
        k = 0 if j is None else j
        old = outs[k]["reason"]
        new = rng.choice([r for r in _SWAPPABLE if r != old])
        outs[k] = {**outs[k], "reason": new, "reserved": new in ("reserved", "idempotent_retry")}
        line["result"] = outs[0] if j is None else outs
    return out
