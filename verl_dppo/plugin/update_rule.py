"""The update rule a run's config trains, in one line: what `verl-dppo check` prints at its end.

    trains dppo_binary_tv: delta 0.15/0.15, ratio cap 10000, anchored on the rollout's log-probs, bypass on (no
    recompute pass), K -

The values are the worker's: the loss mode's family resolves them from the actor's config as the loss does at its
first call (`LossFamily.options`, the values its "in effect" line logs, verl's clip_ratio_* fallbacks included), and
the run's other sections say where the anchor comes from (`policy_loss.anchor`, the rollout's `calculate_log_probs`)
and whether verl recomputes the old log-probs (bypass mode). A value that differs from the paper's has the paper's
beside it; one inherited from verl's ratio clip says so.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["update_rule"]


def update_rule(config: Any) -> str:
    """One line: the loss mode and the values it trains with, from a composed run config (`actor_rollout_ref`,
    `algorithm`). Raises ValueError where the options do not resolve (the loss would raise the same at its first
    call)."""
    from verl_dppo.plugin.losses import LOSS_MODES

    actor = config.actor_rollout_ref.actor
    name = str(actor.policy_loss.loss_mode)
    mode = next((mode for mode in LOSS_MODES if mode.name == name), None)
    if mode is None:
        return _verls_own(name, config)
    options, family_options, _ = mode.family.options(mode, actor)
    parts = _trust_region(mode, options, family_options)
    parts += [_anchor(config, options.anchor), _bypass(config)]
    if family_options is None:  # TROLL names its K with its own options
        from verl_dppo.plugin.topk_mode import TOPK_MODES, configured_topk

        parts.append(f"K {configured_topk(actor)}" if name in TOPK_MODES else "K -")
    return f"trains {name}: " + ", ".join(parts)


def _trust_region(mode: Any, options: Any, family_options: Any) -> list[str]:
    from verl_dppo.plugin.config import PAPER_DELTA
    from verl_dppo.plugin.topk_mode import is_topk_mode
    from verl_dppo.plugin.troll_mode import TrollOptions

    if isinstance(family_options, TrollOptions):
        troll = family_options
        return [f"eps {troll.eps:g}", f"K {troll.topk}", f"support mass {troll.support_mass:.10g}",
                f"alpha {troll.alpha:g}"]
    inherited = options.inherited()
    paper = mode.name.startswith("dppo_")
    parts = []
    thresholds = f"{options.delta_low:g}/{options.delta_high:g}"
    if not mode.uses_divergence_thresholds:  # PPO's eps: always actor.clip_ratio_low/high
        parts.append(f"ratio clip eps {thresholds} (clip_ratio_low/high)")
    elif mode.divergence is None and not is_topk_mode(mode.name):
        parts.append("no trust region")
    else:
        delta = PAPER_DELTA["kl" if mode.name.endswith("_kl") else "tv"]
        keys = [inherited[name] for name in ("delta_low", "delta_high") if name in inherited]
        notes = [f"inherited from {'/'.join(keys)}"] if keys else []
        if paper and not (options.delta_low == options.delta_high == delta):
            notes.append(f"the paper's {delta:g}")
        parts.append(f"delta {thresholds}" + (f" ({'; '.join(notes)})" if notes else ""))
    if options.relax_below > 0:
        parts.append(f"relaxed below mu {options.relax_below:g} on the {options.relax_side} side")
    if mode.family.truncates:
        notes = ["inherited from clip_ratio_c"] if "ratio_cap" in inherited else []
        if paper and options.ratio_cap < 10000:
            notes.append("the paper's 10000")
        parts.append(f"ratio cap {options.ratio_cap:g}" + (f" ({'; '.join(notes)})" if notes else ""))
    return parts


def _correction(config: Any) -> Any:
    return (config.get("algorithm", None) or {}).get("rollout_correction", None) or {}


def _anchor(config: Any, anchor: str) -> str:
    if anchor == "recompute":
        return "anchored on the recomputed old log-probs (anchor=recompute)"
    if config.actor_rollout_ref.rollout.get("calculate_log_probs", False):
        return "anchored on the rollout's log-probs"
    return "anchored on the recomputed log-probs (the rollout reports none: calculate_log_probs=False)"


def _bypass(config: Any) -> str:
    if _correction(config).get("bypass_mode", False):
        return "bypass on (no recompute pass)"
    return "bypass off (verl recomputes the old log-probs every step)"


def _verls_own(name: str, config: Any) -> str:
    """verl's own loss modes (vanilla, gspo, dppo_tv...): the ratio clip's keys as verl reads them."""
    actor = config.actor_rollout_ref.actor
    clip = actor.get("clip_ratio", 0.2)
    low, high = (_or(actor.get(key, None), clip) for key in ("clip_ratio_low", "clip_ratio_high"))
    old = ("old log-probs from the rollout (bypass on, no recompute pass)" if _correction(config).get("bypass_mode")
           else "old log-probs recomputed every step (bypass off)")
    return (f"trains {name}, verl's own policy loss (not the plugin's): clip_ratio_low/high {float(low):g}/"
            f"{float(high):g}, clip_ratio_c {float(_or(actor.get('clip_ratio_c', None), 3.0)):g}, {old}")


def _or(value: Optional[Any], default: Any) -> Any:
    return default if value is None else value
