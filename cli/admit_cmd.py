"""`admit`: run the admission gate over a JSONL file of rollouts, write one decision per line.

Why it is built this way:

* Rollouts are read, validated and gated in chunks, so lag and drift are computed
  vectorised and memory stays flat for any input size. A chunk is checked column by column
  and handed to the gate as columns (`AdmissionGate.assess_columns`): no record is built
  per line. A chunk the column checks doubt goes line by line instead (records and
  `assess_batch`, as always), so every error names the same line with the same message.
* The column checks run on 32 lines at a time, right after json parsed them (their objects
  still in the CPU cache, then freed), and each list column is checked and converted in
  one C-level pass: struct for numbers and token ids, marshal's bytes for the mask, a second
  look only at the values a bool could have become. Large arrays are reused from chunk to
  chunk instead of being page-faulted in anew.
* Decisions go to a hidden temp file beside `--out` and are renamed into place only after
  the last line: an error on line 90,000, or Ctrl-C, leaves no half-written decisions that a
  trainer could mistake for a complete admission.
* Every input problem names its line, and is raised before anything is renamed, so a user
  fixes the data instead of reading a traceback.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import marshal
import math
import operator
import os
import struct
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

import attrs
import click
import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from rollout_lifecycle.cli.exitcodes import InputError, TechnicalError
from rollout_lifecycle.cli.output import (
    Progress as LineProgress,
)
from rollout_lifecycle.cli.output import (
    check_report_path,
    emit_report,
    make_console,
    quiet_option,
    report_options,
)
from rollout_lifecycle.cli.params import VERSION, FiniteFloat, StrictInt
from rollout_lifecycle.model.atomic import atomic_open
from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.errors import BackendUnavailable, OutputError, RolloutLifecycleError
from rollout_lifecycle.model.gate import (
    FRESHNESS,
    AdmissionDecision,
    AdmissionGate,
    GatePolicy,
    RecordColumns,
    Registry,
    check_bounds,
)
from rollout_lifecycle.model.machines import LIFECYCLE
from rollout_lifecycle.model.records import (
    ActionEvidence,
    BehaviorPolicy,
    GenerationConditions,
    LedgerEntry,
    Rollout,
    RolloutIdentity,
    from_jsonable,
    ints64_pass,
    texts_pass,
)
from rollout_lifecycle.model.registry import activated_hash

__all__ = ["INPUT_FIELDS", "OUTPUT_FIELDS", "admit"]

# The flat input schema: field -> what it holds. `state` is the only optional field.
INPUT_FIELDS: dict[str, str] = {
    "rollout_id": "non-empty string, unique in the file",
    "prompt_id": "non-empty string",
    "dataset": "non-empty string (task source)",
    "sample_index": "int >= 0",
    "behavior_version": "int >= 0, the policy version stamped at dispatch",
    "artifact_hash": "non-empty string, the artifact hash stamped at dispatch",
    "conditions": "object {tokenizer_id, temperature, top_p, top_k, max_tokens, seed}",
    "response_token_ids": "list of ints",
    "action_mask": "list of booleans (true on action tokens)",
    "behavior_log_probs": "list of numbers, per token, from the behaviour policy",
    "current_log_probs": "list of numbers, per token, from the current policy (same length)",
    "state": f"optional lifecycle state, default 'rewarded' (one of {', '.join(LIFECYCLE.states)})",
}
# One decision per line carries exactly these AdmissionDecision fields, in this order.
OUTPUT_FIELDS = (
    "rollout_id",
    "accepted",
    "reason",
    "route",
    "freshness",
    "drift",
    "lag",
    "current_version",
)
_REQUIRED = tuple(k for k in INPUT_FIELDS if k != "state")
_REQUIRED_SET = frozenset(_REQUIRED)
_INPUT_SET = frozenset(INPUT_FIELDS)
_CONDITION_FIELDS = tuple(f.name for f in attrs.fields(GenerationConditions))
_CONDITION_REQUIRED = tuple(f for f in _CONDITION_FIELDS if f != "seed")
_CONDITION_REQUIRED_SET = frozenset(_CONDITION_REQUIRED)
_LISTS = ("response_token_ids", "action_mask", "behavior_log_probs", "current_log_probs")
_INPUT_OWNER = "input-file"  # placeholder owner for rollouts the input says are reserved
DEFAULT_CHUNK = 1024


class InputLineError(Exception):
    """One bad input line: carries its number so the message can point at it."""

    def __init__(self, lineno: int, message: str) -> None:
        super().__init__(message)
        self.lineno = lineno


@attrs.frozen
class ParsedLine:
    """One input line turned into what the gate needs."""

    lineno: int
    rollout: Rollout
    entry: LedgerEntry
    current: npt.NDArray[np.float64]
    aligned: bool


# ---- parsing ---------------------------------------------------------------------------------


def _need_list(obj: Mapping[str, Any], key: str, lineno: int) -> list[Any]:
    v = obj[key]
    if not isinstance(v, list):
        raise InputLineError(lineno, f"field {key!r} must be a list, got {type(v).__name__}")
    return v


_NUMBER_TYPES = frozenset({float, int})


def _numbers(values: list[Any], key: str, lineno: int) -> npt.NDArray[np.float64]:
    """A list of JSON numbers as a float64 array; bools and strings are refused (json's NaN
    is allowed)."""
    if not set(map(type, values)) <= _NUMBER_TYPES:  # C-speed check; find the culprit only if bad
        for i, v in enumerate(values):
            if type(v) not in _NUMBER_TYPES:
                raise InputLineError(
                    lineno, f"field {key!r}[{i}] must be a number, got {type(v).__name__} {v!r}"
                )
    try:
        return np.array(values, dtype=np.float64)
    except OverflowError:
        i = next(j for j, v in enumerate(values) if isinstance(v, int) and abs(v) > 2**1023)
        raise InputLineError(
            lineno, f"field {key!r}[{i}] is too large to be a log-prob ({str(values[i])[:20]}...)"
        ) from None


def _frozen_array(values: list[Any], allowed: frozenset[type], dtype: type) -> Any:
    """`values` as the read-only array the record would make of them, in one C-speed
    conversion; the list itself where an element is not of an `allowed` type or does not
    fit, so the record's own validation names it, word for word as always."""
    if not set(map(type, values)) <= allowed:
        return values
    try:
        # fromiter is several times faster than np.array for Python bools and ints (no
        # type discovery); np.array is the faster for floats
        if dtype is np.float64:
            arr = np.array(values, dtype=dtype)
        else:
            arr = np.fromiter(values, dtype, len(values))
    except OverflowError:
        return values
    arr.flags.writeable = False  # owned, contiguous, read-only: the record keeps it as is
    return arr


