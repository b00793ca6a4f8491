"""An independent float64 reference of the paper's Eq. (9), (11)-(14) and the options, written token by token
from the equations (no code shared with verl_dppo), for the tests to compare against."""

from __future__ import annotations

import math


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
        [token_coefficient(mode, A[i][t], pi[i][t], mu[i][t], anchor[i][t], delta_low, delta_high, cap, **relax)
         for t in range(lens[i])]
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
