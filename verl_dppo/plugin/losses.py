"""The DPPO loss family, registered in verl's POLICY_LOSS_REGISTRY: the part every mode shares.

Every mode runs one function, `dppo_policy_loss`:

    loss_t = -A_t * sg(min(r_t, C)) * M_t * log pi(a_t),   r_t = pi(a_t) / mu(a_t)        (Eq. 11)
    M_t    = Eq. (12) with the mode's divergence D_t, taken against the anchor             (trust_region.py)

aggregated with verl's `agg_loss` and the run's `loss_agg_mode`. What a mode's family changes (its options, D_t, the
terms from the engine's logits hook, the per-token loss, its own diagnostics) lives in its module,
`verl_dppo/plugin/<family>_mode.py` (`verl_dppo.plugin.loss_family` gives the interface): `binary_mode` (the
binary DPPO modes, GRPO's clip, PG-IS), `ipo_mode` (prime-rl's IPO), `topk_mode` (Top-K DPPO), `troll_mode` (TROLL,
arXiv 2510.03817: its Eq. 5 in place of Eq. 11, nothing masked). The registry (`verl_dppo.plugin.modes`) finds every
such module; its modes are registered here; a new family is one new module. mu is the rollout engine's log-prob of the sampled token, handed over by the anchoring hook; without it
(a direct registry call, or a batch without `rollout_log_probs`, as in bypass mode where old_log_probs ARE the
rollout's), `old_log_prob` is mu.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss

from verl_dppo.math.divergence import (
    MAX_LOG_RATIO,
    binary_kl_floored,
    floor_logprob,
    nearest_within_rounding,
    rounding_radius,
)
from verl_dppo.plugin.paper_settings import inherited_thresholds_warning, tv_threshold_warning
from verl_dppo.plugin.extras import DPPO_MODES, current_extras
from verl_dppo.plugin.log_once import warn_once
from verl_dppo.plugin.loss_family import LossMode, Tokens
from verl_dppo.plugin.metrics import ratios
from verl_dppo.plugin.modes import loss_modes
from verl_dppo.plugin.staleness import OVER_THRESHOLD, staleness_parts, staleness_sums

__all__ = ["LOSS_MODES", "LossMode", "MAX_LOG_RATIO", "dppo_policy_loss", "register_all"]


# The paper's "bad update" (Sec. 5.3): A < 0 and mu(a_t) - pi(a_t) > 0.5.
BAD_UPDATE_DROP = 0.5


LOSS_MODES = loss_modes()
"""Every mode of the registry (`verl_dppo.plugin.modes`: each `*_mode.py` module's FAMILY)."""


def _check_shapes(**tensors: Optional[torch.Tensor]) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(
            "DPPO loss inputs must share one [batch, response_len] shape; got "
            + ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        )


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
    family = mode.family
    options, family_options, described = family.options(mode, config)
    _announce(mode.name, options, described)
    extras = current_extras()
    rollout_log_prob = _checked_inputs(
        mode, options, extras, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights
    )
    # mu: the policy that generated the data. Without the hook, old_log_prob is mu (bypass mode / direct call).
    mu_log_prob = rollout_log_prob if rollout_log_prob is not None else old_log_prob
    anchored_on_mu = options.anchor == "rollout"
    response = response_mask.bool()
    pi, mu, adv = log_prob.detach().float(), mu_log_prob.detach().float(), advantages.detach().float()
    anchor = mu if anchored_on_mu else old_log_prob.detach().float()
    hook, unusable = family.hook_terms(mode, extras, options, response)
    # One scalar transfer picks the path: the sum of every input is finite iff all of them are. The common,
    # all-finite case then needs no masking of its inputs at all. The hook's marker is NaN at unusable tokens.
    probe = pi.sum() + mu.sum() + adv.sum() + (0.0 if anchored_on_mu else anchor.sum())
    if unusable is not None:
        probe = probe + unusable.sum()
    sanitized = not bool(torch.isfinite(probe))
    valid = response
    if sanitized:
        pi, mu, anchor, adv, unusable, valid = _drop_nonfinite(
            mode.name, response, pi, mu, anchor, adv, anchored_on_mu, unusable
        )
    tokens = Tokens(
        mode=mode,
        options=options,
        family_options=family_options,
        log_prob=log_prob,
        pi=pi,
        mu=mu,
        anchor=anchor,
        adv=adv,
        response=response,
        valid=valid,
        sanitized=sanitized,
        anchored_on_mu=anchored_on_mu,
        hook=hook,
        unusable=unusable,
        **_measure(pi, mu, anchor, anchored_on_mu, options.ratio_cap, log_prob.dtype, mu_log_prob.dtype),
    )
    blocked = family.blocked(tokens, family.divergence(tokens))
    global_batch_info = dict(getattr(config, "global_batch_info", None) or {})
    loss = agg_loss(
        loss_mat=family.loss_matrix(tokens, blocked),
        loss_mask=response,
        loss_agg_mode=loss_agg_mode,
        **global_batch_info,
    )
    own = {**family.metrics(tokens), **_rows_mass(family, extras, valid)}
    metrics, ratio_parts = _diagnostics(
        tokens, blocked & valid, (tokens.ratio >= options.ratio_cap) & family.truncates, extras, own
    )
    if extras is not None:
        # Through verl's ppo_loss: the wrapper turns these into metrics that verl's aggregation over
        # micro-batches and data-parallel ranks keeps exact (see RatioMetric).
        extras.ratio_parts = ratio_parts
    if ratio_parts["actor/dppo/dropped_frac"][1] == 0:
        # Empty responses: verl's local normalisers would divide 0 by 0. Nothing to learn from: a zero loss that
        # still reaches the parameters, so backward() works.
        loss = family.zero_loss(tokens)
    return loss, metrics


def _announce(mode_name: str, options, described: str) -> None:
    """Once per process and setting: the values in effect, and what in them is probably not meant."""
    warn_once(("in effect", mode_name, described), "verl-dppo %s in effect: %s", mode_name, described)
    for kind, warning in (
        ("wide", tv_threshold_warning(mode_name, options.delta_low, options.delta_high)),
        ("inherited", inherited_thresholds_warning(mode_name, options)),
    ):
        if warning:
            warn_once((kind, mode_name, described), "verl-dppo %s", warning)


def _rows_mass(family, extras, valid: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The rollout's top-K rows as the engine sent them, where the batch has them: their mean mass per valid token
    (`<prefix>rollout_topk_mass_mean`), which shows in the log that they came through."""
    if extras is None or extras.topk_mass is None or extras.topk_mass.shape != valid.shape:
        return {}
    mass = torch.where(valid, extras.topk_mass.float(), 0.0).sum()
    return {f"{family.metric_prefix}rollout_topk_mass_mean": (mass, valid.sum().float())}


def _checked_inputs(mode, options, extras, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights):
    """The shapes, the settings the mode's family refuses, and the anchor's inputs; returns the rollout log-probs
    (mu) the hook handed over, or None."""
    rollout_log_prob = extras.rollout_log_probs if extras is not None else None
    _check_shapes(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        rollout_log_probs=rollout_log_prob,
        entropy=extras.entropy if extras is not None else None,
    )
    if rollout_is_weights is not None:
        warn_once(
            "is_weights",
            f"{mode.name} weights every token by pi/mu itself; verl's rollout-correction IS weights "
            "(algorithm.rollout_correction.rollout_is) are ignored so the correction is not applied twice.",
        )
    mode.family.check(mode, options)
    if options.anchor == "recompute" and rollout_log_prob is None:
        raise ValueError(
            f"{mode.name} with policy_loss.anchor='recompute' needs both the rollout log-probs (mu) and the "
            "recomputed old_log_probs, but this batch carries no rollout_log_probs: set "
            "actor_rollout_ref.rollout.calculate_log_probs=True and algorithm.rollout_correction.bypass_mode=False "
            "(or use anchor='rollout')."
        )
    if extras is not None and rollout_log_prob is None:
        warn_once(
            "no_rollout_log_probs",
            f"{mode.name}: the training batch carries no rollout_log_probs, so old_log_probs stand in for mu. With "
            "algorithm.rollout_correction.bypass_mode=False those are the recomputed policy: the ratio and the trust "
            "region are then anchored on it (the paper's unstable decoupled variant, Sec. 5.2), not on the rollout "
            "policy: set actor_rollout_ref.rollout.calculate_log_probs=True.",
        )
    return rollout_log_prob


def _measure(pi, mu, anchor, anchored_on_mu, ratio_cap, pi_dtype, mu_dtype) -> dict[str, torch.Tensor]:
    """The ratio and the mismatch statistics every mode logs (the `Tokens` fields its family reads). A log-prob
    computed in bf16 does not resolve a confident token's 1 - p below bf16's eps: the binary divergences are measured
    at the pair (mu', pi') nearest each other with each side within its own rounding (rounding_radius; 0 for float32
    inputs), the ratio and mu(a_t) (Relax's alpha, the metrics) at the values given."""
    log_ratio = pi - mu
    ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO))  # r_t = pi / mu, always against the rollout policy
    mu_near, pi_near = nearest_within_rounding(mu, pi, rounding_radius(mu, mu_dtype), rounding_radius(pi, pi_dtype))
    mu_floored, pi_floored = floor_logprob(mu_near), floor_logprob(pi_near)
    mu_near_prob = torch.exp(mu_floored)
    drop = mu_near_prob - torch.exp(pi_floored)  # mu(a_t) - pi(a_t), at the nearest pair
    return dict(
        ratio=ratio,
        weight=ratio.clamp(max=ratio_cap),
        log_ratio_to_anchor=log_ratio if anchored_on_mu else pi - anchor,
        mu_prob=torch.exp(floor_logprob(mu)),  # mu(a_t) as given
        drop=drop,
        mismatch_tv=drop.abs(),  # Eq. (13) against mu
        mismatch_kl=binary_kl_floored(mu_floored, pi_floored, mu_near_prob),  # Eq. (14) against mu
    )


def _drop_nonfinite(mode_name, response, pi, mu, anchor, adv, anchored_on_mu, unusable=None):
    """The rare path: some input is NaN/inf. Errors for the current policy and the advantages (on response
    tokens); a token whose mu or anchor log-prob is NaN/inf (e.g. -inf: probability 0 under the engine), or whose
    rollout statistics are unusable (the hook's marker is NaN there: Top-K's D, TROLL's terms), has no finite ratio
    or divergence: it is dropped from the update and counted in actor/dppo/dropped_frac. Values outside the response
    are zeroed, whatever they are."""
    valid = response & torch.isfinite(mu)
    if not anchored_on_mu:
        valid &= torch.isfinite(anchor)
    if unusable is not None:
        valid &= ~torch.isnan(unusable)
    bad_pi, bad_adv, dropped = torch.stack(
        [(response & ~torch.isfinite(pi)).sum(), (response & ~torch.isfinite(adv)).sum(), (response & ~valid).sum()]
    ).tolist()
    if bad_pi:
        raise FloatingPointError(
            f"{mode_name}: the current policy's log-probs are NaN/inf at {bad_pi} response tokens; the actor's "
            "forward pass produced non-finite values (check the learning rate, gradient clipping and "
            "mixed-precision settings)."
        )
    if bad_adv:
        raise FloatingPointError(
            f"{mode_name}: the advantages are NaN/inf at {bad_adv} response tokens; check the reward function "
            "and algorithm.adv_estimator."
        )
    if dropped:
        warn_once(
            "dropped",
            f"{mode_name}: some response tokens have a NaN/inf rollout or anchor log-prob (e.g. probability 0 "
            "under the rollout engine); they are left out of the update (actor/dppo/dropped_frac).",
        )
    outside = ~valid
    pi, mu, adv = pi.masked_fill(outside, 0.0), mu.masked_fill(outside, 0.0), adv.masked_fill(outside, 0.0)
    anchor = mu if anchored_on_mu else anchor.masked_fill(outside, 0.0)
    if unusable is not None:
        unusable = unusable.masked_fill(outside, 0.0)
    return pi, mu, anchor, adv, unusable, valid


def _diagnostics(
    tokens: Tokens,
    blocked: torch.Tensor,
    truncated: torch.Tensor,
    extras: Any,
    own: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
    """Every diagnostic reduced on device to a few scalars, read back in one host transfer: `blocked` the masked
    valid tokens, `truncated` those whose ratio reached the cap, `extras` the entropy and the lags where the batch
    has them, `own` the family's diagnostics (and the rollout's top-K mass) as 0-d (numerator, denominator) sums.

    Returns the metrics of this micro-batch, and each mean-type metric as (numerator, denominator): a mean over
    a condition (A > 0, masked, ...) is a ratio of sums, and only the sums add up exactly over the micro-batches
    and data-parallel ranks of a mini-batch (a mean of per-micro-batch ratios is biased whenever the micro-batches
    differ in how many tokens meet the condition).
    """
    valid, adv, drop, mismatch_tv = tokens.valid, tokens.adv, tokens.drop, tokens.mismatch_tv
    entropy = extras.entropy if extras is not None else None
    lags = extras.lags if extras is not None else None
    threshold = tokens.options.max_off_policy_threshold
    valid_f, blocked_f = valid.float().view(-1), blocked.float().view(-1)
    positive, negative = adv > 0, adv < 0
    counts = (
        torch.stack(
            [
                valid,
                blocked,
                positive & valid,
                blocked & positive,
                negative & valid,
                blocked & negative,
                negative & valid & (drop > BAD_UPDATE_DROP),
                truncated & valid,
            ]
        )
        .view(8, -1)
        .sum(dim=1)
        .float()
    )
    sums = torch.stack(
        [
            tokens.response.sum().float(),
            torch.dot(mismatch_tv.view(-1), valid_f),
            torch.dot(tokens.mismatch_kl.view(-1), valid_f),
            torch.dot(tokens.log_ratio_to_anchor.view(-1), valid_f),
            torch.dot(tokens.mu_prob.view(-1), blocked_f),
            torch.dot(entropy.float().reshape(-1), blocked_f) if entropy is not None else valid_f.new_zeros(()),
            (mismatch_tv.view(-1) * valid_f).max() if valid_f.numel() else valid_f.new_zeros(()),
        ]
    )
    stale = [] if lags is None else [staleness_sums(lags, valid, blocked, mismatch_tv, threshold)]
    pairs = [torch.stack([num.float(), den.float()]) for num, den in own.values()]
    values = torch.cat([*pairs, counts, sums, *stale]).tolist()  # the one transfer
    parts = {name: (values[2 * i], values[2 * i + 1]) for i, name in enumerate(own)}
    values = values[2 * len(own) :]
    (
        n_valid,
        n_blocked,
        n_pos,
        n_blocked_pos,
        n_neg,
        n_blocked_neg,
        n_bad,
        n_truncated,
        n_response,
        tv_sum,
        kl_sum,
        log_ratio_sum,
        masked_mu_sum,
        masked_entropy_sum,
        tv_max,
    ) = values[:15]

    parts.update(
        {
            "actor/pg_clipfrac": (n_blocked, n_valid),
            "actor/ppo_kl": (-log_ratio_sum, n_valid),
            "actor/pg_clipfrac_lower": (n_truncated, n_valid),
            "actor/dppo/masked_frac_pos": (n_blocked_pos, n_pos),
            "actor/dppo/masked_frac_neg": (n_blocked_neg, n_neg),
            "actor/dppo/mismatch_tv_mean": (tv_sum, n_valid),
            "actor/dppo/mismatch_kl_mean": (kl_sum, n_valid),
            "actor/dppo/bad_update_frac": (n_bad, n_valid),
            "actor/dppo/masked_rollout_prob_mean": (masked_mu_sum, n_blocked),
            "actor/dppo/dropped_frac": (n_response - n_valid, n_response),
        }
    )
    if entropy is not None:
        parts["actor/dppo/masked_entropy_mean"] = (masked_entropy_sum, n_blocked)
    if lags is not None:
        parts.update(staleness_parts(values[15:], threshold))
        if threshold is not None and parts[OVER_THRESHOLD][0] > 0:
            warn_once(
                "over_threshold",
                f"some samples are {threshold}+ policy versions older than the trainer "
                f"(policy_loss.max_off_policy_threshold={threshold}): older than verl's replay buffer keeps; "
                f"counted in {OVER_THRESHOLD}.",
            )
    metrics = ratios(parts)
    metrics["actor/dppo/mismatch_tv_max"] = tv_max
    return metrics, parts


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
    loss_fn.__doc__ = f"{mode.paper}. See verl_dppo.plugin.losses.dppo_policy_loss."
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


# Registered at import, as verl's own losses are (by decorator). The plugin imports this module when verl imports its
# registry (`verl_dppo.plugin.entry`); in a process that imports this module first, which imports verl and so the
# plugin, the plugin finds it half-initialised, and the modes are registered here once the module is whole.
register_all()
