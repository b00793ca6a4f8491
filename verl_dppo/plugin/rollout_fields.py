"""Where a rollout server puts mu's top-K rows, and where it reads K: one definition for every server.

K comes from one setting, `actor_rollout_ref.actor.policy_loss.topk`; on the driver the plugin copies it into
`actor_rollout_ref.rollout.custom.dppo_topk` (patches/llm_server.sync_rollout_config) before any server is built,
and the servers read it from their rollout config. A server's `TokenOutput.extra_fields` then carries two numpy
arrays, one row per generated token, by rank: `dppo_topk_ids` [T, K] int64 and `dppo_topk_logprobs` [T, K] float32.
The vLLM and SGLang patches (patches/_server_common) and the plugin's own `hf` rollout use these names.
"""

from __future__ import annotations

from typing import Any, Optional

from verl_dppo.plugin.log_once import warn_once

__all__ = ["CUSTOM_KEY", "EXTRA_IDS", "EXTRA_LOGPROBS", "rollout_topk", "warn_truncated_sampling"]

CUSTOM_KEY = "dppo_topk"
"""Key in actor_rollout_ref.rollout.custom that carries K to the servers (written by the driver-side patch)."""

EXTRA_IDS = "dppo_topk_ids"

EXTRA_LOGPROBS = "dppo_topk_logprobs"


def rollout_topk(rollout_config: Any) -> Optional[int]:
    """K requested by the run (written by the driver from policy_loss.topk), or None when Top-K is off."""
    custom = rollout_config.get("custom", None) if hasattr(rollout_config, "get") else getattr(rollout_config, "custom", None)
    if not custom:
        return None
    value = custom.get(CUSTOM_KEY, None)
    return int(value) if value is not None else None


def warn_truncated_sampling(sampling_params: dict, logprobs_mode: Optional[str]) -> None:
    """Once per process: truncated sampling with processed log-probs makes the sampled log-prob (and the engine's rows,
    where it reports them truncated) those of the truncated distribution, not of the policy the actor scores."""
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
