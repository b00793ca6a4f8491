"""One chunk's work in the fused LM-head passes (`verl_dppo.math.fused_topk`): the chunk's logits from the hidden
states, on the torch path the entropy and dL/dlogits in place (the kernels' path: `verl_dppo.math.kernels`), and the
backward's coefficients every fused pass shares (`log_normalisers`, `grad_terms`, `chunk_grad`).

Pure torch (no verl import). The torch path's entropy works in row blocks: 16 rows on a CPU, sized by the free memory
on an accelerator, where every op of every block costs a launch.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from verl_dppo.math.kernels import chunk_bytes_for, logits_at, scaled_exp_into

__all__ = [
    "chunk_logits",
    "entropy_rows",
    "entropy_sums",
    "entropy_grad",
    "logits_grad_in_place",
    "GradTerms",
    "grad_terms",
    "log_normalisers",
    "chunk_grad",
]

_ENTROPY_ROWS = 16
"""Rows per block of the entropy's temporaries on the torch path on a CPU (a few MiB each at Qwen3's vocabulary);
on an accelerator the block is sized by `kernels.chunk_bytes_for` (a launch per op per block costs there)."""


def _entropy_block_rows(block: torch.Tensor) -> int:
    if block.device.type == "cpu":
        return _ENTROPY_ROWS
    return max(_ENTROPY_ROWS, chunk_bytes_for(block.device) // (3 * 4 * max(block.shape[1], 1)))


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float, out: Optional[torch.Tensor]):
    """hidden @ W^T / temperature in the matmul's dtype (verl's order of operations), into `out` when it fits."""
    autocast = torch.is_autocast_enabled(hidden.device.type)
    if out is not None and not autocast and hidden.dtype == weight.dtype == out.dtype:
        logits = torch.matmul(hidden, weight.t(), out=out[: hidden.shape[0]])
    else:
        logits = hidden @ weight.t()
    return logits.div_(temperature) if temperature != 1.0 else logits


def entropy_rows(block: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """H = log Z - sum exp(s) s / Z, Z = sum exp(s), s = logit - max, to float32's relative accuracy on every row.

    Both terms are >= 0 (no cancellation), but on a peaked row Z = 1 + (1 - p) / p, and a sum that holds the max's
    own 1 rounds 1 + 1e-9 to 1 (3.6% of H lost at 1 - p = 1e-9 before issue 53.3). Z - 1 is summed apart, without
    that 1 (one argmax's entry zeroed: the max's ties keep theirs), in float32 (the small terms keep their relative
    digits), and log Z = log1p(Z - 1) (`kernels.row_entropy` does the same; tests/test_fused_topk.py)."""
    rest, weighted = entropy_sums(block, row_max)
    return torch.log1p(rest) - weighted / (1.0 + rest)


def entropy_sums(block: torch.Tensor, row_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`entropy_rows`'s two sums per row, float64 [N] each, s = logit - row_max: Z - 1 (one argmax's exp(s) left
    out, summed in float32 without it) and sum exp(s) s; `fused_logprob.vocab_parallel_token_logprobs` combines the
    vocabulary shards' sums."""
    rest = torch.empty(block.shape[0], dtype=torch.float64, device=block.device)
    weighted = torch.empty_like(rest)
    step = _entropy_block_rows(block)
    for r in range(0, block.shape[0], step):
        shifted = block[r : r + step] - row_max[r : r + step, None]
        e = shifted.exp()
        # the max's own 1 out (one argmax per row; its ties keep theirs): Z - 1 summed in float32 holds its digits
        rest[r : r + step] = e.scatter_(1, shifted.argmax(dim=1, keepdim=True), 0.0).sum(dim=1).double()
        weighted[r : r + step] = e.mul_(shifted).sum(dim=1).double()  # the max's term is 0 either way
    return rest, weighted


def entropy_grad(logits, log_z, entropy, g_entropy) -> torch.Tensor:
    """dL/dlogit from the entropy: -g_H pi (log pi + H)."""
    log_p = logits - log_z[:, None]
    return log_p.exp().mul_(log_p.add_(entropy[:, None])).mul_(-g_entropy[:, None])


