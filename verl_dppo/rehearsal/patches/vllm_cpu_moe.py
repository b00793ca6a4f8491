"""vLLM-CPU's MoE layers under verl: the weight sync into them, and R3's routed experts out of them.

Two things verl 0.9.1 needs of a MoE rollout that vLLM-CPU 0.27.1's only unquantized MoE path (the monolithic CPU
kernel, `UnquantizedFusedMoEMethod` on `UnquantizedMoeBackend.CPU`) does not give:

1. **verl's weight sync.** After loading, the CPU kernel readies the experts for the kernel this CPU takes
   (`cpu_fused_moe.CPUFusedMOE`): its grouped GEMM repacks them and registers the packed tensors as the layer's
   parameters (`init_moe_grouped_gemm`, `replace_parameter`: AVX-512 and AMX builds); the per-expert torch loop keeps
   them and reads views of them, or drops them for oneDNN handles (`init_moe_torch`: builds without the prepack op,
   AVX2 among them). verl's sync then calls `model.load_weights`, which finds parameters without `weight_loader`
   (AttributeError in `routed_experts.py:962`), in a layout that is not the checkpoint's. verl re-runs
   `process_weights_after_loading` after every sync, so what the sync needs is the loadable parameters back in
   place between forwards, whichever kernel this CPU takes.
2. **R3** (`rollout.enable_rollout_routing_replay=True`, which asks vLLM for `enable_return_routed_experts`):
   `GPUModelRunner._bind_routed_experts_capturer` refuses the CPU kernel ("not supported with monolithic MoE
   kernel", gpu_model_runner.py:7739), which has no capture hook: the routed experts never reach verl's router
   replay.

| upstream (vLLM 0.27.1) | the patch, CPU platform only |
|---|---|
| model_executor/layers/fused_moe/unquantized_fused_moe_method.py `UnquantizedFusedMoEMethod.process_weights_after_loading` | keeps the loadable parameters (the checkpoint's layout, `weight_loader` and all) registered, and the kernel's packed ones aside (`_dppo_packed`); the next sync loads into the former, and the next call repacks from them |
| same file, `UnquantizedFusedMoEMethod.apply_monolithic` | registers the packed parameters for the duration of the kernel's call; with R3, sets the layer's capture function for it too |
| v1/worker/gpu_model_runner.py:7739 `GPUModelRunner._bind_routed_experts_capturer` | each CPU-kernel layer's method gets its capture function (`_dppo_capture`, on the method: the kernel object is rebuilt at every sync); vLLM binds any other layer itself |
| model_executor/layers/fused_moe/cpu_fused_moe.py:356 `CPUFusedMOE.check_grouped_gemm` | on a CPU with AMX, a layer vLLM refuses (any but bf16 of aligned sizes: the rehearsal's float32 experts) gets the decision of an AVX-512 CPU without AMX instead of the refusal |
| model_executor/layers/fused_moe/cpu_fused_moe.py:127 `select_experts` | the CPU kernel's routing (both kernels look it up in their module at each call): hands the `topk_ids` it returns, the ones the kernel then uses, to the capture function set by `apply_monolithic` |

Cost: a second copy of the experts' weights on CPU (the loadable one) where the kernel packs its own; at each sync, a
transient copy of one layer's experts, by which the patch tells what vLLM did to them. Which branch this CPU takes:
`verl-dppo doctor` (`verl_dppo.rehearsal.isa`). Installed by
`verl_dppo.rehearsal.entry` when vLLM imports those modules; vLLM's engine process imports verl's
worker extension, so the plugin is loaded there before the model is built. Off the CPU platform every wrapper is a
pass-through. Tests: tests/test_vllm_cpu_moe.py.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import torch

from verl_dppo.patches._import_hook import patch_once

__all__ = ["patch_method", "patch_bind_capturer", "patch_cpu_select_experts", "patch_check_grouped_gemm"]

_EXPERT_PARAMETERS = ("w13_weight", "w2_weight", "w13_bias", "w2_bias")
_CAPTURE: contextvars.ContextVar = contextvars.ContextVar("dppo_routed_experts_capture", default=None)


def _on_cpu() -> bool:
    from verl_dppo.rehearsal.platform import is_selected

    return is_selected()


def _cpu_kernel(method: Any) -> bool:
    """True for vLLM-CPU's unquantized MoE method (the monolithic CPU kernel), on the CPU platform."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    return _on_cpu() and getattr(method, "unquantized_backend", None) == UnquantizedMoeBackend.CPU


