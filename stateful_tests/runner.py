"""Programmatic fuzz campaigns over the three machines: what `rollout-lifecycle fuzz` runs.

A campaign runs each named machine through Hypothesis with a settings profile, either once
(`examples`) or in batches with fresh seeds until a time budget is spent, and reports what
it saw: examples, steps, rules fired, declared edges covered (every declared edge listed,
0 when never taken), invariant checks run, sometimes-properties reached (zeros included),
and the first failure with the shrunk program Hypothesis printed (then minimised further by
replaying it with steps deleted), saved as a replayable Python file under `workdir`.

Deterministic with a seed: batch k of machine m runs with a seed derived from (seed, m, k)
and no example database. Without a seed, a time-budgeted campaign draws a base seed and
reports it, so any run can be repeated.

Infrastructure is not a finding: when the backend cannot be reached, the server dies or the
disk fills up under a machine, `run_campaign` raises `InfrastructureFailure` naming the
cause; no program is saved and no machine is marked failed (nothing was judged).
"""

from __future__ import annotations

import contextlib
import random
import re
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import attrs
from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.reporting import with_reporter
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from rollout_lifecycle.model.atomic import atomic_write
from rollout_lifecycle.spec.invariants import SOMETIMES
from rollout_lifecycle.stateful_tests import (
    activation_machine,
    artifact_machine,
    e2e_machine,
    ledger_machine,
    seams_machine,
)
from rollout_lifecycle.stateful_tests.backends import LedgerFactory, resolve_factory, stack_backend
from rollout_lifecycle.stateful_tests.infrastructure import (
    InfrastructureFailure as InfrastructureFailure,
)
from rollout_lifecycle.stateful_tests.infrastructure import (
    InfrastructureStop,
    infrastructure_cause,
)
from rollout_lifecycle.stateful_tests.minimize import minimize
from rollout_lifecycle.stateful_tests.profiles import register_profiles
from rollout_lifecycle.stateful_tests.recording import DECLARED, Recorder

MACHINES = ("ledger", "activation", "e2e", "seams", "artifacts")
# the README campaign's fuzz budget (`make campaign`): enough to take every declared edge and
# reach every sometimes-property on the default seed, on either backend (tests check it)
README_EXAMPLES = 200
README_SEED = 20261130
README_BACKEND = "sqlite"
README_RACE_SECONDS = 20.0  # the campaign's race stage: 1 activator, 3 learner processes
PROFILES = ("ci", "dev", "fuzz")
SCHEMA = "rollout-lifecycle/fuzz-report/1"
BATCH_EXAMPLES = 25  # examples per batch when a time budget drives the campaign
PROGRESS_EVERY_S = 0.25

_MODULES = {
    "ledger": ("rollout_lifecycle.stateful_tests.ledger_machine", "make_ledger_machine"),
    "activation": (
        "rollout_lifecycle.stateful_tests.activation_machine",
        "make_activation_machine",
    ),
    "e2e": ("rollout_lifecycle.stateful_tests.e2e_machine", "make_e2e_machine"),
    "seams": ("rollout_lifecycle.stateful_tests.seams_machine", "make_seams_machine"),
    "artifacts": ("rollout_lifecycle.stateful_tests.artifact_machine", "make_artifact_machine"),
}
_INVARIANT_NAMES = {
    "ledger": ledger_machine.INVARIANT_NAMES,
    "activation": activation_machine.INVARIANT_NAMES,
    "e2e": e2e_machine.INVARIANT_NAMES,
    "seams": seams_machine.INVARIANT_NAMES,
    "artifacts": artifact_machine.INVARIANT_NAMES,
}


class BudgetSpent(BaseException):
    """Raised when a machine starts its example number `stop_after + 1`: the batch ends
    there, as if Hypothesis's `max_examples` had been reached, but the examples before it
    were generated exactly as under the full `max_examples` (a smaller `max_examples` makes
    Hypothesis generate a different sequence). A BaseException, so Hypothesis stops."""


@attrs.define
class _RunState:
    """What the hooks of one batch share: whether an example of it has failed (after a
    failure every example is a shrinking attempt, which a budget never cuts short)."""

    failed: bool = False


