"""A CPU platform for verl 0.9.1, registered through verl's own platform plug-in point (`verl.plugin.platform`).

verl ships CUDA, NPU and ROCm platforms only; its workers ask the platform for the device, the collective
backend, the memory counters and the Ray resource. This one answers `cpu`, `gloo`, zeros and Ray's CPUs, so that
verl's real workers (FSDP2 engine), rollout servers (the plugin's `hf` backend) and `main_ppo` itself run on a
machine without an accelerator: a recipe checked end to end on a laptop before it costs GPU-hours.

Chosen by one setting that reaches every Ray process: `VERL_PLATFORM=cpu` (verl's own platform override, read at
verl's first `get_platform()`; local Ray workers inherit the driver's environment, remote nodes need it in
`ray_kwargs.ray_init.runtime_env.env_vars`). The plugin registers the class at `import verl` (`register()`), and
`select_cpu_platform()` sets the variables in the driver before anything starts. The frictions verl meets on this
platform are handled in `verl_dppo.rehearsal.patches.cpu_distributed` and `verl_dppo.rehearsal.patches.cpu_resources`.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Optional

import torch

from verl.plugin.platform import PlatformBase, PlatformRegistry, get_platform, set_platform

from verl_dppo.rehearsal.selection import PLATFORM_NAME, is_selected

__all__ = ["CPUPlatform", "PLATFORM_NAME", "install", "is_selected", "register", "select_cpu_platform"]


class _CPUDeviceModule:
    """What verl calls on `torch.<device>`: torch.cpu's functions plus no-op memory statistics."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "CPU"  # verl's flops counter looks the name up in its table of peak FLOPS (none for CPUs: inf)

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        return 0

    max_memory_reserved = memory_allocated = memory_reserved = max_memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        return 0, 0

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)


class CPUPlatform(PlatformBase):
    """verl's platform interface answered for the host CPU: device `cpu`, collectives over gloo."""

    _device_module = _CPUDeviceModule()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return self._device_module  # type: ignore[return-value]

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return True

    def current_device(self) -> str:  # verl moves tensors with `.to(current_device())`: "cpu" is what works
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "VERL_DPPO_VISIBLE_CPUS"  # verl sets it per worker; nothing reads it

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        # verl's default, {"resources": {"CPU": n}}, is refused by Ray: CPUs are asked for as num_cpus.
        return {"num_cpus": num_gpus}

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        """The environment of a rollout server verl starts (vLLM's, on CPU: its CPU build reads these), each kept
        where the driver's environment sets it: a KV cache of VLLM_CPU_KVCACHE_SPACE GiB (vLLM's default, 4, is a
        lot beside a CPU run's trainer), OpenMP threads left unbound (vLLM binds one thread per core by default,
        which a run sharing its cores with the trainer cannot afford), and TorchDynamo off: vLLM would compile two
        sampler ops with inductor at the first log-probs request (seconds of a small machine's cores, for nothing in
        eager mode)."""
        defaults = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TORCHDYNAMO_DISABLE": "1"}
        return {name: os.environ.get(name, value) for name, value in defaults.items()}

    def cudart(self) -> Any:
        return None


def register() -> None:
    """Register the class under PLATFORM_NAME in verl's PlatformRegistry (the plugin does it at `import verl`), and
    when this process selected it, point verl's engine registry at the FSDP engine (listed under cuda and npu only;
    the engine itself runs wherever the platform points it)."""
    if PlatformRegistry.get(PLATFORM_NAME) is not CPUPlatform:
        PlatformRegistry.register(platform=PLATFORM_NAME)(CPUPlatform)
    if is_selected():
        os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
        _quiet_override_notice()


def _quiet_override_notice() -> None:
    """verl's platform manager logs the VERL_PLATFORM override at INFO in every process of a run (five lines a
    cpu_tiny run): the CPU platform is what the launch chose, not news. Any other line of that logger stays."""
    manager = logging.getLogger("verl.plugin.platform.platform_manager")
    if not any(isinstance(f, _OverrideNotice) for f in manager.filters):
        manager.addFilter(_OverrideNotice())


class _OverrideNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "Platform override from VERL_PLATFORM: %s" and record.args == (PLATFORM_NAME,))


def select_cpu_platform() -> None:
    """Select the CPU platform in this process and in every local Ray process it starts (they inherit the
    environment): call it in the driver before ray.init."""
    os.environ["VERL_PLATFORM"] = PLATFORM_NAME
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
    _quiet_override_notice()


_installed: Optional[CPUPlatform] = None


def install() -> PlatformBase:
    """Make the CPU platform verl's platform in this process now (idempotent), for code that drives verl's workers
    without Ray (the worker-level tests); call it before verl's first `get_platform()`: some verl modules read the
    device name at import (the FSDP engine's transformer_impl)."""
    global _installed
    if _installed is None:
        register()
        select_cpu_platform()
        _installed = CPUPlatform()
        set_platform(_installed)
    if get_platform() is not _installed:
        raise RuntimeError("verl's platform was replaced after the CPU platform was installed")
    return _installed


register()  # at import: `import verl` (which loads the plugin) may itself be what imports this module first
