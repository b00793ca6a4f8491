"""torch's CUDA surface as megatron-core 0.16.1 meets it on a CPU: the device, the RNG, type names, factories.

Pieces 1, 2, 6 and 7 of the plugin's Megatron CPU shim (`verl_dppo.rehearsal.megatron_shim`, which installs them and says
why each exists); kept apart from the model and engine pieces there.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from typing import Any, Callable

import torch

__all__ = [
    "FACTORY_MODULES",
    "MegatronShimError",
    "piece_cuda",
    "piece_cuda_factories",
    "piece_rng",
    "piece_tensor_type",
    "target",
]


class MegatronShimError(RuntimeError):
    """The installed megatron-core or mbridge is not the version a piece was read against, or a piece's target moved."""


def target(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise MegatronShimError(f"verl-dppo's Megatron CPU shim: {module}.{name} is gone ({error})") from error


# ----------------------------------------------------------------------------------------------------- 1. cuda


class _Null:
    """A CUDA stream or event on the CPU: every call does nothing and returns another (a stream's `record_event()`
    is an event to `synchronize()`)."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: _Null()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def piece_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    for name in ("set_device", "synchronize", "empty_cache", "reset_peak_memory_stats", "ipc_collect"):
        setattr(cuda, name, lambda *args, **kwargs: None)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, lambda *args, **kwargs: 0)
    cuda.get_device_capability = lambda *args, **kwargs: (0, 0)
    cuda.Stream = cuda.Event = _Null
    cuda.current_stream = cuda.default_stream = lambda *args, **kwargs: _Null()
    cuda.stream = lambda *args, **kwargs: _Null()
    torch.Tensor.record_stream = lambda self, *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self


# ------------------------------------------------------------------------------------------------------ 2. rng


def piece_rng() -> None:
    def get_rng_state(device: Any = "cuda", *args, **kwargs) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(state: torch.Tensor, *args, **kwargs) -> None:
        torch.set_rng_state(state)

    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))  # not torch.manual_seed: it calls cuda's seeding back

    for owner in (torch.cuda, torch.cuda.random):
        owner.get_rng_state, owner.set_rng_state = get_rng_state, set_rng_state
        owner.manual_seed = owner.manual_seed_all = manual_seed
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    target(random.__name__, "_get_cuda_rng_state")
    random._get_cuda_rng_state = get_rng_state
    random._set_cuda_rng_state = set_rng_state


# ---------------------------------------------------------------------------------------------- 6. tensor_type


def piece_tensor_type() -> None:
    original = torch.Tensor.type

    @functools.wraps(original)
    def tensor_type(self, *args, **kwargs):
        answer = original(self, *args, **kwargs)
        if args or kwargs or not isinstance(answer, str) or not answer.startswith("torch."):
            return answer
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("megatron.core") and not answer.startswith("torch.cuda."):
            return "torch.cuda." + answer[len("torch.") :]
        return answer

    torch.Tensor.type = tensor_type


# ------------------------------------------------------------------------------------------ 7. cuda_factories

FACTORY_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.utils",
    "megatron.core.utils",
    "megatron.core.rerun_state_machine",
)
_FACTORIES = (
    "tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "eye",
    "linspace",
    "empty_strided",
    "scalar_tensor",
    "as_tensor",
)


def _on_cpu(device: Any) -> Any:
    if device == "cuda" or (isinstance(device, str) and device.startswith("cuda:")) or isinstance(device, int):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


class _TorchOnCpu(types.ModuleType):
    """`torch` as a megatron-core module sees it: factories and `torch.device` with a CUDA device create on the CPU;
    everything else is torch's own."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        if name in _FACTORIES:
            return _cpu_factory(value)
        if name == "device":
            return _cpu_device
        return value


def _cpu_factory(factory: Callable) -> Callable:
    @functools.wraps(factory)
    def on_cpu(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        return factory(*args, **kwargs)

    return on_cpu


def _cpu_device(*args, **kwargs) -> torch.device:
    if args and not isinstance(args[0], torch.device):
        args = (_on_cpu(args[0]),) + args[1:]
    return torch.device(*args, **kwargs)


_PROXY = _TorchOnCpu()


def piece_cuda_factories() -> None:
    for name in FACTORY_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is not torch:
            raise MegatronShimError(f"verl-dppo's Megatron CPU shim: {name} no longer imports torch as `torch`")
        module.torch = _PROXY
