"""An independent float64 reference of the paper's Eq. (9), (11)-(16) and the options, written from the equations
(no code shared with verl_dppo), for the tests to compare against; and the LLM-like rows to compare on."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import weakref
from pathlib import Path
from typing import Optional

import torch


def divergence(mode: str, anchor_p: float, pi_p: float) -> float:
    if mode == "dppo_binary_tv":  # Eq. (13)
        return abs(anchor_p - pi_p)
    if mode == "dppo_binary_kl":  # Eq. (14), 0 log 0 = 0
        kl = 0.0
        if anchor_p > 0:
            kl += anchor_p * math.log(anchor_p / pi_p) if pi_p > 0 else math.inf
        if anchor_p < 1:
            kl += (1 - anchor_p) * math.log((1 - anchor_p) / (1 - pi_p)) if pi_p < 1 else math.inf
        return kl
    if mode == "grpo_clip":  # Eq. (9): the ratio leaves [1 - eps_low, 1 + eps_high]
        return abs(pi_p / anchor_p - 1)
    raise ValueError(mode)


def token_coefficient(mode, A, pi_lp, mu_lp, anchor_lp, delta_low, delta_high, cap, relax_below=0.0, relax_side="high"):
    """-M_t * min(r_t, C) * A_t: d loss_t / d log pi(a_t) (before aggregation)."""
    pi_p, mu_p, anchor_p = math.exp(pi_lp), math.exp(mu_lp), math.exp(anchor_lp)
    r = pi_p / mu_p
    blocked = False
    if mode != "pg_is":
        D = divergence(mode, anchor_p, pi_p)
        r_anchor = pi_p / anchor_p
        high = A > 0 and r_anchor > 1 and D > delta_high
        low = A < 0 and r_anchor < 1 and D > delta_low
        if relax_below > 0 and mu_p < relax_below:
            high = high and relax_side not in ("high", "both")
            low = low and relax_side not in ("low", "both")
        blocked = high or low
    return 0.0 if blocked else -min(r, cap) * A


def reference_loss(mode, A, pi, mu, anchor, lens, agg, delta_low, delta_high, cap, horizon=None, **relax):
    """Returns (loss, per-token gradient d loss / d log pi) for rows of lists, rows truncated to `lens`."""
    coefs = [
        [
            token_coefficient(mode, A[i][t], pi[i][t], mu[i][t], anchor[i][t], delta_low, delta_high, cap, **relax)
            for t in range(lens[i])
        ]
        for i in range(len(lens))
    ]
    n_tokens = sum(lens)
    n_seqs = sum(1 for n in lens if n > 0)
    grads = []
    for i, row in enumerate(coefs):
        if agg == "token-mean":
            scale = [1 / n_tokens] * len(row)
        elif agg == "token-sum":
            scale = [1.0] * len(row)
        elif agg == "seq-mean-token-mean":
            scale = [1 / (len(row) * n_seqs)] * len(row)
        elif agg == "seq-mean-token-sum":
            scale = [1 / n_seqs] * len(row)
        elif agg == "seq-mean-token-sum-norm":
            scale = [1 / (n_seqs * horizon)] * len(row)
        else:
            raise ValueError(agg)
        grads.append([c * s for c, s in zip(row, scale)])
    loss = sum(g * pi[i][t] for i, row in enumerate(grads) for t, g in enumerate(row))
    return loss, grads


def ipo_reference(A, pi, mu, anchor, lens, agg, eps_low, eps_high, cap, tau):
    """IPO (prime-rl) in float64, from its definition: a token is dropped where |anchor(a) - pi(a)| > eps (eps_high
    for A > 0, eps_low otherwise), whatever the sign of A or the way pi moved; loss_t = -M_t * min(pi/mu, C) * A_t *
    log pi(a_t) + tau * (log pi(a_t) - log mu(a_t))^2. Returns (loss, d loss / d log pi per token), aggregated as
    `reference_loss` does (token-mean, token-sum)."""
    values, grads = [], []
    for i, n in enumerate(lens):
        row_values, row_grads = [], []
        for t in range(n):
            a, lp, lmu = A[i][t], pi[i][t], mu[i][t]
            kept = abs(math.exp(anchor[i][t]) - math.exp(lp)) <= (eps_high if a > 0 else eps_low)
            coefficient = -min(math.exp(lp - lmu), cap) * a if kept else 0.0
            row_values.append(coefficient * lp + tau * (lp - lmu) ** 2)
            row_grads.append(coefficient + 2 * tau * (lp - lmu))
        values.append(row_values)
        grads.append(row_grads)
    scale = {"token-mean": 1.0 / sum(lens), "token-sum": 1.0}[agg]
    return (sum(v for row in values for v in row) * scale, [[g * scale for g in row] for row in grads])


# ---------------------------------------------------------------------------------------------------------------
# Binary divergences, Eq. (13)/(14), on tensors of log-probs.

FLOAT32_TINY = torch.finfo(torch.float32).tiny


def binary_reference(mu_logprob, pi_logprob, floor: float = FLOAT32_TINY):
    """Eq. (13) and (14) per token in float64 from the log-probs as given: TV = |mu(a) - pi(a)|, KL of the
    Bernoullis (mu(a), 1 - mu(a)) || (pi(a), 1 - pi(a)), 1 - p = -expm1(log p), every probability floored at
    `floor` (binary_kl's documented floor: float32's smallest normal number, which keeps KL finite)."""
    mu_lp, pi_lp = mu_logprob.double(), pi_logprob.double()
    tv = (mu_lp.exp() - pi_lp.exp()).abs()
    kl = torch.zeros_like(mu_lp)
    for mu_p, pi_p in ((mu_lp.exp(), pi_lp.exp()), (-torch.expm1(mu_lp), -torch.expm1(pi_lp))):
        mu_p, pi_p = mu_p.clamp(min=floor), pi_p.clamp(min=floor)
        kl = kl + mu_p * (mu_p.log() - pi_p.log())
    return tv, kl


def eq12_blocked(advantage: float, log_ratio: float, divergence: float, delta_low: float, delta_high: float) -> bool:
    """1 - M_t of Eq. (12), in exact arithmetic on the given numbers (r_t > 1 iff log r_t > 0)."""
    high = advantage > 0 and log_ratio > 0 and divergence > delta_high
    low = advantage < 0 and log_ratio < 0 and divergence > delta_low
    return high or low


# ---------------------------------------------------------------------------------------------------------------
# Top-K divergences, Eq. (15)/(16), on whole rows.

TV_ATOL = 1e-4
"""Issue 8: Top-K D_TV within 1e-4 (absolute) of `topk_reference`."""
KL_RTOL, KL_FLOOR = 0.02, 1e-4
"""Issue 8: Top-K D_KL within 2% of `topk_reference`, relative to max(reference, 1e-4): 2e-6 absolute near 0."""


def topk_reference(logits, topk_ids, topk_logprobs, sampled_ids, sampled_logprobs):
    """Eq. (15)/(16) per row in float64, from the very inputs `topk_divergence` receives.

    pi is the float64 softmax of the logits as given (bf16-rounded logits are the policy): pi'(x) on A'_t and
    pi'(other) = the sum of pi over the vocabulary outside A'_t, summed directly (never 1 - kept mass).
    mu is what the rollout engine reports: its top-K (and a_t's) float32 log-probs, upcast; mu'(other) =
    max(0, 1 - mu's kept mass). Those log-probs are float32 roundings (relative 6e-8 of |log mu|), so mu'(other)
    carries an error of up to ~1e-7 that no implementation can remove: the reference keeps the same inputs, and
    "the true value" is the divergence of the inputs as given. A KL term this error can move, ~1e-7 x log(1e-7 /
    pi'(other)), stays below KL_FLOOR.
    """
    logits, topk_ids, sampled_ids = logits.double(), topk_ids.long(), sampled_ids.long()
    pi = torch.softmax(logits, dim=-1)
    in_topk = (topk_ids == sampled_ids[:, None]).any(dim=1)
    kept = torch.zeros_like(pi, dtype=torch.bool)
    kept.scatter_(1, topk_ids, True)
    kept.scatter_(1, sampled_ids[:, None], True)
    pi_kept = torch.cat([pi.gather(1, topk_ids), pi.gather(1, sampled_ids[:, None])], dim=1)
    pi_other = torch.where(kept, 0.0, pi).sum(dim=1)
    mu_kept = torch.cat([topk_logprobs.double(), sampled_logprobs.double()[:, None]], dim=1).exp()
    mu_kept[:, -1] = torch.where(in_topk, 0.0, mu_kept[:, -1])  # a_t in the top-K counts once
    pi_kept[:, -1] = torch.where(in_topk, 0.0, pi_kept[:, -1])
    mu_other = (1.0 - mu_kept.sum(dim=1)).clamp(min=0.0)
    mu_r = torch.cat([mu_kept, mu_other[:, None]], dim=1)
    pi_r = torch.cat([pi_kept, pi_other[:, None]], dim=1)
    tv = 0.5 * (mu_r - pi_r).abs().sum(dim=1)
    kl_terms = torch.where(mu_r > 0, mu_r * (mu_r.log() - pi_r.log()), torch.zeros_like(mu_r))
    return tv, kl_terms.sum(dim=1)


def exact_divergences(mu_logp: torch.Tensor, pi_logp: torch.Tensor):
    """TV and KL(mu || pi) over the whole vocabulary, float64, from full log-prob rows."""
    mu_logp, pi_logp = mu_logp.double(), pi_logp.double()
    mu, pi = mu_logp.exp(), pi_logp.exp()
    kl_terms = torch.where(mu > 0, mu * (mu_logp - pi_logp), torch.zeros_like(mu))
    return 0.5 * (mu - pi).abs().sum(dim=-1), kl_terms.sum(dim=-1)


def topk_mismatch(tv, kl, ref_tv, ref_kl) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows outside issue 8's tolerances (TV_ATOL; KL_RTOL x max(ref, KL_FLOOR)), or not finite where the reference
    is; the two bool masks (TV, KL)."""
    tv, kl, ref_tv, ref_kl = tv.double(), kl.double(), ref_tv.double(), ref_kl.double()
    bad_tv = ~((tv - ref_tv).abs() <= TV_ATOL)
    finite = torch.isfinite(ref_kl)
    close = (kl - ref_kl).abs() <= KL_RTOL * ref_kl.clamp(min=KL_FLOOR)
    bad_kl = torch.where(finite, ~close, kl != ref_kl)
    return bad_tv, bad_kl


# ---------------------------------------------------------------------------------------------------------------
# Rows shaped like a real LLM's next-token distributions.


def llm_logits(
    rows: int, vocab: int, seed: int, top1_prob: Optional[float] = None, spread: float = 2.0
) -> torch.Tensor:
    """float64 [rows, vocab] logits: a body N(0, spread^2), 1/8 of the vocabulary ~100 nats below the rest (log-probs
    down to -100 and beyond), and, with top1_prob, one dominant token per row at exactly that probability (peaked
    rows: 1 - 1e-9 .. 1 - 1e-3). Without it the rows are flat: no token above a few per cent."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * spread
    deep = torch.rand(rows, vocab, generator=gen) < 0.125
    logits = torch.where(deep, logits - 100.0, logits)
    if top1_prob is not None:
        top = torch.randint(0, vocab, (rows,), generator=gen)
        logits[torch.arange(rows), top] = -math.inf
        rest = torch.logsumexp(logits, dim=-1)
        logits[torch.arange(rows), top] = rest + math.log(top1_prob) - math.log1p(-top1_prob)
    return logits


def rollout_topk(
    mu_logits: torch.Tensor, k: int, seed: int, inside: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the rollout engine reports for mu = softmax(mu_logits): (full float64 log mu, top-K ids, their float32
    log-probs, a_t, float32 log mu(a_t)). a_t is drawn inside the top-K, or outside it (half the rows just below
    the top-K, half anywhere below, down into the -100 tail)."""
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = mu_logits.shape
    mu_logp = torch.log_softmax(mu_logits.double(), dim=-1)
    order = mu_logp.argsort(dim=-1, descending=True)
    if inside:
        rank = torch.randint(0, k, (rows,), generator=gen)
    else:
        rank = torch.randint(k, vocab, (rows,), generator=gen)
        rank[::2] = k
    sampled = order[torch.arange(rows), rank]
    topk_ids = order[:, :k]
    topk_lp = mu_logp.gather(1, topk_ids).float()
    sampled_lp = mu_logp.gather(1, sampled[:, None]).squeeze(1).float()
    return mu_logp, topk_ids, topk_lp, sampled, sampled_lp


def entropy_reference(logits: torch.Tensor) -> torch.Tensor:
    """The entropy of softmax(logits) per row in float64, relative to H on peaked rows too: log1p of Z - 1 summed
    without the max's own 1 (a float64 1 + 1e-12 keeps only 4 digits of the 1e-12), minus sum exp(s) s / Z."""
    x = logits.double()
    shifted = x - x.amax(dim=1, keepdim=True)
    e = shifted.exp()
    top = torch.zeros_like(e, dtype=torch.bool).scatter_(1, x.argmax(dim=1, keepdim=True), True)
    rest = torch.where(top, 0.0, e).sum(dim=1)
    weighted = torch.where(e > 0, e * shifted, 0.0).sum(dim=1)
    return torch.log1p(rest) - weighted / (1.0 + rest)


# ---------------------------------------------------------------------------------------------------------------
# Waits for the device, counted on the CPU (issue 54.2).

_HOST_READS = (
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
    "masked_select",
)
"""Tensor methods that read a tensor back to the host: on a GPU each one waits for the device to get there."""
_HOST_COPIES = ("tensor", "as_tensor", "nonzero", "masked_select", "unique", "repeat_interleave")
"""torch functions that either read back (an output sized by the data) or copy host data to the device (a
blocking copy, a stream sync on CUDA)."""


@contextlib.contextmanager
def host_reads():
    """Counts the calls of verl_dppo's own code (the first frame outside torch, and outside this helper) that wait
    for the device: a tensor read back (`item`, `tolist`, `bool(t)`, `int(t)`, `nonzero`, ...), a tensor built from
    host data (`torch.tensor`), or indexing by a bool tensor. Yields a list; each counted call appends 'name at
    file:line'. Calls from other code (Triton's interpreter, torch internals called by torch) are not counted."""
    package = str(Path(__file__).resolve().parents[1] / "verl_dppo")
    here, counted, saved = str(Path(__file__).resolve()), [], []

    def wrap(owner, name):
        original = getattr(owner, name)

        @functools.wraps(original)
        def counting(*args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and (
                f"{os.sep}torch{os.sep}" in frame.f_code.co_filename or frame.f_code.co_filename == here
            ):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(package):
                if name not in ("__getitem__", "__setitem__") or any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool
                    for i in (args[1] if isinstance(args[1], tuple) else (args[1],))
                ):
                    counted.append(f"{name} at {frame.f_code.co_filename}:{frame.f_lineno}")
            return original(*args, **kwargs)

        saved.append((owner, name, original, name in vars(owner)))
        setattr(owner, name, counting)

    for name in (*_HOST_READS, "__getitem__", "__setitem__"):
        wrap(torch.Tensor, name)
    for name in _HOST_COPIES:
        wrap(torch, name)
    try:
        yield counted
    finally:
        for owner, name, original, own in reversed(saved):
            if own:
                setattr(owner, name, original)
            else:  # inherited (torch.Tensor's C base): the class gets its lookup back
                delattr(owner, name)


# ---------------------------------------------------------------------------------------------------------------
# Peak memory of torch's ops, counted on the CPU (issue 54.2).


@contextlib.contextmanager
def live_bytes():
    """The bytes of the tensors torch's ops create inside the block while they are alive (each storage once, freed
    when its last tensor goes): yields a dict whose "peak" is the most alive at once. Tensors created before the
    block are not counted; the outputs still alive at its end are."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    state = {"live": 0, "peak": 0}
    storages: dict[int, int] = {}

    class Live(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t._base is None:
                    key = t.untyped_storage().data_ptr()
                    if key in storages or key == 0:
                        continue
                    storages[key] = size = t.untyped_storage().nbytes()
                    state["live"] += size
                    state["peak"] = max(state["peak"], state["live"])
                    weakref.finalize(t, _released, state, storages, key)
            return out

    with Live():
        yield state


def _released(state: dict, storages: dict, key: int) -> None:
    state["live"] -= storages.pop(key, 0)
