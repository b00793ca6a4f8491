"""How the `hf` rollout samples: the settings of verl's sampling-params dict it accepts, and one token per row.

Sampling follows vLLM with `logprobs_mode=processed_logprobs`: logits / temperature, then top-k, then top-p; the
token is drawn from that truncated distribution and its log-prob is taken from it (the distribution it was actually
sampled from). The draw is vLLM's exponential race (argmax of p_i / E_i, one E_i ~ Exp(1) per vocabulary entry): a
change of the logits in their last bits changes the token only where two scores tie, where the inverse CDF over
sorted probabilities moved a boundary whenever two near-equal logits swapped ranks. temperature 0 is greedy, with the log-prob of the untruncated log-softmax (as vLLM reports it).
The top-K row of a token (Top-K DPPO, TROLL) is the top-K of the temperature-scaled log-softmax before truncation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["HFRolloutError", "SamplingSettings", "parse_sampling_params", "sample_next"]


class HFRolloutError(ValueError):
    """A request the hf rollout cannot serve (the message names the setting to change)."""


_ACCEPTED = {
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "max_new_tokens",
    "logprobs",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "seed",
}


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    logprobs: bool = False
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: Optional[int] = None


def parse_sampling_params(params: dict[str, Any], default_max_tokens: int) -> SamplingSettings:
    """verl's sampling-params dict -> SamplingSettings; a setting the engine cannot honour raises HFRolloutError."""
    unknown = sorted(set(params) - _ACCEPTED)
    if unknown:
        raise HFRolloutError(
            f"the hf rollout does not support the sampling setting(s) {', '.join(f'{k}={params[k]!r}' for k in unknown)}"
            f": remove them or use actor_rollout_ref.rollout.name=vllm (it supports {', '.join(sorted(_ACCEPTED))})"
        )
    repetition_penalty = params.get("repetition_penalty", 1.0)
    if repetition_penalty not in (None, 1.0):
        raise HFRolloutError(
            f"the hf rollout does not support repetition_penalty={repetition_penalty}: set "
            "actor_rollout_ref.rollout.repetition_penalty=1.0 or use rollout.name=vllm"
        )
    temperature = float(params.get("temperature", 1.0) if params.get("temperature") is not None else 1.0)
    top_p = float(params.get("top_p", 1.0) if params.get("top_p") is not None else 1.0)
    top_k = int(params.get("top_k", -1) if params.get("top_k") is not None else -1)
    if temperature < 0:
        raise HFRolloutError(f"temperature={temperature} < 0: set actor_rollout_ref.rollout.temperature >= 0")
    if not 0.0 < top_p <= 1.0:
        raise HFRolloutError(f"top_p={top_p} outside (0, 1]: set actor_rollout_ref.rollout.top_p in (0, 1]")
    if top_k == 0 or top_k < -1:
        raise HFRolloutError(f"top_k={top_k}: set actor_rollout_ref.rollout.top_k to -1 (off) or a positive count")
    max_tokens = params.get("max_tokens", params.get("max_new_tokens", default_max_tokens))
    max_tokens = default_max_tokens if max_tokens is None else int(max_tokens)
    stop = params.get("stop_token_ids") or ()
    seed = params.get("seed")
    return SamplingSettings(
        temperature,
        top_p,
        top_k,
        max_tokens,
        bool(params.get("logprobs", False)),
        bool(params.get("ignore_eos", False)),
        tuple(int(t) for t in stop),
        None if seed is None else int(seed),
    )


def sample_next(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    noise: torch.Tensor,
    k: Optional[int],
):
    """One token per row of `logits` [B, V] (fp32), drawn with `noise` [B, V] (Exp(1) draws, one per vocabulary id:
    the token is the kept one with the largest p / noise, vLLM's sampler). Returns (tokens [B], log-probs [B] under
    the distribution sampled from, top-K ids [B, k] and log-probs [B, k] of the temperature-scaled log-softmax, or
    None).

    Truncation in sorted space, as vLLM does it: logits below the top_k-th largest dropped (vLLM's threshold rule:
    a tie with the top_k-th is kept), then the tail whose preceding cumulative probability already reaches top_p
    (the token that crosses top_p is kept; the top token always is).
    """
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    full_sorted = torch.log_softmax(sorted_logits, dim=-1)
    kth = sorted_logits.gather(1, (top_k.clamp(1, logits.shape[-1]) - 1)[:, None])
    drop = (top_k[:, None] > 0) & (sorted_logits < kth)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (probs.cumsum(-1) - probs) >= top_p[:, None]
    drop[:, 0] = False
    truncated = torch.log_softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Dropped ranks score -inf whatever their noise (a zero draw, clamped, cannot revive one).
    race = truncated - noise.gather(1, order).clamp_min(torch.finfo(noise.dtype).tiny).log()
    position = race.argmax(dim=-1, keepdim=True)
    position = torch.where(greedy[:, None], torch.zeros_like(position), position)
    sampled_logprob = torch.where(greedy[:, None], full_sorted.gather(1, position), truncated.gather(1, position))
    tokens = order.gather(1, position)[:, 0]
    topk = None if not k else (order[:, :k], full_sorted[:, :k])
    return tokens, sampled_logprob[:, 0], topk
