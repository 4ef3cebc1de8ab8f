"""Activation with real artifacts: written, damaged on disk, loaded, hashed, acked.

The other machines ack abstract hashes; here the trainer publishes each version through
the real `ArtifactStore` (safetensors + manifest, atomic, immutable), faults damage the
published files the way disks and copies do (truncate, flip a byte, swap two versions'
weights), and each worker loads through the real `WorkerLoader`, which acks only the hash
of the bytes it read. The ghost truth is computed here, independently: the sha256 of the
files each worker actually read. A loader that acks the registered hash instead of what it
read activates damaged weights, and the ghost check says so; an honest one refuses.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rollout_lifecycle.model import artifacts as artifacts_mod
from rollout_lifecycle.model.errors import ActivationError, ArtifactError
from rollout_lifecycle.model.ledger import ManualClock
from rollout_lifecycle.stateful_tests.backends import (
    Stack,
    bind_machine,
    close_stack,
    end_example,
    open_stack,
)
from rollout_lifecycle.stateful_tests.recording import (
    Recorder,
    TraceChecker,
    check_snapshot,
    raise_violations,
    world_of,
)

WORKERS = ("w0", "w1")
MAX_VERSIONS = 4
INVARIANT_NAMES = ("spec_holds",)
FAULTS = ("truncate", "flip_byte", "swap")


def _tensors(version: int) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(version)
    return {"layer.weight": rng.standard_normal((4, 8)).astype(np.float32)}


def read_hash(store: artifacts_mod.ArtifactStore, version: int) -> str | None:
    """The content hash of the files as they are on disk now (the ghost's own reading)."""
    try:
        manifest = store.read_manifest(version)
        entries = []
        for f in manifest.files:
            data = (store.path_for(version) / f.name).read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            entries.append(artifacts_mod.FileEntry(f.name, len(data), digest))
        return artifacts_mod.content_hash(entries)
    except (OSError, ArtifactError):
        return None


class ArtifactMachine(RuleBasedStateMachine):
    """A trainer publishing real artifacts, faults on the files, two loading workers."""

    backend: ClassVar[str] = "memory"
    recorder: ClassVar[Recorder]
    workdir: ClassVar[Path | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.recorder.start_example()
        self.tmp = Path(tempfile.mkdtemp(prefix="artifact-machine-", dir=self.workdir))
        self.clock = ManualClock(0.0)
        self.stack: Stack = open_stack(self.backend, self.tmp, self.clock, WORKERS)
        self.store = artifacts_mod.ArtifactStore(self.tmp / "artifacts")
        self.pristine = self.tmp / "pristine"  # a copy to repair damaged files from
        self.loaders = {w: artifacts_mod.WorkerLoader(self.store, w) for w in WORKERS}
        self.truth: dict[str, tuple[int, str | None] | None] = {w: None for w in WORKERS}
        self.damaged: set[int] = set()
        self.checker = TraceChecker(self.recorder, with_registry=True)

    @property
    def coord(self) -> Any:
        """The live coordinator."""
        return self.stack.coordinator

    def _awaiting(self) -> Any:
        recs = [a for a in self.coord.artifacts() if a.state == "awaiting_acks"]
        return recs[0] if recs else None

    # ---- the trainer -------------------------------------------------------------------

    @rule()
    @precondition(
        lambda self: self._awaiting() is None and len(self.coord.artifacts()) < MAX_VERSIONS
    )
    def publish(self) -> None:
        """Write the next version through the store, commit its hash, distribute it."""
        self.recorder.fired("publish")
        top = self.coord.registry.max_version()
        v = 0 if top is None else top + 1
        self.coord.prepare(v)
        stored = self.store.write(v, tensors=_tensors(v), label=f"v{v}")
        self.coord.commit_artifact(v, stored.artifact_hash, str(stored.path))
        shutil.copytree(stored.path, self.pristine / str(v))
        try:
            self.coord.distribute(v)
        except ActivationError:
            self.coord.abandon(v, "overtaken")

    # ---- the files ---------------------------------------------------------------------

    @rule(fault=st.sampled_from(FAULTS), at=st.integers(min_value=0, max_value=10_000))
    @precondition(lambda self: self._awaiting() is not None)
    def damage(self, fault: str, at: int) -> None:
        """Damage the awaited version's weights on disk (as a bad copy or disk would)."""
        self.recorder.fired("damage")
        rec = self._awaiting()
        path = self.store.path_for(rec.version) / artifacts_mod.WEIGHTS_NAME
        data = bytearray(path.read_bytes())
        if fault == "truncate":
            data = data[: at % max(1, len(data))]
        elif fault == "flip_byte":
            if not data:
                return
            data[at % len(data)] ^= 0x01
        else:
            others = [v for v in self.store.versions() if v != rec.version]
            if not others:
                return
            other = self.store.path_for(others[at % len(others)]) / artifacts_mod.WEIGHTS_NAME
            data = bytearray(other.read_bytes())
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        self.damaged.add(rec.version)
        self.recorder.reached("artifact_damaged")

    @rule()
    @precondition(lambda self: bool(self.damaged))
    def repair(self) -> None:
        """Restore damaged files from the pristine copy (an operator re-syncs the store)."""
        self.recorder.fired("repair")
        for v in sorted(self.damaged):
            dst = self.store.path_for(v) / artifacts_mod.WEIGHTS_NAME
            dst.chmod(0o644)
            dst.write_bytes((self.pristine / str(v) / artifacts_mod.WEIGHTS_NAME).read_bytes())
        self.damaged.clear()

    # ---- the workers -------------------------------------------------------------------

    @rule(w=st.sampled_from(WORKERS))
    @precondition(lambda self: self._awaiting() is not None)
    def load(self, w: str) -> None:
        """The worker loads through the real loader and acks what it read (or nothing)."""
        self.recorder.fired("load")
        rec = self._awaiting()
        really = read_hash(self.store, rec.version)  # the ghost's own reading
        token = self.coord.attempt_token(w, rec.version)  # sent with the weights
        try:
            _loaded, ack = self.loaders[w].load(
                rec.version, rec.artifact_hash, token=token, attempt=rec.attempts
            )
        except ArtifactError:
            # a failed load stages nothing: the worker keeps what it held, and acks nothing
            self.recorder.reached("damaged_load_refused")
            return
        self.truth[w] = (rec.version, really)
        res = self.coord.record_ack(ack)
        # a token counts once: a second good load in the same attempt says what the counted
        # ack already says (the loader refuses damaged bytes), so it is a duplicate of it
        if not res.counted and res.reason != "duplicate":
            raise self.recorder.fail(f"{w}'s ack of its fresh load was refused: {res.reason}")

    @rule()
    @precondition(lambda self: self._awaiting() is not None)
    def activate(self) -> None:
        """Try to flip the pointer; the ghost judges the workers' real bytes when it does."""
        self.recorder.fired("activate")
        rec = self._awaiting()
        res = self.coord.try_activate(rec.version)
        if res.activated:
            for w in WORKERS:
                if self.truth[w] != (rec.version, rec.artifact_hash):
                    raise self.recorder.fail(
                        f"ghost: v{rec.version} activated while {w} really read "
                        f"{self.truth[w]} (committed {rec.artifact_hash[:12]})"
                    )

    @rule()
    @precondition(lambda self: self._awaiting() is not None)
    def fail(self) -> None:
        """The distribution times out; the trainer retries (after a repair) or gives up."""
        self.recorder.fired("fail")
        rec = self._awaiting()
        self.coord.fail_distribution(rec.version, "ack_timeout")
        try:
            self.coord.retry(rec.version)
        except ActivationError:
            self.coord.abandon(rec.version, "overtaken")

    @rule()
    def settle(self) -> None:
        """Nothing pending may be all there is (keeps Hypothesis from refusing the state)."""
        self.recorder.fired("settle")

    @invariant()
    def spec_holds(self) -> None:
        """The spec's invariants on the new trace steps and the stored state."""
        rec = self.recorder
        raise_violations(rec, "trace", self.checker.feed(self.stack.source.new_events()))
        reg = self.stack.registry
        led = self.stack.ledger
        world = world_of(led.snapshot(), reg.artifacts(), reg.pointer(), reg, led)
        raise_violations(rec, "stores", check_snapshot(rec, world))
        if self.checker.world != world:
            raise rec.fail("the trace's after-images differ from the stored records")

    def teardown(self) -> None:
        """Close and delete; never raise over the real failure."""
        end_example(self.recorder, self.tmp, [lambda: close_stack(self.stack)])


def make_artifact_machine(
    backend: str = "memory",
    *,
    recorder: Recorder | None = None,
    workdir: Path | None = None,
) -> type[RuleBasedStateMachine]:
    """Real-artifact activation on 'memory', 'sqlite' or PostgreSQL (the records live in the
    backend; the artifact files in a temporary folder)."""
    return bind_machine(
        ArtifactMachine,
        backend,
        machine="artifacts",
        recorder=recorder,
        recorder_name="artifacts",
        workdir=workdir,
    )
