"""`rollout-lifecycle admit`: decisions and summary on good input, and every error path."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rollout_lifecycle.cli.main import cli
from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.gate import AdmissionGate
from rollout_lifecycle.model.records import WorkerAck

H = {v: f"{v:x}" * 64 for v in range(4)}
CONDITIONS = {
    "tokenizer_id": "tok",
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_tokens": 8,
    "seed": None,
}


def row(rid: str, bv: int = 3, shift: float = 0.01, **over: Any) -> dict[str, Any]:
    """One valid input rollout; prompt token masked out, current = behaviour + shift."""
    old = [-0.5, -1.0, -1.5, -2.0]
    base: dict[str, Any] = {
        "rollout_id": rid,
        "prompt_id": "p0",
        "dataset": "d",
        "sample_index": 0,
        "behavior_version": bv,
        "artifact_hash": H.get(bv, "z" * 64),
        "conditions": dict(CONDITIONS),
        "response_token_ids": [1, 2, 3, 4],
        "action_mask": [False, True, True, True],
        "behavior_log_probs": old,
        "current_log_probs": [o + shift for o in old],
    }
    base.update(over)
    return base


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """Rows as JSONL; strings are written verbatim (for deliberately broken lines)."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def run(args: list[str]) -> Result:
    """Invoke the CLI group as a user would."""
    return CliRunner().invoke(cli, args)


def admit_args(inp: Path, out: Path, *extra: str) -> list[str]:
    """The usual admit invocation: current v3, L_max 1, D_max 0.2."""
    return [
        "admit",
        str(inp),
        "--out",
        str(out),
        "--current-version",
        "3",
        "--max-lag",
        "1",
        "--max-drift",
        "0.2",
        *extra,
    ]


MIXED = [
    row("fresh-ok", 3),
    row("tolerated-ok", 2, shift=-0.1),
    row("stale", 1),
    row("future", 4),
    row("drift", 3, shift=0.5),
    row("empty-mask", 3, action_mask=[False] * 4),
    row("waiting", 3, state="generated"),
]


def read_out(out: Path) -> list[dict[str, Any]]:
    """The decisions file as a list of dicts."""
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_good_run_writes_every_decision_and_a_right_summary(tmp_path: Path) -> None:
    """Each rollout gets its decision line, in input order; the JSON summary counts them."""
    inp = write_jsonl(tmp_path / "in.jsonl", MIXED)
    out = tmp_path / "decisions.jsonl"
    res = run(admit_args(inp, out, "--json"))
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["total"] == 7 and summary["accepted"] == 2 and summary["rejected"] == 5
    assert summary["by_reason"] == {
        "empty_action_mask": 1,
        "future_policy": 1,
        "not_finished": 1,
        "ok": 2,
        "policy_drift": 1,
        "stale_policy": 1,
    }
    assert summary["by_route"] == {
        "admit": 2,
        "offline": 1,
        "quarantine": 1,
        "reject": 2,
        "wait": 1,
    }
    assert summary["by_freshness"] == {
        "future": 1,
        "fresh": 3,
        "tolerated": 1,
        "stale": 1,
        "n/a": 1,
    }
    assert summary["drift"]["count"] == 4
    assert summary["drift"]["min"] == pytest.approx(0.01)
    assert summary["drift"]["max"] == pytest.approx(0.5)
    decisions = read_out(out)
    assert [d["rollout_id"] for d in decisions] == [r["rollout_id"] for r in MIXED]
    by_id = {d["rollout_id"]: d for d in decisions}
    assert set(by_id["fresh-ok"]) == {
        "rollout_id",
        "accepted",
        "reason",
        "route",
        "freshness",
        "drift",
        "lag",
        "current_version",
    }
    assert by_id["fresh-ok"]["accepted"] is True
    assert by_id["fresh-ok"]["drift"] == pytest.approx(0.01)
    assert by_id["tolerated-ok"] | {"drift": 0} == {
        "rollout_id": "tolerated-ok",
        "accepted": True,
        "reason": "ok",
        "route": "admit",
        "freshness": "tolerated",
        "drift": 0,
        "lag": 1,
        "current_version": 3,
    }
    assert by_id["stale"]["route"] == "offline" and by_id["stale"]["lag"] == 2
    assert by_id["future"]["reason"] == "future_policy" and by_id["future"]["lag"] == -1
    assert by_id["drift"]["reason"] == "policy_drift"
    assert by_id["empty-mask"]["drift"] is None and by_id["empty-mask"]["freshness"] is None
    assert by_id["waiting"]["route"] == "wait"


