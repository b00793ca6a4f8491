"""log pi(a_t) and the entropy fused with the LM head, for the modes that need nothing else of the logits (the binary
DPPO modes, the ratio-clip and PG-IS baselines): what verl's `FusedLinearForPPO` returns, from the plugin's one-read
pass (`verl_dppo.math.fused_slots.fused_slot_logprobs` with a_t as the only slot).

Pure torch (no verl import). Per chunk of tokens the logits are formed once and read once: their max, the logit at
a_t, the sum of exp over the rest and the entropy (on a GPU in one Triton kernel, `kernels.max_sum_outside_and_entropy`
or without the entropy `max_and_sum_exp_outside`, as the matmul left them); the backward recomputes the chunk's
logits and forms dL/dlogits in place (`kernels.scaled_exp_into`). verl's torch kernel computes the same in float32
from a float32 copy of each chunk's logits, a log-softmax and a second pass for the entropy.

`vocab_parallel_token_logprobs`: the same over a vocabulary-parallel LM head (Megatron's tensor parallelism, verl's
`linear_cross_entropy(..., "none", tp_group)`): each rank holds the weight's rows [vocab_start, vocab_start +
V_local) and the same hidden states, and reads its chunks as above: its row max m_r and, relative to it, the sum of
exp outside a_t, the logit at a_t where it owns a_t and the entropy's two sums (on a GPU from the same kernel read,
`kernels.max_sum_outside_and_entropy_sums`; on the torch path `fused_chunk.entropy_sums`).
After the pass two all-reduces for all chunks: MAX of m_r (M), then SUM of [T, 5] float64 partials rescaled by
exp(m_r - M): the sum outside a_t, the logit at a_t (its owner's), Z - 1 (the ranks holding M count their 1 apart: a
peaked row keeps its 1 - p digits, a max tied across ranks its other 1s) and sum exp(logit - M)(logit - M) (W_r +
(m_r - M) Z_r, terms <= 0); log pi(a_t) and the normalisers by `topk._pi_at_slots` / `fused_chunk.log_normalisers`, H
= log1p(Z - 1) - W / Z. The backward forms the shard's dL/dlogits by `fused_chunk.grad_terms` / `chunk_grad` (a rank
without a_t has no slot); dW stays local, dh is summed over the group unless reduce_grad_hidden=False (hidden states
from Megatron's sequence-parallel all-gather, whose backward reduce-scatters the ranks' shares, as for verl's
kernel).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from verl_dppo.math.fused_chunk import chunk_grad, chunk_logits, entropy_grad, entropy_sums, grad_terms, log_normalisers
from verl_dppo.math.fused_slots import DEFAULT_CHUNK_TOKENS, _kernels_read, fused_slot_logprobs
from verl_dppo.math.fused_topk import _fixed_selector
from verl_dppo.math.kernels import logits_at, max_and_sum_exp_outside, max_sum_outside_and_entropy_sums
from verl_dppo.math.topk import _finite, _pi_at_slots, _sum_exp_outside

__all__ = ["fused_token_logprobs", "vocab_parallel_token_logprobs"]


def fused_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log pi(labels) [T], the entropy [T] or None) with logits = hidden @ weight^T / temperature, hidden [T, H],
    weight [V, H], labels [T] in [0, V); float32 (float64 for float64 inputs), with exact gradients to hidden and
    weight (each chunk's logits recomputed in the backward)."""
    if labels.dim() != 1 or labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"labels [T={hidden.shape[0]}] expected, got {tuple(labels.shape)}")
    slot_ids = labels.long()[:, None]
    dropped = torch.zeros_like(slot_ids, dtype=torch.bool)
    log_pi, _, ent, _, _, _ = fused_slot_logprobs(
        hidden, weight, temperature, _fixed_selector(slot_ids, dropped), 1, entropy, chunk_tokens
    )
    out = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    return log_pi[:, 0].to(out), (ent.to(out) if entropy else None)


def _all_reduce(tensor: torch.Tensor, group: Any, op: str) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op), group=group)


