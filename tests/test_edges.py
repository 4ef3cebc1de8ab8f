"""Regression tests of issue 10: every bad input a typed, one-line error; every file written
whole; memory bounded by the input. Each test names the hostile input it was reported with."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rollout_lifecycle import assess_policy_compatibility, compare_and_reserve
from rollout_lifecycle.model.artifacts import ArtifactStore
from rollout_lifecycle.model.backends import open_backend
from rollout_lifecycle.model.coordinator import ActivationCoordinator
from rollout_lifecycle.model.errors import (
    ActivationError,
    ArtifactError,
    BackendURLError,
    GateConfigError,
    InvalidRecord,
    RolloutLifecycleError,
)
from rollout_lifecycle.model.ledger import MemoryLedger, ReserveRequest
from rollout_lifecycle.model.records import (
    AdmissionPolicy,
    AdmissionStamp,
    LedgerEntry,
    Reward,
    WorkerAck,
)
from rollout_lifecycle.model.registry import MemoryRegistry, set_admission_policy
from rollout_lifecycle.model.sqlite_ledger import SQLiteLedger

CLI = str(Path(sys.executable).parent / "rollout-lifecycle")
H = "a" * 64
ROW = {
    "rollout_id": "r0",
    "prompt_id": "p",
    "dataset": "d",
    "sample_index": 0,
    "behavior_version": 3,
    "artifact_hash": H,
    "conditions": {
        "tokenizer_id": "t",
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_tokens": 8,
    },
    "response_token_ids": [1, 2],
    "action_mask": [True, True],
    "behavior_log_probs": [-0.5, -0.5],
    "current_log_probs": [-0.5, -0.5],
}
STAMP = AdmissionStamp(3, 3, 1, 0.2, 0.0, "fresh", "ok", True)


def run(
    *args: str, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """The installed command, as a user runs it."""
    return subprocess.run(
        [CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, check=False
    )


def admit(inp: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run(
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
        "--quiet",
        *extra,
    )


def one_line_error(res: subprocess.CompletedProcess[str], code: int = 2) -> None:
    assert res.returncode == code, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout


def write_line(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    return path


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        (json.dumps({**ROW, "behavior_version": 10**30}), "64 bits"),
        (json.dumps({**ROW, "behavior_version": 2**63}), "64 bits"),
        (json.dumps(ROW).replace("-0.5, -0.5]}", "-0.5, " + "1" + "0" * 400 + "]}"), "too large"),
    ],
    ids=["deep-json", "version-1e30", "version-2**63", "logprob-10**400"],
)
def test_admit_hostile_lines_are_one_line_errors(text: str, needle: str, tmp_path: Path) -> None:
    """Deep nesting, 10**30 / 2**63 versions, a 10**400 log-prob: line-numbered, exit 2."""
    inp = write_line(tmp_path / "in.jsonl", text)
    res = admit(inp, tmp_path / "o.jsonl")
    one_line_error(res)
    assert "line 1" in res.stderr and needle in res.stderr, res.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_admit_dev_zero_is_refused_not_a_memory_error(tmp_path: Path) -> None:
    """An endless line (/dev/zero) is refused once it passes the line limit."""
    res = admit(Path("/dev/zero"), tmp_path / "o.jsonl")
    one_line_error(res)
    assert "longer than" in res.stderr


def test_admit_options_out_of_range(tmp_path: Path) -> None:
    """--current-version 2**63 and 1_0 are usage errors before reading anything."""
    inp = write_line(tmp_path / "in.jsonl", json.dumps(ROW))
    for value in ("9223372036854775808", "1_0"):
        res = run(
            "admit",
            str(inp),
            "--out",
            str(tmp_path / "o.jsonl"),
            "--current-version",
            value,
            "--max-lag",
            "1",
            "--max-drift",
            "0.2",
        )
        one_line_error(res)


def test_admit_writes_strict_json_for_overflowing_drift(tmp_path: Path) -> None:
    """Finite log-probs of +-1e308 overflow the drift: written as null + drift_overflow."""
    row = {**ROW, "behavior_log_probs": [-1e308, -1e308], "current_log_probs": [1e308, 1e308]}
    inp = write_line(tmp_path / "in.jsonl", json.dumps(row))
    res = admit(inp, tmp_path / "o.jsonl")
    assert res.returncode == 0, res.stderr
    line = (tmp_path / "o.jsonl").read_text().strip()
    assert "Infinity" not in line and "NaN" not in line
    got = json.loads(line)
    assert got["drift"] is None and got["drift_overflow"] is True and not got["accepted"]


def test_admit_refuses_a_hard_link_to_its_input(tmp_path: Path) -> None:
    """--out naming the input through a hard link is refused (paths differ, the file not)."""
    inp = write_line(tmp_path / "in.jsonl", json.dumps(ROW))
    link = tmp_path / "link.jsonl"
    os.link(inp, link)
    res = admit(inp, link, "--force")
    one_line_error(res)
    assert inp.read_text().startswith("{")


def test_admit_outlier_memory_is_bounded(tmp_path: Path) -> None:
    """One 100k-token rollout among 1,023 short ones: every row decided, no padding blow-up
    (peak RSS is measured by benchmarks/admit_memory.py; here: it runs and decides all)."""
    short = {
        **ROW,
        "response_token_ids": [1] * 8,
        "action_mask": [True] * 8,
        "behavior_log_probs": [-0.5] * 8,
        "current_log_probs": [-0.5] * 8,
    }
    n = 100_000
    long = {
        **ROW,
        "rollout_id": "long",
        "response_token_ids": [1] * n,
        "action_mask": [True] * n,
        "behavior_log_probs": [-0.5] * n,
        "current_log_probs": [-0.5] * n,
    }
    inp = tmp_path / "in.jsonl"
    with inp.open("w") as f:
        for i in range(1023):
            f.write(json.dumps({**short, "rollout_id": f"s{i}"}) + "\n")
        f.write(json.dumps(long) + "\n")
    res = admit(inp, tmp_path / "o.jsonl")
    assert res.returncode == 0, res.stderr
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 1024


def test_sigterm_leaves_no_temporary(tmp_path: Path) -> None:
    """SIGTERM during admit: no decisions file and no hidden temporary left behind."""
    inp = tmp_path / "in.jsonl"
    with inp.open("w") as f:
        for i in range(60_000):
            f.write(json.dumps({**ROW, "rollout_id": f"r{i}"}) + "\n")
    out = tmp_path / "o.jsonl"
    proc = subprocess.Popen(
        [
            CLI,
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
            "--quiet",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 60
    while time.time() < deadline and not any(
        p.name.startswith(".o.jsonl") for p in tmp_path.iterdir()
    ):
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize(
    "args",
    [
        ["diagram", "--out", "{f}/x.mmd", "--machine", "lifecycle"],
        ["diagram", "--write-docs", "{f}/x"],
        ["fuzz", "--out", "{f}/w", "--examples", "1"],
        ["campaign", "--out", "{f}/w", "--examples", "1"],
        ["demo", "--workdir", "{f}/w"],
        ["explore", "--report", "{f}/r.json", "--model", "activation-2v"],
        ["fuzz", "--time-budget", "nan"],
    ],
    ids=[
        "diagram-out",
        "write-docs",
        "fuzz-out",
        "campaign-out",
        "demo-workdir",
        "explore-report",
        "time-budget-nan",
    ],
)
def test_paths_under_a_file_and_nan_budgets_fail_fast(args: list[str], tmp_path: Path) -> None:
    """A path under a file, or a NaN budget, is a usage error at once (no work, no output)."""
    f = tmp_path / "some.jsonl"
    f.write_text("{}\n")
    start = time.time()
    res = run(*(a.replace("{f}", str(f)) for a in args), cwd=tmp_path)
    one_line_error(res)
    assert time.time() - start < 30


def test_diagram_never_overwrites_a_data_file_without_force(tmp_path: Path) -> None:
    """`diagram --out data.jsonl` refuses; with --force it replaces it."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"keep": true}\n')
    res = run("diagram", "--machine", "lifecycle", "--out", str(data))
    one_line_error(res)
    assert data.read_text() == '{"keep": true}\n'
    res = run("diagram", "--machine", "lifecycle", "--out", str(data), "--force")
    assert res.returncode == 0 and data.read_text().startswith("---")


