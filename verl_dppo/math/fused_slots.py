"""The fused LM-head pass that `verl_dppo.math.fused_topk` (Top-K DPPO), `fused_troll` (TROLL) and `fused_logprob`
(log pi(a_t) alone) share: log pi at the slots a selector picks per chunk of tokens, log pi(other) and the entropy,
from the hidden states and the LM head weight, the [T, V] logits never existing (verl's `use_fused_kernels`).

How it works. verl's `FusedLinearForPPO` (verl/utils/experimental/torch_functional.py) computes log pi(a_t) and the
entropy chunk by chunk over the tokens and recomputes each chunk's logits in the backward; this is the same scheme
with the Top-K statistics of `verl_dppo.math.topk` as outputs. Per chunk of tokens:

    logits  = hidden @ W^T / temperature                     (the matmul in the inputs' dtype, as verl does)
    row max, the logits at the slots (A'_t: the K ids, then a_t), sum of exp(logit - max) outside A'_t
    log pi(slot), log pi(other) = `topk._pi_at_slots` (float64): "other" summed from the complement itself

The sums are those of `topk._sum_exp_outside`, the same operations in the same order as the unfused path, so that
a float64 run agrees with `topk_divergence` to rounding. The backward recomputes a chunk's logits and forms
dL/dlogit_j in place, with G the sum of all incoming gradients:

    j in A'_t:   sum of g over the slots holding j  -  G pi_j
    j outside:   q_j (g_other - G pi(other)),   q = the softmax of the complement, exp(logit_j - log Z_tail)
    entropy:     - g_H pi_j (log pi_j + H)

(q rather than pi_j / pi(other): exact where pi(other) underflows), then dh = dlogits W / temperature and
dW += dlogits^T h. On a GPU (`kernels.backend_for`) the chunk's logits are read as the matmul left them (bf16, no
float32 copy, and no float32 buffer in the forward) by the Triton kernels: `max_and_sum_exp_outside` in the forward
(`max_sum_outside_and_entropy` when the entropy is asked for: one read of each chunk for the fixed slots, a_t and
mu's top-K; TROLL's selector reads with its own kernels and `row_entropy`), `scaled_exp_into` (with the entropy's
term) into the float32 buffer in the backward. The torch path's entropy works in row blocks (16 rows on a CPU, sized by the free
memory on an accelerator).

A slot that repeats an id (a_t inside the top-K, or a row outside the mask whose slots all hold a_t) is "dropped":
left out of Z and of the complement, but its output is still log pi of its id, with gradient.

Memory: per chunk, one float32 buffer of the chunk's logits (forward and backward: the backward overwrites it with
dL/dlogits; the kernels' forward needs none for bf16 chunks), the logits in the matmul's dtype beside it when that
is not float32 (bf16), and on the torch path the entropy's row blocks; TROLL's torch selector one more float32
buffer. TROLL on the kernels holds its reads of every row through the pass ([T, 260] candidate ids and logits:
1.7 KB a row, the slots' tensors allocated after the pass instead) and selects S_t in blocks of rows whose
temporaries stay within one chunk's logits; the backward's float32 chunk buffer remains the peak. Between forward and backward only [T, S] and [T] tensors beside the inputs; the weight's gradient is
accumulated in place (addmm_). `DEFAULT_CHUNK_TOKENS` tokens per chunk, as verl: the LM head is read once per chunk,
so a GPU needs chunks of a few hundred tokens to be compute-bound rather than bandwidth-bound.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch

from verl_dppo.math.fused_chunk import chunk_grad, chunk_logits, entropy_rows, grad_terms, log_normalisers
from verl_dppo.math.kernels import backend_for, row_entropy
from verl_dppo.math.topk import _finite, _pi_at_slots

__all__ = ["DEFAULT_CHUNK_TOKENS", "ChunkSlots", "Selector", "fused_slot_logprobs"]


DEFAULT_CHUNK_TOKENS = 512
"""Tokens per chunk: verl's FusedLinearForPPO default (311 MB of float32 logits per chunk at V = 151,936)."""


class ChunkSlots(NamedTuple):
    """What a slot selector returns for one chunk of rows ([c, S] and [c] tensors)."""

    ids: torch.Tensor  # [c, S] long: the slot ids
    dropped: torch.Tensor  # [c, S] bool: slots repeating an id held by another slot (left out of Z)
    row_max: torch.Tensor  # [c]: the shift of the sums (any finite value <= the row max keeps them finite)
    sum_outside: torch.Tensor  # [c]: sum of exp(logit - row_max) over the ids in no slot
    slot_logits: torch.Tensor  # [c, S]: the logits at the slot ids
    extra: Optional[torch.Tensor] = None  # [c, S] long, the selector's own per-slot data (TROLL: the source)
    again: Optional[torch.Tensor] = None  # [c] bool: rows whose slots are wrong, to select again after the pass


