"""Per-token divergence estimates between the rollout policy mu and the current policy pi.

Pure torch (no verl import). Every function takes log-probabilities in any float dtype and returns float32.

Paper: Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning" (arXiv 2602.04879), Sec. 4.4.
The binary estimates collapse each categorical to the Bernoulli (p(a_t), 1 - p(a_t)) of the sampled token a_t;
by the data-processing inequality they are lower bounds of the exact divergence (Appendix C).
"""

from __future__ import annotations

import math

import torch

__all__ = ["binary_tv", "binary_kl", "ratio_deviation", "log1mexp", "topk_divergence"]

_LN2 = math.log(2.0)


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

    Each term uses the 0 log 0 = 0 convention, so mu(a_t) = 0 or 1 is finite. The result is +inf only where the
    divergence truly is: pi(a_t) = 1 while mu(a_t) < 1, or pi(a_t) = 0 while mu(a_t) > 0.
    """
    mu_logprob, pi_logprob = _as_float32(mu_logprob, pi_logprob)
    mu = torch.exp(mu_logprob)
    one_minus_mu = -torch.expm1(mu_logprob.clamp(max=0.0))
    sampled_term = torch.where(mu > 0, mu * (mu_logprob - pi_logprob), torch.zeros_like(mu))
    other_term = torch.where(
        one_minus_mu > 0,
        one_minus_mu * (log1mexp(mu_logprob) - log1mexp(pi_logprob)),
        torch.zeros_like(mu),
    )
    # Rounding can make a true 0 slightly negative; KL is non-negative by definition.
    return (sampled_term + other_term).clamp(min=0.0)


def ratio_deviation(anchor_logprob: torch.Tensor, pi_logprob: torch.Tensor) -> torch.Tensor:
    """|r - 1| with r = pi(a_t) / anchor(a_t): PPO's single-sample estimate of 2 * D_TV, Eq. (10).

    Used as the "divergence" of ratio clipping (Eq. 9), so PPO/GRPO runs through the same mask as DPPO.
    """
    anchor_logprob, pi_logprob = _as_float32(anchor_logprob, pi_logprob)
    return torch.expm1(pi_logprob - anchor_logprob).abs()


def __getattr__(name):
    # Top-K divergences, Eq. (15)/(16): their own module (chunked over the vocabulary), exported from here lazily
    # because verl_dppo.topk builds on this module's log1mexp.
    if name == "topk_divergence":
        from verl_dppo.topk import topk_divergence

        return topk_divergence
    raise AttributeError(f"module 'verl_dppo.divergence' has no attribute {name!r}")
