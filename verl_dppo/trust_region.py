"""The one trust-region mask that every loss mode shares (paper Eq. 9 and Eq. 12), and the surrogate weight.

Pure torch (no verl import). A reader can tick `trust_region_keep` off against Eq. (12) line by line:

    M_t = 0  iff  (A_t > 0 and r_t > 1 and D_t > delta_high)  or  (A_t < 0 and r_t < 1 and D_t > delta_low)

where r_t and D_t are taken against the anchor of the trust region (mu, the rollout policy, by default).
The mask only blocks updates that move pi further away from the anchor in the direction the advantage pushes;
it never blocks a move back toward it.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["RELAX_SIDES", "trust_region_keep", "truncated_ratio"]

RELAX_SIDES = ("low", "high", "both")


def trust_region_keep(
    advantages: torch.Tensor,
    log_ratio_to_anchor: torch.Tensor,
    divergence: Optional[torch.Tensor],
    delta_low: float,
    delta_high: float,
    rollout_prob: Optional[torch.Tensor] = None,
    relax_below: float = 0.0,
    relax_side: str = "high",
) -> torch.Tensor:
    """Boolean keep-mask M_t of Eq. (12); True = the token's update passes.

    Args:
        advantages: A_t.
        log_ratio_to_anchor: log pi(a_t) - log anchor(a_t); its sign is the direction of the move.
        divergence: D_t against the anchor, or None for no trust region (PG-IS: M_t = 1 everywhere).
        delta_low: threshold for A_t < 0 (moves that lower pi(a_t)).
        delta_high: threshold for A_t > 0 (moves that raise pi(a_t)).
        rollout_prob: mu(a_t); only needed when relax_below > 0.
        relax_below: alpha of Sec. 6: tokens with mu(a_t) < alpha are never blocked on `relax_side`. 0 = off.
        relax_side: "high" (A > 0 side), "low" (A < 0 side) or "both".
    """
    if divergence is None:
        return torch.ones_like(advantages, dtype=torch.bool)
    block_high = (advantages > 0) & (log_ratio_to_anchor > 0) & (divergence > delta_high)
    block_low = (advantages < 0) & (log_ratio_to_anchor < 0) & (divergence > delta_low)
    if relax_below > 0:
        if rollout_prob is None:
            raise ValueError("relax_below > 0 needs the rollout probabilities mu(a_t)")
        if relax_side not in RELAX_SIDES:
            raise ValueError(f"relax_side must be one of {RELAX_SIDES}, got {relax_side!r}")
        rare = rollout_prob < relax_below
        if relax_side in ("high", "both"):
            block_high = block_high & ~rare
        if relax_side in ("low", "both"):
            block_low = block_low & ~rare
    return ~(block_high | block_low)


def truncated_ratio(pi_logprob: torch.Tensor, mu_logprob: torch.Tensor, ratio_cap: float) -> torch.Tensor:
    """sg(min(r_t, C)) with r_t = pi(a_t) / mu(a_t), in float32 (Eq. 11; C = inf disables truncation).

    The loss per token is -A_t * sg(min(r_t, C)) * M_t * log pi(a_t): its gradient is -M_t * min(r_t, C) * A_t
    times grad log pi = the gradient of -M_t * r_t * A_t wherever r_t <= C.
    """
    ratio = torch.exp(pi_logprob.detach().float() - mu_logprob.detach().float())
    return ratio.clamp(max=ratio_cap)