def test_table_summary_names_reasons_routes_and_drift(tmp_path: Path) -> None:
    """Without --json a table by reason and route is printed, plus freshness and drift."""
    inp = write_jsonl(tmp_path / "in.jsonl", MIXED)
    res = run(admit_args(inp, tmp_path / "o.jsonl"))
    assert res.exit_code == 0, res.output
    assert "admitted 2 of 7 rollouts" in res.stdout
    for word in ("policy_drift", "quarantine", "offline", "tolerated", "median"):
        assert word in res.stdout
    assert "artifact hashes are not checked" in res.stderr


def test_chunking_does_not_change_decisions(tmp_path: Path) -> None:
    """Gating in chunks of 2 writes exactly what one chunk writes."""
    inp = write_jsonl(tmp_path / "in.jsonl", MIXED)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert run(admit_args(inp, a)).exit_code == 0
    assert run(admit_args(inp, b, "--chunk-size", "2")).exit_code == 0
    assert a.read_text() == b.read_text()


def test_uses_the_vectorised_batch_gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rollouts go through the batch gate (assess_batch over records, or assess_columns
    where a chunk is valid throughout), one call per chunk."""
    calls: list[int] = []
    batch, columns = AdmissionGate.assess_batch, AdmissionGate.assess_columns

    def spy(self: AdmissionGate, rollouts: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(rollouts))
        return batch(self, rollouts, *args, **kwargs)

    def spy_columns(self: AdmissionGate, cols: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(cols.rollout_ids))
        return columns(self, cols, *args, **kwargs)

    monkeypatch.setattr(AdmissionGate, "assess_batch", spy)
    monkeypatch.setattr(AdmissionGate, "assess_columns", spy_columns)
    inp = write_jsonl(tmp_path / "in.jsonl", MIXED)
    assert run(admit_args(inp, tmp_path / "o.jsonl", "--chunk-size", "3")).exit_code == 0
    assert calls == [3, 3, 1]


def test_blank_lines_are_skipped_and_empty_input_is_fine(tmp_path: Path) -> None:
    """Blank lines are not rollouts; an empty file gives an empty decisions file."""
    inp = write_jsonl(tmp_path / "in.jsonl", ["", row("a"), "   "])
    out = tmp_path / "o.jsonl"
    res = run(admit_args(inp, out, "--json"))
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["total"] == 1
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    out2 = tmp_path / "o2.jsonl"
    res = run(admit_args(empty, out2, "--json"))
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["drift"]["count"] == 0
    assert out2.read_text() == ""


def test_registry_json_quarantines_unknown_versions_and_wrong_hashes(tmp_path: Path) -> None:
    """With --registry-json, a wrong hash or a never-active version is quarantined."""
    reg = tmp_path / "reg.json"
    reg.write_text(json.dumps({"2": H[2], "3": H[3]}))
    rows = [row("good"), row("bad-hash", artifact_hash="f" * 64), row("unknown", 2)]
    rows[2]["behavior_version"] = 1
    rows[2]["artifact_hash"] = H[1]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "o.jsonl"
    res = run(admit_args(inp, out, "--registry-json", str(reg)))
    assert res.exit_code == 0, res.output
    got = {d["rollout_id"]: (d["reason"], d["route"]) for d in read_out(out)}
    assert got == {
        "good": ("ok", "admit"),
        "bad-hash": ("artifact_hash_mismatch", "quarantine"),
        "unknown": ("unregistered_version", "quarantine"),
    }


def test_conditions_json_rejects_other_sampling(tmp_path: Path) -> None:
    """With --conditions-json, a rollout sampled at another temperature is rejected."""
    cond = tmp_path / "cond.json"
    cond.write_text(json.dumps(CONDITIONS))
    other = dict(CONDITIONS, temperature=0.7)
    inp = write_jsonl(tmp_path / "in.jsonl", [row("same"), row("other", conditions=other)])
    out = tmp_path / "o.jsonl"
    assert run(admit_args(inp, out, "--conditions-json", str(cond))).exit_code == 0
    reasons = [d["reason"] for d in read_out(out)]
    assert reasons == ["ok", "conditions_mismatch"]


def _activated_backend(path: Path) -> str:
    """A ledger file whose registry has v3 active with hash H[3] (two workers acked)."""
    url = f"sqlite:///{path}"
    with open_backend(url) as b:
        c = ActivationCoordinator(b.registry, ["w0", "w1"])
        c.prepare(3)
        c.commit_artifact(3, H[3])
        c.distribute(3)
        for w in ("w0", "w1"):
            c.record_ack(WorkerAck(w, 3, H[3], token=c.attempt_token(w, 3)))
        assert c.try_activate(3).activated
    return url


def test_backend_registry_is_read_from_the_coordinator(tmp_path: Path) -> None:
    """--backend reads ever-active versions from the stored registry."""
    url = _activated_backend(tmp_path / "state.db")
    rows = [row("good"), row("bad-hash", artifact_hash="f" * 64), row("v2", 2)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "o.jsonl"
    res = run(admit_args(inp, out, "--backend", url))
    assert res.exit_code == 0, res.output
    assert [d["reason"] for d in read_out(out)] == [
        "ok",
        "artifact_hash_mismatch",
        "unregistered_version",
    ]


def test_backend_warns_when_current_version_is_not_active(tmp_path: Path) -> None:
    """A --current-version other than the stored active one is admitted but warned about."""
    url = _activated_backend(tmp_path / "state.db")
    inp = write_jsonl(tmp_path / "in.jsonl", [row("a", 3)])
    args = admit_args(inp, tmp_path / "o.jsonl", "--backend", url)
    args[args.index("--current-version") + 1] = "4"
    res = run(args)
    assert res.exit_code == 0, res.output
    assert "active version" in res.stderr


def _no_leftovers(tmp_path: Path, out: Path) -> None:
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


NAN_AT_ACTION = row("x", behavior_log_probs=[-0.5, float("nan"), -1.5, -2.0])
INF_MASKED_OK = row("y", current_log_probs=[-math.inf, -0.99, -1.49, -1.99])


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ('{"rollout_id": "x",', "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({k: v for k, v in row("x").items() if k != "prompt_id"}, "missing field(s) ['prompt_id']"),
        (row("x", sample_index="0"), "sample_index must be a non-negative int"),
        (row("x", action_mask=[0, 1, 1, 1]), "action mask entries must be booleans"),
        (row("x", action_mask="1111"), "field 'action_mask' must be a list"),
        (row("x", current_log_probs=[-1, "a", -1, -1]), "'current_log_probs'[1] must be a number"),
        (row("x", current_log_probs=[-1.0, -1.0]), "2 current_log_probs for 4"),
        (NAN_AT_ACTION, "non-finite log-prob at action position 1"),
        (row("x", current_log_probs=[-1, -1, math.inf, -1]), "non-finite log-prob at action"),
        (row("x", conditions={"tokenizer_id": "t"}), "field 'conditions' is missing"),
        (row("x", conditions=dict(CONDITIONS, top_p=2.0)), "top_p must be in (0, 1]"),
        (row("x", state="done"), "field 'state' must be one of"),
        (row("x", extra=1), "unknown field(s) ['extra']"),
        (row("first"), "rollout_id 'first' already appeared on line 1"),
    ],
)
def test_bad_line_names_its_line_and_writes_nothing(tmp_path: Path, bad: Any, needle: str) -> None:
    """A bad line 3 fails with its line number, exit 1, no traceback, no output, no temp file."""
    inp = write_jsonl(tmp_path / "in.jsonl", [row("first"), INF_MASKED_OK, bad, row("last")])
    out = tmp_path / "o.jsonl"
    res = run(admit_args(inp, out, "--chunk-size", "1"))
    assert res.exit_code == 2, res.output
    assert "line 3:" in res.output and needle in res.output
    assert "no decisions were written" in res.output
    assert "Traceback" not in res.output
    assert isinstance(res.exception, SystemExit)  # a handled exit, not a crash
    _no_leftovers(tmp_path, out)


def test_not_utf8_is_a_line_error(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 are reported with their line."""
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(json.dumps(row("a")).encode() + b"\n\xff\xfe\n")
    res = run(admit_args(inp, tmp_path / "o.jsonl"))
    assert res.exit_code == 2 and "line 2:" in res.output
    _no_leftovers(tmp_path, tmp_path / "o.jsonl")


