"""Evidence of one real update, judged by the same spec as every other checker.

The real-run check (CONTRACT section 7) saves, per candidate group, an evidence document
whose field paths the seed experiment's readers already use, plus the event trace of the
run (ledger and registry events). This module is the part that needs no GPU and no verl:
it validates an evidence document, judges it against tolerances fixed up front, keeps
technical failures apart from failed checks, replays the trace through
`spec.invariants.check_trace`, and stores results so that a run is never overwritten (a new
run needs a new label).

Every check is a function of the saved document (and its trace), so a result file can be
re-judged by anyone: `judge_result(doc)` gives back exactly the checks the run recorded.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from rollout_lifecycle.model.atomic import atomic_write
from rollout_lifecycle.model.errors import RolloutLifecycleError
from rollout_lifecycle.model.events import TraceEvent, event_from_jsonable, event_to_jsonable
from rollout_lifecycle.spec.invariants import check_trace, sometimes_from_events

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
    max_lag: int = 1


@attrs.frozen
class CheckResult:
    """One named check: passed or failed, and the figures it was decided on."""

    name: str
    passed: bool
    detail: str

    def to_json(self) -> dict[str, Any]:
        """As stored in a result file."""
        return {"name": self.name, "passed": self.passed, "detail": self.detail}

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}"


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


# ---- the seed's checks (need only the seed's field paths) ---------------------------------


def _comparison(name: str, field: str, cmp: Any, tol: Tolerances) -> CheckResult | str:
    """Check `name`: the comparison stored at `field` within the fixed bounds (else technical)."""
    mx: Any = cmp.get("max_abs_error") if isinstance(cmp, Mapping) else None
    mean: Any = cmp.get("mean_abs_error") if isinstance(cmp, Mapping) else None
    if not (_finite(mx) and _finite(mean)):
        return f"{field} needs finite max_abs_error and mean_abs_error"
    return CheckResult(
        name,
        mx <= tol.max_abs_logprob and mean <= tol.mean_abs_logprob,
        f"max {mx:.4g} (<= {tol.max_abs_logprob}), mean {mean:.4g} (<= {tol.mean_abs_logprob})",
    )


def _admission_violations(doc: Mapping[str, Any], tol: Tolerances) -> tuple[list[str], list[str]]:
    """(technical problems, rows admitted over the drift bound) of decision.admission."""
    technical, over = [], []
    for i, row in enumerate(doc["decision"]["admission"]):
        drift, accepted = row.get("drift"), row.get("accepted")
        if not isinstance(accepted, bool):
            technical.append(f"decision.admission[{i}].accepted must be a boolean")
            continue
        if accepted and not (_finite(drift) and drift <= tol.max_drift):
            over.append(f"admission[{i}]: admitted with drift {drift} over {tol.max_drift}")
    return technical, over


def _seed_checks(doc: Mapping[str, Any], tol: Tolerances) -> tuple[list[str], list[CheckResult]]:
    technical: list[str] = []
    checks: list[CheckResult] = []
    upd = doc["update"]
    if not all(_finite(upd[k]) for k in ("grad_norm", "delta_l2")):
        technical.append("update.grad_norm / update.delta_l2 must be finite numbers")
    else:
        checks.append(
            CheckResult(
                "update_moved_weights",
                upd["delta_l2"] > 0 and upd["changed_tensors"] > 0,
                f"delta_l2 {upd['delta_l2']:.6g}, {upd['changed_tensors']} tensors changed",
            )
        )
        checks.append(
            CheckResult(
                "weights_changed_hash",
                upd["after_sha256"] != doc["initialization"]["adapter_sha256"],
                "after-update hash differs from the initial adapter hash",
            )
        )
    got = _comparison(
        "same_version_logprobs",
        "same_version_after",
        doc["decision"]["comparisons"]["same_version_after"],
        tol,
    )
    if isinstance(got, str):
        technical.append(got)
    else:
        checks.append(got)
    sync = doc["sync_rpc_and_version"]
    checks.append(
        CheckResult(
            "version_seen_after_sync",
            sync.get("version_before") == 0 and sync.get("version_after") == 1,
            f"generation side saw v{sync.get('version_before')} -> v{sync.get('version_after')}",
        )
    )
    return technical, checks


def trace_report(events: Iterable[TraceEvent]) -> dict[str, Any]:
    """Replay a run's trace through the spec (at quiescence: the run left nothing pending).

    Returns which invariants were checked, which held, which were violated (with messages),
    how many atomic steps and events were judged, and the sometimes-properties reached.
    """
    evs = list(events)
    rep = check_trace(evs, quiescent=True)
    violated: dict[str, list[str]] = {}
    for v in rep.violations:
        violated.setdefault(v.invariant, []).append(str(v))
    return {
        "checked": list(rep.checked),
        "held": [n for n in rep.checked if n not in violated],
        "violated": violated,
        "steps": rep.steps,
        "events": rep.events,
        "sometimes": sorted(sometimes_from_events(evs)),
    }


def judge(
    doc: Mapping[str, Any], tol: Tolerances | None = None, trace: Iterable[TraceEvent] | None = None
) -> Verdict:
    """Check one group's evidence (the seed's fields) against the tolerances and its trace."""
    tol = tol or Tolerances()
    technical = validate(doc)
    if technical:
        return Verdict(tuple(technical), (), (), ())
    tech, checks = _seed_checks(doc, tol)
    technical += tech
    tech, over = _admission_violations(doc, tol)
    technical += tech
    failed = [str(c) for c in checks if not c.passed] + over
    passed = [str(c) for c in checks if c.passed]
    violations: tuple[str, ...] = ()
    if trace is not None:
        rep = check_trace(trace)
        violations = tuple(str(v) for v in rep.violations)
    return Verdict(tuple(technical), tuple(failed), tuple(passed), violations)


# ---- every check of a full group document -------------------------------------------------


def _artifact(doc: Mapping[str, Any], version: Any) -> Mapping[str, Any] | None:
    arts = doc.get("protocol", {}).get("artifacts", {})
    art = arts.get(str(version))
    return art if isinstance(art, Mapping) else None


def _check_base_frozen(doc: Mapping[str, Any], _t: Tolerances) -> CheckResult:
    ok = doc["update"]["base_weights_unchanged"] is True
    return CheckResult(
        "base_weights_frozen", ok, "base weights bit-identical" if ok else "base weights moved"
    )


def _check_attribution(doc: Mapping[str, Any], _t: Tolerances) -> CheckResult:
    tensors = doc["update"]["tensors"]
    wrong = [
        n
        for n, t in tensors.items()
        if t["change"] != {"lora_B": "gradient", "lora_A": "weight_decay"}.get(t["role"])
    ]
    grad = sum(t["change"] == "gradient" for t in tensors.values())
    wd = sum(t["change"] == "weight_decay" for t in tensors.values())
    detail = f"{grad} changed by gradient (lora_B), {wd} by weight decay only (lora_A)"
    if wrong:
        detail += f"; unexpected: {', '.join(sorted(wrong)[:3])}"
    return CheckResult("change_attribution", not wrong and bool(tensors), detail)


def _check_before(doc: Mapping[str, Any], tol: Tolerances) -> CheckResult:
    got = _comparison(
        "same_version_before",
        "same_version_before",
        doc["decision"]["comparisons"]["same_version_before"],
        tol,
    )
    if isinstance(got, str):
        raise KeyError(got)
    return got


def _check_admission(doc: Mapping[str, Any], tol: Tolerances) -> CheckResult:
    tech, over = _admission_violations(doc, tol)
    if tech:
        raise KeyError("; ".join(tech))
    rows = doc["decision"]["admission"]
    n = sum(bool(r["accepted"]) for r in rows)
    detail = f"{n} admitted, {len(rows) - n} rejected (D_max {tol.max_drift})"
    return CheckResult("admission_within_bounds", not over, "; ".join([detail, *over]))


def _check_consumed(doc: Mapping[str, Any], _t: Tolerances) -> CheckResult:
    prot = doc["protocol"]
    states = prot["ledger_states"]
    rows = doc["decision"]["admission"]
    admitted = sorted(r["rollout_id"] for r in rows if r["accepted"])
    rejected = sorted(r["rollout_id"] for r in rows if not r["accepted"])
    problems = [
        f"{r} admitted but {states.get(r)}" for r in admitted if states.get(r) != "consumed"
    ]
    problems += [
        f"{r} rejected but {states.get(r)}"
        for r in rejected
        if states.get(r) in ("reserved", "consumed")
    ]
    if sorted(prot["reservation"]["reserved"]) != admitted:
        problems.append("the update reserved other rollouts than the admitted ones")
    return CheckResult(
        "update_consumed_admitted",
        not problems,
        "; ".join(problems)
        or f"{len(admitted)} admitted reserved and consumed by {prot['reservation']['update_id']}, "
        f"{len(rejected)} rejected left unreserved",
    )


def _check_artifact(doc: Mapping[str, Any], _t: Tolerances) -> CheckResult:
    art = _artifact(doc, 1)
    if art is None:
        return CheckResult("artifact_committed", False, "no v1 artifact was published")
    problems = []
    if art["read_back_adapter_sha256"] != doc["update"]["after_sha256"]:
        problems.append("its tensors are not the trained ones")
    if art["read_back_base_sha256"] != doc["initialization"]["base_sha256"]:
        problems.append("its base hash is not the trainer's")
    if art["registered_hash"] != art["artifact_hash"]:
        problems.append("the registry holds another hash")
    return CheckResult(
        "artifact_committed",
        not problems,
        "; ".join(problems)
        or f"v1 {art['artifact_hash'][:12]} verified on disk and holds the trained tensors",
    )


def _check_pointer(doc: Mapping[str, Any], _t: Tolerances) -> CheckResult:
    art = _artifact(doc, 1)
    p = doc["protocol"]["pointer_after"]
    ok = art is not None and p == {"version": 1, "artifact_hash": art["artifact_hash"]}
    act = doc["protocol"]["activation"]
    return CheckResult(
        "activation_flipped_pointer",
        ok,
        f"pointer v{p['version'] if p else None} after the update (try_activate: {act['reason']})",
    )


def _check_acks(doc: Mapping[str, Any], _t: Tolerances) -> CheckResult:
    acks = doc["sync_rpc_and_version"]["acks"]
    bad = [a for a in acks if a["artifact_hash"] != a["held_at_ack"]]
    return CheckResult(
        "ack_matches_held",
        bool(acks) and not bad,
        "; ".join(
            f"v{a['version']} acked {a['artifact_hash'][:12]} holding {str(a['held_at_ack'])[:12]}"
            for a in bad
        )
        or f"{len(acks)} acks, each the hash of what the generation side held",
    )


def _check_holds(doc: Mapping[str, Any], _t: Tolerances) -> CheckResult:
    art = _artifact(doc, 1)
    held = doc["sync_rpc_and_version"]["held_after_sync"]
    ok = art is not None and held == art["artifact_hash"]
    want = art["artifact_hash"][:12] if art else None
    return CheckResult(
        "generation_holds_artifact",
        ok,
        f"after the v1 sync the generation side holds {str(held)[:12]}, v1 is {want}",
    )


def _check_announced(doc: Mapping[str, Any], _t: Tolerances) -> CheckResult:
    anns = doc["sync_rpc_and_version"]["announcements"]
    bad = []
    for a in anns:
        art = _artifact(doc, a["version"])
        if art is None or a["held"] != art["artifact_hash"]:
            bad.append(f"v{a['version']} announced holding {str(a['held'])[:12]}")
    return CheckResult(
        "version_matches_weights",
        bool(anns) and not bad,
        "; ".join(bad) or f"{len(anns)} announcements, each made holding that version's weights",
    )


def _check_memory(doc: Mapping[str, Any], _t: Tolerances) -> CheckResult:
    gen = doc["generation_side"]
    mode = gen["mode"]
    upd = [e["event"] for e in gen["events"] if e["phase"] == "update"]
    sync = [
        e["event"] + (":" + ",".join(e.get("tags", [])) if e["event"] == "resume" else "")
        for e in gen["events"]
        if e["phase"] == "sync_v1" and e["event"] in ("resume", "update_weights", "release")
    ]
    if mode == "release_resume":
        ok = (
            "release" in upd
            and bool(sync)
            and sync[0] == "resume:weights"
            and sync[-1] == "resume:kv_cache"
        )
    else:
        ok = "release" not in upd and not any(s.startswith("resume") for s in sync)
    return CheckResult(
        "generation_memory_mode",
        ok,
        f"{mode}: update phase {upd or ['(nothing)']}, v1 sync {sync}",
    )


def _check_trace(doc: Mapping[str, Any], _t: Tolerances) -> CheckResult:
    inv = doc["invariants"]
    outcome = doc["protocol"]["reservation"]["outcome_violations"]
    bad = sorted(inv["violated"]) + [f"{v}" for v in outcome]
    return CheckResult(
        "trace_invariants",
        bool(inv["checked"]) and not bad,
        f"{len(inv['held'])}/{len(inv['checked'])} invariants held over {inv['steps']} steps"
        + (f"; violated: {', '.join(bad)}" if bad else ""),
    )


GROUP_CHECKS: tuple[Callable[[Mapping[str, Any], Tolerances], CheckResult], ...] = (
    _check_base_frozen,
    _check_attribution,
    _check_before,
    _check_admission,
    _check_consumed,
    _check_artifact,
    _check_pointer,
    _check_acks,
    _check_holds,
    _check_announced,
    _check_memory,
    _check_trace,
)


# every check of a group, in the order results list them (docs/gpu-check.md's table)
CHECK_ORDER = (
    "update_moved_weights",
    "weights_changed_hash",
    "base_weights_frozen",
    "change_attribution",
    "same_version_before",
    "same_version_logprobs",
    "version_seen_after_sync",
    "admission_within_bounds",
    "update_consumed_admitted",
    "artifact_committed",
    "activation_flipped_pointer",
    "ack_matches_held",
    "generation_holds_artifact",
    "version_matches_weights",
    "generation_memory_mode",
    "trace_invariants",
)


def judge_group(
    doc: Mapping[str, Any], tol: Tolerances | None = None
) -> tuple[list[str], list[CheckResult]]:
    """(technical problems, every check) of one trained group's full evidence document."""
    tol = tol or Tolerances()
    technical = validate(doc)
    if technical:
        return technical, []
    technical, checks = _seed_checks(doc, tol)
    for fn in GROUP_CHECKS:
        try:
            checks.append(fn(doc, tol))
        except (KeyError, TypeError, AttributeError, IndexError) as exc:
            technical.append(f"{fn.__name__.removeprefix('_check_')}: evidence field {exc}")
    checks.sort(key=lambda c: CHECK_ORDER.index(c.name))
    return technical, checks


