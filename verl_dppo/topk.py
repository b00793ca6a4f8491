"""Top-K divergences between the rollout policy mu and the current policy pi, paper Eq. (15) and (16).

Pure torch (no verl import). Public entry point: `verl_dppo.divergence.topk_divergence` (re-exported there).

Per response token t, with a_t the sampled token:

    A'_t   = TopK(mu(.|s_t), K)  U  {a_t}                  (the union: K or K + 1 tokens)
    mu', pi' = mu and pi reduced to A'_t U {other},  other = 1 - (mass kept on A'_t), floored at 0
    D_TV   = 1/2 * sum_{x in A'_t U {other}} |mu'(x) - pi'(x)|                                      (15)
    D_KL   = sum_{x in A'_t U {other}} mu'(x) log(mu'(x) / pi'(x))   = KL(mu' || pi')              (16)

Coarsening a distribution can only shrink an f-divergence (data processing), and {a_t, other} is a coarsening of
A'_t U {other}: Binary <= Top-K <= exact, for TV and KL alike.

Memory: pi is needed only on the K + 1 ids of each row plus its log-normaliser log Z = logsumexp(logits). Both are
computed in row chunks of a few MiB: a float32 [N, V] tensor (the 4.7 GB that a naive `log_softmax(logits.float())`
allocates at N = 8192, V = 151,936) never exists. The small [N, K + 1] arithmetic runs in float64.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from verl_dppo.divergence import log1mexp

__all__ = ["topk_divergence", "TopKInputError", "DEFAULT_CHUNK_BYTES", "MASS_TOLERANCE"]

DEFAULT_CHUNK_BYTES = 8 * 2**20
"""Float32 working set per chunk of rows (8 MiB = 13 rows of Qwen3's 151,936-token vocabulary)."""

MASS_TOLERANCE = 1e-3
"""mu's kept mass may exceed 1 by this much (rounding in the engine's log-softmax); more is an error."""

class TopKInputError(ValueError):
    """The rollout's top-K statistics are malformed (duplicates, ids outside the vocabulary, mass > 1)."""


def _check_inputs(logits, topk_ids, topk_logprobs, sampled_ids, sampled_logprobs, mask) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise TopKInputError(f"logits must be a float [N, V] tensor, got {tuple(logits.shape)} {logits.dtype}")
    n = logits.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n or topk_ids.shape[1] < 1:
        raise TopKInputError(f"rollout_topk_ids must be [N={n}, K>=1], got {tuple(topk_ids.shape)}")
    if tuple(topk_logprobs.shape) != tuple(topk_ids.shape):
        raise TopKInputError(
            f"rollout_topk_logprobs {tuple(topk_logprobs.shape)} must match rollout_topk_ids {tuple(topk_ids.shape)}"
        )
    for name, t in (("sampled_ids", sampled_ids), ("rollout_sampled_logprobs", sampled_logprobs)):
        if tuple(t.shape) != (n,):
            raise TopKInputError(f"{name} must be [N={n}], got {tuple(t.shape)}")
    if topk_ids.is_floating_point() or sampled_ids.is_floating_point():
        raise TopKInputError("token ids must be integer tensors")
    if not (topk_logprobs.is_floating_point() and sampled_logprobs.is_floating_point()):
        raise TopKInputError("log-probs must be float tensors")
    if mask is not None and tuple(mask.shape) != (n,):
        raise TopKInputError(f"mask must be [N={n}], got {tuple(mask.shape)}")


def _validate_rows(topk_ids: torch.Tensor, sampled_ids: torch.Tensor, vocab_size: int) -> None:
    bad_range = (topk_ids < 0) | (topk_ids >= vocab_size)
    if bool(bad_range.any()) or bool(((sampled_ids < 0) | (sampled_ids >= vocab_size)).any()):
        raise TopKInputError(
            f"top-K or sampled token ids outside the vocabulary [0, {vocab_size}): the rollout engine and the actor "
            "use different vocabularies (check actor_rollout_ref.model.path and the tokenizer)"
        )
    if topk_ids.shape[1] > 1:
        ordered = topk_ids.sort(dim=1).values
        duplicate_rows = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
        if bool(duplicate_rows.any()):
            raise TopKInputError(
                f"{int(duplicate_rows.sum())} rows of rollout_topk_ids repeat a token id: the rollout's top-K "
                "extraction is broken (each row must hold K distinct ids)"
            )


def _pi_logprobs_at(logits: torch.Tensor, rows: Optional[torch.Tensor], slot_ids: torch.Tensor, chunk_bytes: int):
    """log pi(slot_ids) = logits[slot_ids] - logsumexp(logits), row chunk by row chunk, in float32 at least."""
    n, vocab = (rows.numel() if rows is not None else logits.shape[0]), logits.shape[1]
    work_dtype = torch.promote_types(logits.dtype, torch.float32)
    out = torch.empty(slot_ids.shape, dtype=work_dtype, device=logits.device)
    step = max(1, chunk_bytes // (torch.finfo(work_dtype).bits // 8 * vocab))
    for start in range(0, n, step):
        end = min(start + step, n)
        block = logits[start:end] if rows is None else logits.index_select(0, rows[start:end])
        block32 = block.to(work_dtype)
        log_z = torch.logsumexp(block32, dim=-1, keepdim=True)
        out[start:end] = block32.gather(1, slot_ids[start:end]) - log_z
    return out


@torch.no_grad()
def topk_divergence(
    logits: torch.Tensor,
    rollout_topk_ids: torch.Tensor,
    rollout_topk_logprobs: torch.Tensor,
    sampled_ids: torch.Tensor,
    rollout_sampled_logprobs: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    mass_tolerance: float = MASS_TOLERANCE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K TV (Eq. 15) and KL(mu || pi) (Eq. 16) per row; two float32 [N] tensors (no gradient).

    Args:
        logits: [N, V] logits of the current policy pi (any float dtype, temperature already applied).
        rollout_topk_ids: [N, K] the rollout engine's K most likely token ids under mu (distinct per row).
        rollout_topk_logprobs: [N, K] log mu of those ids.
        sampled_ids: [N] the sampled token a_t (inside or outside the top-K).
        rollout_sampled_logprobs: [N] log mu(a_t). Where a_t is among the top-K, the top-K entry is used.
        mask: optional [N] bool; rows where it is False (prompt or padding positions) are neither read nor
            validated and get D = 0.
        chunk_bytes: float32 working set per row chunk; bounds the extra memory.
        mass_tolerance: mu's kept mass may exceed 1 by this much (rounding); the excess is clipped (other = 0).

    Raises:
        TopKInputError: ids outside [0, V), a row repeating an id, or mu's kept mass above 1 + mass_tolerance.
    """
    _check_inputs(logits, rollout_topk_ids, rollout_topk_logprobs, sampled_ids, rollout_sampled_logprobs, mask)
    n, vocab = logits.shape
    tv = torch.zeros(n, dtype=torch.float32, device=logits.device)
    kl = torch.zeros(n, dtype=torch.float32, device=logits.device)
    rows = None
    if mask is not None:
        rows = mask.nonzero().squeeze(1)
        if rows.numel() == n:
            rows = None
        elif rows.numel() == 0:
            return tv, kl
    pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
    topk_ids = pick(rollout_topk_ids).long()
    sampled = pick(sampled_ids).long()
    _validate_rows(topk_ids, sampled, vocab)

    # A'_t as K + 1 slots: the top-K, then a_t; the last slot is dropped where a_t is already in the top-K.
    slot_ids = torch.cat([topk_ids, sampled.unsqueeze(1)], dim=1)
    sampled_in_topk = (topk_ids == sampled.unsqueeze(1)).any(dim=1)
    drop = torch.zeros_like(slot_ids, dtype=torch.bool)
    drop[:, -1] = sampled_in_topk
    neg_inf = torch.tensor(-math.inf, dtype=torch.float64, device=logits.device)

    mu_lp = torch.cat([pick(rollout_topk_logprobs), pick(rollout_sampled_logprobs).unsqueeze(1)], dim=1).double()
    mu_lp = torch.where(drop, neg_inf, mu_lp)
    if bool(torch.isnan(mu_lp).any()) or bool((mu_lp == math.inf).any()):
        raise TopKInputError("the rollout's top-K log-probs contain NaN or +inf")
    pi_lp = _pi_logprobs_at(logits, rows, slot_ids, chunk_bytes).double()
    pi_lp = torch.where(drop, neg_inf, pi_lp)

    log_mass_mu = torch.logsumexp(mu_lp, dim=1)
    if bool((log_mass_mu > math.log1p(mass_tolerance)).any()):
        worst = float(log_mass_mu.max().exp())
        raise TopKInputError(
            f"the rollout's top-K probabilities sum to {worst:.4f} > 1: they are not log-probs of one distribution "
            "(actor_rollout_ref.rollout.logprobs_mode must be raw_logprobs or processed_logprobs, not *_logits)"
        )
    log_other_mu = log1mexp(log_mass_mu)  # other = 1 - kept mass, floored at 0 (clamp inside log1mexp)
    log_other_pi = log1mexp(torch.logsumexp(pi_lp, dim=1))

    mu_p, pi_p = mu_lp.exp(), pi_lp.exp()
    other_mu, other_pi = log_other_mu.exp(), log_other_pi.exp()
    tv_rows = 0.5 * ((mu_p - pi_p).abs().sum(dim=1) + (other_mu - other_pi).abs())
    # 0 log 0 = 0; a kept token with mu > 0 and pi = 0 gives +inf, the true value.
    kept_terms = torch.where(mu_p > 0, mu_p * (mu_lp - pi_lp), torch.zeros_like(mu_p)).sum(dim=1)
    other_term = torch.where(other_mu > 0, other_mu * (log_other_mu - log_other_pi), torch.zeros_like(other_mu))
    kl_rows = (kept_terms + other_term).clamp(min=0.0)

    if rows is None:
        tv.copy_(tv_rows)
        kl.copy_(kl_rows)
    else:
        tv.index_copy_(0, rows, tv_rows.float())
        kl.index_copy_(0, rows, kl_rows.float())
    return tv, kl