def test_missing_input_is_a_usage_error(tmp_path: Path) -> None:
    """A missing input file exits 2 with a message, never a traceback."""
    res = run(admit_args(tmp_path / "nope.jsonl", tmp_path / "o.jsonl"))
    assert res.exit_code == 2
    assert "does not exist" in res.output and "Traceback" not in res.output


def test_existing_out_is_refused_unless_force(tmp_path: Path) -> None:
    """An existing --out is kept untouched without --force and replaced with it."""
    inp = write_jsonl(tmp_path / "in.jsonl", [row("a")])
    out = tmp_path / "o.jsonl"
    out.write_text("precious\n")
    res = run(admit_args(inp, out))
    assert res.exit_code == 2 and "--force" in res.output
    assert out.read_text() == "precious\n"
    res = run(admit_args(inp, out, "--force"))
    assert res.exit_code == 0, res.output
    assert read_out(out)[0]["rollout_id"] == "a"


def test_failed_forced_run_keeps_the_old_output(tmp_path: Path) -> None:
    """With --force, an error midway leaves the previous decisions file as it was."""
    inp = write_jsonl(tmp_path / "in.jsonl", [row("a"), "{bad"])
    out = tmp_path / "o.jsonl"
    out.write_text("old\n")
    res = run(admit_args(inp, out, "--force", "--chunk-size", "1"))
    assert res.exit_code == 2 and "line 2:" in res.output
    assert out.read_text() == "old\n"


