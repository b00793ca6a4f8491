"""`verl_dppo.patches`: runtime patches of verl 0.9.1 where it offers no extension point; installed at plugin load.

One module per verl module patched. Each module's docstring says which verl method it wraps, why verl 0.9.1 offers no
extension point for it, and what change in verl would make the patch unnecessary, so the patches can be proposed
upstream one by one. A patch is applied when its verl module is first imported in a process (`_import_hook`), so
nothing heavy (vLLM, SGLang, the engines) is imported by the plugin itself. Every patch is a pass-through for loss
modes that are not the plugin's; the Top-K ones act only for `dppo_topk_tv` / `dppo_topk_kl`.

| module here              | verl module                                          | patched                                            |
|--------------------------|------------------------------------------------------|----------------------------------------------------|
| `workers_utils_losses`   | workers.utils.losses                                 | `ppo_loss`: hand mu to the loss, route the logits hook |
| `engine_workers`         | workers.engine_workers                               | `TrainingWorker.train_batch`: hook on, exact metrics; `infer_batch`: the worker's loss known to no-grad steps |
| `fsdp_logits_hook`       | workers.engine.fsdp.transformer_impl (called by)     | the logits hook's Top-K statistics, whole vocabulary |
| `megatron_logits_hook`   | workers.engine.megatron (called by)                  | the same, vocabulary-parallel                      |
| `megatron_fused_head`    | workers.engine.megatron.transformer_impl, models.mcore.model_forward_fused | `MegatronEngineWithLMHead.forward_step`, the module's `linear_cross_entropy`: the binary modes' and baselines' log-probs and entropy from the plugin's vocabulary-parallel one-read pass (use_fused_kernels) |
| `fused_lm_head`          | utils.experimental.torch_functional, workers.engine.fsdp.transformer_impl | `FusedLinearForPPO.forward`, `FSDPEngineWithLMHead.forward_step` / `prepare_model_outputs`: the hook fused with the LM head (use_fused_kernels); without fused kernels, transformer_impl's `logprobs_from_logits` / `verl_F.entropy_from_logits`: the binary modes' log-probs and entropy in one read of the logits |
| `llm_server`             | workers.rollout.llm_server                           | `LLMServerManager.__init__`, `LLMServerClient.generate` |
| `vllm_async_server`      | workers.rollout.vllm_rollout.vllm_async_server       | `vLLMHttpServer.generate`: logprobs=K; `__init__`: the weight socket's job id per Ray cluster |
| `vllm_rollout`           | workers.rollout.vllm_rollout.vllm_rollout            | `ServerAdapter.__init__`: the weight socket named per Ray cluster (two local clusters on a host) |
| `sglang_async_server`    | workers.rollout.sglang_rollout.async_sglang_server   | `SGLangHttpServer.generate`: top_logprobs_num=K    |
| `agent_loop`             | experimental.agent_loop.agent_loop                   | `AgentLoopWorker._run_agent_loop`, `AgentLoopOutput.as_dict`, `ContinuousTokenBuilder.align_response_metadata` |
| `padding_utils`          | trainer.ppo.padding_utils                            | `construct_minimal_padding_template`               |
| `main_ppo`               | trainer.main_ppo                                     | `pprint` of the config: a line naming its file (`verl-dppo run` only) |
| `trainer_separate_async` | trainer.ppo.v1.trainer_separate_async                | its `logger`: `hybrid_engine=False` no longer dies on `logger.info(..., flush=True)` |
| `fsdp_router_replay`     | workers.engine.fsdp.transformer_impl, transformers' MoE routers | `FSDPEngineWithLMHead.prepare_model_inputs`, the routers' `forward`: R3 on the FSDP engine |
| `megatron_router_replay` | workers.engine.megatron.transformer_impl, utils.megatron.router_replay_patch | `set_router_replay_data`, `RouterReplay.get_replay_topk`: R3's replay counted for the loss's metrics |
| `file_logger`            | utils.tracking                                       | `FileLogger`: a resumed run keeps its earlier steps |

The last one is installed by `verl_dppo.plugin.entry.register_backends`. The CPU-only patches (gloo, Ray's
resources, vLLM-CPU) live with the CPU rehearsal, `verl_dppo.rehearsal.patches`, installed by its own entry point.

Installed from the `patches/` folder at the top of the repository as `verl_dppo.patches` (setup.py's package_dir).
"""

from __future__ import annotations

__all__ = ["install"]


def install() -> None:
    from verl_dppo.patches import (
        agent_loop,
        engine_workers,
        fsdp_router_replay,
        fused_lm_head,
        llm_server,
        main_ppo,
        megatron_fused_head,
        megatron_router_replay,
        padding_utils,
        sglang_async_server,
        trainer_separate_async,
        vllm_async_server,
        vllm_rollout,
        workers_utils_losses,
    )
    from verl_dppo.patches._import_hook import when_imported

    when_imported("verl.workers.utils.losses", lambda _module: workers_utils_losses.install())
    when_imported("verl.workers.engine_workers", engine_workers.patch_engine_workers)
    when_imported("verl.utils.experimental.torch_functional", fused_lm_head.patch_torch_functional)
    when_imported("verl.workers.engine.fsdp.transformer_impl", fused_lm_head.patch_fsdp_engine)
    when_imported("verl.workers.engine.megatron.transformer_impl", megatron_fused_head.patch_megatron_engine)
    when_imported("verl.models.mcore.model_forward_fused", megatron_fused_head.patch_model_forward_fused)
    fsdp_router_replay.install()
    megatron_router_replay.install()
    when_imported("verl.workers.rollout.llm_server", llm_server.patch_llm_server)
    when_imported("verl.experimental.agent_loop.agent_loop", agent_loop.patch_agent_loop)
    when_imported("verl.trainer.ppo.padding_utils", padding_utils.patch_padding_utils)
    when_imported("verl.trainer.main_ppo", main_ppo.patch_main_ppo)
    when_imported("verl.trainer.ppo.v1.trainer_separate_async", trainer_separate_async.patch_separate_async_logger)
    when_imported("verl.workers.rollout.vllm_rollout.vllm_async_server", vllm_async_server.patch_vllm_server)
    when_imported("verl.workers.rollout.vllm_rollout.vllm_async_server", vllm_rollout.patch_server_job_id)
    when_imported("verl.workers.rollout.vllm_rollout.vllm_rollout", vllm_rollout.patch_server_adapter)
    when_imported("verl.workers.rollout.sglang_rollout.async_sglang_server", sglang_async_server.patch_sglang_server)
