"""What a loss family is: the interface `verl_dppo.plugin.losses.dppo_policy_loss` calls, and its defaults.

A family is one module `verl_dppo/plugin/<name>_mode.py` holding `FAMILY`, a `LossFamily` whose `modes` are its
rows of verl's registry (`losses.py` finds every such module and registers their modes; a new family is one new
module). The shared function does what every mode does alike (shape checks, non-finite inputs, the ratio
r_t = pi / mu, the mismatch statistics, the mask of Eq. (12), aggregation, the exact diagnostics); a family says
what differs:

    options      the values in effect, and the line that announces them
    check        the settings it refuses (Top-K, TROLL: an anchor other than the rollout's)
    hook_terms   what the engine's logits hook computed for it, and which tokens that left unusable (NaN)
    divergence   D_t of Eq. (12) against the anchor, or None (no trust region)
    blocked      the tokens the trust region masks; the default is Eq. (12) (`trust_region_blocked`)
    loss_matrix  the per-token loss; the default is Eq. (11): -M_t * sg(min(r_t, C)) * A_t * log pi(a_t)
    metrics      its own diagnostics, as (numerator, denominator) pairs summed exactly over micro-batches, given
                 as 0-d tensors that the shared function reads back with its own in one host transfer
    zero_loss    a zero that still reaches the parameters, for a micro-batch of empty responses
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from verl_dppo.math.trust_region import trust_region_blocked
from verl_dppo.plugin.options import resolve_options

__all__ = ["LossMode", "LossFamily", "Tokens"]


@dataclass(frozen=True)
class LossMode:
    name: str
    paper: str
    """The paper's name and equation for it (the registered function's docstring)."""
    family: "LossFamily" = field(repr=False, compare=False, default=None)
    divergence: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
    """Binary family: D(anchor || pi) from the two log-probs of the sampled token; None = no trust region."""
    uses_divergence_thresholds: bool = True
    """False: thresholds always come from actor.clip_ratio_low/high (PPO's eps), never from delta_low/high."""
    measure: Optional[str] = None
    """What its thresholds bound: "tv" (a total variation, never above 1) or "kl"; None: no divergence threshold."""
    paper_delta: Optional[float] = None
    """The DPPO paper's threshold for it (Sec. 5.4: TV 0.15, KL 0.05): a value set or inherited outside the paper's
    range is said (`verl_dppo.plugin.config`). None: not one of the paper's DPPO modes."""
    default_topk: Optional[int] = None
    """K when policy_loss.topk is unset, for a mode that reads the rollout's top-K in the engine's logits hook;
    None: the mode reads no top-K."""
    label: str = ""
    """Its short name in tables and figures (bTV, clip, ...)."""
    color: Optional[str] = None
    """Its colour in every figure (`verl_dppo.studies.colors`), where no recipe of its own sets one."""
    panels: str = "dppo"
    """Which of `verl-dppo plot`'s default panels its runs get: "dppo" (the mask's), "troll" or "clip"."""
    demo: Optional[tuple[str, tuple[tuple[str, Any], ...]]] = None
    """(description, policy_loss settings) of a demo row for it, where the demo's own table has none."""

    @property
    def reads_topk(self) -> bool:
        """True for a mode that needs the rollout's top-K and the engine's logits hook."""
        return self.default_topk is not None


@dataclass
class Tokens:
    """One micro-batch as every mode sees it: [batch, response_len] tensors, float32 and detached unless said."""

    mode: LossMode
    options: Any  # ResolvedOptions
    family_options: Any  # what the family's `options` returned beside them (TROLL's), else None
    log_prob: torch.Tensor  # log pi(a_t), verl's, with gradient
    pi: torch.Tensor
    mu: torch.Tensor
    anchor: torch.Tensor
    adv: torch.Tensor
    response: torch.Tensor  # bool: the response tokens
    valid: torch.Tensor  # bool: the response tokens with finite inputs (the others are dropped)
    sanitized: bool  # some input was non-finite: the tensors above are zeroed outside `valid`
    anchored_on_mu: bool
    ratio: torch.Tensor  # r_t = pi / mu, exp(min(log r, MAX_LOG_RATIO))
    weight: torch.Tensor  # sg(min(r_t, C))
    log_ratio_to_anchor: torch.Tensor
    mu_prob: torch.Tensor
    drop: torch.Tensor  # mu(a_t) - pi(a_t)
    mismatch_tv: torch.Tensor  # Eq. (13) against mu
    mismatch_kl: torch.Tensor  # Eq. (14) against mu
    hook: Any = None  # the family's hook terms
    unusable: Optional[torch.Tensor] = None  # the hook's NaN marker, zeroed outside `valid`


class LossFamily:
    """The defaults: a DPPO-shaped mode with no hook, no trust region, Eq. (11)'s loss and no extra metric."""

    truncates = True
    """Whether the ratio cap C applies (counted in actor/pg_clipfrac_lower)."""
    metric_prefix = "actor/dppo/"
    """Where the family's own diagnostics go in verl's log."""
    logits_hook: Optional[str] = None
    """What the engine's logits hook computes for its modes: "topk" (Eq. 15/16), "troll" (TROLL's terms) or None."""

    def __init__(self, modes: tuple[LossMode, ...]):
        self.modes = tuple(replace(m, family=self) for m in modes)

    def options(self, mode: LossMode, config: Any) -> tuple[Any, Any, str]:
        """(the shared ResolvedOptions, the family's own options or None, the "in effect" description)."""
        options = resolve_options(config, mode.uses_divergence_thresholds)
        return options, None, options.describe()

    def check(self, mode: LossMode, options: Any) -> None:
        """Raise ValueError for settings the family cannot serve."""

    def hook_terms(self, mode: LossMode, extras: Any, options: Any, response: torch.Tensor):
        """(the hook's terms for this micro-batch or None, a NaN marker of the unusable tokens or None)."""
        return None, None

    def divergence(self, tokens: Tokens) -> Optional[torch.Tensor]:
        return None

    def blocked(self, tokens: Tokens, divergence: Optional[torch.Tensor]) -> torch.Tensor:
        """Eq. (12): the tokens whose update moves D past delta in the direction A pushes (none without D)."""
        options = tokens.options
        return trust_region_blocked(
            tokens.adv,
            tokens.log_ratio_to_anchor,
            divergence,
            options.delta_low,
            options.delta_high,
            rollout_prob=tokens.mu_prob,
            relax_below=options.relax_below,
            relax_side=options.relax_side,
        )

    def loss_matrix(self, tokens: Tokens, blocked: torch.Tensor) -> torch.Tensor:
        """Eq. (11) per token: -M_t * sg(min(r_t, C)) * A_t * log pi(a_t)."""
        coefficient = (tokens.adv * tokens.weight).mul_((~blocked).float()).neg_()
        log_pi = tokens.log_prob.float()
        if tokens.sanitized:  # a dropped token contributes nothing, not even a NaN gradient
            log_pi = log_pi.masked_fill(~tokens.valid, 0.0)
        return coefficient * log_pi

    def metrics(self, tokens: Tokens) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Its own diagnostics as 0-d (numerator, denominator) tensors, read back with the shared ones at once."""
        return {}

    def zero_loss(self, tokens: Tokens) -> torch.Tensor:
        return tokens.log_prob.float().masked_fill(~tokens.response, 0.0).sum() * 0.0
