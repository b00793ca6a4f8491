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

__all__ = ["ANCHORS", "DPPOLossConfig", "FALLBACK_KEYS", "PAPER_RANGE", "ResolvedOptions", "check_threshold",
           "check_troll_options", "resolve_options", "inherited_out_of_range_problem", "unusual_thresholds_warning"]

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

    max_off_policy_threshold: Optional[int] = None
    """verl's `trainer.v1.sampler.max_off_policy_threshold` T, copied here (the actor never sees the trainer's
    section; the recipes interpolate it): under an asynchronous trainer, samples with lag >= T (a trajectory spanning
    more than T versions up to the trainer's, which verl's replay buffer would not keep) are counted in
    actor/dppo/lag_over_threshold_frac. None: not counted."""

    def __post_init__(self):
        # Hydra passes override values through unconverted ("inf", "1e4", "20" may arrive as strings).
        for name in ("delta_low", "delta_high", "ratio_cap", "relax_below", "troll_eps", "troll_alpha",
                     "troll_support_mass"):
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


PAPER_DELTA = {"tv": 0.15, "kl": 0.05}
"""The paper's thresholds (Sec. 5.4: DPPO-TV 0.15, DPPO-KL 0.05), which the recipes use."""

PAPER_RANGE = {"tv": (0.15, 1.0), "kl": (0.05, 0.05)}
"""Every threshold the paper and the recipes use, lowest to highest: TV 0.15 (DPPO, Sec. 5.4), 0.5 and 0.8 (the
minimal mask, Sec. 5.3) and 1.0 (a side that never blocks); KL 0.05 alone."""

CAP_RANGE = (2.0, math.inf)
"""The ratio caps C the paper and the recipes use: 2 (PG-TIS / CISPO), 10000 (the scaling runs: none in effect)."""


def _kind(loss_mode: str) -> str:
    return "kl" if str(loss_mode).endswith("_kl") else "tv"


def _paper_fix(delta: float) -> str:
    return ("actor_rollout_ref.actor.policy_loss._target_=verl_dppo.DPPOLossConfig "
            f"+actor_rollout_ref.actor.policy_loss.delta_low={delta:g} "
            f"+actor_rollout_ref.actor.policy_loss.delta_high={delta:g} "
            "+actor_rollout_ref.actor.policy_loss.ratio_cap=10000 (README: From GRPO)")


def _outside(loss_mode: str, options: "ResolvedOptions") -> dict[str, str]:
    """A DPPO mode's options outside every value the paper and the recipes use -> which way ("below", "above")."""
    if not str(loss_mode).startswith("dppo_"):
        return {}
    low, high = PAPER_RANGE[_kind(loss_mode)]
    found = {}
    for name in ("delta_low", "delta_high"):
        value = getattr(options, name)
        if value < low and not math.isclose(value, low):
            found[name] = "below"
        elif value > high and not math.isclose(value, high):
            found[name] = "above"
    if options.ratio_cap < CAP_RANGE[0]:
        found["ratio_cap"] = "below"
    return found


def _range_text(loss_mode: str) -> str:
    kind = _kind(loss_mode)
    low, high = PAPER_RANGE[kind]
    values = f"{low:g}" if low == high else f"{low:g} to {high:g}, DPPO's {PAPER_DELTA[kind]:g}"
    return f"{kind.upper()} thresholds the paper and the recipes use ({values})"


def inherited_out_of_range_problem(loss_mode: str, options: "ResolvedOptions") -> Optional[str]:
    """One line when a DPPO mode inherits from verl's ratio clip a threshold (or cap) outside every value the paper and
    the recipes use: GSPO's clip_ratio_low=0.0003 as a TV threshold blocks nearly every update that moves a token's
    probability. A problem for `verl-dppo check` (the command trains, but not anything the paper studied), where a
    value inside the range is only `inherited_thresholds_warning`. None otherwise."""
    inherited = options.inherited()
    off = {name: way for name, way in _outside(loss_mode, options).items() if name in inherited}
    if not off:
        return None
    delta = PAPER_DELTA[_kind(loss_mode)]
    values = " ".join(f"{name}={getattr(options, name):g} (actor.{inherited[name]})" for name in off)
    effects = []
    if any(way == "below" for name, way in off.items() if name != "ratio_cap"):
        effects.append("a threshold that small blocks nearly every update that moves a token's probability")
    if any(way == "above" for way in off.values()):
        effects.append("a threshold that large lets through updates the paper's trust region blocks")
    if "ratio_cap" in off:
        effects.append(f"a cap below {CAP_RANGE[0]:g} truncates the weight pi/mu harder than any of the paper's runs")
    return (f"{loss_mode}: {values} inherited from verl's ratio clip, outside the {_range_text(loss_mode)}: "
            f"{'; '.join(effects)}. Set the paper's values: {_paper_fix(delta)}")


