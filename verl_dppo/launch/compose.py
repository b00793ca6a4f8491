"""Reproduction recipes: find them, compose one on top of verl's config, and check it the way verl will.

A recipe is a pair (setup, method) of Hydra config groups under `recipes/`, run by one of verl's v1 trainer modes
(a third group, `trainer_mode`: sync by default):

    verl/trainer/config/ppo_trainer.yaml -> recipes/dppo.yaml -> setup/<SETUP>.yaml -> method/<METHOD>.yaml
    -> trainer_mode/<MODE>.yaml -> the user's overrides

The check is verl's own: `validate_config` (which builds the actor's dataclass, our `DPPOLossConfig` included) and
the dataclass conversions verl's workers run, plus what verl does not check until the first actor update hours
into a run (`verl_dppo.launch.recipe_checks`: that the loss mode is registered, the run's length, the anchor).
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from verl_dppo.launch.findings.overrides import check_override_types, group_choices, key_hint, override_problems
from verl_dppo.launch.recipe_checks import check_anchor, check_length, check_loss_registered, check_topk_rollout
from verl_dppo.launch.recipe_checks import check_supported, check_trainer_mode  # noqa: F401  (check_supported: API)
from verl_dppo.launch.preflight import check_launch_site, check_paths, check_writable  # noqa: F401  (part of this module's API)
from verl_dppo.launch.recipe_files import (  # noqa: F401  (part of this module's API)
    GROUP_KEYS,
    GROUPS,
    PRIMARY_CONFIG,
    TRAINER_MODES,
    RecipeError,
    RecipeInfo,
    check_name,
    list_recipes,
    recipes_dir,
    register_resolvers,
)

__all__ = [
    "RecipeError",
    "RecipeInfo",
    "check_launch_site",
    "check_paths",
    "check_writable",
    "compose_recipe",
    "list_recipes",
    "recipes_dir",
    "validate_recipe",
]

_SECTIONS_IN_USE = ("actor_rollout_ref", "data", "algorithm", "trainer", "dppo")


def _verl_error_types() -> tuple:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return (AssertionError, ValueError, TypeError, HydraException, OmegaConfBaseException, OSError)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """verl and Hydra print progress to stdout; a dry run's stdout must carry the YAML and nothing else."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


VERL_PASS_LINE = "[validate_config] All configuration checks passed"
"""What verl's `validate_config` prints when it finds nothing wrong: left out of `run`'s output, where the launcher's
own checks come after it (it read as the verdict on a run that the next line then refused)."""