def _guarded(cls: type[RuleBasedStateMachine], state: _RunState) -> type[RuleBasedStateMachine]:
    """`cls` whose construction turns an infrastructure error into `InfrastructureStop`
    (a BaseException, so Hypothesis stops at once instead of shrinking against a dead server):
    when the server died under a rule, the shrinker's next machine cannot connect, and the
    run stops there instead of shrinking for minutes. It also notes in `state` when an
    example failed (teardown runs in Hypothesis's `finally`, so it sees the exception)."""

    class Guarded(cls):  # type: ignore[valid-type,misc]
        def __init__(self) -> None:
            try:
                super().__init__()
            except Exception as exc:
                cause = infrastructure_cause(exc)
                if cause is None:
                    state.failed = True
                    raise
                raise InfrastructureStop(cause) from exc

        def teardown(self) -> None:
            failure = sys.exc_info()[1]
            if isinstance(failure, Exception):
                state.failed = True
            super().teardown()

    Guarded.__name__ = cls.__name__
    Guarded.__qualname__ = cls.__qualname__
    return Guarded


@attrs.frozen
class ProgressEvent:
    """A campaign heartbeat: phase is start, example, batch, failure or done."""

    machine: str
    phase: str
    examples: int
    steps: int
    elapsed_s: float
    batch: int
    budget_s: float | None


@attrs.frozen
class Failure:
    """The first failure of a machine: what failed and the shrunk program that shows it."""

    machine: str
    backend: str
    exception: str
    program: str
    program_path: str
    program_steps: int
    seed: int | None
    batch: int

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict."""
        return attrs.asdict(self)


@attrs.define
class MachineRun:
    """What one machine did during the campaign."""

    machine: str
    backend: str
    examples: int = 0
    steps: int = 0
    rules: dict[str, int] = attrs.field(factory=dict)
    elapsed_s: float = 0.0
    batches: int = 0
    seeds: list[int | None] = attrs.field(factory=list)
    examples_until_failure: int | None = None
    failure: Failure | None = None
    # goal -> the example of this machine that first reached it
    first_reached: dict[str, int] = attrs.field(factory=dict)

    @property
    def steps_per_s(self) -> float:
        """Rule executions per second, shrinking included."""
        return self.steps / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict."""
        return {
            "machine": self.machine,
            "backend": self.backend,
            "examples": self.examples,
            "steps": self.steps,
            "rules": dict(sorted(self.rules.items())),
            "elapsed_s": round(self.elapsed_s, 3),
            "steps_per_s": round(self.steps_per_s, 1),
            "batches": self.batches,
            "seeds": list(self.seeds),
            "examples_until_failure": self.examples_until_failure,
            "failure": None if self.failure is None else self.failure.to_json(),
            "first_reached": dict(sorted(self.first_reached.items())),
        }