def _keep_loadable(original, method: Any, layer: torch.nn.Module) -> None:
    """Run vLLM's `process_weights_after_loading`, then put the loadable parameters back (see the module's table).

    vLLM-CPU's kernels differ by CPU, so what became of each expert parameter is read from its values, not from its
    identity (a copy of one layer's experts is taken first and dropped when the layer is done):
    - another tensor registered in its place (the grouped GEMM's prepack on AVX-512 or AMX, or the padding of the
      intermediate size): the loadable parameter goes back, the kernel's own is kept aside for its calls;
    - the same parameter with the same values (`init_moe_torch`, the per-expert torch loop of CPUs whose vLLM build
      has no prepack op, AVX2 among them: its linears read views of the parameter): it is left as it is, the kernel
      reads the loadable parameter itself;
    - the same parameter with other values (a repack in place, as vLLM's SGL kernel does): the packed values move to
      a parameter of their own and the loadable ones come back from the copy.
    Whatever vLLM wrote into the loadable storage is undone, so the next sync loads into the checkpoint's layout."""
    names = [name for name in _EXPERT_PARAMETERS if name in layer._parameters]
    loadable = {name: layer._parameters[name] for name in names}
    storage = {name: parameter.data for name, parameter in loadable.items()}
    values = {name: parameter.data.clone() for name, parameter in loadable.items()}
    original(method, layer)
    _say_which_kernel(method)
    packed = {}
    for name in names:
        now = layer._parameters.get(name)
        if now is loadable[name] and torch.equal(now.data, values[name]):
            packed[name] = now  # kept as it was: the kernel computes from the loadable parameter
            continue
        if now is loadable[name]:  # repacked in place: the packed values move to a parameter of their own
            now = torch.nn.Parameter(now.data, requires_grad=False)
            storage[name] = values[name]
        elif not torch.equal(storage[name], values[name]):  # replaced, after writing into the old storage too
            storage[name].copy_(values[name])
        if now is not None:
            packed[name] = now
        loadable[name].data = storage[name]
        layer._parameters[name] = loadable[name]
    layer._dppo_packed = packed


def _say_which_kernel(method: Any) -> None:
    """Once per process: the MoE kernel vLLM-CPU chose on this CPU, and the CPU's branch (verl_dppo.rehearsal.isa)."""
    from verl_dppo.rehearsal.isa import describe
    from verl_dppo.plugin.log_once import warn_once

    kernel = getattr(getattr(method, "cpu_fused_moe", None), "isa", None)
    if kernel is not None:
        warn_once("vllm_cpu_moe_kernel", "verl-dppo: vLLM-CPU's MoE layers run kernel %r here. %s", kernel, describe())


def patch_check_grouped_gemm(cpu_fused_moe: Any) -> None:
    """vllm.model_executor.layers.fused_moe.cpu_fused_moe.CPUFusedMOE.check_grouped_gemm, on the CPU platform only.

    On a CPU with AMX, vLLM 0.27.1 takes its AMX grouped GEMM for bf16 experts of aligned sizes and refuses every
    other layer ("refuses to silently fall back to the much slower per-expert torch loop on AMX-capable CPUs"),
    float32 experts among them, which the CPU rehearsal's exact checks use. Such a layer gets the decision vLLM makes
    on an AVX-512 CPU without AMX (its vector grouped GEMM where the sizes allow, else the torch loop): the same
    kernels every AVX-512 machine runs. bf16 layers that AMX takes are left to it."""

    def make(original):
        def check_grouped_gemm(self, layer):
            try:
                return original(self, layer)
            except RuntimeError:
                if not _on_cpu() or not torch.cpu._is_amx_tile_supported():
                    raise
            with _amx_reported_absent():
                return original(self, layer)

        return check_grouped_gemm

    patch_once(cpu_fused_moe.CPUFusedMOE, "check_grouped_gemm", make)


@contextlib.contextmanager
def _amx_reported_absent():
    """`torch.cpu._is_amx_tile_supported()` answers False for the block (vLLM reads it at each decision)."""
    real = torch.cpu._is_amx_tile_supported
    torch.cpu._is_amx_tile_supported = lambda: False
    try:
        yield
    finally:
        torch.cpu._is_amx_tile_supported = real


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
