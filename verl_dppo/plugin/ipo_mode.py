"""The `ipo` loss mode: prime-rl's default loss (since 2026-08), on verl's pipeline beside DPPO.

    M_t    = 0  where |pi(a_t) - mu(a_t)| > eps, whatever the sign of A_t or the way pi moved; 1 elsewhere
    loss_t = -M_t * sg(min(r_t, C)) * A_t * log pi(a_t)  +  tau * (log pi(a_t) - log mu(a_t))^2

The mask reads the binary TV of DPPO's Eq. (13), but it is not Eq. (12): DPPO blocks a token only when the update
would push D further past delta (A > 0 with pi above mu, A < 0 with pi below it); IPO drops every token whose
probability already left the band, so neither sign of the advantage moves it further either way. eps is
policy_loss.delta_low for A <= 0 and delta_high for A > 0 (the recipe sets both to prime-rl's 0.3). The weight is
Eq. (11)'s, on the kept tokens. The optional penalty tau * (log pi/mu)^2 (policy_loss.ipo_tau, 0 = off, prime-rl's
default) acts on every valid token, masked or not: it pulls pi back towards mu where the mask lets go. Anchored on
mu, the rollout engine's log-probs (with anchor=recompute the band is measured against the recomputed policy;
the penalty stays on log pi/mu). Relax (relax_below) is DPPO's and the ratio clip's, not IPO's: refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from verl_dppo.math.divergence import binary_tv
from verl_dppo.plugin.binary_mode import BinaryFamily
from verl_dppo.plugin.loss_family import LossMode, Tokens
from verl_dppo.plugin.options import DEFAULTS, checked, policy_loss_get

__all__ = ["FAMILY", "IpoOptions"]


@dataclass(frozen=True)
class IpoOptions:
    tau: float

    def rule_parts(self, shared: list[str]) -> list[str]:
        """The update rule's words (`verl-dppo check`): the shared ones (the band, the cap), then the penalty."""
        return [*shared, f"penalty tau {self.tau:g} x (log pi/mu)^2" if self.tau else "no log-ratio penalty"]


def ipo_tau(config: Any) -> float:
    """policy_loss.ipo_tau from an actor config (DPPOLossConfig, a plain PolicyLossConfig or a DictConfig)."""
    tau = checked("ipo_tau", policy_loss_get(config, "ipo_tau", None))
    return DEFAULTS["ipo_tau"] if tau is None else tau


class IpoFamily(BinaryFamily):
    def options(self, mode: LossMode, config: Any) -> tuple[Any, Any, str]:
        options, _, described = super().options(mode, config)
        own = IpoOptions(ipo_tau(config))
        return options, own, f"{described} ipo_tau={own.tau:g}"

    def check(self, mode: LossMode, options: Any) -> None:
        if options.relax_below > 0:
            raise ValueError(
                f"{mode.name} masks by |pi - mu| > eps whatever the advantage's sign; Relax (policy_loss.relax_below="
                f"{options.relax_below:g}) frees one side of Eq. (12)'s mask, which IPO does not have: set "
                "relax_below=0, or use dppo_binary_tv / grpo_clip for Relax"
            )

    def blocked(self, tokens: Tokens, divergence: Optional[torch.Tensor]) -> torch.Tensor:
        options = tokens.options
        eps = torch.where(tokens.adv > 0, options.delta_high, options.delta_low)
        return divergence > eps

    def loss_matrix(self, tokens: Tokens, blocked: torch.Tensor) -> torch.Tensor:
        loss = super().loss_matrix(tokens, blocked)
        tau = tokens.family_options.tau
        if not tau:
            return loss
        log_ratio = tokens.log_prob.float() - tokens.mu
        if tokens.sanitized:
            log_ratio = log_ratio.masked_fill(~tokens.valid, 0.0)
        return loss + tau * log_ratio.square()

    def metrics(self, tokens: Tokens) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """actor/dppo/ipo_log_ratio_sq_mean: the penalty's (log pi/mu)^2 per valid token, logged whatever tau."""
        log_ratio = torch.where(tokens.valid, tokens.pi - tokens.mu, 0.0)
        return {f"{self.metric_prefix}ipo_log_ratio_sq_mean": (log_ratio.square().sum(), tokens.valid.sum())}


FAMILY = IpoFamily(
    (
        LossMode(
            "ipo",
            "IPO (prime-rl): mask |pi - mu| > eps whatever the sign, Eq. (11)'s weight, tau (log pi/mu)^2",
            divergence=binary_tv,
            measure="tv",
            label="IPO",
            color="#b15928",
            demo=("IPO (prime-rl), eps 0.3, tau 0", (("delta_low", 0.3), ("delta_high", 0.3), ("ratio_cap", 10000.0))),
        ),
    )
)