@attrs.define
class CampaignReport:
    """Everything a campaign observed; `to_json()` is the report the CLI and diagrams read."""

    backend: str
    profile: str
    seed: int | None
    steps_per_example: int
    examples_requested: int | dict[str, int] | None
    time_budget_s: float | None
    mutant: str | None
    elapsed_s: float
    runs: dict[str, MachineRun]
    edges: dict[str, dict[str, int]]
    invariants: dict[str, int]
    sometimes: dict[str, int]
    notes: dict[str, int]
    # goal ("lifecycle: edge" or a sometimes-property) -> (machine, example that reached it)
    first_reached: dict[str, tuple[str, int]] = attrs.field(factory=dict)

    @property
    def failures(self) -> list[Failure]:
        """Every machine's failure, in campaign order."""
        return [r.failure for r in self.runs.values() if r.failure is not None]

    @property
    def failure(self) -> Failure | None:
        """The first failure, or None."""
        fs = self.failures
        return fs[0] if fs else None

    @property
    def violations(self) -> int:
        """How many machines failed (each stops at its first failure)."""
        return len(self.failures)

    def coverage(self) -> dict[str, dict[str, Any]]:
        """`{"lifecycle": {"edges": {...}, "declared": N, "covered": M}, "activation": ...}`."""
        out: dict[str, dict[str, Any]] = {}
        for name, counts in self.edges.items():
            out[name] = {
                "edges": dict(counts),
                "declared": len(counts),
                "covered": sum(1 for n in counts.values() if n > 0),
            }
        return out

    def uncovered(self) -> dict[str, list[str]]:
        """Declared edges never taken, per machine."""
        return {m: [e for e, n in c.items() if n == 0] for m, c in self.edges.items()}

    def unreached(self) -> list[str]:
        """Sometimes-properties never reached."""
        return [name for name, n in self.sometimes.items() if n == 0]

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (``json.dumps(report.to_json())``)."""
        return {
            "schema": SCHEMA,
            "backend": self.backend,
            "profile": self.profile,
            "seed": self.seed,
            "steps_per_example": self.steps_per_example,
            "examples_requested": (
                dict(self.examples_requested)
                if isinstance(self.examples_requested, Mapping)
                else self.examples_requested
            ),
            "time_budget_s": self.time_budget_s,
            "mutant": self.mutant,
            "elapsed_s": round(self.elapsed_s, 3),
            "runs": {m: r.to_json() for m, r in self.runs.items()},
            "machines": self.coverage(),
            "source": f"fuzz: {', '.join(self.runs)} on {self.backend} (times each edge fired)",
            "invariants": dict(sorted(self.invariants.items())),
            "sometimes": dict(self.sometimes),
            "notes": dict(sorted(self.notes.items())),
            "first_reached": {k: list(v) for k, v in sorted(self.first_reached.items())},
            "violations": self.violations,
            "failure": None if self.failure is None else self.failure.to_json(),
        }


def _batch_seed(base: int, machine: str, batch: int) -> int:
    return (base * 1_000_003 + zlib.crc32(machine.encode()) * 7_919 + batch) % (2**32)


def _machine_class(
    machine: str, backend: str | LedgerFactory, recorder: Recorder, workdir: Path
) -> tuple[type[RuleBasedStateMachine], str]:
    """The machine class bound to its backend; activation/e2e run on memory for a factory."""
    if machine == "ledger":
        label, factory = resolve_factory(backend)
        cls = ledger_machine.make_ledger_machine(factory, recorder=recorder, workdir=workdir)
        return cls, label
    stack = stack_backend(backend)
    if machine == "activation":
        return (
            activation_machine.make_activation_machine(stack, recorder=recorder, workdir=workdir),
            stack,
        )
    if machine == "e2e":
        return e2e_machine.make_e2e_machine(stack, recorder=recorder, workdir=workdir), stack
    if machine == "seams":
        return seams_machine.make_seams_machine(stack, recorder=recorder, workdir=workdir), stack
    if machine == "artifacts":
        cls = artifact_machine.make_artifact_machine(stack, recorder=recorder, workdir=workdir)
        return cls, stack
    raise ValueError(f"unknown machine {machine!r}: choose from {list(MACHINES)}")


def _settings(profile: str, examples: int, steps: int, seeded: bool, shrink: bool) -> settings:
    register_profiles()
    base = settings.get_profile(profile)
    phases = base.phases if shrink else tuple(p for p in base.phases if p is not Phase.shrink)
    return settings(
        base,
        phases=phases,
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=base.derandomize and not seeded,
        database=None if seeded else base.database,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        print_blob=False,
        verbosity=max(base.verbosity, Verbosity.normal),
    )


_CALL = re.compile(r"^(?:[\w(),\s]+ = )?state\.(\w+)\(")


def program_steps(program: str, invariant_names: Sequence[str] = ()) -> int:
    """How many rule calls a printed program makes (invariant checks and teardown excluded)."""
    skip = {"teardown", *invariant_names}
    n = 0
    for line in program.splitlines():
        m = _CALL.match(line.strip())
        if m is not None and m.group(1) not in skip:
            n += 1
    return n


def _program_lines(reported: list[str]) -> list[str]:
    lines: list[str] = []
    for chunk in reported:
        for line in str(chunk).splitlines():
            if line.startswith("state") or " = state." in line:
                lines.append(line)
    return lines


def _replay_header(
    machine: str, backend: str | LedgerFactory, label: str, mutant_name: str | None
) -> tuple[list[str], str]:
    module, maker = _MODULES[machine]
    head = [f"from {module} import {maker}"]
    if machine == "ledger" and not isinstance(backend, str):
        mod, _, qual = label.partition(":")
        if qual and "<" not in qual and "." not in qual:
            head.append(f"from {mod} import {qual} as ledger_factory")
            arg = "ledger_factory"
        else:
            head.append(f"# the ledger factory {label} is not importable: bind it here")
            arg = "ledger_factory"
            head.append("ledger_factory = None  # replace with the factory")
    else:
        arg = repr(label)
    if mutant_name is not None:
        head.append("from stateful_tests.mutants import BY_NAME")
    head.append("")
    head.append(f"Machine = {maker}({arg})")
    return head, "" if mutant_name is None else "    "


def _save_program(
    workdir: Path,
    machine: str,
    backend: str | LedgerFactory,
    label: str,
    lines: list[str],
    exc_text: str,
    seed: int | None,
    batch: int,
    mutant_name: str | None,
) -> tuple[str, Path]:
    head, indent = _replay_header(machine, backend, label, mutant_name)
    body = []
    for line in lines:
        if line.startswith("state = "):
            line = "state = Machine()"
        body.append(indent + line)
    doc_error = exc_text.splitlines()[0][:300].replace('"""', "'''") if exc_text else ""
    doc = [
        '"""Shrunk failing program from a rollout-lifecycle fuzz campaign.',
        "",
        f"machine: {machine}  backend: {label}  seed: {seed}  batch: {batch}",
        f"mutant: {mutant_name}" if mutant_name else "mutant: none (the model as it is)",
        f"error: {doc_error}",
        "",
        "Replay: python this_file.py (raises the same error). Paste into a regression test",
        "to keep it.",
        '"""',
        "",
    ]
    if mutant_name is not None:
        body = [f"with BY_NAME[{mutant_name!r}]():", *body]
    text = "\n".join([*doc, *head, *body]) + "\n"
    out_dir = workdir / "failures"
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)[:40]
    stem = f"{machine}-{slug}-seed{seed}-batch{batch}"
    path = out_dir / f"{stem}.py"
    k = 1
    while path.exists():  # earlier failures are kept, never overwritten
        path = out_dir / f"{stem}-{k}.py"
        k += 1
    atomic_write(path, text)
    return text, path


