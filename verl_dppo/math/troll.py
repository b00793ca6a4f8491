"""TROLL: the differentiable KL trust-region projection on a sparse support, per token.

Becker, Freymuth, Thilges, Otto, Neumann 2025, "TROLL: Trust Regions improve Reinforcement Learning for Large
Language Models" (arXiv 2510.03817). Pure torch (no verl import). Entry points: `troll_token_terms` (from the
current policy's logits and the rollout's top-K, the per-token pieces of the loss), `troll_token_loss` (their Eq. 5
per token, to aggregate with verl's agg_loss), `kl_projection` (the projection on given atoms).

Per response token t, with pi the current policy, mu the rollout policy (known on the engine's top-K ids and on
the sampled token a_t) and Top(q) = q's most probable tokens until their mass reaches SUPPORT_MASS, at most TOPK:

    S_t     = Top(mu) U {a_t} U Top(pi)                   the sparse support (the union, each token once)
    atoms   = S_t U {other}                                pi', mu': pi and mu coarsened to the atoms
    p       = argmin_p KL(p || pi')  s.t.  KL(p || mu') <= eps                              (their Eq. 3/4)
    log p   = (log pi' + eta log mu') / (1 + eta) - log Z(eta),
              eta = 0 if KL(pi' || mu') <= eps, else the root of KL(p_eta || mu') = eps
    loss_t  = -(p(a_t) / mu'(a_t)) A_t + alpha KL(pi' || sg(p))                   (their Eq. 5, minimised)

Choices (the authors' code and prime-rl's re-implementation differ; see docs of each constant):
- "other" bucket. pi' and mu' keep the rest of the vocabulary as one atom instead of renormalising on S_t: both
  stay exact coarsenings (pi's tail mass is computed, not 1 - sum, so it is exact even for peaked rows), the
  projection sees mass leaving the support, and the gradient reaches every logit through pi'(other) (prime-rl
  notes that without it the regression term lets mass drift into the tail). It is the coarsening Top-K DPPO uses.
- mu outside its reported top-K. A token of Top(pi) that the engine did not report gets an equal share of the
  mass the engine left unreported (1 - reported mass - mu(a_t) if a_t is unreported), spread over the unreported
  vocabulary, and never more than the smallest reported probability (it ranks below all of them): prime-rl's
  uniform tail rather than the authors' fixed 1e-12, because that mass is the one fact the engine gives about
  the tail. mu'(other) is what remains. Both are floored at MU_FLOOR (the authors' tiny probability) and mu' is
  renormalised. Reported entries of -inf count as unreported; a_t's atom uses the rollout's log mu(a_t).
- eta by a batched bracketing search on log eta in LOG_ETA_BRACKET (Newton steps, bisection whenever Newton
  would leave the bracket), in float64 on the [n, |S| + 1] atoms only, to float64 resolution. Its gradient is the
  implicit derivative of F(eta, pi') = KL(p_eta || mu') - eps = 0: d eta / d log pi' = -(dF/d log pi') / (dF/d eta),
  attached as eta0 - (F(eta0, pi') - sg F) / sg(dF/d eta) (value eta0, that gradient), with
  dF/d eta = -Var_p(log p - log mu') / (1 + eta). prime-rl detaches eta; that is not the projection's gradient.

Memory and what backward keeps. The logits are read in row chunks of `chunk_bytes` (a float32 copy of a few rows
at a time, two reused buffers). The graph keeps the logits tensor itself (saved, not copied: verl holds it for its
own log-prob anyway) and [N, |S|]-sized tensors (ids, log pi at the ids, log Z, log Z of the tail); backward
recomputes softmax(logits) chunk by chunk and returns the gradient in the logits' dtype. No float32 [N, V] tensor
exists at any time. Backward therefore reads the logits' values and needs them unchanged: torch's version counter
catches in-place torch ops on them, and backward re-reads the logits at the support ids and raises if they differ
from the forward's, which catches writes that bypass the counter (verl's flash-attn cross entropy with
`inplace_backward=True` writes its gradient into the logits' storage; its backward runs before this one when its
node is newer, so a loss that takes gradient through verl's own log-prob and through TROLL must not use it).
`inplace_backward=True` makes this backward do what flash-attn does: write the gradient into the logits' storage
and return it, so that no second [N, V] tensor exists. Use it only when TROLL is the logits' last consumer in
backward; a later consumer that saved the logits fails loudly on the version counter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

__all__ = [
    "EPS",
    "ALPHA",
    "SUPPORT_MASS",
    "TOPK",
    "MU_FLOOR",
    "DEFAULT_CHUNK_BYTES",
    "MASS_TOLERANCE",
    "TrollInputError",
    "TrollTerms",
    "Projection",
    "troll_token_terms",
    "troll_token_loss",
    "kl_projection",
]

EPS = 0.05
"""Trust-region radius: KL(p || mu) <= eps per token (TROLL's reported value)."""

ALPHA = 1.0
"""Weight of the regression term KL(pi || sg(p)) in Eq. 5 (TROLL's reported value)."""

SUPPORT_MASS = 1.0 - 1e-5
"""A policy's support: its most probable tokens until their mass reaches 1 - delta, delta = 1e-5 (TROLL)."""

TOPK = 64
"""At most this many tokens per policy in the support (TROLL's K; the rollout must report at least K)."""

MU_FLOOR = 1e-12
"""Smallest probability mu' gives an atom (the unreported tail, "other"): the authors' tiny probability."""

DEFAULT_CHUNK_BYTES = 8 * 2**20
"""Float32 working set per chunk of rows (8 MiB = 13 rows of Qwen3's 151,936-token vocabulary)."""

MASS_TOLERANCE = 1e-3
"""mu's reported mass may exceed 1 by this much (rounding in the engine's log-softmax); more is an error."""

LOG_ETA_BRACKET = (-25.0, 25.0)
"""log eta is searched in this interval (eta from 1.4e-11 to 7.2e10)."""

SOLVER_STEPS = 100
"""At most this many safeguarded Newton steps on log eta (bisection alone needs 56 to reach float64 resolution)."""


class TrollInputError(ValueError):
    """The rollout's top-K statistics or the sampled tokens are malformed."""


class Projection(NamedTuple):
    """`kl_projection`'s result, per row: log p on the atoms (with gradient) and detached diagnostics."""

    log_p: torch.Tensor
    eta: torch.Tensor
    kl_before: torch.Tensor
    kl_after: torch.Tensor
    projected: torch.Tensor


@dataclass
class TrollTerms:
    """Per-token pieces of TROLL's loss ([N] each; 0 on rows not in the update).

    log_p_sampled: log p(a_t) of the projected policy, with gradient (through eta as well).
    regression_kl: KL(pi' || sg(p)) over the atoms, with gradient.
    log_mu_sampled: log mu'(a_t), the denominator of the ratio (detached).
    diagnostics: detached; "projected" (bool), "eta", "kl_before" = KL(pi' || mu'), "kl_after" = KL(p || mu'),
        "support_size" (|S_t|, "other" not counted), "valid" (bool: masked-in rows with a finite log mu(a_t)).
    """

    log_p_sampled: torch.Tensor
    regression_kl: torch.Tensor
    log_mu_sampled: torch.Tensor
    diagnostics: dict[str, torch.Tensor]


# --- the projection on atoms (float64, small tensors) ------------------------------------------------------------


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    # torch.logsumexp is many times slower than this on CPU in float64; rows hold at least one finite entry.
    top = x.amax(dim=1, keepdim=True)
    return top + (x - top).exp().sum(dim=1, keepdim=True).log()


def _log_geometric(log_pi: torch.Tensor, log_mu: torch.Tensor, eta: torch.Tensor, present: torch.Tensor):
    """log p_eta = (log pi + eta log mu) / (1 + eta) - log Z on the present atoms; finite garbage elsewhere."""
    z = (log_pi + eta * log_mu) / (1.0 + eta)
    return z - _logsumexp(torch.where(present, z, -math.inf))


def _kl(log_p: torch.Tensor, log_q: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    return torch.where(present, log_p.exp() * (log_p - log_q), 0.0).sum(dim=1)


def _excess_and_slope(log_pi, log_mu, present, log_eta, eps):
    """F = KL(p_eta || mu) - eps and dF/d log eta = -eta Var_p(log p - log mu) / (1 + eta), per row."""
    eta = log_eta.exp()[:, None]
    log_p = _log_geometric(log_pi, log_mu, eta, present)
    p = torch.where(present, log_p.exp(), 0.0)
    d = torch.where(present, log_p - log_mu, 0.0)
    mean = (p * d).sum(dim=1, keepdim=True)
    variance = (p * (d - mean) ** 2).sum(dim=1)
    return mean.squeeze(1) - eps, -(eta.squeeze(1) * variance) / (1.0 + eta.squeeze(1))


@torch.no_grad()
def _solve_log_eta(log_pi, log_mu, present, eps, kl_before):
    """The root of KL(p_eta || mu) = eps in log eta: Newton's method kept inside a shrinking bracket (a bisection
    step whenever Newton would leave it), batched; starts at the quadratic estimate eta = sqrt(KL(pi||mu)/eps) - 1.

    Returns (log eta, bracketed): rows whose root lies above the bracket get its upper end.
    """
    lo = torch.full_like(kl_before, LOG_ETA_BRACKET[0])
    hi = torch.full_like(kl_before, LOG_ETA_BRACKET[1])
    bracketed = _excess_and_slope(log_pi, log_mu, present, hi, eps)[0] <= 0
    x = ((kl_before / eps).sqrt() - 1.0).clamp(min=1e-6).log().clamp(*LOG_ETA_BRACKET)
    done = torch.zeros_like(bracketed)
    for _ in range(SOLVER_STEPS):
        excess, slope = _excess_and_slope(log_pi, log_mu, present, x, eps)
        lo = torch.where(excess > 0, x, lo)
        hi = torch.where(excess > 0, hi, x)
        newton = x - excess / slope.clamp(max=-1e-300)
        inside = (newton >= lo) & (newton <= hi)
        step = torch.where(done, 0.0, torch.where(inside, newton, 0.5 * (lo + hi)) - x)
        x = x + step
        # Converged: KL at eps to ~100 ulps, or the step or the bracket at float64 resolution of log eta.
        done |= (excess.abs() <= 1e-14) | (step.abs() <= 1e-13) | (hi - lo <= 1e-12 * (1.0 + x.abs()))
        if bool(done.all()):
            break
    return torch.where(bracketed, x, hi), bracketed


def kl_projection(log_pi: torch.Tensor, log_mu: torch.Tensor, eps: float = EPS) -> Projection:
    """p = argmin KL(p || pi) subject to KL(p || mu) <= eps, row by row, differentiable in log_pi.

    Args:
        log_pi: [n, A] log-probabilities on A atoms (renormalised here); -inf marks atoms with pi = 0 (p = 0 there).
        log_mu: [n, A] log-probabilities of mu (detached), finite wherever log_pi is.
        eps: the radius.

    Computed in float64. eta is exactly 0 on rows inside the ball (p = pi); elsewhere the root of
    KL(p_eta || mu) = eps (to float64 resolution), with the implicit-function gradient. A row whose root lies beyond
    LOG_ETA_BRACKET (only when pi has no mass on atoms where mu holds nearly everything) keeps the bracket's end,
    without the implicit term.
    """
    present = torch.isfinite(log_pi)
    mu = torch.where(present, log_mu.detach().double(), 0.0)
    pi = torch.where(present, log_pi.double(), 0.0)
    pi = pi - _logsumexp(torch.where(present, pi, -math.inf))
    n = pi.shape[0]

    with torch.no_grad():
        kl_before = _kl(pi.detach(), mu, present)
        projected = kl_before > eps
        rows = projected.nonzero().squeeze(1)
        eta0 = torch.zeros(n, dtype=torch.float64, device=pi.device)
        if rows.numel():
            log_eta, bracketed = _solve_log_eta(pi.detach()[rows], mu[rows], present[rows], eps, kl_before[rows])
            eta0[rows] = log_eta.exp()

    eta = eta0
    if rows.numel():
        # eta0 - (F - sg F) / sg(dF/d eta): the value eta0, the gradient -(dF/d log pi) / (dF/d eta).
        a, b, on, e0 = pi[rows], mu[rows], present[rows], eta0[rows]
        excess = _kl(_log_geometric(a, b, e0[:, None], on), b, on)
        slope = _excess_and_slope(a.detach(), b, on, e0.log(), eps)[1] / e0
        usable = bracketed & (slope < 0)
        implicit = torch.where(usable, -(excess - excess.detach()) / torch.where(usable, slope, -1.0), 0.0)
        eta = eta0.index_put((rows,), e0 + implicit)
    log_p = _log_geometric(pi, mu, eta[:, None], present)
    kl_after = _kl(log_p.detach(), mu, present)
    log_p = torch.where(present, log_p, -math.inf)
    return Projection(log_p, eta0, kl_before, kl_after, projected)


# --- pi on the support, from the full logits, chunk by chunk -----------------------------------------------------


def _candidates(sampled, mu_ids, pi_ids):
    """Every id that may enter S_t, {a_t} U mu's reported ids U Top-K(pi), sorted by id. `first` marks the first
    occurrence of each id, which comes from the best-known source for mu (a_t, then mu's report, then pi's top);
    `source` is the candidate column (0: a_t, 1..K: mu's report, then pi's top)."""
    candidates = torch.cat([sampled[:, None], mu_ids, pi_ids], dim=1)
    width = candidates.shape[1]
    key = (candidates * width + torch.arange(width, device=candidates.device)).sort(dim=1).values
    ids, source = key // width, key % width
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return candidates, ids, source, first


def _kept(ids, source, first, selected):
    """S_t: the ids with at least one selected occurrence (`selected` per candidate column), once each."""
    group = first.long().cumsum(dim=1) - 1
    group_selected = torch.zeros_like(ids).scatter_add_(1, group, selected.gather(1, source).long()) > 0
    return first & group_selected.gather(1, group)


class _PiOnSupport(torch.autograd.Function):
    """log pi at the support ids and log pi(other) from the full logits, with Top(pi) and S_t found on the way.

    Saves the logits (no copy), the support ids and [n]-sized log-normalisers; recomputes softmax in backward.
    Two float32 chunk buffers are reused across chunks (fresh multi-MiB allocations cost page faults on CPU).
    """

    @staticmethod
    def forward(ctx, logits, rows, sampled, mu_ids, mu_selected, topk, support_mass, rows_per_chunk, inplace):
        vocab = logits.shape[1]
        n = sampled.shape[0]
        reader = _ChunkReader(logits, rows, rows_per_chunk)
        k_pi = min(topk, vocab)
        width = 1 + mu_ids.shape[1] + k_pi
        dev = logits.device
        ids = torch.empty(n, width, dtype=torch.long, device=dev)
        source = torch.empty_like(ids)
        valid = torch.empty(n, width, dtype=torch.bool, device=dev)
        log_pi = torch.empty(n, width, dtype=reader.work, device=dev)
        log_z = torch.empty(n, dtype=reader.work, device=dev)
        log_z_tail = torch.empty_like(log_z)
        for start, end, block, scratch in reader:
            sampled_c, mu_ids_c = sampled[start:end], mu_ids[start:end]
            top_logits, top_ids = block.topk(k_pi, dim=1)
            row_max = top_logits[:, :1]
            shifted_exp = torch.sub(block, row_max, out=scratch).exp_()
            candidates, c_ids, c_source, c_first = _candidates(sampled_c, mu_ids_c, top_ids)
            c_exp = torch.where(c_first, shifted_exp.gather(1, c_ids), 0.0)
            rest = shifted_exp.scatter_(1, candidates, 0.0).sum(dim=1)  # one pass: every id that is no candidate
            lz = row_max.squeeze(1) + (rest + c_exp.sum(dim=1)).log()
            top_p = (top_logits - lz[:, None]).exp()
            pi_selected = (top_p.cumsum(dim=1) - top_p) < support_mass
            always = torch.ones_like(sampled_c[:, None], dtype=torch.bool)  # a_t
            keep = _kept(c_ids, c_source, c_first, torch.cat([always, mu_selected[start:end], pi_selected], dim=1))
            # pi(other) from the tail's own exponentials: exact however close pi's support mass is to 1.
            tail = rest + torch.where(keep, 0.0, c_exp).sum(dim=1)
            order = (~keep).long().argsort(dim=1, stable=True)  # S_t first; padding slots repeat a_t
            s_ids = torch.where(keep, c_ids, sampled_c[:, None]).gather(1, order)
            ids[start:end], source[start:end] = s_ids, c_source.gather(1, order)
            valid[start:end] = keep.gather(1, order)
            log_pi[start:end] = block.gather(1, s_ids) - lz[:, None]
            log_z[start:end] = lz
            log_z_tail[start:end] = row_max.squeeze(1) + tail.log()
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
        changed = torch.zeros((), dtype=torch.bool, device=logits.device)  # checked once, after the loop
        for start, end, block, scratch in _ChunkReader(logits, rows, ctx.rows_per_chunk):
            s_ids, s_valid = ids[start:end], valid[start:end]
            reread, before = block.gather(1, s_ids) - log_z[start:end, None], log_pi[start:end]
            changed |= (s_valid & (reread != before) & ~(reread.isnan() & before.isnan())).any()
            q = torch.sub(block, tail_base[start:end, None], out=scratch).exp_().scatter_(1, s_ids, 0.0)
            q.mul_(tail_coef[start:end, None]).scatter_add_(1, s_ids, on_support[start:end])
            if rows is None:
                grad[start:end].copy_(q)
            else:
                grad.index_copy_(0, rows[start:end], q.to(grad.dtype))
        if bool(changed):
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


# --- the public entry points -------------------------------------------------------------------------------------


def _check_inputs(logits, topk_ids, topk_logprobs, sampled_ids, sampled_logprobs, mask):
    if logits.dim() != 2 or not logits.is_floating_point():
        raise TrollInputError(f"logits must be a float [N, V] tensor, got {tuple(logits.shape)} {logits.dtype}")
    n = logits.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n or topk_ids.shape[1] < 1:
        raise TrollInputError(f"rollout_topk_ids must be [N={n}, K>=1], got {tuple(topk_ids.shape)}")
    if tuple(topk_logprobs.shape) != tuple(topk_ids.shape):
        raise TrollInputError(
            f"rollout_topk_logprobs {tuple(topk_logprobs.shape)} must match rollout_topk_ids {tuple(topk_ids.shape)}"
        )
    for name, t in (("sampled_ids", sampled_ids), ("rollout_sampled_logprobs", sampled_logprobs)):
        if tuple(t.shape) != (n,):
            raise TrollInputError(f"{name} must be [N={n}], got {tuple(t.shape)}")
    if topk_ids.is_floating_point() or sampled_ids.is_floating_point():
        raise TrollInputError("token ids must be integer tensors")
    if not (topk_logprobs.is_floating_point() and sampled_logprobs.is_floating_point()):
        raise TrollInputError("log-probs must be float tensors")
    if mask is not None and tuple(mask.shape) != (n,):
        raise TrollInputError(f"mask must be [N={n}], got {tuple(mask.shape)}")


def _validate_rows(mu_ids, mu_logprobs, sampled, vocab, mass_tolerance):
    if bool(((mu_ids < 0) | (mu_ids >= vocab)).any()) or bool(((sampled < 0) | (sampled >= vocab)).any()):
        raise TrollInputError(
            f"top-K or sampled token ids outside the vocabulary [0, {vocab}): the rollout engine and the actor "
            "use different vocabularies (check actor_rollout_ref.model.path and the tokenizer)"
        )
    if mu_ids.shape[1] > 1 and bool((mu_ids.sort(dim=1).values.diff(dim=1) == 0).any()):
        raise TrollInputError(
            "rollout_topk_ids repeat a token id within a row: the rollout's top-K extraction is broken"
        )
    if bool(torch.isnan(mu_logprobs).any()) or bool((mu_logprobs == math.inf).any()):
        raise TrollInputError("the rollout's top-K log-probs contain NaN or +inf")
    mass = torch.where(torch.isfinite(mu_logprobs), mu_logprobs.exp(), 0.0).sum(dim=1)
    if bool((mass > 1.0 + mass_tolerance).any()):
        raise TrollInputError(
            f"the rollout's top-K probabilities sum to {float(mass.max()):.4f} > 1: they are not log-probs of one "
            "distribution (actor_rollout_ref.rollout.logprobs_mode must be raw_logprobs or processed_logprobs)"
        )


def _mu_on_atoms(sampled, sampled_lp, mu_ids, mu_lp, ids, source, valid, vocab):
    """log mu' on S_t U {other} (float64): known where reported, the uniform unreported share elsewhere."""
    k = mu_ids.shape[1]
    reported = torch.isfinite(mu_lp)
    known = torch.cat([sampled_lp[:, None], mu_lp, torch.full_like(sampled_lp[:, None], -math.inf)], dim=1)
    slot_lp = known.gather(1, source.clamp(max=k + 1))
    sampled_reported = ((mu_ids == sampled[:, None]) & reported).any(dim=1)
    unreported_mass = 1.0 - torch.where(reported, mu_lp.exp(), 0.0).sum(dim=1)
    unreported_mass = unreported_mass - torch.where(sampled_reported, 0.0, sampled_lp.exp())
    unreported_count = vocab - reported.sum(dim=1) - (~sampled_reported).long()
    share = unreported_mass.clamp(min=MU_FLOOR).log() - unreported_count.clamp(min=1).double().log()
    share = torch.minimum(share, torch.where(reported, mu_lp, math.inf).amin(dim=1))
    slot_lp = torch.where(torch.isfinite(slot_lp), slot_lp, share[:, None])
    slot_lp = torch.where(valid, slot_lp, -math.inf)
    other = (1.0 - slot_lp.exp().sum(dim=1)).clamp(min=MU_FLOOR).log()
    atoms = torch.cat([slot_lp, other[:, None]], dim=1)
    return atoms - _logsumexp(atoms)


def _to_all_rows(values: torch.Tensor, rows: Optional[torch.Tensor], n: int, dtype) -> torch.Tensor:
    values = values.to(dtype)
    if rows is None:
        return values
    return torch.zeros(n, dtype=dtype, device=values.device).index_put((rows,), values)


def troll_token_terms(
    logits: torch.Tensor,
    rollout_topk_ids: torch.Tensor,
    rollout_topk_logprobs: torch.Tensor,
    sampled_ids: torch.Tensor,
    rollout_sampled_logprobs: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    eps: float = EPS,
    support_mass: float = SUPPORT_MASS,
    topk: int = TOPK,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    mass_tolerance: float = MASS_TOLERANCE,
    inplace_backward: bool = False,
) -> TrollTerms:
    """TROLL's per-token pieces from the current policy's logits and the rollout's top-K (see the module doc).

    Args:
        logits: [N, V] logits of pi (any float dtype, temperature applied), usually with gradient.
        rollout_topk_ids: [N, K] the rollout engine's most likely token ids under mu (distinct per row, any order).
        rollout_topk_logprobs: [N, K] log mu of those ids; -inf entries count as unreported.
        sampled_ids: [N] the sampled tokens a_t.
        rollout_sampled_logprobs: [N] log mu(a_t) from the engine. Rows where it is NaN or +-inf are dropped
            (no finite ratio; diagnostics["valid"] is False), as in DPPO.
        mask: optional [N] bool; rows where it is False are neither read nor validated.
        eps: trust-region radius. support_mass, topk: the support rule (1 - delta, K).
        chunk_bytes: float32 working set per chunk of rows, forward and backward.
        mass_tolerance: mu's reported mass may exceed 1 by this much.
        inplace_backward: the backward writes the logits' gradient into the logits' storage (see the module doc).

    Returns:
        TrollTerms, [N] tensors in float32 (float64 for float64 logits); rows not in the update hold 0.

    Raises:
        TrollInputError: ids outside [0, V), a row repeating a top-K id, NaN/+inf top-K log-probs, mu's reported
            mass above 1 + mass_tolerance.
    """
    _check_inputs(logits, rollout_topk_ids, rollout_topk_logprobs, sampled_ids, rollout_sampled_logprobs, mask)
    if not (eps > 0 and 0 < support_mass <= 1 and topk >= 1):
        raise TrollInputError(f"need eps > 0, 0 < support_mass <= 1, topk >= 1; got {eps}, {support_mass}, {topk}")
    n, vocab = logits.shape
    out_dtype = torch.promote_types(logits.dtype, torch.float32)
    dev = logits.device
    sampled_lp_all = rollout_sampled_logprobs.detach().double()
    valid_rows = torch.isfinite(sampled_lp_all)
    if mask is not None:
        valid_rows &= mask.bool()
    rows = valid_rows.nonzero().squeeze(1)
    zeros = torch.zeros(n, dtype=out_dtype, device=dev)
    if rows.numel() == 0:
        diagnostics = {"projected": torch.zeros_like(valid_rows), "eta": zeros, "kl_before": zeros, "kl_after": zeros}
        diagnostics.update(support_size=torch.zeros(n, dtype=torch.long, device=dev), valid=valid_rows)
        return TrollTerms(zeros, zeros, zeros, diagnostics)  # no gradient: nothing in the update
    rows_arg = None if rows.numel() == n else rows
    sampled = sampled_ids[rows].long()
    sampled_lp = sampled_lp_all[rows]
    mu_lp = rollout_topk_logprobs[rows].detach().double()
    mu_ids = rollout_topk_ids[rows].long()
    _validate_rows(mu_ids, mu_lp, sampled, vocab, mass_tolerance)

    # Top(mu): the reported ids by decreasing probability until the mass reaches support_mass, at most topk.
    mu_lp, order = mu_lp.sort(dim=1, descending=True)
    mu_ids = mu_ids.gather(1, order)
    mu_p = torch.where(torch.isfinite(mu_lp), mu_lp.exp(), 0.0)
    rank = torch.arange(mu_ids.shape[1], device=dev)
    mu_selected = ((mu_p.cumsum(dim=1) - mu_p) < support_mass) & torch.isfinite(mu_lp) & (rank < topk)

    work_bytes = torch.finfo(torch.promote_types(logits.dtype, torch.float32)).bits // 8
    rows_per_chunk = max(1, chunk_bytes // (work_bytes * vocab))
    ids, source, slot_valid, log_pi_s, log_pi_other = _PiOnSupport.apply(
        logits, rows_arg, sampled, mu_ids, mu_selected, topk, support_mass, rows_per_chunk, inplace_backward
    )
    log_mu = _mu_on_atoms(sampled, sampled_lp, mu_ids, mu_lp, ids, source, slot_valid, vocab)
    log_pi = torch.cat([log_pi_s.double(), log_pi_other.double()[:, None]], dim=1)
    present = torch.cat([slot_valid, torch.isfinite(log_pi_other)[:, None]], dim=1) & torch.isfinite(log_pi)
    log_pi = torch.where(present, log_pi, -math.inf)
    projection = kl_projection(log_pi, log_mu, eps)

    slot = ((ids == sampled[:, None]) & slot_valid).long().argmax(dim=1, keepdim=True)
    log_p_sampled = projection.log_p.gather(1, slot).squeeze(1)
    pi_on = torch.where(present, log_pi, 0.0)
    pi_on = pi_on - _logsumexp(torch.where(present, pi_on, -math.inf))
    log_p_det = torch.where(present, projection.log_p.detach(), 0.0)
    regression_kl = torch.where(present, pi_on.exp() * (pi_on - log_p_det), 0.0).sum(dim=1)
    log_mu_sampled = log_mu.gather(1, slot).squeeze(1)

    diagnostics = {
        "projected": _to_all_rows(projection.projected, rows_arg, n, torch.bool),
        "eta": _to_all_rows(projection.eta, rows_arg, n, torch.float32),
        "kl_before": _to_all_rows(projection.kl_before, rows_arg, n, torch.float32),
        "kl_after": _to_all_rows(projection.kl_after, rows_arg, n, torch.float32),
        "support_size": _to_all_rows(slot_valid.sum(dim=1), rows_arg, n, torch.long),
        "valid": valid_rows,
    }
    return TrollTerms(
        log_p_sampled=_to_all_rows(log_p_sampled, rows_arg, n, out_dtype),
        regression_kl=_to_all_rows(regression_kl, rows_arg, n, out_dtype),
        log_mu_sampled=_to_all_rows(log_mu_sampled, rows_arg, n, out_dtype),
        diagnostics=diagnostics,
    )


def troll_token_loss(terms: TrollTerms, advantages: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """Eq. 5 per token, minimised: -(p(a_t) / mu'(a_t)) A_t + alpha KL(pi' || sg(p)); 0 on rows not in the update.

    No ratio clipping (the projection is the trust region). Aggregate with verl's agg_loss and the response mask.
    """
    ratio = torch.exp(terms.log_p_sampled - terms.log_mu_sampled)
    loss = -ratio * advantages.to(ratio.dtype) + alpha * terms.regression_kl
    return torch.where(terms.diagnostics["valid"], loss, 0.0)
