"""Patch of `verl.workers.rollout.llm_server`: `LLMServerManager.__init__` (driver) and `LLMServerClient.generate`.

Which verl methods: `LLMServerManager.__init__(config, ...)` builds the rollout servers from the run's config on the
driver; `LLMServerClient.generate` is every server call an agent loop makes (every turn, every resumed partial
rollout).
What the wrappers do: `__init__` runs the run-level checks of the DPPO modes (`verl_dppo.plugin.run_config`: the
anchor against bypass mode, how the rollout computes mu) and, for the Top-K modes, copies K =
`policy_loss.topk` (or the mode's default) into `rollout.custom.dppo_topk` (troll too: it reads the same top-K) (raising vLLM's `max_logprobs` when K > 20) before any server is
built; `generate` moves each reply's top-K rows out of `extra_fields` into the current trajectory
(`agent_loop.record_turn`) and, for the hf rollout, hands the server the sample's identity in the run
(`agent_loop.sample_identity`: dataset index, which of the prompt's n samples, validation or not) as
`verl_dppo_sample`: the hf rollout seeds the sample's draws from it.
Why no extension point: verl 0.9.1 has no driver-side hook that sees the whole config before the servers start,
and its agent loops do not carry per-token `extra_fields`.
What would make it unnecessary: a plugin hook on the validated run config, and per-token `extra_fields` kept by the
agent loop (see `agent_loop`).
"""

from __future__ import annotations

from typing import Any, Optional

from verl_dppo.patches._import_hook import patch_once
from verl_dppo.patches._server_common import CUSTOM_KEY
from verl_dppo.plugin.rollout_fields import HF_ROLLOUT, SAMPLE_KWARG, raw_logprobs_problem, truncated_sampling_problem
from verl_dppo.patches.agent_loop import current_sample, record_turn
from verl_dppo.plugin.topk_mode import configured_fused_kernels_problem, configured_topk, is_topk_mode

__all__ = ["sync_rollout_config", "patch_llm_server"]


VLLM_DEFAULT_MAX_LOGPROBS = 20
VLLM_NO_CAP = -1
"""vLLM's `max_logprobs=-1`: no cap (vllm config/model.py `max_logprobs`, sampling_params.py `_validate_logprobs`
reads it as the vocabulary size): any K passes."""

TOPK_ROLLOUTS = ("vllm", "sglang", "hf")
"""Rollout backends that report mu's top-K per generated token (vLLM, SGLang through the patches; hf natively)."""


def sync_rollout_config(config: Any) -> Optional[int]:
    """Driver side: copy K = actor.policy_loss.topk (unset: 20 for dppo_topk_*, 64 for troll) into
    rollout.custom.dppo_topk and check the rollout settings.

    Returns K, or None when the loss mode neither is a Top-K mode nor troll (then nothing is touched).
    """
    from omegaconf import open_dict

    arr = config.actor_rollout_ref
    policy_loss = arr.actor.get("policy_loss", None)
    mode = policy_loss.get("loss_mode", None) if policy_loss is not None else None
    if not is_topk_mode(mode):
        return None
    k = configured_topk(arr.actor)  # policy_loss.topk, or the mode's default (20 for dppo_topk_*, 64 for troll)
    rollout = arr.rollout
    if rollout.name not in TOPK_ROLLOUTS:
        raise ValueError(
            f"{mode} captures the top-K in vLLM, SGLang or the plugin's hf rollout: set "
            "actor_rollout_ref.rollout.name=vllm, sglang or hf"
        )
    if not rollout.get("calculate_log_probs", False):
        raise ValueError(
            f"{mode} needs the rollout's log-probs: set actor_rollout_ref.rollout.calculate_log_probs=True"
        )
    if not config.get("trainer", {}).get("use_v1", True):
        raise ValueError(f"{mode} carries the top-K through verl's v1 trainer only: set trainer.use_v1=True")
    fused_problem = configured_fused_kernels_problem(mode, arr)  # None: off, or fused with the LM head
    if fused_problem is not None:
        raise ValueError(fused_problem)
    logprobs_mode = rollout.get("logprobs_mode", "processed_logprobs")
    if logprobs_mode is not None and "logprobs" not in str(logprobs_mode):
        raise ValueError(
            f"{mode} needs log-probs from the rollout, got rollout.logprobs_mode={logprobs_mode}: set "
            "actor_rollout_ref.rollout.logprobs_mode=processed_logprobs"
        )
    for problem in (truncated_sampling_problem(mode, rollout), raw_logprobs_problem(mode, rollout)):
        if problem is not None:
            raise ValueError(problem)
    with open_dict(rollout):
        custom = dict(rollout.get("custom", None) or {})
        if custom.get(CUSTOM_KEY, k) != k:
            raise ValueError(
                f"actor_rollout_ref.rollout.custom.{CUSTOM_KEY}={custom[CUSTOM_KEY]} disagrees with "
                f"actor_rollout_ref.actor.policy_loss.topk={k}: set only policy_loss.topk (the plugin copies it)"
            )
        custom[CUSTOM_KEY] = k
        rollout.custom = custom
        if rollout.name == "vllm":
            if rollout.get("engine_kwargs", None) is None:
                rollout.engine_kwargs = {}
            if rollout.engine_kwargs.get("vllm", None) is None:
                rollout.engine_kwargs.vllm = {}
            current = rollout.engine_kwargs.vllm.get("max_logprobs", None)
            if current is None:
                if k > VLLM_DEFAULT_MAX_LOGPROBS:
                    rollout.engine_kwargs.vllm.max_logprobs = k
            elif int(current) != VLLM_NO_CAP and int(current) < k:
                raise ValueError(
                    f"actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs={current} < policy_loss.topk={k}: "
                    f"raise it to at least {k} (or leave it unset: the plugin sets it)"
                )
    return k


def patch_llm_server(module: Any) -> None:
    def make_init(original_init):
        def __init__(self, config, *args, **kwargs):
            from verl_dppo.plugin.run_config import check_run_config

            check_run_config(config)
            sync_rollout_config(config)
            original_init(self, config, *args, **kwargs)

        return __init__

    def make_generate(original_generate):
        async def generate(self, *args, **kwargs):
            if self.config.actor_rollout_ref.rollout.name == HF_ROLLOUT:
                # The hf rollout seeds a sample's draws from its identity in the run (dataset index, which of the
                # prompt's n samples, validation or not): distinct draws for a prompt's samples on any number of
                # replicas, the same draws after a resume. Outside an agent loop, verl's `priority` if given.
                sample = current_sample()
                if sample is None and kwargs.get("priority") is not None:
                    sample = int(kwargs["priority"])
                if sample is not None:
                    kwargs[SAMPLE_KWARG] = sample
            output = await original_generate(self, *args, **kwargs)
            record_turn(output)
            return output

        return generate

    patch_once(module.LLMServerManager, "__init__", make_init)
    patch_once(module.LLMServerClient, "generate", make_generate)
