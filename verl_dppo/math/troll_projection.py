"""TROLL's KL projection on a few atoms, per row (float64): the closed form, eta by a batched bracketing search, and
eta's implicit gradient. Part of `verl_dppo.math.troll`, the public entry point (which re-exports `kl_projection`,
`Projection` and `EPS`; its module doc gives the equations and the choices).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["EPS", "LOG_ETA_BRACKET", "SOLVER_STEPS", "Projection", "kl_projection"]

EPS = 0.05
"""Trust-region radius: KL(p || mu) <= eps per token (TROLL's reported value)."""

LOG_ETA_BRACKET = (-25.0, 25.0)
"""log eta is searched in this interval (eta from 1.4e-11 to 7.2e10)."""

SOLVER_STEPS = 100
"""At most this many safeguarded Newton steps on log eta (bisection alone needs 56 to reach float64 resolution)."""

SOLVER_CHECKS = (8, 16, 32, 64)
"""After these many steps the solver reads back whether every row has converged (a wait for the device each): real
rows take 5-7 steps, so one read; a converged row's steps leave it as it is, so the checks change no value."""


class Projection(NamedTuple):
    """`kl_projection`'s result, per row: log p on the atoms (with gradient) and detached diagnostics."""

    log_p: torch.Tensor
    eta: torch.Tensor
    kl_before: torch.Tensor
    kl_after: torch.Tensor
    projected: torch.Tensor


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
def _solve_log_eta(log_pi, log_mu, present, eps, kl_before, projected):
    """The root of KL(p_eta || mu) = eps in log eta: Newton's method kept inside a shrinking bracket (a bisection
    step whenever Newton would leave it), batched; starts at the quadratic estimate eta = sqrt(KL(pi||mu)/eps) - 1.
    Solved on every row, the rows not `projected` done from the start (selecting the others would wait for the
    device); converged rows checked only at SOLVER_CHECKS.

    Returns (log eta, bracketed, how many rows are projected): rows whose root lies above the bracket get its upper
    end; the count is read at the first check, with it (one wait for most calls).
    """
    lo = torch.full_like(kl_before, LOG_ETA_BRACKET[0])
    hi = torch.full_like(kl_before, LOG_ETA_BRACKET[1])
    bracketed = _excess_and_slope(log_pi, log_mu, present, hi, eps)[0] <= 0
    x = ((kl_before / eps).sqrt() - 1.0).clamp(min=1e-6).log().clamp(*LOG_ETA_BRACKET)
    done = ~projected
    count = None
    for steps in range(1, SOLVER_STEPS + 1):
        excess, slope = _excess_and_slope(log_pi, log_mu, present, x, eps)
        lo = torch.where(excess > 0, x, lo)
        hi = torch.where(excess > 0, hi, x)
        newton = x - excess / slope.clamp(max=-1e-300)
        inside = (newton >= lo) & (newton <= hi)
        step = torch.where(done, 0.0, torch.where(inside, newton, 0.5 * (lo + hi)) - x)
        x = x + step
        # Converged: KL at eps to ~100 ulps, or the step or the bracket at float64 resolution of log eta.
        done |= (excess.abs() <= 1e-14) | (step.abs() <= 1e-13) | (hi - lo <= 1e-12 * (1.0 + x.abs()))
        if steps in SOLVER_CHECKS or steps == SOLVER_STEPS:
            if count is None:
                finished, count = torch.stack([done.all().long(), projected.sum()]).tolist()  # the wait
            else:
                finished = bool(done.all())
            if finished:
                break
    return torch.where(bracketed, x, hi), bracketed, count


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

    with torch.no_grad():
        kl_before = _kl(pi.detach(), mu, present)
        projected = kl_before > eps
        log_eta, bracketed, count = _solve_log_eta(pi.detach(), mu, present, eps, kl_before, projected)
        eta0 = torch.where(projected, log_eta.exp(), 0.0)

    eta = eta0
    if count:
        # eta0 - (F - sg F) / sg(dF/d eta): the value eta0, the gradient -(dF/d log pi) / (dF/d eta), on the
        # projected rows (ascending, as nonzero gives them, from the count already read).
        rows = torch.argsort((~projected).to(torch.uint8), stable=True)[:count]
        bracketed = bracketed[rows]
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
