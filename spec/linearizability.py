"""A linearizability checker for recorded call histories (issue 33), as etcd's robustness
tests check theirs with Porcupine and Jepsen with Knossos.

A history is every call of every process, each with its invocation and return time on one
monotonic clock, its arguments and its outcome (docs/design.md, "A call history"). It is
linearizable when every call can be given one instant inside its own window such that the
calls, applied in the order of their instants to the sequential specification
(spec/call_model.py), give exactly the recorded outcomes.

How it stays cheap (P-compositionality, as Porcupine and Knossos partition by key):

- Each rollout is its own object (rollouts dispatched on one prompt chain form one object:
  a dispatch reads its chain), checked on its own with the calls that touch it.
- The registry (pointer, artifacts, acks, tokens, worker set, policy, bad versions) is one
  object. Its changes that rollouts read (an activation, a rollback, a policy, a bad
  version) are replayed inside every rollout partition whose calls overlap them in time,
  in the order the registry's own check found; the state before them is the registry's
  after every change that ended earlier.
- A call that spans rollouts (add_many, reserve_batch, commit, abort, renew_leases,
  expire_leases, retire_stale, reads of many rows) has one sub-call per partition, and
  must take effect at ONE instant for all of them: after every partition is linearized, a
  consistency pass gives each call one time inside its window that respects every
  partition's order (earliest-time propagation over the union of the orders; a cycle or a
  call pushed past its return is a conflict). A conflict is searched again jointly over
  the partitions involved; only if that search fails too is it a violation.

The search is Wing and Gong's, with Lowe's memoisation of (linearized set, state) and
Porcupine's linked list of call and return events. A partition that runs past its time
limit is reported "unknown", never "ok".

What a partition cannot see is left to the checks that can: the dispatch budget counts
rollouts of every chain (judged by `dispatch_paced` on the trace), a read that returns a
subset (oldest_admissible, a state query, expire_leases) is checked for what it returned,
and a refusal that names no rollout (a CommitMismatch or DuplicateRollout of a call over
several) for changing nothing; each is checked exactly where the call touches one
partition only.

Extending the model: a refusal of the reservation is one entry of
`call_model.RESERVE_ORDER`. A fact several partitions read (an update's poison, say)
becomes a registry-like change: give it a registry step (`call_model.REGISTRY_OPS`), a View
field and effect (`view_effect`, `changes_view`) and the partitions it reaches
(`_VIEW_OPS`), and the consistency pass keeps its instant one for all of them.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import attrs

from rollout_lifecycle.spec import call_model as cm
from rollout_lifecycle.spec.call_model import EMPTY_VIEW, Outcome, Row

SCHEMA = "rollout-lifecycle/call-history/1"
REGISTRY = "registry"
State = Any
Step = Callable[[State], State | None]

# calls on the registry object (coordinator steps and registry reads)
_REGISTRY_CALLS = frozenset(cm.REGISTRY_OPS) - {"quarantine_version", "clear_bad_version"}
# ledger calls that change what every rollout reads: checked on the registry object too
_VIEW_OPS = frozenset({"quarantine_version", "clear_bad_version"})
# ledger calls the model judges
_LEDGER_CALLS = frozenset(
    {
        "add",
        "add_many",
        "get",
        "find",
        "transition",
        "reserve",
        "reserve_batch",
        "commit",
        "abort",
        "fail_update",
        "renew_leases",
        "expire_leases",
        "reserved_by",
        "dispatch",
        "retire_stale",
        "oldest_admissible",
        "in_state",
    }
)


class Call(NamedTuple):
    """One recorded call (a line of the history)."""

    proc: str
    seq: int
    op: str
    args: Mapping[str, Any]
    inv: float
    ret: float
    out: Outcome

    def brief(self) -> str:
        """The call in one line, for a violation's message."""
        args = json.dumps(self.args, sort_keys=True, default=str)
        if len(args) > 160:
            args = args[:157] + "..."
        got = (
            f"raised {self.out.error.get('type')}"
            if self.out.error is not None
            else json.dumps(self.out.result, sort_keys=True, default=str)
        )
        if len(got) > 200:
            got = got[:197] + "..."
        return f"{self.proc}#{self.seq} {self.op}({args}) -> {got} [{self.inv:.6f}, {self.ret:.6f}]"


class HistoryError(ValueError):
    """A history line that does not follow the schema (docs/design.md)."""


