"""The CPU rehearsal's entry point in verl's `verl.plugins` group (`dppo_cpu`, beside the plugin's `dppo`).

`import verl` loads it in every process, as it loads the plugin. It registers what exists only so that verl runs on
these CPUs: the CPU platform (`VERL_PLATFORM=cpu`), the `hf` rollout in verl's two rollout registries, the
`ray_store` checkpoint engine, Megatron's CPU shim, and the CPU-only patches of verl (`verl_dppo.rehearsal.patches`).
Each registry is filled when verl first imports it (nothing heavy now); off the CPU platform, and for engines a run
does not name, each hook is a pass-through. The plugin's own entry (`verl_dppo.plugin.entry`) never imports this
package: a cluster process that loads only the plugin (`VERL_USE_EXTERNAL_PLUGINS=dppo`) loads none of it.

verl logs an entry point's import error only at DEBUG: everything here reports at ERROR before re-raising.
"""

from __future__ import annotations

from verl_dppo.plugin.log_once import logger


def register() -> None:
    from verl_dppo.patches._import_hook import when_imported
    from verl_dppo.rehearsal.patches import vllm_cpu_moe
    from verl_dppo.rehearsal.patches.cpu_distributed import patch_distributed, patch_offload_policy
    from verl_dppo.rehearsal.patches.cpu_resources import patch_resource_check
    from verl_dppo.rehearsal.patches.vllm_cpu import (
        patch_accelerator_ids,
        patch_cpu_gemm_dispatch,
        quiet_torchvision_fallback,
    )

    # The CPU platform registers itself at the end of its import; when that import is what is importing verl (and
    # so this entry point) right now, the module is still partial here and finishes the registration itself.
    import verl_dppo.rehearsal.platform  # noqa: F401
    from verl_dppo.rehearsal import hf_rollout, megatron_shim, store_engine

    when_imported("verl.workers.rollout.replica", hf_rollout.register_replica)
    when_imported("verl.workers.rollout.base", hf_rollout.register_adapter)
    when_imported("verl.checkpoint_engine.base", store_engine.register)
    # megatron-core and mbridge on the CPU platform (each a pass-through elsewhere)
    when_imported("verl.workers.engine.megatron.transformer_impl", megatron_shim.install_on_engine)
    when_imported("verl.workers.config.engine", megatron_shim.allow_float32)
    when_imported("verl.utils.distributed", patch_distributed)
    when_imported("verl.workers.engine.fsdp.transformer_impl", patch_offload_policy)
    when_imported("verl.single_controller.ray.base", patch_resource_check)
    # vLLM's CPU build as the `vllm` rollout on the CPU platform (each patch a pass-through elsewhere)
    when_imported("ray.runtime_context", patch_accelerator_ids)
    when_imported("vllm.model_executor.layers.utils", patch_cpu_gemm_dispatch)
    when_imported("vllm", quiet_torchvision_fallback)
    # vLLM-CPU's MoE kernel: verl's weight sync into it, R3's routed experts out of it (rehearsal/patches/vllm_cpu_moe.py)
    when_imported("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method", vllm_cpu_moe.patch_method)
    when_imported("vllm.v1.worker.gpu_model_runner", vllm_cpu_moe.patch_bind_capturer)
    when_imported("vllm.model_executor.layers.fused_moe.cpu_fused_moe", vllm_cpu_moe.patch_cpu_select_experts)
    when_imported("vllm.model_executor.layers.fused_moe.cpu_fused_moe", vllm_cpu_moe.patch_check_grouped_gemm)


try:
    register()
except Exception:
    logger.exception(
        "verl-dppo's CPU rehearsal failed to load: the CPU platform, the hf rollout and the ray_store "
        "checkpoint engine are NOT registered in this process"
    )
    raise
