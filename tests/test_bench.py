"""`rollout-lifecycle bench`: the quick run end to end, its report's shape (never its times).

The command runs in a subprocess, as a user runs it: the measurement modules are then never
loaded into the test process (Hypothesis draws on the constants of every loaded project
module, so loading them here would change what later seeded fuzz runs generate).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollout_lifecycle.stateful_tests import runner


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollout_lifecycle", "bench", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


VARIANTS = {"gate_arrays", "gate_records", "bare", "read_once", "python_loop"}


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x >= 0


def test_quick_bench_end_to_end(tmp_path: Path) -> None:
    """bench --quick measures every part, prints the JSON report and writes the docs."""
    out = tmp_path / "docs"
    res = bench("--quick", "--json", "--quiet", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""  # --quiet: no progress lines
    report = json.loads(res.stdout)
    assert report["schema"] == "rollout-lifecycle/bench-report/1" and report["quick"] is True
    assert report["command"] == f"rollout-lifecycle bench --quick --out={out}"
    assert {"cpus", "python", "numpy", "torch", "verl", "sqlite"} <= set(report["machine"])

    rows = report["admission"]["rows"]
    libs = {r["library"] for r in rows}
    assert "numpy" in libs and (report["machine"]["torch"] is None or "torch" in libs)
    for r in rows:
        assert set(r["ms"]) >= VARIANTS and all(_number(r["ms"][k]) for k in VARIANTS)
        assert ("verl" in r["ms"]) == (
            r["library"] == "torch" and report["machine"]["verl"] is not None
        )
        assert set(r["ratios"]) == {
            "arrays_vs_bare",
            "arrays_vs_read_once",
            "records_vs_arrays",
            "python_loop_vs_arrays",
            "verl_vs_arrays",
        }
        if r["ms"]["bare"] >= 0.05:  # ms are rounded to 0.1 us
            assert r["ratios"]["arrays_vs_bare"] == pytest.approx(
                r["ms"]["gate_arrays"] / r["ms"]["bare"], rel=0.01, abs=2e-3
            )
        assert set(r["peak_extra_bytes"]) == {"gate_arrays", "gate_records", "bare"}
        assert r["input_bytes"] == r["B"] * r["T"] * 9  # two float32 arrays and a bool mask

    for backend in ("memory", "sqlite"):
        x = report["ledgers"][backend]
        assert _number(x["single_per_s"]) and _number(x["batch_per_s"])
        assert [r["workers"] for r in x["racing"]] == [1, 4]
        assert all(r["wins"] == r["rollouts"] for r in x["racing"])  # every rollout won once
        assert len(x["commits_per_s"]) == 2 and all(map(_number, x["commits_per_s"].values()))
        assert {"batch_vs_single", "commit_large_vs_small"} <= set(x["ratios"])
    scale = report["ledgers"]["memory"]["scale"]
    assert list(scale["cpu_us_per_row"]) == ["200", "2000"] and scale["gc"] == "on"
    assert all(map(_number, [*scale["cpu_us_per_row"].values(), *scale["ratios"].values()]))
    # flatness is judged over every size: the most over the least per-row cost, not the ends
    per_row = list(scale["cpu_us_per_row"].values())
    assert scale["ratios"]["cpu_max_vs_min"] == pytest.approx(max(per_row) / min(per_row), 0.01)
    assert scale["ratios"]["cpu_max_vs_min"] >= 1
    # the hand-written floor at the same sizes, measured beside the ledger
    plain = list(scale["plain_cpu_us_per_row"].values())
    assert list(scale["plain_cpu_us_per_row"]) == list(scale["cpu_us_per_row"])
    assert all(map(_number, plain))
    assert scale["ratios"]["plain_cpu_max_vs_min"] == pytest.approx(max(plain) / min(plain), 0.01)
    assert {"autocommit_update_per_s", "executemany_1000_per_s"} <= set(
        report["ledgers"]["sqlite"]["baseline"]
    )
    assert report["ledgers"]["sqlite"]["baseline"]["synchronous"] == "FULL"
    # the single CAS is measured again on tmpfs, where there is one, with its own ratio/goal
    sq = report["ledgers"]["sqlite"]
    tmpfs, vs_tmpfs = sq["tmpfs"], sq["ratios"]["single_vs_autocommit_update_tmpfs"]
    tmpfs_goals = [g for g in report["goals"] if "on tmpfs" in g["goal"]]
    assert len(tmpfs_goals) == 1 and tmpfs_goals[0]["target"] == "<= 3"
    if Path("/dev/shm").is_dir():
        assert tmpfs["measured"] is True and tmpfs["folder"] == "/dev/shm"
        assert _number(tmpfs["single_per_s"]) and tmpfs["baseline"]["synchronous"] == "FULL"
        assert vs_tmpfs == pytest.approx(
            tmpfs["single_per_s"] / tmpfs["baseline"]["autocommit_update_per_s"], rel=0.01
        )
        assert tmpfs_goals[0]["measured"] == pytest.approx(1 / vs_tmpfs, rel=0.01)
        assert "(synchronous FULL)" in tmpfs_goals[0]["goal"]
    else:
        assert tmpfs["measured"] is False and vs_tmpfs is None
        assert tmpfs_goals[0]["measured"] is None and "not measured" in tmpfs_goals[0]["goal"]
    disk_goals = [g for g in report["goals"] if "autocommit UPDATE time, on disk" in g["goal"]]
    assert len(disk_goals) == 1 and disk_goals[0]["target"] == "<= 1.2"

    fuzz = report["checkers"]["fuzz"]["memory"]
    assert set(fuzz) == set(runner.MACHINES)
    assert all(r["steps"] > 0 and not r["failed"] for r in fuzz.values())
    assert all(m["distinct_states"] > 0 for m in report["checkers"]["explore"].values())

    for g in report["goals"]:
        assert set(g) == {"goal", "measured", "target", "met", "load1"}
        assert g["met"] in (True, False, None)
        assert g["load1"] is None or _number(g["load1"])
    # the load beside every figure (issue 36): admission rows, each ledger, the gate rows
    assert all(_number(r["load1"]) for r in rows)
    assert all(_number(report["ledgers"][b]["load1"]) for b in ("memory", "sqlite"))
    if report["gate"] is not None:
        for r in report["gate"]["rows"]:
            assert _number(r["load1"]) and _number(r["ms"]["bare_warm"])
            assert r["gate_vs_bare_warm"] == pytest.approx(
                r["ms"]["gate"] / r["ms"]["bare_warm"], rel=0.02, abs=2e-3
            )
            assert r["bare_warm_threads"] == 1  # the gate's own thread count up to 2
            # the records path is timed against the array path in a pair of their own, not
            # in the gate/bare rotation (issue 36), wall and CPU, the load beside them
            assert "records" not in r["ms"]
            if r["dtype"] != "float32":
                assert r["records_vs_arrays"] is None and "records_ms" not in r
                continue
            wall, cpu = r["records_ms"], r["records_cpu_ms"]
            assert set(wall) == set(cpu) == {"arrays", "records"}
            assert r["records_vs_arrays"] == pytest.approx(
                wall["records"] / wall["arrays"], rel=0.02, abs=2e-3
            )
            assert r["records_vs_arrays_cpu"] == pytest.approx(
                cpu["records"] / cpu["arrays"], rel=0.02, abs=2e-3
            )
            assert _number(r["records_load1"])
        records_goals = [
            g
            for g in report["goals"]
            if g["goal"].startswith("torch float32") and "records path / array path" in g["goal"]
        ]
        # wall and CPU time, one goal each per float32 row
        assert len(records_goals) == 2 * sum(
            r["dtype"] == "float32" for r in report["gate"]["rows"]
        )
        assert sum("CPU time" in g["goal"] for g in records_goals) == len(records_goals) // 2
        # the quick sizes are under T = 4096: each goal is the per-record floor's
        assert all("per-record floor" in g["goal"] for g in records_goals)
        assert {g["target"] for g in records_goals} == {"<= 3"}

    # the fleet: every store here x N, the ledger and plain SQL side by side
    fleet = report["fleet"]
    stores = ["sqlite-disk"] + (["sqlite-tmpfs"] if Path("/dev/shm").is_dir() else [])
    assert [(c["store"], c["N"]) for c in fleet["cells"]] == [
        (s, n) for s in stores for n in (1, 2)
    ]
    for c in fleet["cells"]:
        assert (c["reservers"], c["adders"]) == ((1, 0) if c["N"] == 1 else (1, 1))
        assert set(c) >= {"ledger", "plain", "queued", "ledger_vs_queued"}
        for variant in ("ledger", "plain", "queued"):
            v = c[variant]
            # SQLite's lock may starve a plain reserver for a whole short cell: no timing
            # is asserted, only the shape
            assert _number(v["reservations_per_s"])
            if v["reservations_per_s"] > 0:
                assert _number(v["p50_ms"]) and v["p99_ms"] >= v["p50_ms"]
            assert len(v["lock_wait_p99_ms"]) == c["N"]  # one per writer
            assert v["lock_wait_p99_ms_max"] == max(v["lock_wait_p99_ms"])
            assert v["adds_per_s"] == 0 if c["N"] == 1 else _number(v["adds_per_s"])
        for base in ("plain", "queued"):
            if c[base]["reservations_per_s"] > 0:
                assert c[f"ledger_vs_{base}"] == pytest.approx(
                    c["ledger"]["reservations_per_s"] / c[base]["reservations_per_s"],
                    rel=0.01,
                    abs=5e-4,  # the ratio is rounded to 3 places: 0.024 stands for 0.02356
                )
    assert "## Fleet (issue 36)" in (out / "README.md").read_text()

    written = json.loads((out / "bench.json").read_text())
    assert written == report
    md = (out / "README.md").read_text()
    assert "## Goals (issues 13 and 22)" in md and "## Admission" in md and report["command"] in md
    if report["gate"] is not None:  # the records pairs' table and the floor it states
        from rollout_lifecycle.cli.bench_speed import RECORDS_FLOOR

        assert "### Records path / array path (float32)" in md and RECORDS_FLOOR in md
    png = out / "admission.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not png.exists() and "matplotlib is not installed" in md
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "admission.png" in md


def test_bad_destinations_are_refused_before_any_work(tmp_path: Path) -> None:
    """A file given as --out, or a --report in a missing folder: exit 2 at once."""
    afile = tmp_path / "f"
    afile.write_text("x")
    res = bench("--quick", "--out", str(afile))
    assert res.returncode == 2 and "is a file" in res.stderr and res.stdout == ""
    res = bench("--quick", "--no-docs", "--report", str(tmp_path / "no" / "r.json"))
    assert res.returncode == 2 and "does not exist" in res.stderr


DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


def _rendered(result: Path) -> str:
    """The Markdown a committed bench.json renders to, rendered apart (see the module
    docstring)."""
    render = (
        "import json, sys\n"
        "from rollout_lifecycle.cli.bench_report import markdown\n"
        "d = json.load(open(sys.argv[1]))\n"
        "sys.stdout.write(markdown(d, d['command']))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", render, str(result)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return res.stdout


def test_committed_benchmark_doc_is_its_result_file() -> None:
    """docs/benchmarks/README.md is exactly what the committed bench.json renders to (so no
    figure in it can drift from the file), and every explorer count there that is complete
    is the count tests/test_protocol_models.py pins (so the file cannot go stale either)."""
    from tests.test_protocol_models import PINNED

    assert _rendered(DOCS / "bench.json") == (DOCS / "README.md").read_text()
    explored = json.loads((DOCS / "bench.json").read_text())["checkers"]["explore"]
    complete = {k: v["distinct_states"] for k, v in explored.items() if v["complete"]}
    assert complete and all(k in PINNED for k in complete), complete
    assert complete == {k: PINNED[k] for k in complete}


def test_committed_fleet_is_part_of_the_one_full_run() -> None:
    """The fleet part (issue 36) is measured in the same full run as every other figure in
    docs/benchmarks (rendered into its README, checked above): every store at N = 1, 2, 4
    and 8, PostgreSQL included, in rounds whose medians are reported, each goal with its
    load."""
    report = json.loads((DOCS / "bench.json").read_text())
    assert not report["quick"] and {"ledgers", "gate", "fleet"} <= set(report)
    fleet = report["fleet"]
    assert fleet["rounds"] >= 3 and fleet["postgres"]
    by_store: dict[str, list[int]] = {}
    for c in fleet["cells"]:
        by_store.setdefault(c["store"], []).append(c["N"])
    assert by_store == {s: [1, 2, 4, 8] for s in ("sqlite-disk", "sqlite-tmpfs", "postgres")}
    fleet_goals = [g for g in report["goals"] if g["goal"].startswith("fleet ")]
    assert fleet_goals and all(g["load1"] is not None for g in fleet_goals)


def test_fleet_on_postgres_quick(postgres_url: str) -> None:
    """The fleet measures PostgreSQL when given a URL: its cells, no lock waits (those are
    SQLite's), and every schema it made is dropped."""
    res = bench(
        "--quick",
        "--part=fleet",
        "--no-docs",
        "--json",
        "--quiet",
        f"--fleet-postgres={postgres_url}",
        "--fleet-seconds=0.2",
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert postgres_url not in res.stdout  # the command line leaves the URL out
    cells = [c for c in report["fleet"]["cells"] if c["store"] == "postgres"]
    assert [c["N"] for c in cells] == [1, 2] and report["fleet"]["postgres"] is True
    for c in cells:
        assert "queued" not in c  # PostgreSQL's locks queue already
        for variant in ("ledger", "plain"):
            assert _number(c[variant]["reservations_per_s"])
            assert "lock_wait_p99_ms" not in c[variant]
    import psycopg

    with psycopg.connect(postgres_url) as conn:
        left = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'fleet_%'"
        ).fetchall()
    assert left == []


def test_drift_gate_benchmark_script_runs(tmp_path: Path) -> None:
    """`python benchmarks/verl_drift_gate.py`, which docs/gpu-check.md cites, runs as
    printed (it imported a helper that no longer existed), here on a tiny batch."""
    import importlib.util

    if importlib.util.find_spec("verl") is None or importlib.util.find_spec("torch") is None:
        pytest.skip("needs the [verl] extra (verl and torch)")
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "gate.json"
    tiny = ["--rows", "16", "--cols", "64", "--repeats", "1", "--json", str(out)]
    res = subprocess.run(
        [sys.executable, "benchmarks/verl_drift_gate.py", *tiny],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["batch"]["B"] == 16 and figures["batch"]["T"] == 64
    kept = figures["kept"]
    assert all(0 <= n <= 16 for n in kept.values()) and len(kept) == 3
    assert figures["seconds_best_of_1"]["this gate"] > 0


def test_verl_v1_overhead_doc_is_its_result_files() -> None:
    """docs/verl-v1.md's overhead table is the committed result files of
    benchmarks/verl_v1_overhead.py (the table drifted from a rerun once)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "verl_v1_overhead", DOCS.parents[1] / "benchmarks" / "verl_v1_overhead.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    doc = (DOCS.parent / "verl-v1.md").read_text()
    every = []
    for where in ("", "-tmpfs"):
        results = [
            json.loads((DOCS / f"verl-v1-overhead-{shape}{where}.json").read_text())
            for shape in ("8x4", "64x8")
        ]
        assert bench.doc_table(results) in doc
        every += results
    for res in every:
        assert [r["prefill"] for r in res["runs"]] == [0, 10_000, 100_000]
        assert res["command"].startswith("python benchmarks/verl_v1_overhead.py")
    # and the run-length table: the same steps after 0 and 2,000 activated versions
    runs = [
        json.loads((DOCS / f"verl-v1-overhead-64x8-tmpfs-versions-{v}.json").read_text())
        for v in (0, 2000)
    ]
    assert bench.versions_table(runs) in doc
    assert [r["versions_before"] for r in runs] == [0, 2000]
    assert all(f"--versions {r['versions_before']}" in r["command"] for r in runs)


def test_interleaved_medians_rotate_the_order() -> None:
    """Each round starts one variant later, so no variant always runs right after the same
    other one (whose leftovers, evicted caches or spinning threads, would weigh on it)."""
    from rollout_lifecycle.cli.bench_speed import interleaved_medians

    ran: list[str] = []

    def runs(name: str) -> Callable[[], None]:
        return lambda: ran.append(name)

    variants = {k: runs(k) for k in "abc"}
    med = interleaved_medians(variants, 4)
    assert ran == list("abcbcacababc")
    assert set(med) == set("abc") and all(v >= 0 for v in med.values())
    follows = {(ran[i - 1], ran[i]) for i in range(1, len(ran))}
    assert {("a", "b"), ("c", "a"), ("b", "c"), ("a", "c"), ("c", "b")} <= follows


_OWN_PROCESS = """
import gc, os
from rollout_lifecycle.cli.benchmarks import _OwnProcess
parent = os.getpid()

def setup(stack):
    def run(a, b):
        if os.getpid() == parent or gc.get_freeze_count() == 0 or not gc.isenabled():
            raise AssertionError("timed in the parent's heap")
    return run

def broken(stack):
    def run(a, b):
        raise ValueError("this variant fails")
    return run

p = _OwnProcess(setup)
print("turn", p.turn(0, 1) >= 0)
p.close()
q = _OwnProcess(broken)
try:
    q.turn(0, 1)
except RuntimeError as e:
    print("reported", "this variant fails" in str(e))
q.close()
"""


def test_each_reservation_variant_is_timed_in_a_heap_of_its_own() -> None:
    """The ledger benchmark's variants (single CAS, batch, their baselines) each run in a
    process of their own, the collector on and the parent's objects frozen: in one shared
    heap the batch was timed for the collections the singles' garbage triggered (issue
    36). A variant that fails there is reported in the parent with its traceback."""
    gc_off = "import gc; gc.disable()\n"  # the child turns it on whatever the parent did
    res = subprocess.run(
        [sys.executable, "-c", gc_off + _OWN_PROCESS],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["turn", "True", "reported", "True"], res.stdout + res.stderr
