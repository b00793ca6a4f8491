"""Reproduction recipes: find them, compose one on top of verl's config, and check it the way verl will.

A recipe is a pair (setup, method) of Hydra config groups under `recipes/`:

    verl/trainer/config/ppo_trainer.yaml -> recipes/dppo.yaml -> setup/<SETUP>.yaml -> method/<METHOD>.yaml
    -> the user's overrides

The check is verl's own: `validate_config` (which builds the actor's dataclass, our `DPPOLossConfig` included) and
the dataclass conversions verl's workers run, plus what verl does not check until the first actor update hours
into a run: that the loss mode is registered.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

__all__ = [
    "RecipeError",
    "RecipeInfo",
    "check_paths",
    "compose_recipe",
    "list_recipes",
    "recipes_dir",
    "validate_recipe",
]

PRIMARY_CONFIG = "dppo"
GROUPS = ("setup", "method")
_SECTIONS_IN_USE = ("actor_rollout_ref", "data", "algorithm", "trainer", "dppo")


class RecipeError(ValueError):
    """A recipe that cannot be composed, validated or launched; the message says what to change."""


@dataclass(frozen=True)
class RecipeInfo:
    name: str
    figure: str
    summary: str


def recipes_dir() -> Path:
    """The recipes folder: shipped inside the package (`verl_dppo.recipes`), or `recipes/` in a checkout."""
    candidates = []
    try:
        from importlib.resources import files

        candidates.append(Path(str(files("verl_dppo.recipes"))))
    except (ModuleNotFoundError, TypeError):
        pass
    candidates.append(Path(__file__).resolve().parent.parent / "recipes")
    for candidate in candidates:
        if (candidate / f"{PRIMARY_CONFIG}.yaml").is_file():
            return candidate
    raise RecipeError(
        "verl-dppo's recipes are missing (looked in: " + ", ".join(map(str, candidates)) + "); reinstall verl-dppo "
        "(`pip install -e .` from a checkout, or `pip install verl-dppo`)."
    )


def _group_names(group: str) -> list[str]:
    return sorted(path.stem for path in (recipes_dir() / group).glob("*.yaml") if not path.stem.startswith("_"))


def _read_info(group: str, name: str) -> RecipeInfo:
    from omegaconf import OmegaConf

    path = recipes_dir() / group / f"{name}.yaml"
    text = path.read_text(encoding="utf-8")
    # The summary is the first comment line after the package header.
    comments = [line[1:].strip() for line in text.splitlines() if line.startswith("#") and "@package" not in line]
    node = OmegaConf.create(text).get("dppo", {})
    return RecipeInfo(name=name, figure=str(node.get(f"{group}_figure", "")), summary=comments[0] if comments else "")


def list_recipes() -> dict[str, list[RecipeInfo]]:
    """Setups and methods, each with the paper figure it reproduces."""
    return {group: [_read_info(group, name) for name in _group_names(group)] for group in GROUPS}


def _check_name(group: str, name: str) -> None:
    names = _group_names(group)
    if name not in names:
        import difflib

        close = difflib.get_close_matches(name, names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise RecipeError(
            f"unknown {group} {name!r}.{hint} Choose one of: {', '.join(names)} (`verl-dppo recipes` lists them "
            "with the paper figure each reproduces)."
        )


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """verl and Hydra print progress to stdout; a dry run's stdout must carry the YAML and nothing else."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def compose_recipe(setup: str, method: str, overrides: Sequence[str] = ()) -> Any:
    """Compose verl's ppo_trainer.yaml + dppo.yaml + setup + method + overrides into one DictConfig."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    _check_name("setup", setup)
    _check_name("method", method)
    for override in overrides:
        if "=" not in override and not override.startswith("~"):
            raise RecipeError(
                f"bad override {override!r}: write Hydra overrides as key=value (e.g. trainer.nnodes=4), "
                "+key=value to add a key verl's config lacks, ~key to delete one."
            )
    try:
        with stdout_to_stderr(), initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
            return compose(PRIMARY_CONFIG, overrides=[f"setup={setup}", f"method={method}", *overrides])
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        message = str(error).strip()
        if "Could not override" in message or "Key '" in message or "not in struct" in message:
            hint = (
                " Check the key's spelling against `verl-dppo run SETUP --method METHOD --dry-run` (the full "
                "config); prefix a key verl's config does not have with '+' to add it."
            )
        else:
            hint = " Check the override's syntax (Hydra: key=value, +key=value, ~key)."
        raise RecipeError(f"cannot compose {setup} + {method}: {message}.{hint}") from None


def _loss_registered(loss_mode: str) -> bool:
    import verl  # noqa: F401  (loads the verl.plugins entry points: our loss modes)
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    return loss_mode in POLICY_LOSS_REGISTRY


def validate_recipe(config: Any) -> None:
    """Run verl's own checks on a composed recipe; raise RecipeError naming the setting to change."""
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        # Every interpolation must resolve before anything is launched.
        resolved = OmegaConf.to_container(config, resolve=True)
    except OmegaConfBaseException as error:
        raise RecipeError(f"the composed config does not resolve: {error}") from None
    # Mandatory values (???) left unset in the sections a run uses (verl leaves some in disabled sections).
    missing = [key for section in _SECTIONS_IN_USE for key in _missing_paths(resolved.get(section), section)]
    if missing:
        raise RecipeError("set these mandatory values: " + ", ".join(f"{key}=..." for key in missing))

    loss_mode = config.actor_rollout_ref.actor.policy_loss.loss_mode
    if not _loss_registered(loss_mode):
        raise RecipeError(
            f"loss mode {loss_mode!r} is not registered in verl's POLICY_LOSS_REGISTRY: the plugin that provides it "
            "is not installed or failed to load (run `verl-dppo doctor`), or "
            "actor_rollout_ref.actor.policy_loss.loss_mode is misspelt."
        )

    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from verl_dppo.plugin.config import DPPOLossConfig

    steps = (
        ("validate_config", lambda: validate_config(config, need_reference_policy(config), need_critic(config))),
        ("actor_rollout_ref.actor.policy_loss", lambda: omega_conf_to_dataclass(config.actor_rollout_ref.actor.policy_loss)),
        ("actor_rollout_ref.rollout", lambda: omega_conf_to_dataclass(config.actor_rollout_ref.rollout)),
        ("algorithm", lambda: omega_conf_to_dataclass(config.algorithm)),
    )
    results = {}
    for name, step in steps:
        try:
            with stdout_to_stderr(), _quiet_warnings():
                results[name] = step()
        except ModuleNotFoundError as error:
            raise RecipeError(
                f"verl's check of {name} needs the module {error.name!r}, which is not installed here; run the "
                "check where the rollout engine is installed, or change the setting that needs it "
                "(e.g. actor_rollout_ref.model.lora.merge=True avoids importing vLLM for LoRA)."
            ) from None
        except (AssertionError, ValueError, TypeError, HydraException, OmegaConfBaseException) as error:
            cause = error.__cause__ if isinstance(error, HydraException) and error.__cause__ else error
            raise RecipeError(f"verl rejects the config ({name}): {cause}") from None
    if not isinstance(results["actor_rollout_ref.actor.policy_loss"], DPPOLossConfig):
        raise RecipeError(
            "actor_rollout_ref.actor.policy_loss._target_ must be verl_dppo.DPPOLossConfig (the DPPO options "
            "delta_low, delta_high, ratio_cap, anchor, relax_below, relax_side, topk live there)."
        )
    _check_anchor(config)
    _check_topk_rollout(config)


