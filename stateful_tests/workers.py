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

    def ack(self, worker_id: str, version: int, hash_: str, attempt: int) -> WorkerAck:
        """Load `version` (hash as actually read) and report it: the next ack in order."""
        self.loaded = (version, hash_)
        self.seq += 1
        self.last_sent = WorkerAck(worker_id, version, hash_, self.incarnation, self.seq, attempt)
        return self.last_sent

    def answer(
        self,
        worker_id: str,
        version: int,
        good_hash: str,
        bad_hash: str,
        attempt: int,
        *,
        corrupt: bool = False,
    ) -> WorkerAck:
        """Answer a distribution request for (version, attempt), as a sane worker does.

        A worker that already holds the right weights does not load them again: it re-sends
        its answer for this attempt, or answers a new attempt with what it holds. Reloading
        good weights into bad ones behind an ack already sent is a fault no coordinator can
        see, so it is not part of the model. Otherwise it loads (corrupt while `broken`).
        """
        if self.loaded == (version, good_hash):
            sent = self.last_sent
            if sent is not None and (sent.version, sent.attempt) == (version, attempt):
                return sent
            return self.ack(worker_id, version, good_hash, attempt)
        bad = self.broken or corrupt
        return self.ack(worker_id, version, bad_hash if bad else good_hash, attempt)

    def copy(self) -> WorkerTruth:
        """An independent copy (the liveness check drives copies, never the machine)."""
        return attrs.evolve(self)


@attrs.define
class ReportRef:
    """The reference model of one worker's stored report: floor and latest counted ack."""

    floor: int = 0
    latest: WorkerAck | None = None

    def expect(self, ack: WorkerAck) -> str:
        """How the coordinator must judge `ack`: ordered by (incarnation, seq), floor first."""
        if ack.incarnation < self.floor:
            return "stale_incarnation"
        if self.latest is None:
            return "counted"
        key = (ack.incarnation, ack.seq)
        latest_key = (self.latest.incarnation, self.latest.seq)
        if key == latest_key:
            return "duplicate" if ack == self.latest else "conflicting_report"
        return "counted" if key > latest_key else "out_of_order"

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
