"""The DPPO loss family, registered in verl's POLICY_LOSS_REGISTRY.

Every mode is one row of `LOSS_MODES` over one shared function, `dppo_policy_loss`:

    loss_t = -A_t * sg(min(r_t, C)) * M_t * log pi(a_t),   r_t = pi(a_t) / mu(a_t)        (Eq. 11)
    M_t    = Eq. (12) with the mode's divergence D_t, taken against the anchor             (trust_region.py)

aggregated with verl's `agg_loss` and the run's `loss_agg_mode`. mu is the rollout engine's log-prob of the
sampled token, handed over by the anchoring hook; without it (a direct registry call, or a batch without
`rollout_log_probs`, as in bypass mode where old_log_probs ARE the rollout's), `old_log_prob` is mu.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss
from verl.utils.metric import AggregationType, Metric

from verl_dppo.adapter.anchoring import DPPO_MODES, current_extras
from verl_dppo.adapter.config import resolve_options
from verl_dppo.adapter.topk_actor import check_anchor, divergence_from_extras
from verl_dppo.divergence import binary_kl, binary_tv, ratio_deviation
from verl_dppo.trust_region import truncated_ratio, trust_region_keep

__all__ = ["LOSS_MODES", "LossMode", "dppo_policy_loss", "finalize_metrics", "register_all"]

logger = logging.getLogger("verl_dppo")

# The paper's "bad update" (Sec. 5.3): A < 0 and mu(a_t) - pi(a_t) > 0.5.
BAD_UPDATE_DROP = 0.5


@dataclass(frozen=True)
class LossMode:
    name: str
    divergence: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]
    """D(anchor || pi) from the two log-probs of the sampled token; None = no trust region."""
    uses_divergence_thresholds: bool
    """False: thresholds always come from actor.clip_ratio_low/high (PPO's eps), never from delta_low/high."""
    paper: str
    topk: bool = False
    """True: D is the Top-K statistic (Eq. 15/16) the actor's logits hook computed (adapter.topk_actor)."""


LOSS_MODES = (
    LossMode("dppo_binary_tv", binary_tv, True, "DPPO-Binary-TV: Eq. (12) with D = Eq. (13)"),
    LossMode("dppo_binary_kl", binary_kl, True, "DPPO-Binary-KL: Eq. (12) with D = Eq. (14)"),
    LossMode("grpo_clip", ratio_deviation, False, "GRPO / Clip-Higher: ratio clip, Eq. (9); Relax: Sec. 6"),
    LossMode("pg_is", None, True, "PG-IS; with a finite ratio_cap, PG-TIS (= CISPO)"),
    LossMode("dppo_topk_tv", None, True, "DPPO-TopK-TV: Eq. (12) with D = Eq. (15)", topk=True),
    LossMode("dppo_topk_kl", None, True, "DPPO-TopK-KL: Eq. (12) with D = Eq. (16)", topk=True),
)

# Metrics that are maxima over tokens: verl would average them over micro-batches unless told otherwise.
_MAX_METRICS = ("actor/dppo/mismatch_tv_max",)

_logged_options: set[tuple[str, str]] = set()
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def _check_shapes(**tensors: Optional[torch.Tensor]) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(
            "DPPO loss inputs must share one [batch, response_len] shape; got "
            + ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        )


def _ratio_of(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    return numerator / denominator.clamp(min=1)


def dppo_policy_loss(
    mode: LossMode,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    options = resolve_options(config, mode.uses_divergence_thresholds)
    log_key = (mode.name, options.describe())
    if log_key not in _logged_options:
        _logged_options.add(log_key)
        logger.warning("verl-dppo %s in effect: %s", mode.name, options.describe())

    extras = current_extras()
    rollout_log_prob = extras.rollout_log_probs if extras is not None else None
    entropy = extras.entropy if extras is not None else None
    _check_shapes(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        rollout_log_probs=rollout_log_prob,
        entropy=entropy,
    )
    if rollout_is_weights is not None:
        _warn_once(
            "is_weights",
            f"{mode.name} weights every token by pi/mu itself; verl's rollout-correction IS weights "
            "(algorithm.rollout_correction.rollout_is) are ignored so the correction is not applied twice.",
        )

    if mode.topk:
        check_anchor(mode.name, options.anchor)
    if options.anchor == "recompute" and rollout_log_prob is None:
        raise ValueError(
            f"{mode.name} with policy_loss.anchor='recompute' needs both the rollout log-probs (mu) and the "
            "recomputed old_log_probs, but this batch carries no rollout_log_probs: set "
            "actor_rollout_ref.rollout.calculate_log_probs=True and algorithm.rollout_correction.bypass_mode=False "
            "(or use anchor='rollout')."
        )
    # mu: the policy that generated the data. Without the hook, old_log_prob is mu (bypass mode / direct call).
    mu_log_prob = rollout_log_prob if rollout_log_prob is not None else old_log_prob
    anchor_log_prob = old_log_prob if options.anchor == "recompute" else mu_log_prob

    response = response_mask.bool()
    pi = log_prob.detach().float()
    mu = mu_log_prob.detach().float()
    anchor = anchor_log_prob.detach().float()
    adv = advantages.detach().float()

    # A token whose mu or anchor log-prob is NaN/inf (e.g. -inf: probability 0 under the engine) has no finite
    # ratio: it is dropped from the update and counted in actor/dppo/dropped_frac.
    valid = response & torch.isfinite(mu) & torch.isfinite(anchor)
    zeros = torch.zeros_like(pi)
    pi = torch.where(valid, pi, zeros)
    mu = torch.where(valid, mu, zeros)
    anchor = torch.where(valid, anchor, zeros)

    if mode.topk:
        divergence = divergence_from_extras(mode.name, extras, options.anchor, valid)
    else:
        divergence = mode.divergence(anchor, pi) if mode.divergence is not None else None
    mu_prob = torch.exp(mu)
    keep = trust_region_keep(
        adv,
        pi - anchor,
        divergence,
        options.delta_low,
        options.delta_high,
        rollout_prob=mu_prob,
        relax_below=options.relax_below,
        relax_side=options.relax_side,
    )
    weight = truncated_ratio(pi, mu, options.ratio_cap)
    coefficient = torch.where(valid & keep, -adv * weight, zeros)
    # where() (not a product) keeps a non-finite log-prob outside the loss from reaching the gradient as NaN.
    loss_mat = coefficient * torch.where(valid, log_prob.float(), zeros)
    global_batch_info = dict(getattr(config, "global_batch_info", None) or {})
    loss = agg_loss(loss_mat=loss_mat, loss_mask=response, loss_agg_mode=loss_agg_mode, **global_batch_info)

    # Diagnostics: reduced on device, one host transfer for all of them.
    anchored_on_mu = options.anchor == "rollout" and divergence is not None
    mismatch_kl = divergence if anchored_on_mu and mode.divergence is binary_kl else binary_kl(mu, pi)
    fvalid = valid.float()
    blocked = valid & ~keep
    fblocked = blocked.float()
    positive, negative = (adv > 0) & valid, (adv < 0) & valid
    n_valid = fvalid.sum()
    pi_prob = torch.exp(pi)
    mismatch = (pi_prob - mu_prob).abs() * fvalid
    stats = {
        "actor/pg_clipfrac": _ratio_of(fblocked.sum(), n_valid),
        "actor/ppo_kl": _ratio_of(((anchor - pi) * fvalid).sum(), n_valid),
        "actor/pg_clipfrac_lower": _ratio_of(((weight >= options.ratio_cap) & valid).float().sum(), n_valid),
        "actor/dppo/masked_frac_pos": _ratio_of((blocked & positive).float().sum(), positive.float().sum()),
        "actor/dppo/masked_frac_neg": _ratio_of((blocked & negative).float().sum(), negative.float().sum()),
        "actor/dppo/mismatch_tv_mean": _ratio_of(mismatch.sum(), n_valid),
        "actor/dppo/mismatch_tv_max": mismatch.max() if mismatch.numel() else zeros.sum(),
        "actor/dppo/mismatch_kl_mean": _ratio_of((mismatch_kl * fvalid).sum(), n_valid),
        "actor/dppo/bad_update_frac": _ratio_of(
            (negative & (mu_prob - pi_prob > BAD_UPDATE_DROP)).float().sum(), n_valid
        ),
        "actor/dppo/masked_rollout_prob_mean": _ratio_of((mu_prob * fblocked).sum(), fblocked.sum()),
        "actor/dppo/dropped_frac": _ratio_of((response & ~valid).float().sum(), response.float().sum()),
    }
    if entropy is not None:
        stats["actor/dppo/masked_entropy_mean"] = _ratio_of(
            (torch.where(blocked, entropy.float(), zeros)).sum(), fblocked.sum()
        )
    checks = {
        "n_response": response.float().sum(),
        "nonfinite_pi": (response & ~torch.isfinite(log_prob.detach())).float().sum(),
        "nonfinite_adv": (response & ~torch.isfinite(advantages.detach())).float().sum(),
        "anchor_differs": ((old_log_prob.detach() != mu_log_prob.detach()) & valid).float().sum()
        if options.anchor == "recompute"
        else zeros.sum(),
    }
    names = list(stats) + list(checks)
    values = dict(zip(names, torch.stack([*stats.values(), *checks.values()]).tolist()))
    metrics = {name: values[name] for name in stats}

    if values["nonfinite_pi"] > 0:
        raise FloatingPointError(
            f"{mode.name}: the current policy's log-probs are NaN/inf at {int(values['nonfinite_pi'])} response "
            "tokens; the actor's forward pass produced non-finite values (check the learning rate, gradient "
            "clipping and mixed-precision settings)."
        )
    if values["nonfinite_adv"] > 0:
        raise FloatingPointError(
            f"{mode.name}: the advantages are NaN/inf at {int(values['nonfinite_adv'])} response tokens; check "
            "the reward function and algorithm.adv_estimator."
        )
    if options.anchor == "recompute" and values["anchor_differs"] == 0 and values["n_response"] > 0:
        raise ValueError(
            f"{mode.name} with policy_loss.anchor='recompute': old_log_probs equal the rollout log-probs, so the "
            "recomputed anchor does not exist; set algorithm.rollout_correction.bypass_mode=False (or use "
            "anchor='rollout')."
        )
    if metrics["actor/dppo/dropped_frac"] > 0:
        _warn_once(
            "dropped",
            f"{mode.name}: some response tokens have a NaN/inf rollout or anchor log-prob (e.g. probability 0 "
            "under the rollout engine); they are left out of the update (actor/dppo/dropped_frac).",
        )
    if values["n_response"] == 0:
        # Empty responses: verl's local normalisers would divide 0 by 0. Nothing to learn from: a zero loss that
        # still reaches the parameters, so backward() works.
        loss = torch.where(response, log_prob.float(), zeros).sum() * 0.0
    return loss, metrics


def finalize_metrics(metrics: dict) -> dict:
    """Give max-type diagnostics verl's MAX aggregation (ppo_loss wraps every loss metric as a MEAN)."""
    for name in _MAX_METRICS:
        metric = metrics.get(name)
        if isinstance(metric, Metric) and metric.aggregation is not AggregationType.MAX:
            maximum = Metric(aggregation=AggregationType.MAX)
            maximum.extend(list(metric.values))
            metrics[name] = maximum
    return metrics


def _make_loss_fn(mode: LossMode) -> Callable:
    def loss_fn(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return dppo_policy_loss(
            mode, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
        )

    loss_fn.__name__ = loss_fn.__qualname__ = f"compute_policy_loss_{mode.name}"
    loss_fn.__doc__ = f"{mode.paper}. See verl_dppo.adapter.losses.dppo_policy_loss."
    return loss_fn


def register_all() -> list[str]:
    """Register every mode under a new name; never overwrite one of verl's own losses."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    for mode in LOSS_MODES:
        existing = POLICY_LOSS_REGISTRY.get(mode.name)
        if existing is not None and not getattr(existing, "__verl_dppo__", False):
            raise RuntimeError(f"verl already registers a policy loss named {mode.name!r}; refusing to overwrite it")
        loss_fn = _make_loss_fn(mode)
        loss_fn.__verl_dppo__ = True
        register_policy_loss(mode.name)(loss_fn)
        DPPO_MODES.add(mode.name)
    return [mode.name for mode in LOSS_MODES]
