"""Batch plumbing of Top-K DPPO: from the servers' `TokenOutput.extra_fields` to training-batch tensors.

verl 0.9.1's agent loops pass `extra_fields` through untouched (single turn: never truncated to the response
length; tool loop: only the first turn's are kept), so the top-K rows are not carried in `extra_fields` at all:

1. `LLMServerClient.generate` (every server call an agent loop makes, every turn, every resumed partial
   rollout) pops the rows out of `extra_fields` and appends (generated token ids, top-K ids, top-K log-probs) to
   the trajectory's list (a context variable set by the `AgentLoopWorker._run_agent_loop` patch; each trajectory
   runs in its own asyncio task).
2. `AgentLoopOutput.as_dict` (v1 trainer, the TransferQueue path) lays the concatenated rows onto the response:
   row j goes to the j-th position with response_mask = 1 (generated tokens, in order; tool tokens get zero rows,
   masked by response_mask), truncated to the response length. The generated token ids must equal the response
   tokens at those positions, else it raises: never a silently shifted top-K.
   It adds `rollout_topk_ids` [response_len, K] int64 and `rollout_topk_logprobs` [response_len, K] float32.
3. `construct_minimal_padding_template` (v1 batch padding) resizes the two fields of a synthetic padding sample to
   its one-token response (zeros; its response_mask is 0, so the hook never reads them).

`sync_rollout_config` (patched into `LLMServerManager.__init__`, on the driver) hands K to the servers.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any, Optional

import numpy as np
import torch

from verl_dppo.adapter.topk_actor import TOPK_IDS, TOPK_LOGPROBS, is_topk_mode
from verl_dppo.adapter.topk_import_hook import patch_once
from verl_dppo.adapter.topk_rollout import CUSTOM_KEY, EXTRA_IDS, EXTRA_LOGPROBS, RolloutTopKError

__all__ = [
    "sync_rollout_config",
    "record_turn",
    "trajectory",
    "align_topk_to_response",
    "patch_llm_server",
    "patch_agent_loop",
    "patch_padding_utils",
]

logger = logging.getLogger("verl_dppo")

VLLM_DEFAULT_MAX_LOGPROBS = 20

_TURNS: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("verl_dppo_topk_turns", default=None)


def sync_rollout_config(config: Any) -> Optional[int]:
    """Driver side: copy K = actor.policy_loss.topk into rollout.custom.dppo_topk and check the rollout settings.

    Returns K, or None when the loss mode is not a Top-K mode (then nothing is touched).
    """
    from omegaconf import open_dict

    arr = config.actor_rollout_ref
    policy_loss = arr.actor.get("policy_loss", None)
    mode = policy_loss.get("loss_mode", None) if policy_loss is not None else None
    if not is_topk_mode(mode):
        return None
    k = policy_loss.get("topk", None)
    if k is None:
        raise ValueError(
            f"{mode} needs policy_loss.topk: set actor_rollout_ref.actor.policy_loss._target_=verl_dppo.DPPOLossConfig "
            "(topk defaults to 20; +actor_rollout_ref.actor.policy_loss.topk=K to change it)"
        )
    k = int(k)
    rollout = arr.rollout
    if rollout.name not in ("vllm", "sglang"):
        raise ValueError(f"{mode} captures the top-K in vLLM or SGLang: set actor_rollout_ref.rollout.name=vllm or sglang")
    if not rollout.get("calculate_log_probs", False):
        raise ValueError(f"{mode} needs the rollout's log-probs: set actor_rollout_ref.rollout.calculate_log_probs=True")
    if not config.get("trainer", {}).get("use_v1", True):
        raise ValueError(f"{mode} carries the top-K through verl's v1 trainer only: set trainer.use_v1=True")
    if arr.model.get("use_fused_kernels", False):
        raise ValueError(f"{mode} needs the actor's logits: set actor_rollout_ref.model.use_fused_kernels=False")
    logprobs_mode = rollout.get("logprobs_mode", "processed_logprobs")
    if logprobs_mode is not None and "logprobs" not in str(logprobs_mode):
        raise ValueError(
            f"{mode} needs log-probs from the rollout, got rollout.logprobs_mode={logprobs_mode}: set "
            "actor_rollout_ref.rollout.logprobs_mode=processed_logprobs"
        )
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
            elif int(current) < k:
                raise ValueError(
                    f"actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs={current} < policy_loss.topk={k}: "
                    f"raise it to at least {k} (or leave it unset: the plugin sets it)"
                )
    return k


# ------------------------------------------------------------------------------------------ per-trajectory rows


class trajectory:  # noqa: N801 (a context manager, used like a function)
    """`with trajectory(): ...` collects the top-K rows of every server call made inside (one agent-loop run)."""

    def __enter__(self):
        self._token = _TURNS.set([])
        return _TURNS.get()

    def __exit__(self, *exc):
        _TURNS.reset(self._token)


def record_turn(token_output: Any) -> None:
    """Move a server reply's top-K rows out of extra_fields into the current trajectory (if one is open)."""
    extra = getattr(token_output, "extra_fields", None)
    if not extra or EXTRA_IDS not in extra:
        return
    turns = _TURNS.get()
    if turns is None:
        return  # not inside an agent loop: leave the reply as the server sent it
    ids, logprobs = extra.pop(EXTRA_IDS), extra.pop(EXTRA_LOGPROBS)
    token_ids = np.asarray(list(token_output.token_ids), dtype=np.int64)
    if ids.shape[0] != token_ids.shape[0]:
        raise RolloutTopKError(f"{ids.shape[0]} top-K rows for {token_ids.shape[0]} generated tokens")
    turns.append((token_ids, np.asarray(ids), np.asarray(logprobs)))


