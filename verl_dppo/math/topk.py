"""Top-K divergences between the rollout policy mu and the current policy pi, paper Eq. (15) and (16).

Pure torch (no verl import). Public entry point: `topk_divergence`, imported from `verl_dppo.math.topk`.

Per response token t, with a_t the sampled token:

    A'_t   = TopK(mu(.|s_t), K)  U  {a_t}                  (the union: K or K + 1 tokens)
    mu', pi' = mu and pi reduced to A'_t U {other}, other = the mass outside A'_t
    D_TV   = 1/2 * sum_{x in A'_t U {other}} |mu'(x) - pi'(x)|                                      (15)
    D_KL   = sum_{x in A'_t U {other}} mu'(x) log(mu'(x) / pi'(x))   = KL(mu' || pi')              (16)

Coarsening a distribution can only shrink an f-divergence (data processing), and {a_t, other} is a coarsening of
A'_t U {other}: Binary <= Top-K <= exact, for TV and KL alike.

"other" is computed differently on the two sides. mu is known only through the engine's top-K, so mu'(other) =
1 - (mu's mass on A'_t), floored at 0 (log1mexp of a float64 logsumexp). pi'(other) is summed from the complement
itself: sum over the logits outside A'_t of exp(logit - max), divided by the same sum over the whole row. Taking it
as 1 - (pi's kept mass) instead cancels: on a row whose top-1 probability is 1 - 1e-7 the kept mass rounds to 1 in
float32, pi'(other) becomes 0 while mu'(other) is ~1e-7, and D_KL = +inf where the true value is ~0. pi'(other) is
floored at float32's smallest normal number (1.2e-38, as in `binary_kl`), so D_KL stays finite where the
complement's sum underflows.

Memory: pi is needed only on the K + 1 ids of each row plus two sums over the row (all of it, and all of it but
those ids). All are computed in row chunks of a few MiB: a float32 [N, V] tensor (the 4.7 GB that a naive
`log_softmax(logits.float())` allocates at N = 8192, V = 151,936) never exists. The small [N, K + 1] arithmetic
runs in float64.

Two entry points share everything but how pi is read (`divergence_at_slots` is the reduction): `topk_divergence`
for logits holding the whole vocabulary (FSDP), `vocab_parallel_topk_divergence` for one tensor-parallel rank's
vocabulary slice (Megatron): the row max all-reduced, then each rank's sum of exp over its slice minus the ids it
owns, and each id's logit from the one rank that owns it (the others add 0), summed in one all-reduce.

One wait for the device per call (issue 54.2): the input checks of every row (`topk_inputs.row_problems`,
`mu_problems`) and the mask's row count are read back together (`topk_inputs.raise_first`); the kept rows are then
picked by a sort of the mask, not `nonzero` (which would wait again).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from verl_dppo.math.divergence import LOG_FLOOR, log1mexp
from verl_dppo.math.topk_inputs import (
    MASS_TOLERANCE,
    TopKInputError,
    check_topk_inputs,
    mu_problems,
    raise_first,
    row_problems,
)
from verl_dppo.math.kernels import (
    CPU_CHUNK_BYTES,
    backend_for,
    chunk_bytes_for,
    logits_at,
    max_and_sum_exp_outside,
)

__all__ = [
    "topk_divergence",
    "vocab_parallel_topk_divergence",
    "divergence_at_slots",
    "TopKInputError",
    "check_topk_inputs",
    "DEFAULT_CHUNK_BYTES",
    "MASS_TOLERANCE",
]

DEFAULT_CHUNK_BYTES = CPU_CHUNK_BYTES
"""Float32 working set per chunk of rows on a CPU; on a GPU the chunk follows free memory (`chunk_bytes_for`)."""


def _rows_per_chunk(chunk_bytes: int, work_dtype: torch.dtype, vocab: int) -> int:
    return max(1, chunk_bytes // (torch.finfo(work_dtype).bits // 8 * vocab))


def _row_blocks(logits: torch.Tensor, rows: Optional[torch.Tensor], chunk_bytes: int, writable: bool = False):
    """(start, end, block in float32 at least) over the selected rows, a few MiB at a time; writable: the block is
    a copy (never a view of `logits`) that the caller may overwrite."""
    n = rows.numel() if rows is not None else logits.shape[0]
    work_dtype = torch.promote_types(logits.dtype, torch.float32)
    step = _rows_per_chunk(chunk_bytes, work_dtype, logits.shape[1])
    for start in range(0, n, step):
        end = min(start + step, n)
        block = logits[start:end] if rows is None else logits.index_select(0, rows[start:end])
        yield start, end, block.to(work_dtype, copy=writable and rows is None)


def _finite(row_max: torch.Tensor) -> torch.Tensor:
    # A row that is -inf everywhere has no finite max; shifting by 0 keeps exp() at 0 instead of NaN from -inf - -inf.
    return torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))


def _sum_exp_outside(
    block: torch.Tensor, row_max: torch.Tensor, slot_columns: torch.Tensor, owned: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """sum of exp(logit - row_max) over the columns of `block` that are not slot ids: pi's "other" mass, up to
    the normaliser, summed from the complement itself (subtracting the slots from the full sum would cancel on
    peaked rows). `owned` marks the slot columns inside this vocabulary slice (None: all of them). Overwrites
    `block` (in place: one chunk-sized buffer, not two)."""
    shifted = block.sub_(row_max[:, None]).exp_()
    if owned is None:
        shifted.scatter_(1, slot_columns, 0.0)  # a dropped slot repeats a top-K id: zeroing twice is harmless
    else:
        # Slots this rank does not own point at column 0: a product by 1 leaves it, by 0 clears it, in any order.
        shifted.scatter_reduce_(1, slot_columns, (~owned).to(shifted.dtype), reduce="prod")
    return shifted.sum(dim=-1)


def _pi_at_slots(
    row_max: torch.Tensor, sum_outside: torch.Tensor, slot_logits: torch.Tensor, dropped: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi at the slots and log pi(other), in float64, from the row max, the sum of exp(logit - max) outside
    A'_t and the logits at the slots: Z / e^max = (sum outside) + (sum over the slots), two non-negative terms."""
    at_slots = slot_logits.double() - row_max.double()[:, None]
    sum_outside = sum_outside.double()
    log_z = torch.log(sum_outside + torch.where(dropped, 0.0, at_slots.exp()).sum(dim=1))  # log Z - max
    return at_slots - log_z[:, None], sum_outside.log() - log_z


