"""The rollout's per-token fields on the engine's packed token stream, shared by the logits hooks of both engines
(`fsdp_logits_hook`, `megatron_logits_hook`) and the fused LM-head pass (`fused_lm_head`).

The row at packed position p holds the statistics of the token that the logits (or hidden states) at p predict:
the engine's left shift. Prompt positions are masked out.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from verl_dppo.plugin.topk_mode import TOPK_IDS, TOPK_LOGPROBS

__all__ = ["packed_rollout_fields", "unusable_rows", "local_rollout_fields"]


def _jagged_values(data: Any, key: str) -> torch.Tensor:
    value = data[key]
    if not value.is_nested:
        raise ValueError(f"Top-K DPPO expects {key} as a jagged (nested) tensor, as verl's v1 trainer builds it")
    return value.values()


def _packed_layout(data: Any) -> tuple[torch.Tensor, int]:
    """Positions in the packed token stream whose logits predict each response token (the engine's left shift), and
    the packed length; the lengths and the checks read back to the host at once (the hook's one wait for them)."""
    input_ids = data["input_ids"]
    prompts, responses = data["prompts"], data["responses"]
    if not (input_ids.is_nested and prompts.is_nested and responses.is_nested):
        raise ValueError(
            "Top-K DPPO runs on verl's no-padding (v1) micro-batches: set trainer.use_v1=True "
            "(input_ids / prompts / responses must be jagged tensors)"
        )
    seq_offsets = input_ids.offsets()[:-1].long()
    prompt_lens = prompts.offsets().diff().long()
    response_lens = responses.offsets().diff().long()
    reads = [
        input_ids.offsets()[-1],
        (prompt_lens + response_lens).sum(),
        (prompt_lens == 0).sum(),
        response_lens.sum(),
    ]
    total_nnz, sequences_nnz, empty_prompts, response_tokens = torch.stack([r.long() for r in reads]).tolist()
    if seq_offsets.numel() and sequences_nnz != total_nnz:
        raise ValueError(f"packed length {total_nnz} != the prompts' and responses' {sequences_nnz} tokens")
    if empty_prompts:
        raise ValueError("Top-K DPPO needs a non-empty prompt in every sample (the first response token's logits)")
    row = torch.repeat_interleave(
        torch.arange(response_lens.numel(), device=response_lens.device), response_lens, output_size=response_tokens
    )
    first = responses.offsets()[:-1].long()
    t = torch.arange(row.numel(), device=row.device) - first[row]
    return seq_offsets[row] + prompt_lens[row] - 1 + t, total_nnz


def _slice_for_sequence_parallel(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor

    if get_ulysses_sequence_parallel_world_size() <= 1:
        return tensors
    # Same pad-then-slice rule the engine applies to input_ids (and distillation to its teacher tensors).
    return [slice_input_tensor(t.unsqueeze(0), dim=1).squeeze(0) for t in tensors]


def packed_rollout_fields(loss_mode: str, k: int, data: Any, device: torch.device):
    """The rollout's per-token fields laid out on the full packed token stream (prompt positions masked out): the
    row at position p holds the statistics of the token that the logits at p predict (the engine's left shift).

    Returns (topk_ids [nnz, K] long, topk_logprobs [nnz, K] float32, sampled_ids [nnz] long,
    sampled_logprobs [nnz] float32, mask [nnz] bool), nnz = the micro-batch's packed length."""
    topk_ids = _jagged_values(data, TOPK_IDS)
    topk_logprobs = _jagged_values(data, TOPK_LOGPROBS)
    if topk_ids.dim() != 2 or topk_ids.shape[1] != k:
        raise ValueError(
            f"{loss_mode}: the batch carries {topk_ids.shape[-1] if topk_ids.dim() == 2 else '?'} top-K log-probs per "
            f"token but policy_loss.topk={k}; the rollout and the loss must use the same K (set only "
            "actor_rollout_ref.actor.policy_loss.topk; the plugin passes it to the rollout)"
        )
    positions, global_nnz = _packed_layout(data)
    if topk_ids.shape[0] != positions.numel():
        raise ValueError(
            f"{loss_mode}: {topk_ids.shape[0]} rows of {TOPK_IDS} for {positions.numel()} response tokens; the "
            "top-K fields must be aligned with `responses` (one row per response token)"
        )
    positions = positions.to(device)
    full_ids = torch.zeros(global_nnz, k, dtype=torch.long, device=device)
    full_lp = torch.zeros(global_nnz, k, dtype=torch.float32, device=device)
    full_sampled = torch.zeros(global_nnz, dtype=torch.long, device=device)
    full_sampled_lp = torch.zeros(global_nnz, dtype=torch.float32, device=device)
    full_mask = torch.zeros(global_nnz, dtype=torch.bool, device=device)
    full_ids[positions] = topk_ids.to(device).long()
    full_lp[positions] = topk_logprobs.to(device).float()
    full_sampled[positions] = _jagged_values(data, "responses").to(device).long()
    full_sampled_lp[positions] = _jagged_values(data, "rollout_log_probs").to(device).float()
    full_mask[positions] = _jagged_values(data, "response_mask").to(device).bool()
    return full_ids, full_lp, full_sampled, full_sampled_lp, full_mask


def unusable_rows(topk_logprobs: torch.Tensor, sampled_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rows of `mask` whose rollout statistics give no divergence: log mu(a_t) NaN or +-inf (the loss drops such a
    token for every mode, docs/bad-input.md), or a top-K log-prob NaN or +inf (-inf is a probability of 0, valid).
    The hook leaves them out of the reduction and reports D = NaN there, so the loss drops them too."""
    bad = (
        ~torch.isfinite(sampled_logprobs)
        | torch.isnan(topk_logprobs).any(dim=-1)
        | (topk_logprobs == math.inf).any(dim=-1)
    )
    return bad & mask


def local_rollout_fields(loss_mode: str, k: int, data: Any, device: torch.device, rows: int):
    """`packed_rollout_fields` sliced like the engine's inputs under Ulysses sequence parallelism: this rank's
    `rows` positions of the packed stream (the FSDP engine's logits or hidden states)."""
    fields = _slice_for_sequence_parallel(list(packed_rollout_fields(loss_mode, k, data, device)))
    if fields[-1].shape[0] != rows:
        raise ValueError(
            f"{loss_mode}: {rows} logit rows for {fields[-1].shape[0]} packed tokens; static packing "
            "(actor_rollout_ref.actor.fsdp_config.pad_to_length) is not supported with Top-K: disable it"
        )
    return fields