def align_topk_to_response(response_ids, response_mask, turns: list) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Top-K rows laid onto the response: the j-th generated token's row at the j-th position with mask 1."""
    if not turns:
        return None
    generated = np.concatenate([t[0] for t in turns])
    ids = np.concatenate([t[1] for t in turns])
    logprobs = np.concatenate([t[2] for t in turns])
    response_ids = np.asarray(response_ids, dtype=np.int64)
    positions = np.nonzero(np.asarray(response_mask))[0]
    if positions.size > generated.size or not np.array_equal(response_ids[positions], generated[: positions.size]):
        raise RolloutTopKError(
            "the response's generated tokens are not the tokens the rollout engine returned (re-tokenised by the "
            "agent loop?): the top-K rows cannot be aligned with `responses`; Top-K DPPO needs token-in-token-out "
            "agent loops"
        )
    k = ids.shape[1]
    out_ids = torch.zeros((response_ids.size, k), dtype=torch.int64)
    out_lps = torch.zeros((response_ids.size, k), dtype=torch.float32)
    out_ids[torch.from_numpy(positions)] = torch.from_numpy(ids[: positions.size])
    out_lps[torch.from_numpy(positions)] = torch.from_numpy(logprobs[: positions.size]).float()
    return out_ids, out_lps


# ----------------------------------------------------------------------------------------------------- patches


def patch_llm_server(module: Any) -> None:
    def make_init(original_init):
        def __init__(self, config, *args, **kwargs):
            sync_rollout_config(config)
            original_init(self, config, *args, **kwargs)

        return __init__

    def make_generate(original_generate):
        async def generate(self, *args, **kwargs):
            output = await original_generate(self, *args, **kwargs)
            record_turn(output)
            return output

        return generate

    patch_once(module.LLMServerManager, "__init__", make_init)
    patch_once(module.LLMServerClient, "generate", make_generate)


def patch_agent_loop(module: Any) -> None:
    def make_run(original_run):
        async def _run_agent_loop(self, *args, **kwargs):
            with trajectory():
                return await original_run(self, *args, **kwargs)

        return _run_agent_loop

    def make_as_dict(original_as_dict):
        def as_dict(self):
            output = original_as_dict(self)
            aligned = align_topk_to_response(self.response_ids, self.response_mask, _TURNS.get() or [])
            if aligned is not None:
                output[TOPK_IDS], output[TOPK_LOGPROBS] = aligned
            return output

        return as_dict

    patch_once(module.AgentLoopWorker, "_run_agent_loop", make_run)
    patch_once(module.AgentLoopOutput, "as_dict", make_as_dict)


def patch_padding_utils(module: Any) -> None:
    def make(original):
        def construct_minimal_padding_template(source_td, source_tag, eos_token_id):
            template_sample, template_tag = original(source_td, source_tag, eos_token_id)
            length = template_sample["responses"].shape[0]
            for key in (TOPK_IDS, TOPK_LOGPROBS):
                value = template_sample.get(key, None)
                if isinstance(value, torch.Tensor):
                    template_sample[key] = value.new_zeros((length, *value.shape[1:]))
            return template_sample, template_tag

        return construct_minimal_padding_template

    patch_once(module, "construct_minimal_padding_template", make)