def _pi_logprobs_at(
    logits: torch.Tensor,
    rows: Optional[torch.Tensor],
    slot_ids: torch.Tensor,
    dropped: torch.Tensor,
    chunk_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(slot_ids), log pi(other)) in float64, from one pass over the logits row chunk by row chunk (one
    kernel on a GPU: `verl_dppo.math.kernels`)."""
    if backend_for(logits) == "triton":
        row_max, sum_outside = max_and_sum_exp_outside(logits, slot_ids, rows)
        return _pi_at_slots(_finite(row_max), sum_outside, logits_at(logits, rows, slot_ids), dropped)
    work_dtype = torch.promote_types(logits.dtype, torch.float32)
    row_max = torch.empty(slot_ids.shape[0], dtype=work_dtype, device=logits.device)
    sum_outside = torch.empty_like(row_max)
    slot_logits = torch.empty(slot_ids.shape, dtype=work_dtype, device=logits.device)
    for start, end, block in _row_blocks(logits, rows, chunk_bytes, writable=True):
        row_max[start:end] = _finite(block.amax(dim=-1))
        slot_logits[start:end] = block.gather(1, slot_ids[start:end])
        sum_outside[start:end] = _sum_exp_outside(block, row_max[start:end], slot_ids[start:end])
        del block  # freed before _row_blocks converts the next chunk: one chunk alive at a time, not two
    return _pi_at_slots(row_max, sum_outside, slot_logits, dropped)


def _vocab_parallel_pi_logprobs_at(
    shard: torch.Tensor,
    rows: Optional[torch.Tensor],
    slot_ids: torch.Tensor,
    dropped: torch.Tensor,
    chunk_bytes: int,
    vocab_start: int,
    group: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_pi_logprobs_at` from this rank's vocabulary slice [vocab_start, vocab_start + V_local): two all-reduces
    over `group` in all (the max, then the sum outside A'_t and the owned logits together), whatever the number
    of chunks."""
    import torch.distributed as dist

    n, local_vocab = slot_ids.shape[0], shard.shape[1]
    work_dtype = torch.promote_types(shard.dtype, torch.float32)
    kernel = backend_for(shard) == "triton" and local_vocab > 0
    row_max = torch.full((n,), -math.inf, dtype=work_dtype, device=shard.device)
    if kernel:  # one fused reduction over the whole slice (rows picked after: no [n, V_local] copy)
        row_max = shard.amax(dim=-1) if rows is None else shard.amax(dim=-1).index_select(0, rows)
        row_max = row_max.to(work_dtype)
    for start, end, block in _row_blocks(shard, rows, chunk_bytes) if local_vocab and not kernel else ():
        row_max[start:end] = block.amax(dim=-1)  # (a slice of padding only reads nothing)
        del block  # as in _pi_logprobs_at
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    row_max = _finite(row_max)

    local_ids = slot_ids - vocab_start
    owned = (local_ids >= 0) & (local_ids < local_vocab)
    if kernel:
        partial = torch.zeros(n, 1 + slot_ids.shape[1], dtype=work_dtype, device=shard.device)
        _, partial[:, 0] = max_and_sum_exp_outside(shard, torch.where(owned, local_ids, -1), rows, row_max)
        at_ids = logits_at(shard, rows, torch.where(owned, local_ids, 0))
        partial[:, 1:] = torch.where(owned, at_ids, torch.zeros_like(at_ids))
        dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
        return _pi_at_slots(row_max, partial[:, 0], partial[:, 1:], dropped)
    local_ids = torch.where(owned, local_ids, torch.zeros_like(local_ids))
    # Column 0: this rank's share of sum exp(logits - max) outside A'_t; columns 1..: the logits at the ids this
    # rank owns, else 0.
    partial = torch.zeros(n, 1 + slot_ids.shape[1], dtype=work_dtype, device=shard.device)
    for start, end, block in _row_blocks(shard, rows, chunk_bytes, writable=True) if local_vocab else ():
        at_ids = block.gather(1, local_ids[start:end])
        partial[start:end, 1:] = torch.where(owned[start:end], at_ids, torch.zeros_like(at_ids))
        partial[start:end, 0] = _sum_exp_outside(block, row_max[start:end], local_ids[start:end], owned[start:end])
        del block
    dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
    return _pi_at_slots(row_max, partial[:, 0], partial[:, 1:], dropped)


