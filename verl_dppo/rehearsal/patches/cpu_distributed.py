"""Patch of `verl.utils.distributed` on the CPU platform: `initialize_global_process_group_ray` without a duplicate
backend, and `set_numa_affinity` skipped.

Which verl function: `initialize_global_process_group_ray(timeout_second, backend)` builds the default backend
string `cpu:gloo,<device>:<collective backend>`; on the CPU platform that is `cpu:gloo,cpu:gloo`, which torch
refuses ("Duplicate device type cpu in backend string"). Every Ray worker of verl's (the FSDP workers, the
checkpoint-engine workers of standalone rollout replicas) calls it.
What the wrapper does: on the CPU platform only (`VERL_PLATFORM=cpu`), a backend of `cpu:gloo` when none was given;
elsewhere it calls verl's function unchanged. It must replace the module attribute before
`verl.workers.engine_workers` and `verl.checkpoint_engine.base` import the function by name, hence an import hook.
Why no extension point: the backend string is built inline from the device name.
What would retire it: verl building the string from the set of distinct device types (`cpu:gloo` once), or asking
the platform for the whole backend string.

`verl.workers.engine.fsdp.transformer_impl`'s `CPUOffloadPolicy` (FSDP2): verl gives every forward-only engine (the
reference model of `use_kl_loss`) `CPUOffloadPolicy(pin_memory=True)` (transformer_impl.py:459-462 in 0.9.1), and
pinning host memory needs an accelerator ("Cannot access accelerator device when none is available"). On the CPU
platform the name is bound to a subclass that never pins (the parameters live in host memory anyway); elsewhere to
verl's class unchanged. What would retire it: verl asking the platform whether pinning is available.

`set_numa_affinity()` (each training worker, `engine_workers.py:91`) pins the process to the NUMA node of its GPU
through NVML; on the CPU platform there is no GPU, and it printed "Warning: Failed to set NUMA affinity: libnuma.so
..." in every run. On the CPU platform it returns at once (the process keeps the CPUs Ray gave it); elsewhere verl's.
"""

from __future__ import annotations

from typing import Any

from verl_dppo.patches._import_hook import patch_once

__all__ = ["patch_distributed", "patch_offload_policy"]


def patch_distributed(module: Any) -> None:
    def make(original):
        def initialize_global_process_group_ray(timeout_second=None, backend=None):
            from verl_dppo.rehearsal.platform import is_selected

            if backend is None and is_selected():
                backend = "cpu:gloo"
            return original(timeout_second=timeout_second, backend=backend)

        return initialize_global_process_group_ray

    patch_once(module, "initialize_global_process_group_ray", make)

    def make_numa(original):
        def set_numa_affinity(*args, **kwargs):
            from verl_dppo.rehearsal.platform import is_selected

            if is_selected():
                return None
            return original(*args, **kwargs)

        return set_numa_affinity

    patch_once(module, "set_numa_affinity", make_numa)


def patch_offload_policy(module: Any) -> None:
    """Bind the FSDP engine's `CPUOffloadPolicy` to one that does not pin memory on the CPU platform."""
    original = getattr(module, "CPUOffloadPolicy", None)
    if original is None or getattr(original, "__verl_dppo_patched__", False):
        return

    class CPUOffloadPolicy(original):  # an FSDP2 offload policy still (verl and torch test isinstance)
        __verl_dppo_patched__ = True

        def __init__(self, pin_memory: bool = True, **kwargs):
            from verl_dppo.rehearsal.platform import is_selected

            super().__init__(pin_memory=pin_memory and not is_selected(), **kwargs)

    CPUOffloadPolicy.__qualname__ = original.__qualname__
    CPUOffloadPolicy.__module__ = original.__module__
    module.CPUOffloadPolicy = CPUOffloadPolicy
