"""Top-K DPPO's statistics fused with the LM head: log pi at mu's top-K, at a_t and on the "other" atom, from the
hidden states and the LM head weight, the [T, V] logits never existing (verl's `use_fused_kernels`).

Pure torch (no verl import). Entry points: `fused_topk_logprobs` (log pi at the slots of A'_t, log pi(other) and the
entropy, with gradient to the hidden states and the weight) and `fused_topk_divergence` (Eq. 15/16 from them, as
`verl_dppo.math.topk.topk_divergence` computes it from the logits). `verl_dppo.math.fused_troll` serves TROLL from
the same autograd function.

The fused pass itself (the chunks, the slots a selector picks, the backward, the memory it holds) is
`verl_dppo.math.fused_slots`'s; this module is its Top-K selector and entry points.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from verl_dppo.math.kernels import (
    backend_for,
    logits_at,
    max_and_sum_exp_outside,
    max_sum_outside_and_entropy,
)
from verl_dppo.math.topk import (
    MASS_TOLERANCE,
    TopKInputError,
    _finite,
    _sum_exp_outside,
    check_topk_inputs,
    divergence_at_slots,
)
from verl_dppo.math.topk_inputs import _validate_rows

from verl_dppo.math.fused_slots import DEFAULT_CHUNK_TOKENS, ChunkSlots, Selector, fused_slot_logprobs

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "FusedTopK",
    "ChunkSlots",
    "fused_slot_logprobs",
    "fused_topk_logprobs",
    "fused_topk_divergence",
]


class FusedTopK(NamedTuple):
    """`fused_topk_logprobs`'s result. Rows outside the mask hold only log_p_sampled and entropy."""

    log_p_sampled: torch.Tensor  # [T] log pi(a_t), float32 (float64 for float64 inputs), with gradient
    log_p_topk: torch.Tensor  # [T, K] log pi at mu's top-K ids, float64, with gradient
    log_p_other: torch.Tensor  # [T] log pi(other): pi's mass outside A'_t, float64, with gradient
    entropy: Optional[torch.Tensor]  # [T] entropy of pi, float32 (float64 for float64 inputs), with gradient


def _topk_slots(sampled: torch.Tensor, topk_ids: torch.Tensor, rows: Optional[torch.Tensor]):
    """A'_t as K + 1 slots, the top-K then a_t (topk.py's layout): a_t's slot dropped where it is in the top-K; rows
    outside `rows` (a bool mask) hold a_t in every slot, all but the last dropped."""
    slot_ids = torch.cat([topk_ids, sampled[:, None]], dim=1)
    dropped = torch.zeros_like(slot_ids, dtype=torch.bool)
    dropped[:, -1] = (topk_ids == sampled[:, None]).any(dim=1)
    if rows is not None:
        outside = ~rows
        slot_ids = torch.where(outside[:, None], sampled[:, None], slot_ids)
        dropped = torch.where(outside[:, None], True, dropped)
        dropped[:, -1] &= rows
    return slot_ids, dropped


def _fixed_selector(slot_ids: torch.Tensor, dropped: torch.Tensor) -> Selector:
    def select(block, scratch, index, again=False):
        ids = slot_ids[index]
        if backend_for(block) == "triton":  # one read, in place
            row_max, sum_outside = max_and_sum_exp_outside(block, ids)
            return ChunkSlots(ids, dropped[index], _finite(row_max), sum_outside, logits_at(block, None, ids))
        row_max = _finite(block.amax(dim=-1))
        slot_logits = block.gather(1, ids)
        sum_outside = _sum_exp_outside(block, row_max, ids)  # topk.py's sum; overwrites block
        return ChunkSlots(ids, dropped[index], row_max, sum_outside, slot_logits)

    def with_entropy(block, index):
        """The kernels' path with the entropy asked for: (slots, entropy) from one read of the chunk."""
        ids = slot_ids[index]
        row_max, sum_outside, entropy = max_sum_outside_and_entropy(block, ids)
        return ChunkSlots(ids, dropped[index], _finite(row_max), sum_outside, logits_at(block, None, ids)), entropy

    select.with_entropy = with_entropy
    return select


