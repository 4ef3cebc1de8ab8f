"""The ledger conformance kit as a pytest plugin (install the ``[pytest]`` extra).

Registered through the ``pytest11`` entry point, so with this package installed::

    pytest --rl-ledger=mypkg.ledgers:make_ledger            # one test item per factory
    pytest --rl-ledger=mypkg.ledgers:make_ledger --rl-ledger-examples 300

runs every protocol check and the ledger race machine against your ledger class, and a
test can ask for the ``ledger_conformance`` fixture to check a factory it builds itself.
Nothing heavy (no Hypothesis) is imported unless ``--rl-ledger`` is given or the fixture
runs, so the plugin costs other test sessions nothing and never breaks them.

The factory is ``make_ledger(tmp_path: Path, clock: Callable[[], float], **options) ->
Ledger``; the options are ``lease_seconds`` and ``recovery``. ``mypkg.ledgers`` is imported
with pytest's rootdir and the current folder on ``sys.path``, so a ``ledgers.py`` beside
your tests works with plain ``pytest``. A factory that cannot be imported, is not callable,
does not take those arguments or does not return a Ledger is a usage error (exit 4) before
anything runs. A failing ledger's report shows the shrunk program itself and where it is
saved (a folder that is kept: ``rl-conformance-*`` under the temporary directory).
"""

from __future__ import annotations

import contextlib
import inspect
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

OPTION = "--rl-ledger"


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add the options that name ledger factories to check."""
    group = parser.getgroup("rollout-lifecycle", "rollout-lifecycle ledger conformance")
    group.addoption(
        OPTION,
        action="append",
        default=[],
        metavar="MODULE:FACTORY",
        help="run the ledger conformance kit on this factory (repeatable); also 'memory', "
        "'sqlite', or a postgresql:// URL (each check in a fresh schema of that database) "
        "for the built-in backends",
    )
    group.addoption(
        "--rl-ledger-examples",
        type=int,
        default=100,
        metavar="N",
        help="Hypothesis examples of the race machine per factory (default 100)",
    )


class ConformanceItem(pytest.Item):
    """One factory checked by the whole kit; fails with the kit's own summary."""

    def __init__(self, *, factory: str, examples: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.factory = factory
        self.examples = examples

    def runtest(self) -> None:
        """Run the protocol checks and the race machine in a folder of their own, kept
        when the ledger fails (its report names the saved program there)."""
        from rollout_lifecycle.stateful_tests.conformance import run_conformance

        work = Path(tempfile.mkdtemp(prefix="rl-conformance-"))
        report = run_conformance(self.factory, examples=self.examples, workdir=work)
        if report.ok:
            shutil.rmtree(work, ignore_errors=True)
        report.raise_on_failure()

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        """The kit's summary, not a traceback through the kit."""
        from rollout_lifecycle.stateful_tests.conformance import ConformanceFailure

        if isinstance(excinfo.value, ConformanceFailure):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Any, int | None, str]:
        """Where the item comes from, for pytest's report lines."""
        return self.path, None, f"ledger conformance: {self.factory}"


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Append one conformance item per ``--rl-ledger`` factory."""
    examples = int(config.getoption("rl_ledger_examples"))
    if examples < 1:
        raise pytest.UsageError("--rl-ledger-examples must be >= 1")
    factories = config.getoption("rl_ledger")
    if factories:
        try:
            import hypothesis  # noqa: F401  (the race machine's engine, the [pytest] extra)
        except ImportError:
            raise pytest.UsageError(
                f"{OPTION} runs a Hypothesis state machine, and Hypothesis is not installed: "
                "pip install 'rollout-lifecycle[pytest]'"
            ) from None
    for factory in factories:
        check_factory(factory, [config.rootpath, Path.cwd()])
    for factory in factories:
        items.append(
            ConformanceItem.from_parent(
                session,
                name=f"rl-ledger-conformance[{factory}]",
                factory=factory,
                examples=examples,
            )
        )


def check_factory(spec: str, import_roots: list[Path]) -> None:
    """Refuse a ``--rl-ledger`` value that cannot be run, as a usage error that says what to
    fix: a factory module is imported with `import_roots` on sys.path (pytest's rootdir and
    the current folder, so a module beside the tests imports under plain ``pytest``), and
    the factory is called once to see that it takes the documented arguments and returns a
    Ledger. Built-in backends and postgresql:// URLs are checked by the kit itself."""
    if spec.startswith(("postgresql://", "postgres://")):
        return
    for root in import_roots:
        if str(root) not in sys.path:
            sys.path.append(str(root))  # after the installed packages: never shadows them
    from rollout_lifecycle.model.ledger import Ledger, ManualClock, RecoveryRule
    from rollout_lifecycle.stateful_tests.backends import resolve_factory

    usage = (
        "a ledger factory is 'package.module:function' with the signature "
        "make_ledger(tmp_path: Path, clock: Callable[[], float], **options) -> Ledger "
        "(options: lease_seconds, recovery)"
    )
    try:
        _, factory = resolve_factory(spec)
    except (ValueError, TypeError) as exc:
        raise pytest.UsageError(f"{OPTION}={spec}: {exc}; {usage}") from None
    if ":" not in spec:
        return  # a built-in backend by name: the kit's own
    args: tuple[Any, ...] = (ManualClock(0.0),)
    options: dict[str, Any] = {"lease_seconds": 10.0, "recovery": RecoveryRule()}
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without one: the call below tells
        signature = None
    if signature is not None:
        try:
            signature.bind(Path("."), *args, **options)
        except TypeError as exc:
            raise pytest.UsageError(
                f"{OPTION}={spec}: it cannot be called that way ({exc}); {usage}"
            ) from None
    with tempfile.TemporaryDirectory(prefix="rl-conformance-probe-") as tmp:
        try:
            led = factory(Path(tmp), *args, **options)
        except Exception:
            return  # it raised for its own reasons: that is the kit's finding to report
        try:
            if not isinstance(led, Ledger):
                missing = sorted(
                    m for m in dir(Ledger) if not m.startswith("_") and not hasattr(led, m)
                )
                raise pytest.UsageError(
                    f"{OPTION}={spec}: returned {type(led).__name__}, not a Ledger "
                    f"(missing {', '.join(missing)}); {usage}"
                )
        finally:
            close = getattr(led, "close", None)
            if callable(close):
                with contextlib.suppress(Exception):  # closing is the kit's to judge
                    close()


@pytest.fixture
def ledger_conformance(tmp_path: Path) -> Iterator[Callable[..., None]]:
    """``ledger_conformance(factory, examples=100)`` raises ConformanceFailure on a bad ledger."""
    from rollout_lifecycle.stateful_tests.conformance import run_conformance

    def check(factory: Any, examples: int = 100, **kwargs: Any) -> None:
        run_conformance(factory, examples=examples, workdir=tmp_path, **kwargs).raise_on_failure()

    yield check