def test_interrupt_midway_leaves_no_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C after the first chunk was written leaves neither output nor temp file."""
    calls = []

    def interrupting(original: Any) -> Any:
        def interrupted(self: AdmissionGate, *args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return original(self, *args, **kwargs)

        return interrupted

    for name in ("assess_batch", "assess_columns"):  # records or columns: whichever runs
        monkeypatch.setattr(AdmissionGate, name, interrupting(getattr(AdmissionGate, name)))
    inp = write_jsonl(tmp_path / "in.jsonl", [row("a"), row("b"), row("c")])
    out = tmp_path / "o.jsonl"
    res = run(admit_args(inp, out, "--chunk-size", "1"))
    assert res.exit_code != 0
    _no_leftovers(tmp_path, out)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--max-drift", "inf"], "finite"),
        (["--max-drift", "-1"], "is not in [0.0"),
        (["--registry-json", "REG", "--backend", "memory://"], "not both"),
        (["--registry-json", "MISSING"], "no such file"),
        (["--registry-json", "BADKEY"], "is not a version"),
        (["--conditions-json", "BADCOND"], "temperature must be"),
        (["--backend", "sqlite:///MISSINGDB"], "no such file"),
        (["--backend", "postgresql+psycopg://localhost/x"], "drop the '+psycopg'"),
    ],
)
def test_bad_options_are_usage_errors(tmp_path: Path, extra: list[str], needle: str) -> None:
    """Bad options exit 2 with a one-line reason and write nothing."""
    (tmp_path / "reg.json").write_text(json.dumps({"3": H[3]}))
    (tmp_path / "badkey.json").write_text(json.dumps({"three": H[3]}))
    (tmp_path / "badcond.json").write_text(json.dumps(dict(CONDITIONS, temperature=-1)))
    names = {
        "REG": tmp_path / "reg.json",
        "MISSING": tmp_path / "missing.json",
        "BADKEY": tmp_path / "badkey.json",
        "BADCOND": tmp_path / "badcond.json",
        "sqlite:///MISSINGDB": f"sqlite:///{tmp_path / 'missing.db'}",
    }
    extra = [str(names.get(x, x)) for x in extra]
    inp = write_jsonl(tmp_path / "in.jsonl", [row("a")])
    out = tmp_path / "o.jsonl"
    args = admit_args(inp, out)
    args = args[:-2] + extra if extra[0] == "--max-drift" else args + extra
    res = run(args)
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output
    assert not out.exists()
    assert not (tmp_path / "missing.db").exists()


def test_out_directory_must_exist(tmp_path: Path) -> None:
    """An --out in a missing directory is a usage error."""
    inp = write_jsonl(tmp_path / "in.jsonl", [row("a")])
    res = run(admit_args(inp, tmp_path / "no" / "o.jsonl"))
    assert res.exit_code == 2 and "does not exist" in res.output


def test_progress_lines_when_piped_and_none_with_quiet(tmp_path: Path) -> None:
    """Piped stderr gets plain progress lines (no bar); --quiet silences them."""
    inp = write_jsonl(tmp_path / "in.jsonl", [row("a")])
    reg = tmp_path / "reg.json"
    reg.write_text(json.dumps({"3": H[3]}))
    res = run(admit_args(inp, tmp_path / "o.jsonl", "--registry-json", str(reg)))
    assert res.exit_code == 0 and "admit: " in res.stderr and "(100.0%)" in res.stderr
    assert "\r" not in res.stderr and "\x1b" not in res.stderr
    res = run([*admit_args(inp, tmp_path / "q.jsonl", "--registry-json", str(reg)), "--quiet"])
    assert res.exit_code == 0 and res.stderr == ""


def test_help_documents_the_input_schema() -> None:
    """--help lists every input field."""
    res = run(["admit", "--help"])
    assert res.exit_code == 0
    for field in ("rollout_id", "behavior_log_probs", "current_log_probs", "state"):
        assert field in res.output


def test_first_bad_line_wins_within_a_chunk(tmp_path: Path) -> None:
    """A NaN on line 2 is reported even when line 3 of the same chunk is not JSON at all."""
    inp = write_jsonl(tmp_path / "in.jsonl", [row("a"), NAN_AT_ACTION, "{oops", row("b")])
    res = run(admit_args(inp, tmp_path / "o.jsonl"))
    assert res.exit_code == 2
    assert "line 2: non-finite log-prob" in res.output


def test_many_chunks_write_every_line_once(tmp_path: Path) -> None:
    """50 rollouts in chunks of 7 give 50 decision lines, in input order."""
    rows = [row(f"r{i}", 3 - i % 3) for i in range(50)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "o.jsonl"
    res = run(admit_args(inp, out, "--chunk-size", "7", "--json"))
    assert res.exit_code == 0, res.output
    assert [d["rollout_id"] for d in read_out(out)] == [f"r{i}" for i in range(50)]
    assert json.loads(res.stdout)["by_freshness"]["stale"] == 16


def _varied_rows(n: int) -> list[dict[str, Any]]:
    """Rows of many widths, states, versions and reasons (some with more token ids than
    log-probs, one with a longer mask, non-ASCII ids, conditions mismatches), for comparing
    the two paths."""
    import random

    rng = random.Random(7)
    rows = []
    for i in range(n):
        k = rng.choice([0, 1, 3, 7, 64, 300])
        old = [round(-3 * rng.random(), 6) for _ in range(k)]
        r = row(
            f"r{i}-\u00e9" if i % 9 == 0 else f"r{i}",
            rng.randint(0, 4),
            response_token_ids=list(range(k + (1 if i % 17 == 4 else 0))),
            action_mask=[rng.random() < 0.7 for _ in range(k)],
            behavior_log_probs=old,
            current_log_probs=[o + rng.gauss(0, 0.3) for o in old],
        )
        if i % 11 == 5:
            r["state"] = rng.choice(["reserved", "consumed", "generated", "quarantined"])
        if i % 13 == 6:
            r["conditions"] = {**CONDITIONS, "top_p": 0.5}
        rows.append(r)
    rows[-10]["action_mask"] = [True] * (len(rows[-10]["behavior_log_probs"]) + 1)
    return rows


@pytest.mark.parametrize("max_cells", [2000, None])
def test_column_path_writes_what_the_line_path_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_cells: int | None
) -> None:
    """A chunk that is valid throughout goes to the gate as columns; its decisions are the
    line-by-line path's to the byte, across chunks, in several width groups (small
    MAX_CELLS) or one group of the whole chunk."""
    from rollout_lifecycle.cli import admit_cmd

    if max_cells is not None:
        monkeypatch.setattr(admit_cmd, "MAX_CELLS", max_cells)
    inp = write_jsonl(tmp_path / "in.jsonl", _varied_rows(240))
    cond = tmp_path / "cond.json"
    cond.write_text(json.dumps(CONDITIONS))
    extra = ("--chunk-size", "50", "--conditions-json", str(cond), "--json")
    fast_out, slow_out = tmp_path / "fast.jsonl", tmp_path / "slow.jsonl"
    taken: list[bool] = []
    fast_chunk = admit_cmd._fast_chunk

    def spy(*args: Any) -> Any:
        got = fast_chunk(*args)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(admit_cmd, "_fast_chunk", spy)
    fast = run(admit_args(inp, fast_out, *extra))
    assert fast.exit_code == 0, fast.output
    assert taken == [True] * 4 + [False]  # the last chunk holds a mask of another length
    monkeypatch.setattr(admit_cmd, "_fast_chunk", lambda *_: None)
    slow = run(admit_args(inp, slow_out, *extra))
    assert slow.exit_code == 0, slow.output
    assert fast_out.read_bytes() == slow_out.read_bytes()
    summaries = [json.loads(r.stdout) for r in (fast, slow)]
    for summary, out in zip(summaries, (fast_out, slow_out), strict=True):
        assert summary.pop("elapsed_s") >= 0 and summary.pop("output") == str(out)
    assert summaries[0] == summaries[1]
    reasons = {d["reason"] for d in read_out(fast_out)}
    assert {"ok", "already_reserved", "conditions_mismatch", "empty_action_mask"} <= reasons


@pytest.mark.parametrize(
    "bad",
    [
        {"current_log_probs": [0.1, True, 0.2, 0.3]},
        {"behavior_log_probs": [-0.5, "-1", -1.5, -2.0]},
        {"response_token_ids": [1, 2.0, 3, 4]},
        {"response_token_ids": [1, 2**63, 3, 4]},
        {"action_mask": [0, 1, 1, 1]},
        {"sample_index": -1},
        {"behavior_version": True},
        {"dataset": ""},
        {"prompt_id": "a\x00b"},
        {"rollout_id": "x" * 1025},
        {"state": "nope"},
        {"current_log_probs": [0.1, 0.2, 0.3]},
        {"behavior_log_probs": [-0.5, float("nan"), -1.5, -2.0]},
        {"rollout_id": "dup"},
    ],
)
def test_a_bad_line_in_a_valid_looking_chunk_is_named_as_always(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: dict[str, Any]
) -> None:
    """Whatever the column checks doubt sends the chunk line by line: the error (line and
    message) is the one the line-by-line path gives."""
    from rollout_lifecycle.cli import admit_cmd

    rows = [row("dup"), *(row(f"r{i}") for i in range(5))]
    rows[3] = {**rows[3], **bad}
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    first = run(admit_args(inp, tmp_path / "a.jsonl"))
    monkeypatch.setattr(admit_cmd, "_fast_chunk", lambda *_: None)
    second = run(admit_args(inp, tmp_path / "b.jsonl"))
    assert (first.exit_code, first.output) == (second.exit_code, second.output)
    assert first.exit_code == 2 and "line 4" in first.output


def test_decision_lines_are_the_encoder_s_bytes() -> None:
    """The field-by-field line is the JSON encoder's line, overflowed drifts included."""
    from rollout_lifecycle.cli import admit_cmd
    from rollout_lifecycle.model.gate import AdmissionDecision

    decisions = [
        AdmissionDecision(rid, ok, reason, route, fresh, drift, lag, 7, 7 - lag, 2, 0.2)
        for rid, ok, reason, route, fresh, drift, lag in [
            ("a", True, "ok", "train", "fresh", 0.012345678901234567, 0),
            ('q"\\\u00e9\U0001f600', False, "policy_drift", "reject", "tolerated", 1e300, 2),
            ("e", False, "empty_action_mask", "reject", None, None, 1),
            ("o", False, "policy_drift", "reject", "fresh", float("inf"), 0),
            ("n", False, "stale_policy", "reject", "stale", -0.0, 5),
        ]
    ]
    want = "".join(admit_cmd._decision_line(d) + "\n" for d in decisions)
    assert admit_cmd._decision_lines(decisions) == want


