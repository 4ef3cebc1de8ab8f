"""Ghost truth about workers, and the reference model of how their acks must be judged.

The coordinator only sees acks; the machines also know what each worker REALLY loaded. That
ghost truth is what makes "a version activates only when every required worker truly holds
it" checkable: an ack counted from before a restart, or from an earlier distribution
attempt, passes every check that looks only at acks, and fails this one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from rollout_lifecycle.model.events import ArtifactChanged, TraceEvent
from rollout_lifecycle.model.records import WorkerAck


@attrs.define
class WorkerTruth:
    """What one worker really is: incarnation, ack counter, loaded weights, pending fault."""

    incarnation: int = 0
    seq: int = 0
    loaded: tuple[int, str] | None = None
    broken: bool = False  # a fault is pending: every load it does comes out corrupt
    serving: tuple[int, str] | None = None  # the weights generation runs on (end-to-end)
    last_sent: WorkerAck | None = None

    def restart(self) -> None:
        """The process died and came back: new incarnation, nothing loaded, fault gone."""
        self.incarnation += 1
        self.seq = 0
        self.loaded = None
        self.serving = None
        self.broken = False
        self.last_sent = None

    def ack(
        self,
        worker_id: str,
        version: int,
        hash_: str,
        attempt: int | None = None,
        token: str | None = None,
    ) -> WorkerAck:
        """Load `version` (hash as actually read) and report it: the next ack in order,
        echoing `token` when it answers a distribution attempt."""
        self.loaded = (version, hash_)
        self.seq += 1
        self.last_sent = WorkerAck(
            worker_id, version, hash_, self.incarnation, self.seq, attempt, token
        )
        return self.last_sent

    def answer(
        self,
        worker_id: str,
        version: int,
        good_hash: str,
        bad_hash: str,
        attempt: int,
        token: str | None,
        *,
        corrupt: bool = False,
    ) -> WorkerAck:
        """Answer a distribution request for (version, attempt), sent with `token`, as a sane
        worker does: its ack echoes the token it was sent.

        A worker that already holds the right weights does not load them again: it re-sends
        its answer to this very request (same token), or answers a new one (a new attempt,
        or a token issued when it re-joined) with what it holds. Reloading good weights into
        bad ones behind an ack already sent is a fault no coordinator can see, so it is not
        part of the model. Otherwise it loads (corrupt while `broken`).
        """
        if self.loaded == (version, good_hash):
            sent = self.last_sent
            if sent is not None and (sent.version, sent.token) == (version, token):
                return sent
            return self.ack(worker_id, version, good_hash, attempt, token)
        bad = self.broken or corrupt
        return self.ack(worker_id, version, bad_hash if bad else good_hash, attempt, token)

    def copy(self) -> WorkerTruth:
        """An independent copy (the liveness check drives copies, never the machine)."""
        return attrs.evolve(self)


# how a report that is stored is named: it answers the current attempt, it reports a version
# that awaits no acks, or it comes from a worker outside the required set
STORED_REASONS = ("counted", "reported", "not_required")


@attrs.define
class ReportRef:
    """The reference model of one worker's stored report: floor and latest stored ack."""

    floor: int = 0
    latest: WorkerAck | None = None
    # the tokens an ack of this worker was counted with: each counts once
    spent: set[str] = attrs.field(factory=set)

    def expect(
        self,
        ack: WorkerAck,
        *,
        member: bool = True,
        awaiting: bool = True,
        token: str | None = None,
        others: frozenset[str] = frozenset(),
    ) -> str:
        """How the coordinator must judge `ack`, written independently of it.

        An ack of a version awaiting acks from a member must echo that worker's token of
        the current attempt (`token`; `others` are the other workers' ones): else it is
        refused for its token. Then reports are ordered by (incarnation, seq), floor first;
        an answer whose token counted once already is a duplicate of the ack still standing,
        else refused as spent; a report that passes is stored, and named by what it is
        (STORED_REASONS). Call `stored` with what the coordinator kept.
        """
        answers = member and awaiting
        if answers:
            if ack.token is None:
                return "missing_attempt_token"
            if ack.token != token:
                return "foreign_attempt_token" if ack.token in others else "stale_attempt_token"
        if ack.incarnation < self.floor:
            return "stale_incarnation"
        if self.latest is not None:
            key = (ack.incarnation, ack.seq)
            latest_key = (self.latest.incarnation, self.latest.seq)
            if key == latest_key:
                same = attrs.evolve(ack, token=None) == attrs.evolve(self.latest, token=None)
                return "duplicate" if same else "conflicting_report"
            if key < latest_key:
                return "out_of_order"
        if answers and ack.token in self.spent:
            standing = self.latest
            if standing is not None and attrs.evolve(ack, seq=None) == attrs.evolve(
                standing, seq=None
            ):
                return "duplicate"
            return "spent_attempt_token"
        if answers:
            return "counted"
        return "reported" if member else "not_required"

    def counted(self, ack: WorkerAck) -> None:
        """`ack` was counted: it is the latest report, and its token is spent."""
        self.latest = ack
        if ack.token is not None:
            self.spent.add(ack.token)

    def restarted(self, incarnation: int) -> None:
        """Raise the floor; a counted ack below it no longer counts."""
        self.floor = max(self.floor, incarnation)
        if self.latest is not None and self.latest.incarnation < self.floor:
            self.latest = None


def activation_ghost_violations(
    events: Sequence[TraceEvent], truth: Mapping[str, WorkerTruth]
) -> list[str]:
    """Every `activate` in `events` whose required workers do not truly hold that artifact."""
    out = []
    for ev in events:
        if not isinstance(ev, ArtifactChanged) or ev.event != "activate":
            continue
        want = (ev.version, ev.after.artifact_hash)
        for w in ev.required_workers:
            real = truth[w].loaded if w in truth else None
            if real != want:
                out.append(
                    f"ghost: v{ev.version}:{(ev.after.artifact_hash or '')[:8]} activated while "
                    f"{w} truly holds {_short(real)} (an ack that no longer held was counted)"
                )
    return out


def _short(loaded: tuple[int, str] | None) -> str:
    return "nothing" if loaded is None else f"v{loaded[0]}:{loaded[1][:8]}"
