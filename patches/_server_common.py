"""What the vLLM and SGLang server patches share: K's hand-over key, the `extra_fields` names, the per-request
capture of the engine's final output. Not a patch itself.

K comes from one setting, `actor_rollout_ref.actor.policy_loss.topk`. On the driver the `LLMServerManager.__init__`
patch (`llm_server.sync_rollout_config`) copies it into `actor_rollout_ref.rollout.custom.dppo_topk` before any
rollout server is built; the servers read it from their rollout config. The patched `generate` of each server puts
two numpy arrays in `TokenOutput.extra_fields`: `dppo_topk_ids` [T, K] int64 and `dppo_topk_logprobs` [T, K]
float32, one row per generated token, sorted by rank.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Optional

__all__ = ["CUSTOM_KEY", "EXTRA_IDS", "EXTRA_LOGPROBS", "RolloutTopKError", "rollout_topk", "warn_truncated_sampling",
           "capture_outputs_of", "generate_capturing", "REQUEST_K"]

# The names and K's hand-over are defined once, in the plugin (the hf rollout uses them too).
from verl_dppo.plugin.log_once import warn_once  # noqa: E402
from verl_dppo.plugin.rollout_fields import CUSTOM_KEY, EXTRA_IDS, EXTRA_LOGPROBS, rollout_topk  # noqa: E402


class RolloutTopKError(ValueError):
    """The rollout engine's log-probs do not hold a well-formed top-K per generated token."""


REQUEST_K: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("verl_dppo_request_k", default=None)


_CAPTURE: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("verl_dppo_capture", default=None)



def capture_outputs_of(engine: Any, name: str) -> None:
    """Make the engine's async-generator method `name` keep the current request's last output in _CAPTURE (an
    instance attribute: the engine object is created by the server, after the module is patched)."""
    original = getattr(engine, name)
    if getattr(original, "__verl_dppo_capture__", False):
        return

    @functools.wraps(original)
    async def capturing(*args, **kwargs):
        holder = _CAPTURE.get()
        async for output in original(*args, **kwargs):
            if holder is not None:
                holder["output"] = output
            yield output

    capturing.__verl_dppo_capture__ = True
    setattr(engine, name, capturing)


def warn_truncated_sampling(sampling_params: dict, logprobs_mode: Optional[str]) -> None:
    top_p = sampling_params.get("top_p", 1.0)
    top_k = sampling_params.get("top_k", -1)
    truncated = (top_p is not None and top_p < 1.0) or (top_k is not None and top_k > 0)
    if truncated and logprobs_mode == "processed_logprobs":
        warn_once(
            "truncated",
            "verl-dppo Top-K: top_p=%s / top_k=%s with rollout.logprobs_mode=processed_logprobs: the engine renormalises "
            "mu over the truncated support, so mu's top-K (and its 'other' mass) differ from the full policy the actor "
            "scores; use top_p=1.0, top_k=-1 for Top-K DPPO",
            top_p,
            top_k,
        )


async def generate_capturing(original_generate, k: int, *args, **kwargs):
    """Run a server's original `generate` with K requested and the engine's final output captured (per request:
    context variables follow the request's task). Returns (verl's TokenOutput, the engine's final output or None)."""
    holder: dict = {}
    k_token, capture_token = REQUEST_K.set(k), _CAPTURE.set(holder)
    try:
        result = await original_generate(*args, **kwargs)
    finally:
        REQUEST_K.reset(k_token)
        _CAPTURE.reset(capture_token)
    return result, holder.get("output")