def judge_result(doc: Mapping[str, Any]) -> tuple[list[str], list[CheckResult]]:
    """Technical problems and checks of a whole result (every group, then the run's own).

    Group checks are named `<group>/<check>`; technical failures the run recorded are kept.
    """
    tol = Tolerances(**doc.get("tolerances", {}))
    technical = [f"{t['stage']}: {t['message']}" for t in doc.get("technical", [])]
    checks: list[CheckResult] = []
    groups: Sequence[Mapping[str, Any]] = doc.get("groups", [])
    for g in groups:
        if not g.get("initialization", {}).get("trained", False):
            continue
        tech, cs = judge_group(g, tol)
        technical += [f"{g['group']}: {t}" for t in tech]
        checks += [attrs.evolve(c, name=f"{g['group']}/{c.name}") for c in cs]
    if len(groups) >= 2:
        first = groups[0]["initialization"]["adapter_sha256"]
        second = groups[1]["initialization"]["adapter_sha256"]
        checks.append(
            CheckResult(
                "groups_same_initial_adapter",
                first == second and bool(groups[1]["initialization"].get("trained")),
                f"{groups[0]['group']} {first[:12]} vs {groups[1]['group']} {second[:12]}"
                + ("" if first == second else "; the second group did not train"),
            )
        )
    return technical, checks


