"""Delta-debugging of a failing program after Hypothesis has shrunk it.

Hypothesis shrinks the choice sequence, which sometimes leaves steps that a person would
delete at once (a no-op probe, a rollout that plays no part). Replaying the printed program
is cheap, so the runner deletes runs of consecutive steps, long ones first, while the replay
still fails with the same error (same exception type, same first clause once numbers and
ids are blanked out), and saves the smallest program it found.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Sequence
from typing import Any

_RULE = re.compile(r"^(?:[\w(),\s]+ = )?state\.(\w+)\(")
_NUMBERS = re.compile(r"\d+")


def signature(exc: BaseException) -> str:
    """What makes two failures 'the same': the type and the first clause of the message."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    clause = re.split(r"[;(]", first, maxsplit=1)[0]
    return f"{type(exc).__name__}:{_NUMBERS.sub('#', clause).strip()}"


def split_steps(
    lines: Sequence[str], invariant_names: Sequence[str]
) -> tuple[list[str], list[list[str]]]:
    """(prefix, steps): each step is one rule call with the invariant checks after it."""
    skip = {"teardown", *invariant_names}
    prefix: list[str] = []
    steps: list[list[str]] = []
    for line in lines:
        m = _RULE.match(line.strip())
        if line.strip() == "state.teardown()":
            continue
        if m is not None and m.group(1) not in skip:
            steps.append([line])
        elif steps:
            steps[-1].append(line)
        else:
            prefix.append(line)
    return prefix, steps


def replay(
    machine_cls: type[Any], prefix: list[str], steps: list[list[str]]
) -> BaseException | None:
    """Run the program against `machine_cls`; the exception it raised, or None."""
    namespace: dict[str, Any] = {"Machine": machine_cls}
    try:
        for line in [*prefix, *(line for step in steps for line in step)]:
            code = "state = Machine()" if line.startswith("state = ") else line
            exec(code, namespace)  # the program is our own printout, never user input
    except Exception as exc:
        return exc
    finally:
        state = namespace.get("state")
        if state is not None:
            with contextlib.suppress(Exception):
                state.teardown()
    return None


def minimize(
    machine_cls: type[Any],
    lines: Sequence[str],
    invariant_names: Sequence[str],
    *,
    max_replays: int = 400,
    max_seconds: float = 30.0,
) -> list[str]:
    """The smallest sub-program (by steps) that still fails the same way; `lines` if the
    original does not replay to that failure (then nothing is trusted)."""
    prefix, steps = split_steps(lines, invariant_names)
    first = replay(machine_cls, prefix, steps)
    if first is None:
        return list(lines)
    want = signature(first)
    deadline = time.perf_counter() + max_seconds
    budget = [max_replays]

    def still_fails(candidate: list[list[str]]) -> bool:
        if budget[0] <= 0 or time.perf_counter() > deadline:
            return False
        budget[0] -= 1
        exc = replay(machine_cls, prefix, candidate)
        return exc is not None and signature(exc) == want

    changed = True
    while changed and budget[0] > 0:
        changed = False
        n = len(steps)
        # big halves first (cheap wins), then every small chunk size: a rollout that plays
        # no part is usually its generate plus a few pipeline steps in a row
        for size in sorted({n // 2, n // 4, *range(min(n, 8), 0, -1)} - {0}, reverse=True):
            i = len(steps) - size
            while i >= 0:
                candidate = steps[:i] + steps[i + size :]
                if candidate and still_fails(candidate):
                    steps = candidate
                    changed = True
                    i = min(i, len(steps) - size)
                else:
                    i -= 1
    return [*prefix, *(line for step in steps for line in step), "state.teardown()"]
