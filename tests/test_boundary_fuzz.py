"""Property-based fuzz of every boundary: hostile values in, typed errors or correct results out.

Each entry point (the small API, the records, a ledger's calls, the gate, backend URLs, the
`admit` input lines and the CLI's options) gets values chosen to break naive validation:
huge ints, non-finite floats, bools where ints belong, wrong types, deep nesting, odd
paths. The property is the same everywhere: the call returns, or raises one of the
project's typed errors (RolloutLifecycleError) with a message; never another exception, and
a command never prints a traceback.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import click
import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_lifecycle import (
    activate_policy_version,
    assess_policy_compatibility,
    compare_and_reserve,
    transition_lifecycle,
)
from rollout_lifecycle.cli.main import cli
from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.errors import RolloutLifecycleError
from rollout_lifecycle.model.gate import AdmissionGate, GatePolicy, assess_arrays
from rollout_lifecycle.model.ledger import MemoryLedger, ReserveRequest
from rollout_lifecycle.model.records import (
    ActionEvidence,
    AdmissionStamp,
    LedgerEntry,
    Reward,
    WorkerAck,
)

TRIED: Counter[str] = Counter()  # inputs tried per entry point (printed at the end)

FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def nested(depth: int) -> Any:
    """A JSON value nested `depth` levels deep (deeper than any parser's recursion)."""
    out: Any = 0
    for _ in range(depth):
        out = [out]
    return out


hostile_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**63, 2**63 - 1, -1, 10**30, 10**400, 0]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, -1e308, 0.0]),
    st.complex_numbers(allow_nan=False, allow_infinity=False, max_magnitude=1e3),
    st.text(max_size=8),
    st.binary(max_size=4),
)
hostile = st.one_of(
    hostile_scalar,
    st.lists(hostile_scalar, max_size=4),
    st.dictionaries(st.text(max_size=4), hostile_scalar, max_size=3),
    st.just(nested(3000)),
)