# ---- the column path's one-pass conversions, against the checks they replace ---------------

_JSON_SCALARS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5]),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**1024, -(10**400)]),
    st.booleans(),
    st.sampled_from(["1.5", "0", "nan", "", None, [1.0], [], {}, {"a": 1}]),
)
# long rows of ordinary values with a few hostile ones: the 0/1 values to look at again are
# sparse (picked out one by one), where in short mixed rows they are dense (one full pass)
_ORDINARY = st.one_of(st.floats(-10, -0.01), st.integers(2, 10**6))
_SPARSE = st.lists(
    st.lists(st.one_of(*[_ORDINARY] * 12, _JSON_SCALARS), min_size=16, max_size=40),
    min_size=1,
    max_size=4,
)
_ROWS = st.one_of(st.lists(st.lists(_JSON_SCALARS, max_size=6), max_size=5), _SPARSE)


def _numbers_reference(rows: list[list[Any]]) -> bytes | None:
    """What the column path accepted before: number types only, then np.array's float64."""
    values = [v for r in rows for v in r]
    if not {type(v) for v in values} <= {int, float}:
        return None
    try:
        return np.array(values, dtype=np.float64).tobytes()
    except OverflowError:
        return None


@settings(max_examples=400, deadline=None)
@given(_ROWS)
def test_number_column_is_the_type_check_and_np_array(rows: list[list[Any]]) -> None:
    """array('d') plus the second look at 0.0 and 1.0 accepts exactly ints and floats (no
    bool, string, None, list or object, no int beyond a float), with np.array's values to
    the bit (NaN, -0.0 and rounded huge ints included)."""
    from rollout_lifecycle.cli import admit_cmd

    got = admit_cmd._number_column(rows)
    assert (None if got is None else got.tobytes()) == _numbers_reference(rows)
    if got is not None:
        assert got.dtype == np.float64