def test_reports_and_artifacts_are_readable_by_others(tmp_path: Path) -> None:
    """Reports are 0644 (not mkstemp's 0600); artifact folders are not 0700."""
    old = os.umask(0o022)
    try:
        res = run(
            "explore", "--model", "activation-2v", "--report", str(tmp_path / "r.json"), "--quiet"
        )
        assert res.returncode == 0, res.stderr
        assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == 0o644
        stored = ArtifactStore(tmp_path / "arts").write(0, files={"w.bin": b"x"})
        assert stat.S_IMODE(stored.path.stat().st_mode) == 0o755
    finally:
        os.umask(old)


def test_ledger_show_survives_a_lease_of_1e300(tmp_path: Path) -> None:
    """A lease far outside any calendar is shown as a number, not a traceback."""
    url = f"sqlite:///{tmp_path / 'l.db'}"
    with open_backend(url) as b:
        set_admission_policy(b.registry, AdmissionPolicy(1, 0.2), "set by the operator")
        c = ActivationCoordinator(
            b.registry, ["g0"], ledger=b.ledger, policy=AdmissionPolicy(1, 0.2)
        )
        c.prepare(0)
        c.commit_artifact(0, H)
        c.distribute(0)
        c.record_ack(WorkerAck("g0", 0, H, token=c.attempt_token("g0", 0)))
        assert c.try_activate(0).activated
        b.ledger.add(LedgerEntry("r", 0, H, state="rewarded", reward=Reward("rm", "1", 1.0)))
    with open_backend(url, clock=lambda: 1e300) as b:
        out = b.ledger.reserve("r", 0, "u", AdmissionStamp(0, 0, 1, 0.2, 0.0, "fresh", "ok", True))
        assert out.reserved, out
    res = run("ledger", "show", "r", "--backend", url)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    shown = json.loads(run("ledger", "show", "r", "--backend", url, "--json").stdout)
    assert shown["lease_expires_at"] > 1e299


