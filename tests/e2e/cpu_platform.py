"""A CPU platform for verl 0.9.1, registered through verl's own platform plug-in point (`verl.plugin.platform`).

verl ships CUDA, NPU and ROCm platforms only; its workers ask the platform for the device, the collective
backend and the memory counters. This one answers `cpu`, `gloo` and zeros, so that verl's real
`ActorRolloutRefWorker` (FSDP2 engine) trains on a machine without an accelerator. It lives with the tests and is
not shipped: a user's cluster always has a real platform.

`install()` must run before anything in verl calls `get_platform()` (some verl modules read the device name at
import time, e.g. the FSDP engine's `transformer_impl`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Optional

import torch

from verl.plugin.platform import PlatformBase, PlatformRegistry, get_platform, set_platform

__all__ = ["CPUPlatform", "install"]

PLATFORM_NAME = "verl_dppo_test_cpu"


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


@PlatformRegistry.register(platform=PLATFORM_NAME)
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
        return "VERL_DPPO_TEST_VISIBLE_CPUS"

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

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


_installed: Optional[CPUPlatform] = None


def install() -> PlatformBase:
    """Make the CPU platform verl's platform in this process (idempotent); call it before verl's first
    `get_platform()`: some verl modules read the device name at import (the FSDP engine's transformer_impl)."""
    global _installed
    if _installed is None:
        # The registry name, for anything that resolves the platform by name (verl's VERL_PLATFORM override).
        os.environ["VERL_PLATFORM"] = PLATFORM_NAME
        # verl's engine registry lists the FSDP engine under the devices cuda and npu only; the engine itself runs
        # wherever the platform points it.
        os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
        _installed = CPUPlatform()
        set_platform(_installed)
    if get_platform() is not _installed:
        raise RuntimeError("verl's platform was replaced after the CPU platform was installed")
    return _installed