def _collector(sink: list[str]) -> Callable[[object], None]:
    """A Hypothesis reporter that keeps what it is given (the shrunk program's lines)."""

    def report(text: object) -> None:
        sink.append(str(text))

    return report


def _exception_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    notes = [
        line
        for n in getattr(exc, "__notes__", [])
        for line in str(n).splitlines()
        if not (line.startswith("state") or " = state." in line)
    ]
    if notes:
        text += "\n" + "\n".join(notes[:8])
    return text[:4000]


def run_campaign(
    machines: Sequence[str],
    backend: str | LedgerFactory,
    *,
    examples: int | Mapping[str, int] | None = None,
    time_budget_s: float | None = None,
    seed: int | None = None,
    profile: str = "ci",
    steps: int | None = None,
    progress: Callable[[ProgressEvent], None] | None = None,
    workdir: Path | str,
    mutant: AbstractContextManager[Any] | None = None,
    mutant_name: str | None = None,
    shrink: bool = True,
    stop_after: int | Mapping[str, int] | None = None,
) -> CampaignReport:
    """Run each machine on `backend` and report coverage, checks, paths and failures.

    `examples` alone: one batch of that many examples per machine (the profile's count if
    None; a mapping gives each machine its own count). With `time_budget_s`: batches of
    `examples` (default 25) with fresh seeds until each machine's share of the budget is
    spent. `mutant` is entered around the whole run.
    `shrink=False` skips Hypothesis's shrinker (it can take minutes) and keeps only the
    replay minimiser, which is what "examples until the kill" measurements want.

    `stop_after` (one count, or one per machine) ends a machine's batch when it starts
    its example number `stop_after + 1`, with every example before it generated exactly as
    under the full `examples`: the campaign's fast profile runs the thorough profile's
    Hypothesis settings this way, so "first reached at example n" means the same in both.
    Never with `time_budget_s`; a failure's shrinking is never cut short.

    Raises `InfrastructureFailure` when the backend or the disk fails under a machine (the
    machines after it are not started).
    """
    unknown = [m for m in machines if m not in MACHINES]
    if unknown or not machines:
        raise ValueError(f"machines must be some of {list(MACHINES)}, got {list(machines)}")
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {list(PROFILES)}, got {profile!r}")
    per_machine: dict[str, int] | None = None
    one: int | None = None
    if isinstance(examples, Mapping):
        per_machine = dict(examples)
        missing = [m for m in machines if m not in per_machine]
        if missing:
            raise ValueError(f"examples gives no count for {missing}")
        if any(not isinstance(n, int) or n < 1 for n in per_machine.values()):
            raise ValueError("examples must be >= 1")
    elif examples is not None:
        if examples < 1:
            raise ValueError("examples must be >= 1")
        one = examples
    if time_budget_s is not None and time_budget_s <= 0:
        raise ValueError("time_budget_s must be > 0")
    stops: dict[str, int] = {}
    if stop_after is not None:
        if time_budget_s is not None:
            raise ValueError("stop_after and time_budget_s exclude each other")
        stops = (
            dict(stop_after)
            if isinstance(stop_after, Mapping)
            else dict.fromkeys(machines, stop_after)
        )
        if any(not isinstance(n, int) or n < 1 for n in stops.values()):
            raise ValueError("stop_after must be >= 1")
    if steps is not None and steps < 1:
        raise ValueError("steps must be >= 1")
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    register_profiles()
    base = settings.get_profile(profile)
    n_steps = steps or base.stateful_step_count
    budgeted = time_budget_s is not None
    base_seed = seed
    if base_seed is None and budgeted:
        base_seed = random.SystemRandom().randrange(2**31)
    default_batch: int = one or (BATCH_EXAMPLES if budgeted else base.max_examples)
    label = resolve_factory(backend)[0]
    started = time.perf_counter()
    runs: dict[str, MachineRun] = {}
    recorders: list[Recorder] = []
    with mutant if mutant is not None else contextlib.nullcontext():
        for i, machine in enumerate(machines):
            share = None
            if time_budget_s is not None:
                left = time_budget_s - (time.perf_counter() - started)
                share = max(left / (len(machines) - i), 0.0)
            rec = Recorder(machine)
            recorders.append(rec)
            runs[machine] = _run_machine(
                machine,
                backend,
                rec,
                work,
                profile=profile,
                per_batch=per_machine[machine] if per_machine is not None else default_batch,
                n_steps=n_steps,
                base_seed=base_seed,
                share_s=share,
                progress=progress,
                mutant_name=mutant_name,
                shrink=shrink,
                stop_after=stops.get(machine),
            )
    return _report(
        label,
        profile,
        base_seed,
        n_steps,
        examples,
        time_budget_s,
        mutant_name,
        time.perf_counter() - started,
        runs,
        recorders,
    )