# ---- files ---------------------------------------------------------------------------------


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


def dump_trace(events: Iterable[TraceEvent]) -> str:
    """JSON lines of a trace, one event per line (the inverse of `load_trace`)."""
    return "".join(json.dumps(event_to_jsonable(e), sort_keys=True) + "\n" for e in events)


def check_label(label: Any) -> str:
    """A run label usable as one file name; EvidenceError otherwise."""
    if not isinstance(label, str) or not _LABEL.match(label):
        raise EvidenceError(
            f"run_label {label!r}: use 1-100 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit (it names the result file)"
        )
    return label


def result_path(root: Path, label: str) -> Path:
    """Where the result of `label` lives under `root`."""
    return Path(root) / f"{check_label(label)}.json"


def save(root: Path, doc: Mapping[str, Any], *, require_seed_paths: bool = True) -> Path:
    """Store a well-formed evidence document under its label; never overwrite a result.

    The bytes go through the project's atomic writer into a staging name, then a hard link
    publishes them: `link(2)` fails when the label exists, so two runs racing on one label
    cannot both win and an existing result is never replaced. A run that failed before any
    update (`require_seed_paths=False`) is stored without the seed's paths: its technical
    failures are the result.
    """
    problems = validate(doc) if require_seed_paths else []
    if problems:
        raise EvidenceError("evidence is not well-formed: " + "; ".join(problems))
    final = result_path(Path(root), doc["run_label"])
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    if final.exists():
        raise EvidenceError(
            f"a result for run_label {doc['run_label']!r} already exists at {final}; "
            "a new run needs a new label"
        )
    staged = root / f".{final.name}.{os.getpid()}.staged"
    atomic_write(staged, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    try:
        os.link(staged, final)  # fails if the label exists: results are never overwritten
    except FileExistsError:
        raise EvidenceError(
            f"a result for run_label {doc['run_label']!r} already exists at {final}; "
            "a new run needs a new label"
        ) from None
    finally:
        staged.unlink(missing_ok=True)
    return final