def _check_topk_rollout(config: Any) -> None:
    """The Top-K modes' driver-side rollout check (it runs again at launch), on a copy: the config stays as composed."""
    import copy

    from verl_dppo.patches.llm_server import sync_rollout_config

    try:
        sync_rollout_config(copy.deepcopy(config))
    except ValueError as error:
        raise RecipeError(str(error)) from None


def _missing_paths(node: Any, prefix: str) -> list[str]:
    if isinstance(node, dict):
        return [path for key, value in node.items() for path in _missing_paths(value, f"{prefix}.{key}")]
    if isinstance(node, list):
        return [path for index, value in enumerate(node) for path in _missing_paths(value, f"{prefix}[{index}]")]
    return [prefix] if node == "???" else []


@contextlib.contextmanager
def _quiet_warnings() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _check_anchor(config: Any) -> None:
    """The run-level checks the plugin repeats at launch (anchor vs bypass mode, how the rollout computes mu)."""
    from verl_dppo.plugin.run_config import RunConfigError, check_run_config

    try:
        check_run_config(config)
    except RunConfigError as error:
        raise RecipeError(str(error)) from None
    if not config.actor_rollout_ref.rollout.calculate_log_probs:
        raise RecipeError(
            "the DPPO losses need the rollout engine's log-probs (mu): set "
            "actor_rollout_ref.rollout.calculate_log_probs=True."
        )


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(item) for item in value]


def check_paths(config: Any) -> list[str]:
    """Problems with the run's local files (data and model), each saying how to fix it; [] when all exist."""
    problems = []
    for key in ("train_files", "val_files"):
        for path in _as_list(config.data.get(key)):
            if not Path(os.path.expanduser(path)).exists():
                name = Path(path).stem
                problems.append(
                    f"data.{key}: {path} does not exist. Write it with `verl-dppo data {name} --out "
                    f"{Path(path).parent}`, or point data.{key} at your copy (or set DPPO_ROOT; now "
                    f"{config.dppo.root})."
                )
    model_path = str(config.actor_rollout_ref.model.path)
    if model_path.startswith(("/", "~", ".")) and not Path(os.path.expanduser(model_path)).exists():
        problems.append(
            f"actor_rollout_ref.model.path: {model_path} does not exist. Download it with `huggingface-cli download "
            f"{config.dppo.get('model_id') or '<hub id>'} --local-dir {model_path}`, or set actor_rollout_ref.model.path "
            f"(or DPPO_ROOT; now {config.dppo.root})."
        )
    return problems


def check_supported(config: Any) -> list[str]:
    """Combinations verl-dppo does not run, each saying what to do; [] when none. They compose and pass verl's
    checks, so a dry-run only warns, but `run` refuses them instead of failing at the first actor update."""
    from verl_dppo.plugin.topk_mode import unsupported_settings

    return unsupported_settings(config)


def resolved_yaml(config: Any) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(config, resolve=True)


def compose_and_validate(setup: str, method: str, overrides: Sequence[str] = ()) -> Any:
    config = compose_recipe(setup, method, overrides)
    validate_recipe(config)
    return config