def _run_machine(
    machine: str,
    backend: str | LedgerFactory,
    rec: Recorder,
    work: Path,
    *,
    profile: str,
    per_batch: int,
    n_steps: int,
    base_seed: int | None,
    share_s: float | None,
    progress: Callable[[ProgressEvent], None] | None,
    mutant_name: str | None,
    shrink: bool,
    stop_after: int | None = None,
) -> MachineRun:
    try:
        cls, label = _machine_class(machine, backend, rec, work)
    except Exception as exc:
        cause = infrastructure_cause(exc)
        if cause is None:
            raise
        label = resolve_factory(backend)[0]
        raise InfrastructureFailure(f"the {machine} machine", label, cause) from None
    state = _RunState()
    cls = _guarded(cls, state)
    run = MachineRun(machine, label)
    t0 = time.perf_counter()
    last = [0.0]

    def emit(phase: str, batch: int) -> None:
        if progress is not None:
            progress(
                ProgressEvent(
                    machine,
                    phase,
                    rec.examples,
                    rec.steps,
                    time.perf_counter() - t0,
                    batch,
                    share_s,
                )
            )

    def on_example(r: Recorder) -> None:
        if stop_after is not None and r.examples > stop_after and not state.failed:
            raise BudgetSpent()
        now = time.perf_counter()
        if progress is not None and now - last[0] >= PROGRESS_EVERY_S:
            last[0] = now
            emit("example", run.batches)

    rec.on_example = on_example
    emit("start", 0)
    batch = 0
    while True:
        batch_seed = None if base_seed is None else _batch_seed(base_seed, machine, batch)
        run.seeds.append(batch_seed)
        seeded_cls: type[RuleBasedStateMachine] = (
            cls if batch_seed is None else hypothesis_seed(batch_seed)(cls)
        )
        reported: list[str] = []
        state.failed = False
        spent = False
        try:
            with with_reporter(_collector(reported)):
                run_state_machine_as_test(
                    seeded_cls,
                    settings=_settings(profile, per_batch, n_steps, batch_seed is not None, shrink),
                )
        except InfrastructureStop as stop:
            raise InfrastructureFailure(f"the {machine} machine", label, stop.cause) from None
        except BaseException as exc:
            if not isinstance(exc, Exception) and not _budget_spent(exc):
                raise  # KeyboardInterrupt and the like
            spent = _budget_spent(exc)
            if not spent:
                _record_failure(
                    run,
                    rec,
                    exc,
                    machine,
                    backend,
                    label,
                    work,
                    batch,
                    batch_seed,
                    reported,
                    mutant_name,
                )
                run.examples_until_failure = rec.first_failure_example or rec.examples
                emit("failure", batch)
                break
        batch += 1
        run.batches = batch
        emit("batch", batch)
        if spent or share_s is None or time.perf_counter() - t0 >= share_s:
            break
    run.examples = rec.examples if stop_after is None else min(rec.examples, stop_after)
    run.steps = rec.steps
    run.rules = dict(rec.rules)
    run.first_reached = {**rec.first_edge, **rec.first_sometimes}
    run.elapsed_s = time.perf_counter() - t0
    emit("done", run.batches)
    return run


