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

__all__ = [
    "CUSTOM_KEY",
    "EXTRA_IDS",
    "EXTRA_LOGPROBS",
    "HF_ROLLOUT",
    "SAMPLE_KWARG",
    "raw_logprobs_problem",
    "rollout_topk",
    "truncated_sampling_problem",
    "warn_truncated_sampling",
]

CUSTOM_KEY = "dppo_topk"
"""Key in actor_rollout_ref.rollout.custom that carries K to the servers (written by the driver-side patch)."""

EXTRA_IDS = "dppo_topk_ids"

EXTRA_LOGPROBS = "dppo_topk_logprobs"

HF_ROLLOUT = "hf"
"""`actor_rollout_ref.rollout.name` of the plugin's own `hf` rollout (`verl_dppo.rehearsal.hf_rollout`)."""

SAMPLE_KWARG = "verl_dppo_sample"
"""The keyword the plugin's `LLMServerClient.generate` patch (patches/llm_server.py) adds to an `hf` server's
`generate`: the sample's identity in the run (verl's `priority`, which verl hands on to vLLM only, outside an agent
loop), from which the server seeds the sample's draws (`verl_dppo.rehearsal.hf_rollout.engine`). Defined here, below
both, so that the patch a cluster process loads never imports the CPU rehearsal."""


def rollout_topk(rollout_config: Any) -> Optional[int]:
    """K requested by the run (written by the driver from policy_loss.topk), or None when Top-K is off."""
    custom = (
        rollout_config.get("custom", None)
        if hasattr(rollout_config, "get")
        else getattr(rollout_config, "custom", None)
    )
    if not custom:
        return None
    value = custom.get(CUSTOM_KEY, None)
    return int(value) if value is not None else None


def _truncated(top_p: Any, top_k: Any) -> bool:
    return (top_p is not None and float(top_p) < 1.0) or (top_k is not None and int(top_k) > 0)


def truncated_sampling_problem(mode: str, rollout: Any) -> Optional[str]:
    """The rollout config (actor_rollout_ref.rollout) samples from a truncated distribution (top_p < 1 or top_k > 0)
    and reports processed log-probs (verl's default `logprobs_mode`): vLLM's processed log-probs, and so mu's top-K
    rows, are then of the truncated, renormalised distribution (vllm sampling after temperature and top-k/top-p),
    not of the policy the actor scores. A Top-K mode or troll cannot use them; None when the settings are fine.
    (Validation's `val_kwargs` are not trained on: a request-time warning covers them.)"""
    top_p, top_k = rollout.get("top_p", 1.0), rollout.get("top_k", -1)
    logprobs_mode = rollout.get("logprobs_mode", "processed_logprobs") or "processed_logprobs"
    if not _truncated(top_p, top_k) or logprobs_mode != "processed_logprobs":
        return None
    return (
        f"{mode} compares pi with mu's top-K rows, but the rollout samples with top_p={top_p}, top_k={top_k} and "
        "rollout.logprobs_mode=processed_logprobs: the engine's log-probs (the rows and the sampled token's) are "
        "then of the truncated, renormalised distribution, not of the policy the actor scores. Set "
        "actor_rollout_ref.rollout.top_p=1.0 and actor_rollout_ref.rollout.top_k=-1"
    )


def raw_logprobs_problem(mode: str, rollout: Any) -> Optional[str]:
    """vLLM's `raw_logprobs` are of the logits before temperature: at a rollout temperature other than 1 they (and
    mu's top-K rows) are not of the distribution the rollout sampled from. None when the settings are fine."""
    temperature = rollout.get("temperature", 1.0)
    if (
        rollout.get("logprobs_mode", None) != "raw_logprobs"
        or temperature is None
        or abs(float(temperature) - 1.0) < 1e-6
    ):
        return None
    return (
        f"{mode} compares pi with mu's top-K rows, but rollout.logprobs_mode=raw_logprobs reports log-probs before "
        f"temperature and the rollout samples at temperature={temperature}: set "
        "actor_rollout_ref.rollout.logprobs_mode=processed_logprobs (verl's default)"
    )


def warn_truncated_sampling(sampling_params: dict, logprobs_mode: Optional[str]) -> None:
    """Once per process: truncated sampling with processed log-probs makes the sampled log-prob (and the engine's rows,
    where it reports them truncated) those of the truncated distribution, not of the policy the actor scores."""
    top_p = sampling_params.get("top_p", 1.0)
    top_k = sampling_params.get("top_k", -1)
    if _truncated(top_p, top_k) and logprobs_mode == "processed_logprobs":
        warn_once(
            "truncated",
            "verl-dppo Top-K: top_p=%s / top_k=%s with rollout.logprobs_mode=processed_logprobs: the engine renormalises "
            "mu over the truncated support, so mu's top-K (and its 'other' mass) differ from the full policy the actor "
            "scores; use top_p=1.0, top_k=-1 for Top-K DPPO",
            top_p,
            top_k,
        )
