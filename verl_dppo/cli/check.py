"""`verl-dppo check`: the plugin's launch checks on a plain `python -m verl.trainer.main_ppo ...` command line.

`verl-dppo run` composes a paper setup; a user with a GRPO command of their own wants to know, before a cluster
job, what the plugin would say about that command as it is. `check` composes verl's own config (`ppo_trainer`, or
the command's `--config-path` / `--config-name`) with the command's overrides, as `main_ppo` does, and runs on it
everything `run --dry-run` checks: each override's type against verl's value, verl's own `validate_config` and
config classes, the plugin's run-level checks (anchor and bypass mode, asynchronous trainers, Ulysses attention),
the Top-K settings, the thresholds a DPPO mode would inherit from the ratio clip, and whether the data files and
the model exist here. Nothing is launched.

    verl-dppo check python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo ... \\
        actor_rollout_ref.actor.policy_loss.loss_mode=dppo_binary_tv
    verl-dppo check algorithm.adv_estimator=grpo ...        # the overrides alone
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from verl_dppo.cli.errors import UsageError

__all__ = ["add_command", "split_command", "compose_main_ppo", "check_command"]

_LAUNCHERS = ("python", "python3", "-m", "verl.trainer.main_ppo")


def split_command(argv: Sequence[str]) -> tuple[list[str], Optional[str], str]:
    """(overrides, --config-path, --config-name) of a main_ppo command line; the launcher words (`python3 -m
    verl.trainer.main_ppo`, a path to main_ppo.py) are skipped, a shell's trailing `$@` or backslash too."""
    overrides: list[str] = []
    config_path, config_name = None, "ppo_trainer"
    items = list(argv)
    index = 0
    while index < len(items):
        item = items[index]
        index += 1
        if item in ("--config-path", "--config-name", "-cp", "-cn"):
            if index >= len(items):
                raise UsageError(f"{item} needs a value")
            value, index = items[index], index + 1
            if item in ("--config-path", "-cp"):
                config_path = value
            else:
                config_name = value
        elif item.startswith(("--config-path=", "--config-name=")):
            key, value = item.split("=", 1)
            config_path, config_name = (value, config_name) if key == "--config-path" else (config_path, value)
        elif item in _LAUNCHERS or item.endswith(("python", "python3", "main_ppo.py")) or item in ("\\", "$@"):
            continue
        elif "=" in item or item.startswith("~"):
            overrides.append(item)
        else:
            raise UsageError(f"{item!r} is not a Hydra override (key=value) of a main_ppo command line")
    if not overrides:
        raise UsageError("give the main_ppo command line (or its overrides) to check")
    return overrides, config_path, config_name


def compose_main_ppo(overrides: Sequence[str], config_path: Optional[str] = None,
                     config_name: str = "ppo_trainer") -> tuple[Any, Any]:
    """(verl's config with the overrides, verl's config without them), composed as main_ppo composes them."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    import verl.trainer.main_ppo as main_ppo
    from verl_dppo.cli.compose import RecipeError, stdout_to_stderr

    folder = Path(config_path) if config_path else Path(main_ppo.__file__).parent / "config"
    if not folder.is_absolute():
        folder = Path.cwd() / folder
    try:
        with stdout_to_stderr(), initialize_config_dir(config_dir=str(folder), version_base=None):
            return compose(config_name, overrides=list(overrides)), compose(config_name, overrides=[])
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        raise RecipeError(" ".join(str(error).split())) from None


def check_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(problems that would stop the launch, warnings) of a main_ppo command line; raises RecipeError for a config
    verl or the plugin rejects."""
    from verl_dppo.cli.compose import check_supported, validate_recipe
    from verl_dppo.cli.override_checks import check_override_types
    from verl_dppo.cli.launch import _threshold_warnings

    overrides, config_path, config_name = split_command(argv)
    config, baseline = compose_main_ppo(overrides, config_path, config_name)
    check_override_types(baseline, config, overrides)
    validate_recipe(config, plain=True)
    problems = list(check_supported(config)) + _missing_files(config)
    return problems, _threshold_warnings(config)


def _missing_files(config: Any) -> list[str]:
    problems = []
    for key in ("train_files", "val_files"):
        value = config.data.get(key)
        for path in ([value] if isinstance(value, str) else list(value or [])):
            if "://" not in str(path) and not Path(str(path)).expanduser().exists():
                problems.append(f"data.{key}: {path} does not exist here")
    model = str(config.actor_rollout_ref.model.path)
    if model.startswith(("/", ".", "~")) and not (Path(model).expanduser() / "config.json").is_file():
        problems.append(f"actor_rollout_ref.model.path: {model} holds no config.json here")
    return problems


def cmd_check(args: argparse.Namespace) -> int:
    from verl_dppo.cli.compose import RecipeError

    try:
        problems, warnings = check_command(args.command_line)
    except RecipeError as error:
        raise UsageError(str(error)) from None
    for warning in warnings:
        print(f"verl-dppo: warning: {warning}", file=sys.stderr)
    for problem in problems:
        print(f"verl-dppo: problem: {problem}", file=sys.stderr)
    verdict = (f"{len(problems)} problem(s) above would stop the launch from here" if problems
               else "nothing found that would stop the launch from here")
    print(f"verl-dppo: check: the command passed verl's checks and the plugin's; {verdict}", file=sys.stderr)
    return 2 if problems else 0


def add_command(commands: Any) -> None:
    parser = commands.add_parser(
        "check", help="the plugin's launch checks on a plain `python -m verl.trainer.main_ppo ...` command line",
        description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command_line", nargs=argparse.REMAINDER, metavar="COMMAND",
                        help="the main_ppo command line, or its overrides alone")
    parser.set_defaults(handler=cmd_check)
