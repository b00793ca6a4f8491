"""What the plugin's logits hook hands the loss inside verl's engine, computed for the demo's micro-batches: the
Top-K divergences (dppo_topk_*) and TROLL's terms, in the engine's no-padding layout under the model-output keys the
`ppo_loss` wrapper reads (`verl_dppo.studies.demo.rl` builds the micro-batches)."""

from __future__ import annotations

import torch

import verl_dppo.studies.demo.task as task

__all__ = ["to_no_padding", "topk_statistics", "troll_terms"]


def to_no_padding(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[n, seq_len] -> [total_nnz]: the engine's remove-padding layout that ppo_loss reads back per response."""
    return values[attention_mask.bool()]


def topk_statistics(logits, responses, response_mask, rollout_log_probs, topk_ids, topk_log_probs, attention_mask):
    """What the plugin's logits hook hands the loss inside verl's engine (adapter.topk_actor) for dppo_topk_*:
    per-token Top-K D_TV / D_KL (Eq. 15/16) of mu's top-k against the learner's logits, in the engine's
    no-padding layout, under the model-output keys the anchoring hook reads."""
    from verl_dppo.plugin.topk_mode import OUTPUT_KEYS
    from verl_dppo.math.topk import topk_divergence

    n, length = responses.shape
    cols = slice(task.PROMPT_LEN - 1, task.PROMPT_LEN - 1 + length)
    tv, kl = topk_divergence(
        logits[:, cols].reshape(n * length, -1),
        topk_ids.reshape(n * length, -1),
        topk_log_probs.reshape(n * length, -1),
        responses.reshape(-1),
        rollout_log_probs.reshape(-1),
        mask=response_mask.reshape(-1).bool(),
    )
    statistics = {}
    for name, value in (("tv", tv), ("kl", kl)):
        full = torch.zeros(n, attention_mask.shape[1])
        full[:, cols] = value.view(n, length)
        statistics[OUTPUT_KEYS[name]] = to_no_padding(full, attention_mask)
    return statistics


def troll_terms(config, logits, responses, response_mask, rollout_log_probs, topk_ids, topk_log_probs, attention_mask):
    """What the plugin's logits hook hands the loss inside verl's engine for troll: TROLL's per-token terms from the
    learner's logits (the hook's own `troll_outputs`), log p(a_t) and the regression KL WITH gradient, in the
    engine's no-padding layout under the model-output keys the `ppo_loss` wrapper reads."""
    from verl_dppo.plugin.troll_mode import troll_outputs

    n, length = responses.shape
    cols = slice(task.PROMPT_LEN - 1, task.PROMPT_LEN - 1 + length)
    outputs = troll_outputs(
        config,
        logits[:, cols].reshape(n * length, -1),
        topk_ids.reshape(n * length, -1),
        topk_log_probs.reshape(n * length, -1),
        responses.reshape(-1),
        rollout_log_probs.reshape(-1),
        response_mask.reshape(-1).bool(),
    )
    terms = {}
    for key, value in outputs.items():
        full = torch.zeros(n, attention_mask.shape[1], dtype=value.dtype)
        full[:, cols] = value.view(n, length)
        terms[key] = to_no_padding(full, attention_mask)
    return terms