def parse(lines: Iterable[str | Mapping[str, Any]]) -> tuple[dict[str, Any], list[Call]]:
    """(header, calls) of a history: JSON lines, or already decoded dicts."""
    header: dict[str, Any] = {}
    calls: list[Call] = []
    for n, line in enumerate(lines, 1):
        if isinstance(line, str):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as exc:
                raise HistoryError(f"line {n}: not JSON ({exc})") from None
        else:
            doc = line
        if not isinstance(doc, Mapping):
            raise HistoryError(f"line {n}: a history line is a JSON object")
        if "schema" in doc:
            if doc["schema"] != SCHEMA:
                raise HistoryError(f"line {n}: schema {doc['schema']!r}, this reads {SCHEMA}")
            header.update(doc)
            continue
        try:
            inv, ret = float(doc["inv"]), float(doc["ret"])
            out = Outcome(doc.get("result"), doc.get("error"))
            call = Call(
                str(doc["proc"]), int(doc["seq"]), str(doc["op"]), doc["args"], inv, ret, out
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise HistoryError(
                f"line {n}: {exc!r} (see docs/design.md, 'A call history')"
            ) from None
        if ret < inv:
            raise HistoryError(f"line {n}: returns at {ret} before its invocation at {inv}")
        calls.append(call)
    return header, calls


def read_history(path: str) -> tuple[dict[str, Any], list[Call]]:
    """Parse a history file."""
    with open(path, encoding="utf-8") as f:
        return parse(f)


# ---- the search ---------------------------------------------------------------------------


class Entry(NamedTuple):
    """A call as one search sees it: its window, its step, and its place among the
    registry changes replayed here, as (lane, rank in the lane) (None: not one)."""

    inv: float
    ret: float
    step: Step
    shared: tuple[int, int] | None


@attrs.frozen
class Searched:
    """What a search found: 'ok' with the order (entry indices), 'violation' with the
    entry it could not place, or 'unknown' (ran out of time)."""

    verdict: str
    order: tuple[int, ...] = ()
    stuck: int | None = None
    depth: int = 0
    steps: int = 0


def linearize(entries: Sequence[Entry], init: State, deadline: float) -> Searched:
    """Wing-Gong search with Lowe's memo, over Porcupine's list of call/return events.

    Calls are tried earliest-invoked first, so where an order is free every partition
    picks the same one; a replayed registry change is taken only in its registry order
    among the changes of its lane (`call_model.VIEW_LANES`): changes of different lanes
    commute in the registry, so their order is the partition's to find."""
    n = len(entries)
    if n == 0:
        return Searched("ok")
    evs = sorted(
        [(e.inv, 0, i) for i, e in enumerate(entries)]
        + [(e.ret, 1, i) for i, e in enumerate(entries)]
    )
    m = len(evs)
    head = m
    nxt = [*range(1, m), -1, 0]
    prv = [head, *range(0, m - 1), -1]
    is_call = [k == 0 for _, k, _ in evs]
    op_of = [i for _, _, i in evs]
    call_ev, ret_ev = [0] * n, [0] * n
    for j, (_, k, i) in enumerate(evs):
        if k == 0:
            call_ev[i] = j
        else:
            ret_ev[i] = j
    steps = [e.step for e in entries]
    shared = [e.shared for e in entries]

    def lift(i: int) -> None:
        for e in (call_ev[i], ret_ev[i]):
            p, q = prv[e], nxt[e]
            nxt[p] = q
            if q != -1:
                prv[q] = p

    def unlift(i: int) -> None:
        for e in (ret_ev[i], call_ev[i]):
            p, q = prv[e], nxt[e]
            nxt[p] = e
            if q != -1:
                prv[q] = e

    cache: set[tuple[int, int, State]] = set()
    stack: list[tuple[int, State, tuple[int, ...]]] = []
    state, lin = init, 0
    done = (0,) * (1 + max((s[0] for s in shared if s is not None), default=0))
    entry = nxt[head]
    best, stuck, count = -1, None, 0
    while nxt[head] != -1:
        count += 1
        if not count & 1023 and time.monotonic() > deadline:
            return Searched("unknown", depth=len(stack), steps=count)
        if is_call[entry]:
            i = op_of[entry]
            s = shared[i]
            new = steps[i](state) if s is None or s[1] == done[s[0]] else None
            if new is not None:
                grown = lin | 1 << i
                # the set as (first call not linearized, the bits above it): a search runs
                # mostly in order, so the key stays small however long the history
                low = ((grown + 1) & ~grown).bit_length() - 1
                key = (low, grown >> low, new)
                if key not in cache:
                    cache.add(key)
                    stack.append((i, state, done))
                    state, lin = new, grown
                    if s is not None:
                        done = (*done[: s[0]], s[1] + 1, *done[s[0] + 1 :])
                    lift(i)
                    entry = nxt[head]
                    continue
            entry = nxt[entry]
            continue
        if len(stack) > best:
            best, stuck = len(stack), op_of[entry]
        if not stack:
            return Searched("violation", stuck=stuck, depth=best, steps=count)
        i, state, done = stack.pop()
        lin &= ~(1 << i)
        unlift(i)
        entry = nxt[call_ev[i]]
    return Searched("ok", tuple(i for i, _, _ in stack), steps=count)


# ---- partitions -----------------------------------------------------------------------------


@attrs.define
class Partition:
    """One object's calls: a rollout (or a chain's rollouts), or the registry."""

    key: str
    ids: list[str] = attrs.field(factory=list)
    index: dict[str, int] = attrs.field(factory=dict)  # id -> its place in `ids`
    # global call index -> this partition's step of that call
    subs: dict[int, Step] = attrs.field(factory=dict)
    own: list[int] = attrs.field(factory=list)  # calls of its own (not replayed changes)
    init: State = None
    replayed: list[int] = attrs.field(factory=list)  # registry changes, in registry order
    result: Searched | None = None
    order: tuple[int, ...] = ()  # global call indices, linearized
    edges: tuple[tuple[int, ...], list[tuple[int, int]]] | None = None  # (of order, edges)
    # replayed calls that read or write rows (a bad version's quarantine, retire_stale):
    # ordered with the row writes even where they changed nothing
    row_bound: set[int] = attrs.field(factory=set)


@attrs.frozen
class Finding:
    """A violation (or an unknown) the checker names: the partition(s), what failed."""

    verdict: str  # 'violation' or 'unknown'
    partitions: tuple[str, ...]
    message: str


@attrs.frozen
class LinReport:
    """The verdict on a history and the counts the campaign reports."""

    verdict: str  # ok / violation / unknown
    calls: int
    checked_calls: int
    unchecked: dict[str, int]
    partitions: int
    max_partition: int
    seconds: float
    joint_searches: int
    findings: tuple[Finding, ...]

    def to_json(self) -> dict[str, Any]:
        """The report as JSON (the race report's `linearizability`)."""
        return {
            "verdict": self.verdict,
            "calls": self.calls,
            "checked_calls": self.checked_calls,
            "unchecked": dict(sorted(self.unchecked.items())),
            "partitions": self.partitions,
            "max_partition": self.max_partition,
            "seconds": round(self.seconds, 3),
            "joint_searches": self.joint_searches,
            "violations": sum(f.verdict == "violation" for f in self.findings),
            "unknown": sum(f.verdict == "unknown" for f in self.findings),
            "findings": [attrs.asdict(f) for f in self.findings[:50]],
        }


def _ids_of(entries: Any) -> list[str]:
    return [e["id"] for e in entries or ()]


class _Builder:
    """Turns calls into partitions and per-partition steps (see the module doc)."""

    def __init__(self, header: Mapping[str, Any], calls: Sequence[Call]) -> None:
        self.calls = calls
        self.max_releases = int(header.get("max_releases", cm.MAX_RELEASES))
        self.attached = bool(header.get("registry", True))
        self.unchecked: dict[str, int] = defaultdict(int)
        self.parts: dict[str, Partition] = {}
        self.key_of: dict[str, str] = {}
        # which rollouts an update ever asked to reserve: where it may hold rows
        self.asked: dict[str, set[str]] = defaultdict(set)
        self.windows: dict[int, tuple[float, float]] = {}  # registry calls' narrowed windows
        self.rank: dict[int, int] = {}  # a registry change -> its place in the registry's order
        named: set[str] = set()  # rollouts some call other than a refused dispatch names
        refused: set[str] = set()
        for c in calls:
            if c.op == "dispatch":
                rid = c.args["entry"]["id"]
                self.key_of[rid] = f"chain:{c.args['chain']}"
                if c.out.error is None and not c.out.result.get("dispatched"):
                    refused.add(rid)
                    continue
            elif c.op == "reserve":
                self.asked[c.args["update"]].add(c.args["id"])
            elif c.op == "reserve_batch":
                self.asked[c.args["update"]].update(r["id"] for r in c.args["requests"])
            named.update(_ids_in(c.args))
            named.update(_ids_in(c.out.result))
        # a refused attempt that nothing else names never existed: its chain needs no row
        # for it (a chain's partition would otherwise grow a row per refusal)
        self.rowless = refused - named

    # -- plumbing

    def part(self, rid: str, *, row: bool = True) -> Partition:
        """The partition of rollout `rid`, with a row for it (unless `row` is False)."""
        key = self.key_of.get(rid) or f"rollout:{rid}"
        p = self.parts.get(key)
        if p is None:
            p = self.parts[key] = Partition(key)
        if row and rid not in p.index:
            p.index[rid] = len(p.ids)
            p.ids.append(rid)
        return p

    def touch(self, ci: int, rids: Iterable[str], make: Callable[[dict[str, int]], Step]) -> None:
        """Give call `ci` a step in the partition of each of `rids` (one per partition)."""
        by: dict[str, list[str]] = defaultdict(list)
        for rid in dict.fromkeys(rids):
            p = self.part(rid, row=rid not in self.rowless)
            by[p.key].append(rid)
        for key, members in by.items():
            p = self.parts[key]
            p.own.append(ci)
            ix = {rid: p.index[rid] for rid in members if rid in p.index}
            p.subs[ci] = make(ix)

    # -- the calls

    def build(self) -> None:
        reg = self.parts[REGISTRY] = Partition(REGISTRY)
        for ci, c in enumerate(self.calls):
            if c.op in _REGISTRY_CALLS or c.op in _VIEW_OPS:
                reg.own.append(ci)
                reg.subs[ci] = _registry_step(c)
                if c.op in _REGISTRY_CALLS:
                    continue
            if c.op in _VIEW_OPS or c.op == "retire_stale":
                continue  # replayed where it overlaps (see `replay`)
            if c.op not in _LEDGER_CALLS:
                self.unchecked[c.op] += 1
                continue
            try:
                self.ledger_call(ci, c)
            except (TypeError, KeyError, AttributeError) as exc:
                if c.out.error is None:
                    raise HistoryError(f"{c.brief()}: arguments the model cannot read") from exc
                self.unchecked[f"{c.op} (refused, arguments unreadable)"] += 1

    def ledger_call(self, ci: int, c: Call) -> None:
        a, out, mr = c.args, c.out, self.max_releases
        if c.op in ("add", "add_many"):
            docs = a["entries"]
            self.touch(ci, _ids_of(docs), lambda ix: _add_step(ix, docs, out, len(docs)))
        elif c.op in ("get", "find"):
            rid = a["id"]
            self.touch(ci, [rid], lambda ix: _read_step(ix[rid], c.op, out))
        elif c.op == "transition":
            rid = a["id"]
            self.touch(ci, [rid], lambda ix: _transition_step(ix[rid], a, out))
        elif c.op == "reserve":
            if out.error is not None:
                self.touch(ci, [a["id"]], lambda _ix: _same)  # refused on its arguments
                return
            req = a
            self.touch(
                ci, [a["id"]], lambda ix: _reserve_step(ix, [req], [out.result], a["update"])
            )
        elif c.op == "reserve_batch":
            reqs = a["requests"]
            if out.error is not None or len(out.result) != len(reqs):
                self.touch(ci, [r["id"] for r in reqs], lambda _ix: _same)
                return
            got = out.result
            self.touch(
                ci, [r["id"] for r in reqs], lambda ix: _reserve_step(ix, reqs, got, a["update"])
            )
        elif c.op in ("commit", "abort", "fail_update", "renew_leases", "reserved_by"):
            upd = a["update"]
            listed = list(a.get("ids", ()))
            got = [] if out.error is not None else (out.result or [])
            got_ids = got if c.op == "reserved_by" else _ids_of(got)
            involved = [*listed, *got_ids, *sorted(self.asked.get(upd, ()))]
            single = len({self.part(r).key for r in involved}) <= 1
            self.touch(
                ci, involved, lambda ix: _held_step(ix, c.op, upd, listed, got, out, mr, single)
            )
        elif c.op == "expire_leases":
            got = [] if out.error is not None else out.result
            self.touch(ci, _ids_of(got), lambda ix: _expire_step(ix, got, mr))
        elif c.op == "dispatch":
            rid = a["entry"]["id"]
            self.touch(ci, [rid], lambda ix: _dispatch_step(ix, rid, a, out))
        elif c.op in ("oldest_admissible", "in_state"):
            got = [] if out.error is not None else out.result
            self.touch(ci, _ids_of(got), lambda ix: _listed_step(ix, c.op, a, got))

    # -- registry changes replayed in the rollout partitions

    def replay(self, reg_order: Sequence[int]) -> None:
        """Give every rollout partition its initial View and the registry changes (and
        retire_stale calls) that overlap it, in the registry's order."""
        changes = [ci for ci in reg_order if cm.changes_view(self.calls[ci].op, self.calls[ci].out)]
        self.rank = {ci: n for n, ci in enumerate(changes)}
        views = [EMPTY_VIEW._replace(attached=self.attached)]
        for ci in changes:
            c = self.calls[ci]
            views.append(cm.view_effect(views[-1], c.op, c.args, c.out))
        settled: list[float] = []  # running max of the returns of the first k changes
        top = float("-inf")
        for ci in changes:
            top = max(top, self.calls[ci].ret)
            settled.append(top)
        sweeps = [ci for ci, c in enumerate(self.calls) if c.op == "retire_stale"]
        sweeps.sort(key=lambda ci: self.calls[ci].inv)
        sweep_inv = [self.calls[ci].inv for ci in sweeps]
        longest = max((self.calls[ci].ret - self.calls[ci].inv for ci in sweeps), default=0.0)
        # the rollouts each sweep or bad version's quarantine returned: those partitions
        # reach that call even where it comes after their own last call
        returned: dict[str, list[int]] = defaultdict(list)
        for ci, c in enumerate(self.calls):
            if c.op in ("retire_stale", "quarantine_version") and c.out.error is None:
                for rid in _ids_of(c.out.result):
                    returned[rid].append(ci)
        for p in self.parts.values():
            if p.key == REGISTRY:
                continue
            lo = min(self.calls[ci].inv for ci in p.own)
            hi = max(self.calls[ci].ret for ci in p.own)
            reaching = {ci for rid in p.ids for ci in returned.get(rid, ())}
            hi = max([hi, *(self.calls[ci].ret for ci in reaching)])
            k = _bisect_below(settled, lo)  # the first k changes ended before it began
            p.init = (tuple(None for _ in p.ids), views[k])
            ix = dict(p.index)
            for ci in changes[k:]:
                c = self.calls[ci]
                if c.inv > hi:
                    break
                p.replayed.append(ci)
                p.subs[ci] = _view_step(ix, c)
                if c.op == "quarantine_version":
                    p.row_bound.add(ci)
            # the sweeps whose windows overlap the partition's
            first = _bisect_below(sweep_inv, lo - longest)
            near = {
                ci for ci in sweeps[first:] if self.calls[ci].inv <= hi and self.calls[ci].ret >= lo
            }
            for ci in sorted(near | {ci for ci in reaching if self.calls[ci].op == "retire_stale"}):
                p.own.append(ci)
                p.subs[ci] = _sweep_step(ix, self.calls[ci])
                p.row_bound.add(ci)


def _bisect_below(sorted_max: Sequence[float], lo: float) -> int:
    """How many leading items are < lo (the list is non-decreasing)."""
    a, b = 0, len(sorted_max)
    while a < b:
        mid = (a + b) // 2
        if sorted_max[mid] < lo:
            a = mid + 1
        else:
            b = mid
    return a


def _ids_in(obj: Any) -> Iterable[str]:
    """The rollout ids a call's arguments or result name ('id' fields, 'ids' lists)."""
    if isinstance(obj, Mapping):
        rid = obj.get("id")
        if isinstance(rid, str):
            yield rid
        ids = obj.get("ids")
        if isinstance(ids, list):
            yield from (i for i in ids if isinstance(i, str))
        for v in obj.values():
            if isinstance(v, Mapping | list):
                yield from _ids_in(v)
    elif isinstance(obj, list):
        for v in obj:
            if isinstance(v, Mapping | list):
                yield from _ids_in(v)
            elif isinstance(v, str):
                yield v  # reserved_by's answer: a list of ids


def _same(st: State) -> State:
    return st


def _put(rows: tuple[Row | None, ...], k: int, row: Row | None) -> tuple[Row | None, ...]:
    return (*rows[:k], row, *rows[k + 1 :])


def _add_step(ix: dict[str, int], docs: list[dict[str, Any]], out: Outcome, n: int) -> Step:
    mine = [(ix[d["id"]], d, n_) for n_, d in enumerate(docs) if d["id"] in ix]

    def step(st: State) -> State | None:
        rows, view = st
        if out.error is not None:
            if out.is_a("DuplicateRollout") and n == 1:
                return st if rows[mine[0][0]] is not None else None
            return st
        new_rows = rows
        for k, d, n_ in mine:
            if rows[k] is not None:
                return None
            row = cm.new_row(d, view)
            if not cm.entry_matches(row, out.result[n_]):
                return None
            new_rows = _put(new_rows, k, row)
        return new_rows, view

    return step


def _read_step(k: int, op: str, out: Outcome) -> Step:
    def step(st: State) -> State | None:
        row = st[0][k]
        if out.error is not None:
            if out.is_a("UnknownRollout"):
                return st if row is None else None
            return st
        return st if cm.entry_matches(row, out.result) else None

    return step


def _transition_step(k: int, a: Mapping[str, Any], out: Outcome) -> Step:
    event, expected = a["event"], a["rev"]

    def step(st: State) -> State | None:
        rows, view = st
        new = cm.transition(rows[k], event, expected, out)
        if new is False:
            return None
        return st if new is rows[k] else (_put(rows, k, new), view)  # type: ignore[arg-type]

    return step


def _reserve_step(
    ix: dict[str, int], reqs: Sequence[Mapping[str, Any]], got: Sequence[Any], update: str
) -> Step:
    mine = [
        (ix[r["id"]], r["rev"], cm.stamp_of(r.get("stamp")), g)
        for r, g in zip(reqs, got, strict=True)
        if r["id"] in ix
    ]

    def step(st: State) -> State | None:
        rows, view = st
        for k, rev, stamp, g in mine:
            new = cm.reserve(rows[k], rev, update, stamp, view, g)
            if new is False:
                return None
            if new is not rows[k]:
                rows = _put(rows, k, new)  # type: ignore[arg-type]
        return rows, view

    return step


def _held_step(
    ix: dict[str, int],
    op: str,
    update: str,
    listed: list[str],
    got: Any,
    out: Outcome,
    max_releases: int,
    single: bool,
) -> Step:
    """commit / abort / fail_update / renew_leases / reserved_by: what the update holds at
    the instant is exactly what the answer names (commit: what it listed)."""
    named = set(got) if op == "reserved_by" else set(_ids_of(got))
    by_id = {} if op == "reserved_by" else {e["id"]: e for e in got}
    local = sorted(ix.items(), key=lambda t: t[1])
    wanted = set(listed) if op == "commit" else named

    def step(st: State) -> State | None:
        rows, view = st
        if out.error is not None:
            # exact where it touches one partition; a subclass (a poisoned update's
            # refusal, another change of the ledger) says more than a mismatch
            if op == "commit" and out.error.get("type") == "CommitMismatch" and single:
                held = {rid for rid, k in local if _held(rows[k], update)}
                return st if held != set(listed) else None
            return st
        for rid, k in local:
            row = rows[k]
            if _held(row, update) != (rid in wanted):
                return None
            if rid not in wanted or op == "reserved_by":
                continue
            assert row is not None
            if op == "commit":
                new = row._replace(state="consumed", rev=row.rev + 1, by=None)
            elif op == "abort":
                new = cm.released(row, view, max_releases)
            elif op == "fail_update":
                new = row._replace(state="update_failed", rev=row.rev + 1, by=None)
            else:
                new = row._replace(rev=row.rev + 1)
            if not cm.entry_matches(new, by_id.get(rid)):
                return None
            rows = _put(rows, k, new)
        return rows, view

    return step


def _held(row: Row | None, update: str) -> bool:
    return row is not None and row.state == "reserved" and row.by == update


def _expire_step(ix: dict[str, int], got: Sequence[Mapping[str, Any]], max_releases: int) -> Step:
    mine = [(ix[e["id"]], e) for e in got if e["id"] in ix]

    def step(st: State) -> State | None:
        rows, view = st
        for k, e in mine:
            row = rows[k]
            if row is None or row.state != "reserved":
                return None
            new = cm.released(row, view, max_releases)
            if not cm.entry_matches(new, e):
                return None
            rows = _put(rows, k, new)
        return rows, view

    return step


def _dispatch_step(ix: dict[str, int], rid: str, a: Mapping[str, Any], out: Outcome) -> Step:
    k, doc = ix.get(rid), a["entry"]  # no row: a refused attempt nothing else names

    def step(st: State) -> State | None:
        rows, view = st
        if out.error is not None:
            if out.is_a("DuplicateRollout"):
                return st if k is not None and rows[k] is not None else None
            return st
        if k is not None and rows[k] is not None:
            return None
        chain = [r for r in rows if r is not None]
        got = out.result
        if got["reason"] not in cm.dispatch_reasons(chain, doc["v"], view):
            return None
        if got["attempt"] != len(chain) + 1:
            return None
        if not got["dispatched"]:
            return st
        if k is None:
            return None
        row = cm.new_row(doc, view)
        return (_put(rows, k, row), view) if cm.entry_matches(row, got["entry"]) else None

    return step


def _listed_step(
    ix: dict[str, int], op: str, a: Mapping[str, Any], got: Sequence[Mapping[str, Any]]
) -> Step:
    mine = [(ix[e["id"]], e) for e in got if e["id"] in ix]

    def step(st: State) -> State | None:
        rows, view = st
        lo, hi = cm.window(view) if op == "oldest_admissible" else (None, None)
        state = "rewarded" if op == "oldest_admissible" else a["state"]
        for k, e in mine:
            row = rows[k]
            if row is None or row.state != state or not cm.entry_matches(row, e):
                return None
            if (lo is not None and row.version < lo) or (hi is not None and row.version > hi):
                return None
        return st

    return step


def _view_step(ix: dict[str, int], c: Call) -> Step:
    """A registry change replayed in a rollout partition: the View moves; a bad version's
    mark also quarantines the open rows of that version (exactly those it returned)."""
    quarantined = {e["id"]: e for e in c.out.result or ()} if c.op == "quarantine_version" else {}

    def step(st: State) -> State | None:
        rows, view = st
        view = cm.view_effect(view, c.op, c.args, c.out)
        if c.op == "quarantine_version":
            v = c.args["v"]
            for rid, k in ix.items():
                row = rows[k]
                due = row is not None and row.version == v and row.state in cm.QUARANTINABLE
                if due != (rid in quarantined):
                    return None
                if due:
                    assert row is not None
                    new = row._replace(state="quarantined", rev=row.rev + 1)
                    if not cm.entry_matches(new, quarantined[rid]):
                        return None
                    rows = _put(rows, k, new)
        return rows, view

    return step


def _sweep_step(ix: dict[str, int], c: Call) -> Step:
    """retire_stale in one partition: at the instant, every open row of a rolled-back
    (retired) version is quarantined, every other rewarded row below the window's floor is
    retired, and only those."""
    got = {e["id"]: e for e in c.out.result or ()} if c.out.error is None else None

    def step(st: State) -> State | None:
        if got is None:
            return st
        rows, view = st
        lo, _ = cm.window(view)
        for rid, k in ix.items():
            row = rows[k]
            dest = None
            if row is not None and row.version in view.retired and row.state in cm.QUARANTINABLE:
                dest = "quarantined"
            elif (
                lo is not None and row is not None and row.state == "rewarded" and row.version < lo
            ):
                dest = "retired_stale"
            if (dest is not None) != (rid in got):
                return None
            if dest is not None:
                assert row is not None
                new = row._replace(state=dest, rev=row.rev + 1)
                if not cm.entry_matches(new, got[rid]):
                    return None
                rows = _put(rows, k, new)
        return rows, view

    return step


def _registry_step(c: Call) -> Step:
    def step(reg: State) -> State | None:
        return cm.registry_step(reg, c.op, c.args, c.out)

    return step


# ---- the check ------------------------------------------------------------------------------


def check_history(
    lines: Iterable[str | Mapping[str, Any]],
    *,
    time_limit: float = 10.0,
    max_joint: int = 16,
) -> LinReport:
    """Check a history for linearizability (see the module doc); `time_limit` seconds per
    search (a partition, or a joint search) before it is 'unknown'."""
    header, calls = parse(lines)
    return check_calls(header, calls, time_limit=time_limit, max_joint=max_joint)


def check_calls(
    header: Mapping[str, Any],
    calls: Sequence[Call],
    *,
    time_limit: float = 10.0,
    max_joint: int = 16,
) -> LinReport:
    """`check_history` on parsed calls."""
    started = time.monotonic()
    b = _Builder(header, calls)
    b.build()
    findings: list[Finding] = []
    reg = b.parts[REGISTRY]
    reg.init = cm.Registry()
    _search(reg, calls, time_limit)
    assert reg.result is not None
    if reg.result.verdict == "ok":
        reg_order = reg.order
    else:
        findings.append(_finding(reg, calls))
        # the rollouts are still checked, against the registry changes in invocation order
        reg_order = tuple(sorted(reg.own, key=lambda ci: calls[ci].inv))
    b.replay(reg_order)
    if reg.result.verdict == "ok":
        b.windows = _narrowed(reg, calls)
    for p in b.parts.values():
        if p.key == REGISTRY:
            continue
        _search(p, calls, time_limit, b.windows)
        assert p.result is not None
        if p.result.verdict != "ok":
            findings.append(_finding(p, calls))
    joint = 0
    if not findings:
        joint, extra = _consistent(b, calls, time_limit, max_joint)
        findings.extend(extra)
    verdict = "ok"
    if any(f.verdict == "violation" for f in findings):
        verdict = "violation"
    elif findings:
        verdict = "unknown"
    sizes = [len(p.subs) for p in b.parts.values()]
    return LinReport(
        verdict=verdict,
        calls=len(calls),
        checked_calls=len(calls) - sum(b.unchecked.values()),
        unchecked=dict(b.unchecked),
        partitions=len(b.parts),
        max_partition=max(sizes, default=0),
        seconds=time.monotonic() - started,
        joint_searches=joint,
        findings=tuple(findings),
    )


Windows = Mapping[int, tuple[float, float]]


def _window(calls: Sequence[Call], windows: Windows, ci: int) -> tuple[float, float]:
    got = windows.get(ci)
    return (calls[ci].inv, calls[ci].ret) if got is None else got


def _entries(
    p: Partition, calls: Sequence[Call], windows: Windows
) -> tuple[list[int], list[Entry]]:
    order = sorted(p.subs, key=lambda ci: (_window(calls, windows, ci), ci))
    rank = _lane_ranks(p.replayed, calls)
    return order, [Entry(*_window(calls, windows, ci), p.subs[ci], rank.get(ci)) for ci in order]


def _lane_ranks(changes: Sequence[int], calls: Sequence[Call]) -> dict[int, tuple[int, int]]:
    """Each replayed change (given in registry order) as (its lane, its rank in the lane)."""
    seen: dict[int, int] = defaultdict(int)
    out: dict[int, tuple[int, int]] = {}
    for ci in changes:
        lane = cm.VIEW_LANES[calls[ci].op]
        out[ci] = (lane, seen[lane])
        seen[lane] += 1
    return out


def _narrowed(p: Partition, calls: Sequence[Call]) -> dict[int, tuple[float, float]]:
    """Each call's window as the registry's own order narrows it: a change takes effect
    after every read that did not see it began, and before every read that saw it
    returned (earliest and latest times along the order's constraints)."""
    succ: dict[int, list[int]] = defaultdict(list)
    pred: dict[int, list[int]] = defaultdict(list)
    for x, y in _constraints(p, calls):
        succ[x].append(y)
        pred[y].append(x)
    lo: dict[int, float] = {}
    for ci in p.order:  # the order found is a topological order of its constraints
        lo[ci] = max([calls[ci].inv, *(lo[x] for x in pred[ci])])
    hi: dict[int, float] = {}
    for ci in reversed(p.order):
        hi[ci] = min([calls[ci].ret, *(hi[y] for y in succ[ci])])
    return {ci: (lo[ci], hi[ci]) for ci in p.order}


def _search(
    p: Partition, calls: Sequence[Call], time_limit: float, windows: Windows | None = None
) -> None:
    order, entries = _entries(p, calls, windows or {})
    got = linearize(entries, p.init, time.monotonic() + time_limit)
    p.result = got
    p.order = tuple(order[i] for i in got.order)
    if got.stuck is not None:
        p.result = attrs.evolve(got, stuck=order[got.stuck])


def _finding(p: Partition, calls: Sequence[Call]) -> Finding:
    r = p.result
    assert r is not None
    if r.verdict == "unknown":
        return Finding(
            "unknown",
            (p.key,),
            f"{p.key}: no verdict within the time limit ({len(p.subs)} calls, {r.steps:,} "
            "search steps)",
        )
    what = calls[r.stuck].brief() if r.stuck is not None else "?"
    return Finding(
        "violation",
        (p.key,),
        f"{p.key}: no order of its {len(p.subs)} calls explains every answer; the longest "
        f"explained prefix ({r.depth} calls) cannot fit {what}",
    )


# ---- one instant per call across partitions -------------------------------------------------


def _consistent(
    b: _Builder, calls: Sequence[Call], time_limit: float, max_joint: int
) -> tuple[int, list[Finding]]:
    """Give every call one time in its window, respecting every partition's order; where
    that fails, search the partitions involved jointly (their orders are then replaced by
    the joint one) and try again."""
    joint = 0
    groups: list[set[str]] = []  # partitions searched together so far (they stay together)
    while True:
        conflict = _assign_times(b, calls)
        if conflict is None:
            return joint, []
        found, why = conflict
        keys = set(found) - {REGISTRY}
        for g in [g for g in groups if g & keys]:
            keys |= g
            groups.remove(g)
        groups.append(keys)
        if joint >= max_joint or not keys:
            return joint, [
                Finding(
                    "unknown",
                    tuple(sorted(found)),
                    f"gave up after {joint} joint searches: {why}",
                )
            ]
        joint += 1
        got = _joint_search(b, sorted(keys), calls, time_limit)
        if got.verdict != "ok":
            what = "" if got.stuck is None else f"; cannot fit {calls[got.stuck].brief()}"
            msg = (
                f"calls over {len(keys)} objects cannot each take effect at one instant: "
                f"{why}{what}"
                if got.verdict == "violation"
                else f"joint search of {len(keys)} objects ran out of time: {why}"
            )
            return joint, [Finding(got.verdict, tuple(sorted(keys)), msg)]


def _assign_times(b: _Builder, calls: Sequence[Call]) -> tuple[set[str], str] | None:
    """Earliest-time propagation over the union of the partitions' orders: None when each
    call gets one time in its window; else (the partitions to search jointly, why)."""
    succ: dict[int, dict[int, set[str]]] = defaultdict(dict)
    indeg: dict[int, int] = defaultdict(int)
    nodes: set[int] = set()
    for p in b.parts.values():
        nodes.update(p.order)
        for x, y in _constraints(p, calls):
            keys = succ[x].get(y)
            if keys is None:
                keys = succ[x][y] = set()
                indeg[y] += 1
            keys.add(p.key)
    win = {ci: _window(calls, b.windows, ci) for ci in nodes}
    t = {ci: win[ci][0] for ci in nodes}
    via: dict[int, int] = {}
    ready = [ci for ci in nodes if indeg[ci] == 0]
    seen = 0
    while ready:
        x = ready.pop()
        seen += 1
        if t[x] > win[x][1]:
            keys, y = set(), x
            while y in via:
                keys |= succ[via[y]][y]
                y = via[y]
            return keys, f"{calls[x].brief()} would take effect after it returned"
        for y in succ[x]:
            if t[x] > t[y]:
                t[y] = t[x]
                via[y] = x
            indeg[y] -= 1
            if indeg[y] == 0:
                ready.append(y)
    if seen == len(nodes):
        return None
    left = {ci for ci in nodes if indeg[ci] > 0}
    cycle = _cycle(left, succ)
    keys = set().union(*(succ[x][y] for x, y in itertools.pairwise([*cycle, cycle[0]])))
    return keys, f"the partitions order calls in a cycle (through {calls[cycle[0]].brief()})"


def _constraints(p: Partition, calls: Sequence[Call], reach: int = 8) -> list[tuple[int, int]]:
    """The order a partition's linearization imposes, and no more (the consistency pass
    holds other partitions to these edges only).

    A rollout partition's state is (rows, View), and the two move apart: the calls that
    change the rows keep the order found among themselves, the replayed registry changes
    keep the registry's order within each lane (`call_model.VIEW_LANES`), and every other
    call is bound only by the changes that bound the run of states in which its answer
    holds: a row write by the registry changes it cannot cross (its answer or its rows
    would differ), a call that changes nothing also by the row writes around it (up to
    `reach` either way: a run of views where it holds on its rows, then each row state
    around them on which it holds with every view of that run). Calls that change nothing
    commute, so no other partition is held to an order this one chose freely. The
    registry (one state) is the special case with no View: its writes keep their order
    only where they conflict (`_conflicting`)."""
    if p.edges is not None and p.edges[0] == p.order:
        return p.edges[1]
    split = p.key != REGISTRY
    rows = [p.init[0] if split else p.init]  # row states, after each row write
    views = [p.init[1] if split else None]  # views, after each registry change
    row_writes: list[int] = []
    view_changes: list[int] = []
    placed: list[tuple[int, int, int, bool]] = []  # (call, row index, view index, writes)
    replayed = set(p.replayed)
    for ci in p.order:
        st = (rows[-1], views[-1]) if split else rows[-1]
        new = p.subs[ci](st)
        assert new is not None, "a linearization replays"
        new_rows, new_view = new if split else (new, None)
        row_write = new_rows != rows[-1] or ci in p.row_bound
        view_change = split and new_view != views[-1]
        if row_write and not view_change:
            placed.append((ci, len(rows) - 1, len(views) - 1, True))
        elif not row_write and not view_change and ci not in replayed:
            # (a registry change that leaves this partition as it was holds anywhere)
            placed.append((ci, len(rows) - 1, len(views) - 1, False))
        if row_write:  # (one that moves the View too is held in both orders)
            row_writes.append(ci)
            rows.append(new_rows)
        if view_change:
            view_changes.append(ci)
            views.append(new_view)
    if split:  # each lane's changes in the registry's order (lanes commute)
        lanes: dict[int, list[int]] = defaultdict(list)
        for ci in view_changes:
            lanes[cm.VIEW_LANES[calls[ci].op]].append(ci)
        out = [*itertools.pairwise(row_writes)]
        out += [pair for lane in lanes.values() for pair in itertools.pairwise(lane)]
    else:
        out = _conflicting(row_writes, calls)

    def holds(ci: int, r: int, v: int, writes: bool) -> bool:
        st = (rows[r], views[v]) if split else rows[r]
        new = p.subs[ci](st)
        if new is None:
            return False
        if not writes:
            return bool(new == st)
        return bool(new[0] == rows[r + 1] and new[1] == views[v]) if split else True

    for ci, r, v, writes in placed:
        vlo = vhi = v
        if split:
            while vlo > 0 and v - vlo < reach and holds(ci, r, vlo - 1, writes):
                vlo -= 1
            while vhi + 1 < len(views) and vhi - v < reach and holds(ci, r, vhi + 1, writes):
                vhi += 1
        if not writes:
            # rows around it, each holding its answer with every view of its run
            span = range(vlo, vhi + 1)
            rlo = rhi = r
            while rlo > 0 and r - rlo < reach and all(holds(ci, rlo - 1, j, False) for j in span):
                rlo -= 1
            while (
                rhi + 1 < len(rows)
                and rhi - r < reach
                and all(holds(ci, rhi + 1, j, False) for j in span)
            ):
                rhi += 1
            if rlo > 0:
                out.append((row_writes[rlo - 1], ci))  # the row write that made its rows
            if rhi < len(row_writes):
                out.append((ci, row_writes[rhi]))  # the row write that ended them
        if vlo > 0:
            out.append((view_changes[vlo - 1], ci))
        if vhi < len(view_changes):
            out.append((ci, view_changes[vhi]))
    p.edges = (p.order, out)
    return out


def _conflicting(writes: Sequence[int], calls: Sequence[Call]) -> list[tuple[int, int]]:
    """The order among a registry linearization's writes that matters: each write after
    the last earlier write of a group it reads or writes, and after every earlier write
    since then that read a group it writes (`call_model.registry_footprint`). Writes of
    groups neither reads of the other commute, so any order of them that keeps these
    edges replays to the same registry."""
    out: list[tuple[int, int]] = []
    last: dict[str, int] = {}  # group -> its last writer so far
    readers: dict[str, list[int]] = defaultdict(list)  # group -> writes reading it since
    for ci in writes:
        reads, wrote = cm.registry_footprint(calls[ci].op)
        for g in reads | wrote:
            if g in last:
                out.append((last[g], ci))
        for g in wrote:
            out.extend((x, ci) for x in readers.pop(g, ()) if x != ci)
            last[g] = ci
        for g in reads - wrote:
            readers[g].append(ci)
    return out


def _cycle(left: set[int], succ: Mapping[int, Mapping[int, set[str]]]) -> list[int]:
    """A cycle among `left`, where every node has a predecessor: walking back from any
    node along predecessors in `left` must repeat one."""
    pred: dict[int, int] = {}
    for x in left:
        for y in succ.get(x, {}):
            if y in left:
                pred.setdefault(y, x)
    x = next(iter(left))
    on: dict[int, int] = {}
    path: list[int] = []
    while x not in on:
        on[x] = len(path)
        path.append(x)
        x = pred[x]
    return list(reversed(path[on[x] :]))


def _joint_search(
    b: _Builder, keys: Sequence[str], calls: Sequence[Call], time_limit: float
) -> Searched:
    """Search the partitions `keys` as one object; on success their orders become the
    joint order's projections."""
    # the registry's own order of changes stands (each partition replays it in that
    # order), so the registry need not be searched again: its reads order nothing else
    parts = [b.parts[k] for k in keys if k != REGISTRY]
    every = sorted(
        {ci for p in parts for ci in p.subs}, key=lambda ci: (_window(calls, b.windows, ci), ci)
    )
    replayed = sorted({ci for p in parts for ci in p.replayed}, key=b.rank.__getitem__)
    rank = _lane_ranks(replayed, calls)
    entries = []
    for ci in every:
        subs = [(j, p.subs[ci]) for j, p in enumerate(parts) if ci in p.subs]
        entries.append(Entry(*_window(calls, b.windows, ci), _composite(subs), rank.get(ci)))
    got = linearize(entries, tuple(p.init for p in parts), time.monotonic() + time_limit)
    if got.stuck is not None:
        got = attrs.evolve(got, stuck=every[got.stuck])
    if got.verdict == "ok":
        order = [every[i] for i in got.order]
        for p in parts:
            p.order = tuple(ci for ci in order if ci in p.subs)
    return got


def _composite(subs: list[tuple[int, Step]]) -> Step:
    def step(st: State) -> State | None:
        out = list(st)
        for j, f in subs:
            new = f(out[j])
            if new is None:
                return None
            out[j] = new
        return tuple(out)

    return step