Selector = Callable[..., ChunkSlots]
"""(block, scratch, index, again=False) -> ChunkSlots: block holds the chunk's logits (in float32 at least on the
torch path, which may overwrite it; as the matmul left them on the kernels' path), scratch a buffer of the same
size when asked for (else None); index (a slice, or a tensor of row ids) the rows. A selector that returns `again`
rows (TROLL's crowded rows, flagged without waiting for the GPU) is called once more on them after the pass, with
again=True and their logits recomputed, and must then select them for good.

A selector may also defer its selection on the kernels' path (TROLL's): with a `read` attribute (not None),
`read(block, index)` returns a tuple of per-row tensors ([c, ...]) read from each chunk's logits, kept for every
row; after the pass `finish(reads, index)` turns the reads of a block of rows into their ChunkSlots (with `again`),
blocks of as many rows as hold `bytes_per_row` (the selector's peak per row) within one chunk's logits. Per chunk
then only the reads run, and the selection's small ops run a few times per call instead of once per chunk."""


def _kernels_read(work: torch.dtype, device: torch.device) -> bool:
    """Whether the chunks' logits go to the kernels as the matmul left them (`verl_dppo.math.kernels`)."""
    return backend_for(torch.empty(0, dtype=work, device=device)) == "triton"


class _FusedSlotLogprobs(torch.autograd.Function):
    """(hidden, weight) -> log pi at each row's slots, log pi(other), the entropy; see the module doc."""

    @staticmethod
    def forward(ctx, hidden, weight, temperature, chunk, select, width, want_entropy, needs_scratch, report):
        ctx.set_materialize_grads(False)
        n, dev = hidden.shape[0], hidden.device
        work = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        entropy = torch.empty(n, dtype=torch.float64, device=dev) if want_entropy else None
        rows = min(chunk, n)
        in_place = _kernels_read(work, dev)
        # A selector that reads its chunks now and selects the slots after the pass (TROLL's on the kernels):
        # per chunk a few reads, the selection in a few large launches once the logits are gone
        deferred = in_place and getattr(select, "read", None) is not None
        # A selector that reads the entropy from its own read of the chunk (the fixed slots' on the kernels)
        with_entropy = getattr(select, "with_entropy", None) if want_entropy and in_place else None
        reads = None  # the deferred selector's reads of every row: [n, ...] tensors

        def allocate():
            return (
                torch.empty(n, width, dtype=torch.long, device=dev),
                torch.empty(n, width, dtype=torch.bool, device=dev),
                torch.zeros(n, width, dtype=torch.long, device=dev),
                torch.empty(n, dtype=work, device=dev),
                torch.empty(n, dtype=work, device=dev),
                torch.empty(n, width, dtype=work, device=dev),
            )

        # the slots' tensors after the pass on the deferred path: the reads and the slots are not held together
        # with a chunk's logits
        ids, dropped, extra, row_max, sum_outside, slot_logits = (None,) * 6 if deferred else allocate()
        # The kernels read bf16 chunks as they are: a float32 buffer only for a float32 matmul's output.
        buffered = not in_place or hidden.dtype == weight.dtype == work
        buffer = torch.empty(rows, weight.shape[0], dtype=work, device=dev) if buffered else None
        scratch = torch.empty_like(buffer) if needs_scratch and not in_place else None
        again = None  # rows a selector flagged for a second look: [n] bool on the device, read once after the pass

        def chunk_block(index, size):
            logits = chunk_logits(hidden[index], weight, temperature, buffer)
            if logits.dtype == work or in_place:
                return logits, logits.dtype
            return buffer[:size].copy_(logits), logits.dtype

        def store(index, slots):
            ids[index], dropped[index] = slots.ids, slots.dropped
            row_max[index], sum_outside[index] = slots.row_max, slots.sum_outside
            slot_logits[index] = slots.slot_logits
            if slots.extra is not None:
                extra[index] = slots.extra

        matmul_dtype = work
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            block, matmul_dtype = chunk_block(slice(start, end), end - start)
            if want_entropy and with_entropy is None:
                entropy[start:end] = row_entropy(block) if in_place else entropy_rows(block, _finite(block.amax(dim=1)))
            if deferred:
                part = select.read(block, slice(start, end))
                if reads is None:
                    reads = tuple(torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=dev) for t in part)
                for whole, t in zip(reads, part):
                    whole[start:end] = t
                del block, part
                continue
            if with_entropy is not None:
                slots, entropy[start:end] = with_entropy(block, slice(start, end))
            else:
                slots = select(block, scratch[: end - start] if scratch is not None else None, slice(start, end))
            store(slice(start, end), slots)
            if slots.again is not None:
                if again is None:
                    again = torch.zeros(n, dtype=torch.bool, device=dev)
                again[start:end] = slots.again
            del block, slots
        if deferred:
            ids, dropped, extra, row_max, sum_outside, slot_logits = allocate()
            again = torch.zeros(n, dtype=torch.bool, device=dev)
            # rows per selection: its peak within one chunk's logits (in the matmul's dtype), at least a chunk
            step = max(
                rows, (rows * weight.shape[0] * torch.finfo(matmul_dtype).bits // 8) // max(1, select.bytes_per_row)
            )
            for start in range(0, n, step):
                end = min(start + step, n)
                slots = select.finish(tuple(t[start:end] for t in reads), slice(start, end))
                store(slice(start, end), slots)
                again[start:end] = slots.again
                del slots
            reads = None
        # The pass's one wait for the device: how many rows to select again, and the widest row's kept slots
        reads = ([again.sum()] if again is not None else []) + ([_widest(dropped)] if report is not None else [])
        counts = torch.stack(reads).tolist() if reads else []
        redo = 0 if again is None else counts[0]
        order = torch.argsort((~again).to(torch.uint8), stable=True) if redo else None  # flagged rows first
        for start in range(0, redo, chunk):
            index = order[start : min(start + chunk, redo)]
            block, _ = chunk_block(index, index.numel())
            store(index, select(block, scratch[: index.numel()] if scratch is not None else None, index, again=True))
            del block
        if report is not None:
            report["kept"] = int(_widest(dropped)) if redo else counts[-1]  # rows selected again: one more wait
        del buffer, scratch
        log_pi, log_other = _pi_at_slots(row_max, sum_outside, slot_logits, dropped)
        log_z, log_z_tail = log_normalisers(row_max, sum_outside, slot_logits, dropped)
        ctx.temperature, ctx.chunk, ctx.matmul_dtype = temperature, chunk, matmul_dtype
        ctx.want_entropy = want_entropy
        ctx.autocast = (dev.type, torch.is_autocast_enabled(dev.type), torch.get_autocast_dtype(dev.type))
        ctx.save_for_backward(
            hidden, weight, ids, dropped, log_pi, log_z, log_z_tail, entropy if entropy is not None else log_z
        )
        ctx.mark_non_differentiable(ids, dropped, extra)
        entropy_out = entropy.to(work) if entropy is not None else torch.zeros(n, dtype=work, device=dev)
        return log_pi, log_other, entropy_out, ids, dropped, extra

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_slots, g_other, g_entropy, _g_ids, _g_dropped, _g_extra):
        hidden, weight, ids, dropped, log_pi, log_z, log_z_tail, entropy = ctx.saved_tensors
        n, dev = hidden.shape[0], hidden.device
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        work = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        # Without want_entropy the entropy output is a constant 0: no gradient, whatever arrives.
        terms = grad_terms(
            g_slots, g_other, g_entropy if ctx.want_entropy else None, dropped, log_pi, log_z, log_z_tail, entropy, work
        )

        grad_hidden = torch.zeros_like(hidden) if need_h else None
        grad_weight = torch.zeros_like(weight) if need_w else None
        device_type, autocast_on, autocast_dtype = ctx.autocast
        chunk, rows = ctx.chunk, min(ctx.chunk, n)
        in_place = _kernels_read(work, dev)
        buffer = torch.empty(rows, weight.shape[0], dtype=work, device=dev)
        with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                h = hidden[start:end]
                logits = chunk_logits(h, weight, ctx.temperature, buffer)
                c = slice(start, end)
                # the kernels read the logits as they are; the torch path overwrites a float32 chunk
                out = None if logits.dtype == work and not in_place else buffer[: end - start]
                grad = chunk_grad(logits, out, ids[c], dropped[c], terms.rows(c), in_place)
                del logits
                if ctx.temperature != 1.0:
                    grad.div_(ctx.temperature)
                d_logits = grad.to(ctx.matmul_dtype)  # verl casts dlogits to the logits' dtype the same way
                if need_h:
                    grad_hidden[start:end] = d_logits @ weight
                if need_w:
                    if d_logits.dtype == h.dtype == grad_weight.dtype and not autocast_on:
                        grad_weight.addmm_(d_logits.t(), h)  # no [V, H] temporary
                    else:
                        grad_weight += d_logits.t() @ h
                del d_logits, grad
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _widest(dropped: torch.Tensor) -> torch.Tensor:
    """The most slots a row keeps (not dropped), on the device: 0 without rows."""
    kept = (~dropped).sum(dim=1)
    return kept.max() if kept.numel() else kept.new_zeros(())


def fused_slot_logprobs(
    hidden,
    weight,
    temperature: float,
    select: Selector,
    width: int,
    entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    scratch: bool = False,
    report: Optional[dict] = None,
):
    """log pi at the slots `select` picks per chunk, log pi(other) (the ids in no slot) and the entropy, fused with
    the LM head. Returns (log_pi [T, width] float64, log_other [T] float64, entropy [T] (0 unless asked), ids
    [T, width], dropped [T, width], extra [T, width]); the first three with gradient to hidden and weight.
    scratch: `select` gets a chunk-sized float32 buffer (else None). report: a dict that gets "kept", the most
    slots a row keeps (TROLL's widest S_t), read with the selector's `again` rows in the pass's one wait for the
    device (a second one only when rows were selected again)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [T, H] and weight [V, H] expected, got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if not (temperature > 0 and math.isfinite(temperature)) or chunk_tokens < 1:
        raise ValueError(f"need temperature > 0 and chunk_tokens >= 1, got {temperature}, {chunk_tokens}")
    return _FusedSlotLogprobs.apply(
        hidden, weight, float(temperature), int(chunk_tokens), select, int(width), bool(entropy), bool(scratch), report
    )
