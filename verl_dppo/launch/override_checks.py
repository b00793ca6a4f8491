"""The checks of a user's overrides against the config they change: each keeps the type of the value it replaces (or
the type verl's config dataclass declares), and a near miss (a key, a config class's field) names the fix."""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

from verl_dppo.launch.recipe_files import GROUP_KEYS, RecipeError

__all__ = ["check_override_types", "group_choices", "is_group_choice", "override_problems", "type_problem",
           "unknown_key_problem", "key_hint", "field_hint"]


def _leaf_paths(node: Any, prefix: str = "") -> Iterator[str]:
    from omegaconf import DictConfig

    if isinstance(node, DictConfig):
        for key in node.keys():
            path = f"{prefix}.{key}" if prefix else str(key)
            child = node._get_node(key)
            if isinstance(child, DictConfig):
                yield from _leaf_paths(child, path)
            else:
                yield path


def key_hint(message: str, baseline: Any) -> str:
    """`optim.lr` -> 'did you mean actor_rollout_ref.actor.optim.lr?': full keys ending in the one given, or close."""
    import difflib
    import re

    match = re.search(r"Could not override '([^']+)'", message) or re.search(r"Key '([^']+)'", message)
    if not match:
        return ""
    key = match.group(1)
    paths = list(_leaf_paths(baseline))
    close = [path for path in paths if path.endswith("." + key)][:3]
    close = close or difflib.get_close_matches(key, paths, n=3, cutoff=0.75)
    return f" Did you mean {' or '.join(close)}?" if close else ""


