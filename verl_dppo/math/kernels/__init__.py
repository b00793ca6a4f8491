"""One read of the logits per row: the Triton kernels behind the Top-K statistics and TROLL's support on a GPU.

Pure torch + Triton (no verl import). The torch paths in `topk.py` and `troll_support.py` stay the reference and
the fallback (CPU, accelerators without Triton); these kernels compute the same quantities in the same float32
arithmetic, without the row chunks' float32 copies and their dozens of small launches per chunk:

- `max_and_sum_exp_outside(logits, excluded, rows=None, row_max=None)`: per row, the max logit and
  sum over the columns NOT in `excluded` of exp(logit - max). The sum is taken over the complement itself, as the
  torch path does (on a row whose top-1 probability is 1 - 1e-9, "all minus the excluded" cancels to 0 in float32).
  One read of the row, with no reduction inside the loop: each lane keeps its own running max and its sum relative
  to it (one exp per element: exp(-|x - max|) rescales the sum when x is the lane's new max, else weighs x), and
  the lanes are combined once at the end (or the sum is taken relative to the given `row_max`: the
  vocabulary-parallel path all-reduces the max first): close to the time of one read of the logits, where a first
  version that reduced a max and a slot count across the block at every step took several times that, more with
  TROLL's excluded ids (docs/benchmarks.md has the GPU figures).
- `row_entropy(logits)`: the entropy of each row's softmax in one read, by the same kernel (per lane, also the sum of
  exp(s) s relative to the lane's max; the fused paths' entropy, where verl's `FusedLinearForPPO` returns one).
- `max_sum_outside_and_entropy(logits, excluded)`: both of the above in one read of every row (the entropy is
  summed over every column, the sum outside `excluded` beside it; the unfused binary modes' forward,
  `logits_logprob`).
- `scaled_exp_into(out, logits, base, coef, rows=None, entropy_term=None)`: out[r, j] = exp(logit[r, j] - base[r]) *
  coef[r], plus the entropy's gradient when asked, in `out`'s dtype (TROLL's backward off the support, the fused
  backward: one read, one write; `out` may be the logits themselves).
- `top_threshold(logits, kth, rows=None)`: per row, the max and the (kth + 1)-th largest of the BLOCK lanes' own
  maxima (lane = column mod BLOCK), a lower bound of the row's (kth + 1)-th largest logit, found by bisection on the
  float's bits (32 counts of the lanes; a sort of the block's lanes is far slower, under the interpreter most).
- `sum_exp_below(logits, excluded, row_max, threshold, capacity, rows=None)`: per row, the ids at or above the
  threshold (their slots from an atomic counter: a handful per row, so no scan of each block) and the sum of
  exp(logit - max) over the other columns, less `excluded`. With `top_threshold`, pi's top K + 1 in two reads
  (TROLL's support: `troll_support.support_by_kernel`), where torch's `topk` took two thirds of TROLL's time.

Which columns a row excludes: its ids sorted ascending (sentinels for "none"), walked with a scalar pointer as the
blocks of columns pass them, so a row's exclusion costs its number of ids, not ids x columns.

The fused LM-head paths (`fused_topk`, `fused_troll`) give each chunk's logits to these kernels as the matmul
left them (bf16 read in place, forward and backward).

Which path runs (`backend_for`): Triton for CUDA tensors when Triton imports, the torch path otherwise.
`VERL_DPPO_KERNELS=torch` forces torch everywhere; `VERL_DPPO_KERNELS=triton` forces the kernels, also on CPU
tensors under Triton's interpreter (`TRITON_INTERPRET=1`, how the suite tests them without a GPU). float64
logits always take the torch path (the kernels compute in float32, as the torch path does for bf16/fp16/fp32).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from verl_dppo.math.kernels.jit import build_kernels as _kernels

__all__ = [
    "backend_for",
    "max_and_sum_exp_outside",
    "scaled_exp_into",
    "KERNELS_ENV",
    "triton_importable",
    "CPU_CHUNK_BYTES",
    "chunk_bytes_for",
    "logits_at",
    "top_threshold",
    "sum_exp_below",
    "LANES",
    "row_entropy",
    "max_sum_outside_and_entropy",
    "max_sum_outside_and_entropy_sums",
    "sorted_excluded",
]

KERNELS_ENV = "VERL_DPPO_KERNELS"
"""auto (default): Triton on CUDA tensors when it imports; torch: never; triton: always (CPU needs TRITON_INTERPRET=1)."""

CPU_CHUNK_BYTES = 8 * 2**20
"""The torch paths' float32 working set per chunk of rows on a CPU (8 MiB = 13 rows of Qwen3's 151,936-token
vocabulary): small enough to stay in cache-friendly sizes, large enough that per-chunk overheads do not show."""

GPU_CHUNK_SHARE = 1 / 32
"""On an accelerator the torch path's chunk is this share of the free memory, between CPU_CHUNK_BYTES and
GPU_CHUNK_MAX: a GPU pays a launch per small op per chunk, so CPU-sized chunks cost it several times the time of
large ones, and beyond GPU_CHUNK_MAX a larger chunk gains little (docs/benchmarks.md has the measured rows)."""

GPU_CHUNK_MAX = 256 * 2**20

_WARPS = 4
"""Launch shape: the best of the BLOCK x warps sweep (bench/kernel_sweep.py; its figures in docs/benchmarks.md)."""
_SENTINEL = 2**62  # sorts after every column id; never equals one
_BLOCK = 1024  # columns per step: 2 KiB of bf16 per load, 149 steps over Qwen3's 151,936-token vocabulary
LANES = _BLOCK
"""How many lanes `top_threshold` ranks: a threshold exists for up to LANES of a row's largest logits."""