def logits_grad_in_place(block, ids, dropped, tail_base, tail_coef, on_slots, log_z, entropy, g_entropy):
    """Overwrite the chunk's logits with dL/dlogits (the module doc's three lines): one chunk-sized buffer."""
    if g_entropy is not None:  # the entropy term at the slots (once per id), before their logits are overwritten
        at_slots = entropy_grad(block.gather(1, ids), log_z, entropy, g_entropy)
        on_slots = on_slots + torch.where(dropped, 0.0, at_slots)
    if g_entropy is None:
        block.sub_(tail_base[:, None]).exp_().mul_(tail_coef[:, None])
    else:
        step = _entropy_block_rows(block)
        for r in range(0, block.shape[0], step):  # row blocks: the entropy term needs the logits too
            rows = slice(r, r + step)
            term = entropy_grad(block[rows], log_z[rows], entropy[rows], g_entropy[rows])
            block[rows].sub_(tail_base[rows, None]).exp_().mul_(tail_coef[rows, None]).add_(term)
    return block.scatter_(1, ids, 0.0).scatter_add_(1, ids, on_slots)


class GradTerms(NamedTuple):
    """Per-row coefficients of dL/dlogits (the module doc's three lines), in the work dtype ([T] and [T, S])."""

    tail_base: torch.Tensor  # exp(logit - tail_base) * tail_coef off the slots
    tail_coef: torch.Tensor
    on_slots: torch.Tensor  # [T, S]: the slots' own term (the entropy's added per chunk)
    log_z: torch.Tensor
    entropy: torch.Tensor
    g_entropy: Optional[torch.Tensor]  # None: no entropy term

    def rows(self, index) -> "GradTerms":
        return GradTerms(*(t[index] if t is not None else None for t in self))


def log_normalisers(row_max, sum_outside, slot_logits, dropped) -> tuple[torch.Tensor, torch.Tensor]:
    """(log Z, log Z_tail) in float64 from the same sums as `_pi_at_slots`'s: the backward's normalisers."""
    shift, outside = row_max.double(), sum_outside.double()
    at_slots = torch.where(dropped, 0.0, (slot_logits.double() - shift[:, None]).exp())
    return shift + (outside + at_slots.sum(dim=1)).log(), shift + outside.log()


def grad_terms(g_slots, g_other, g_entropy, dropped, log_pi, log_z, log_z_tail, entropy, work) -> GradTerms:
    """The backward's per-row coefficients from the incoming gradients (None: zero) and the forward's per-row
    results (float64); `entropy` is only read with a g_entropy."""
    g_s = torch.zeros_like(log_pi) if g_slots is None else g_slots.double()
    has_tail = torch.isfinite(log_z_tail)
    g_o = torch.zeros_like(log_z) if g_other is None else torch.where(has_tail, g_other.double(), 0.0)
    total = g_s.sum(dim=1) + g_o
    pi_other = torch.where(has_tail, (log_z_tail - log_z).exp(), 0.0)
    return GradTerms(
        tail_base=torch.where(has_tail, log_z_tail, log_z).to(work),
        tail_coef=(g_o - total * pi_other).to(work),
        on_slots=(g_s - torch.where(dropped, 0.0, total[:, None] * log_pi.exp())).to(work),
        log_z=log_z.to(work),
        entropy=entropy.to(work),
        g_entropy=g_entropy.to(work) if g_entropy is not None else None,
    )


def chunk_grad(logits, out, ids, dropped, terms: GradTerms, in_place: bool) -> torch.Tensor:
    """dL/dlogits of one chunk of rows, returned in `out` (the chunk's shape; None: the torch path overwrites
    `logits` itself, which must then be float32 at least). in_place: one kernel pass from the logits as they are,
    written in out's dtype; else the torch path on `out` holding a float32 (at least) copy of the logits."""
    tail_base, tail_coef, on_slots, log_z, entropy, g_h = terms
    if in_place:
        term = None
        if g_h is not None:  # the entropy's term: at the slots here, elsewhere in the kernel
            at_slots = entropy_grad(logits_at(logits, None, ids), log_z, entropy, g_h)
            on_slots = on_slots + torch.where(dropped, 0.0, at_slots)
            term = (log_z, entropy, -g_h)
        grad = scaled_exp_into(out, logits, tail_base, tail_coef, entropy_term=term)
        return grad.scatter_(1, ids, 0.0).scatter_add_(1, ids, on_slots.to(grad.dtype))
    block = logits if out is None else out.copy_(logits)
    return logits_grad_in_place(block, ids, dropped, tail_base, tail_coef, on_slots, log_z, entropy, g_h)