def test_manifest_nested_deep_is_an_artifact_error(tmp_path: Path) -> None:
    """A manifest nested 100k deep raises ArtifactError, not RecursionError."""
    store = ArtifactStore(tmp_path / "a")
    stored = store.write(0, files={"w.bin": b"x"})
    manifest = stored.path / "manifest.json"
    manifest.chmod(0o644)
    manifest.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ArtifactError, match="nested too deeply"):
        store.read_manifest(0)


def test_artifact_store_on_a_file_is_typed(tmp_path: Path) -> None:
    """ArtifactStore(path of a file) raises ArtifactError."""
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ArtifactError):
        ArtifactStore(f)
    with pytest.raises(ArtifactError):
        ArtifactStore(f / "below")


def test_api_refuses_silent_coercions() -> None:
    """Strings, bools and dicts as log-probs, huge ints, 2-D input: typed ValueErrors."""
    for old in (["-0.5"], [True], [{}], [10**400], [[-0.5]], [None], [1j]):
        with pytest.raises(GateConfigError):
            assess_policy_compatibility(old, [-0.5], [True], 0, 0, 1, 0.2)
    for stored in (True, -1):
        with pytest.raises(InvalidRecord):
            compare_and_reserve(
                {"r": {"lifecycle_state": "rewarded", "revision": stored, "reserved_by": None}},
                "r",
                0,
                "u",
            )
    for expected in (False, 0.0, -1):
        with pytest.raises(ValueError):
            compare_and_reserve({}, "r", expected, "u")  # type: ignore[arg-type]
        with pytest.raises(RolloutLifecycleError):
            MemoryLedger().reserve("r", expected, "u", STAMP)  # type: ignore[arg-type]


def test_coordinator_refuses_a_string_worker_set() -> None:
    """ActivationCoordinator(reg, "abc") is refused, not split into workers a, b, c."""
    with pytest.raises(ActivationError, match="string"):
        ActivationCoordinator(MemoryRegistry(), "abc")


