"""Is the `[verl]` extra importable, and which versions are installed? (no heavy imports)

The core install never needs torch or verl: this module only asks importlib where the
modules would come from and reads installed distributions' metadata, so `rollout-lifecycle
--help` and every other command stay fast and work without the extra.
"""

from __future__ import annotations

import importlib.util
import sys
from importlib import metadata

from rollout_lifecycle.gpu_check.errors import ExtraMissing

# import name -> distribution name; everything verl's worker path imports that a bare
# `pip install verl` may leave out (uvicorn/fastapi: verl.workers.engine_workers imports
# them through verl.checkpoint_engine)
REQUIRED_MODULES: dict[str, str] = {
    "torch": "torch",
    "verl": "verl",
    "transformers": "transformers",
    "peft": "peft",
    "tensordict": "tensordict",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "hydra": "hydra-core",
    "uvicorn": "uvicorn",
    "fastapi": "fastapi",
}

# the distributions whose versions a result records (the extra's resolved set)
VERSIONED = (
    "rollout-lifecycle",
    "torch",
    "verl",
    "transformers",
    "peft",
    "tensordict",
    "tokenizers",
    "safetensors",
    "numpy",
    "hydra-core",
    "ray",
    "uvicorn",
    "fastapi",
)

VERL_VERSION = "0.9.1"

INSTALL_HINT = (
    "pip install torch==2.13.0 (or the CUDA build you use; install torch FIRST so pip keeps "
    "it), then pip install 'rollout-lifecycle[verl]' (from a checkout: pip install -e '.[verl]')"
)


# what the activation drill imports (Ray actors building the small Qwen2 + LoRA model): all
# of it comes with the [verl] extra (verl brings ray)
DRILL_MODULES: dict[str, str] = {
    "ray": "ray",
    "torch": "torch",
    "transformers": "transformers",
    "peft": "peft",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
}


def missing_modules(modules: dict[str, str] | None = None) -> list[str]:
    """Import names of the extra (or of `modules`) that cannot be found, without importing
    them."""
    out = []
    for name in REQUIRED_MODULES if modules is None else modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found or (name in sys.modules and sys.modules[name] is None):
            out.append(name)
    return out


def require_extra() -> None:
    """Raise ExtraMissing, naming every missing module and the exact install command."""
    missing = missing_modules()
    if missing:
        raise ExtraMissing([f"{m} ({REQUIRED_MODULES[m]})" for m in missing], INSTALL_HINT)


def require_drill_modules() -> None:
    """Raise ExtraMissing when the activation drill's modules are not all importable: the
    drill needs the [verl] extra too (its workers are Ray actors building a real model)."""
    missing = missing_modules(DRILL_MODULES)
    if missing:
        names = [f"{m} ({DRILL_MODULES[m]})" for m in missing]
        raise ExtraMissing(names, INSTALL_HINT, what="the activation drill")


def versions() -> dict[str, str | None]:
    """Installed version of each distribution the check depends on (None: not installed)."""
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for dist in VERSIONED:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out
