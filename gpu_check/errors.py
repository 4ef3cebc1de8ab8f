"""Typed errors of the real-run check; each message says what happened and what to do.

`ExtraMissing` and `TechnicalFailure` are environment failures (exit 3: nothing was judged),
`ModelAssetsError` is bad input (exit 2, or 4 from preflight when only the weights are
missing), `ControlError` a refused combination of options. Failed checks are not errors:
they are results, recorded in the evidence.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollout_lifecycle.model.errors import RolloutLifecycleError


class GpuCheckError(RolloutLifecycleError):
    """Base class for the real-run check's own errors."""


class ExtraMissing(GpuCheckError):
    """The optional `[verl]` extra (verl 0.9.1 and its worker-path needs) is not importable."""

    def __init__(
        self, missing: Sequence[str], install_hint: str, what: str = "the real-run check"
    ) -> None:
        self.missing = tuple(missing)
        super().__init__(
            f"{what} needs the [verl] extra; not importable: {', '.join(missing)}. "
            f"Install it with: {install_hint}"
        )


class TechnicalFailure(GpuCheckError):
    """The environment or a library failed at a named stage; nothing there was judged."""

    def __init__(self, stage: str, message: str) -> None:
        self.stage = stage
        super().__init__(f"{stage}: {message}")


class ModelAssetsError(GpuCheckError, ValueError):
    """A local model folder that cannot be used as given (missing config, tokenizer, weights)."""

    def __init__(self, message: str, *, only_weights_missing: bool = False) -> None:
        self.only_weights_missing = only_weights_missing
        super().__init__(message)


class ControlError(GpuCheckError, ValueError):
    """Options that cannot be combined (for instance two negative controls in one run)."""
