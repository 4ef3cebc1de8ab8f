"""The ledger conformance kit as a pytest plugin (install the ``[pytest]`` extra).

Registered through the ``pytest11`` entry point, so with this package installed::

    pytest --rl-ledger=mypkg.ledgers:make_ledger            # one test item per factory
    pytest --rl-ledger=mypkg.ledgers:make_ledger --rl-ledger-examples 300

runs every protocol check and the ledger race machine against your ledger class, and a
test can ask for the ``ledger_conformance`` fixture to check a factory it builds itself.
Nothing heavy is imported until a conformance item or the fixture actually runs, so the
plugin costs other test sessions nothing.
"""

from __future__ import annotations

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
        """Run the protocol checks and the race machine in a private temporary folder."""
        from rollout_lifecycle.stateful_tests.conformance import run_conformance

        with tempfile.TemporaryDirectory(prefix="rl-conformance-") as tmp:
            run_conformance(
                self.factory, examples=self.examples, workdir=Path(tmp)
            ).raise_on_failure()

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
    for factory in config.getoption("rl_ledger"):
        items.append(
            ConformanceItem.from_parent(
                session,
                name=f"rl-ledger-conformance[{factory}]",
                factory=factory,
                examples=examples,
            )
        )


@pytest.fixture
def ledger_conformance(tmp_path: Path) -> Iterator[Callable[..., None]]:
    """``ledger_conformance(factory, examples=100)`` raises ConformanceFailure on a bad ledger."""
    from rollout_lifecycle.stateful_tests.conformance import run_conformance

    def check(factory: Any, examples: int = 100, **kwargs: Any) -> None:
        run_conformance(factory, examples=examples, workdir=tmp_path, **kwargs).raise_on_failure()

    yield check
