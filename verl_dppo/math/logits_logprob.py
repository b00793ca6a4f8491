"""log pi(labels) and the entropy from materialised logits [N, V] in one read, for the plugin's modes that need
nothing else of them (the binary DPPO modes, the ratio-clip and PG-IS baselines) when verl's fused kernels are off:
what verl's engine computes with `entropy_from_logits` (softmax, logsumexp, a product: several [N, V] tensors) and
`logprobs_from_logits` (without flash-attn a Python loop row by row, keeping a [N, V] log-softmax for the backward).

Pure torch (no verl import). The same per-row statistics as the fused LM head (`verl_dppo.math.fused_topk`, with
a_t as the only slot): per chunk of rows, the row max, the logit at a_t, the sum of exp(logit - max) over the other
columns and the entropy (on a GPU in one pass of the Triton kernel `kernels.max_sum_outside_and_entropy` over
the logits as they are; else `_fixed_selector`'s torch path and `fused_chunk.entropy_rows` on a float32 copy of
the chunk); log pi(a_t) = `topk._pi_at_slots` in float64 (exact to rounding at a top-1
probability of 1 - 1e-9 and 100 nats down the tail). Chunks of rows sized by `kernels.chunk_bytes_for`: no float32
[N, V] copy is made. The backward saves the logits by reference and per-row float64 results (log Z, the entropy)
and writes dL/dlogits = g_lp (onehot - p) + g_H dH/dlogits chunk by chunk into one new tensor of the logits' dtype
(`fused_chunk.chunk_grad`: `kernels.scaled_exp_into` on a GPU, `fused_chunk.logits_grad_in_place` on the torch path).
Temperature is the caller's (verl divides the logits before).
"""

from __future__ import annotations

from typing import Optional

import torch

from verl_dppo.math.fused_chunk import chunk_grad, entropy_rows, grad_terms, log_normalisers
from verl_dppo.math.fused_topk import _fixed_selector
from verl_dppo.math.kernels import backend_for, chunk_bytes_for, logits_at, max_sum_outside_and_entropy
from verl_dppo.math.topk import _finite, _pi_at_slots

__all__ = ["logits_logprobs"]


class _LogitsLogprobs(torch.autograd.Function):
    """logits [N, V], labels [N] -> (log pi(labels) [N], entropy [N] or zeros), float32 at least."""

    @staticmethod
    def forward(ctx, logits, labels, want_entropy, chunk_rows):
        ctx.set_materialize_grads(False)
        n, vocab, dev = logits.shape[0], logits.shape[1], logits.device
        work = torch.promote_types(logits.dtype, torch.float32)
        in_place = backend_for(logits) == "triton"
        ids = labels.long()[:, None]
        dropped = torch.zeros_like(ids, dtype=torch.bool)
        select = _fixed_selector(ids, dropped)
        row_max = torch.empty(n, dtype=work, device=dev)
        sum_outside = torch.empty_like(row_max)
        slot_logits = torch.empty(n, 1, dtype=work, device=dev)
        entropy = torch.zeros(n, dtype=torch.float64, device=dev)
        step = n if in_place else chunk_rows
        buffer = None if in_place else torch.empty(min(step, n), vocab, dtype=work, device=dev)
        for start in range(0, n, max(step, 1)):
            c = slice(start, min(start + step, n))
            block = logits[c] if in_place else buffer[: c.stop - start].copy_(logits[c])
            if in_place and want_entropy:  # one kernel pass: the max, the sum outside a_t and the entropy
                top, sum_outside[c], entropy[c] = max_sum_outside_and_entropy(block, ids[c])
                row_max[c], slot_logits[c] = _finite(top), logits_at(block, None, ids[c])
                continue
            if want_entropy:  # before the torch path's selector overwrites the block
                entropy[c] = entropy_rows(block, _finite(block.amax(dim=1)))
            slots = select(block, None, c)
            row_max[c], sum_outside[c], slot_logits[c] = slots.row_max, slots.sum_outside, slots.slot_logits
            del block, slots
        del buffer
        log_pi, _ = _pi_at_slots(row_max, sum_outside, slot_logits, dropped)
        log_z, log_z_tail = log_normalisers(row_max, sum_outside, slot_logits, dropped)
        ctx.want_entropy, ctx.chunk_rows, ctx.in_place = want_entropy, chunk_rows, in_place
        ctx.save_for_backward(logits, ids, dropped, log_pi, log_z, log_z_tail, entropy)
        return log_pi[:, 0].to(work), entropy.to(work)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_log_pi, g_entropy):
        logits, ids, dropped, log_pi, log_z, log_z_tail, entropy = ctx.saved_tensors
        g_entropy = g_entropy if ctx.want_entropy else None  # without it the entropy is a constant 0
        if g_log_pi is None and g_entropy is None:
            return None, None, None, None
        n, vocab = logits.shape
        work = torch.promote_types(logits.dtype, torch.float32)
        terms = grad_terms(
            g_log_pi[:, None] if g_log_pi is not None else None,
            None,
            g_entropy,
            dropped,
            log_pi,
            log_z,
            log_z_tail,
            entropy,
            work,
        )
        grad = torch.empty(n, vocab, dtype=logits.dtype, device=logits.device)
        direct = ctx.in_place or logits.dtype == work  # dL/dlogits formed in the output itself
        step = n if ctx.in_place else ctx.chunk_rows
        buffer = None if direct else torch.empty(min(step, n), vocab, dtype=work, device=logits.device)
        for start in range(0, n, max(step, 1)):
            c = slice(start, min(start + step, n))
            out = grad[c] if direct else buffer[: c.stop - start]
            chunk = chunk_grad(logits[c], out, ids[c], dropped[c], terms.rows(c), ctx.in_place)
            if not direct:
                grad[c].copy_(chunk)
        return grad, None, None, None


def logits_logprobs(
    logits: torch.Tensor,
    labels: Optional[torch.Tensor] = None,
    *,
    entropy: bool = False,
    chunk_rows: Optional[int] = None,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(log pi(labels) or None without labels, the entropy or None unless asked) from logits [..., V] and labels
    [...] in [0, V); float32 (float64 for float64 logits), shaped like the logits' leading dims, with exact
    gradients to the logits. chunk_rows: rows per chunk on the torch path (default: `kernels.chunk_bytes_for`)."""
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    if labels is not None and tuple(labels.shape) != tuple(lead):
        raise ValueError(f"labels {tuple(lead)} expected, got {tuple(labels.shape)}")
    flat = logits.reshape(-1, vocab)
    ids = (
        labels.reshape(-1) if labels is not None else torch.zeros(flat.shape[0], dtype=torch.long, device=logits.device)
    )
    if chunk_rows is None:
        chunk_rows = max(1, chunk_bytes_for(logits.device) // (4 * max(vocab, 1)))
    log_pi, ent = _LogitsLogprobs.apply(flat, ids, bool(entropy), int(chunk_rows))
    return (log_pi.view(lead) if labels is not None else None), (ent.view(lead) if entropy else None)