def divergence_at_slots(
    mu_logprobs: torch.Tensor,
    pi_logprobs: torch.Tensor,
    pi_log_other: torch.Tensor,
    dropped: torch.Tensor,
    mass_tolerance: float = MASS_TOLERANCE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (15)/(16) per row from log mu and log pi at the slots of A'_t ([N, S] each; `dropped` slots are not in
    A'_t; the last slot is a_t's, the others the top-K) and log pi(other) ([N], pi's mass outside A'_t, summed from
    the complement): the reduction to A'_t U {other} and its TV and KL(mu' || pi'), in float64. mu(other) = 1 -
    mu's kept mass, floored at 0.

    Raises:
        TopKInputError: mu's log-probs are NaN/+inf (the message names the top-K or a_t's), or its kept mass exceeds
            1 + mass_tolerance (both read in one wait).
    """
    mu_lp, log_mass_mu = _mu_at_slots(mu_logprobs, dropped)
    raise_first(mu_problems(mu_lp, log_mass_mu, mass_tolerance))
    return _divergence(mu_lp, log_mass_mu, pi_logprobs, pi_log_other, dropped)


def _mu_at_slots(mu_logprobs: torch.Tensor, dropped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log mu at the slots in float64, -inf at the dropped ones, and the log of mu's kept mass per row."""
    mu_lp = torch.where(dropped, -math.inf, mu_logprobs.double())  # a scalar: no tensor copied from the host
    return mu_lp, torch.logsumexp(mu_lp, dim=1)


