"""Per-token divergence estimates between the rollout policy mu and the current policy pi.

Pure torch (no verl import). The Top-K divergences (Eq. 15/16) are in `verl_dppo.math.topk`. Every function takes log-probabilities in any float dtype and returns float32.

Paper: Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning" (arXiv 2602.04879), Sec. 4.4.
The binary estimates collapse each categorical to the Bernoulli (p(a_t), 1 - p(a_t)) of the sampled token a_t;
by the data-processing inequality they are lower bounds of the exact divergence (Appendix C).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "binary_tv",
    "binary_kl",
    "binary_kl_floored",
    "floor_logprob",
    "ratio_deviation",
    "rounding_radius",
    "within_rounding",
    "nearest_within_rounding",
    "log1mexp",
    "MAX_LOG_RATIO",
]

_LN2 = math.log(2.0)
_TINY = torch.finfo(torch.float32).tiny
LOG_FLOOR = math.log(_TINY)
"""log of float32's smallest normal number (-87.3): the floor of probabilities in binary_kl."""

MAX_LOG_RATIO = 20.0
"""Every mode's importance ratio (DPPO's pi/mu, TROLL's p/mu') is taken at log r <= 20 (r <= 4.85e8): with
`ratio_cap=inf` (PG-IS), or a token the engine gave log mu(a_t) = -100, the log-ratio can pass float32's exp limit
(88.7), where r = inf made the loss -inf (A != 0) or NaN (0 x inf, A = 0). Any cap C below 4.85e8 (the paper's
"off" value is 1e4) is unaffected."""


def log1mexp(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(logp)) for logp <= 0, accurate at both ends (Maechler 2012).

    Near logp = 0 (p close to 1), 1 - p cancels catastrophically; expm1 keeps it. Far below, log1p keeps it.
    """
    logp = logp.clamp(max=0.0)
    return torch.where(logp > -_LN2, torch.log(-torch.expm1(logp)), torch.log1p(-torch.exp(logp)))


def _as_float32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1:
        raise ValueError(f"log-prob tensors must have one shape, got {sorted(shapes)}")
    for t in tensors:
        if not t.is_floating_point():
            raise TypeError(f"log-probs must be a float tensor, got {t.dtype}")
    return [t.detach().float() for t in tensors]


def binary_tv(mu_logprob: torch.Tensor, pi_logprob: torch.Tensor) -> torch.Tensor:
    """Binary total variation, Eq. (13): D_TV = |mu(a_t) - pi(a_t)|.

    (The Bernoulli TV is half the L1 distance over {a_t, other}: both terms equal |mu - pi|.)
    """
    mu_logprob, pi_logprob = _as_float32(mu_logprob, pi_logprob)
    return (torch.exp(mu_logprob) - torch.exp(pi_logprob)).abs()


def binary_kl(mu_logprob: torch.Tensor, pi_logprob: torch.Tensor) -> torch.Tensor:
    """Binary KL(mu || pi), Eq. (14): mu log(mu/pi) + (1-mu) log((1-mu)/(1-pi)).

    Probabilities are floored at float32's smallest normal number (1.2e-38, log -87.3) on both sides of the
    Bernoulli, which gives 0 log 0 = 0 at mu(a_t) = 0 or 1 and keeps the result finite: where the exact value is
    +inf (pi(a_t) = 1 or 0 while mu(a_t) is not), it is about 87 x the mass involved, far above any threshold.
    Absolute accuracy is about 1e-7 (float32).
    """
    mu_logprob, pi_logprob = _as_float32(mu_logprob, pi_logprob)
    mu_logprob, pi_logprob = floor_logprob(mu_logprob), floor_logprob(pi_logprob)
    return binary_kl_floored(mu_logprob, pi_logprob, torch.exp(mu_logprob))


def floor_logprob(logprob: torch.Tensor) -> torch.Tensor:
    """Clamp log-probabilities into [log(tiny), 0]: the domain binary_kl_floored works on."""
    return logprob.clamp(min=LOG_FLOOR, max=0.0)


def binary_kl_floored(mu_logprob: torch.Tensor, pi_logprob: torch.Tensor, mu_prob: torch.Tensor) -> torch.Tensor:
    """Eq. (14) on float32 log-probs already passed through `floor_logprob`, with mu_prob = exp(mu_logprob).

    The loss calls this directly to share exp(mu) with its other per-token quantities; it uses one log, no
    branches: the "other" term is (1-mu) log((1-mu)/(1-pi)) with 1-p = -expm1(log p) (exact near p = 1).
    """
    sampled_term = mu_prob * (mu_logprob - pi_logprob)
    one_minus_mu = torch.expm1(mu_logprob).neg_().clamp_(min=_TINY)
    one_minus_pi = torch.expm1(pi_logprob).neg_().clamp_(min=_TINY)
    other_term = one_minus_mu * torch.log(one_minus_mu / one_minus_pi)
    # Rounding can make a true 0 slightly negative; KL is non-negative by definition.
    return sampled_term.add_(other_term).clamp_(min=0.0)


def rounding_radius(logprob: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The error bound of a log-prob computed in `dtype`: (eps(dtype) / 2) x (1 + |log p|) for a dtype coarser than
    float32 (bf16: eps 2^-7, so 2^-8 x (1 + |log p|)), 0 for float32 and float64 (their values are taken as exact).

    Where it comes from: a log-softmax in bf16 (verl's log-prob path without flash-attn's cross entropy:
    `logprobs_from_logits_v2` on bf16 logits) rounds the log of the sum of exponentials to bf16, an absolute error
    up to eps/2 in every log-prob (a top token's 1 - p below about 0.004 reads log p = 0 exactly), and rounds the
    result to bf16, a relative error up to eps/2 of |log p|. Measured on torch's CPU kernel against float64
    (tests/test_math_properties.py, bench/bf16_logprob_rounding.py): at most 0.8 of this bound from p = 1 down to
    p = 1e-6. It is the bound of one side: a divergence of two bf16 log-probs moves each side within its own radius
    (`nearest_within_rounding`), a float32 side not at all.
    """
    eps = torch.finfo(dtype).eps
    if eps <= torch.finfo(torch.float32).eps:
        return torch.zeros((), dtype=torch.float32, device=logprob.device)
    return (logprob.detach().float().abs() + 1.0) * (eps / 2)


