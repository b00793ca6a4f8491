"""TROLL: the differentiable KL trust-region projection on a sparse support, per token.

Becker, Freymuth, Thilges, Otto, Neumann 2025, "TROLL: Trust Regions improve Reinforcement Learning for Large
Language Models" (arXiv 2510.03817). Pure torch (no verl import). Entry points: `troll_token_terms` (from the
current policy's logits and the rollout's top-K, the per-token pieces of the loss), `troll_token_loss` (their Eq. 5
per token, to aggregate with verl's agg_loss), `kl_projection` (the projection on given atoms). The code is in
four modules: this one (inputs, the per-token terms, the loss), `troll_support` (the sparse support from the
logits, chunked or by the kernels), `troll_support_grad` (pi on it with its autograd) and `troll_projection` (the
projection and eta's solver).

Per response token t, with pi the current policy, mu the rollout policy (known on the engine's top-K ids and on
the sampled token a_t) and Top(q) = q's most probable tokens until their mass reaches SUPPORT_MASS, at most TOPK,
taken in whole groups of tied values (`troll_support.top_selected` says why):

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
  the tail. mu'(other) is what remains. Each of these atoms is then floored at MU_FLOOR (the authors' tiny
  probability per token; the floor wins over the cap when the smallest reported probability is below it), and mu'
  is renormalised. Reported entries of -inf count as unreported; a_t's atom uses the rollout's log mu(a_t).
- eta by a batched bracketing search on log eta in LOG_ETA_BRACKET (Newton steps, bisection whenever Newton
  would leave the bracket), in float64 on the [n, |S| + 1] atoms only, to float64 resolution. Its gradient is the
  implicit derivative of F(eta, pi') = KL(p_eta || mu') - eps = 0: d eta / d log pi' = -(dF/d log pi') / (dF/d eta),
  attached as eta0 - (F(eta0, pi') - sg F) / sg(dF/d eta) (value eta0, that gradient), with
  dF/d eta = -Var_p(log p - log mu') / (1 + eta). prime-rl detaches eta; that is not the projection's gradient.
- The ratio p(a_t) / mu'(a_t) as the DPPO modes take theirs (`capped_ratio`): exp(min(log r, MAX_LOG_RATIO = 20)),
  with the gradient the capped weight times d log p(a_t). A token the engine gave log mu(a_t) = -100 reaches
  log r = 95 (float32's exp overflows at 88.7); neither the authors' code nor prime-rl bounds it. Below the cap
  the loss and its gradient are Eq. 5's exactly.

Memory and what backward keeps. On a GPU the logits are read in place by `verl_dppo.math.kernels` (torch's top-k
for Top(pi), one kernel for the tail's sum, one for the backward); elsewhere in row chunks of `chunk_bytes` (a
float32 copy of a few rows at a time, two reused buffers). The graph keeps the logits tensor itself (saved, not copied: verl holds it for its
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
from typing import Callable, Optional, Sequence

import torch

from verl_dppo.math.divergence import MAX_LOG_RATIO  # the DPPO modes' cap, for Eq. 5's ratio
from verl_dppo.math.kernels import CPU_CHUNK_BYTES, chunk_bytes_for
from verl_dppo.math.topk import check_topk_inputs
from verl_dppo.math.troll_projection import (  # noqa: F401  (LOG_ETA_BRACKET, SOLVER_STEPS: re-exported)
    EPS,
    LOG_ETA_BRACKET,
    SOLVER_STEPS,
    Projection,
    _logsumexp,
    kl_projection,
)
from verl_dppo.math.troll_support import top_selected
from verl_dppo.math.troll_support_grad import pi_on_support

__all__ = [
    "EPS",
    "ALPHA",
    "SUPPORT_MASS",
    "TOPK",
    "MU_FLOOR",
    "DEFAULT_CHUNK_BYTES",
    "MASS_TOLERANCE",
    "MAX_LOG_RATIO",
    "TrollInputError",
    "TrollTerms",
    "Projection",
    "troll_token_terms",
    "troll_terms_from_support",
    "troll_token_loss",
    "capped_ratio",
    "kl_projection",
]

ALPHA = 1.0
"""Weight of the regression term KL(pi || sg(p)) in Eq. 5 (TROLL's reported value)."""

SUPPORT_MASS = 1.0 - 1e-5
"""A policy's support: its most probable tokens until their mass reaches 1 - delta, delta = 1e-5 (TROLL)."""

TOPK = 64
"""At most this many tokens per policy in the support (TROLL's K; the rollout must report at least K)."""

DEFAULT_CHUNK_BYTES = CPU_CHUNK_BYTES
"""Float32 working set per chunk of rows on a CPU; on a GPU the chunk follows free memory (`chunk_bytes_for`)."""

MASS_TOLERANCE = 1e-3
"""mu's reported mass may exceed 1 by this much (rounding in the engine's log-softmax); more is an error."""

MU_FLOOR = 1e-12
"""Smallest probability mu' gives an atom it has no report for (each token of S_t outside mu's report, and "other"),
per atom: the authors' tiny probability of a token outside their support."""


def mu_on_atoms(sampled, sampled_lp, mu_ids, mu_lp, ids, source, valid, vocab):
    """log mu' on S_t U {other} (float64): known where reported, elsewhere the uniform unreported share capped at the
    smallest reported probability; that share and mu'(other) each floored at MU_FLOOR, then renormalised."""
    k = mu_ids.shape[1]
    reported = torch.isfinite(mu_lp)
    known = torch.cat([sampled_lp[:, None], mu_lp, torch.full_like(sampled_lp[:, None], -math.inf)], dim=1)
    slot_lp = known.gather(1, source.clamp(max=k + 1))
    sampled_reported = ((mu_ids == sampled[:, None]) & reported).any(dim=1)
    unreported_mass = 1.0 - torch.where(reported, mu_lp.exp(), 0.0).sum(dim=1)
    unreported_mass = unreported_mass - torch.where(sampled_reported, 0.0, sampled_lp.exp())
    unreported_count = vocab - reported.sum(dim=1) - (~sampled_reported).long()
    share = (unreported_mass / unreported_count.clamp(min=1)).clamp(min=0.0).log()
    share = torch.minimum(share, torch.where(reported, mu_lp, math.inf).amin(dim=1))
    # Per atom, last: no token without a report gets less than the authors' fixed tiny probability, whatever the
    # vocabulary size or the rounding of the reported mass (which can leave nothing, or less than nothing, over).
    share = share.clamp(min=math.log(MU_FLOOR))
    slot_lp = torch.where(torch.isfinite(slot_lp), slot_lp, share[:, None])
    slot_lp = torch.where(valid, slot_lp, -math.inf)
    other = (1.0 - slot_lp.exp().sum(dim=1)).clamp(min=MU_FLOOR).log()
    atoms = torch.cat([slot_lp, other[:, None]], dim=1)
    return atoms - _logsumexp(atoms)


class TrollInputError(ValueError):
    """The rollout's top-K statistics or the sampled tokens are malformed."""


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


# --- the public entry points -------------------------------------------------------------------------------------


Problem = tuple[torch.Tensor, Callable[[torch.Tensor], None]]
"""(bool [N], True at a row whose input is wrong; raises the problem's error given the rows checked, a bool [N]: called
on the error path only, where its details may wait for the device)."""


def _input_problems(mu_ids, mu_logprobs, sampled, vocab, mass_tolerance) -> list[Problem]:
    """The rollout's rows checked on the device, per row ([N, K] top-K ids and float64 log-probs, [N] a_t), in the
    order they are raised: ids outside the vocabulary, a repeated top-K id, NaN/+inf log-probs, mass above 1."""
    outside = ((mu_ids < 0) | (mu_ids >= vocab)).any(dim=1) | (sampled < 0) | (sampled >= vocab)

    def out_of_range(_keep):
        raise TrollInputError(
            f"top-K or sampled token ids outside the vocabulary [0, {vocab}): the rollout engine and the actor "
            "use different vocabularies (check actor_rollout_ref.model.path and the tokenizer)"
        )

    def repeated(_keep):
        raise TrollInputError(
            "rollout_topk_ids repeat a token id within a row: the rollout's top-K extraction is broken"
        )

    def not_finite(_keep):
        raise TrollInputError("the rollout's top-K log-probs contain NaN or +inf")

    mass = torch.where(torch.isfinite(mu_logprobs), mu_logprobs.exp(), 0.0).sum(dim=1)

    def above_one(keep):
        raise TrollInputError(
            f"the rollout's top-K probabilities sum to {float(mass[keep].max()):.4f} > 1: they are not log-probs of "
            "one distribution (actor_rollout_ref.rollout.logprobs_mode must be raw_logprobs or processed_logprobs)"
        )

    problems = [(outside, out_of_range)]
    if mu_ids.shape[1] > 1:
        problems.append(((mu_ids.sort(dim=1).values.diff(dim=1) == 0).any(dim=1), repeated))
    unusable = (torch.isnan(mu_logprobs) | (mu_logprobs == math.inf)).any(dim=1)
    return problems + [(unusable, not_finite), (mass > 1.0 + mass_tolerance, above_one)]


def _checked_rows(everywhere: Sequence[Problem], problems: Sequence[Problem], keep: torch.Tensor) -> int:
    """The call's one wait for the device before the pass (issue 54.2): every flag of `everywhere` (checked on all
    rows) and of `problems` (on the rows `keep` selects) and the number of those rows, read back together; raises the
    first problem found, in that order; returns the count."""
    found = [rows.any() for rows, _ in everywhere] + [(rows & keep).any() for rows, _ in problems]
    values = torch.cat([torch.stack(found).long(), keep.sum().reshape(1)]).tolist()  # the wait
    for hit, (_, fail) in zip(values, (*everywhere, *problems)):
        if hit:
            fail(keep)
    return values[-1]


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
    chunk_bytes: Optional[int] = None,
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
        mask: optional [N] bool; rows where it is False are neither read nor validated. A row in the update whose
            logits hold a NaN or +inf (or are -inf throughout) has no distribution pi: its log p(a_t), regression
            KL, eta, kl_before and kl_after are NaN (as `topk_divergence`'s D there), so the loss is too.
        eps: trust-region radius. support_mass, topk: the support rule (1 - delta, K).
        chunk_bytes: float32 working set per chunk of rows of the torch path, forward and backward (None: by
            device, `chunk_bytes_for`). The Triton path (a GPU) reads rows in place, without chunks.
        mass_tolerance: mu's reported mass may exceed 1 by this much.
        inplace_backward: the backward writes the logits' gradient into the logits' storage (see the module doc).

    Returns:
        TrollTerms, [N] tensors in float32 (float64 for float64 logits); rows not in the update hold 0.

    Raises:
        TrollInputError: ids outside [0, V), a row repeating a top-K id, NaN/+inf top-K log-probs, mu's reported
            mass above 1 + mass_tolerance.
    """
    check_topk_inputs(
        logits, rollout_topk_ids, rollout_topk_logprobs, sampled_ids, rollout_sampled_logprobs, mask, TrollInputError
    )
    chunk_bytes = chunk_bytes or chunk_bytes_for(logits.device)
    work_bytes = torch.finfo(torch.promote_types(logits.dtype, torch.float32)).bits // 8
    rows_per_chunk = max(1, chunk_bytes // (work_bytes * logits.shape[1]))

    def read_support(rows_arg, sampled, mu_ids, mu_selected):
        return pi_on_support(
            logits, rows_arg, sampled, mu_ids, mu_selected, topk, support_mass, rows_per_chunk, inplace_backward
        )

    return troll_terms_from_support(
        read_support,
        logits.shape[1],
        torch.promote_types(logits.dtype, torch.float32),
        rollout_topk_ids,
        rollout_topk_logprobs,
        sampled_ids,
        rollout_sampled_logprobs,
        mask,
        eps=eps,
        support_mass=support_mass,
        topk=topk,
        mass_tolerance=mass_tolerance,
    )


def troll_terms_from_support(
    read_support,
    vocab: int,
    out_dtype: torch.dtype,
    rollout_topk_ids,
    rollout_topk_logprobs,
    sampled_ids,
    rollout_sampled_logprobs,
    mask=None,
    *,
    eps: float,
    support_mass: float,
    topk: int,
    mass_tolerance: float = MASS_TOLERANCE,
    checks_everywhere: Sequence[Problem] = (),
) -> TrollTerms:
    """`troll_token_terms` with pi read by `read_support(rows or None, sampled, mu_ids, mu_selected)` -> (ids,
    source, valid, log pi at the ids, log pi(other)) on the rows in the update: `pi_on_support` on the logits, or
    the same support fused with the LM head (`verl_dppo.math.fused_troll`). One implementation of Eq. 3-5 for both.
    checks_everywhere: the caller's own checks of every row, raised first; read with the rollout's checks and the
    update's row count in one wait for the device."""
    if not (eps > 0 and 0 < support_mass <= 1 and topk >= 1):
        raise TrollInputError(f"need eps > 0, 0 < support_mass <= 1, topk >= 1; got {eps}, {support_mass}, {topk}")
    n = sampled_ids.shape[0]
    dev = sampled_ids.device
    sampled_lp_all = rollout_sampled_logprobs.detach().double()
    valid_rows = torch.isfinite(sampled_lp_all)
    if mask is not None:
        valid_rows &= mask.bool()
    # Every row's checks at once, flagged where the update reads them: one wait, not one per check (issue 54.2)
    sampled, mu_lp, mu_ids = sampled_ids.long(), rollout_topk_logprobs.detach().double(), rollout_topk_ids.long()
    kept = _checked_rows(checks_everywhere, _input_problems(mu_ids, mu_lp, sampled, vocab, mass_tolerance), valid_rows)
    zeros = torch.zeros(n, dtype=out_dtype, device=dev)
    if kept == 0:
        diagnostics = {"projected": torch.zeros_like(valid_rows), "eta": zeros, "kl_before": zeros, "kl_after": zeros}
        diagnostics.update(support_size=torch.zeros(n, dtype=torch.long, device=dev), valid=valid_rows)
        return TrollTerms(zeros, zeros, zeros, diagnostics)  # no gradient: nothing in the update
    rows_arg = None
    sampled_lp = sampled_lp_all
    if kept < n:  # the update's rows ascending, as nonzero gives them, from the count already read
        rows_arg = torch.argsort((~valid_rows).to(torch.uint8), stable=True)[:kept]
        sampled, sampled_lp, mu_lp, mu_ids = (t[rows_arg] for t in (sampled, sampled_lp, mu_lp, mu_ids))

    # Top(mu): the reported ids by decreasing probability until the mass reaches support_mass, at most topk, in
    # whole groups of tied log-probs (as Top(pi): `top_selected`).
    mu_lp, order = mu_lp.sort(dim=1, descending=True)
    mu_ids = mu_ids.gather(1, order)
    mu_p = torch.where(torch.isfinite(mu_lp), mu_lp.exp(), 0.0)
    mu_selected = top_selected(mu_lp, mu_p, topk, support_mass) & torch.isfinite(mu_lp)

    ids, source, slot_valid, log_pi_s, log_pi_other = read_support(rows_arg, sampled, mu_ids, mu_selected)
    log_mu = mu_on_atoms(sampled, sampled_lp, mu_ids, mu_lp, ids, source, slot_valid, vocab)
    log_pi = torch.cat([log_pi_s.double(), log_pi_other.double()[:, None]], dim=1)
    # pi's atoms hold mass 1 (log 0) wherever the row's log-normaliser is finite; a NaN or +inf logit, or a row of
    # -inf, leaves NaN, inf or no mass: such rows answer NaN (as Top-K's D does), never a clean-looking 0
    atoms = torch.cat([slot_valid, torch.ones_like(slot_valid[:, :1])], dim=1)
    no_pi = torch.where(torch.isfinite(_logsumexp(torch.where(atoms, log_pi, -math.inf))).squeeze(1), 0.0, math.nan)
    present = torch.cat([slot_valid, torch.isfinite(log_pi_other)[:, None]], dim=1) & torch.isfinite(log_pi)
    log_pi = torch.where(present, log_pi, -math.inf)
    projection = kl_projection(log_pi, log_mu, eps)

    slot = ((ids == sampled[:, None]) & slot_valid).long().argmax(dim=1, keepdim=True)
    log_p_sampled = projection.log_p.gather(1, slot).squeeze(1) + no_pi
    pi_on = torch.where(present, log_pi, 0.0)
    pi_on = pi_on - _logsumexp(torch.where(present, pi_on, -math.inf))
    log_p_det = torch.where(present, projection.log_p.detach(), 0.0)
    regression_kl = torch.where(present, pi_on.exp() * (pi_on - log_p_det), 0.0).sum(dim=1) + no_pi
    log_mu_sampled = log_mu.gather(1, slot).squeeze(1)

    diagnostics = {
        "projected": _to_all_rows(projection.projected, rows_arg, n, torch.bool),
        "eta": _to_all_rows(projection.eta + no_pi, rows_arg, n, torch.float32),
        "kl_before": _to_all_rows(projection.kl_before + no_pi, rows_arg, n, torch.float32),
        "kl_after": _to_all_rows(projection.kl_after + no_pi, rows_arg, n, torch.float32),
        "support_size": _to_all_rows(slot_valid.sum(dim=1), rows_arg, n, torch.long),
        "valid": valid_rows,
    }
    return TrollTerms(
        log_p_sampled=_to_all_rows(log_p_sampled, rows_arg, n, out_dtype),
        regression_kl=_to_all_rows(regression_kl, rows_arg, n, out_dtype),
        log_mu_sampled=_to_all_rows(log_mu_sampled, rows_arg, n, out_dtype),
        diagnostics=diagnostics,
    )


def capped_ratio(log_p: torch.Tensor, log_mu: torch.Tensor) -> torch.Tensor:
    """r = p(a_t) / mu'(a_t) as the DPPO modes take theirs: the value exp(min(log r, MAX_LOG_RATIO)), the gradient
    that value times d log p(a_t) (log_mu is detached).

    Below the cap this is exp(log r) exactly, in value and gradient. Above it the token keeps learning with the
    capped weight, as DPPO's sg(min(r, C)) d log pi does; a plain clamp would cut its gradient to 0 instead.
    """
    log_r = log_p - log_mu.detach()
    return torch.exp(log_r - (log_r.detach() - MAX_LOG_RATIO).clamp(min=0.0))


def troll_token_loss(terms: TrollTerms, advantages: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """Eq. 5 per token, minimised: -(p(a_t) / mu'(a_t)) A_t + alpha KL(pi' || sg(p)); 0 on rows not in the update.

    No ratio clipping (the projection is the trust region); the ratio is `capped_ratio` (finite where mu(a_t) is
    tiny, as for every mode). Aggregate with verl's agg_loss and the response mask.
    """
    ratio = capped_ratio(terms.log_p_sampled, terms.log_mu_sampled)
    loss = -ratio * advantages.to(ratio.dtype) + alpha * terms.regression_kl
    return torch.where(terms.diagnostics["valid"], loss, 0.0)