def unusual_thresholds_warning(loss_mode: str, options: "ResolvedOptions") -> Optional[str]:
    """One line when a DPPO mode's thresholds or cap, set for it, lie outside every value the paper and the recipes
    use (a KL mode given the TV lines' 0.15: three times the paper's KL value). A choice of the user's: a warning with
    the paper's value. TV thresholds above 1 are `tv_threshold_warning`'s. None otherwise."""
    inherited = options.inherited()
    kind = _kind(loss_mode)
    off = [name for name in _outside(loss_mode, options) if name not in inherited]
    deltas = [name for name in off if name != "ratio_cap" and not (kind == "tv" and getattr(options, name) > 1)]
    said = []
    if deltas:
        values = " ".join(f"{name}={getattr(options, name):g}" for name in deltas)
        tv_low, tv_high = PAPER_RANGE["tv"]
        if kind == "kl" and any(tv_low <= getattr(options, name) <= tv_high for name in deltas):
            said.append(f"{values}: a TV-sized threshold (DPPO-TV's {PAPER_DELTA['tv']:g}, the README's TV lines), "
                        f"outside the {_range_text(loss_mode)}: set delta_low and delta_high to the paper's KL value "
                        f"{PAPER_DELTA['kl']:g}")
        else:
            said.append(f"{values} outside the {_range_text(loss_mode)}: the paper's {kind.upper()} value is "
                        f"{PAPER_DELTA[kind]:g}")
    if "ratio_cap" in off:
        said.append(f"ratio_cap={options.ratio_cap:g} below every cap the paper and the recipes use ({CAP_RANGE[0]:g} "
                    "and up): the paper's runs use 10000, no truncation (Sec. 5.4: truncating hurts)")
    return f"{loss_mode}: " + "; ".join(said) if said else None


def inherited_thresholds_warning(loss_mode: str, options: "ResolvedOptions") -> Optional[str]:
    """One line when a DPPO mode's thresholds or weight cap come from verl's ratio-clip keys (a GRPO command
    switched by its `loss_mode` line alone): PPO's eps and dual-clip cap are not the paper's divergence thresholds.
    None when every value was set for the mode (DPPOLossConfig), and for modes without thresholds."""
    if not options.sources or not str(loss_mode).startswith("dppo_"):
        return None
    delta = PAPER_DELTA[_kind(loss_mode)]
    def is_paper(source: str) -> bool:
        key, value = source.split("=", 1)
        return float(value) >= 10000.0 if key == "clip_ratio_c" else math.isclose(float(value), delta)

    off = [source for source in options.sources if not is_paper(source)]
    if not off:  # inherited, but the paper's values (the recipes put the cap in clip_ratio_c)
        return None
    return (f"{loss_mode}: {' '.join(off)} inherited from verl's ratio clip (actor.clip_ratio_*), not "
            f"the paper's settings (delta {delta:g} both sides, no cap: ratio_cap 10000): set them with "
            f"{_paper_fix(delta)}")


def tv_threshold_warning(loss_mode: str, delta_low: float, delta_high: float) -> Optional[str]:
    """One line when a TV mode's threshold exceeds 1: the total variation never does, so that side has no trust
    region at all (the same as 1.0, which Sec. 5.3's minimal negative mask sets on purpose). None otherwise."""
    if not str(loss_mode).endswith("_tv"):
        return None
    above = [f"{name}={value:g}" for name, value in (("delta_low", delta_low), ("delta_high", delta_high)) if value > 1]
    if not above:
        return None
    return (f"{loss_mode}: {' and '.join(above)} exceeds 1, the largest total variation: that side masks nothing "
            "(no trust region; 1.0 says so on purpose). TV thresholds are fractions such as 0.15, not KL values or "
            "percentages")

