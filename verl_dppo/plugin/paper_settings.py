"""A DPPO mode's options against the values the paper and the recipes use: the warnings the loss logs once and the
problems `verl-dppo check` reports (a GRPO command switched by its loss_mode line alone inherits PPO's eps).

Each mode's paper threshold and what it measures come from its registry entry (`verl_dppo.plugin.modes`); the options
are `verl_dppo.plugin.options.ResolvedOptions`. Modes without a paper threshold (grpo_clip, pg_is, troll, ipo) get
none of these lines.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from verl_dppo.plugin.modes import mode_named

if TYPE_CHECKING:
    from verl_dppo.plugin.options import ResolvedOptions

__all__ = [
    "CAP_RANGE",
    "PAPER_RANGE",
    "inherited_out_of_range_problem",
    "inherited_thresholds_warning",
    "tv_threshold_warning",
    "unusual_thresholds_warning",
]


PAPER_RANGE = {"tv": (0.15, 1.0), "kl": (0.05, 0.05)}
"""Every threshold the paper and the recipes use, lowest to highest: TV 0.15 (DPPO, Sec. 5.4), 0.5 and 0.8 (the
minimal mask, Sec. 5.3) and 1.0 (a side that never blocks); KL 0.05 alone."""

CAP_RANGE = (2.0, math.inf)
"""The ratio caps C the paper and the recipes use: 2 (PG-TIS / CISPO), 10000 (the scaling runs: none in effect)."""


def _paper_mode(loss_mode: str):
    """The registry's entry for one of the paper's DPPO modes (it has a paper threshold), else None."""
    mode = mode_named(str(loss_mode))
    return mode if mode is not None and mode.paper_delta is not None else None


def _kind(loss_mode: str) -> str:
    """What a paper mode's thresholds measure: "tv" or "kl"."""
    return _paper_mode(loss_mode).measure


def _paper_fix(delta: float) -> str:
    return (
        "actor_rollout_ref.actor.policy_loss._target_=verl_dppo.DPPOLossConfig "
        f"+actor_rollout_ref.actor.policy_loss.delta_low={delta:g} "
        f"+actor_rollout_ref.actor.policy_loss.delta_high={delta:g} "
        "+actor_rollout_ref.actor.policy_loss.ratio_cap=10000 (README: From GRPO)"
    )


def _outside(loss_mode: str, options: "ResolvedOptions") -> dict[str, str]:
    """A DPPO mode's options outside every value the paper and the recipes use -> which way ("below", "above")."""
    if _paper_mode(loss_mode) is None:
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
    values = f"{low:g}" if low == high else f"{low:g} to {high:g}, DPPO's {_paper_mode(loss_mode).paper_delta:g}"
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
    delta = _paper_mode(loss_mode).paper_delta
    values = " ".join(f"{name}={getattr(options, name):g} (actor.{inherited[name]})" for name in off)
    effects = []
    if any(way == "below" for name, way in off.items() if name != "ratio_cap"):
        effects.append("a threshold that small blocks nearly every update that moves a token's probability")
    if any(way == "above" for way in off.values()):
        effects.append("a threshold that large lets through updates the paper's trust region blocks")
    if "ratio_cap" in off:
        effects.append(f"a cap below {CAP_RANGE[0]:g} truncates the weight pi/mu harder than any of the paper's runs")
    return (
        f"{loss_mode}: {values} inherited from verl's ratio clip, outside the {_range_text(loss_mode)}: "
        f"{'; '.join(effects)}. Set the paper's values: {_paper_fix(delta)}"
    )


def unusual_thresholds_warning(loss_mode: str, options: "ResolvedOptions") -> Optional[str]:
    """One line when a DPPO mode's thresholds or cap, set for it, lie outside every value the paper and the recipes
    use (a KL mode given the TV lines' 0.15: three times the paper's KL value). A choice of the user's: a warning with
    the paper's value. TV thresholds above 1 are `tv_threshold_warning`'s. None otherwise."""
    inherited = options.inherited()
    off = [name for name in _outside(loss_mode, options) if name not in inherited]
    if not off:
        return None
    kind, delta = _kind(loss_mode), _paper_mode(loss_mode).paper_delta
    deltas = [name for name in off if name != "ratio_cap" and not (kind == "tv" and getattr(options, name) > 1)]
    said = []
    if deltas:
        values = " ".join(f"{name}={getattr(options, name):g}" for name in deltas)
        tv_low, tv_high = PAPER_RANGE["tv"]
        if kind == "kl" and any(tv_low <= getattr(options, name) <= tv_high for name in deltas):
            said.append(
                f"{values}: a TV-sized threshold (DPPO-TV's {mode_named('dppo_binary_tv').paper_delta:g}, "
                f"the README's TV lines), outside the {_range_text(loss_mode)}: set delta_low and delta_high "
                f"to the paper's KL value {delta:g}"
            )
        else:
            said.append(f"{values} outside the {_range_text(loss_mode)}: the paper's {kind.upper()} value is {delta:g}")
    if "ratio_cap" in off:
        said.append(
            f"ratio_cap={options.ratio_cap:g} below every cap the paper and the recipes use ({CAP_RANGE[0]:g} "
            "and up): the paper's runs use 10000, no truncation (Sec. 5.4: truncating hurts)"
        )
    return f"{loss_mode}: " + "; ".join(said) if said else None


def inherited_thresholds_warning(loss_mode: str, options: "ResolvedOptions") -> Optional[str]:
    """One line when a DPPO mode's thresholds or weight cap come from verl's ratio-clip keys (a GRPO command
    switched by its `loss_mode` line alone): PPO's eps and dual-clip cap are not the paper's divergence thresholds.
    None when every value was set for the mode (DPPOLossConfig), and for modes without thresholds."""
    if not options.sources or _paper_mode(loss_mode) is None:
        return None
    delta = _paper_mode(loss_mode).paper_delta

    def is_paper(source: str) -> bool:
        key, value = source.split("=", 1)
        return float(value) >= 10000.0 if key == "clip_ratio_c" else math.isclose(float(value), delta)

    off = [source for source in options.sources if not is_paper(source)]
    if not off:  # inherited, but the paper's values (the recipes put the cap in clip_ratio_c)
        return None
    return (
        f"{loss_mode}: {' '.join(off)} inherited from verl's ratio clip (actor.clip_ratio_*), not "
        f"the paper's settings (delta {delta:g} both sides, no cap: ratio_cap 10000): set them with "
        f"{_paper_fix(delta)}"
    )


def tv_threshold_warning(loss_mode: str, delta_low: float, delta_high: float) -> Optional[str]:
    """One line when a TV mode's threshold exceeds 1: the total variation never does, so that side has no trust
    region at all (the same as 1.0, which Sec. 5.3's minimal negative mask sets on purpose). None otherwise."""
    mode = mode_named(str(loss_mode))
    if mode is None or mode.measure != "tv":
        return None
    above = [f"{name}={value:g}" for name, value in (("delta_low", delta_low), ("delta_high", delta_high)) if value > 1]
    if not above:
        return None
    return (
        f"{loss_mode}: {' and '.join(above)} exceeds 1, the largest total variation: that side masks nothing "
        "(no trust region; 1.0 says so on purpose). TV thresholds are fractions such as 0.15, not KL values or "
        "percentages"
    )
