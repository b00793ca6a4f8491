"""The update rule a run's config trains, in one line: what `verl-dppo check` prints at its end.

    trains dppo_binary_tv: delta 0.15/0.15, ratio cap 10000, anchored on the rollout's log-probs, bypass on (no
    recompute pass), K -

The values are the worker's: the loss mode's family resolves them from the actor's config as the loss does at its
first call (`LossFamily.options`, the values its "in effect" line logs, verl's clip_ratio_* fallbacks included), and
the run's other sections say where the anchor comes from (`policy_loss.anchor`, the rollout's `calculate_log_probs`)
and whether verl recomputes the old log-probs (bypass mode). A value that differs from the paper's has the paper's
beside it; one inherited from verl's ratio clip says so. After the trust region, what else shapes the update where it
differs from the paper's recipe (`beside_the_loss`: a KL loss, the aggregation, the advantages' normalisation, an
entropy bonus, a distillation term, a rejection sampling that bypass mode drops), a few words each:

    ...; beside it, unlike the paper's recipe: KL loss low_var_kl x 0.001 (and a reference model), token-mean
    aggregation (the paper: seq-mean-token-sum-norm), advantages divided by the group's std (the paper: not)
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["update_rule", "beside_the_loss", "PAPER_UPDATE"]

PAPER_UPDATE = {
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.entropy_coeff": 0.0,
    "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum-norm",
    "algorithm.adv_estimator": "grpo",
    "algorithm.norm_adv_by_std_in_grpo": False,
    "algorithm.use_kl_in_reward": False,
}
"""What the paper's recipe (recipes/dppo.yaml) sets around the policy loss: the rest of the update a command is
compared against (`beside_the_loss`)."""


def update_rule(config: Any) -> str:
    """One line: the loss mode and the values it trains with, from a composed run config (`actor_rollout_ref`,
    `algorithm`). Raises ValueError where the options do not resolve (the loss would raise the same at its first
    call)."""
    from verl_dppo.plugin.modes import mode_named

    actor = config.actor_rollout_ref.actor
    name = str(actor.policy_loss.loss_mode)
    mode = mode_named(name)
    beside = beside_the_loss(config)
    beside_text = f"; beside it, unlike the paper's recipe: {', '.join(beside)}" if beside else ""
    if mode is None:
        return _verls_own(name, config) + beside_text
    options, family_options, _ = mode.family.options(mode, actor)
    parts = _trust_region(mode, options)
    if family_options is not None:  # a family's own options say their part (TROLL's replace the trust region)
        parts = family_options.rule_parts(parts)
    parts += [_anchor(config, options.anchor), _bypass(config)]
    if not any(part.startswith("K ") for part in parts):
        from verl_dppo.plugin.topk_mode import configured_topk

        parts.append(f"K {configured_topk(actor)}" if mode.reads_topk else "K -")
    return f"trains {name}: " + ", ".join(parts) + beside_text


def beside_the_loss(config: Any) -> list[str]:
    """What else shapes the update where it differs from the paper's recipe (`PAPER_UPDATE`), a few words each: the
    KL loss, the aggregation, the advantages, an entropy bonus, epochs, a distillation term, a rejection sampling
    that bypass mode drops."""
    from omegaconf import OmegaConf

    def get(key: str) -> Any:
        return OmegaConf.select(config, key, default=None)

    actor, found = "actor_rollout_ref.actor", []
    if get(f"{actor}.use_kl_loss"):
        found.append(
            f"KL loss {get(f'{actor}.kl_loss_type')} x {float(get(f'{actor}.kl_loss_coef') or 0):g} "
            "(and a reference model)"
        )
    if get("algorithm.use_kl_in_reward"):
        found.append("KL penalty in the reward (and a reference model)")
    agg = get(f"{actor}.loss_agg_mode")
    if agg is not None and agg != PAPER_UPDATE[f"{actor}.loss_agg_mode"]:
        found.append(f"{agg} aggregation (the paper: seq-mean-token-sum-norm)")
    elif agg is not None and get(f"{actor}.loss_scale_factor") is None:
        found.append(
            "the token sum divided by each micro-batch's padded length (loss_scale_factor unset; the "
            "paper: data.max_response_length)"
        )
    estimator = get("algorithm.adv_estimator")
    if estimator is not None and str(estimator) != "grpo":
        found.append(f"{estimator} advantages (the paper: grpo)")
    elif get("algorithm.norm_adv_by_std_in_grpo") is not False:
        found.append("advantages divided by the group's std (the paper: not)")
    if float(get(f"{actor}.entropy_coeff") or 0) != 0:
        found.append(f"entropy bonus {float(get(f'{actor}.entropy_coeff')):g}")
    epochs = get(f"{actor}.ppo_epochs")
    if epochs is not None and epochs != 1:
        found.append(f"{epochs} epochs over each batch (the paper: 1)")
    if get("distillation.enabled") and get("distillation.distillation_loss.use_task_rewards") is not False:
        coef = float(get("distillation.distillation_loss.distillation_loss_coef") or 0)
        found.append(f"plus the distillation loss {get('distillation.distillation_loss.loss_mode')} x {coef:g}")
    correction = _correction(config)
    if correction.get("bypass_mode", False) and correction.get("rollout_rs", None):
        found.append(f"rollout_rs={correction.get('rollout_rs')} dropped (bypass mode skips verl's rollout correction)")
    return found


def _trust_region(mode: Any, options: Any) -> list[str]:
    inherited = options.inherited()
    delta = mode.paper_delta  # None: not one of the paper's DPPO modes
    parts = []
    thresholds = f"{options.delta_low:g}/{options.delta_high:g}"
    if not mode.uses_divergence_thresholds:  # PPO's eps: always actor.clip_ratio_low/high
        parts.append(f"ratio clip eps {thresholds} (clip_ratio_low/high)")
    elif mode.measure is None:
        parts.append("no trust region")
    else:
        keys = [inherited[name] for name in ("delta_low", "delta_high") if name in inherited]
        notes = [f"inherited from {'/'.join(keys)}"] if keys else []
        if delta is not None and not (options.delta_low == options.delta_high == delta):
            notes.append(f"the paper's {delta:g}")
        parts.append(f"delta {thresholds}" + (f" ({'; '.join(notes)})" if notes else ""))
    if options.relax_below > 0:
        parts.append(f"relaxed below mu {options.relax_below:g} on the {options.relax_side} side")
    if mode.family.truncates:
        notes = ["inherited from clip_ratio_c"] if "ratio_cap" in inherited else []
        if delta is not None and options.ratio_cap < 10000:
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
    old = (
        "old log-probs from the rollout (bypass on, no recompute pass)"
        if _correction(config).get("bypass_mode")
        else "old log-probs recomputed every step (bypass off)"
    )
    return (
        f"trains {name}, verl's own policy loss (not the plugin's): clip_ratio_low/high {float(low):g}/"
        f"{float(high):g}, clip_ratio_c {float(_or(actor.get('clip_ratio_c', None), 3.0)):g}, {old}"
    )


def _or(value: Optional[Any], default: Any) -> Any:
    return default if value is None else value
