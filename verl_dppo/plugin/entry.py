"""Entry point of the `verl.plugins` group: `import verl` imports this module in every process.

verl logs a plugin's import error only at DEBUG, so a broken install would surface hours later as
"Unsupported loss mode" at the first actor update. Everything here reports at ERROR before re-raising.
"""

from __future__ import annotations

from verl_dppo.plugin.compat import check_verl_version
from verl_dppo.plugin.log_once import logger  # the plugin's logger, visible whatever the process did to the root's


def register_backends() -> None:
    """The `hf` rollout in verl's two rollout registries, the `ray_store` checkpoint engine, the CPU platform
    (`VERL_PLATFORM=cpu`) and its patches (vLLM's CPU build among them), the JSONL log kept across a resume; each registry is filled when verl
    first imports it (nothing heavy now)."""
    from verl_dppo.patches._import_hook import when_imported
    from verl_dppo.patches.cpu_distributed import patch_distributed, patch_offload_policy
    from verl_dppo.patches.cpu_resources import patch_resource_check
    from verl_dppo.patches.file_logger import patch_file_logger
    from verl_dppo.patches import vllm_cpu_moe
    from verl_dppo.patches.vllm_cpu import patch_accelerator_ids, patch_cpu_gemm_dispatch, quiet_torchvision_fallback
    # The CPU platform registers itself at the end of its import; when that import is what is importing verl (and
    # so this plugin) right now, the module is still partial here and finishes the registration itself.
    import verl_dppo.cpu.platform  # noqa: F401
    from verl_dppo.cpu import hf_rollout, megatron_shim, store_engine

    when_imported("verl.workers.rollout.replica", hf_rollout.register_replica)
    when_imported("verl.workers.rollout.base", hf_rollout.register_adapter)
    when_imported("verl.checkpoint_engine.base", store_engine.register)
    # megatron-core and mbridge on the CPU platform (each a pass-through elsewhere)
    when_imported("verl.workers.engine.megatron.transformer_impl", megatron_shim.install_on_engine)
    when_imported("verl.workers.config.engine", megatron_shim.allow_float32)
    when_imported("verl.utils.distributed", patch_distributed)
    when_imported("verl.workers.engine.fsdp.transformer_impl", patch_offload_policy)
    when_imported("verl.single_controller.ray.base", patch_resource_check)
    when_imported("verl.utils.tracking", patch_file_logger)
    # vLLM's CPU build as the `vllm` rollout on the CPU platform (each patch a pass-through elsewhere)
    when_imported("ray.runtime_context", patch_accelerator_ids)
    when_imported("vllm.model_executor.layers.utils", patch_cpu_gemm_dispatch)
    when_imported("vllm", quiet_torchvision_fallback)
    # vLLM-CPU's MoE kernel: verl's weight sync into it, R3's routed experts out of it (patches/vllm_cpu_moe.py)
    when_imported("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method", vllm_cpu_moe.patch_method)
    when_imported("vllm.v1.worker.gpu_model_runner", vllm_cpu_moe.patch_bind_capturer)
    when_imported("vllm.model_executor.layers.fused_moe.cpu_fused_moe", vllm_cpu_moe.patch_cpu_select_experts)
    when_imported("vllm.model_executor.layers.fused_moe.cpu_fused_moe", vllm_cpu_moe.patch_check_grouped_gemm)


def load() -> None:
    """Register the loss modes, the backends and install the patches (`verl_dppo.patches`).

    The loss modes go into verl's registry the moment verl imports it (`verl.trainer.ppo.core_algos`), not at
    `import verl`: nothing can look a mode up before that, and the processes of a run that never train (the rollout
    router, the reward workers, the rollout server) are spared importing verl's trainer modules (about 1.5 s each on
    a small CPU)."""
    check_verl_version()
    from verl_dppo.patches import install
    from verl_dppo.patches._import_hook import when_imported

    when_imported("verl.trainer.ppo.core_algos", _register_losses)
    install()
    register_backends()


def _register_losses(_core_algos) -> None:
    """A failure here fails verl's import of its registry, logged at ERROR by the import hook."""
    import verl_dppo.plugin.losses  # noqa: F401  (registers the modes at its import)


try:
    load()
except Exception:
    logger.exception("verl-dppo failed to load: its loss modes are NOT registered in this process")
    raise