def typed_or_ok(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call fn; a typed error is fine, any other exception fails the property."""
    try:
        return fn(*args, **kwargs)
    except RolloutLifecycleError as exc:
        assert str(exc), "a typed error says what was wrong"
        return None


@FUZZ
@given(state=hostile, event=hostile)
def test_transition_lifecycle(state: Any, event: Any) -> None:
    """Any state/event: a next state, or ValueError (IllegalTransition)."""
    TRIED["transition_lifecycle"] += 1
    typed_or_ok(transition_lifecycle, state, event)


@FUZZ
@given(
    old=st.one_of(hostile, st.lists(hostile_scalar, min_size=1, max_size=5)),
    cur=st.one_of(hostile, st.lists(hostile_scalar, min_size=1, max_size=5)),
    mask=st.one_of(hostile, st.lists(st.one_of(st.booleans(), hostile_scalar), max_size=5)),
    bv=hostile_scalar,
    cv=hostile_scalar,
    lag=hostile_scalar,
    drift=hostile_scalar,
)
def test_assess_policy_compatibility(
    old: Any, cur: Any, mask: Any, bv: Any, cv: Any, lag: Any, drift: Any
) -> None:
    """Hostile log-probs, masks, versions and bounds: a decision or a typed error."""
    TRIED["assess_policy_compatibility"] += 1
    out = typed_or_ok(assess_policy_compatibility, old, cur, mask, bv, cv, lag, drift)
    if out is not None:
        assert out["reason"] in {
            "ok",
            "empty_action_mask",
            "future_policy",
            "stale_policy",
            "policy_drift",
        }
        d = out["mean_abs_log_ratio"]
        assert d is None or (isinstance(d, float) and not math.isnan(d))


@FUZZ
@given(
    ledger=st.one_of(
        hostile,
        st.dictionaries(
            st.just("r"),
            st.fixed_dictionaries(
                {"lifecycle_state": hostile_scalar, "revision": hostile_scalar},
                optional={"reserved_by": hostile_scalar},
            ),
        ),
    ),
    rid=st.one_of(st.just("r"), hostile_scalar),
    rev=hostile_scalar,
    upd=hostile_scalar,
)
def test_compare_and_reserve(ledger: Any, rid: Any, rev: Any, upd: Any) -> None:
    """Hostile dict ledgers and arguments: a result dict, or a typed error."""
    TRIED["compare_and_reserve"] += 1
    out = typed_or_ok(compare_and_reserve, ledger, rid, rev, upd)
    if out is not None:
        assert set(out) >= {"reserved", "reason", "record"}


@FUZZ
@given(pointer=hostile, artifact=hostile, workers=hostile, required=hostile)
def test_activate_policy_version(pointer: Any, artifact: Any, workers: Any, required: Any) -> None:
    """Hostile pointers, artifacts, worker states and worker sets: typed errors only."""
    TRIED["activate_policy_version"] += 1
    typed_or_ok(activate_policy_version, pointer, artifact, workers, required)


@FUZZ
@given(ids=hostile, mask=hostile, lp=hostile, reward=hostile_scalar, version=hostile_scalar)
def test_records(ids: Any, mask: Any, lp: Any, reward: Any, version: Any) -> None:
    """Records built from hostile values refuse them with InvalidRecord."""
    TRIED["records"] += 1
    typed_or_ok(ActionEvidence, ids, mask, lp)
    typed_or_ok(Reward, "rm", "1", reward)
    typed_or_ok(WorkerAck, "w", version, "h" * 64)
    typed_or_ok(LedgerEntry, rollout_id="r", behavior_version=version, artifact_hash="h")
    typed_or_ok(
        AdmissionStamp,
        current_version=version,
        behavior_version=0,
        max_lag=1,
        max_drift=0.2,
        drift=reward,
        freshness="fresh",
        reason="ok",
        accepted=True,
    )


@FUZZ
@given(rid=hostile, rev=hostile_scalar, upd=hostile_scalar, batch=hostile)
def test_ledger_calls(rid: Any, rev: Any, upd: Any, batch: Any) -> None:
    """A ledger's calls with hostile arguments: typed errors, and nothing written."""
    TRIED["ledger"] += 1
    led = MemoryLedger()
    typed_or_ok(led.add, rid)
    typed_or_ok(led.reserve, rid, rev, upd, None)
    typed_or_ok(led.reserve_batch, upd, batch)
    typed_or_ok(led.reserve_batch, "u", [ReserveRequest(rid, rev, None)])
    typed_or_ok(led.transition, rid, "reward_ready", rev)
    typed_or_ok(led.commit, upd, batch)
    assert led.snapshot() == {} and led.history() == []


@FUZZ
@given(
    shape=st.sampled_from([(2, 3), (0, 3), (2,), (2, 3, 1), (1, 0)]),
    fill=hostile_scalar,
    mask_fill=hostile_scalar,
    versions=hostile,
    cv=hostile_scalar,
)
def test_gate_arrays(shape: Any, fill: Any, mask_fill: Any, versions: Any, cv: Any) -> None:
    """assess_arrays on hostile arrays, masks and versions: a batch result or a typed error."""
    TRIED["assess_arrays"] += 1
    try:
        old = np.full(shape, fill)
        mask = np.full(shape, mask_fill)
    except (TypeError, ValueError, OverflowError):
        old = np.zeros((2, 3))
        mask = np.ones((2, 3), dtype=bool)
    typed_or_ok(assess_arrays, old, np.zeros_like(old, dtype=float), mask, versions, cv, 1, 0.2)


@FUZZ
@given(policy=st.tuples(hostile_scalar, hostile_scalar), registry=hostile)
def test_gate_policy_and_registry(policy: Any, registry: Any) -> None:
    """Gate bounds, and a registry callable that raises its own error, come out typed."""
    TRIED["gate_policy"] += 1
    typed_or_ok(GatePolicy, *policy)

    def broken(_v: int) -> str:
        raise KeyError("the registry service is down")

    gate = AdmissionGate(GatePolicy(1, 0.2), registry=broken)
    from rollout_lifecycle.stateful_tests.builders import make_rollout

    ro = make_rollout("r", 0, 0, "h" * 64)
    typed_or_ok(
        gate.assess,
        ro,
        [-0.5, -0.5],
        1,
        LedgerEntry("r", 0, "h" * 64, state="rewarded", reward=Reward("rm", "1", 1.0)),
    )


@FUZZ
@given(
    url=st.one_of(hostile, st.text(max_size=40).map(lambda s: f"sqlite:///{s}")),
    lease=hostile_scalar,
)
def test_open_backend(url: Any, lease: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Backend URLs and lease lengths: a backend, or BackendURLError / a typed error."""
    TRIED["open_backend"] += 1
    cwd = tmp_path_factory.mktemp("urls")
    import os

    old = os.getcwd()
    os.chdir(cwd)
    try:
        b = typed_or_ok(open_backend, url, lease_seconds=lease if lease is not None else 600.0)
        if b is not None:
            b.close()
        long = f"sqlite:///{'x' * 300}.db"
        typed_or_ok(open_backend, long)
    finally:
        os.chdir(old)


ROW = {
    "rollout_id": "r",
    "prompt_id": "p",
    "dataset": "d",
    "sample_index": 0,
    "behavior_version": 0,
    "artifact_hash": "a" * 64,
    "conditions": {
        "tokenizer_id": "t",
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_tokens": 4,
    },
    "response_token_ids": [1, 2],
    "action_mask": [True, True],
    "behavior_log_probs": [-0.5, -0.5],
    "current_log_probs": [-0.5, -0.5],
}


def _json_text(v: Any) -> str:
    """The value as JSON text: deep nesting written out literally, non-JSON types as text."""
    try:
        return json.dumps(v)
    except RecursionError:
        return "[" * 3000 + "0" + "]" * 3000
    except (TypeError, ValueError):
        return json.dumps(type(v).__name__)


@settings(FUZZ, max_examples=100)
@given(field=st.sampled_from(sorted(ROW)), value=hostile)
def test_admit_input_lines(
    field: str, value: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One hostile field in a JSONL line: exit 0 or 2, a one-line message, no traceback."""
    TRIED["admit_lines"] += 1
    tmp = tmp_path_factory.mktemp("admit")
    row = dict(ROW)
    text = json.dumps(row).replace(json.dumps(row[field]), _json_text(value), 1)
    inp = tmp / "in.jsonl"
    inp.write_text(text + "\n")
    res = CliRunner().invoke(
        cli,
        [
            "admit",
            str(inp),
            "--out",
            str(tmp / "o.jsonl"),
            "--current-version",
            "0",
            "--max-lag",
            "1",
            "--max-drift",
            "0.2",
            "--quiet",
        ],
    )
    assert res.exit_code in (0, 2), res.output
    assert "Traceback" not in res.output
    if res.exit_code == 0:
        for line in (tmp / "o.jsonl").read_text().splitlines():
            json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))


