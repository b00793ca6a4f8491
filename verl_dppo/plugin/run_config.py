"""Checks of a whole run's config (the driver's view: actor, rollout and algorithm together) for the DPPO modes.

The loss sees one micro-batch and the actor's config; whether verl recomputed `old_log_probs` (bypass mode) and
how the rollout engine computed mu are settings of other sections. They are decided here, from the configuration,
on the driver: by `verl-dppo run` (also in a dry run) and at launch (the plugin's `LLMServerManager.__init__`
patch), before anything slow starts.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["RunConfigError", "check_run_config"]

logger = logging.getLogger("verl_dppo")


class RunConfigError(ValueError):
    """A DPPO mode cannot run as configured; the message names the setting to change."""


def _dppo_mode(config: Any) -> str | None:
    from verl_dppo.plugin.extras import DPPO_MODES

    policy_loss = config.actor_rollout_ref.actor.get("policy_loss", None)
    mode = policy_loss.get("loss_mode", None) if policy_loss is not None else None
    return mode if mode in DPPO_MODES else None


def check_run_config(config: Any) -> list[str]:
    """Raise `RunConfigError` for a setting under which a DPPO mode would train on the wrong policy; return the
    warnings (each also logged) for settings that run but are probably not what the user meant."""
    mode = _dppo_mode(config)
    if mode is None:
        return []
    arr = config.actor_rollout_ref
    anchor = arr.actor.policy_loss.get("anchor", "rollout")
    correction = config.get("algorithm", {}).get("rollout_correction", None) or {}
    bypass = bool(correction.get("bypass_mode", False))
    rollout = arr.rollout
    if anchor == "recompute" and bypass:
        raise RunConfigError(
            f"{mode}: policy_loss.anchor=recompute needs the recomputed old_log_probs, which bypass mode skips "
            "(old_log_probs are then the rollout's): set algorithm.rollout_correction.bypass_mode=False (or "
            "policy_loss.anchor=rollout)."
        )
    temperature = float(rollout.get("temperature", 1.0))
    if rollout.get("name", None) == "vllm" and str(rollout.get("logprobs_mode", "")).startswith("raw_") and temperature != 1.0:
        raise RunConfigError(
            f"{mode}: rollout.logprobs_mode={rollout.logprobs_mode} makes vLLM report log-probs before temperature, "
            f"while the actor divides its logits by rollout.temperature={temperature:g}: pi and mu would differ by "
            "the temperature alone. Set actor_rollout_ref.rollout.logprobs_mode=processed_logprobs (or temperature=1)."
        )
    warnings = []
    if not bypass and not rollout.get("calculate_log_probs", False):
        warnings.append(
            f"{mode}: rollout.calculate_log_probs=False with bypass_mode=False: the batch has no rollout log-probs, "
            "so the ratio and the trust region are anchored on the recomputed policy (the paper's unstable decoupled "
            "variant, Sec. 5.2): set actor_rollout_ref.rollout.calculate_log_probs=True."
        )
    for warning in warnings:
        logger.warning(warning)
    return warnings