@contextlib.contextmanager
def _without_pass_line() -> Iterator[None]:
    """verl's output of the block on stderr (stdout carries a dry run's YAML), less VERL_PASS_LINE."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        kept = [line for line in captured.getvalue().splitlines(keepends=True) if not line.startswith(VERL_PASS_LINE)]
        sys.stderr.write("".join(kept))


def compose_recipe(
    setup: str,
    method: str,
    overrides: Sequence[str] = (),
    config_dirs: Sequence[str] = (),
    trainer_mode: Optional[str] = None,
) -> Any:
    """Compose verl's ppo_trainer.yaml + dppo.yaml + setup + method + trainer mode + overrides into one DictConfig.

    `trainer_mode`: one of TRAINER_MODES (None: sync, the recipes' default), the recipe-level switch to verl's
    asynchronous trainers (recipes/trainer_mode/<MODE>.yaml sets what they need besides `trainer.v1.trainer_mode`).

    `+key=value` is accepted for a key the recipe already sets (plain `main_ppo` scripts add DPPO's keys that way):
    it becomes Hydra's `++key=value`, add-or-override. An override must keep the type of the value it replaces
    (`data.train_batch_size=abc` is refused here, not hours later in a worker). `config_dirs`: the user's own
    setups and methods (verl_dppo.launch.user_recipes)."""
    from verl_dppo.launch.user_recipes import check_config_dirs, searchpath_override

    folders = check_config_dirs(config_dirs)
    check_name("setup", setup, folders)
    check_name("method", method, folders)
    if trainer_mode is not None and trainer_mode not in TRAINER_MODES:
        raise RecipeError(f"unknown trainer mode {trainer_mode!r}: choose one of {', '.join(TRAINER_MODES)}")
    # Ahead of the user's overrides: the search path, and the trainer mode group's choice.
    searchpath = [
        *searchpath_override(recipes_dir(), folders),
        *([f"trainer_mode={trainer_mode}"] if trainer_mode is not None else []),
    ]
    for override in overrides:
        if "=" not in override and not override.startswith("~"):
            raise RecipeError(
                f"bad override {override!r}: write Hydra overrides as key=value (e.g. trainer.nnodes=4), "
                "+key=value to add a key verl's config lacks, ~key to delete one."
            )
    overrides = [f"+{item}" if item.startswith("+") and not item.startswith("++") else item for item in overrides]
    if not overrides:
        return _compose(setup, method, searchpath)
    baseline = _compose(setup, method, searchpath)
    try:
        config = _compose(setup, method, [*searchpath, *overrides])
    except RecipeError as error:
        # Hydra's answer to a misspelled key is to add it with '+': the nearest existing key instead, looked up in
        # the config with the overrides' group choices (model_engine=megatron brings actor.megatron.*)
        try:
            chosen = _compose(setup, method, [*searchpath, *group_choices(overrides)])
        except RecipeError:
            chosen = baseline
        unknown, _ = override_problems(chosen, overrides, keys_only=True)
        if unknown:
            raise RecipeError(f"cannot compose {setup} + {method}: {unknown[0]}") from None
        raise RecipeError(str(error) + key_hint(str(error), baseline)) from None
    check_override_types(baseline, config, overrides)
    _label_loss_mode(baseline, config, method, overrides)
    return config


def _label_loss_mode(baseline: Any, config: Any, method: str, overrides: Sequence[str]) -> None:
    """A loss_mode override that is not the method's own: the run is named and announced "<method>+<loss_mode>"
    (unless the user named it), so that a grpo_clip_higher run switched to dppo_binary_tv does not pass for GRPO."""
    from omegaconf import OmegaConf, open_dict

    key = "actor_rollout_ref.actor.policy_loss.loss_mode"
    before, after = (OmegaConf.select(c, key, default=None) for c in (baseline, config))
    named = any(o.lstrip("+").startswith(("dppo.run_label=", "trainer.experiment_name=")) for o in overrides)
    if before != after and not named and config.get("dppo") is not None:
        with open_dict(config.dppo):
            config.dppo.run_label = f"{method}+{after}"


def _compose(setup: str, method: str, overrides: Sequence[str]) -> Any:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_resolvers()
    try:
        with stdout_to_stderr(), initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
            return compose(PRIMARY_CONFIG, overrides=[f"setup={setup}", f"method={method}", *overrides])
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        message = " ".join(str(error).split())  # Hydra's messages span lines; ours is one
        if "Could not override" in message or "Key '" in message or "not in struct" in message:
            hint = (
                " Check the key's spelling against `verl-dppo run SETUP --method METHOD --dry-run` (the full "
                "config); prefix a key verl's config does not have with '+' to add it."
            )
        else:
            hint = " Check the override's syntax (Hydra: key=value, +key=value, ~key)."
        raise RecipeError(f"cannot compose {setup} + {method}: {message}.{hint}") from None


def validate_recipe(config: Any, plain: bool = False) -> None:
    """Run verl's own checks on a composed recipe; raise RecipeError naming the setting to change (the first of
    `recipe_problems`). `plain`: verl's own config as a `main_ppo` command line composes it (`verl-dppo check`): no
    recipe keys, any policy-loss class."""
    problems, not_here = recipe_problems(config, plain=plain)
    if problems or not_here:
        raise RecipeError((problems or not_here)[0])


def recipe_problems(
    config: Any, plain: bool = False, skip_critic: bool = False, empty: Sequence[str] = ()
) -> tuple[list[str], list[str]]:
    """(every problem verl's checks and the plugin's find in a composed config, each one line; what they need that
    is not installed here). Each check runs whatever the others found, so that one run names them all; verl's
    `validate_config`, which stops at its first complaint, is followed by its parts that stand alone
    (`verl_validation`). `skip_critic`: the critic's model is not readable here (`verl-dppo check` says so);
    `empty`: see `verl_validation`."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        # Every interpolation must resolve before anything is launched.
        resolved = OmegaConf.to_container(config, resolve=True)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None)
        where = f" (at {key})" if key else ""
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return [f"the composed config does not resolve{where}: {first}"], []
    # Mandatory values (???) left unset in the sections a run uses (verl leaves some in disabled sections).
    missing = [key for section in _SECTIONS_IN_USE for key in _missing_paths(resolved.get(section), section)]
    if missing:
        return ["set these mandatory values: " + ", ".join(f"{key}=..." for key in missing)], []
    problems: list[str] = []
    for check in (check_length, check_loss_registered, check_trainer_mode):
        try:
            check(config)
        except RecipeError as error:
            problems.append(str(error))
    verl_problems, not_here, policy_loss = verl_validation(config, skip_critic=skip_critic, empty=empty)
    problems += verl_problems
    from verl_dppo.plugin.config import DPPOLossConfig

    if not plain and policy_loss is not None and not isinstance(policy_loss, DPPOLossConfig):
        problems.append(
            "actor_rollout_ref.actor.policy_loss._target_ must be verl_dppo.DPPOLossConfig (the DPPO options "
            "delta_low, delta_high, ratio_cap, anchor, relax_below, relax_side, topk live there)."
        )
    for check in (check_anchor, check_topk_rollout):
        try:
            check(config)
        except RecipeError as error:
            problems.append(str(error))
        except Exception:  # noqa: BLE001  (a config verl refused above may not hold what the check reads)
            if not problems:
                raise
    return problems, not_here


