"""verl plug-in for a CPU-only machine, loaded in EVERY verl process (Ray workers included).

    VERL_USE_EXTERNAL_MODULES=rollout_lifecycle.gpu_check.verl_v1_cpu

verl imports the modules named there from its own `__init__` (verl/__init__.py:49), before
any worker module caches the device name, which is the only point early enough for a
platform: this installs the CPU platform of the real-run check (device 'cpu', gloo) and
makes verl's FSDP engine registry answer for it (VERL_ENGINE_DEVICE=cuda).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")


def _install() -> None:
    from verl.plugin.platform import get_platform

    from rollout_lifecycle.gpu_check.platform import _install_cpu_platform

    if get_platform().device_name != "cpu":
        _install_cpu_platform()
    # verl places every worker with resources={platform.ray_resource_name(): n}; Ray refuses
    # "CPU" there (single_controller/ray/base.py:415 -> ray_option_utils.py:50), so the CPU
    # workers are scheduled on logical GPUs (`ray_init.num_gpus=N`) instead
    cls = type(get_platform())
    # checkpoint_manager.load_rng_state restores the "device" RNG under the key named by
    # the device ("cpu" here), through the device module: give it torch's CPU RNG calls
    device = get_platform().device_module
    for name in ("get_rng_state", "set_rng_state"):
        if not hasattr(device, name):
            setattr(device, name, getattr(__import__("torch"), name))
    cls.ray_resource_name = lambda _self: "GPU"
    # utils/distributed.py:89 builds "cpu:gloo,{device}:{backend}", which on this platform
    # is "cpu:gloo,cpu:gloo" and torch refuses the duplicate device type: plain gloo instead
    import verl.utils.distributed as dist_utils

    if not getattr(dist_utils.initialize_global_process_group_ray, "_cpu_shim", False):
        original = dist_utils.initialize_global_process_group_ray

        def init_gloo(timeout_second: int | None = None, backend: str | None = None) -> None:
            original(timeout_second=timeout_second, backend=backend or "gloo")

        init_gloo._cpu_shim = True  # type: ignore[attr-defined]
        dist_utils.initialize_global_process_group_ray = init_gloo
    # the small CPU replica (rollout name `cpu_hf`), resolvable in every process; when that
    # module is the one being imported (a Ray actor unpickling its server class), it
    # registers itself once its own import finishes
    if "rollout_lifecycle.gpu_check.verl_cpu_replica" not in sys.modules:
        import rollout_lifecycle.gpu_check.verl_cpu_replica  # noqa: F401


_install()