@settings(max_examples=400, deadline=None)
@given(_ROWS)
def test_int64_column_is_the_type_check_and_the_int64_fit(rows: list[list[Any]]) -> None:
    """array('q') plus the second look at 0 and 1 accepts exactly ints (never a bool) that
    np.fromiter puts in int64 without overflow."""
    from rollout_lifecycle.cli import admit_cmd

    values = [v for r in rows for v in r]
    want = {type(v) for v in values} <= {int}
    if want:
        try:
            np.fromiter(values, np.int64, len(values))
        except OverflowError:
            want = False
    assert admit_cmd._int64_column(rows) is want


@pytest.mark.parametrize("by_marshal", [True, False])
@settings(max_examples=300, deadline=None)
@given(rows=_ROWS)
def test_bool_column_takes_only_bools(by_marshal: bool, rows: list[list[Any]]) -> None:
    """The mask column: bools only (0, 1, 0.0, None refused), as np.fromiter's bool array;
    by marshal's bytes, and value by value where marshal writes bools otherwise."""
    from rollout_lifecycle.cli import admit_cmd

    assert admit_cmd._MARSHAL_BOOLS  # CPython writes them as b"T" and b"F"
    values = [v for r in rows for v in r]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(admit_cmd, "_MARSHAL_BOOLS", by_marshal)
        got = admit_cmd._bool_column(rows)
    if {type(v) for v in values} <= {bool}:
        assert got is not None and got.tolist() == values and got.dtype == np.bool_
    else:
        assert got is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=6).map(lambda b: b + b"\n"), min_size=1, max_size=8))
