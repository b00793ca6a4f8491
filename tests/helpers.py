"""Builders of real verl objects for the tests: ActorConfig and micro-batches shaped like verl 0.9.1's."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from tensordict import TensorDict

import verl  # noqa: F401  (loads the plugin through the verl.plugins entry point)
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig, PolicyLossConfig

from verl_dppo import DPPOLossConfig


def actor_config(
    loss_mode: str,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    plain: bool = False,
    **dppo_fields,
) -> ActorConfig:
    """A real verl ActorConfig whose policy_loss is DPPOLossConfig (or verl's PolicyLossConfig with plain=True)."""
    policy_loss = PolicyLossConfig(loss_mode=loss_mode) if plain else DPPOLossConfig(loss_mode=loss_mode, **dppo_fields)
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=2,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        policy_loss=policy_loss,
    )


def _nested(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def v1_micro_batch(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_lens: Sequence[int],
    rollout_log_prob: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    prompt_lens: Optional[Sequence[int]] = None,
    nested_fields: bool = True,
):
    """(model_output, data) as verl 0.9.1's FSDP engine hands them to `ppo_loss` in the v1 (no-padding) path.

    `log_prob` etc. are [B, T] padded tensors; row i holds response_lens[i] real tokens. The model output is a
    nested [B, prompt+response] tensor whose log-prob for response token t sits at position prompt_len - 1 + t
    (the engine's left shift). With nested_fields, response_mask / old_log_probs / advantages / rollout_log_probs
    are jagged tensors, as they arrive from TransferQueue.
    """
    batch = log_prob.shape[0]
    prompt_lens = list(prompt_lens or [3 + (i % 2) for i in range(batch)])
    model_rows, entropy_rows = [], []
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        row = torch.zeros(p + r, dtype=log_prob.dtype)
        row[p - 1 : p - 1 + r] = log_prob[i, :r]
        model_rows.append(row)
        if entropy is not None:
            erow = torch.zeros(p + r, dtype=entropy.dtype)
            erow[p - 1 : p - 1 + r] = entropy[i, :r]
            entropy_rows.append(erow)
    values = torch.cat(model_rows).detach().requires_grad_(log_prob.requires_grad)
    offsets = torch.tensor([0] + [p + r for p, r in zip(prompt_lens, response_lens)]).cumsum(0)
    model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(values, offsets)}
    if entropy is not None:
        model_output["entropy"] = torch.nested.nested_tensor_from_jagged(torch.cat(entropy_rows), offsets)

    def field(t: torch.Tensor) -> torch.Tensor:
        if not nested_fields:
            return t
        return _nested([t[i, :r] for i, r in enumerate(response_lens)])

    response_mask = torch.zeros(log_prob.shape, dtype=torch.int64)
    for i, r in enumerate(response_lens):
        response_mask[i, :r] = 1
    fields = {
        "prompts": _nested([torch.full((p,), 7) for p in prompt_lens]),
        "responses": _nested([torch.full((r,), 9) for r in response_lens]),
        "response_mask": field(response_mask),
        "old_log_probs": field(old_log_prob),
        "advantages": field(advantages),
    }
    if rollout_log_prob is not None:
        fields["rollout_log_probs"] = field(rollout_log_prob)
    data = TensorDict(fields, batch_size=[batch])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    return model_output, data, values


def leaf(values, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)
