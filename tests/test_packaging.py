"""The distribution is a good guest: one import name, no test runner at runtime, installs
beside verl 0.9.1, and a user's own `model.py` or `cli/` cannot shadow it.

These build the real wheel and install it into a fresh virtualenv (dependencies from the
package index), so they need the index; they are the slow part of the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# a known-long module: a larger limit than the suite's default (pyproject.toml)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def run(cmd: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """Run a command, failing the test with its output when it fails."""
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{cmd}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def wheel_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel built from this checkout, and everything the build printed (-v)."""
    out = tmp_path_factory.mktemp("dist")
    res = run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(ROOT),
        ],
        cwd=out,
    )
    (whl,) = out.glob("rollout_lifecycle-*.whl")
    return whl, res.stdout + res.stderr


@pytest.fixture(scope="module")
def wheel(wheel_build: tuple[Path, str]) -> Path:
    """The wheel built from this checkout."""
    return wheel_build[0]


def test_wheel_carries_every_report_schema_without_build_warnings(
    wheel_build: tuple[Path, str],
) -> None:
    """Every cli/schemas/*.schema.json is in the wheel, and setuptools never warns that the
    schemas folder is a package it would ignore (a future setuptools may drop it)."""
    import zipfile

    whl, log = wheel_build
    assert "Package would be ignored" not in log, log[-3000:]
    names = set(zipfile.ZipFile(whl).namelist())
    shipped = sorted(p.name for p in (ROOT / "cli" / "schemas").glob("*.schema.json"))
    assert len(shipped) >= 8
    missing = [n for n in shipped if f"rollout_lifecycle/cli/schemas/{n}" not in names]
    assert missing == []


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """A new virtualenv with only the wheel and its declared dependencies installed."""
    env = tmp_path_factory.mktemp("venv")
    venv.create(env, with_pip=True)
    py = env / "bin" / "python"
    run([str(py), "-m", "pip", "install", "--quiet", str(wheel)], cwd=env)
    return py


def test_wheel_holds_one_package(wheel: Path) -> None:
    """Every module of the wheel lives under rollout_lifecycle/ (no top-level model, cli...)."""
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"rollout_lifecycle"}, tops
    for sub in ("model", "spec", "stateful_tests", "gpu_check", "cli"):
        assert f"rollout_lifecycle/{sub}/__init__.py" in names
    # verl's `+rollout_lifecycle=ledger` config group (docs/verl-v1.md)
    assert "rollout_lifecycle/gpu_check/verl_config/rollout_lifecycle/ledger.yaml" in names


def test_user_model_py_and_cli_do_not_shadow(fresh_env: Path, tmp_path: Path) -> None:
    """From a folder with its own model.py and cli/, both the user's and ours import."""
    (tmp_path / "model.py").write_text("USER_MODEL = True\n")
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "__init__.py").write_text("USER_CLI = True\n")
    (tmp_path / "spec.py").write_text("USER_SPEC = True\n")
    probe = textwrap.dedent(
        """
        import sys
        import model, cli, spec
        assert model.USER_MODEL and cli.USER_CLI and spec.USER_SPEC
        from rollout_lifecycle.model.backends import open_backend
        from rollout_lifecycle import transition_lifecycle, __version__
        import rollout_lifecycle.cli.main
        assert transition_lifecycle("rewarded", "reserve") == "reserved"
        with open_backend("sqlite:///probe.db") as b:
            assert b.ledger.statistics().entries == 0
        assert "pytest" not in sys.modules, "the library must not import a test runner"
        print(__version__)
        """
    )
    res = run([str(fresh_env), "-c", probe], cwd=tmp_path)
    assert res.stdout.strip()
    script = fresh_env.parent / "rollout-lifecycle"
    out = run([str(script), "--version"], cwd=tmp_path)
    assert "rollout-lifecycle" in out.stdout
    run([str(fresh_env), "-m", "rollout_lifecycle", "--version"], cwd=tmp_path)


def test_no_second_copy_under_another_name(fresh_env: Path, tmp_path: Path) -> None:
    """The package refuses to be imported under a second name (e.g. from the repo root)."""
    res = subprocess.run(
        [str(fresh_env), "-c", "import model"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode != 0 and "import rollout_lifecycle.model" in res.stderr


def test_runtime_dependencies_are_ranges_without_a_test_runner() -> None:
    """No exact pins and no pytest among the core dependencies."""
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = meta["project"]["dependencies"]
    assert not [d for d in deps if "==" in d], deps
    assert not [d for d in deps if d.lower().startswith("pytest")], deps
    assert "pytest" in " ".join(meta["project"]["optional-dependencies"]["pytest"])


def test_hypothesis_and_the_psycopg_build_are_extras() -> None:
    """Embedding needs no Hypothesis (the [campaign] extra, which `make campaign` and
    `make setup-dev` install) and [postgres] depends on plain psycopg, as its docs advise a
    library to; the binary build is its own extra, which the dev install uses."""
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = meta["project"]["dependencies"]
    extras = meta["project"]["optional-dependencies"]
    assert not [d for d in deps if d.lower().startswith("hypothesis")], deps
    for extra in ("campaign", "pytest", "dev"):
        assert [d for d in extras[extra] if d.startswith("hypothesis>=")], extra
    assert [d for d in extras["postgres"] if d.startswith("psycopg>=3.1,<4")], extras
    assert not [d for d in extras["postgres"] if "[binary]" in d], extras
    assert [d for d in extras["postgres-binary"] if d.startswith("psycopg[binary]")], extras
    for target, extra in (("campaign", "[campaign]"), ("setup-dev", "campaign")):
        plan = subprocess.run(
            ["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        installs = [ln for ln in plan.splitlines() if "pip install" in ln and " -e " in ln]
        assert any(extra in ln for ln in installs), (target, plan)


def test_resolves_beside_verl(fresh_env: Path, wheel: Path, tmp_path: Path) -> None:
    """pip's resolver finds one install set for this wheel, verl 0.9.1 and the CPU torch."""
    report = tmp_path / "resolution.json"
    run(
        [
            str(fresh_env),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report),
            f"{wheel}[verl]",
            "verl==0.9.1",
            "torch==2.13.0",
        ],
        cwd=tmp_path,
    )
    got = {
        i["metadata"]["name"].lower(): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }
    assert got["verl"] == "0.9.1" and got["rollout-lifecycle"]
    assert got["torch"].startswith("2.13.0")


def test_readme_install_instructions_match_the_package(wheel: Path) -> None:
    """The README says how to install from a checkout (the package is not on the index, so
    never a bare `pip install rollout-lifecycle`) and points at docs/install.md, which names
    the wheel the build really makes and describes exactly the extras pyproject.toml
    declares."""
    import re
    import tomllib

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Install as a library", 1)[1].split("\n## ", 1)[0]
    guide = (ROOT / "docs" / "install.md").read_text()
    for text in (readme, guide):
        assert not re.search(r"pip install '?rollout-lifecycle\b", text)
    assert "pip install ." in section and "(docs/install.md)" in section
    for line in ("pip install .", "pip install -e .", "python -m build"):
        assert line in guide, line
    named = re.findall(r"dist/(rollout_lifecycle-[\w.]+-py3-none-any\.whl)", guide)
    assert named and set(named) == {wheel.name}, (named, wheel.name)
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    described = set(re.findall(r"^\| `([a-z0-9-]+)` \|", guide, flags=re.M))
    assert described == extras