def verl_validation(config: Any, skip_critic: bool = False, empty: Sequence[str] = ()) -> tuple[list, list, Any]:
    """(verl's complaints about the config, one line each; the modules its checks need that are not installed here;
    the policy loss's config object, or None where it does not build). verl's `validate_config` stops at its first
    complaint: then its standalone parts (the actor's and critic's dataclasses and `validate`, router replay) run
    one by one, each complaint named in one run. `empty`: the numbers the command left empty, named beside verl's
    TypeErrors (`findings.overrides.empty_values`: their text names no key)."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils import config as verl_config
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    with _quiet_warnings():
        use_critic = need_critic(config) and not skip_critic
    actor = config.actor_rollout_ref.actor

    def n_gpus() -> Any:  # in each step: both numbers left empty ('' * '') raise there, named with `empty`
        return config.trainer.n_gpus_per_node * config.trainer.nnodes

    def actor_check() -> None:
        omega_conf_to_dataclass(actor).validate(n_gpus(), config.data.train_batch_size, config.actor_rollout_ref.model)

    def router_replay() -> None:
        check = getattr(verl_config, "_validate_router_replay_config", None)  # verl 0.9.1's; absent elsewhere
        if check is not None:
            check(omega_conf_to_dataclass(actor), config.algorithm.get("rollout_correction", None))

    def critic_check() -> None:
        omega_conf_to_dataclass(config.critic).validate(n_gpus(), config.data.train_batch_size)

    steps = [
        ("validate_config", lambda: validate_config(config, need_reference_policy(config), use_critic)),
        ("actor_rollout_ref.actor", actor_check),
        ("router replay", router_replay),
        *([("critic", critic_check)] if use_critic else []),
        ("actor_rollout_ref.actor.policy_loss", lambda: omega_conf_to_dataclass(actor.policy_loss)),
        ("actor_rollout_ref.rollout", lambda: omega_conf_to_dataclass(config.actor_rollout_ref.rollout)),
        ("algorithm", lambda: omega_conf_to_dataclass(config.algorithm)),
    ]
    from hydra.errors import HydraException

    errors = _verl_error_types()
    problems, not_here, results, texts = [], [], {}, set()
    for name, step in steps:
        if name in ("actor_rollout_ref.actor", "router replay", "critic") and "validate_config" in results:
            continue  # validate_config ran these and passed
        try:
            with _without_pass_line(), _quiet_warnings():
                results[name] = step()
        except ModuleNotFoundError as error:
            line = (
                f"verl's check of {name} needs the module {error.name!r}, which is not installed here; run the "
                "check where the rollout engine is installed, or change the setting that needs it "
                "(e.g. actor_rollout_ref.model.lora.merge=True avoids importing vLLM for LoRA)."
            )
            if line not in not_here:
                not_here.append(line)
        except Exception as error:  # noqa: BLE001  (verl's checks raise assertions, ValueErrors, Hydra's and more)
            if not isinstance(error, errors):
                raise
            cause = error.__cause__ if isinstance(error, HydraException) and error.__cause__ else error
            text = " ".join(str(cause).split())
            if text in texts:
                continue
            texts.add(text)
            if _raised_by_plugin(cause):  # DPPOLossConfig's own checks, run inside verl's dataclass build
                problems.append(
                    f"verl-dppo rejects actor_rollout_ref.actor.policy_loss ({type(cause).__name__}): {text}"
                )
            else:
                from verl_dppo.launch.findings.command import complaint_hint

                hint = complaint_hint(text, cause, config, empty)
                problems.append(f"verl rejects the config ({name}): {text.rstrip('.') if hint else text}{hint}")
    return problems, not_here, results.get("actor_rollout_ref.actor.policy_loss")


def _raised_by_plugin(error: BaseException) -> bool:
    """Whether the innermost frame that raised `error` is verl-dppo's code (not verl's)."""
    import traceback

    package = str(Path(__file__).resolve().parent.parent)
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
    return bool(frames) and str(Path(frames[-1].filename).resolve()).startswith(package)


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


def resolved_yaml(config: Any) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(config, resolve=True)


def compose_and_validate(setup: str, method: str, overrides: Sequence[str] = ()) -> Any:
    config = compose_recipe(setup, method, overrides)
    validate_recipe(config)
    return config
