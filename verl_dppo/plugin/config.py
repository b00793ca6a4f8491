"""`DPPOLossConfig`: the typed options of the DPPO loss family, and how a run's config resolves to values.

Select it with `actor_rollout_ref.actor.policy_loss._target_=verl_dppo.DPPOLossConfig` and set its fields with a
`+` prefix (`+actor_rollout_ref.actor.policy_loss.delta_low=0.15`): verl 0.9.1's YAML has no such keys, and the
subclass is how its `validate_config` and dataclass conversion accept them.

Unset fields follow verl's own convention (so a script written for verl's `dppo_tv` switches over by renaming
the mode): thresholds from `actor.clip_ratio_low` / `clip_ratio_high`, the cap from `actor.clip_ratio_c`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

from verl.workers.config import PolicyLossConfig

from verl_dppo.math.trust_region import RELAX_SIDES

__all__ = ["ANCHORS", "DPPOLossConfig", "FALLBACK_KEYS", "ResolvedOptions", "check_threshold", "check_troll_options",
           "resolve_options"]

logger = logging.getLogger("verl_dppo")

ANCHORS = ("rollout", "recompute")

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

    anchor: str = "rollout"
    """Trust-region anchor: "rollout" = mu, the rollout engine's log-probs (the paper's choice, Sec. 5.2);
    "recompute" = the recomputed old_log_probs (MiniRL / decoupled DPPO: the paper's unstable ablations)."""

    relax_below: float = 0.0
    """alpha of Sec. 6: never block tokens with mu(a_t) < alpha on `relax_side` (Relax-low/high/both). 0 = off."""

    relax_side: str = "high"
    """Which side `relax_below` frees: "high" (A > 0), "low" (A < 0) or "both" (Sec. 6)."""

    topk: Optional[int] = None
    """K: how many top log-probs of mu the rollout engine reports per token (one setting per run: the plugin hands it
    to vLLM/SGLang). None = the mode's default: 20 for dppo_topk_* (K of Eq. 15/16; the paper's ablation) and 64 for
    troll (TROLL's K: at most 64 tokens of mu and of pi in the sparse support). Only read by those modes."""

    troll_eps: float = 0.05
    """TROLL (Becker et al. 2025, arXiv 2510.03817, their Eq. 3/4): trust-region radius eps, KL(p || mu) <= eps per
    token for the projected policy p. Reported value: 0.05. Only read by the troll mode."""

    troll_alpha: float = 1.0
    """TROLL (their Eq. 5): weight alpha of the regression term KL(pi || sg(p)) that pulls pi towards its projection.
    Reported value: 1.0. Only read by the troll mode."""

    troll_support_mass: float = 1.0 - 1e-5
    """TROLL's sparse support: each policy's most probable tokens until their mass reaches 1 - delta (at most K =
    `topk`), delta = 1e-5 (reported value). Only read by the troll mode."""

    ipo_tau: float = 0.0
    """IPO (prime-rl): weight tau of the penalty tau * (log pi/mu)^2 on every valid token; 0 = off (prime-rl's
    default). Only read by the ipo mode (`verl_dppo.plugin.ipo_mode`, which checks it)."""

    max_off_policy_threshold: Optional[int] = None
    """verl's `trainer.v1.sampler.max_off_policy_threshold` T, copied here (the actor never sees the trainer's
    section; the recipes interpolate it): under an asynchronous trainer, samples with lag >= T (a trajectory spanning
    more than T versions up to the trainer's, which verl's replay buffer would not keep) are counted in
    actor/dppo/lag_over_threshold_frac. None: not counted."""

    def __post_init__(self):
        # Hydra passes override values through unconverted ("inf", "1e4", "20" may arrive as strings).
        for name in ("delta_low", "delta_high", "ratio_cap", "relax_below", "troll_eps", "troll_alpha",
                     "troll_support_mass", "ipo_tau"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _to_float(name, value))
        if isinstance(self.topk, str) and self.topk.strip().isdigit():
            object.__setattr__(self, "topk", int(self.topk))
        for name in ("delta_low", "delta_high"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"policy_loss.{name} must be a finite number >= 0, got {value!r}")
        if self.ratio_cap is not None and not self.ratio_cap > 0:
            raise ValueError(f"policy_loss.ratio_cap must be > 0 (use .inf for no truncation), got {self.ratio_cap!r}")
        if self.anchor not in ANCHORS:
            raise ValueError(f"policy_loss.anchor must be one of {ANCHORS}, got {self.anchor!r}")
        if self.relax_side not in RELAX_SIDES:
            raise ValueError(f"policy_loss.relax_side must be one of {RELAX_SIDES}, got {self.relax_side!r}")
        if not 0.0 <= self.relax_below <= 1.0:
            raise ValueError(f"policy_loss.relax_below (alpha) must lie in [0, 1], got {self.relax_below!r}")
        if self.topk is not None and (isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1):
            raise ValueError(f"policy_loss.topk must be an integer >= 1, got {self.topk!r}")
        object.__setattr__(self, "max_off_policy_threshold", check_threshold(self.max_off_policy_threshold))
        check_troll_options(self.troll_eps, self.troll_alpha, self.troll_support_mass)


def check_threshold(value: Any) -> Optional[int]:
    """policy_loss.max_off_policy_threshold: None, or an integer >= 1 (verl's own rule for the sampler's)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            "policy_loss.max_off_policy_threshold must be null or an integer >= 1 (verl's "
            f"trainer.v1.sampler.max_off_policy_threshold), got {value!r}"
        )
    return value


def check_troll_options(eps: float, alpha: float, support_mass: float) -> None:
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"policy_loss.troll_eps must be a finite number > 0 (TROLL: 0.05), got {eps!r}")
    if not (alpha >= 0 and math.isfinite(alpha)):
        raise ValueError(f"policy_loss.troll_alpha must be a finite number >= 0 (TROLL: 1.0), got {alpha!r}")
    if not 0 < support_mass <= 1:
        raise ValueError(f"policy_loss.troll_support_mass must lie in (0, 1] (TROLL: 1 - 1e-5), got {support_mass!r}")


def _to_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"policy_loss.{name} must be a number, got {value!r}")
    if isinstance(value, str):
        text = value.strip().lower()
        text = {".inf": "inf", "+.inf": "inf", "-.inf": "-inf", ".nan": "nan"}.get(text, text)
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"policy_loss.{name} must be a number, got {value!r}") from None
    return float(value)


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


def _get(config: Any, key: str, default: Any = None) -> Any:
    if config is None:
        return default
    getter = getattr(config, "get", None)
    if getter is not None:
        return getter(key, default)
    return getattr(config, key, default)


def resolve_options(config: Any, uses_divergence_thresholds: bool) -> ResolvedOptions:
    """Resolve the options in effect from an actor config (verl's `ActorConfig` or a DictConfig/dict).

    `uses_divergence_thresholds` is False for `grpo_clip`, which always takes its eps from clip_ratio_low/high.
    """
    if config is None:
        raise ValueError("DPPO losses need the actor config (verl passes config=ActorConfig); got config=None")
    policy_loss = _get(config, "policy_loss", None)
    clip_ratio = _get(config, "clip_ratio", 0.2)
    sources = []

    def fallback(field: str, verl_key: str, verl_default: float) -> float:
        value = _get(policy_loss, field, None) if uses_divergence_thresholds or field == "ratio_cap" else None
        if value is not None:
            return float(value)
        verl_value = _get(config, verl_key, None)
        if verl_value is None:
            verl_value = verl_default
        sources.append(f"{verl_key}={float(verl_value):g}")
        return float(verl_value)

    delta_low = fallback("delta_low", FALLBACK_KEYS["delta_low"], clip_ratio)
    delta_high = fallback("delta_high", FALLBACK_KEYS["delta_high"], clip_ratio)
    ratio_cap = fallback("ratio_cap", FALLBACK_KEYS["ratio_cap"], 3.0)

    options = ResolvedOptions(
        delta_low=delta_low,
        delta_high=delta_high,
        ratio_cap=ratio_cap,
        anchor=str(_get(policy_loss, "anchor", "rollout")),
        relax_below=float(_get(policy_loss, "relax_below", 0.0)),
        relax_side=str(_get(policy_loss, "relax_side", "high")),
        topk=None if _get(policy_loss, "topk", None) is None else int(_get(policy_loss, "topk")),
        max_off_policy_threshold=check_threshold(_get(policy_loss, "max_off_policy_threshold", None)),
        sources=tuple(sources),
    )
    # The same checks as DPPOLossConfig, for runs that reach us with a plain PolicyLossConfig or a DictConfig.
    if options.anchor not in ANCHORS:
        raise ValueError(f"policy_loss.anchor must be one of {ANCHORS}, got {options.anchor!r}")
    if options.relax_side not in RELAX_SIDES:
        raise ValueError(f"policy_loss.relax_side must be one of {RELAX_SIDES}, got {options.relax_side!r}")
    for name in ("delta_low", "delta_high"):
        value = getattr(options, name)
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"the {name} threshold must be a finite number >= 0, got {value!r}")
    if not options.ratio_cap > 0:
        raise ValueError(f"the ratio cap C must be > 0, got {options.ratio_cap!r}")
    if not 0.0 <= options.relax_below <= 1.0:
        raise ValueError(f"policy_loss.relax_below (alpha) must lie in [0, 1], got {options.relax_below!r}")
    return options
