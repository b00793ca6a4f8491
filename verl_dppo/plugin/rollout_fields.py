"""Where a rollout server puts mu's top-K rows, and where it reads K: one definition for every server.

K comes from one setting, `actor_rollout_ref.actor.policy_loss.topk`; on the driver the plugin copies it into
`actor_rollout_ref.rollout.custom.dppo_topk` (patches/llm_server.sync_rollout_config) before any server is built,
and the servers read it from their rollout config. A server's `TokenOutput.extra_fields` then carries two numpy
arrays, one row per generated token, by rank: `dppo_topk_ids` [T, K] int64 and `dppo_topk_logprobs` [T, K] float32.
The vLLM and SGLang patches (patches/_server_common) and the plugin's own `hf` rollout use these names.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["CUSTOM_KEY", "EXTRA_IDS", "EXTRA_LOGPROBS", "rollout_topk"]

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