class _VocabParallelTokenLogprobs(torch.autograd.Function):
    """(hidden, weight shard) -> (log pi(labels), entropy). group None: one rank's arithmetic, no collectives."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_start, temperature, chunk, want_entropy, group, reduce_grad_h):
        ctx.set_materialize_grads(False)  # the module doc's vocabulary-parallel pass
        n, dev, local_vocab = hidden.shape[0], hidden.device, weight.shape[0]
        work = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        local_ids = labels.long() - vocab_start
        owned = (local_ids >= 0) & (local_ids < local_vocab)
        ids = torch.where(owned, local_ids, 0)[:, None]  # a_t on another rank: column 0, no slot
        row_max = torch.full((n,), -math.inf, dtype=work, device=dev)
        sum_outside, at_label = torch.zeros_like(row_max), torch.zeros_like(row_max)
        rest, weighted = (torch.zeros(n, dtype=torch.float64, device=dev) for _ in range(2))
        in_place = _kernels_read(work, dev)
        buffer = (
            torch.empty(min(chunk, n), local_vocab, dtype=work, device=dev)
            if not in_place or hidden.dtype == weight.dtype == work
            else None
        )
        matmul_dtype = work
        for start in range(0, n if local_vocab else 0, chunk):
            c = slice(start, min(start + chunk, n))
            logits = chunk_logits(hidden[c], weight, temperature, buffer)
            matmul_dtype = logits.dtype
            block = logits if logits.dtype == work or in_place else buffer[: logits.shape[0]].copy_(logits)
            at_label[c] = torch.where(owned[c], logits_at(block, None, ids[c])[:, 0], 0.0)
            if in_place:  # one kernel read: the max, the sum outside a_t (not owned: -1 excludes nothing), the
                excluded = torch.where(owned[c], local_ids[c], -1)[:, None]  # entropy's two sums when asked
                if want_entropy:
                    m, s, sums = max_sum_outside_and_entropy_sums(block, excluded)
                    rest[c], weighted[c] = sums[:, 0].double(), sums[:, 1].double()
                else:
                    m, s = max_and_sum_exp_outside(block, excluded)
            m = _finite(m if in_place else block.amax(dim=1))
            if want_entropy and not in_place:
                rest[c], weighted[c] = entropy_sums(block, m)
            row_max[c] = m  # the torch path's sum outside a_t overwrites block
            sum_outside[c] = s if in_place else _sum_exp_outside(block, m, ids[c], owned[c][:, None])
            del logits, block
        top = row_max.clone()
        _all_reduce(top, group, "MAX")
        top = _finite(top)
        shift = row_max.double() - top.double()
        scale, holds = shift.exp(), row_max == top  # scale: 1 on the ranks holding the max, 0 on an empty shard
        partials = torch.stack(
            [
                scale * sum_outside.double(),
                at_label.double(),
                scale * rest + torch.where(holds, 0.0, scale),
                holds.double(),
                torch.where(scale > 0, scale * (weighted + shift * (1.0 + rest)), 0.0),
            ],
            dim=1,
        )
        _all_reduce(partials, group, "SUM")
        slot, dropped = partials[:, 1:2], torch.zeros(n, 1, dtype=torch.bool, device=dev)
        log_pi, _ = _pi_at_slots(top, partials[:, 0], slot, dropped)
        log_z, log_z_tail = log_normalisers(top, partials[:, 0], slot, dropped)
        z_less_1 = partials[:, 2] + (partials[:, 3] - 1.0)
        entropy = torch.log1p(z_less_1) - partials[:, 4] / (1.0 + z_less_1) if want_entropy else torch.zeros_like(log_z)
        ctx.temperature, ctx.chunk, ctx.matmul_dtype, ctx.want_entropy = temperature, chunk, matmul_dtype, want_entropy
        ctx.group, ctx.reduce_grad_h = group, reduce_grad_h
        ctx.autocast = (dev.type, torch.is_autocast_enabled(dev.type), torch.get_autocast_dtype(dev.type))
        ctx.save_for_backward(hidden, weight, ids, owned, log_pi, log_z, log_z_tail, entropy)
        return log_pi[:, 0].to(work), entropy.to(work)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_log_pi, g_entropy):
        hidden, weight, ids, owned, log_pi, log_z, log_z_tail, entropy = ctx.saved_tensors
        n, dev, (need_h, need_w) = hidden.shape[0], hidden.device, ctx.needs_input_grad[:2]
        work = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        terms = grad_terms(
            None if g_log_pi is None else g_log_pi[:, None],
            None,
            g_entropy if ctx.want_entropy else None,
            torch.zeros(n, 1, dtype=torch.bool, device=dev),
            log_pi,
            log_z,
            log_z_tail,
            entropy,
            work,
        )
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        grad_weight = torch.zeros_like(weight) if need_w else None
        device_type, autocast_on, autocast_dtype = ctx.autocast
        in_place = _kernels_read(work, dev)
        buffer = torch.empty(min(ctx.chunk, n), weight.shape[0], dtype=work, device=dev)
        with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
            for start in range(0, n if weight.shape[0] else 0, ctx.chunk):
                c = slice(start, min(start + ctx.chunk, n))
                h, mine, part = hidden[c], owned[c][:, None], terms.rows(c)
                logits = chunk_logits(h, weight, ctx.temperature, buffer)
                # a_t on another rank: column 0 (the scatter's target) keeps its off-slot term (dropped: no slot's)
                col0 = logits_at(logits, None, ids[c])
                off = (col0 - part.tail_base[:, None]).exp() * part.tail_coef[:, None]
                if part.g_entropy is not None:
                    off = off + entropy_grad(col0, part.log_z, part.entropy, part.g_entropy)
                part = part._replace(on_slots=torch.where(mine, part.on_slots, off.to(part.on_slots.dtype)))
                out = None if logits.dtype == work and not in_place else buffer[: h.shape[0]]
                grad = chunk_grad(logits, out, ids[c], ~mine, part, in_place)
                d_logits = (grad.div_(ctx.temperature) if ctx.temperature != 1.0 else grad).to(ctx.matmul_dtype)
                del logits, grad
                if need_h:
                    grad_hidden[c] = d_logits @ weight
                if need_w and d_logits.dtype == h.dtype == grad_weight.dtype and not autocast_on:
                    grad_weight.addmm_(d_logits.t(), h)  # no [V, H] temporary
                elif need_w:
                    grad_weight += d_logits.t() @ h
        if need_h and ctx.reduce_grad_h:
            _all_reduce(grad_hidden, ctx.group, "SUM")
        return grad_hidden, grad_weight, *(None,) * 7


def vocab_parallel_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int = 0,
    temperature: float = 1.0,
    group: Any = None,
    *,
    entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    reduce_grad_hidden: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`fused_token_logprobs` from this rank's shard of a vocabulary-parallel LM head (the module doc): hidden [T, H]
    and labels [T] (global ids) the same on every rank of `group`, weight [V_local, H] the head's rows [vocab_start,
    vocab_start + V_local). The results are the same on every rank; the gradient to hidden is summed over the group
    unless reduce_grad_hidden=False (this rank's share), to weight this shard's. One rank: `fused_token_logprobs`."""
    if group is None or dist.get_world_size(group) == 1:
        if vocab_start != 0:
            raise ValueError(f"one rank holds the whole vocabulary: vocab_start must be 0, got {vocab_start}")
        return fused_token_logprobs(hidden, weight, labels, temperature, entropy=entropy, chunk_tokens=chunk_tokens)
    if (
        hidden.dim() != 2
        or weight.dim() != 2
        or hidden.shape[1] != weight.shape[1]
        or labels.dim() != 1
        or labels.shape[0] != hidden.shape[0]
    ):
        raise ValueError(
            f"hidden [T, H], weight [V_local, H] and labels [T] expected, got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    if not (temperature > 0 and math.isfinite(temperature)) or chunk_tokens < 1:
        raise ValueError(f"need temperature > 0 and chunk_tokens >= 1, got {temperature}, {chunk_tokens}")
    return _parallel(hidden, weight, labels, vocab_start, temperature, group, entropy, chunk_tokens, reduce_grad_hidden)


def _parallel(hidden, weight, labels, vocab_start, temperature, group, entropy, chunk_tokens, reduce_grad_hidden):
    """The vocabulary-parallel pass (group None: one rank's arithmetic without collectives; the tests')."""
    log_pi, ent = _VocabParallelTokenLogprobs.apply(
        hidden,
        weight,
        labels,
        int(vocab_start),
        float(temperature),
        int(chunk_tokens),
        bool(entropy),
        group,
        bool(reduce_grad_hidden),
    )
    return log_pi, (ent if entropy else None)