def _fused_topk(hidden, weight, sampled_ids, topk_ids, temperature, mask, entropy, chunk_tokens):
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0] or tuple(sampled_ids.shape) != (hidden.shape[0],):
        raise TopKInputError(
            f"topk_ids [T={hidden.shape[0]}, K] and sampled_ids [T] expected, got {tuple(topk_ids.shape)}, "
            f"{tuple(sampled_ids.shape)}"
        )
    sampled, topk = sampled_ids.long(), topk_ids.long()
    rows = mask.bool() if mask is not None else None
    # every a_t (log pi(a_t) is read on every row), the top-K only in the mask
    _validate_rows(topk if rows is None else topk[rows], sampled, weight.shape[0])
    slot_ids, dropped = _topk_slots(sampled, topk, rows)
    log_pi, log_other, ent, _, _, _ = fused_slot_logprobs(
        hidden, weight, temperature, _fixed_selector(slot_ids, dropped), slot_ids.shape[1], entropy, chunk_tokens
    )
    out = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    return FusedTopK(log_pi[:, -1].to(out), log_pi[:, :-1], log_other, ent if entropy else None), log_pi


def fused_topk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    sampled_ids: torch.Tensor,
    topk_ids: torch.Tensor,
    temperature: float = 1.0,
    mask: Optional[torch.Tensor] = None,
    *,
    entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> FusedTopK:
    """log pi(a_t), log pi at mu's top-K ids and log pi(other) (the mass outside A'_t = TopK U {a_t}, summed from the
    complement), and the entropy when asked, from hidden [T, H] and the LM head weight [V, H]; logits =
    hidden @ weight^T / temperature. Exact gradients to hidden and weight (each chunk's logits recomputed).

    Rows outside `mask` (bool [T]; None: all) are not read for the top-K: their top-K ids are neither used nor
    validated, and only log_p_sampled and entropy are meaningful there.

    Raises:
        TopKInputError: ids outside [0, V), or a row in the mask repeating a top-K id.
    """
    return _fused_topk(hidden, weight, sampled_ids, topk_ids, temperature, mask, entropy, chunk_tokens)[0]


def fused_topk_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rollout_topk_ids: torch.Tensor,
    rollout_topk_logprobs: torch.Tensor,
    sampled_ids: torch.Tensor,
    rollout_sampled_logprobs: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    mass_tolerance: float = MASS_TOLERANCE,
) -> tuple[torch.Tensor, torch.Tensor, FusedTopK]:
    """`topk_divergence` (Eq. 15/16) without the logits: (TV [T], KL [T], the `fused_topk_logprobs` outputs).

    TV and KL are float32, detached, 0 outside `mask`, computed by `divergence_at_slots` from the fused statistics;
    the FusedTopK carries log pi(a_t) (on every row: verl's log_prob) and the entropy with their gradients.

    Raises:
        TopKInputError: as `topk_divergence`.
    """
    check_topk_inputs(hidden, rollout_topk_ids, rollout_topk_logprobs, sampled_ids, rollout_sampled_logprobs, mask)
    stats, log_pi = _fused_topk(hidden, weight, sampled_ids, rollout_topk_ids, temperature, mask, entropy, chunk_tokens)
    n = hidden.shape[0]
    tv = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    kl = torch.zeros_like(tv)
    rows = mask.bool().nonzero().squeeze(1) if mask is not None else torch.arange(n, device=hidden.device)
    if rows.numel() == 0:
        return tv, kl, stats
    with torch.no_grad():
        topk = rollout_topk_ids.long()[rows]
        sampled = sampled_ids.long()[rows]
        dropped = torch.zeros(rows.numel(), topk.shape[1] + 1, dtype=torch.bool, device=hidden.device)
        dropped[:, -1] = (topk == sampled[:, None]).any(dim=1)
        mu_lp = torch.cat([rollout_topk_logprobs[rows], rollout_sampled_logprobs[rows, None]], dim=1)
        tv_rows, kl_rows = divergence_at_slots(mu_lp, log_pi[rows], stats.log_p_other[rows], dropped, mass_tolerance)
    tv.index_copy_(0, rows, tv_rows.float())
    kl.index_copy_(0, rows, kl_rows.float())
    return tv, kl, stats
