"""pi on TROLL's sparse support S_t U {other} with autograd: the logits saved, not copied, softmax recomputed in
backward. The support itself is `verl_dppo.math.troll_support`'s; `verl_dppo.math.troll` is the public entry point
(its module doc gives the support rule, the "other" bucket and what backward keeps).
"""

from __future__ import annotations

from typing import Optional

import torch

from verl_dppo.math.kernels import backend_for, logits_at, scaled_exp_into
from verl_dppo.math.troll_support import pi_read_width, support_by_kernel, support_in_chunk

__all__ = ["pi_on_support"]


class _PiOnSupport(torch.autograd.Function):
    """log pi at the support ids and log pi(other) from the full logits, with Top(pi) and S_t found on the way.

    Saves the logits (no copy), the support ids and [n]-sized log-normalisers; recomputes softmax in backward.
    Two float32 chunk buffers are reused across chunks (fresh multi-MiB allocations cost page faults on CPU).
    """

    @staticmethod
    def forward(ctx, logits, rows, sampled, mu_ids, mu_selected, topk, support_mass, rows_per_chunk, inplace):
        vocab = logits.shape[1]
        n = sampled.shape[0]
        k_pi = min(topk, vocab)
        if backend_for(logits) == "triton":
            s = support_by_kernel(logits, rows, sampled, mu_ids, mu_selected, k_pi, support_mass)
            ids, source, valid, log_z = s.ids, s.source, s.valid, s.log_z
            log_pi = logits_at(logits, rows, ids) - log_z[:, None]
            log_z_tail = s.row_max + s.tail.log()
        else:
            ids, source, valid, log_pi, log_z, log_z_tail = _support_by_chunks(
                logits, rows, sampled, mu_ids, mu_selected, k_pi, support_mass, rows_per_chunk
            )
        used = int(valid.sum(dim=1).max()) if n else 0
        ids, source, valid = ids[:, :used].contiguous(), source[:, :used].contiguous(), valid[:, :used].contiguous()
        log_pi = log_pi[:, :used].contiguous()
        ctx.rows, ctx.rows_per_chunk, ctx.inplace = rows, rows_per_chunk, inplace
        ctx.save_for_backward(logits, ids, valid, log_pi, log_z, log_z_tail)
        ctx.mark_non_differentiable(ids, source, valid)
        return ids, source, valid, log_pi, log_z_tail - log_z

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _g_ids, _g_source, _g_valid, g_log_pi, g_log_other):
        logits, ids, valid, log_pi, log_z, log_z_tail = ctx.saved_tensors
        rows = ctx.rows
        work = log_pi.dtype
        g_s = torch.zeros_like(log_pi) if g_log_pi is None else torch.where(valid, g_log_pi.to(work), 0.0)
        has_tail = torch.isfinite(log_z_tail)
        g_o = torch.zeros_like(log_z) if g_log_other is None else torch.where(has_tail, g_log_other.to(work), 0.0)
        # d/dl_j: on S, g_j - G pi_j; off S, q_j (g_o - G pi_o) with q = softmax of the tail (G = sum of all g).
        total = g_s.sum(dim=1) + g_o
        pi_other = torch.where(has_tail, (log_z_tail - log_z).exp(), 0.0)
        tail_coef = g_o - total * pi_other
        on_support = torch.where(valid, g_s - total[:, None] * log_pi.exp(), 0.0)
        tail_base = torch.where(has_tail, log_z_tail, log_z)
        grad = logits if ctx.inplace else torch.zeros_like(logits) if rows is not None else torch.empty_like(logits)
        fill = _grad_by_kernel if backend_for(logits) == "triton" else _grad_by_chunks
        if fill(grad, logits, rows, ctx.rows_per_chunk, ids, valid, log_pi, log_z, tail_base, tail_coef, on_support):
            raise RuntimeError(
                "TROLL's backward found the logits changed since its forward: another backward overwrote them in "
                "place (verl's flash-attn cross entropy with inplace_backward=True does). Take the loss's gradient "
                "only through TROLL's outputs, or disable the in-place cross entropy (VERL_DISABLE_FLASH_ATTN_CE=1, "
                "or calculate_entropy=True)"
            )
        if ctx.inplace and rows is not None:
            unused = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
            unused[rows] = False
            grad.masked_fill_(unused[:, None], 0.0)
        return grad, None, None, None, None, None, None, None, None


