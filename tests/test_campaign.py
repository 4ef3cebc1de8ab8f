"""The campaign: its profiles, its verdict (every declared edge and sometimes-property
reached, reports and coverage diagrams written, no violation), its progress lines, and
that infrastructure failures and bad options are never reported as findings."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from rollout_lifecycle.cli import campaign_cmd
from rollout_lifecycle.cli.campaign_cmd import README_SEED
from rollout_lifecycle.cli.main import cli
from rollout_lifecycle.spec.bounds import EXPLORER_MODELS
from rollout_lifecycle.stateful_tests.campaign_profiles import (
    FAST_FLOOR,
    MODEL_S,
    MODEL_STATES,
    PROFILES,
    fast_examples,
    load_first_reached,
)
from rollout_lifecycle.stateful_tests.infrastructure import InfrastructureFailure
from rollout_lifecycle.stateful_tests.runner import MACHINES
from tests.test_report_schemas import validate

# a known-long module: a larger limit than the suite's default (pyproject.toml)
pytestmark = pytest.mark.timeout(1800)


def test_campaign_fuzz_covers_everything(tmp_path: Path) -> None:
    """The default (fast) profile's fuzz budget, on SQLite as `make campaign` runs it,
    exercises every declared edge and reaches every sometimes-property."""
    out = tmp_path / "camp"
    res = CliRunner().invoke(
        cli,
        [
            "campaign",
            "--no-explore",
            "--race-seconds",
            "0",
            "--stage",
            "none",
            "--out",
            str(out),
            "--report",
            str(tmp_path / "summary.json"),
            "--quiet",
        ],
    )
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["profile"] == "fast" and summary["backend"] == "sqlite"
    assert summary["examples"] == PROFILES["fast"].examples
    # the fast run is the thorough run cut short: every goal the thorough run reached within
    # the fast budget is reached at the same example (first_reached.json, by machine)
    ref = load_first_reached()["by_machine"]
    for machine, run in summary["fuzz"]["runs"].items():
        budget = PROFILES["fast"].examples[machine]
        assert run["examples"] == budget
        want = {g: n for g, n in ref[machine].items() if n <= budget}
        assert run["first_reached"] == want, machine
    assert all(not v for v in summary["goals_missed"].values()), summary["goals_missed"]
    cov = json.loads((out / "coverage.json").read_text())
    for name, m in cov["machines"].items():
        assert m["covered"] == m["declared"], (name, [e for e, n in m["edges"].items() if not n])
    fuzz = json.loads((out / "fuzz-report.json").read_text())
    assert fuzz["violations"] == 0
    assert all(n > 0 for n in fuzz["sometimes"].values()), fuzz["sometimes"]
    drawn = (out / "lifecycle-coverage.mmd").read_text().split("%% Coverage")[1]
    assert "⚠ 0 NEVER" not in drawn.split("\n", 1)[1]
    assert "Traceback" not in res.output


def test_campaign_explore_subset(tmp_path: Path) -> None:
    """The explore half writes its report and merges coverage with the fuzz half."""
    out = tmp_path / "camp"
    res = CliRunner().invoke(
        cli,
        [
            "campaign",
            "--backend",
            "memory",
            "--examples",
            "5",
            "--model",
            "activation-2v",
            "--stage",
            "none",
            "--out",
            str(out),
            "--quiet",
        ],
    )
    # 5 examples cannot take every edge: the campaign says which goals it missed and the
    # budget that reaches each; nothing was violated, so it exits 5, not 1
    assert res.exit_code == 5, res.output
    assert "goal missed" in res.output and "never took" in res.output
    assert "rerun with --examples" in res.output
    ex = json.loads((out / "explore-report.json").read_text())
    # 1695 before attempt tokens, 2743 before a token counted once (see
    # tests/test_protocol_models.py for why it grew)
    assert ex["models"]["activation-2v"]["distinct_states"] == 3195
    assert ex["violations"] == 0


def test_campaign_bad_model_is_a_usage_error(tmp_path: Path) -> None:
    """An unknown explorer model is a one-line usage error, not a traceback."""
    res = CliRunner().invoke(
        cli,
        [
            "campaign",
            "--backend",
            "memory",
            "--examples",
            "1",
            "--model",
            "nope",
            "--out",
            str(tmp_path),
            "--quiet",
        ],
    )
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_first_reached_reference_is_the_thorough_campaigns() -> None:
    """stateful_tests/first_reached.json is what the thorough campaign wrote (its
    first-reached.json): its seed, budget and Hypothesis settings, every goal of the
    declared machines reached within that budget, and the overall record the earliest of
    the per-machine ones."""
    from rollout_lifecycle.spec.invariants import SOMETIMES
    from rollout_lifecycle.stateful_tests.recording import DECLARED
    from rollout_lifecycle.stateful_tests.runner import README_BACKEND

    ref = load_first_reached()
    thorough = PROFILES["thorough"]
    assert (ref["seed"], ref["examples"]) == (README_SEED, thorough.examples)
    assert (ref["profile"], ref["hypothesis_profile"]) == ("thorough", thorough.hypothesis)
    assert ref["steps"] == thorough.steps
    assert ref["backend"].startswith(README_BACKEND)
    goals = {f"{m}: {spec.edge_id(e)}" for m, spec in DECLARED.items() for e in spec.edges}
    goals |= set(SOMETIMES)
    assert goals <= set(ref["first_reached"]), sorted(goals - set(ref["first_reached"]))
    # Hypothesis builds more instances than max_examples (it discards some): a goal may be
    # first reached past the 200th, never past the instances the run made
    assert set(ref["instances"]) == set(MACHINES)
    assert all(n >= 200 for n in ref["instances"].values())
    assert all(1 <= n <= ref["instances"][m] for m, n in ref["first_reached"].values())
    for goal, (machine, n) in ref["first_reached"].items():
        assert ref["by_machine"][machine][goal] == n
        assert n == min(per[goal] for per in ref["by_machine"].values() if goal in per)


def test_profiles_fast_budget_is_first_reached_plus_margin() -> None:
    """The fast profile's examples are read off first_reached.json (each goal charged to
    the machine that reached it first, +25%, at least the floor); thorough is the README's
    200 per machine at the README bounds; ci is the fast budget, strict. Every model a
    profile names exists, with the reference counts the ETA uses."""
    from tests.test_protocol_models import PINNED

    fast, thorough, ci = PROFILES["fast"], PROFILES["thorough"], PROFILES["ci"]
    ref = load_first_reached()
    assert fast.examples == fast_examples(ref["first_reached"], cap=ref["instances"])
    assert set(fast.examples) == set(MACHINES)
    assert all(FAST_FLOOR <= n <= ref["instances"][m] for m, n in fast.examples.items())
    latest = {m: 0 for m in MACHINES}
    for machine, n in load_first_reached()["first_reached"].values():
        latest[machine] = max(latest[machine], n)
    assert all(fast.examples[m] >= min(ref["instances"][m], 1.25 * n) for m, n in latest.items())
    assert thorough.examples == dict.fromkeys(MACHINES, 200) and not thorough.cut
    assert fast.cut and ci.cut
    assert thorough.models == ("lifecycle", "ledger", "activation", "activation-2v", "seams")
    assert (ci.examples, ci.models, ci.strict, fast.strict) == (
        fast.examples,
        fast.models,
        True,
        False,
    )
    # the targeted stages (stateful_tests/stages.py): each where its registry entry says;
    # verl-v1 is too slow for the five-minute verdict, ci runs every one
    assert fast.stages == ("clock-skew", "premise-window", "faults")
    assert (
        set(thorough.stages)
        == set(ci.stages)
        == {
            "verl-v1",
            "clock-skew",
            "premise-window",
            "faults",
        }
    )
    for p in PROFILES.values():
        assert (p.hypothesis, p.steps, p.seed) == ("dev", 50, README_SEED)
        assert p.max_examples == 200
        assert all(m in EXPLORER_MODELS and m in MODEL_S and m in MODEL_STATES for m in p.models)
    assert {k: MODEL_STATES[k] for k in PINNED} == PINNED
    # the fast explorer models: every model family, each at bounds that take seconds
    assert sum(MODEL_S[m] for m in fast.models) < 120


def test_fast_examples_rule() -> None:
    """A goal first reached at example n of a machine asks for 1.25 n there, rounded up to a
    multiple of 5, within [floor, cap]; a machine that reached nothing first gets the floor."""
    got = fast_examples({"a": ["ledger", 157], "b": ["ledger", 3], "c": ["seams", 33]})
    assert got["ledger"] == 200 and got["seams"] == 45 and got["e2e"] == FAST_FLOOR
    assert fast_examples({"a": ["ledger", 190]})["ledger"] == 200
    # capped per machine at the instances the thorough run made: past 200 is reachable
    got = fast_examples({"a": ["ledger", 204]}, cap={"ledger": 254})
    assert got["ledger"] == 254 and got["e2e"] == FAST_FLOOR


def test_budget_hints_name_the_examples_that_reach_a_goal() -> None:
    """A missed goal's hint gives the thorough run's example number; an unknown one says the
    thorough budget does not reach it either; an explorer witness points at the models."""
    from rollout_lifecycle.cli.campaign_cmd import budget_hints, load_first_reached

    goal, (machine, n) = next(iter(load_first_reached()["first_reached"].items()))
    witness = "activation-2v: activated"
    hints = budget_hints([goal, "no such goal", witness], explorer=[witness])
    assert f"--examples {n}" in hints[goal] and machine in hints[goal]
    assert "not reached by the thorough budget" in hints["no such goal"]
    assert "explorer witness" in hints[witness]
    # a fuzz edge of a machine that shares its name with an explorer model is still a
    # fuzz goal: the hint names its example
    edge = next(g for g in load_first_reached()["first_reached"] if g.startswith("lifecycle: "))
    assert "--examples" in budget_hints([edge])[edge]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _invoke(args: list[str], cwd: Path) -> Any:
    """The CLI as a user runs it in `cwd` (through `run`, which maps errors to exit codes)."""
    import os

    from rollout_lifecycle.cli.main import run

    before = Path.cwd()
    os.chdir(cwd)
    try:
        return run(args)
    finally:
        os.chdir(before)


def test_bad_backend_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """`campaign --backend foo` (and `fuzz`) exit 2 naming the option, and write nothing:
    no --out folder, no checkers-report.json, no fuzz-work/."""
    for cmd in ("campaign", "fuzz"):
        rc = _invoke([cmd, "--backend", "foo", "--out", "out", "--quiet"], tmp_path)
        assert rc == 2, cmd
    assert list(tmp_path.iterdir()) == []


def test_sqlite_urls_are_accepted_like_every_other_command(tmp_path: Path) -> None:
    """`--backend sqlite:///runs.db` runs the machines on SQLite (fresh files under --out;
    the named file is never written), for fuzz and campaign alike."""
    rc = _invoke(
        [
            "fuzz",
            "--backend",
            "sqlite:///runs.db",
            "--machine",
            "ledger",
            "--examples",
            "2",
            "--out",
            "f",
            "--quiet",
            "--report",
            "fuzz.json",
        ],
        tmp_path,
    )
    assert rc == 0
    assert json.loads((tmp_path / "fuzz.json").read_text())["backend"] == "sqlite"
    rc = _invoke(
        [
            "campaign",
            "--backend",
            "sqlite:///runs.db",
            "--examples",
            "1",
            "--no-explore",
            "--race-seconds",
            "0",
            "--out",
            "c",
            "--quiet",
            "--report",
            "c.json",
        ],
        tmp_path,
    )
    assert rc == 5  # one example per machine misses goals; nothing was violated
    assert json.loads((tmp_path / "c.json").read_text())["backend"] == "sqlite"
    assert not (tmp_path / "runs.db").exists()
    bare = ["fuzz", "--backend", "sqlite://", "--machine", "ledger", "--examples", "1"]
    assert _invoke([*bare, "--out", "g", "--quiet"], tmp_path) == 0
    assert _invoke(["fuzz", "--backend", "sqlite:///:memory:", "--quiet"], tmp_path) == 2


def test_unreachable_postgres_is_exit_3_and_writes_nothing(tmp_path: Path) -> None:
    """A PostgreSQL server that does not answer is a technical failure (exit 3, the cause
    named), found before anything is written: no FAILED machine, no "shrunk failing program",
    no --out folder."""
    pytest.importorskip("psycopg")
    url = f"postgresql://rl:secret@127.0.0.1:{_free_port()}/nowhere"
    for cmd in ("fuzz", "campaign"):
        res = CliRunner().invoke(cli, [cmd, "--backend", url, "--out", str(tmp_path / cmd)])
        assert res.exit_code == 3, (cmd, res.output)
        assert "cannot reach" in res.output and "127.0.0.1" in res.output
        assert "secret" not in res.output and "FAILED" not in res.output
        assert not (tmp_path / cmd).exists()


@pytest.mark.parametrize("factory", ["dying_server", "full_disk"])
def test_backend_failing_mid_run_is_not_a_finding(factory: str, tmp_path: Path) -> None:
    """A server that stops answering, or a disk that fills up, under a running machine is
    exit 3 naming the cause: no program saved, no machine marked FAILED."""
    from tests import helpers_infra

    helpers_infra._state["writes"] = 0
    res = CliRunner().invoke(
        cli,
        [
            "fuzz",
            "--backend",
            f"tests.helpers_infra:{factory}",
            "--machine",
            "ledger",
            "--examples",
            "60",
            "--out",
            str(tmp_path / "f"),
        ],
    )
    assert res.exit_code == 3, res.output
    assert "not a finding" in res.output
    assert ("BackendUnavailable" if factory == "dying_server" else "No space left") in res.output
    assert "FAILED" not in res.output and "shrunk" not in res.output
    assert not list((tmp_path / "f").rglob("*.py"))


def test_campaign_stops_before_the_next_stage_on_infrastructure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An infrastructure failure in one stage ends the campaign there: exit 3 naming the
    stage, the cause and the stages not started; no later stage's report is written."""

    def dies(*_a: Any, **_k: Any) -> Any:
        raise InfrastructureFailure(
            "the seams machine", "sqlite", OSError(28, "No space left on device")
        )

    monkeypatch.setattr(campaign_cmd, "run_campaign", dies)
    out = tmp_path / "c"
    res = CliRunner().invoke(cli, ["campaign", "--out", str(out), "--quiet"])
    assert res.exit_code == 3, res.output
    assert "stage fuzz" in res.output
    assert "not started: explore, interleavings, race" in res.output
    assert "No space left" in res.output
    assert (out / "checkers-report.json").exists()
    assert not (out / "fuzz-report.json").exists() and not (out / "explore-report.json").exists()