@settings(FUZZ, max_examples=100)
@given(
    option=st.sampled_from(
        [
            ("explore", "--max-states"),
            ("fuzz", "--examples"),
            ("fuzz", "--time-budget"),
            ("fuzz", "--seed"),
            ("campaign", "--examples"),
            ("race", "--seconds"),
            ("admit", "--current-version"),
            ("admit", "--max-drift"),
        ]
    ),
    value=st.one_of(
        st.sampled_from(
            [
                "nan",
                "inf",
                "-1",
                "1_0",
                "9223372036854775808",
                "1e400",
                "",
                "x",
                "0x10",
                " 3 ",
                "3.5",
            ]
        ),
        st.text(max_size=6),
    ),
)
def test_cli_options(option: tuple[str, str], value: str) -> None:
    """Hostile option values are parsed to a valid value or refused as usage errors, at
    parse time (before any work), never with another exception."""
    TRIED["cli_options"] += 1
    cmd, name = option
    args = [name, value]
    if cmd == "admit":
        args = ["/dev/null", "--out", "/tmp/o.jsonl", "--current-version", "0", "--max-lag"]
        args += ["1", "--max-drift", "0.2", name, value]
    command = cli.get_command(click.Context(cli), cmd)  # lazy commands load here
    assert command is not None
    try:
        ctx = command.make_context(cmd, list(args))
    except click.UsageError:
        return  # refused at parse time (BadParameter, NoSuchOption, ...): exit 2
    chosen = ctx.params[name.lstrip("-").replace("-", "_")]
    if isinstance(chosen, float):
        assert math.isfinite(chosen)
    if isinstance(chosen, int):
        assert 0 <= chosen <= 2**63 - 1


def test_zz_report_how_many_inputs_were_tried(capsys: pytest.CaptureFixture[str]) -> None:
    """How many hostile inputs each entry point received in this run (for the record)."""
    with capsys.disabled():
        print("\nboundary fuzz inputs tried:", dict(sorted(TRIED.items())))
    assert not TRIED or all(n > 0 for n in TRIED.values())


def test_paths_are_checked(tmp_path: Path) -> None:
    """Output paths under a file are usage errors before any work."""
    f = tmp_path / "some.jsonl"
    f.write_text("{}\n")
    runner = CliRunner()
    for args in (
        ["diagram", "--out", str(f / "x.mmd"), "--machine", "lifecycle"],
        ["diagram", "--write-docs", str(f / "x")],
        ["fuzz", "--out", str(f / "w"), "--examples", "1"],
        ["campaign", "--out", str(f / "w"), "--examples", "1"],
        ["demo", "--workdir", str(f / "w")],
        ["explore", "--report", str(f / "r.json"), "--model", "activation-2v"],
    ):
        res = runner.invoke(cli, args)
        assert res.exit_code == 2, (args, res.output)
        assert "Traceback" not in res.output