def _divergence(
    mu_lp: torch.Tensor,
    log_mass_mu: torch.Tensor,
    pi_logprobs: torch.Tensor,
    pi_log_other: torch.Tensor,
    dropped: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`divergence_at_slots` on checked rows, from `_mu_at_slots`."""
    pi_lp = torch.where(dropped, -math.inf, pi_logprobs.double())
    log_other_mu = log1mexp(log_mass_mu)  # other = 1 - kept mass, floored at 0 (clamp inside log1mexp)
    # Floored like binary_kl's probabilities: where the complement's float32 sum underflows, KL stays finite.
    log_other_pi = pi_log_other.double().clamp(min=LOG_FLOOR, max=0.0)

    mu_p, pi_p = mu_lp.exp(), pi_lp.exp()
    other_mu, other_pi = log_other_mu.exp(), log_other_pi.exp()
    tv = 0.5 * ((mu_p - pi_p).abs().sum(dim=1) + (other_mu - other_pi).abs())
    # 0 log 0 = 0; a kept token with mu > 0 and pi = 0 gives +inf, the true value.
    kept_terms = torch.where(mu_p > 0, mu_p * (mu_lp - pi_lp), torch.zeros_like(mu_p)).sum(dim=1)
    other_term = torch.where(other_mu > 0, other_mu * (log_other_mu - log_other_pi), torch.zeros_like(other_mu))
    kl = (kept_terms + other_term).clamp(min=0.0)
    return tv, kl


PiReader = Callable[[Optional[torch.Tensor], torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(rows or None for all, slot ids [n, S], dropped [n, S]) -> (log pi at those ids [n, S], log pi(other) [n])."""


def _topk_divergence(
    logits: torch.Tensor,
    vocab_size: int,
    read_pi: PiReader,
    rollout_topk_ids: torch.Tensor,
    rollout_topk_logprobs: torch.Tensor,
    sampled_ids: torch.Tensor,
    rollout_sampled_logprobs: torch.Tensor,
    mask: Optional[torch.Tensor],
    mass_tolerance: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_topk_inputs(logits, rollout_topk_ids, rollout_topk_logprobs, sampled_ids, rollout_sampled_logprobs, mask)
    n = logits.shape[0]
    tv = torch.zeros(n, dtype=torch.float32, device=logits.device)
    kl = torch.zeros(n, dtype=torch.float32, device=logits.device)
    # A'_t as K + 1 slots: the top-K, then a_t; the last slot is dropped where a_t is already in the top-K.
    topk_ids, sampled = rollout_topk_ids.long(), sampled_ids.long()
    slot_ids = torch.cat([topk_ids, sampled.unsqueeze(1)], dim=1)
    dropped = torch.zeros_like(slot_ids, dtype=torch.bool)
    dropped[:, -1] = (topk_ids == sampled.unsqueeze(1)).any(dim=1)
    mu_lp = torch.cat([rollout_topk_logprobs, rollout_sampled_logprobs.unsqueeze(1)], dim=1)
    # Every row's checks at once, masked (rows outside the mask are not validated), and the kept rows' count: one
    # wait for the device per call, here (issue 54.2); nothing below reads back.
    mu_terms = _mu_at_slots(mu_lp, dropped)
    keep = None if mask is None else mask.bool()
    kept = raise_first(row_problems(topk_ids, sampled, vocab_size) + mu_problems(*mu_terms, mass_tolerance), keep)
    if kept == 0:
        return tv, kl
    rows = None
    if kept < n:  # the kept rows ascending, as nonzero gives them, from the count already read (nonzero would wait)
        rows = torch.argsort((~keep).to(torch.uint8), stable=True)[:kept]
        slot_ids, dropped, mu_lp = (t.index_select(0, rows) for t in (slot_ids, dropped, mu_lp))
        mu_terms = _mu_at_slots(mu_lp, dropped)
    pi_lp, pi_log_other = read_pi(rows, slot_ids, dropped)
    tv_rows, kl_rows = _divergence(*mu_terms, pi_lp, pi_log_other, dropped)

    if rows is None:
        tv.copy_(tv_rows)
        kl.copy_(kl_rows)
    else:
        tv.index_copy_(0, rows, tv_rows.float())
        kl.index_copy_(0, rows, kl_rows.float())
    return tv, kl


@torch.no_grad()
def topk_divergence(
    logits: torch.Tensor,
    rollout_topk_ids: torch.Tensor,
    rollout_topk_logprobs: torch.Tensor,
    sampled_ids: torch.Tensor,
    rollout_sampled_logprobs: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    chunk_bytes: Optional[int] = None,
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
        chunk_bytes: float32 working set per row chunk of the torch path; bounds the extra memory (None: by
            device, `chunk_bytes_for`). The Triton path (a GPU) reads rows in place, without chunks.
        mass_tolerance: mu's kept mass may exceed 1 by this much (rounding); the excess is clipped (other = 0).

    Raises:
        TopKInputError: ids outside [0, V), a row repeating an id, or mu's kept mass above 1 + mass_tolerance.
    """
    if logits.dim() != 2:
        raise TopKInputError(f"logits must be a float [N, V] tensor, got {tuple(logits.shape)} {logits.dtype}")
    chunk_bytes = chunk_bytes or chunk_bytes_for(logits.device)
    return _topk_divergence(
        logits,
        logits.shape[1],
        lambda rows, slot_ids, dropped: _pi_logprobs_at(logits, rows, slot_ids, dropped, chunk_bytes),
        rollout_topk_ids,
        rollout_topk_logprobs,
        sampled_ids,
        rollout_sampled_logprobs,
        mask,
        mass_tolerance,
    )


@torch.no_grad()
def vocab_parallel_topk_divergence(
    logits_shard: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group: Any,
    rollout_topk_ids: torch.Tensor,
    rollout_topk_logprobs: torch.Tensor,
    sampled_ids: torch.Tensor,
    rollout_sampled_logprobs: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    chunk_bytes: Optional[int] = None,
    mass_tolerance: float = MASS_TOLERANCE,
    valid_vocab: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_divergence` for vocabulary-parallel logits: every rank of `group` calls it with the same rows and
    its own slice of the vocabulary; all get the same two float32 [N] tensors (no gradient).

    Args:
        logits_shard: [N, V_local] this rank's logits, the global ids [vocab_start, vocab_start + V_local).
        vocab_start: first global token id of the slice.
        vocab_size: global (padded) vocabulary size, the bound the ids are checked against.
        group: the torch.distributed process group holding the slices (Megatron's tensor-parallel group).
        rollout_topk_ids: [N, K] the rollout engine's K most likely token ids under mu (distinct per row).
        rollout_topk_logprobs: [N, K] log mu of those ids.
        sampled_ids: [N] the sampled token a_t (inside or outside the top-K).
        rollout_sampled_logprobs: [N] log mu(a_t). Where a_t is among the top-K, the top-K entry is used.
        mask: optional [N] bool; rows where it is False (prompt or padding positions) are neither read nor
            validated and get D = 0.
        chunk_bytes: float32 working set per row chunk of the torch path; bounds the extra memory (None: by
            device, `chunk_bytes_for`). The Triton path (a GPU) reads rows in place, without chunks.
        mass_tolerance: mu's kept mass may exceed 1 by this much (rounding); the excess is clipped (other = 0).
        valid_vocab: the model's own vocabulary size when `vocab_size` is padded beyond it (Megatron pads the LM
            head to a multiple of its tensor-parallel size): the padded columns stay out of pi's normaliser (the
            rollout engine's distribution has none), and an id at or above it is refused.

    Raises:
        TopKInputError: ids outside [0, V), a row repeating an id, or mu's kept mass above 1 + mass_tolerance.
    """
    if logits_shard.dim() != 2:
        raise TopKInputError(f"logits_shard must be a float [N, V_local] tensor, got {tuple(logits_shard.shape)}")
    if not 0 <= vocab_start <= vocab_size - logits_shard.shape[1]:
        raise TopKInputError(
            f"vocabulary slice [{vocab_start}, {vocab_start + logits_shard.shape[1]}) lies outside [0, {vocab_size})"
        )
    if valid_vocab is not None and 0 < valid_vocab < vocab_size:
        # this slice's columns of the model's vocabulary (none on a slice of padding only): a view, never written
        logits_shard = logits_shard[:, : max(0, min(logits_shard.shape[1], valid_vocab - vocab_start))]
        vocab_size = valid_vocab
    chunk_bytes = chunk_bytes or chunk_bytes_for(logits_shard.device)
    return _topk_divergence(
        logits_shard,
        vocab_size,
        lambda rows, slot_ids, dropped: _vocab_parallel_pi_logprobs_at(
            logits_shard, rows, slot_ids, dropped, chunk_bytes, vocab_start, group
        ),
        rollout_topk_ids,
        rollout_topk_logprobs,
        sampled_ids,
        rollout_sampled_logprobs,
        mask,
        mass_tolerance,
    )
