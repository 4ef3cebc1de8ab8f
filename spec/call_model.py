"""The sequential specification a recorded call history is checked against (issue 33).

Written from the documented semantics, apart from the code it checks: CONTRACT sections 4-6,
docs/trust-boundary.md (the reservation's refusal order, leases, retries), docs/pacing.md
(dispatch), docs/design.md (acks bound to an attempt). It imports nothing of model/ but the
declared machines (the one source of the legal moves, DESIGN.md) and no planning, rule or
store code: a bug there cannot blind this model.

Two kinds of object, as the history checker partitions them (spec/linearizability.py):

- a rollout (or an attempt chain: the rollouts dispatched on one prompt) with its rows,
  and the registry's facts every reservation reads (`View`: pointer, ever-active versions,
  policy, retired versions, bad versions), carried along in each partition;
- the registry (`Registry`): artifacts, pointer, worker set, acks and attempt tokens,
  policy.

Each model function takes the state as it is at the call's instant, the call's arguments
and its recorded outcome, and returns the state after it, or None when that outcome is
impossible at that instant (the history checker then tries another instant or order).

The reservation's refusal order is `RESERVE_ORDER`, in ONE place: the ledger's order of
checks (contract section 5 then docs/trust-boundary.md). A new refusal is one entry there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from rollout_lifecycle.model.machines import ACTIVATION, LIFECYCLE

# ---- rows and the registry's facts a partition carries ----------------------------------


class Row(NamedTuple):
    """A rollout as the model holds it. `version` and `hash` are fixed at its creation."""

    state: str
    rev: int
    by: str | None
    version: int
    releases: int
    hash: str | None


class View(NamedTuple):
    """What of the registry (and the ledger's bad versions) a rollout's calls depend on.

    `attached` is False for a ledger without a registry (only a stamp is judged then)."""

    attached: bool
    pointer: int | None
    ever: frozenset[int]
    policy: tuple[int, float, int | None, int | None] | None  # lag, drift, batch, attempts
    retired: frozenset[int]
    bad: frozenset[int]
    hashes: frozenset[tuple[int, str]]


EMPTY_VIEW = View(True, None, frozenset(), None, frozenset(), frozenset(), frozenset())
TERMINAL = frozenset(LIFECYCLE.terminal)
LIVE = frozenset(s for s in LIFECYCLE.states if s not in TERMINAL)
QUARANTINABLE = frozenset(s for s in LIFECYCLE.states if LIFECYCLE.is_legal(s, "quarantine"))
ADDABLE = frozenset(LIFECYCLE.states_tagged("start"))
WAS_ACTIVE = frozenset(ACTIVATION.states_tagged("was_active"))
DIRECT_EVENTS = frozenset(
    {
        "generation_done",
        "reward_ready",
        "generation_failed",
        "reward_timeout",
        "reward_error",
        "quarantine",
        "retire_stale",
    }
)
MAX_RELEASES = 3  # the recovery rule's default (a history header may name another)


def lifecycle_dest(state: str, event: str, guards: Mapping[str, bool] | None = None) -> str | None:
    """Where `event` takes a row in `state` per the declared machine; None if illegal."""
    if not LIFECYCLE.is_legal(state, event):
        return None
    return LIFECYCLE.next_state(state, event, guards)


def entry_matches(row: Row | None, got: Mapping[str, Any] | None) -> bool:
    """Whether a recorded entry (id, state, rev, by) is this row."""
    if got is None or row is None:
        return got is None and row is None
    return got["state"] == row.state and got["rev"] == row.rev and got.get("by") == row.by


# ---- the reservation's order of checks --------------------------------------------------


class Stamp(NamedTuple):
    """The figures of an admission stamp the model judges (None fields: absent)."""

    accepted: Any
    reason: Any
    freshness: Any
    behavior_version: Any
    current_version: Any
    max_lag: Any
    max_drift: Any
    drift: Any


def stamp_of(doc: Mapping[str, Any] | None) -> Stamp | None:
    """The stamp of a recorded request (its JSON form), or None."""
    if doc is None:
        return None
    return Stamp(*(doc.get(f) for f in Stamp._fields))


def _num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def stamp_passes(s: Stamp, version: int) -> bool:
    """A stamp that passed on its own figures (CONTRACT sections 3 and 6): accepted with
    reason ok, for this rollout's version, 0 <= lag <= its max_lag with the freshness that
    lag gives, a finite drift within its max_drift."""
    if s.accepted is not True or s.reason != "ok" or s.behavior_version != version:
        return False
    if not (_int(s.current_version) and _int(s.max_lag) and s.max_lag >= 0):
        return False
    lag = s.current_version - version
    if not 0 <= lag <= s.max_lag:
        return False
    if s.freshness != ("fresh" if lag == 0 else "tolerated"):
        return False
    return _num(s.max_drift) and s.max_drift >= 0 and _num(s.drift) and 0 <= s.drift <= s.max_drift


STAMP_REFUSALS = frozenset({"not_admitted", "stamp_contradicts_itself"})


class Ask(NamedTuple):
    """One reservation request judged at one instant."""

    row: Row | None
    expected: int
    update: str
    stamp: Stamp | None
    view: View


def _lag_ok(a: Ask) -> bool:
    assert a.row is not None and a.stamp is not None and a.view.policy is not None
    assert a.view.pointer is not None
    bound: int = min(a.stamp.max_lag, a.view.policy[0])
    return bool(0 <= a.view.pointer - a.row.version <= bound)


def _looser(a: Ask) -> bool:
    assert a.stamp is not None and a.view.policy is not None
    lag, drift = a.view.policy[0], a.view.policy[1]
    return not (
        _int(a.stamp.max_lag)
        and a.stamp.max_lag <= lag
        and _num(a.stamp.max_drift)
        and a.stamp.max_drift <= drift
    )


def _hash_differs(a: Ask) -> bool | None:
    """None ("maybe") when the row's hash is not the one its version activated with."""
    if not a.view.attached or a.row is None or a.row.hash is None:
        return False
    if a.row.version not in a.view.ever or (a.row.version, a.row.hash) in a.view.hashes:
        return False
    return None


# (reasons any of which answers the check, whether the row is then held, the check).
# Checks run in order on the state at one instant; the first that holds is the answer. A
# check may answer None, "maybe": a fact this model does not hold (yet); its refusal is
# then one possible answer and the order goes on. Where the ledger adds a refusal, it is
# one entry here, at its place in the order (docs/trust-boundary.md's table).
RESERVE_ORDER: tuple[tuple[frozenset[str], bool, Callable[[Ask], bool | None]], ...] = (
    (frozenset({"missing_rollout"}), False, lambda a: a.row is None),
    (
        frozenset({"idempotent_retry"}),
        True,
        lambda a: a.row is not None and a.row.state == "reserved" and a.row.by == a.update,
    ),
    (
        frozenset({"revision_conflict"}),
        False,
        lambda a: a.row is not None and a.row.rev != a.expected,
    ),
    (
        frozenset({"not_rewarded"}),
        False,
        lambda a: a.row is not None and lifecycle_dest(a.row.state, "reserve") is None,
    ),
    # an update whose commit failed or whose lease ran out is poisoned (another change of
    # the ledger): whether it is, no rollout's partition knows yet, so "maybe" once the
    # row itself would take the reservation; make it exact by modelling the poison
    (frozenset({"update_poisoned"}), False, lambda a: None),
    (frozenset({"not_admitted"}), False, lambda a: a.stamp is None),
    (
        STAMP_REFUSALS,
        False,
        lambda a: (
            a.stamp is not None and a.row is not None and not stamp_passes(a.stamp, a.row.version)
        ),
    ),
    # below: the registry's facts, judged only where the ledger shares a registry
    (
        frozenset({"no_admission_policy"}),
        False,
        lambda a: a.view.attached and a.view.policy is None,
    ),
    (frozenset({"looser_than_policy"}), False, lambda a: a.view.attached and _looser(a)),
    (
        frozenset({"version_not_active"}),
        False,
        lambda a: a.view.attached and a.row is not None and a.row.version not in a.view.ever,
    ),
    # a rollout whose artifact hash is not the one its version activated with (another
    # change of the ledger refuses it here): "maybe" until that lands, then exact
    (frozenset({"artifact_hash_mismatch"}), False, _hash_differs),
    (
        frozenset({"version_retired"}),
        False,
        lambda a: a.view.attached and a.row is not None and a.row.version in a.view.retired,
    ),
    (
        frozenset({"stamp_contradicts_itself"}),
        False,
        lambda a: (
            a.view.attached and a.stamp is not None and a.stamp.current_version not in a.view.ever
        ),
    ),
    (
        frozenset({"version_not_active"}),
        False,
        lambda a: a.view.attached and a.view.pointer is None,
    ),
    (frozenset({"pointer_moved"}), False, lambda a: a.view.attached and not _lag_ok(a)),
)


def reserve_answer(a: Ask) -> frozenset[tuple[str, bool]]:
    """The answers the documented order allows at this instant, each with whether the
    rollout is held by the update after it (reserved or idempotent retry);
    ('reserved', True) when every check passes (the row is then written)."""
    out: set[tuple[str, bool]] = set()
    for reasons, held, check in RESERVE_ORDER:
        verdict = check(a)
        if verdict is False:
            continue
        out.update((r, held) for r in reasons)
        if verdict:
            return frozenset(out)
    out.add(("reserved", True))
    return frozenset(out)


def reserve(
    row: Row | None, expected: int, update: str, stamp: Stamp | None, view: View, got: Any
) -> Row | bool | None:
    """The row after a reservation answered `got` ({reserved, reason, entry}); False when
    that answer is not true at this instant."""
    allowed = reserve_answer(Ask(row, expected, update, stamp, view))
    if (got["reason"], bool(got["reserved"])) not in allowed:
        return False
    if got["reason"] == "reserved":
        assert row is not None
        new = row._replace(state="reserved", rev=row.rev + 1, by=update)
        return new if entry_matches(new, got.get("entry")) else False
    entry = got.get("entry")
    if entry is not None and not entry_matches(row, entry):
        return False  # the record it answered with is the row of that same instant
    return row


# ---- other ledger calls on one row --------------------------------------------------------


def released(row: Row, view: View, max_releases: int) -> Row:
    """A returned reservation (abort, lease expiry) under the recovery rule: quarantined
    when its version was marked bad or it was already released `max_releases` times."""
    if row.version in view.bad or row.releases >= max_releases:
        return row._replace(state="quarantined", rev=row.rev + 1, by=None)
    return row._replace(state="rewarded", rev=row.rev + 1, by=None, releases=row.releases + 1)


def new_row(doc: Mapping[str, Any], view: View) -> Row:
    """A row as `add` or `dispatch` writes it: revision 0, or quarantined on arrival when
    its version was marked bad (revision 1)."""
    row = Row(doc["state"], 0, None, doc["v"], 0, doc.get("hash"))
    if row.version in view.bad and lifecycle_dest(row.state, "quarantine") is not None:
        return row._replace(state="quarantined", rev=1)
    return row


def transition(row: Row | None, event: str, expected: int, out: Outcome) -> Row | bool | None:
    """A direct lifecycle event under compare-and-set: unknown, then the revision, then the
    machine (a RevisionConflict names the revision found)."""
    if out.error is None:
        if row is None or row.rev != expected or event not in DIRECT_EVENTS:
            return False
        dest = lifecycle_dest(row.state, event)
        if dest is None:
            return False
        new = row._replace(state=dest, rev=row.rev + 1)
        return new if entry_matches(new, out.result) else False
    if out.is_a("UnknownRollout"):
        return row if row is None else False
    if out.is_a("RevisionConflict"):
        actual = out.error.get("actual")
        ok = row is not None and row.rev != expected and actual in (None, row.rev)
        return row if ok else False
    if out.is_a("IllegalTransition"):
        ok = row is not None and row.rev == expected and lifecycle_dest(row.state, event) is None
        return row if ok else False
    return row  # refused on its arguments alone (checked before any read): nothing changed


class Outcome(NamedTuple):
    """A call's recorded outcome: its result, or its error ({type, types, ...})."""

    result: Any
    error: Mapping[str, Any] | None

    def is_a(self, name: str) -> bool:
        """Whether the error is of class `name` (or a subclass: `types` lists its bases)."""
        return self.error is not None and (
            self.error.get("type") == name or name in self.error.get("types", ())
        )


# ---- dispatch (docs/pacing.md) ------------------------------------------------------------


def dispatch_reasons(chain_rows: Sequence[Row], version: int, view: View) -> frozenset[str]:
    """The answers a dispatch may get at this instant: the first refusal of the documented
    order (version: not rolled back, active, not stale; then chain, then budget). The live
    budget counts rollouts of every chain, which no single chain's partition sees, so where
    no earlier refusal applies 'dispatched' and 'no_capacity' are both possible (the spec's
    `dispatch_paced` judges the budget on the trace)."""
    pol, p = view.policy, view.pointer
    if view.attached:
        if version in view.retired:  # before the pointer: a rollback leaves it above it
            return frozenset({"version_retired"})
        if p is None or version > p or version not in view.ever:
            return frozenset({"not_active"})
        if pol is not None and p - version > pol[0]:
            return frozenset({"stale"})
    states = [r.state for r in chain_rows]
    if "consumed" in states:
        return frozenset({"chain_done"})
    if any(s in LIVE for s in states):
        return frozenset({"chain_live"})
    bound = pol[3] if view.attached and pol is not None else None
    if bound is not None and len(chain_rows) + 1 > bound:
        return frozenset({"attempts_exhausted"})
    if view.attached and pol is not None and pol[2] is not None and p is not None:
        return frozenset({"dispatched", "no_capacity"})
    return frozenset({"dispatched"})


def window(view: View) -> tuple[int | None, int | None]:
    """The versions a learner may still train: [max(0, pointer - max_lag), pointer]."""
    if view.pointer is None or view.policy is None:
        return None, view.pointer
    return max(0, view.pointer - view.policy[0]), view.pointer


# ---- the registry ---------------------------------------------------------------------------


class Art(NamedTuple):
    """An artifact version: its machine state, hash, attempts, rollback pointer, and the
    cause it was rolled back with ('rolled_back' retires its rollouts, '..._kept' not)."""

    v: int
    state: str
    hash: str | None
    attempts: int
    rollback: int | None
    cause: str | None = None


class Report(NamedTuple):
    """A worker's latest stored report."""

    incarnation: int
    seq: int
    version: int
    hash: str
    token: str | None


class Registry(NamedTuple):
    """The registry: artifacts by version, pointer, worker set, reports, attempt tokens
    ((version, worker) -> (attempt, token; None until a read or a counted ack shows it:
    tokens are random)), policy, and the ledger's bad versions."""

    arts: tuple[Art, ...] = ()
    pointer: tuple[int, str] | None = None
    members: tuple[str, ...] | None = None
    reports: tuple[tuple[str, Report], ...] = ()
    tokens: tuple[tuple[tuple[int, str], tuple[int, str | None]], ...] = ()
    policy: tuple[int, float, int | None, int | None] | None = None
    bad: frozenset[int] = frozenset()
    spent: frozenset[str] = frozenset()  # tokens a counted ack already echoed

    def art(self, v: Any) -> Art | None:
        """The artifact of version v, or None."""
        for a in reversed(self.arts):
            if a.v == v:
                return a
        return None

    def put(self, new: Art) -> Registry:
        """With `new` stored (kept sorted by version)."""
        arts = [a for a in self.arts if a.v != new.v]
        arts.append(new)
        arts.sort()
        return self._replace(arts=tuple(arts))

    def report(self, w: str) -> Report | None:
        """The worker's latest stored report."""
        return dict(self.reports).get(w)

    def token(self, v: int, w: str) -> tuple[int, str | None] | None:
        """The token issued to w for v: (attempt, value or None if not yet seen)."""
        return dict(self.tokens).get((v, w))

    def with_tokens(self, changes: Mapping[tuple[int, str], tuple[int, str | None]]) -> Registry:
        """With tokens issued or bound."""
        out = dict(self.tokens)
        out.update(changes)
        return self._replace(tokens=tuple(sorted(out.items())))

    def awaiting(self) -> list[Art]:
        """Versions whose distribution attempt is open."""
        return [a for a in self.arts if a.state == "awaiting_acks"]


def policy_of(doc: Mapping[str, Any] | None) -> tuple[int, float, int | None, int | None] | None:
    """A policy from its recorded JSON form."""
    if doc is None:
        return None
    return (doc["max_lag"], doc["max_drift"], doc.get("batch_size"), doc.get("max_attempts"))


def act(state: str, event: str, guards: Mapping[str, bool] | None = None) -> str | None:
    """Where the declared activation machine takes an artifact; None if illegal."""
    if not ACTIVATION.is_legal(state, event):
        return None
    return ACTIVATION.next_state(state, event, guards)


def _err(out: Outcome, *names: str) -> bool:
    return out.error is not None and any(out.is_a(n) for n in names)


def _art_matches(a: Art, got: Any) -> bool:
    return isinstance(got, Mapping) and got.get("v") == a.v and got.get("state") == a.state


def counted_report(reg: Registry, art: Art, w: str) -> Report | None:
    """The worker's report that speaks for `art`: one of another version (it can only
    block), or one of this version echoing the worker's token of the current attempt."""
    r = reg.report(w)
    if r is None:
        return None
    if r.version != art.v:
        return r
    t = reg.token(art.v, w)
    if t is None or t[0] != art.attempts or t[1] is None or t[1] != r.token:
        return None
    return r


def registry_step(reg: Registry, op: str, args: Mapping[str, Any], out: Outcome) -> Registry | None:
    """The registry after `op` answered `out` at this instant; None if untrue then."""
    fn = REGISTRY_OPS.get(op)
    if fn is None:
        return reg  # a call the model does not judge (recorded, counted as unchecked)
    return fn(reg, args, out)


def _attach(reg: Registry, args: Mapping[str, Any], out: Outcome) -> Registry | None:
    wanted = args.get("workers")
    pol = policy_of(args.get("policy"))
    if pol is not None and reg.policy != pol:
        # the policy is the operator's: a coordinator expecting another one, or one where
        # none is recorded, is refused before it writes anything (not even the worker set)
        return reg if _err(out, "ActivationError") else None
    if reg.members is None and wanted is None:
        return reg if _err(out, "ActivationError") else None
    if reg.members is not None and wanted is not None and set(wanted) != set(reg.members):
        return reg if _err(out, "ActivationError") else None
    if out.error is not None:
        return None
    return reg if reg.members is not None else reg._replace(members=tuple(wanted or ()))


def _prepare(reg: Registry, args: Mapping[str, Any], out: Outcome) -> Registry | None:
    v = args["v"]
    top = max((a.v for a in reg.arts), default=None)
    rb = args.get("rollback", "current")
    if rb == "current":
        rb = None if reg.pointer is None else reg.pointer[0]
    refused = (
        reg.art(v) is not None
        or (top is not None and v <= top)
        or (rb is not None and (rb >= v or reg.art(rb) is None))
    )
    if refused:
        return reg if _err(out, "ActivationError") else None
    if args.get("trained_by"):
        if out.error is not None:  # the lineage fence reads commits the model does not see
            return reg if _err(out, "ActivationError") else None
    elif out.error is not None:
        return None
    new = Art(v, ACTIVATION.initial, None, 0, rb)
    return reg.put(new) if _art_matches(new, out.result) else None


def _move(event: str, exclusive: bool = False) -> Callable[..., Registry | None]:
    """A plain machine event on one artifact (commit_artifact, distribute, ...)."""

    def step(reg: Registry, args: Mapping[str, Any], out: Outcome) -> Registry | None:
        a = reg.art(args["v"])
        if a is None:
            return reg if _err(out, "ActivationError") else None
        if exclusive and any(b.v != a.v for b in reg.awaiting()):
            return reg if _err(out, "ActivationError") else None
        dest = act(a.state, event)
        if dest is None:
            return reg if _err(out, "IllegalTransition", "ActivationError") else None
        if exclusive and reg.pointer is not None and a.v <= reg.pointer[0]:
            return reg if _err(out, "ActivationError") else None
        if out.error is not None:
            return None
        new = a._replace(state=dest)
        if event == "commit_artifact":
            new = new._replace(hash=args["hash"])
        tokens: dict[tuple[int, str], tuple[int, str | None]] = {}
        if event in ("distribute", "retry"):
            new = new._replace(attempts=a.attempts + 1)
            tokens = {(a.v, w): (new.attempts, None) for w in reg.members or ()}
        if not _art_matches(new, out.result):
            return None
        return reg.put(new).with_tokens(tokens)

    return step


def _attempt_tokens(reg: Registry, args: Mapping[str, Any], out: Outcome) -> Registry | None:
    a = reg.art(args["v"])
    if a is None or a.state != "awaiting_acks" or reg.members is None:
        return reg if _err(out, "ActivationError") else None
    current = {w: t for w in reg.members if (t := reg.token(a.v, w)) is not None}
    if any(t[0] != a.attempts for t in current.values()) or len(current) != len(reg.members):
        return reg if _err(out, "ActivationError") else None
    got = out.result
    if out.error is not None or not isinstance(got, Mapping) or set(got) != set(reg.members):
        return None
    bind: dict[tuple[int, str], tuple[int, str | None]] = {}
    for w, (n, value) in current.items():
        if value is None:
            bind[(a.v, w)] = (n, got[w])
        elif value != got[w]:
            return None
    # a token is issued to one worker for one attempt: two workers never share one
    if len(set(got.values())) != len(got):
        return None
    return reg.with_tokens(bind)


def _record_ack(reg: Registry, args: Mapping[str, Any], out: Outcome) -> Registry | None:
    if out.error is not None:
        return None  # every report gets an answer; a malformed one is refused before
    w, v, token = args["worker"], args["v"], args.get("token")
    member = reg.members is not None and w in reg.members
    a = reg.art(v)
    answers = member and a is not None and a.state == "awaiting_acks"
    reason, counted = out.result["reason"], bool(out.result["counted"])
    bind: dict[tuple[int, str], tuple[int, str | None]] = {}
    if answers:
        assert a is not None
        mine = reg.token(v, w)
        others = {t[1] for (tv, tw), t in reg.tokens if tv == v and tw != w and t[0] == a.attempts}
        if token is None:
            judged: str | None = "missing_attempt_token"
        elif mine is not None and mine[0] == a.attempts and mine[1] == token:
            judged = None
        elif mine is not None and mine[0] == a.attempts and mine[1] is None and counted:
            judged = None  # the token was never read back: the counted answer shows it
            bind[(v, w)] = (mine[0], token)
        elif token in others:
            judged = "foreign_attempt_token"
        else:
            judged = "stale_attempt_token"
        if judged is not None:
            return reg if (reason, counted) == (judged, False) else None
        stored_token = token
    else:
        stored_token = None
    old = reg.report(w)
    inc = args.get("incarnation", 0)
    seq = args.get("seq")
    if seq is None:  # numbered by arrival within an incarnation
        seq = old.seq + 1 if old is not None and old.incarnation == inc else 0
    if old is not None and (inc, seq) <= (old.incarnation, old.seq):
        return (
            reg
            if not counted and reason in ("duplicate", "out_of_order", "conflicting_report")
            else None
        )
    if answers and token in reg.spent:
        # a token counts once: a copy of the counted ack still standing is a duplicate,
        # any other ack echoing it (the worker reported something else since) is refused
        standing = (
            old is not None
            and old.token == token
            and (old.incarnation, old.version, old.hash) == (inc, v, args["hash"])
        )
        want_spent = ("duplicate" if standing else "spent_attempt_token", False)
        return reg if (reason, counted) == want_spent else None
    want = ("counted", True) if answers else ("reported" if member else "not_required", False)
    if (reason, counted) != want:
        return None
    new = Report(inc, seq, v, args["hash"], stored_token)
    reports = dict(reg.reports)
    reports[w] = new
    spent = reg.spent | {token} if answers and token is not None else reg.spent
    return reg.with_tokens(bind)._replace(reports=tuple(sorted(reports.items())), spent=spent)


def _try_activate(reg: Registry, args: Mapping[str, Any], out: Outcome) -> Registry | None:
    a = reg.art(args["v"])
    if a is None:
        return reg if _err(out, "ActivationError") else None
    if out.error is not None:
        return None
    got = out.result
    pointer = None if reg.pointer is None else list(reg.pointer)
    if a.state != "awaiting_acks":
        committed = a.hash is not None and a.state not in ("prepared", "commit_failed")
        want = "not_awaiting_acks" if committed else "artifact_not_committed"
        ok = got["reason"] == want and not got["activated"] and got.get("pointer") == pointer
        return reg if ok else None
    members = reg.members or ()
    counted = {w: r for w in members if (r := counted_report(reg, a, w)) is not None}
    missing = sorted(w for w in members if w not in counted)
    mismatched = sorted(w for w, r in counted.items() if (r.version, r.hash) != (a.v, a.hash))
    if reg.pointer is not None and a.v <= reg.pointer[0]:
        want = "non_monotonic_version"
    elif missing:
        want = "missing_worker_ack"
    elif mismatched:
        want = "worker_mismatch"
    else:
        want = "activated"
    if got["reason"] != want or bool(got["activated"]) != (want == "activated"):
        return None
    if sorted(got.get("missing", missing)) != missing:
        return None
    if sorted(got.get("mismatched", mismatched)) != mismatched:
        return None
    if want != "activated":
        return reg if got.get("pointer") == pointer else None
    assert a.hash is not None
    if got.get("pointer") != [a.v, a.hash]:
        return None
    new = reg.put(a._replace(state="active"))
    if reg.pointer is not None:
        old = new.art(reg.pointer[0])
        if old is not None:
            new = new.put(old._replace(state="superseded"))
    return new._replace(pointer=(a.v, a.hash))


def _settle(reg: Registry, args: Mapping[str, Any], out: Outcome) -> Registry | None:
    """`settle`: each version it says it activated was awaiting acks with every required
    worker's counted ack of it matching (as try_activate judges); each it says it failed
    was awaiting acks (its deadline is the coordinator's clock, which the model keeps
    none of: a failure is accepted, never an activation without its acks)."""
    if out.error is not None:
        return None
    new = reg
    for v, h in out.result["activated"]:
        a = new.art(v)
        if a is None or a.state != "awaiting_acks" or a.hash != h:
            return None
        members = new.members or ()
        counted = {w: r for w in members if (r := counted_report(new, a, w)) is not None}
        if not members or len(counted) != len(members):
            return None
        if any((r.version, r.hash) != (a.v, a.hash) for r in counted.values()):
            return None
        if new.pointer is not None and a.v <= new.pointer[0]:
            return None
        after = new.put(a._replace(state="active"))
        if new.pointer is not None:
            old = after.art(new.pointer[0])
            if old is not None:
                after = after.put(old._replace(state="superseded"))
        new = after._replace(pointer=(a.v, h))
    for v in out.result["failed"]:
        a = new.art(v)
        dest = None if a is None else act(a.state, "fail_distribution")
        if a is None or dest is None:
            return None
        new = new.put(a._replace(state=dest))
    return new


def _rollback(reg: Registry, args: Mapping[str, Any], out: Outcome) -> Registry | None:
    cur = None if reg.pointer is None else reg.art(reg.pointer[0])
    target = None if cur is None or cur.rollback is None else reg.art(cur.rollback)
    if (
        reg.awaiting()
        or cur is None
        or target is None
        or target.state != "superseded"
        or target.hash is None
    ):
        return reg if _err(out, "ActivationError") else None
    if out.error is not None or out.result != [target.v, target.hash]:
        return None
    cause = "rolled_back_kept" if args.get("keep") else "rolled_back"
    new = reg.put(cur._replace(state="rolled_back", cause=cause))
    new = new.put(target._replace(state="active"))
    return new._replace(pointer=(target.v, target.hash))


def _change_membership(reg: Registry, args: Mapping[str, Any], out: Outcome) -> Registry | None:
    new = tuple(args["workers"])
    if out.error is not None:
        return None  # a well-formed set is always recorded
    if list(out.result) != list(new):
        return None
    if reg.members == new:
        return reg
    old = reg.members or ()
    leavers = {w for w in old if w not in new}
    joiners = [w for w in new if w not in old]
    reports = tuple((w, r) for w, r in reg.reports if w not in leavers)
    tokens = tuple((k, t) for k, t in reg.tokens if k[1] not in leavers)
    out_reg = reg._replace(members=new, reports=reports, tokens=tokens)
    issued = {(a.v, w): (a.attempts, None) for a in reg.awaiting() for w in joiners}
    return out_reg.with_tokens(issued)


def _set_policy(reg: Registry, args: Mapping[str, Any], out: Outcome) -> Registry | None:
    if out.error is not None or out.result != args["policy"]:
        return None
    return reg._replace(policy=policy_of(args["policy"]))


def _read(field: Callable[[Registry, Mapping[str, Any]], Any]) -> Callable[..., Registry | None]:
    def step(reg: Registry, args: Mapping[str, Any], out: Outcome) -> Registry | None:
        if out.error is not None:
            return None
        return reg if out.result == field(reg, args) else None

    return step


def _pointer(reg: Registry, _a: Mapping[str, Any]) -> Any:
    return None if reg.pointer is None else list(reg.pointer)


def _policy(reg: Registry, _a: Mapping[str, Any]) -> Any:
    p = reg.policy
    return (
        None
        if p is None
        else dict(zip(("max_lag", "max_drift", "batch_size", "max_attempts"), p, strict=True))
    )


def _max_version(reg: Registry, _a: Mapping[str, Any]) -> Any:
    return max((a.v for a in reg.arts), default=None)


def _required(reg: Registry, _a: Mapping[str, Any]) -> Any:
    return None if reg.members is None else list(reg.members)


def _bad(change: bool) -> Callable[..., Registry | None]:
    def step(reg: Registry, args: Mapping[str, Any], out: Outcome) -> Registry | None:
        if out.error is not None:
            return None
        v = args["v"]
        return reg._replace(bad=reg.bad | {v} if change else reg.bad - {v})

    return step


REGISTRY_OPS: dict[str, Callable[[Registry, Mapping[str, Any], Outcome], Registry | None]] = {
    "attach": _attach,
    "prepare": _prepare,
    "commit_artifact": _move("commit_artifact"),
    "distribute": _move("distribute", exclusive=True),
    "retry": _move("retry", exclusive=True),
    "fail_distribution": _move("fail_distribution"),
    "abandon": _move("abandon"),
    "attempt_tokens": _attempt_tokens,
    "record_ack": _record_ack,
    "try_activate": _try_activate,
    "settle": _settle,
    "rollback": _rollback,
    "change_membership": _change_membership,
    "set_policy": _set_policy,
    "pointer": _read(_pointer),
    "policy": _read(_policy),
    "max_version": _read(_max_version),
    "required_workers": _read(_required),
    "quarantine_version": _bad(True),
    "clear_bad_version": _bad(False),
}


# ---- what a registry call changes of every rollout's View ---------------------------------


def view_effect(view: View, op: str, args: Mapping[str, Any], out: Outcome) -> View:
    """The View after a registry change that landed (the ones `changes_view` names)."""
    if op == "set_policy":  # an attach only checks the policy, never records it
        pol = policy_of(args.get("policy"))
        return view if pol is None else view._replace(policy=pol)
    if op == "try_activate":
        v, h = out.result["pointer"]
        return view._replace(pointer=v, ever=view.ever | {v}, hashes=view.hashes | {(v, h)})
    if op == "settle":
        for v, h in out.result["activated"]:
            view = view._replace(pointer=v, ever=view.ever | {v}, hashes=view.hashes | {(v, h)})
        return view
    if op == "rollback":
        v = out.result[0]
        retired = view.retired
        if not args.get("keep") and view.pointer is not None:
            retired = retired | {view.pointer}
        return view._replace(pointer=v, retired=retired)
    if op == "quarantine_version":
        return view._replace(bad=view.bad | {args["v"]})
    if op == "clear_bad_version":
        return view._replace(bad=view.bad - {args["v"]})
    return view


# The registry's fields a call reads and writes, in three groups: the policy, the bad
# versions, and everything else (artifacts, pointer, worker set, reports, tokens). Calls
# whose groups do not conflict commute in `registry_step`, so the order the registry's own
# search happened to pick between them is one of several: a rollout partition may need the
# other (an activation and a policy change by two processes at once, say).
VIEW_LANES = {"set_policy": 0, "try_activate": 1, "settle": 1, "rollback": 1}
VIEW_LANES |= {"quarantine_version": 2, "clear_bad_version": 2}
_POLICY, _BAD, _MAIN = frozenset({"policy"}), frozenset({"bad"}), frozenset({"main"})


def registry_footprint(op: str) -> tuple[frozenset[str], frozenset[str]]:
    """(what `op` reads, what it writes) of the registry, as field groups."""
    if op == "set_policy":
        return frozenset(), _POLICY
    if op in ("quarantine_version", "clear_bad_version"):
        return frozenset(), _BAD
    if op in ("attach", "policy"):  # an attach is refused unless the policy is the expected
        return _POLICY | _MAIN, _MAIN if op == "attach" else frozenset()
    return _MAIN, _MAIN


def changes_view(op: str, out: Outcome) -> bool:
    """Whether a registry call's recorded outcome says it changed what rollouts read."""
    if out.error is not None:
        return False
    if op == "try_activate":
        return bool(out.result.get("activated"))
    if op == "settle":
        return bool(out.result.get("activated"))
    return op in ("set_policy", "rollback", "quarantine_version", "clear_bad_version")
