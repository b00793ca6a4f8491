"""The one trust-region mask that every loss mode shares (paper Eq. 9 and Eq. 12).

Pure torch (no verl import). A reader can tick `trust_region_blocked` off against Eq. (12) line by line:

    M_t = 0  iff  (A_t > 0 and r_t > 1 and D_t > delta_high)  or  (A_t < 0 and r_t < 1 and D_t > delta_low)

where r_t and D_t are taken against the anchor of the trust region (mu, the rollout policy, by default).
The mask only blocks updates that move pi further away from the anchor in the direction the advantage pushes;
it never blocks a move back toward it.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["RELAX_SIDES", "trust_region_blocked", "trust_region_keep"]

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
    """Boolean keep-mask M_t of Eq. (12); True = the token's update passes. Arguments: `trust_region_blocked`."""
    return ~trust_region_blocked(
        advantages, log_ratio_to_anchor, divergence, delta_low, delta_high, rollout_prob, relax_below, relax_side
    )


def trust_region_blocked(
    advantages: torch.Tensor,
    log_ratio_to_anchor: torch.Tensor,
    divergence: Optional[torch.Tensor],
    delta_low: float,
    delta_high: float,
    rollout_prob: Optional[torch.Tensor] = None,
    relax_below: float = 0.0,
    relax_side: str = "high",
) -> torch.Tensor:
    """1 - M_t of Eq. (12), as a bool tensor: True where the token's update is masked.

    Args:
        advantages: A_t.
        log_ratio_to_anchor: log pi(a_t) - log anchor(a_t); its sign is the direction of the move.
        divergence: D_t against the anchor, or None for no trust region (PG-IS: nothing is masked).
        delta_low: threshold for A_t < 0 (moves that lower pi(a_t)).
        delta_high: threshold for A_t > 0 (moves that raise pi(a_t)).
        rollout_prob: mu(a_t); only needed when relax_below > 0.
        relax_below: alpha of Sec. 6: tokens with mu(a_t) < alpha are never masked on `relax_side`. 0 = off.
        relax_side: "high" (A > 0 side), "low" (A < 0 side) or "both".
    """
    if divergence is None:
        return torch.zeros_like(advantages, dtype=torch.bool)
    # (A_t > 0 and r_t > 1) or (A_t < 0 and r_t < 1): the update pushes pi further away from the anchor.
    # Signs, not the product A_t * log r_t, which underflows to 0 for tiny values (1e-30 * 1e-30).
    moving_away = (advantages.sign() * log_ratio_to_anchor.sign()) > 0
    # D_t > delta, with delta_high on the A_t > 0 side and delta_low on the A_t < 0 side (either may be inf).
    if delta_low == delta_high:
        outside = divergence > delta_high
    else:
        outside = torch.where(advantages > 0, divergence > delta_high, divergence > delta_low)
    blocked = moving_away & outside
    if relax_below > 0:
        if rollout_prob is None:
            raise ValueError("relax_below > 0 needs the rollout probabilities mu(a_t)")
        if relax_side not in RELAX_SIDES:
            raise ValueError(f"relax_side must be one of {RELAX_SIDES}, got {relax_side!r}")
        freed = rollout_prob < relax_below
        if relax_side == "high":
            freed = freed & (advantages > 0)
        elif relax_side == "low":
            freed = freed & (advantages < 0)
        blocked = blocked & ~freed
    return blocked
