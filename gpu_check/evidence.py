"""Evidence of one real update, judged by the same spec as every other checker.

The real-run check (CONTRACT section 7) saves, per candidate group, an evidence document
whose field paths the seed experiment's readers already use, plus the event trace of the
run (ledger and registry events). This module is the part that needs no GPU: it validates
an evidence document, judges it against tolerances fixed up front, keeps technical failures
apart from failed checks, replays the trace through `spec.invariants.check_trace`, and
stores results so that a run is never overwritten (a new run needs a new label).
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from rollout_lifecycle.model.errors import RolloutLifecycleError
from rollout_lifecycle.model.events import TraceEvent, event_from_jsonable
from rollout_lifecycle.spec.invariants import check_trace

SCHEMA_VERSION = 1

# the seed's field paths; keeping them lets its readers work unchanged
REQUIRED_PATHS: tuple[tuple[str, type | tuple[type, ...]], ...] = (
    ("schema_version", int),
    ("run_label", str),
    ("initialization.adapter_sha256", str),
    ("update.after_sha256", str),
    ("update.grad_norm", (int, float)),
    ("update.delta_l2", (int, float)),
    ("update.changed_tensors", int),
    ("decision.comparisons.same_version_after", dict),
    ("decision.admission", list),
    ("sync_rpc_and_version", dict),
    ("generation_before", (str, dict, list)),
    ("generation_after", (str, dict, list)),
)

_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class EvidenceError(RolloutLifecycleError, ValueError):
    """An evidence document or label that cannot be accepted as it is."""


@attrs.frozen
class Tolerances:
    """Fixed before the run: same-version log-prob error bounds and the admission bound."""

    max_abs_logprob: float = 0.15
    mean_abs_logprob: float = 0.03
    max_drift: float = 0.2


@attrs.frozen
class Verdict:
    """Technical problems (the evidence is unusable) kept apart from failed checks."""

    technical: tuple[str, ...]
    failed_checks: tuple[str, ...]
    passed_checks: tuple[str, ...]
    trace_violations: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """Usable evidence, every check passed, no invariant violated."""
        return not (self.technical or self.failed_checks or self.trace_violations)


def _get(doc: Mapping[str, Any], path: str) -> Any:
    cur: Any = doc
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            raise KeyError(path)
        cur = cur[part]
    return cur


def validate(doc: Any) -> list[str]:
    """Missing or wrongly typed field paths, by name (an empty list means well-formed)."""
    if not isinstance(doc, Mapping):
        return ["evidence must be a JSON object"]
    problems = []
    for path, typ in REQUIRED_PATHS:
        try:
            value = _get(doc, path)
        except KeyError:
            problems.append(f"missing {path}")
            continue
        if isinstance(value, bool) or not isinstance(value, typ):
            problems.append(f"{path} has type {type(value).__name__}")
    if not problems and doc["schema_version"] != SCHEMA_VERSION:
        problems.append(f"schema_version {doc['schema_version']} (expected {SCHEMA_VERSION})")
    return problems


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def judge(
    doc: Mapping[str, Any], tol: Tolerances | None = None, trace: Iterable[TraceEvent] | None = None
) -> Verdict:
    """Check one group's evidence against the tolerances and, if given, its event trace."""
    tol = tol or Tolerances()
    technical = validate(doc)
    if technical:
        return Verdict(tuple(technical), (), (), ())
    failed: list[str] = []
    passed: list[str] = []

    def check(name: str, ok: bool, detail: str) -> None:
        (passed if ok else failed).append(f"{name}: {detail}")

    upd = doc["update"]
    if not all(_finite(upd[k]) for k in ("grad_norm", "delta_l2")):
        technical.append("update.grad_norm / update.delta_l2 must be finite numbers")
    else:
        check(
            "update_moved_weights",
            upd["delta_l2"] > 0 and upd["changed_tensors"] > 0,
            f"delta_l2 {upd['delta_l2']:.6g}, {upd['changed_tensors']} tensors changed",
        )
        check(
            "weights_changed_hash",
            upd["after_sha256"] != doc["initialization"]["adapter_sha256"],
            "after-update hash differs from the initial adapter hash",
        )
    same = doc["decision"]["comparisons"]["same_version_after"]
    mx, mean = same.get("max_abs_error"), same.get("mean_abs_error")
    if not (_finite(mx) and _finite(mean)):
        technical.append("same_version_after needs finite max_abs_error and mean_abs_error")
    else:
        check(
            "same_version_logprobs",
            mx <= tol.max_abs_logprob and mean <= tol.mean_abs_logprob,
            f"max {mx:.4g} (<= {tol.max_abs_logprob}), mean {mean:.4g} (<= {tol.mean_abs_logprob})",
        )
    sync = doc["sync_rpc_and_version"]
    check(
        "version_seen_after_sync",
        sync.get("version_before") == 0 and sync.get("version_after") == 1,
        f"generation side saw v{sync.get('version_before')} -> v{sync.get('version_after')}",
    )
    for i, row in enumerate(doc["decision"]["admission"]):
        drift, accepted = row.get("drift"), row.get("accepted")
        if not isinstance(accepted, bool):
            technical.append(f"decision.admission[{i}].accepted must be a boolean")
            continue
        if accepted and not (_finite(drift) and drift <= tol.max_drift):
            failed.append(f"admission[{i}]: admitted with drift {drift} over {tol.max_drift}")
    violations: tuple[str, ...] = ()
    if trace is not None:
        rep = check_trace(trace)
        violations = tuple(str(v) for v in rep.violations)
    return Verdict(tuple(technical), tuple(failed), tuple(passed), violations)


def load_trace(lines: Iterable[str]) -> list[TraceEvent]:
    """Events from JSON lines (as the ledger and registry serialise them)."""
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(event_from_jsonable(json.loads(line)))
        except (ValueError, KeyError, TypeError) as exc:
            raise EvidenceError(f"trace line {n}: {exc}") from None
    return out


def save(root: Path, doc: Mapping[str, Any]) -> Path:
    """Store a well-formed evidence document under its label; never overwrite a result."""
    problems = validate(doc)
    if problems:
        raise EvidenceError("evidence is not well-formed: " + "; ".join(problems))
    label = doc["run_label"]
    if not _LABEL.match(label):
        raise EvidenceError(
            f"run_label {label!r}: use letters, digits, '.', '_' or '-' (a file name)"
        )
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{label}.json"
    fd, tmp = tempfile.mkstemp(prefix=f".{label}.", dir=root)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, final)  # fails if the label exists: results are never overwritten
        except FileExistsError:
            raise EvidenceError(
                f"a result for run_label {label!r} already exists at {final}; "
                "a new run needs a new label"
            ) from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    return final
