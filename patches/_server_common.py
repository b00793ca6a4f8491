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

__all__ = [
    "CUSTOM_KEY",
    "EXTRA_IDS",
    "EXTRA_LOGPROBS",
    "RolloutTopKError",
    "rollout_topk",
    "warn_truncated_sampling",
    "capture_outputs_of",
    "generate_capturing",
    "REQUEST_K",
]

# The names and K's hand-over are defined once, in the plugin (the hf rollout uses them too).
from verl_dppo.plugin.rollout_fields import (  # noqa: E402
    CUSTOM_KEY,
    EXTRA_IDS,
    EXTRA_LOGPROBS,
    rollout_topk,
    warn_truncated_sampling,
)


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
