"""`demo`: one readable end-to-end run of the protocol on a real ledger file and real artifacts.

Why a demo and not only tests: it shows a new user, in order, every step the CONTRACT asks
for (stamp at dispatch, reward failure as its own state, the two admission gates, one
indivisible batch reservation, a lost compare-and-set, a refused partial activation, a
stale rollout retired) and ends the way a real run should: the stored trace replayed
through the spec invariants. The files stay behind so `rollout-lifecycle ledger ...` can
inspect them afterwards.
"""

from __future__ import annotations

import shlex
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np
import numpy.typing as npt
from rich import box
from rich.console import Console
from rich.table import Table

from rollout_lifecycle.cli.exitcodes import TechnicalError, findings
from rollout_lifecycle.cli.output import (
    check_report_path,
    emit_report,
    ensure_dir,
    make_console,
    program,
    quiet_option,
    report_options,
)
from rollout_lifecycle.cli.params import SEED
from rollout_lifecycle.model.artifacts import ArtifactStore, WorkerLoader
from rollout_lifecycle.model.backends import Backend, open_backend, sqlite_path
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.errors import BackendUnavailable, RolloutLifecycleError
from rollout_lifecycle.model.events import EntryChanged
from rollout_lifecycle.model.gate import (
    AdmissionDecision,
    AdmissionDecisions,
    AdmissionGate,
    GatePolicy,
)
from rollout_lifecycle.model.ledger import Ledger, ReserveRequest
from rollout_lifecycle.model.records import (
    ActionEvidence,
    AdmissionPolicy,
    BehaviorPolicy,
    Disposition,
    GenerationConditions,
    Reward,
    Rollout,
    RolloutIdentity,
)
from rollout_lifecycle.model.registry import set_admission_policy
from rollout_lifecycle.spec.invariants import check_trace

__all__ = ["demo"]

WORKERS = ("worker-0", "worker-1", "worker-2")
MAX_LAG = 1
MAX_DRIFT = 0.2  # the CONTRACT's reference D_max
CONDITIONS = GenerationConditions("demo-tokenizer", 1.0, 1.0, -1, 16, seed=7)
REWARD_FN = ("exact-match", "1")
N_ROLLOUTS = 8
DRIFTING = "r3"  # its current log-probs move far from the behaviour ones
TIMED_OUT = "r5"  # the reward service never answers for it
LATE = "r7"  # its reward arrives only after v1 is active


