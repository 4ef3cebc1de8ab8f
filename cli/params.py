"""Option types that validate like the rest of the project: strict and bounded.

click's INT accepts ``1_0`` as 10 and unbounded integers that overflow int64 storage later;
its FloatRange lets NaN through every bound (NaN compares false), so `--time-budget nan`
ran forever. These types refuse all of that at parse time, with a message, before any work.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import click

INT64_MAX = 2**63 - 1

if TYPE_CHECKING:  # click >= 8.2 makes ParamType generic; older clicks cannot subscript it
    _IntBase = click.ParamType[int]
    _FloatBase = click.ParamType[float]
else:
    _IntBase = _FloatBase = click.ParamType
_INT = re.compile(r"^[+-]?[0-9]+$")


class StrictInt(_IntBase):
    """A decimal integer (no underscores, no floats) within [low, high]."""

    name = "integer"

    def __init__(self, low: int = 0, high: int = INT64_MAX) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            n = value
        elif isinstance(value, str) and _INT.match(value.strip()):
            n = int(value.strip())
        else:
            self.fail(f"{value!r} is not a whole number (digits only)", param, ctx)
        if not self.low <= n <= self.high:
            self.fail(f"{n} is not in [{self.low}, {self.high}]", param, ctx)
        return n


class FiniteFloat(_FloatBase):
    """A finite number within [low, high] (NaN and infinities are refused)."""

    name = "number"

    def __init__(self, low: float = 0.0, high: float = 1e12) -> None:
        self.low, self.high = low, high

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(x):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if not self.low <= x <= self.high:
            self.fail(f"{x} is not in [{self.low}, {self.high}]", param, ctx)
        return x


SEED = StrictInt(0, 2**32 - 1)
COUNT = StrictInt(1, 10**9)
VERSION = StrictInt(0, INT64_MAX)