def within_rounding(mu_logprob: torch.Tensor, pi_logprob: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """pi's log-prob moved toward mu's by at most `radius`: the pi nearest mu that the rounding cannot tell from the
    value given, for a mu taken as exact (radius: pi's own; two rounded sides take `nearest_within_rounding`). A
    divergence of mu and this pi is the least one the inputs resolve: 0 where |log pi - log mu| is within the rounding
    (bf16 log pi = 0 against log mu = -3e-3 is no evidence of a divergence), the exact value where the radius is 0
    (float32 and float64 inputs)."""
    gap = pi_logprob - mu_logprob
    return pi_logprob - torch.maximum(torch.minimum(gap, radius), -radius)


def nearest_within_rounding(
    mu_logprob: torch.Tensor, pi_logprob: torch.Tensor, mu_radius: torch.Tensor, pi_radius: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair (mu', pi') nearest each other with each log-prob within its own side's rounding radius of the value
    given: pi moved toward mu by at most pi_radius, then mu toward that pi by at most mu_radius.

    Where the two intervals overlap, mu' = pi' (a divergence of 0: a token on the policy that sampled it is never
    masked for rounding alone). Where they do not, (mu', pi') are their nearest endpoints, which is where every
    binary divergence takes its least value over the box of pairs the inputs allow: binary TV and KL(mu || pi) are
    0 on the diagonal and grow with each argument's distance from the other (KL is convex in each), so for mu' below
    pi' the least is at the highest mu' and the lowest pi' (tests/test_divergence.py checks KL against a float64
    grid of the box). Applying both radii to pi alone, as before issue 53, was not this: near p = 1 bf16 mu 0.95
    against pi 0.999 read a KL of 0.046 (under delta 0.05) where every allowed pair gives at least 0.063."""
    gap = pi_logprob - mu_logprob
    pi_move = torch.maximum(torch.minimum(gap, pi_radius), -pi_radius)
    rest = gap - pi_move
    return mu_logprob + torch.maximum(torch.minimum(rest, mu_radius), -mu_radius), pi_logprob - pi_move


def ratio_deviation(anchor_logprob: torch.Tensor, pi_logprob: torch.Tensor) -> torch.Tensor:
    """|r - 1| with r = pi(a_t) / anchor(a_t): PPO's single-sample estimate of 2 * D_TV, Eq. (10).

    Used as the "divergence" of ratio clipping (Eq. 9), so PPO/GRPO runs through the same mask as DPPO.
    """
    anchor_logprob, pi_logprob = _as_float32(anchor_logprob, pi_logprob)
    return torch.expm1(pi_logprob - anchor_logprob).abs()