class _Demo:
    """The demo's state; each method is one step of the story and prints one line or a few."""

    def __init__(
        self, backend: Backend, store: ArtifactStore, seed: int, narrate: Console | None = None
    ) -> None:
        # the story goes to stdout, or to stderr under --json (stdout is the report), or
        # nowhere under --quiet
        self.narrate = narrate if narrate is not None else make_console()
        self.backend = backend
        self.ledger: Ledger = backend.ledger
        self.store = store
        self.rng = np.random.default_rng(seed)
        set_admission_policy(
            backend.registry, AdmissionPolicy(MAX_LAG, MAX_DRIFT), "set by the operator"
        )
        self.coordinator = ActivationCoordinator(
            backend.registry,
            WORKERS,
            ledger=backend.ledger,
            policy=AdmissionPolicy(MAX_LAG, MAX_DRIFT),
        )
        self.loaders = {w: WorkerLoader(store, w) for w in WORKERS}
        self.gate = AdmissionGate(
            GatePolicy(MAX_LAG, MAX_DRIFT, CONDITIONS), self.coordinator.activated_hash
        )
        self.rollouts: dict[str, Rollout] = {}
        self.last: dict[str, AdmissionDecision] = {}
        self.weights: dict[str, npt.NDArray[np.float32]] = {}
        self.step_no = 0

    def say(self, text: str) -> None:
        self.step_no += 1
        self.echo(f"[{self.step_no:2d}] {text}")

    def echo(self, text: str) -> None:
        self.narrate.print(text, markup=False, highlight=False, soft_wrap=True)

    # ---- policy activation ---------------------------------------------------------------

    def publish(self, version: int, hold_back: int = 0) -> str:
        """Write, commit, distribute and activate `version`; `hold_back` acks come late."""
        if version == 0:
            self.weights = {
                "policy.weight": self.rng.normal(0, 0.1, (8, 8)).astype(np.float32),
                "policy.bias": np.zeros(8, dtype=np.float32),
            }
        else:
            self.weights = {
                k: (v + self.rng.normal(0, 0.01, v.shape)).astype(np.float32)
                for k, v in self.weights.items()
            }
        stored = self.store.write(version, tensors=self.weights, label=f"demo-v{version}")
        h = stored.artifact_hash
        self.coordinator.prepare(version, parent_version=version - 1 if version else None)
        self.coordinator.commit_artifact(version, h, str(stored.path))
        self.coordinator.distribute(version)
        self.say(
            f"v{version}: wrote {len(self.weights)} tensors to {stored.path.name}/, hash "
            f"{h[:12]}…; prepared, committed, distributing to {len(WORKERS)} workers"
        )
        acked = WORKERS[: len(WORKERS) - hold_back]
        self._load_and_ack(version, h, acked)
        if hold_back:
            r = self.coordinator.try_activate(version)
            ptr = r.active_pointer.version if r.active_pointer else None
            late = ", ".join((*r.missing_workers, *r.mismatched_workers))
            self.say(
                f"v{version}: {len(acked)}/{len(WORKERS)} acks -> activation refused "
                f"({r.reason}: {late} still reports an older version); pointer stays at v{ptr}"
            )
            self._load_and_ack(version, h, WORKERS[len(acked) :])
        r = self.coordinator.try_activate(version)
        if not r.activated:
            raise click.ClickException(f"demo: v{version} did not activate ({r.reason})")
        before = "" if version == 0 else f"; v{version - 1} superseded"
        self.say(f"v{version}: all {len(WORKERS)} workers acked the same hash -> active{before}")
        return h

    def _load_and_ack(self, version: int, h: str, workers: Sequence[str]) -> None:
        for w in workers:
            # the token of this distribution attempt travels with the weights; the loader
            # echoes it in the ack it builds from the bytes it read
            token = self.coordinator.attempt_token(w, version)
            loaded, ack = self.loaders[w].load(version, h, token=token)
            same = all(np.array_equal(loaded.tensors[k], v) for k, v in self.weights.items())
            if not same:
                raise click.ClickException(f"demo: {w} loaded different tensors for v{version}")
            result = self.coordinator.record_ack(ack)
            self.echo(
                f"     {w}: loaded v{version}, recomputed hash {ack.artifact_hash[:12]}…, "
                f"tensors match; ack {result.reason}"
            )

    # ---- rollouts ------------------------------------------------------------------------

    def dispatch(self, version: int, h: str) -> None:
        for i in range(N_ROLLOUTS):
            rid = f"r{i}"
            n = int(self.rng.integers(6, 11))
            mask = [j > 0 for j in range(n)]  # token 0 is a forced prefix, not an action
            ro = Rollout(
                RolloutIdentity(rid, f"q{i // 2}", "demo-arith", i % 2),
                BehaviorPolicy(version, h),
                CONDITIONS,
                ActionEvidence(
                    [int(t) for t in self.rng.integers(0, 1000, n)],
                    mask,
                    [float(x) for x in self.rng.normal(-1.0, 0.4, n)],
                ),
            )
            self.rollouts[rid] = ro
            self.ledger.add(ro)
        self.say(
            f"dispatched {N_ROLLOUTS} rollouts r0..r{N_ROLLOUTS - 1}, stamped at dispatch with "
            f"v{version}/{h[:12]}…"
        )

    def generate_and_reward(self) -> None:
        for rid in self.rollouts:
            e = self.ledger.get(rid)
            self.ledger.transition(rid, "generation_done", e.revision)
        scored = []
        for rid in self.rollouts:
            e = self.ledger.get(rid)
            if rid == TIMED_OUT:
                self.ledger.transition(
                    rid,
                    "reward_timeout",
                    e.revision,
                    disposition=Disposition("reward", "timeout", "no answer within 30 s"),
                )
            elif rid != LATE:
                value = float(self.rng.integers(0, 2))
                self.ledger.transition(
                    rid, "reward_ready", e.revision, reward=Reward(*REWARD_FN, value)
                )
                scored.append(rid)
        self.say(
            f"generation done for all; rewards for {len(scored)}; {TIMED_OUT}: reward timeout "
            f"recorded as its own failure (stage 'reward', never a reward of 0); {LATE}: "
            "reward still pending"
        )

    def reward_late(self) -> None:
        e = self.ledger.get(LATE)
        self.ledger.transition(LATE, "reward_ready", e.revision, reward=Reward(*REWARD_FN, 1.0))
        self.say(f"{LATE}: its reward finally arrives (rewarded, still stamped v0)")

    def current_log_probs(self, ids: Sequence[str]) -> npt.NDArray[np.float64]:
        """What the current policy gives the same tokens: close, except for the drifting one."""
        t = max(len(self.rollouts[r].evidence.behavior_log_probs) for r in ids)  # type: ignore[union-attr]
        out = np.zeros((len(ids), t), dtype=np.float64)
        for i, rid in enumerate(ids):
            ev = self.rollouts[rid].evidence
            assert ev is not None
            old = np.asarray(ev.behavior_log_probs)
            noise = 0.8 if rid == DRIFTING else 0.02
            out[i, : old.size] = old + self.rng.normal(0, noise, old.size)
        return out

    def admit(self, ids: Sequence[str]) -> AdmissionDecisions:
        pointer = self.coordinator.pointer()
        assert pointer is not None
        cv = pointer.version
        decisions = self.gate.assess_batch(
            [self.rollouts[r] for r in ids],
            self.current_log_probs(ids),
            cv,
            [self.ledger.get(r) for r in ids],
        )
        self.say(
            f"admission at v{cv} (L_max {MAX_LAG}, D_max {MAX_DRIFT}) over {len(ids)} rollouts:"
        )
        for d in decisions:
            self.last[d.rollout_id] = d
            drift = "   n/a" if d.drift is None else f"{d.drift:6.3f}"
            verdict = "admit" if d.accepted else f"{d.reason} -> {d.route}"
            self.echo(
                f"     {d.rollout_id}: lag {d.lag} ({d.freshness or 'n/a'}), drift {drift}: "
                f"{verdict}"
            )
        return decisions

    def reserve_and_commit(self, update_id: str, decisions: Sequence[AdmissionDecision]) -> None:
        admitted = [d for d in decisions if d.accepted]
        requests = [
            ReserveRequest(d.rollout_id, self.ledger.get(d.rollout_id).revision, d.stamp())
            for d in admitted
        ]
        outcomes = self.ledger.reserve_batch(update_id, requests)
        won = [o.rollout_id for o in outcomes if o.reserved]
        self.say(
            f"{update_id} reserves {len(won)}/{len(requests)} admitted rollouts in one "
            f"reserve_batch (compare-and-set on each revision): {', '.join(won)}"
        )
        if update_id == "update-1" and requests:
            # a second learner that read r0 before update-1 reserved it: its CAS must lose
            first = requests[0]
            race = self.ledger.reserve(
                first.rollout_id,
                first.expected_revision,
                "learner-b",
                first.admission,
            )
            self.say(
                f"learner-b tries {first.rollout_id} with the revision it read before: "
                f"{race.reason}, nothing written (still owned by "
                f"{self.ledger.get(first.rollout_id).reserved_by})"
            )
        consumed = self.ledger.commit(update_id, won)
        self.say(f"{update_id} commits: {len(consumed)} consumed exactly once")

    def handle_others(self, decisions: Sequence[AdmissionDecision]) -> None:
        """Route what was not admitted: stale -> offline buffer, contradictions -> quarantine."""
        for d in decisions:
            event = {"offline": "retire_stale", "quarantine": "quarantine"}.get(d.route)
            if event is None:
                continue
            e = self.ledger.get(d.rollout_id)
            after = self.ledger.transition(d.rollout_id, event, e.revision)
            self.say(f"{d.rollout_id}: {d.reason} -> route {d.route}: now {after.state}")

    # ---- the end -------------------------------------------------------------------------

    def final_table(self) -> None:
        entries = self.ledger.snapshot()
        stamps = ", ".join(f"v{v}" for v in sorted({e.behavior_version for e in entries.values()}))
        table = Table(
            title=f"rollouts at the end of the demo (stamped {stamps})", box=box.SIMPLE_HEAD
        )
        for col in ("rollout", "state", "rev", "last admission", "consumed by / failure"):
            table.add_column(col, no_wrap=True)
        for rid, e in entries.items():
            d = self.last.get(rid)
            adm = "-" if d is None else f"v{d.current_version} {d.reason}"
            who = "-"
            if e.disposition is not None:
                who = f"{e.disposition.stage}: {e.disposition.cause}"
            elif e.state == "consumed":
                ups = [
                    ev.update_id
                    for ev in self.ledger.history(rid)
                    if isinstance(ev, EntryChanged) and ev.event == "commit"
                ]
                who = ups[-1] if ups and ups[-1] else "?"
            table.add_row(rid, e.state, str(e.revision), adm, who)
        self.narrate.print(table)


