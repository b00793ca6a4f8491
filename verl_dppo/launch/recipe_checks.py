"""What verl does not check of a composed recipe until the first actor update, hours into a run: that the loss mode
is registered, that the run trains a step, the trainer mode chosen the plugin's way, the anchor against bypass mode
and the Top-K modes' rollout. Each raises RecipeError naming the setting to change (`verl_dppo.launch.compose`'s
`recipe_problems` runs them all)."""

from __future__ import annotations

from typing import Any

from verl_dppo.launch.recipe_files import RecipeError

__all__ = [
    "check_anchor",
    "check_length",
    "check_loss_registered",
    "check_supported",
    "check_topk_rollout",
    "check_trainer_mode",
]


def _loss_registered(loss_mode: str) -> bool:
    import verl  # noqa: F401  (loads the verl.plugins entry points: our loss modes)
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    return loss_mode in POLICY_LOSS_REGISTRY


def check_loss_registered(config: Any) -> None:
    loss_mode = config.actor_rollout_ref.actor.policy_loss.loss_mode
    if _loss_registered(loss_mode):
        return
    import difflib

    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    close = difflib.get_close_matches(str(loss_mode), sorted(POLICY_LOSS_REGISTRY), n=1, cutoff=0.6)
    if close:
        raise RecipeError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}: not registered in verl's "
            f"POLICY_LOSS_REGISTRY. Did you mean {close[0]!r}? (`verl-dppo doctor` lists the registered modes.)"
        )
    raise RecipeError(
        f"loss mode {loss_mode!r} is not registered in verl's POLICY_LOSS_REGISTRY: the plugin that provides it "
        "is not installed or failed to load (run `verl-dppo doctor`), or "
        "actor_rollout_ref.actor.policy_loss.loss_mode is misspelt."
    )


def check_trainer_mode(config: Any) -> None:
    chosen = config.dppo.get("trainer_mode", "sync") if config.get("dppo") is not None else None
    running = config.trainer.v1.get("trainer_mode", "sync")
    if chosen is not None and chosen != running:
        raise RecipeError(
            f"trainer.v1.trainer_mode={running} set by an override: choose the trainer with --trainer-mode {running} "
            f"(recipes/trainer_mode/{running}.yaml also sets what that trainer needs), not the bare key."
        )
    if not config.trainer.get("use_v1", True):
        raise RecipeError(
            "trainer.use_v1=False: `verl-dppo run` launches verl's v1 trainer, as `main_ppo` does by default (verl "
            "0.9.1 deprecates the legacy one; the plugin is tested on v1 only and its Top-K modes need it): remove "
            "trainer.use_v1=False."
        )


def check_length(config: Any) -> None:
    """A run that would train nothing: verl starts Ray, trains no step and exits 0 with an empty log."""
    steps = config.trainer.get("total_training_steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise RecipeError(
            f"trainer.total_training_steps={steps}: a run trains at least one step; set a positive "
            "number, or null to train trainer.total_epochs over the data"
        )
    epochs = config.trainer.get("total_epochs")
    if steps is None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
        raise RecipeError(f"trainer.total_epochs={epochs}: a run trains at least one epoch; set a positive number")


def check_topk_rollout(config: Any) -> None:
    """The Top-K modes' driver-side rollout check (it runs again at launch), on a copy: the config stays as composed."""
    import copy

    from verl_dppo.patches.llm_server import sync_rollout_config

    try:
        sync_rollout_config(copy.deepcopy(config))
    except ValueError as error:
        raise RecipeError(str(error)) from None


def check_anchor(config: Any) -> None:
    """The run-level checks the plugin repeats at launch (anchor vs bypass mode, how the rollout computes mu)."""
    from verl_dppo.plugin.run_config import RunConfigError, check_run_config

    try:
        check_run_config(config)
    except RunConfigError as error:
        raise RecipeError(str(error)) from None
    from verl_dppo.plugin.run_config import is_plugin_mode

    if is_plugin_mode(config) and not config.actor_rollout_ref.rollout.calculate_log_probs:
        raise RecipeError(
            "the DPPO losses need the rollout engine's log-probs (mu): set "
            "actor_rollout_ref.rollout.calculate_log_probs=True."
        )


def check_supported(config: Any) -> list[str]:
    """Combinations verl-dppo does not run, each saying what to do; [] when none. They compose and pass verl's
    checks, so a dry-run only warns, but `run` refuses them instead of failing at the first actor update."""
    from verl_dppo.plugin.topk_mode import unsupported_settings

    return unsupported_settings(config)