def test_blank_lines_are_those_strip_empties(raws: list[bytes]) -> None:
    """`_lines` skips exactly the lines whose strip() is empty (isspace, without a copy)."""
    import io

    from rollout_lifecycle.cli import admit_cmd

    data = b"".join(raws)
    got = list(admit_cmd._lines(io.BytesIO(data), lambda _n: None))
    want = [(i, r) for i, r in enumerate(io.BytesIO(data).readlines(), 1) if r.strip()]
    assert got == want


_HOSTILE = [
    ("current_log_probs", [0.1, True, 0.2, 0.3]),
    ("behavior_log_probs", [-0.5, False, -1.5, -2.0]),
    ("behavior_log_probs", [-0.5, None, -1.5, -2.0]),
    ("current_log_probs", [-0.5, "-1", -1.5, -2.0]),
    ("current_log_probs", [-0.5, 10**400, -1.5, -2.0]),
    ("current_log_probs", [0.0, 1.0, 0, 1]),
    ("response_token_ids", [1, False, 3, 4]),
    ("response_token_ids", [True, 0, 1, 4]),
    ("response_token_ids", [0, 1, -(2**63), 2**63 - 1]),
    ("response_token_ids", [1, 2**64, 3, 4]),
    ("response_token_ids", [1, 2.0, 3, 4]),
    ("action_mask", [False, True, 1, True]),
    ("action_mask", [False, True, None, True]),
    ("rollout_id", "r0"),
]