def _budget_spent(exc: BaseException) -> bool:
    """Whether `exc` is (or wraps, as Hypothesis does) the runner's BudgetSpent."""
    stack: list[BaseException] = [exc]
    seen: set[int] = set()
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, BudgetSpent):
            return True
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        stack.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return False


def _record_failure(
    run: MachineRun,
    rec: Recorder,
    exc: BaseException,
    machine: str,
    backend: str | LedgerFactory,
    label: str,
    work: Path,
    batch: int,
    batch_seed: int | None,
    reported: list[str],
    mutant_name: str | None,
) -> None:
    """The machine failed (the model, or the machine itself): shrink further, save the
    program, and record the failure, unless the backend or the disk was the cause
    (`InfrastructureFailure`: nothing was judged, nothing is saved)."""
    cause = infrastructure_cause(exc)
    if cause is not None:
        raise InfrastructureFailure(f"the {machine} machine", label, cause) from None
    run.batches = batch + 1
    text = _exception_text(exc)
    # Hypothesis attaches the shrunk program to the exception's notes; older versions
    # printed it through the reporter instead
    lines = _program_lines([str(n) for n in getattr(exc, "__notes__", [])])
    lines = lines or _program_lines(reported)
    # replayed against a fresh class (its own recorder), still inside the mutant
    replay_cls, _ = _machine_class(machine, backend, Recorder(machine), work)
    lines = minimize(replay_cls, lines, _INVARIANT_NAMES[machine])
    program, path = _save_program(
        work, machine, backend, label, lines, text, batch_seed, batch, mutant_name
    )
    run.failure = Failure(
        machine=machine,
        backend=label,
        exception=text,
        program=program,
        program_path=str(path),
        program_steps=program_steps(program, _INVARIANT_NAMES[machine]),
        seed=batch_seed,
        batch=batch,
    )


def _report(
    label: str,
    profile: str,
    base_seed: int | None,
    n_steps: int,
    examples: int | Mapping[str, int] | None,
    budget: float | None,
    mutant_name: str | None,
    elapsed: float,
    runs: dict[str, MachineRun],
    recorders: list[Recorder],
) -> CampaignReport:
    edges: dict[str, dict[str, int]] = {}
    for name, spec in DECLARED.items():
        counts: Counter[str] = Counter()
        for r in recorders:
            counts.update(r.edges[name])
        edges[name] = {spec.edge_id(e): counts.get(spec.edge_id(e), 0) for e in spec.edges}
    invariants: Counter[str] = Counter()
    sometimes: Counter[str] = Counter()
    notes: Counter[str] = Counter()
    first: dict[str, tuple[str, int]] = {}
    for r in recorders:
        invariants.update(r.invariants)
        sometimes.update(r.sometimes)
        notes.update(r.notes)
        for goal, n in [*r.first_edge.items(), *r.first_sometimes.items()]:
            if goal not in first or n < first[goal][1]:
                first[goal] = (r.machine, n)
    return CampaignReport(
        backend=label,
        profile=profile,
        seed=base_seed,
        steps_per_example=n_steps,
        examples_requested=dict(examples) if isinstance(examples, Mapping) else examples,
        time_budget_s=budget,
        mutant=mutant_name,
        elapsed_s=elapsed,
        runs=runs,
        edges=edges,
        invariants=dict(invariants),
        sometimes={name: sometimes.get(name, 0) for name in SOMETIMES},
        notes=dict(notes),
        first_reached=first,
    )