def _check_fresh(url: str | None, workdir: Path | None) -> None:
    if workdir is not None:
        ensure_dir(workdir, "--workdir")
    """Refuse a ledger file or artifact store that already exists: the demo writes new ones."""
    if workdir is not None:
        artifacts = workdir / "artifacts"
        if artifacts.exists() and any(artifacts.iterdir()):
            raise click.UsageError(
                f"--workdir: {artifacts} is not empty; artifacts are immutable, use a new directory"
            )
    if url is not None and url.startswith("sqlite:"):
        try:
            path = sqlite_path(url)
        except RolloutLifecycleError as exc:
            raise click.UsageError(f"--backend: {exc}") from None
        if path.exists():
            raise click.UsageError(
                f"--backend {url}: {path} already exists; the demo writes a fresh ledger, "
                "give a new file name"
            )


@click.command("demo")
@click.option(
    "--backend",
    "url",
    default=None,
    help="Ledger URL to write (a new file) [default: sqlite:///<new temp dir>/demo.db].",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Directory for the artifacts (under artifacts/) [default: the new temp dir].",
)
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the synthetic data.")
@report_options
@quiet_option
def demo(
    url: str | None,
    workdir: Path | None,
    seed: int,
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """Run the whole protocol once on SQLite with real artifacts, then check the trace.

    --json prints a report (the trace check, every rollout's final state, where the files
    are) instead of the story, which then goes to stderr; --quiet drops the story.
    """
    check_report_path(report_path)
    _check_fresh(url, workdir)
    tmp: Path | None = None
    if url is None:
        tmp = Path(tempfile.mkdtemp(prefix="rollout-lifecycle-demo-"))
        url = f"sqlite:///{tmp / 'demo.db'}"
    try:
        backend = open_backend(url)
    except BackendUnavailable as exc:
        raise TechnicalError(f"--backend: {exc}") from None
    except RolloutLifecycleError as exc:
        raise click.UsageError(f"--backend: {exc}") from None
    try:
        if workdir is None:
            workdir = tmp or Path(tempfile.mkdtemp(prefix="rollout-lifecycle-demo-"))
        artifacts = workdir / "artifacts"
        narrate = make_console(stderr=as_json, quiet=quiet)
        data = _story(backend, ArtifactStore(artifacts), seed, url, artifacts, narrate)
    except BackendUnavailable as exc:
        raise TechnicalError(f"demo failed: {exc}") from None
    except RolloutLifecycleError as exc:
        raise click.ClickException(f"demo failed: {exc}") from None
    finally:
        backend.close()
    emit_report(data, as_json=as_json, report_path=report_path, console=make_console(True))
    if data["trace"]["violations"]:
        raise findings()


def _story(
    backend: Backend,
    store: ArtifactStore,
    seed: int,
    url: str,
    artifacts: Path,
    narrate: Console | None = None,
) -> dict[str, Any]:
    """Tell the story; return the demo's report."""
    d = _Demo(backend, store, seed, narrate)
    d.say(f"ledger and registry at {url}; artifacts in {artifacts}")
    h0 = d.publish(0)
    d.dispatch(0, h0)
    d.generate_and_reward()
    first = d.admit(list(d.rollouts))
    d.reserve_and_commit("update-1", first)
    d.handle_others(first)
    d.publish(1, hold_back=1)
    d.reward_late()
    second = d.admit([LATE, DRIFTING])
    d.reserve_and_commit("update-2", second)
    d.handle_others(second)
    d.publish(2)
    third = d.admit([r for r, e in backend.ledger.snapshot().items() if e.state == "rewarded"])
    d.handle_others(third)
    report = check_trace(backend.trace(), quiescent=True)
    for v in report.violations:
        d.echo(f"     {v}")
    d.say(
        f"trace check: replayed {report.events} events in {report.steps} atomic steps against "
        f"{len(report.checked)} invariants: {len(report.violations)} violations"
    )
    d.final_table()
    # the command that runs THIS program (after `make demo` it is not on PATH)
    inspect = f"{program()} ledger history {DRIFTING} --backend {shlex.quote(url)}"
    if url.startswith("sqlite:"):
        d.echo(f"inspect it: {inspect}")
    return {
        "schema": "rollout-lifecycle/demo/1",
        "backend": url,
        "artifacts": str(artifacts),
        "seed": seed,
        "trace": {
            "events": report.events,
            "steps": report.steps,
            "invariants": len(report.checked),
            "violations": [str(v) for v in report.violations],
        },
        "rollouts": {
            rid: {"state": e.state, "revision": e.revision}
            for rid, e in backend.ledger.snapshot().items()
        },
        "inspect": inspect if url.startswith("sqlite:") else None,
    }