def _changed(reread: torch.Tensor, before: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Whether the support's log pi, re-read from the logits, differs from the forward's (NaN equal to NaN)."""
    return (valid & (reread != before) & ~(reread.isnan() & before.isnan())).any()


def _grad_by_chunks(
    grad, logits, rows, rows_per_chunk, ids, valid, log_pi, log_z, tail_base, tail_coef, on_support
) -> bool:
    """The gradient chunk by chunk (torch); True if the logits changed since the forward (checked once, at the end:
    a check per chunk would synchronise a GPU each time)."""
    changed = torch.zeros((), dtype=torch.bool, device=logits.device)
    for start, end, block, scratch in _ChunkReader(logits, rows, rows_per_chunk):
        s_ids = ids[start:end]
        changed |= _changed(block.gather(1, s_ids) - log_z[start:end, None], log_pi[start:end], valid[start:end])
        q = torch.sub(block, tail_base[start:end, None], out=scratch).exp_().scatter_(1, s_ids, 0.0)
        q.mul_(tail_coef[start:end, None]).scatter_add_(1, s_ids, on_support[start:end])
        if rows is None:
            grad[start:end].copy_(q)
        else:
            grad.index_copy_(0, rows[start:end], q.to(grad.dtype))
    return bool(changed)


def _grad_by_kernel(
    grad, logits, rows, _rows_per_chunk, ids, valid, log_pi, log_z, tail_base, tail_coef, on_support
) -> bool:
    """The gradient in one kernel pass (every column of the selected rows gets the tail's formula), then the
    support's columns set to their own: [n, |S|] writes. The logits' check comes first: in place, grad is them."""
    if bool(_changed(logits_at(logits, rows, ids) - log_z[:, None], log_pi, valid)):
        return True
    scaled_exp_into(grad, logits, tail_base, tail_coef, rows)
    at = (ids,) if rows is None else (rows[:, None].expand_as(ids), ids)
    # Padding slots repeat a_t with a zero gradient: zero everything on the support first, then add.
    if rows is None:
        grad.scatter_(1, ids, 0.0).scatter_add_(1, ids, on_support.to(grad.dtype))
    else:
        grad.index_put_(at, torch.zeros((), dtype=grad.dtype, device=grad.device))
        grad.index_put_(at, on_support.to(grad.dtype), accumulate=True)
    return False


def _support_by_chunks(logits, rows, sampled, mu_ids, mu_selected, k_pi, support_mass, rows_per_chunk):
    """(ids, source, valid, log pi at the ids, log Z, log Z of the tail) chunk by chunk (the torch path)."""
    n, dev = sampled.shape[0], logits.device
    reader = _ChunkReader(logits, rows, rows_per_chunk)
    width = 1 + mu_ids.shape[1] + pi_read_width(k_pi, logits.shape[1])
    ids = torch.empty(n, width, dtype=torch.long, device=dev)
    source = torch.empty_like(ids)
    valid = torch.empty(n, width, dtype=torch.bool, device=dev)
    log_pi = torch.empty(n, width, dtype=reader.work, device=dev)
    log_z = torch.empty(n, dtype=reader.work, device=dev)
    log_z_tail = torch.empty_like(log_z)
    for start, end, block, scratch in reader:
        s = support_in_chunk(
            block, scratch, sampled[start:end], mu_ids[start:end], mu_selected[start:end], k_pi, support_mass
        )
        ids[start:end], source[start:end], valid[start:end] = s.ids, s.source, s.valid
        log_pi[start:end] = block.gather(1, s.ids) - s.log_z[:, None]
        log_z[start:end] = s.log_z
        log_z_tail[start:end] = s.row_max + s.tail.log()
    return ids, source, valid, log_pi, log_z, log_z_tail


class _ChunkReader:
    """Iterates (start, end, block, scratch) over the selected rows: block holds the rows' logits in float32 at
    least (a view of the logits when no conversion is needed: never written), scratch is a same-sized buffer."""

    def __init__(self, logits: torch.Tensor, rows: Optional[torch.Tensor], rows_per_chunk: int):
        self.logits, self.rows, self.step = logits, rows, rows_per_chunk
        self.work = torch.promote_types(logits.dtype, torch.float32)
        self.n = logits.shape[0] if rows is None else rows.numel()

    def __iter__(self):
        size = (min(self.step, self.n), self.logits.shape[1])
        converted = torch.empty(size, dtype=self.work, device=self.logits.device)
        scratch = torch.empty_like(converted)
        for start in range(0, self.n, self.step):
            end = min(start + self.step, self.n)
            if self.rows is None:
                source = self.logits[start:end]
            else:
                source = self.logits.index_select(0, self.rows[start:end])
            if source.dtype == self.work:
                block = source
            else:
                block = converted[: end - start]
                block.copy_(source)
            yield start, end, block, scratch[: end - start]


pi_on_support = _PiOnSupport.apply
"""(logits, rows, sampled, mu_ids, mu_selected, topk, support_mass, rows_per_chunk, inplace) -> (ids, source, valid,
log pi at the ids, log pi(other)): see `_PiOnSupport`."""
