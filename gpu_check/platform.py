"""One process set up for verl 0.9.1's worker path, on a CUDA device or on the CPU.

verl 0.9.1 registers only NVIDIA, Huawei and AMD platforms; on a CPU it falls back to
"nvidia" and `FSDPEngine.initialize()` fails on `torch.cuda.current_device()`. `prepare`
therefore, on the CPU only:

* registers a CPU platform through verl's own `verl.plugin.platform` registry and installs
  it with `set_platform`, BEFORE any `verl.workers.engine` import (the FSDP engine caches
  `device_name` at import time);
* sets `VERL_ENGINE_DEVICE=cuda`: engines register only under the device keys cuda/npu,
  and this variable is verl's own override of the lookup key (verl/workers/engine/base.py);
* pins torch to one intra-op thread (gloo and intra-op threads compete on small CPUs; the
  results are bit-identical with 1 or 2 threads).

On both devices it initialises a one-process group first (gloo on CPU; cpu:gloo,cuda:nccl
on CUDA, as verl would), so verl's `initialize_global_process_group_ray` finds one and does
nothing. On CUDA verl's own platform is used unchanged: no code path differs except the
device string.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import types
from collections.abc import Iterator
from typing import Any

import attrs

from rollout_lifecycle.gpu_check.errors import TechnicalFailure

DEVICES = ("auto", "cuda", "cpu")
_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"


@attrs.frozen
class DeviceInfo:
    """Where the run executes and how the process was set up."""

    requested: str
    device: str  # "cuda" or "cpu"
    platform: str  # the verl platform in use
    backend: str  # torch.distributed backend string
    name: str  # e.g. the GPU model, or the CPU


_PREPARED: DeviceInfo | None = None


def resolve_device(requested: str) -> str:
    """`auto` is cuda when torch sees a CUDA device, else cpu; cuda without one is an error."""
    import torch

    if requested not in DEVICES:
        raise TechnicalFailure("device", f"unknown device {requested!r}; use {', '.join(DEVICES)}")
    has_cuda = bool(torch.cuda.is_available())
    if requested == "auto":
        return "cuda" if has_cuda else "cpu"
    if requested == "cuda" and not has_cuda:
        raise TechnicalFailure(
            "device",
            "--device cuda, but torch sees no CUDA device (torch "
            f"{torch.__version__}, built with CUDA {torch.version.cuda}); use --device cpu or auto",
        )
    return requested


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_device_module() -> types.ModuleType:
    """`torch.cpu` plus the inert memory calls verl makes on its device module."""
    import torch

    mod = types.ModuleType("rollout_lifecycle_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(mod, name, getattr(torch.cpu, name))

    def zero(*_a: Any, **_k: Any) -> int:
        return 0

    def nothing(*_a: Any, **_k: Any) -> None:
        return None

    for name in (
        "max_memory_allocated",
        "max_memory_reserved",
        "memory_allocated",
        "memory_reserved",
    ):
        setattr(mod, name, zero)
    for name in ("empty_cache", "ipc_collect", "reset_peak_memory_stats", "set_device"):
        setattr(mod, name, nothing)
    mod.mem_get_info = lambda *_a, **_k: (0, 0)  # type: ignore[attr-defined]
    mod.get_device_name = lambda *_a, **_k: "cpu"  # type: ignore[attr-defined]
    mod.manual_seed = torch.manual_seed  # type: ignore[attr-defined]
    mod.manual_seed_all = torch.manual_seed  # type: ignore[attr-defined]
    return mod


def _install_cpu_platform() -> None:
    import torch
    from verl.plugin.platform import PlatformBase, PlatformRegistry, get_platform, set_platform

    device_module = _cpu_device_module()

    class PlatformCPU(PlatformBase):  # type: ignore[misc]
        """verl platform for a CPU-only process: device 'cpu', gloo, no profiler, no IPC."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> types.ModuleType:
            return device_module

        def is_available(self) -> bool:
            return True

        def current_device(self) -> str:  # a torch device argument: verl calls .to(this)
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    if _ENGINE_MODULE in sys.modules and get_platform().device_name != "cpu":
        raise TechnicalFailure(
            "platform",
            "verl's FSDP engine was imported before the CPU platform was installed (it caches "
            "the device name at import); run the check in a fresh process",
        )
    PlatformRegistry.register(platform="cpu")(PlatformCPU)
    set_platform(PlatformCPU())


def prepare(requested: str = "auto") -> DeviceInfo:
    """Set this process up once for the requested device; a second call must agree."""
    global _PREPARED
    device = resolve_device(requested)
    if _PREPARED is not None:
        if _PREPARED.device != device:
            raise TechnicalFailure(
                "platform",
                f"this process is already set up for {_PREPARED.device}; run {device} in a "
                "fresh process",
            )
        return _PREPARED
    import torch
    import torch.distributed as dist

    world = os.environ.get("WORLD_SIZE", "1")
    if world != "1":
        raise TechnicalFailure(
            "platform", f"the check runs in one process; WORLD_SIZE is {world} (unset it)"
        )
    # a fresh port every time: an inherited MASTER_PORT may belong to another process
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if device == "cpu":
        os.environ["VERL_ENGINE_DEVICE"] = "cuda"
        torch.set_num_threads(1)
        _install_cpu_platform()
        backend, name = "gloo", "cpu"
    else:
        torch.cuda.set_device(0)
        backend, name = "cpu:gloo,cuda:nccl", str(torch.cuda.get_device_name(0))
    from verl.plugin.platform import get_platform

    if not dist.is_initialized():
        try:  # a process-local store: no socket to race for, nobody else ever joins
            store = dist.HashStore()  # type: ignore[attr-defined,unused-ignore]
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
        except (RuntimeError, ValueError) as exc:
            raise TechnicalFailure("platform", f"torch.distributed init failed: {exc}") from None
    _PREPARED = DeviceInfo(requested, device, type(get_platform()).__name__, backend, name)
    return _PREPARED


@contextlib.contextmanager
def output_to(path: str) -> Iterator[None]:
    """Send file descriptors 1 and 2 (verl's prints, C++ warnings, progress bars) to `path`.

    The check's own progress goes to a duplicate of the original stderr (see `console_fd`),
    so a `--json` stdout stays clean and verl's chatter lands in the run's log.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (*saved, fd):
            os.close(f)