def _bool_array(values: list[bool]) -> npt.NDArray[np.bool_]:
    """JSON booleans (`_booleans` checked them) as the read-only array the record keeps."""
    arr = np.fromiter(values, np.bool_, len(values))
    arr.flags.writeable = False
    return arr


_INTS = frozenset({int})


def _booleans(values: list[Any], key: str, lineno: int) -> list[bool]:
    """JSON booleans only: the input schema says so (records would also take 0/1 integers)."""
    if not set(map(type, values)) <= {bool}:
        for i, v in enumerate(values):
            if type(v) is not bool:
                raise InputLineError(
                    lineno, f"field {key!r}[{i}]: action mask entries must be booleans, got {v!r}"
                )
    return values


class LineParser:
    """Parses input lines; caches conditions, which are usually identical on every line."""

    def __init__(self) -> None:
        self._conditions: dict[tuple[tuple[Any, ...], ...], GenerationConditions] = {}
        self._seen: dict[str, int] = {}

    def _conditions_of(self, raw: Any, lineno: int) -> GenerationConditions:
        if not isinstance(raw, dict):
            raise InputLineError(
                lineno, f"field 'conditions' must be an object, got {type(raw).__name__}"
            )
        if not raw.keys() >= _CONDITION_REQUIRED_SET:
            missing = [k for k in _CONDITION_REQUIRED if k not in raw]
            raise InputLineError(lineno, f"field 'conditions' is missing {missing}")
        # keyed by names, value types and values as given (True == 1, but not as a top_k);
        # another key order is another key, for the same conditions
        key: tuple[tuple[Any, ...], ...] | None = (
            tuple(raw),
            tuple(map(type, raw.values())),
            tuple(raw.values()),
        )
        try:
            hash(key)
        except TypeError:
            key = None
        if key is not None and key in self._conditions:
            return self._conditions[key]
        try:
            cond = from_jsonable(GenerationConditions, raw)
        except RolloutLifecycleError as exc:
            raise InputLineError(lineno, f"field 'conditions': {exc}") from None
        if key is not None:
            self._conditions[key] = cond
        return cond

    def parse(self, raw: bytes, lineno: int) -> ParsedLine:
        """Validate one JSON line; InputLineError names the first problem found."""
        try:
            return self._parse(raw, lineno)
        except RecursionError:  # a field nested far deeper than any rollout's
            raise InputLineError(lineno, "a field is nested too deeply to be a rollout") from None

    def _parse(self, raw: bytes, lineno: int) -> ParsedLine:
        try:
            obj = json.loads(raw)
        except UnicodeDecodeError as exc:
            raise InputLineError(lineno, f"not UTF-8 text ({exc.reason})") from None
        except json.JSONDecodeError as exc:
            raise InputLineError(
                lineno, f"invalid JSON ({exc.msg} at column {exc.colno})"
            ) from None
        except RecursionError:
            raise InputLineError(lineno, "JSON nested too deeply to be a rollout") from None
        if not isinstance(obj, dict):
            raise InputLineError(lineno, f"expected a JSON object, got {type(obj).__name__}")
        if not (_REQUIRED_SET <= obj.keys() <= _INPUT_SET):  # one C-speed test per line
            missing = [k for k in _REQUIRED if k not in obj]
            if missing:
                raise InputLineError(lineno, f"missing field(s) {missing}")
            unknown = sorted(set(obj) - _INPUT_SET)
            raise InputLineError(
                lineno, f"unknown field(s) {unknown} (see `rollout-lifecycle admit --help`)"
            )
        lists = {k: obj[k] for k in _LISTS}
        if not all(type(v) is list for v in lists.values()):
            lists = {k: _need_list(obj, k, lineno) for k in _LISTS}
        current = _numbers(lists["current_log_probs"], "current_log_probs", lineno)
        state = obj.get("state", "rewarded")
        if state not in LIFECYCLE.states:
            raise InputLineError(
                lineno, f"field 'state' must be one of {list(LIFECYCLE.states)}, got {state!r}"
            )
        try:
            identity = RolloutIdentity(
                obj["rollout_id"], obj["prompt_id"], obj["dataset"], obj["sample_index"]
            )
            behavior = BehaviorPolicy(obj["behavior_version"], obj["artifact_hash"])
            evidence = ActionEvidence(
                _frozen_array(lists["response_token_ids"], _INTS, np.int64),
                _bool_array(_booleans(lists["action_mask"], "action_mask", lineno)),
                _frozen_array(lists["behavior_log_probs"], _NUMBER_TYPES, np.float64),
            )
            entry = LedgerEntry(
                rollout_id=identity.rollout_id,
                behavior_version=behavior.version,
                artifact_hash=behavior.artifact_hash,
                state=state,
                reserved_by=_INPUT_OWNER if state == "reserved" else None,
            )
        except (RolloutLifecycleError, OverflowError) as exc:
            raise InputLineError(lineno, str(exc)) from None
        conditions = self._conditions_of(obj["conditions"], lineno)
        first = self._seen.setdefault(identity.rollout_id, lineno)
        if first != lineno:
            raise InputLineError(
                lineno, f"rollout_id {identity.rollout_id!r} already appeared on line {first}"
            )
        n = len(evidence.behavior_log_probs)
        if len(current) != n:
            raise InputLineError(
                lineno,
                f"{len(current)} current_log_probs for {n} behavior_log_probs; "
                "they must be per token of the same response",
            )
        rollout = Rollout(identity, behavior, conditions, evidence)
        return ParsedLine(lineno, rollout, entry, current, len(evidence.action_mask) == n)


