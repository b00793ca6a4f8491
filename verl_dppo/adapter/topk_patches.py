"""Runtime patches of verl 0.9.1 that carry Top-K DPPO from the rollout engine to the loss; installed at plugin load.

Each patch is applied when its verl module is first imported in a process (`topk_import_hook.when_imported`), so
nothing heavy (vLLM, SGLang, the engines) is imported by the plugin itself. Every patch is a no-op unless the run's
loss mode is `dppo_topk_tv` / `dppo_topk_kl`:

| verl module                                        | patched                          | why                                  |
|----------------------------------------------------|----------------------------------|--------------------------------------|
| workers.engine_workers                             | TrainingWorker.train_batch       | logits hook on; exact diagnostics    |
| workers.rollout.llm_server                         | LLMServerManager.__init__        | run-config checks; K to the rollout  |
| workers.rollout.llm_server                         | LLMServerClient.generate         | collect each turn's top-K            |
| workers.rollout.vllm_rollout.vllm_async_server     | vLLMHttpServer.generate          | logprobs=K, vectorised extraction    |
| workers.rollout.sglang_rollout.async_sglang_server | SGLangHttpServer.generate        | top_logprobs_num=K, extraction       |
| experimental.agent_loop.agent_loop                 | AgentLoopOutput.as_dict          | top-K tensors aligned with responses |
| experimental.agent_loop.agent_loop                 | ContinuousTokenBuilder.align_response_metadata | rows follow verl's edits |
| trainer.ppo.padding_utils                          | construct_minimal_padding_template | padding rows of the right length   |
"""

from __future__ import annotations

from verl_dppo.adapter.topk_import_hook import when_imported

__all__ = ["install"]


def install() -> None:
    from verl_dppo.adapter import topk_actor, topk_agent_loop, topk_rollout

    when_imported("verl.workers.engine_workers", topk_actor.patch_engine_workers)
    when_imported("verl.workers.rollout.llm_server", topk_agent_loop.patch_llm_server)
    when_imported("verl.experimental.agent_loop.agent_loop", topk_agent_loop.patch_agent_loop)
    when_imported("verl.trainer.ppo.padding_utils", topk_agent_loop.patch_padding_utils)
    when_imported("verl.workers.rollout.vllm_rollout.vllm_async_server", topk_rollout.patch_vllm_server)
    when_imported("verl.workers.rollout.sglang_rollout.async_sglang_server", topk_rollout.patch_sglang_server)