def field_hint(message: str) -> str:
    """For a config class refusing a key ("X.__init__() got an unexpected keyword argument 'k'"): the plugin's
    DPPOLossConfig field it is close to, or the `_target_` switch a plugin key needs under verl's PolicyLossConfig."""
    import dataclasses
    import difflib
    import re

    from verl_dppo.plugin.config import DPPOLossConfig

    match = re.search(r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'", message)
    if not match:
        return ""
    cls, key = match.groups()
    ours = sorted({f.name for f in dataclasses.fields(DPPOLossConfig)})
    if cls == "PolicyLossConfig" and key in ours:
        return (f". {key} is an option of the plugin's config class: add "
                "actor_rollout_ref.actor.policy_loss._target_=verl_dppo.DPPOLossConfig")
    close = difflib.get_close_matches(key, ours, n=1, cutoff=0.6) if cls == "DPPOLossConfig" else []
    return f". Did you mean actor_rollout_ref.actor.policy_loss.{close[0]}?" if close else ""


def is_group_choice(key: str) -> bool:
    """Whether an override's key picks a config group (`model_engine=megatron`, `setup=...`, `a/b=c`, `x@y=z`) rather
    than setting a value: a choice changes which keys the config has, so the keys after it are looked up in a
    baseline composed with the choices (`group_choices`)."""
    return key in GROUP_KEYS or "." not in key or "/" in key or "@" in key


def group_choices(overrides: Sequence[str]) -> list[str]:
    """The overrides that pick config groups, in their order (see `is_group_choice`)."""
    return [item for item in overrides
            if "=" in item and not item.startswith(("~", "+")) and is_group_choice(item.split("=", 1)[0])]


def override_problems(baseline: Any, overrides: Sequence[str], keys_only: bool = False) -> tuple[list[str], list[str]]:
    """(problems, the overrides that have none): each override parsed as Hydra parses it, its key looked up in verl's
    config (a change of a key the config lacks, answered with the nearest existing keys, not Hydra's "To append to
    your config use +key") and its value's type against the value it replaces. `keys_only`: the keys alone, and an
    override Hydra cannot parse left to Hydra's own message."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    problems, usable = [], []
    for override in overrides:
        try:
            parsed = parser.parse_overrides([override])[0]
        except HydraException as error:
            if not keys_only:
                problems.append(f"{override}: {' '.join(str(error).split())}")
            continue
        key, given = parsed.key_or_group, override.split("=", 1)[1] if "=" in override else ""
        if parsed.is_delete() or is_group_choice(key) or key.startswith("hydra.") or parsed.package is not None:
            usable.append(override)
            continue
        problem = None if parsed.is_add() or parsed.is_force_add() else unknown_key_problem(baseline, key, given)
        if not keys_only:
            try:
                value = parsed.value()
            except Exception:  # noqa: BLE001  (an interpolation or a sweep: composing judges it)
                value = None
            problem = problem or type_problem(baseline, key, value, given)
        if problem:
            problems.append(problem)
        else:
            usable.append(override)
    return problems, usable


def check_override_types(baseline: Any, config: Any, overrides: Sequence[str]) -> None:
    from omegaconf import OmegaConf

    for override in overrides:
        if override.startswith("~") or "=" not in override:
            continue
        key = override.split("=", 1)[0].lstrip("+")
        if key in GROUP_KEYS or "@" in key:
            continue
        try:
            new = OmegaConf.select(config, key, throw_on_missing=False)
        except Exception:  # an interpolation that does not resolve: validate_recipe names it
            continue
        problem = type_problem(baseline, key, new, override.split("=", 1)[1])
        if problem:
            raise RecipeError(problem)


def type_problem(baseline: Any, key: str, new: Any, given: str) -> Optional[str]:
    """The override `key=given` (parsed to `new`) against the type of the value it replaces (or that verl's config
    dataclass declares): None where it fits, else the one-line problem."""
    from omegaconf import OmegaConf

    try:
        old = OmegaConf.select(baseline, key, throw_on_missing=False)
    except Exception:  # an interpolation that does not resolve: validate_recipe names it
        return None
    expected = _declared_type(baseline, key) or _expected_type(old)
    if expected is None or new is None or _fits(new, expected):
        return None
    return f"{key}={given}: expected {expected} like the recipe's value {old!r}, got {type(new).__name__} {new!r}"


def unknown_key_problem(baseline: Any, key: str, given: str) -> Optional[str]:
    """`key=given` where verl's config has no such key (Hydra's answer would be "To append to your config use +key"):
    the problem, with the existing keys it is nearest to (the same parent's first, then anywhere)."""
    import difflib

    from omegaconf import DictConfig, OmegaConf

    parent, _, name = key.rpartition(".")
    try:
        node = OmegaConf.select(baseline, parent, default=None, throw_on_missing=False) if parent else baseline
    except Exception:  # noqa: BLE001  (an interpolation on the way: not this check's to judge)
        return None
    if not isinstance(node, DictConfig) and parent:  # the parent itself is missing
        ending = [path for path in _leaf_paths(baseline) if path.endswith("." + key)][:2]  # `optim.lr`: a full key's end
        if ending:
            return f"{key}={given}: verl's config has no key {key}; did you mean {' or '.join(ending)}?"
        return unknown_key_problem(baseline, parent, "...") and _no_key(key, given, baseline, parent)
    if isinstance(node, DictConfig) and (name in node.keys() or not node._get_flag("struct") and
                                         node._get_flag("struct") is not None):
        return None  # there (a value of ??? included), or a node that takes any key
    close = []
    if isinstance(node, DictConfig):
        close = [f"{parent}.{near}" if parent else near
                 for near in difflib.get_close_matches(name, [str(k) for k in node.keys()], n=2, cutoff=0.75)]
    if not close:
        paths = list(_leaf_paths(baseline))
        close = [path for path in paths if path.endswith("." + key)][:2] or difflib.get_close_matches(
            key, paths, n=2, cutoff=0.85)
    hint = f"; did you mean {' or '.join(close)}?" if close else (
        f"; to add a key verl's config does not have, write +{key}={given}")
    return f"{key}={given}: verl's config has no key {key}{hint}"


def _no_key(key: str, given: str, baseline: Any, parent: str) -> str:
    """A key under a parent verl's config lacks: the problem names the parent's nearest existing path."""
    inner = unknown_key_problem(baseline, parent, "...") or ""
    hint = inner.split("; ", 1)[1] if "; did you mean" in inner else f"to add it, write +{key}={given}"
    return f"{key}={given}: verl's config has no {parent}; {hint}"


def _declared_type(baseline: Any, key: str) -> Optional[str]:
    """The type verl's config dataclass declares for `key` (the `_target_` of the node holding it), where it declares
    a number: a recipe's `entropy_coeff: 0` is an int in YAML, but verl's `ActorConfig.entropy_coeff` is a float, so
    0.01 is a value the user may give. None where no dataclass declares the key."""
    import dataclasses
    import importlib
    import typing

    from omegaconf import OmegaConf

    parent, _, name = key.rpartition(".")
    try:
        node = OmegaConf.select(baseline, parent, throw_on_missing=False) if parent else baseline
        target = node.get("_target_") if node is not None and hasattr(node, "get") else None
        module, _, cls_name = str(target).rpartition(".")
        cls = getattr(importlib.import_module(module), cls_name) if target else None
        hints = typing.get_type_hints(cls) if cls is not None and dataclasses.is_dataclass(cls) else {}
    except Exception:  # a _target_ that does not import: verl's own instantiation names it
        return None
    declared = hints.get(name)
    if typing.get_origin(declared) is typing.Union:  # Optional[float]
        args = [a for a in typing.get_args(declared) if a is not type(None)]
        declared = args[0] if len(args) == 1 else None
    if declared is float:
        return "a number"
    return None


def _expected_type(value: Any) -> Optional[str]:
    if isinstance(value, bool):
        return "a boolean (true/false)"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    return None  # strings, lists, null: any value may be meant


def _fits(value: Any, expected: str) -> bool:
    if expected.startswith("a boolean"):
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if expected == "an integer":
        return isinstance(value, int)
    return isinstance(value, (int, float))