def _check_finite(chunk: Sequence[ParsedLine]) -> None:
    """Non-finite log-probs at action positions are an input error, reported by line.

    The aligned rows' arrays are concatenated (three C-speed copies for the whole chunk,
    not two per row), so the first bad flat position is the first bad line's first bad
    token."""
    rows = [p for p in chunk if p.aligned]
    if not rows:
        return
    evs = [p.rollout.evidence for p in rows]
    old = np.concatenate([ev.behavior_log_probs for ev in evs if ev is not None])
    mask = np.concatenate([ev.action_mask for ev in evs if ev is not None])
    cur = np.concatenate([p.current for p in rows])
    with np.errstate(invalid="ignore"):
        bad = mask & ~(np.isfinite(old) & np.isfinite(cur))
    if not bad.any():
        return
    at = int(np.argmax(bad))
    starts = np.cumsum([0, *(len(p.current) for p in rows)])
    i = int(np.searchsorted(starts, at, side="right")) - 1
    pos = at - int(starts[i])
    raise InputLineError(
        rows[i].lineno,
        f"non-finite log-prob at action position {pos} (behavior "
        f"{float(old[at])!r}, current {float(cur[at])!r})",
    )


def _current_matrix(chunk: Sequence[ParsedLine]) -> npt.NDArray[np.float64]:
    t = max((len(p.current) for p in chunk), default=0)
    cur = np.zeros((len(chunk), t), dtype=np.float64)
    for i, p in enumerate(chunk):
        cur[i, : len(p.current)] = p.current
    return cur


def _decision_line(d: AdmissionDecision) -> str:
    """One decision as strict JSON: a drift too large to represent (finite log-probs near
    +-1e308 differ by more than a float holds) is written as null with `drift_overflow`."""
    row = dict(zip(OUTPUT_FIELDS, _OUTPUT_VALUES(d), strict=True))
    drift = row["drift"]
    if isinstance(drift, float) and not math.isfinite(drift):
        row["drift"] = None
        row["drift_overflow"] = True
    return _ENCODE(row)


_OUTPUT_VALUES = operator.attrgetter(*OUTPUT_FIELDS)
# the encoder's own string encoding (ensure_ascii), so a line built field by field is the
# line `_ENCODE` writes, byte for byte
_STR = json.encoder.encode_basestring_ascii
_BOOL = {True: "true", False: "false"}


def _decision_lines(decisions: Sequence[AdmissionDecision]) -> str:
    """`_decision_line` of every decision, each followed by a newline: the same bytes, the
    fields formatted straight into one template per line instead of a dict encoded."""
    out = []
    for d in decisions:
        drift = d.drift
        if drift is None:
            tail = "null"
        elif math.isfinite(drift):
            tail = repr(float(drift))
        else:
            out.append(_decision_line(d) + "\n")
            continue
        fresh = d.freshness
        out.append(
            f'{{"rollout_id":{_STR(d.rollout_id)},"accepted":{_BOOL[d.accepted]},'
            f'"reason":{_STR(d.reason)},"route":{_STR(d.route)},'
            f'"freshness":{"null" if fresh is None else _STR(fresh)},"drift":{tail},'
            f'"lag":{int(d.lag)!r},"current_version":{int(d.current_version)!r}}}\n'
        )
    return "".join(out)


# one encoder for every line (json.dumps with options builds a new one per call)
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


# ---- options ---------------------------------------------------------------------------------