def test_skipped_adapter_stage_is_said_loudly_and_ci_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the [verl] extra the adapter stage is SKIPPED, said at the start and beside the
    verdict, with the install hint printed as written (`'.[verl]'`, not eaten as console
    markup) and recorded in the report; the ci profile refuses to skip it (exit 3, nothing
    written)."""
    monkeypatch.setattr(campaign_cmd, "adapter_entry", lambda: (None, "No module named 'verl'"))
    out = tmp_path / "c"
    res = CliRunner().invoke(
        cli,
        [
            "campaign",
            "--backend",
            "memory",
            "--examples",
            "1",
            "--no-explore",
            "--out",
            str(out),
            "--report",
            str(tmp_path / "r.json"),
            "--quiet",
        ],
    )
    assert res.exit_code == 5, res.output
    assert res.output.count("adapter stage SKIPPED") == 2, res.output
    assert "pip install -e '.[verl]'" in res.output and "make setup-dev" in res.output
    assert "SKIPPED: adapter, race" in res.output
    # beside them, the profile's PostgreSQL stages, said not to run on memory (not SKIPPED)
    skipped = json.loads((tmp_path / "r.json").read_text())["skipped"]
    assert set(skipped) == {"adapter", "race", "clock-skew", "premise-window", "faults"}
    assert "postgresql only" in skipped["premise-window"]
    res = CliRunner().invoke(cli, ["campaign", "--profile", "ci", "--out", str(tmp_path / "ci")])
    assert res.exit_code == 3 and "[verl]" in res.output, res.output
    assert not (tmp_path / "ci").exists()


def test_a_progress_line_per_stage_with_an_eta(tmp_path: Path) -> None:
    """Each stage says when it starts (with the campaign's ETA), how it goes, and when it is
    done; the report records the time, the CPU time and the load beside it."""
    res = CliRunner().invoke(
        cli,
        [
            "campaign",
            "--backend",
            "memory",
            "--examples",
            "2",
            "--model",
            "lifecycle-small",
            "--out",
            str(tmp_path / "c"),
            "--report",
            str(tmp_path / "r.json"),
        ],
    )
    assert res.exit_code == 5, res.output
    text = res.output
    for stage in ("checkers", "adapter", "fuzz", "explore"):
        if stage == "adapter" and "adapter stage SKIPPED" in text:
            continue
        assert f"] {stage}: started; about" in text, (stage, text)
        assert f"] {stage}: done in" in text, (stage, text)
    assert "campaign ETA" in text and "[1/" in text
    timing = json.loads((tmp_path / "r.json").read_text())["timing"]
    assert (
        timing["wall_s"] > 0
        and timing["cpu_s"] > 0
        and set(timing["stages_s"]) >= {"checkers", "fuzz", "explore"}
    )
    assert "verdict (fast profile" in text


def test_stage_clock_scales_reference_times_by_this_runs_speed() -> None:
    """The ETA: reference seconds times how much slower this run went than the reference
    (once stages worth 10 reference seconds are done), except the race's fixed clock."""
    from rollout_lifecycle.cli.campaign_cmd import StageClock, fmt_s

    clock = StageClock(
        [("checkers", 1.0), ("fuzz", 20.0), ("explore", 50.0), ("race", 28.0)],
        quiet=True,
        fixed={"race": 20.0},
    )
    assert clock.speed() == 1.0
    clock.index, clock.spent, clock.expected_done = 1, 2.0, 1.0
    assert clock.speed() == 1.0  # a second-long stage says little about the machine
    clock.spent, clock.expected_done = 63.0, 21.0  # three times slower than the reference
    assert clock.speed() == 3.0
    assert clock.scaled("explore", 50.0) == 150.0
    assert clock.scaled("race", 28.0) == 20.0 + 3.0 * 8.0
    assert clock.later_s() == 150.0 + 44.0
    assert clock.not_started() == ["explore", "race"]
    assert (fmt_s(42.4), fmt_s(185), fmt_s(0)) == ("42 s", "3 min 05 s", "0 s")


def test_campaign_stages_report_and_say_where_they_do_not_run(tmp_path: Path) -> None:
    """A PostgreSQL stage asked for on memory is skipped saying so; the report lists the
    stages that ran (here none) under "stages"."""
    out = tmp_path / "camp"
    res = CliRunner().invoke(
        cli,
        [
            "campaign",
            "--no-explore",
            "--backend",
            "memory",
            "--examples",
            "1",
            "--stage",
            "clock-skew",
            "--stage",
            "premise-window",
            "--out",
            str(out),
            "--report",
            str(tmp_path / "summary.json"),
        ],
    )
    assert res.exit_code in (0, 5), res.output
    assert "clock-skew stage skipped" in res.output and "postgresql" in res.output
    assert "premise-window stage skipped" in res.output
    assert json.loads((tmp_path / "summary.json").read_text())["stages"] == []


def test_campaign_on_sqlite_runs_the_interleavings_and_checks_the_race_history(
    tmp_path: Path,
) -> None:
    """On a durable backend the campaign scripts the two-connection gaps (every answer
    right) and checks the race's whole recorded history for linearizability, with its
    counts in the report (issue 33)."""
    out = tmp_path / "camp"
    res = CliRunner().invoke(
        cli,
        [
            "campaign",
            "--no-explore",
            "--backend",
            "sqlite",
            "--examples",
            "1",
            "--race-seconds",
            "2",
            "--stage",
            "none",
            "--out",
            str(out),
            "--report",
            str(tmp_path / "summary.json"),
            "--quiet",
        ],
    )
    assert res.exit_code in (0, 5), res.output  # 1 example misses goals, violates nothing
    summary = json.loads((tmp_path / "summary.json").read_text())
    validate(summary)  # the campaign report's schema, the race's inside it
    assert summary["violations"] == 0
    assert summary["interleavings"] and not any(summary["interleavings"].values())
    lin = summary["race"]["linearizability"]
    assert lin["verdict"] == "ok" and lin["calls"] > 0 and lin["partitions"] > 0, lin
    assert lin["max_partition"] > 0 and lin["seconds"] >= 0
    assert (out / "race" / "history.jsonl").exists()
    assert "linearizability: ok" in res.output
