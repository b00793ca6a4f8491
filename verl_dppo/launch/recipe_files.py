"""The recipe files: where they are, what each group holds (setups, methods, trainer modes), their one-line
summaries, the names a user may choose, and the recipes' own interpolation (`${dppo_div:...}`).

Part of `verl_dppo.launch.compose` (re-exported there), kept apart so that each module stays readable.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from verl_dppo.errors import UsageError

__all__ = [
    "GROUPS",
    "GROUP_KEYS",
    "PRIMARY_CONFIG",
    "RecipeError",
    "RecipeInfo",
    "TRAINER_MODES",
    "check_name",
    "list_recipes",
    "recipes_dir",
    "register_resolvers",
]

PRIMARY_CONFIG = "dppo"
GROUPS = ("setup", "method")
TRAINER_MODES = ("sync", "colocate_async", "separate_async")
"""verl 0.9.1's v1 trainer modes (`trainer.v1.trainer_mode`), one file each in recipes/trainer_mode/."""
GROUP_KEYS = (*GROUPS, "trainer_mode")


class RecipeError(UsageError, ValueError):
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
        "(`pip install -e .` from a checkout, or its wheel)."
    )


def _group_names(group: str) -> list[str]:
    return sorted(path.stem for path in (recipes_dir() / group).glob("*.yaml") if not path.stem.startswith("_"))


def _read_info(group: str, name: str) -> RecipeInfo:
    from omegaconf import OmegaConf

    path = recipes_dir() / group / f"{name}.yaml"
    text = path.read_text(encoding="utf-8")
    # The summary is the first sentence of the comment block that opens the file (after the package header).
    header = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        if "@package" not in line:
            header.append(line[1:].strip())
    node = OmegaConf.create(text).get("dppo", {})
    return RecipeInfo(name=name, figure=str(node.get(f"{group}_figure", "")), summary=_first_sentence(" ".join(header)))


_ABBREVIATIONS = ("Sec", "Fig", "Figs", "App", "Eq", "al", "e.g", "i.e", "a.k.a", "vs", "cf")


def _first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence (not the one in "Sec. 5", "et al. 2025" or "App. G.1")."""
    import re

    for match in re.finditer(r"\.(?=\s+[A-Za-z(\[]|$)", text):
        words = text[: match.start()].split()
        if words and words[-1].strip("(") in _ABBREVIATIONS:
            continue
        return text[: match.end()]
    return text


def list_recipes() -> dict[str, list[RecipeInfo]]:
    """Setups and methods, each with the paper figure it reproduces; the trainer modes."""
    recipes = {group: [_read_info(group, name) for name in _group_names(group)] for group in GROUPS}
    recipes["trainer_mode"] = [_read_info("trainer_mode", name) for name in TRAINER_MODES]
    return recipes


def register_resolvers() -> None:
    """The recipes' own interpolations: `${dppo_div:A,B}` = A / B, a whole number (separate_async's
    parameter_sync_step = train_batch_size / ppo_mini_batch_size); `${dppo_module_file:M}`, a plugin module's file.
    Registered before composing; a dry run prints the resolved YAML, which plain `main_ppo` then reads without it."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("dppo_div"):
        OmegaConf.register_new_resolver("dppo_div", _whole_division)
    if not OmegaConf.has_resolver("dppo_module_file"):
        OmegaConf.register_new_resolver("dppo_module_file", _module_file)


def _module_file(module: str) -> str:
    """`${dppo_module_file:verl_dppo.plugin.rewards}`: the installed file of a plugin module (verl's
    custom_reward_function takes a path)."""
    import importlib.util

    if not module.startswith("verl_dppo."):
        raise ValueError(f"dppo_module_file: {module} is not a module of verl-dppo")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise ValueError(f"dppo_module_file: no module {module}")
    return spec.origin


def _whole_division(numerator: Any, denominator: Any) -> int:
    numerator, denominator = int(numerator), int(denominator)
    if denominator <= 0 or numerator % denominator:
        raise ValueError(
            f"data.train_batch_size={numerator} is not a whole number of actor_rollout_ref.actor.ppo_mini_batch_size="
            f"{denominator} mini-batches, which separate_async needs (one weight push per training step)"
        )
    return numerator // denominator


VERL_LOSS_NAMES = {"dppo_tv": "dppo_binary_tv", "dppo_kl": "dppo_binary_kl", "vanilla": "grpo_clip_higher"}
"""verl 0.9.1's own loss modes, given as a method: the plugin's method that trains the same rule."""


def check_name(group: str, name: str, folders: Sequence[Path] = ()) -> None:
    from verl_dppo.launch.user_recipes import user_names

    shipped, own = _group_names(group), user_names(group, folders)
    clash = sorted(set(shipped) & set(own))
    if clash:
        raise RecipeError(
            f"--config-dir: {group} {', '.join(clash)} is also a shipped {group}, which Hydra would "
            "read instead: rename your file"
        )
    names = sorted(shipped + own)
    if name not in names:
        import difflib

        close = (
            [VERL_LOSS_NAMES[name]]
            if group == "method" and name in VERL_LOSS_NAMES
            else difflib.get_close_matches(name, names, n=1)
        )
        hint = f" Did you mean {close[0]!r}?" if close else ""
        if group == "method" and name in VERL_LOSS_NAMES:
            hint += f" (verl's loss mode {name} is the plugin's {VERL_LOSS_NAMES[name]})"
        raise RecipeError(
            f"unknown {group} {name!r}.{hint} Choose one of: {', '.join(names)} (`verl-dppo recipes` lists them "
            "with the paper figure each reproduces; --config-dir DIR adds DIR/setup/*.yaml, DIR/method/*.yaml)."
        )


def setup_and_overrides(setup: str, overrides: Sequence[str], default: str) -> tuple[str, list[str]]:
    """For a command whose SETUP is optional before its overrides: `cmd --out D key=value` gives argparse the override
    as the setup; it is the first override (a `~key` delete has no "="), and the setup is the default."""
    if "=" in setup or setup.startswith(("~", "+")):
        return default, [setup, *overrides]
    return setup, list(overrides)