def _read_json_file(path: Path, option: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise click.UsageError(f"{option} {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise click.UsageError(f"{option} {path}: cannot read it ({exc})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.UsageError(f"{option} {path}: not valid JSON ({exc})") from None


def load_registry_json(path: Path) -> dict[int, str]:
    """`{"<version>": "<artifact hash>", ...}` of every version that was ever active."""
    data = _read_json_file(path, "--registry-json")
    if not isinstance(data, dict):
        raise click.UsageError(
            f"--registry-json {path}: expected an object mapping version to artifact hash"
        )
    out: dict[int, str] = {}
    for k, v in data.items():
        try:
            version = int(k)
        except ValueError:
            version = -1
        if version < 0 or str(version) != k.strip():
            raise click.UsageError(f"--registry-json {path}: key {k!r} is not a version (int >= 0)")
        if not isinstance(v, str) or not v:
            raise click.UsageError(
                f"--registry-json {path}: version {k} must map to a non-empty hash string"
            )
        out[version] = v
    return out


def load_conditions_json(path: Path) -> GenerationConditions:
    """The experiment's generation conditions; rollouts sampled otherwise are rejected."""
    data = _read_json_file(path, "--conditions-json")
    try:
        return from_jsonable(GenerationConditions, data)
    except RolloutLifecycleError as exc:
        raise click.UsageError(f"--conditions-json {path}: {exc}") from None


@contextlib.contextmanager
def _backend_registry(url: str, current_version: int) -> Iterator[Registry]:
    """The coordinator's "ever active" lookup over a stored registry, cached per version."""
    try:
        backend = open_backend(url, create=False)
    except BackendUnavailable as exc:
        raise TechnicalError(f"--backend: {exc}") from None
    except RolloutLifecycleError as exc:
        raise click.UsageError(f"--backend: {exc}") from None
    try:
        registry = backend.registry
        pointer = registry.pointer()
        if pointer is None:
            click.echo(
                f"warning: {url} has no active policy yet; every version is unregistered", err=True
            )
        elif pointer.version != current_version:
            click.echo(
                f"warning: --current-version {current_version} but the active version in "
                f"{url} is {pointer.version}",
                err=True,
            )
        yield functools.cache(functools.partial(activated_hash, registry))
    finally:
        backend.close()


# ---- running -----------------------------------------------------------------------------------


@attrs.define
class Summary:
    """Counts gathered while writing decisions; small however large the input."""

    by_reason_route: Counter[tuple[str, str]] = attrs.field(factory=Counter)
    by_freshness: Counter[str] = attrs.field(factory=Counter)
    drifts: list[float] = attrs.field(factory=list)
    total: int = 0
    accepted: int = 0

    def add(self, decisions: Sequence[AdmissionDecision]) -> None:
        for d in decisions:
            self.total += 1
            self.accepted += d.accepted
            self.by_reason_route[(d.reason, d.route)] += 1
            self.by_freshness[d.freshness or "n/a"] += 1
            if d.drift is not None:
                self.drifts.append(d.drift)

    def drift_stats(self) -> dict[str, float | int | None]:
        if not self.drifts:
            return {"count": 0, "min": None, "median": None, "max": None}
        arr = np.asarray(self.drifts, dtype=np.float64)
        return {
            "count": int(arr.size),
            "min": float(arr.min()),
            "median": float(np.median(arr)),
            "max": float(arr.max()),
        }


def _chunks(
    lines: Iterator[tuple[int, bytes]], parser: LineParser, size: int
) -> Iterator[list[ParsedLine]]:
    chunk: list[ParsedLine] = []
    for lineno, raw in lines:
        try:
            chunk.append(parser.parse(raw, lineno))
        except InputLineError:
            if chunk:  # an earlier line of this chunk may hold the file's first error
                _check_finite(chunk)
            raise
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


MAX_LINE_BYTES = 256 * 2**20  # one rollout per line; a line this long is not a rollout
# the input is read through a 1 MiB buffer: with the default 8 KiB, a rollout line of a few
# KiB costs a read call of its own, and reading took twice the CPU time
READ_BUFFER = 2**20


def _lines(f: IO[bytes], advance: Callable[[int], None]) -> Iterator[tuple[int, bytes]]:
    lineno = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)  # bounded: /dev/zero has no newline at all
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_LINE_BYTES:
            raise InputLineError(
                lineno, f"line longer than {MAX_LINE_BYTES // 2**20} MiB; one rollout per line"
            )
        advance(len(raw))
        if not raw.isspace():  # the blank lines raw.strip() empties, without copying the line
            yield lineno, raw


@contextlib.contextmanager
def _progress(total: int, quiet: bool = False) -> Iterator[Callable[[int], None]]:
    """A byte-based progress bar on a TTY stderr; a line every few seconds otherwise."""
    if quiet:
        yield lambda _n: None
        return
    if not sys.stderr.isatty():
        lines = LineProgress("admit")
        done = [0]

        def advance(n: int) -> None:
            done[0] += n
            lines(f"{done[0]:,} of {total:,} bytes ({100 * done[0] / max(total, 1):.1f}%)")

        yield advance
        return
    progress = Progress(
        TextColumn("admitting"),
        BarColumn(),
        TextColumn("{task.percentage:>5.1f}%"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with progress:
        task = progress.add_task("admit", total=total)
        yield lambda n: progress.advance(task, n)


@contextlib.contextmanager
def _atomic_output(out: Path, force: bool) -> Iterator[IO[str]]:
    """Decisions land at `out` only if the whole run finishes (model.atomic: a temporary in
    the same folder, fsync, rename; removed on error, Ctrl-C or SIGTERM)."""
    try:
        with atomic_open(out, "w") as f:
            yield f
            if out.exists() and not force:
                raise click.UsageError(f"--out {out} appeared while admitting; pass --force")
    except OutputError as exc:
        raise TechnicalError(f"{exc}; no decisions were written") from None


def _run(
    input_path: Path,
    out: Path,
    gate: AdmissionGate,
    current_version: int,
    chunk_size: int,
    force: bool,
    quiet: bool = False,
) -> Summary:
    summary = Summary()
    parser = LineParser()
    scratch = _Scratch()  # the column path's flat and padded arrays, chunk after chunk
    with (
        input_path.open("rb", buffering=READ_BUFFER) as f,
        _progress(input_path.stat().st_size, quiet) as advance,
        _atomic_output(out, force) as sink,
    ):
        for lines in _raw_chunks(_lines(f, advance), parser, chunk_size):
            fast = _fast_chunk(lines, parser, scratch)
            if fast is not None:
                done = _gate_columns(fast, gate, current_version, scratch)
            else:  # line by line: every problem found and named exactly as always
                done = []
                for chunk in _chunks(iter(lines), parser, len(lines)):
                    done = _gate_parsed(chunk, gate, current_version)
            sink.write(_decision_lines(done))
            summary.add(done)
    return summary


def _raw_chunks(
    lines: Iterator[tuple[int, bytes]], parser: LineParser, size: int
) -> Iterator[list[tuple[int, bytes]]]:
    """The input's non-blank lines, `size` at a time. A line too long to read ends the
    input where it stands: the lines before it are parsed first, one by one, so a bad line
    among them is still the error reported, as when each line was parsed as it was read."""
    chunk: list[tuple[int, bytes]] = []
    try:
        for item in lines:
            chunk.append(item)
            if len(chunk) >= size:
                yield chunk
                chunk = []
    except InputLineError:
        for _ in _chunks(iter(chunk), parser, len(chunk) + 1):
            pass
        raise
    if chunk:
        yield chunk


def _gate_parsed(
    chunk: Sequence[ParsedLine], gate: AdmissionGate, current_version: int
) -> list[AdmissionDecision]:
    """One chunk of parsed lines through the gate, group by group of similar width."""
    decisions: list[AdmissionDecision | None] = [None] * len(chunk)
    groups = list(_by_width([len(p.current) for p in chunk]))
    errors = []
    for rows in groups:  # every group first: the file's FIRST bad line is reported
        part = [chunk[i] for i in rows]
        try:
            _check_finite(part)
        except InputLineError as exc:
            errors.append(exc)
    if errors:
        raise min(errors, key=lambda e: e.lineno)
    for rows in groups:
        part = [chunk[i] for i in rows]
        cur = _current_matrix(part)
        got = gate.assess_batch(
            [p.rollout for p in part], cur, current_version, [p.entry for p in part]
        )
        for i, d in zip(rows, got, strict=True):
            decisions[i] = d
    return [d for d in decisions if d is not None]


# ---- the column path: a chunk that is valid throughout, never a record per line -------------

_FAST_FIELDS = (
    "rollout_id",
    "prompt_id",
    "dataset",
    "sample_index",
    "behavior_version",
    "artifact_hash",
    "conditions",
    "response_token_ids",
    "action_mask",
    "behavior_log_probs",
    "current_log_probs",
)
_FAST_GET = operator.itemgetter(*_FAST_FIELDS)
_STATES = frozenset(LIFECYCLE.states)
_FLAT = itertools.chain.from_iterable
_T = TypeVar("_T", bound=np.generic)
# Lines parsed and checked at a time. Checking a part's values while the objects json just
# made are still in the CPU cache, and dropping them before the next part is parsed, took
# the checks and conversions beyond json.loads from 0.74 to 0.41 s of CPU on the bench's
# input, against checking a 1024-line chunk after all of it was parsed (the allocator also
# reuses the freed memory). Any size gives the same result; 16 to 128 measured alike.
_PART = 32


@attrs.frozen
class _FastChunk:
    """A chunk of lines that passed every check of `LineParser.parse` and `_check_finite`,
    as columns: the arrays concatenated in line order, `starts` each line's offset."""

    ids: list[str]
    states: list[str]
    versions: list[int]
    hashes: list[str]
    conditions: list[GenerationConditions]
    token_counts: list[int]
    lengths: npt.NDArray[np.int64]
    starts: npt.NDArray[np.int64]
    old: npt.NDArray[np.float64]
    current: npt.NDArray[np.float64]
    mask: npt.NDArray[np.bool_]


def _fast_chunk(
    lines: Sequence[tuple[int, bytes]], parser: LineParser, scratch: _Scratch | None = None
) -> _FastChunk | None:
    """The chunk as columns when every line is valid and every action position finite,
    checked `_PART` lines at a time, column by column (one C-level pass per check, not one
    Python call per line or value); None at the first doubt, and the chunk then goes line by
    line, which names the problem exactly as always. Accepts only what `LineParser.parse`
    accepts, with the same values (the same conversions), and records the ids as seen only
    when it accepts the whole chunk. The flat columns of several parts live in `scratch`
    until the next chunk's."""
    scratch = _Scratch() if scratch is None else scratch
    parts = []
    for at in range(0, len(lines), _PART):
        part = _fast_part(lines[at : at + _PART], parser)
        if part is None:
            return None
        parts.append(part)
    if not parts:
        return None
    ids = list(_FLAT(p.ids for p in parts))
    seen = parser._seen
    if len(set(ids)) != len(ids) or not seen.keys().isdisjoint(ids):
        return None
    if len(parts) == 1:
        fast = parts[0]
    else:
        sizes = np.concatenate([p.lengths for p in parts])
        total = (int(sizes.sum()),)
        fast = _FastChunk(
            ids,
            list(_FLAT(p.states for p in parts)),
            list(_FLAT(p.versions for p in parts)),
            list(_FLAT(p.hashes for p in parts)),
            list(_FLAT(p.conditions for p in parts)),
            list(_FLAT(p.token_counts for p in parts)),
            sizes,
            np.cumsum(sizes) - sizes,
            np.concatenate(
                [p.old for p in parts], out=scratch.array("flat old", total, np.float64)
            ),
            np.concatenate(
                [p.current for p in parts], out=scratch.array("flat current", total, np.float64)
            ),
            np.concatenate(
                [p.mask for p in parts], out=scratch.array("flat mask", total, np.bool_)
            ),
        )
    with np.errstate(invalid="ignore"):  # once per chunk: numpy's cost is per call
        if (fast.mask & ~(np.isfinite(fast.old) & np.isfinite(fast.current))).any():
            return None
    seen.update(zip(ids, (lineno for lineno, _ in lines), strict=True))
    return fast


def _fast_part(lines: Sequence[tuple[int, bytes]], parser: LineParser) -> _FastChunk | None:
    """`_fast_chunk`'s checks of a few lines, all but the ids' uniqueness across the chunk
    and against the lines before it and the finite check; the parsed objects are dropped
    on return."""
    try:
        objs = [json.loads(raw) for _, raw in lines]
    except Exception:  # whatever it is, the line-by-line path names it
        return None
    if set(map(type, objs)) != {dict}:
        return None
    keys = list(map(dict.keys, objs))
    if not all(map(operator.le, itertools.repeat(_REQUIRED_SET), keys)) or not all(
        map(operator.le, keys, itertools.repeat(_INPUT_SET))
    ):
        return None
    states = [o.get("state", "rewarded") for o in objs]
    if set(map(type, states)) != {str} or not set(states) <= _STATES:
        return None
    ids, prompts, datasets, sample_index, versions, hashes, raw_conds, tokens, masks, olds, curs = (
        map(list, zip(*map(_FAST_GET, objs), strict=True))
    )
    del objs
    if not all(set(map(type, col)) == {list} for col in (tokens, masks, olds, curs)):
        return None
    if not (all(map(texts_pass, (ids, prompts, datasets, hashes))) and ints64_pass(sample_index)):
        return None
    if not ints64_pass(versions):
        return None
    lengths = list(map(len, olds))
    if list(map(len, curs)) != lengths or list(map(len, masks)) != lengths:
        return None  # misaligned rows: the line-by-line path keeps them out of the finite check
    token_counts = list(map(len, tokens))
    current = _number_column(curs)
    old = _number_column(olds)
    mask = _bool_column(masks)
    if current is None or old is None or mask is None or not _int64_column(tokens):
        return None
    try:
        conditions = [
            parser._conditions_of(raw, lineno)
            for raw, (lineno, _) in zip(raw_conds, lines, strict=True)
        ]
    except InputLineError:
        return None
    sizes = np.array(lengths, np.int64)
    return _FastChunk(
        ids,
        states,
        versions,
        hashes,
        conditions,
        token_counts,
        sizes,
        np.cumsum(sizes) - sizes,
        old,
        current,
        mask,
    )


def _number_column(rows: list[list[Any]]) -> npt.NDArray[np.float64] | None:
    """The rows' values, concatenated, as the float64 array `np.array(values, np.float64)`
    makes of them; None unless every value is an int or a float (never a bool) that a
    float holds.

    One C-level pass converts and checks at once: struct's 'd' takes exactly the ints,
    floats and bools of what json makes (a string, None, a list, an object or an int
    beyond a float's range is a struct.error), and a bool can only have become 0.0 or 1.0,
    so only the values equal to those are looked at again for bools."""
    packed = _packed(rows, "d")
    if packed is None:
        return None
    arr = np.frombuffer(packed, np.float64)
    if not _bools_absent(rows, (arr == 0.0) | (arr == 1.0)):
        return None
    return arr


def _int64_column(rows: list[list[Any]]) -> bool:
    """True when every value is an int (never a bool) that fits in int64, as the record's
    int64 array needs: struct's 'q' takes exactly the ints and bools in that range of what
    json makes, and a bool is 0 or 1, so only those values are looked at again."""
    packed = _packed(rows, "q")
    if packed is None:
        return False
    arr = np.frombuffer(packed, np.int64)
    return _bools_absent(rows, (arr == 0) | (arr == 1))


def _packed(rows: list[list[Any]], code: str) -> bytes | None:
    """The rows' values as native `code` ('d' or 'q') items, one struct.pack per row (about
    40% cheaper than array.fromlist, which parses its format once per value); None where
    struct refuses a value."""
    try:
        return b"".join([_packer(code, len(row))(*row) for row in rows])
    except struct.error:
        return None


@functools.lru_cache(maxsize=1024)
def _packer(code: str, n: int) -> Callable[..., bytes]:
    """The packer of `n` native `code` items (one per row length seen)."""
    return struct.Struct(f"{n}{code}").pack


def _bools_absent(rows: list[list[Any]], maybe: npt.NDArray[np.bool_]) -> bool:
    """True when none of the rows' values where `maybe` (over the flat values) is True is
    a bool; where most are in doubt (log-probs of exactly 0.0), every value's type is
    looked at in one pass instead, which is cheaper than picking them out."""
    at = np.flatnonzero(maybe)
    if not at.size:
        return True
    if at.size * 8 > maybe.size:
        return bool not in set(map(type, _FLAT(rows)))
    flat = list(_FLAT(rows))
    return bool not in set(map(type, map(flat.__getitem__, at.tolist())))


# marshal writes a list as a 5-byte header and then its items, each starting with its type
# byte; True and False are the one bytes b"T" and b"F", and no other value has those type
# bytes. Checked here: where this Python writes them otherwise, the mask's values are
# judged type by type.
_MARSHAL_BOOLS = marshal.dumps([True, False, True])[5:] == b"TFT"


def _bool_column(rows: list[list[Any]]) -> npt.NDArray[np.bool_] | None:
    """The rows' values, concatenated, as a bool array; None unless every one is a bool
    (the input schema's mask; 0 and 1 are refused, as `_booleans` refuses them).

    marshal.dumps writes each row in one C pass, about three times cheaper than looking at
    each value's type: the rows hold only bools when their items are all b"T" or b"F" (any
    other value adds at least its own type byte)."""
    if not _MARSHAL_BOOLS:
        if not set(map(type, _FLAT(rows))) <= {bool}:
            return None
        return np.array(list(_FLAT(rows)), np.bool_)
    try:
        items = b"".join([d[5:] for d in map(marshal.dumps, rows)])
    except ValueError:  # nested too deeply to marshal: not a bool
        return None
    if items.count(b"T") + items.count(b"F") != len(items):
        return None
    mask: npt.NDArray[np.bool_] = np.frombuffer(items, np.uint8) == ord("T")
    return mask


def _gate_columns(
    fast: _FastChunk,
    gate: AdmissionGate,
    current_version: int,
    scratch: _Scratch | None = None,
) -> list[AdmissionDecision]:
    """A valid chunk through the gate's column path, in the same groups as the
    line-by-line path (so each row is padded to the same width: the same figures). The
    padded matrices live in `scratch` until the next chunk's."""
    scratch = _Scratch() if scratch is None else scratch
    decisions: list[AdmissionDecision | None] = [None] * len(fast.ids)
    for rows in _by_width(fast.lengths.tolist()):
        g = np.array(rows, np.intp)
        lens = fast.lengths[g]
        t = int(lens.max()) if len(rows) else 0
        if len(rows) == len(fast.ids):
            # the whole chunk in one group (the usual case): padded in line order straight
            # from the flat columns, then the rows put in the group's order
            valid = np.arange(t) < fast.lengths[:, None]
            cur = _padded_rows(fast.current, valid, g, scratch, "gate current")
            old = _padded_rows(fast.old, valid, g, scratch, "gate old")
            mask = _padded_rows(fast.mask, valid, g, scratch, "gate mask")
        else:
            # each row's values, in the group's order, gathered from the flat columns
            offsets = np.cumsum(lens) - lens
            src = np.repeat(fast.starts[g] - offsets, lens) + np.arange(int(lens.sum()))
            valid = np.arange(t) < lens[:, None]
            cur = _padded(fast.current[src], valid)
            old = _padded(fast.old[src], valid)
            mask = _padded(fast.mask[src], valid)
        n = lens.tolist()
        columns = RecordColumns(
            rollout_ids=[fast.ids[i] for i in rows],
            states=[fast.states[i] for i in rows],
            behavior_versions=[fast.versions[i] for i in rows],
            artifact_hashes=[fast.hashes[i] for i in rows],
            conditions=[fast.conditions[i] for i in rows],
            token_counts=[fast.token_counts[i] for i in rows],
            mask_counts=n,
            log_prob_counts=n,
            old_log_probs=old,
            action_mask=mask,
        )
        got = gate.assess_columns(columns, cur, current_version)
        for i, d in zip(rows, got, strict=True):
            decisions[i] = d
    return [d for d in decisions if d is not None]


def _padded(
    values: npt.NDArray[_T], valid: npt.NDArray[np.bool_], out: npt.NDArray[_T] | None = None
) -> npt.NDArray[_T]:
    """`values`, row after row, in a zero-padded matrix shaped like `valid` (True where a
    row has a value): a new one, or `out` overwritten."""
    if out is None:
        out = np.zeros(valid.shape, values.dtype)
    else:
        out.fill(0)
    out[valid] = values
    return out


def _padded_rows(
    values: npt.NDArray[_T],
    valid: npt.NDArray[np.bool_],
    order: npt.NDArray[np.intp],
    scratch: _Scratch,
    name: str,
) -> npt.NDArray[_T]:
    """`_padded(values, valid)[order]`, built in `scratch`'s arrays."""
    lines = _padded(
        values, valid, scratch.array(f"line order {values.dtype}", valid.shape, values.dtype.type)
    )
    out = scratch.array(name, valid.shape, values.dtype.type)
    np.take(lines, order, axis=0, out=out)
    return out


class _Scratch:
    """Arrays reused from one chunk to the next. A fresh array of a few MiB per chunk is
    page-faulted in anew each time (the allocator gives freed memory that large back to
    the system): on the bench's input, 30,000 page faults and half of admit's system CPU
    time."""

    def __init__(self) -> None:
        self._arrays: dict[str, npt.NDArray[Any]] = {}

    def array(self, name: str, shape: tuple[int, ...], dtype: type[_T]) -> npt.NDArray[_T]:
        """An uninitialised array of `shape`, in the memory `name` had before if it fits;
        what `name` gave the chunk before must no longer be in use."""
        size = math.prod(shape)
        have = self._arrays.get(name)
        if have is None or have.size < size or have.dtype != dtype:
            have = self._arrays[name] = np.empty(size, dtype)
        out: npt.NDArray[_T] = have[:size].reshape(shape)
        return out


MAX_CELLS = 1 << 20  # padded B x T cells per gate call: memory stays near the input's size


def _by_width(widths: Sequence[int]) -> Iterator[list[int]]:
    """Row groups of similar length whose padded B x T stays within MAX_CELLS (a row longer
    than that goes alone), so one length outlier never pads the whole chunk to its width."""
    order = sorted(range(len(widths)), key=widths.__getitem__)
    group: list[int] = []
    for i in order:
        width = widths[i]
        if group and (len(group) + 1) * max(width, 1) > MAX_CELLS:
            yield group
            group = []
        group.append(i)
    if group:
        yield group


def _summary_json(
    summary: Summary, input_path: Path, out: Path, policy: GatePolicy, cv: int, elapsed: float
) -> dict[str, Any]:
    by_reason: Counter[str] = Counter()
    by_route: Counter[str] = Counter()
    for (reason, route), n in summary.by_reason_route.items():
        by_reason[reason] += n
        by_route[route] += n
    return {
        "schema": "rollout-lifecycle/admit-summary/1",
        "input": str(input_path),
        "output": str(out),
        "current_version": cv,
        "max_lag": policy.max_lag,
        "max_drift": policy.max_drift,
        "total": summary.total,
        "accepted": summary.accepted,
        "rejected": summary.total - summary.accepted,
        "by_reason": dict(sorted(by_reason.items())),
        "by_route": dict(sorted(by_route.items())),
        "by_freshness": {k: summary.by_freshness.get(k, 0) for k in (*FRESHNESS, "n/a")},
        "drift": summary.drift_stats(),
        "elapsed_s": round(elapsed, 3),
    }


def _print_summary(data: Mapping[str, Any], summary: Summary) -> None:
    click.echo(
        f"admitted {data['accepted']} of {data['total']} rollouts (current version "
        f"{data['current_version']}, max lag {data['max_lag']}, max drift {data['max_drift']}) "
        f"-> {data['output']}"
    )
    table = Table(title="decisions by reason and route")
    table.add_column("reason")
    table.add_column("route")
    table.add_column("count", justify="right")
    for (reason, route), n in sorted(summary.by_reason_route.items()):
        table.add_row(reason, route, str(n))
    fresh = Table(title="freshness")
    fresh.add_column("freshness")
    fresh.add_column("count", justify="right")
    for k, n in data["by_freshness"].items():
        fresh.add_row(k, str(n))
    console = Console()
    console.print(table)
    console.print(fresh)
    d = data["drift"]
    if d["count"]:
        click.echo(
            f"drift over {d['count']} rollouts with action tokens: min {d['min']:.4g}, "
            f"median {d['median']:.4g}, max {d['max']:.4g}"
        )
    else:
        click.echo("drift: no rollout reached the drift gate")


_EPILOG = "\n".join(
    [
        "\b",
        "Input: one JSON object per line with these fields:",
        *(f"  {k}: {v}" for k, v in INPUT_FIELDS.items()),
        "Log-probs may be NaN or +-Infinity only where action_mask is false.",
        "",
        "\b",
        f"Output: one JSON object per input rollout, in order: {', '.join(OUTPUT_FIELDS)}.",
        "Exit status: 0 done; 2 bad input data (the message names the line) or bad "
        "options; 3 technical failure (I/O, an unreachable backend).",
    ]
)


@click.command("admit", epilog=_EPILOG)
@click.argument(
    "input_path",
    metavar="INPUT.jsonl",
    type=click.Path(exists=True, dir_okay=False, readable=True, path_type=Path),
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Where to write one decision per line (written whole, or not at all).",
)
@click.option(
    "--current-version",
    type=VERSION,
    required=True,
    help="v_current, the policy version the update trains.",
)
@click.option(
    "--max-lag",
    type=StrictInt(0, 10**6),
    required=True,
    help="L_max: admit 0 <= v_current - v_behavior <= L_max.",
)
@click.option(
    "--max-drift",
    type=FiniteFloat(0.0, 1e6),
    required=True,
    help="D_max: admit mean |log-prob difference| over action tokens <= D_max.",
)
@click.option(
    "--registry-json",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help='{"<version>": "<artifact hash>"} of every version that was ever active.',
)
@click.option(
    "--backend",
    "backend_url",
    default=None,
    help="Read the ever-active versions from this stored registry instead (e.g. "
    "sqlite:///rollout-lifecycle.db or postgresql://user:password@host:5432/dbname).",
)
@click.option(
    "--conditions-json",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The experiment's generation conditions; other conditions are rejected.",
)
@click.option("--force", is_flag=True, help="Replace an existing --out file.")
@report_options
@quiet_option
@click.option(
    "--chunk-size",
    type=StrictInt(1, 1_000_000),
    default=DEFAULT_CHUNK,
    show_default=True,
    help="Rollouts gated per vectorised batch.",
)
def admit(
    input_path: Path,
    out: Path,
    current_version: int,
    max_lag: int,
    max_drift: float,
    registry_json: Path | None,
    backend_url: str | None,
    conditions_json: Path | None,
    force: bool,
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
    chunk_size: int,
) -> None:
    """Admit rollouts by version lag AND behaviour drift; write one decision per line.

    Without --registry-json or --backend, artifact hashes are not checked against a
    registry (a warning says so).
    """
    try:
        check_bounds(max_lag, max_drift)
    except RolloutLifecycleError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-drift") from None
    check_report_path(report_path)
    if registry_json is not None and backend_url is not None:
        raise click.UsageError("pass --registry-json or --backend, not both")
    if out.exists() and not force:
        raise click.UsageError(f"--out {out} already exists; pass --force to replace it")
    if out.exists() and os.path.samefile(out, input_path):
        raise click.UsageError("--out is the input file (or a link to it); choose another path")
    if not out.parent.is_dir():
        raise click.UsageError(f"--out {out}: directory {out.parent} does not exist")
    conditions = None if conditions_json is None else load_conditions_json(conditions_json)
    policy = GatePolicy(max_lag=max_lag, max_drift=max_drift, conditions=conditions)
    with contextlib.ExitStack() as stack:
        registry: Registry | None = None
        if registry_json is not None:
            registry = load_registry_json(registry_json)
        elif backend_url is not None:
            registry = stack.enter_context(_backend_registry(backend_url, current_version))
        else:
            click.echo(
                "warning: no --registry-json or --backend: artifact hashes are not checked",
                err=True,
            )
        gate = AdmissionGate(policy, registry)
        start = time.perf_counter()
        try:
            summary = _run(input_path, out, gate, current_version, chunk_size, force, quiet)
        except InputLineError as exc:
            raise InputError(
                f"{input_path}, line {exc.lineno}: {exc}; no decisions were written"
            ) from None
        except (OSError, BackendUnavailable) as exc:
            raise TechnicalError(f"{exc}; no decisions were written") from None
        except RolloutLifecycleError as exc:
            raise InputError(f"{exc}; no decisions were written") from None
        elapsed = time.perf_counter() - start
    data = _summary_json(summary, input_path, out, policy, current_version, elapsed)
    emit_report(data, as_json=as_json, report_path=report_path, console=make_console())
    if not as_json:
        _print_summary(data, summary)
