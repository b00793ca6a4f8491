"""`DPPOLossConfig`: the typed options of the DPPO loss family, as verl's config system takes them.

Select it with `actor_rollout_ref.actor.policy_loss._target_=verl_dppo.DPPOLossConfig` and set its fields with a
`+` prefix (`+actor_rollout_ref.actor.policy_loss.delta_low=0.15`): verl 0.9.1's YAML has no such keys, and the
subclass is how its `validate_config` and dataclass conversion accept them.

Unset fields follow verl's own convention (so a script written for verl's `dppo_tv` switches over by renaming
the mode): thresholds from `actor.clip_ratio_low` / `clip_ratio_high`, the cap from `actor.clip_ratio_c`. How a run's
config resolves to the values a loss call uses (`resolve_options`, `ResolvedOptions`) is `verl_dppo.plugin.options`'s,
beside each option's rule; they are named here too, where a reader of the config looks for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from verl.workers.config import PolicyLossConfig

from verl_dppo.plugin.options import DEFAULTS, FALLBACK_KEYS, RULES, ResolvedOptions, checked_fields, resolve_options

__all__ = ["DPPOLossConfig", "FALLBACK_KEYS", "ResolvedOptions", "resolve_options"]


@dataclass
class DPPOLossConfig(PolicyLossConfig):
    """verl's `PolicyLossConfig` plus the DPPO options (paper: arXiv 2602.04879)."""

    delta_low: Optional[float] = None
    """Divergence threshold delta for A < 0 (Eq. 12). Paper: TV 0.15, KL 0.05. None = actor.clip_ratio_low."""

    delta_high: Optional[float] = None
    """Divergence threshold delta for A > 0 (Eq. 12). Paper: TV 0.15, KL 0.05. None = actor.clip_ratio_high.
    delta_high=1.0 with dppo_binary_tv never blocks A > 0: the minimal negative mask of Sec. 5.3."""

    ratio_cap: Optional[float] = None
    """Truncation cap C of the importance ratio pi/mu (Eq. 11). Paper's scaling runs: 10000 (effectively off);
    `.inf` disables it. None = actor.clip_ratio_c (verl's default 3.0 truncates: Sec. 5.4 shows that hurts)."""

    anchor: str = DEFAULTS["anchor"]
    """Trust-region anchor: "rollout" = mu, the rollout engine's log-probs (the paper's choice, Sec. 5.2);
    "recompute" = the recomputed old_log_probs (MiniRL / decoupled DPPO: the paper's unstable ablations)."""

    relax_below: float = DEFAULTS["relax_below"]
    """alpha of Sec. 6: never block tokens with mu(a_t) < alpha on `relax_side` (Relax-low/high/both). 0 = off."""

    relax_side: str = DEFAULTS["relax_side"]
    """Which side `relax_below` frees: "high" (A > 0), "low" (A < 0) or "both" (Sec. 6)."""

    topk: Optional[int] = None
    """K: how many top log-probs of mu the rollout engine reports per token (one setting per run: the plugin hands it
    to vLLM/SGLang). None = the mode's default: 20 for dppo_topk_* (K of Eq. 15/16; the paper's ablation) and 64 for
    troll (TROLL's K: at most 64 tokens of mu and of pi in the sparse support). Only read by those modes."""

    troll_eps: float = DEFAULTS["troll_eps"]
    """TROLL (Becker et al. 2025, arXiv 2510.03817, their Eq. 3/4): trust-region radius eps, KL(p || mu) <= eps per
    token for the projected policy p. Reported value: 0.05. Only read by the troll mode."""

    troll_alpha: float = DEFAULTS["troll_alpha"]
    """TROLL (their Eq. 5): weight alpha of the regression term KL(pi || sg(p)) that pulls pi towards its projection.
    Reported value: 1.0. Only read by the troll mode."""

    troll_support_mass: float = DEFAULTS["troll_support_mass"]
    """TROLL's sparse support: each policy's most probable tokens until their mass reaches 1 - delta (at most K =
    `topk`), delta = 1e-5 (reported value). Only read by the troll mode."""

    ipo_tau: float = DEFAULTS["ipo_tau"]
    """IPO (prime-rl): weight tau of the penalty tau * (log pi/mu)^2 on every valid token; 0 = off (prime-rl's
    default). Only read by the ipo mode (`verl_dppo.plugin.ipo_mode`)."""

    max_off_policy_threshold: Optional[int] = None
    """verl's `trainer.v1.sampler.max_off_policy_threshold` T, copied here (the actor never sees the trainer's
    section; the recipes interpolate it): under an asynchronous trainer, samples with lag >= T (a trajectory spanning
    more than T versions up to the trainer's, which verl's replay buffer would not keep) are counted in
    actor/dppo/lag_over_threshold_frac. None: not counted."""

    def __post_init__(self):
        # Each field converted and checked by its one rule (verl_dppo.plugin.options), as resolve_options reads it.
        for name, value in checked_fields({name: getattr(self, name) for name in RULES}).items():
            object.__setattr__(self, name, value)
