"""`DPPOLossConfig`: the typed options of the DPPO loss family, and how a run's config resolves to values.

Select it with `actor_rollout_ref.actor.policy_loss._target_=verl_dppo.DPPOLossConfig` and set its fields with a
`+` prefix (`+actor_rollout_ref.actor.policy_loss.delta_low=0.15`): verl 0.9.1's YAML has no such keys, and the
subclass is how its `validate_config` and dataclass conversion accept them.

Unset fields follow verl's own convention (so a script written for verl's `dppo_tv` switches over by renaming
the mode): thresholds from `actor.clip_ratio_low` / `clip_ratio_high`, the cap from `actor.clip_ratio_c`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from verl.workers.config import PolicyLossConfig

from verl_dppo.plugin.options import DEFAULTS, RULES, checked, read_key

__all__ = ["DPPOLossConfig", "FALLBACK_KEYS", "ResolvedOptions", "resolve_options"]

logger = logging.getLogger("verl_dppo")

FALLBACK_KEYS = {"delta_low": "clip_ratio_low", "delta_high": "clip_ratio_high", "ratio_cap": "clip_ratio_c"}
"""Each option left unset -> the actor key of verl's whose value it takes (verl's own `dppo_tv` convention)."""


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
        for name in RULES:
            object.__setattr__(self, name, checked(name, getattr(self, name)))


@dataclass(frozen=True)
class ResolvedOptions:
    """The values a loss call actually uses, after verl's fallbacks."""

    delta_low: float
    delta_high: float
    ratio_cap: float
    anchor: str
    relax_below: float
    relax_side: str
    topk: Optional[int]  # None: the mode's default (topk_mode.configured_topk)
    max_off_policy_threshold: Optional[int]  # None: over-threshold samples not counted
    sources: tuple[str, ...]  # which values came from verl's clip_ratio_* fallbacks

    def inherited(self) -> dict[str, str]:
        """Option -> the verl key its value came from, for the options left unset ({"delta_low": "clip_ratio_low"})."""
        keys = {source.split("=", 1)[0] for source in self.sources}
        return {name: key for name, key in FALLBACK_KEYS.items() if key in keys}

    def describe(self, topk: Optional[int] = None) -> str:
        """The values in effect, key=value; K only where given (the modes that read it: a binary mode's line does not
        show the recipes' `topk: 20`, which it never reads)."""
        text = (
            f"delta_low={self.delta_low:g} delta_high={self.delta_high:g} ratio_cap={self.ratio_cap:g} "
            f"anchor={self.anchor} relax_below={self.relax_below:g} relax_side={self.relax_side}"
        )
        if topk is not None:
            text += f" topk={topk}"
        if self.sources:
            text += " (from verl's " + ", ".join(self.sources) + ")"
        return text


def resolve_options(config: Any, uses_divergence_thresholds: bool) -> ResolvedOptions:
    """Resolve the options in effect from an actor config (verl's `ActorConfig` or a DictConfig/dict), each checked
    by its rule (`verl_dppo.plugin.options.checked`) whichever config class carried it.

    `uses_divergence_thresholds` is False for `grpo_clip`, which always takes its eps from clip_ratio_low/high.
    """
    if config is None:
        raise ValueError("DPPO losses need the actor config (verl passes config=ActorConfig); got config=None")
    policy_loss = read_key(config, "policy_loss", None)
    clip_ratio = read_key(config, "clip_ratio", 0.2)
    sources = []

    def fallback(field: str, verl_default: float) -> float:
        value = read_key(policy_loss, field, None) if uses_divergence_thresholds or field == "ratio_cap" else None
        if value is not None:
            return checked(field, value)
        verl_key = FALLBACK_KEYS[field]
        verl_value = read_key(config, verl_key, None)
        if verl_value is None:
            verl_value = verl_default
        value = checked(field, verl_value, source=f"actor.{verl_key}")
        sources.append(f"{verl_key}={value:g}")
        return value

    def own(field: str) -> Any:
        value = checked(field, read_key(policy_loss, field, None))
        return DEFAULTS.get(field) if value is None else value

    return ResolvedOptions(
        delta_low=fallback("delta_low", clip_ratio),
        delta_high=fallback("delta_high", clip_ratio),
        ratio_cap=fallback("ratio_cap", 3.0),
        anchor=own("anchor"),
        relax_below=own("relax_below"),
        relax_side=own("relax_side"),
        topk=own("topk"),
        max_off_policy_threshold=own("max_off_policy_threshold"),
        sources=tuple(sources),
    )