@pytest.mark.parametrize("lease", [float("nan"), float("inf"), 0, -1, 10**400])
def test_lease_seconds_checked_at_construction(lease: float) -> None:
    """NaN, inf, 0 and huge leases are refused when the ledger is built."""
    with pytest.raises(ValueError):
        MemoryLedger(lease_seconds=lease)
    with pytest.raises(ValueError):
        open_backend("memory://", lease_seconds=lease)


def test_open_backend_with_a_very_long_path(tmp_path: Path) -> None:
    """A path component over 255 characters is a BackendURLError."""
    with pytest.raises(BackendURLError):
        open_backend(f"sqlite:///{tmp_path / ('x' * 300)}.db")


def test_sqlite_refuses_an_id_with_a_nul_in_add_reserve_and_batch(tmp_path: Path) -> None:
    """An id containing NUL can never be stored (PostgreSQL text holds no NUL, so no backend
    stores one): add, a single reserve and a batch all refuse it, typed, and write nothing."""
    from rollout_lifecycle.model.errors import InvalidLedgerArgument, InvalidRecord

    led = SQLiteLedger(tmp_path / "l.db")
    rid = "a\x00b"
    with pytest.raises(InvalidRecord, match="NUL"):
        led.add(LedgerEntry(rid, 3, H, state="rewarded", reward=Reward("rm", "1", 1.0)))
    with pytest.raises(InvalidLedgerArgument, match="NUL"):
        led.reserve(rid, 0, "u", STAMP)
    with pytest.raises(InvalidLedgerArgument, match="NUL"):
        led.reserve_batch("u", [ReserveRequest(rid, 0, STAMP)])
    assert led.statistics().entries == 0
    led.close()


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: writes fail with ENOSPC (root only; skipped elsewhere)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_registry_on_a_full_disk_says_so(full_disk: Path) -> None:
    """A full disk is reported as such (typed), not as 'cannot rollback'."""
    with open_backend(f"sqlite:///{full_disk / 's.db'}") as b:
        set_admission_policy(b.registry, AdmissionPolicy(1, 0.2), "set by the operator")
        coord = ActivationCoordinator(
            b.registry, ["g0"], ledger=b.ledger, policy=AdmissionPolicy(1, 0.2)
        )
        filler = full_disk / "filler"
        with pytest.raises(OSError), filler.open("wb") as f:
            while True:
                f.write(b"\0" * 65536)
        with pytest.raises(RolloutLifecycleError) as err:
            for v in range(200):
                coord.prepare(v, rollback_version=None)
                coord.commit_artifact(v, f"{v:064x}")
        assert "rollback" not in str(err.value).lower() or "full" in str(err.value).lower()
        assert "full" in str(err.value).lower() or "space" in str(err.value).lower()


def test_diagram_on_a_full_disk_leaves_no_truncated_file(full_disk: Path) -> None:
    """The SVG is written whole or not at all: on a full disk, nothing half-written stays."""
    filler = full_disk / "filler"
    with pytest.raises(OSError), filler.open("wb") as f:
        while True:
            f.write(b"\0" * 4096)
    out = full_disk / "lifecycle.mmd"
    res = run("diagram", "--machine", "lifecycle", "--out", str(out))
    assert res.returncode in (2, 3) and "Traceback" not in res.stderr
    assert not out.exists()
    assert [p.name for p in full_disk.iterdir() if p.name.startswith(".")] == []


def test_gate_registry_errors_are_typed() -> None:
    """A registry callable that raises its own error comes out as GateConfigError."""
    from rollout_lifecycle.model.gate import AdmissionGate, GatePolicy
    from rollout_lifecycle.stateful_tests.builders import make_rollout

    def broken(_v: int) -> str:
        raise ConnectionError("registry service down")

    gate = AdmissionGate(GatePolicy(1, 0.2), registry=broken)
    ro = make_rollout("r", 0, 0, H)
    entry = LedgerEntry("r", 0, H, state="rewarded", reward=Reward("rm", "1", 1.0))
    with pytest.raises(GateConfigError, match="registry lookup"):
        gate.assess(ro, list(np.full(len(ro.evidence.behavior_log_probs), -0.5)), 0, entry)  # type: ignore[union-attr]