def chunk_bytes_for(device: torch.device) -> int:
    """The torch paths' working set per chunk of rows on `device` (see CPU_CHUNK_BYTES and GPU_CHUNK_SHARE)."""
    if device.type == "cpu":
        return CPU_CHUNK_BYTES
    try:
        free = torch.get_device_module(device).mem_get_info(device)[0]
    except (AttributeError, RuntimeError):  # an accelerator without a free-memory query
        return CPU_CHUNK_BYTES
    return int(min(GPU_CHUNK_MAX, max(CPU_CHUNK_BYTES, free * GPU_CHUNK_SHARE)))


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install (no driver libraries): the torch path runs
        return False
    return True


def backend_for(tensor: torch.Tensor) -> str:
    """'triton' or 'torch' for work on `tensor` (see the module doc)."""
    choice = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"{KERNELS_ENV}={choice!r}: use auto, torch or triton")
    if choice == "torch" or tensor.dtype == torch.float64:  # the kernels compute in float32
        return "torch"
    if choice == "triton":
        if not triton_importable():
            raise RuntimeError(f"{KERNELS_ENV}=triton but Triton does not import here (pip install triton)")
        return "triton"
    return "triton" if tensor.is_cuda and triton_importable() else "torch"


def logits_at(logits: torch.Tensor, rows: Optional[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """logits[rows][:, ids] ([n, S]) in float32 at least, without copying whole rows."""
    picked = logits.gather(1, ids) if rows is None else logits[rows[:, None], ids]
    return picked.to(torch.promote_types(logits.dtype, torch.float32))


def _rows_arg(rows: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return rows.contiguous() if rows is not None else torch.empty(1, dtype=torch.long, device=like.device)


def sorted_excluded(excluded: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each row's excluded ids ascending, as the kernels walk them; ids outside [0, vocab) become sentinels."""
    ids = torch.where((excluded >= 0) & (excluded < vocab), excluded.long(), _SENTINEL)
    return ids.sort(dim=1).values.contiguous() if ids.shape[1] else ids


def _unit_stride(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"expected [N, V] logits, got {tuple(logits.shape)}")
    return logits if logits.stride(1) == 1 else logits.contiguous()


def max_and_sum_exp_outside(
    logits: torch.Tensor,
    excluded: torch.Tensor,
    rows: Optional[torch.Tensor] = None,
    row_max: Optional[torch.Tensor] = None,
    block: int = _BLOCK,
    num_warps: int = _WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, sum of exp(logit - max) over the columns not in `excluded`) per selected row, float32 [n] each.

    Args:
        logits: [N, V] any float dtype (read in place, never written).
        excluded: [n, S] column ids per selected row; ids outside [0, V) exclude nothing; repeats are harmless.
        rows: optional [n] row indices into `logits` (None: all N rows, n = N).
        row_max: optional [n] max to shift by (the vocabulary-parallel path's all-reduced max), instead of the row's own
            and returned as it is. A -inf max shifts by 0.
        block: columns per step (a power of two; tests use small ones).
    """
    return _max_and_sums(logits, excluded, rows, row_max, False, block, num_warps)[:2]


def row_entropy(logits: torch.Tensor, block: int = _BLOCK, num_warps: int = _WARPS) -> torch.Tensor:
    """The entropy of softmax(logits) per row, float32 [N], in one read: log1p(Z - 1) - sum exp(s) s / Z with s =
    logit - the row max, as the torch path (`fused_chunk.entropy_rows`) computes it. Both terms are >= 0, and Z - 1
    is summed apart from the max's own 1 (a float32 Z rounds 1 + 1e-9 to 1: 3.6% of H lost before issue 53.3), so
    the error is relative on every row: at most 1.2e-7 of H against float64 from flat rows (H = 11.9, V = 151,936)
    to 1 - p = 1e-12, float32 and bf16 logits (Triton's interpreter; tests/probes/kernel_agreement.py). A row that
    is -inf everywhere gives NaN, as there."""
    return _max_and_sums(
        logits, logits.new_empty(logits.shape[0], 0, dtype=torch.long), None, None, True, block, num_warps
    )[2]


def max_sum_outside_and_entropy(
    logits: torch.Tensor, excluded: torch.Tensor, block: int = _BLOCK, num_warps: int = _WARPS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, sum of exp(logit - max) outside `excluded`, entropy) per row, float32 [N] each, in one read: what
    `max_and_sum_exp_outside` (all rows, the row's own max) and `row_entropy` return, from the same kernel pass."""
    return _max_and_sums(logits, excluded, None, None, True, block, num_warps)


def max_sum_outside_and_entropy_sums(
    logits: torch.Tensor, excluded: torch.Tensor, block: int = _BLOCK, num_warps: int = _WARPS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, sum of exp(logit - max) outside `excluded`, [N, 2] sums) per row, float32, in one read: the sums are
    those `row_entropy` forms H from, before it does, with s = logit - the row max: Z - 1 (the max's own 1 left out;
    its ties keep theirs) and sum exp(s) s, as the torch path's `fused_chunk.entropy_sums` returns them: a
    vocabulary shard's, which the vocabulary-parallel pass rescales and sums across the shards."""
    return _max_and_sums(logits, excluded, None, None, "sums", block, num_warps)


def _max_and_sums(logits, excluded, rows, row_max, entropy, block, num_warps):
    """entropy: False, True (H per row) or "sums" (Z - 1 and sum exp(s) s per row, [n, 2])."""
    logits = _unit_stride(logits)
    n = logits.shape[0] if rows is None else rows.numel()
    vocab = logits.shape[1]
    sorted_ids = sorted_excluded(excluded, vocab)
    out_max = (
        torch.empty(n, dtype=torch.float32, device=logits.device)
        if row_max is None
        else row_max.to(torch.float32).contiguous()
    )
    out_sum = torch.empty(n, dtype=torch.float32, device=logits.device)
    sums = entropy == "sums"
    out_entropy = torch.empty((n, 2) if sums else n if entropy else 1, dtype=torch.float32, device=logits.device)
    if n == 0:
        return out_max, out_sum, out_entropy[:n]
    kernel = _kernels()[0]
    kernel[(n,)](
        logits,
        logits.stride(0),
        _rows_arg(rows, logits),
        sorted_ids,
        sorted_ids.shape[1],
        vocab,
        out_max,
        out_sum,
        out_entropy,
        HAS_ROWS=rows is not None,
        HAS_MAX=row_max is not None,
        ENTROPY=bool(entropy),
        SUMS=sums,
        BLOCK=block,
        num_warps=num_warps,
    )
    return out_max, out_sum, out_entropy


def top_threshold(
    logits: torch.Tensor, kth: int, rows: Optional[torch.Tensor] = None, block: int = _BLOCK, num_warps: int = _WARPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, a lower bound of the (kth + 1)-th largest logit) per selected row, float32 [n] each, in one read: the
    (kth + 1)-th largest of the `block` lanes' own maxima (distinct columns). -inf where fewer than kth + 1 lanes
    hold a finite logit. Needs kth < block."""
    logits = _unit_stride(logits)
    if not 0 <= kth < block:
        raise ValueError(f"kth must lie in [0, {block}), got {kth}")
    n = logits.shape[0] if rows is None else rows.numel()
    out_max = torch.empty(n, dtype=torch.float32, device=logits.device)
    out_threshold = torch.empty_like(out_max)
    if n:
        _kernels()[2][(n,)](
            logits,
            logits.stride(0),
            _rows_arg(rows, logits),
            logits.shape[1],
            kth,
            out_max,
            out_threshold,
            HAS_ROWS=rows is not None,
            BLOCK=block,
            num_warps=num_warps,
        )
    return out_max, out_threshold


def sum_exp_below(
    logits: torch.Tensor,
    excluded: torch.Tensor,
    row_max: torch.Tensor,
    threshold: torch.Tensor,
    capacity: int,
    rows: Optional[torch.Tensor] = None,
    block: int = _BLOCK,
    num_warps: int = _WARPS,
    presorted: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One read per selected row: (sum of exp(logit - row_max) over the columns below `threshold` and not in
    `excluded`, float32 [n]; how many columns lie at or above the threshold, int64 [n]; those columns' ids, int32
    [n, capacity] in no particular order, -1 after the row's count). A row whose count exceeds `capacity` has only
    `capacity` of them written (the caller reads that row another way); its sum is still that of the others.
    A -inf row_max shifts by 0. presorted: `excluded` is already as `sorted_excluded` gives it (a caller reading
    many chunks of the same rows sorts them once)."""
    logits = _unit_stride(logits)
    n = logits.shape[0] if rows is None else rows.numel()
    vocab = logits.shape[1]
    sorted_ids = excluded if presorted else sorted_excluded(excluded, vocab)
    out_sum = torch.empty(n, dtype=torch.float32, device=logits.device)
    count = torch.zeros(n, dtype=torch.int32, device=logits.device)
    candidates = torch.full((n, capacity), -1, dtype=torch.int32, device=logits.device)
    if n:
        _kernels()[3][(n,)](
            logits,
            logits.stride(0),
            _rows_arg(rows, logits),
            sorted_ids,
            sorted_ids.shape[1],
            vocab,
            row_max.to(torch.float32).contiguous(),
            threshold.to(torch.float32).contiguous(),
            out_sum,
            count,
            candidates,
            capacity,
            HAS_ROWS=rows is not None,
            BLOCK=block,
            num_warps=num_warps,
        )
    return out_sum, count.long(), candidates


def scaled_exp_into(
    out: torch.Tensor,
    logits: torch.Tensor,
    base: torch.Tensor,
    coef: torch.Tensor,
    rows: Optional[torch.Tensor] = None,
    block: int = _BLOCK,
    num_warps: int = _WARPS,
    entropy_term: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """out[r] = exp(logits[r] - base) * coef on the selected rows (others untouched), in out's dtype; returns out.

    entropy_term: optional per-row (log_z, entropy, entropy_coef), adding the entropy's gradient
    exp(log_p) (log_p + entropy) entropy_coef with log_p = logit - log_z (entropy_coef = -g_H: the fused backward's
    dL/dlogit of the entropy H, where logits are pi's).
    `out` may be `logits` itself (each element is read before it is written, by the same program)."""
    logits = _unit_stride(logits)
    if out.stride(1) != 1:
        raise ValueError("out must have unit column stride")
    n = logits.shape[0] if rows is None else rows.numel()
    if n:
        per_row = [t.to(torch.float32).contiguous() for t in (base, coef, *(entropy_term or ()))]
        if entropy_term is None:
            per_row += [per_row[0]] * 3  # not read
        kernel = _kernels()[1]
        kernel[(n,)](
            logits,
            logits.stride(0),
            out,
            out.stride(0),
            _rows_arg(rows, logits),
            *per_row[:2],
            logits.shape[1],
            *per_row[2:5],
            HAS_ROWS=rows is not None,
            ENTROPY=entropy_term is not None,
            BLOCK=block,
            num_warps=num_warps,
        )
    return out