@settings(max_examples=60, deadline=None)
@example(n=70, chunk="1024", bad=[(50, ("rollout_id", "r3"))])  # a duplicate two parts apart
@example(n=90, chunk="64", bad=[(80, _HOSTILE[6])])  # a bool token in a later chunk's part
@given(
    n=st.integers(1, 90),
    chunk=st.sampled_from(["1", "7", "33", "64", "1024"]),
    bad=st.lists(st.tuples(st.integers(0, 89), st.sampled_from(_HOSTILE)), max_size=2),
)
def test_columns_and_lines_agree_across_parts(
    tmp_path_factory: pytest.TempPathFactory, n: int, chunk: str, bad: list[tuple[int, Any]]
) -> None:
    """Chunks of several `_PART`-line parts, with hostile values (or a duplicate id) in any
    part: the exit, the message and the decisions are the line-by-line path's."""
    from rollout_lifecycle.cli import admit_cmd

    tmp = tmp_path_factory.mktemp("parts")
    rows = [row(f"r{i}", 3 - i % 3, 0.01 * (i % 25)) for i in range(n)]
    for at, (key, value) in bad:
        if at < n:
            rows[at] = {**rows[at], key: value}
    inp = write_jsonl(tmp / "in.jsonl", rows)
    extra = ("--chunk-size", chunk, "--json", "--quiet")
    fast = run(admit_args(inp, tmp / "fast.jsonl", *extra))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(admit_cmd, "_fast_chunk", lambda *_: None)
        slow = run(admit_args(inp, tmp / "slow.jsonl", *extra))
    assert fast.exit_code == slow.exit_code
    if fast.exit_code:
        assert fast.output == slow.output and "no decisions were written" in fast.output
        assert not (tmp / "fast.jsonl").exists()
        return
    assert (tmp / "fast.jsonl").read_bytes() == (tmp / "slow.jsonl").read_bytes()
    summaries = [json.loads(r.stdout) for r in (fast, slow)]
    for summary in summaries:
        del summary["elapsed_s"], summary["output"]
    assert summaries[0] == summaries[1]
