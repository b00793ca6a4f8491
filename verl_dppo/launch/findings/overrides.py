"""The checks of a user's overrides against the config they change: each keeps the type of the value it replaces (or
the type verl's config dataclass declares), and a near miss (a key, a config class's field) names the fix."""

from __future__ import annotations

import re
from typing import Any, Iterator, Optional, Sequence

from verl_dppo.launch.findings.value_types import declared_type, expected_type, type_problem
from verl_dppo.launch.recipe_files import GROUP_KEYS, RecipeError

__all__ = [
    "check_override_types",
    "empty_values",
    "group_choices",
    "is_group_choice",
    "override_problems",
    "type_problem",
    "unknown_key_problem",
    "key_hint",
    "field_hint",
]


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


def field_hint(message: str, config: Any = None) -> str:
    """For a config class refusing a key ("X.__init__() got an unexpected keyword argument 'k'"): the plugin's
    DPPOLossConfig field it is close to, the `_target_` switch a plugin key needs under verl's PolicyLossConfig,
    where verl's `config` holds a key of that name instead (SAPO's `tau_pos` is the actor's, not the policy loss's),
    or, refused by another of verl's classes, that class's nearest fields (`multi_turn.max_turns` of older verl)."""
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
        return (
            f". {key} is an option of the plugin's config class: add "
            "actor_rollout_ref.actor.policy_loss._target_=verl_dppo.DPPOLossConfig"
        )
    close = difflib.get_close_matches(key, ours, n=1, cutoff=0.6) if cls == "DPPOLossConfig" else []
    if close:
        return f". Did you mean actor_rollout_ref.actor.policy_loss.{close[0]}?"
    if cls != "DPPOLossConfig" and "PolicyLoss" not in cls:  # another of verl's classes (MultiTurnConfig)
        import verl.workers.config as verl_classes

        known = getattr(verl_classes, cls, None)
        fields = [f.name for f in dataclasses.fields(known)] if dataclasses.is_dataclass(known) else []
        close = " or ".join(difflib.get_close_matches(key, fields, n=2, cutoff=0.6))
        return (
            f". {cls} has no field {key}{f' (did you mean {close}?)' if close else ''}: a key of another verl version?"
        )
    elsewhere = [
        path
        for path in (_leaf_paths(config) if config is not None else ())
        if path.endswith("." + key) and ".policy_loss." not in path
    ][:2]
    if elsewhere:
        return (
            f". verl reads {key} at {' and '.join(elsewhere)}, not in the policy loss's config: set it there "
            f"(without +) and drop the policy_loss.{key} override"
        )
    return f". {cls} has no field {key}: drop the override, or check the key in verl's config"


def is_group_choice(key: str) -> bool:
    """Whether an override's key picks a config group (`model_engine=megatron`, `setup=...`, `a/b=c`, `x@y=z`) rather
    than setting a value: a choice changes which keys the config has, so the keys after it are looked up in a
    baseline composed with the choices (`group_choices`)."""
    return key in GROUP_KEYS or "." not in key or "/" in key or "@" in key


def group_choices(overrides: Sequence[str]) -> list[str]:
    """The overrides that pick config groups, in their order (see `is_group_choice`)."""
    return [
        item
        for item in overrides
        if "=" in item and not item.startswith(("~", "+")) and is_group_choice(item.split("=", 1)[0])
    ]


_PLACEHOLDER = re.compile(r"^<[^<>]*>$")


def _parse_hint(override: str, parser: Any) -> str:
    """The fix beside Hydra's parse error for one override: a placeholder a script leaves to fill in
    (`key=<path_to_dsv3_config>` in verl's DeepSeek-V3 scripts: Hydra's grammar has no `<`), or the value quoted
    where that form parses (not where the key itself is what Hydra cannot read)."""
    from hydra.errors import HydraException

    key, _, value = override.partition("=")
    if _PLACEHOLDER.match(value.strip()):
        return (
            f". {value} is a placeholder the script leaves for you to fill in: give {key.lstrip('+~')} its value "
            "(a path or a name)"
        )
    quoted = f"{key}='{value}'"
    try:
        parser.parse_overrides([quoted])
    except HydraException:
        return ""
    return f". Hydra reads a value with such characters only quoted: {quoted}" if value and "'" not in value else ""


def override_problems(
    baseline: Any, overrides: Sequence[str], keys_only: bool = False, source: str = "the recipe's"
) -> tuple[list[str], list[str]]:
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
                problems.append(f"{override}: {' '.join(str(error).split())}{_parse_hint(override, parser)}")
            continue
        key, given = parsed.key_or_group, override.split("=", 1)[1] if "=" in override else ""
        if parsed.is_delete() or is_group_choice(key) or key.startswith("hydra.") or parsed.package is not None:
            usable.append(override)
            continue
        problem = None if parsed.is_add() or parsed.is_force_add() else unknown_key_problem(baseline, key, given)
        if parsed.is_add() and not parsed.is_force_add() and _hydra_refuses_add(baseline, key, parsed):
            problem = (
                f"+{key}={given}: verl's config already has {key}, and Hydra refuses to add it again; write "
                f"{key}={given} (or ++{key}={given})"
            )
        if not keys_only and parsed.is_sweep_override():
            problem = problem or (
                f"{key}={given}: several values are a sweep, which Hydra runs only with --multirun "
                "(one job per value); main_ppo trains one run: give one value"
            )
        elif not keys_only:
            try:
                value = parsed.value()
            except Exception:  # noqa: BLE001  (an interpolation: composing judges it)
                value = None
            if given != "":  # `key=` (a shell variable left unset) composes to '', which verl's classes take where
                # the key is not read (`algorithm.gamma=` under GRPO); where verl computes with it, `empty_values`
                problem = problem or type_problem(baseline, key, value, given, source)
        if problem:
            problems.append(problem)
        else:
            usable.append(override)
    return problems, usable


def _hydra_refuses_add(baseline: Any, key: str, parsed: Any) -> bool:
    """Whether Hydra 1.3.8 refuses `+key=value` ("Could not append to config"): the key holds a value other than
    null or ??? and the value added is not a dict or list (hydra/_internal/config_loader_impl.py's rule). A key verl
    holds as null (`override_transformer_config.recompute_method`) takes `+`."""
    from omegaconf import OmegaConf

    if not _has_key(baseline, key):
        return False
    try:
        value = parsed.value()
    except Exception:  # noqa: BLE001  (an interpolation or a sweep: judged as a plain value)
        value = None
    if isinstance(value, (dict, list)):
        return False
    try:
        return OmegaConf.select(baseline, key, throw_on_missing=False) is not None
    except Exception:  # noqa: BLE001  (an interpolation that does not resolve in the baseline: a value all the same)
        return True


def _has_key(baseline: Any, key: str) -> bool:
    """Whether verl's config holds `key` (a value of null or ??? included)."""
    from omegaconf import DictConfig, OmegaConf

    parent, _, name = key.rpartition(".")
    try:
        node = OmegaConf.select(baseline, parent, default=None, throw_on_missing=False) if parent else baseline
    except Exception:  # noqa: BLE001  (an interpolation on the way)
        return False
    return isinstance(node, DictConfig) and name in node.keys()


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


def empty_values(baseline: Any, overrides: Sequence[str]) -> list[str]:
    """The keys the overrides leave empty (`key=`: a shell variable left unset) where `baseline` holds a number or a
    boolean (its config class's declared type, else its value's). verl takes '' where it never reads the key
    (`algorithm.gamma=` under GRPO), so this is no problem by itself; where verl computes with one, its error names
    no key (`trainer.n_gpus_per_node=`: "unsupported operand type(s) for %"), and `verl_validation` names these."""
    from omegaconf import OmegaConf

    empty = []
    for override in overrides:
        key, _, given = override.partition("=")
        if given or not _:
            continue
        key = key.lstrip("+")
        try:
            old = OmegaConf.select(baseline, key, throw_on_missing=False)
        except Exception:  # noqa: BLE001  (an interpolation that does not resolve)
            continue
        declared, expected = declared_type(baseline, key)
        if (expected if declared else expected_type(old)) is not None:
            empty.append(key)
    return empty


TOP_GROUPS = ("model_engine",)
"""verl's top-level config groups (ppo_trainer.yaml's defaults without a package): `model_engine=megatron` picks the
actor's, reference's and critic's configs together; it is no key of a section."""

PLUGIN_SECTIONS = ("actor_rollout_ref.actor.fsdp_config.router_replay",)
"""The sections the plugin adds to verl's config (R3 on the FSDP engine): Hydra takes their keys only with `+`."""


def plugin_key_problem(key: str, given: str) -> Optional[str]:
    """`key=given` for a key the plugin reads and verl's config lacks (its R3 section on FSDP, a DPPOLossConfig
    option under verl's `policy_loss`), or for one of verl's top-level groups under a section: the problem with the
    line that works, instead of the nearest keys of verl's (`delta_low` -> "did you mean dro_beta?")."""
    import dataclasses

    from verl_dppo.plugin.config import DPPOLossConfig

    parent, _, name = key.rpartition(".")
    if parent and name in TOP_GROUPS:
        return (
            f"{key}={given}: {name} is a config group at verl's top level (it picks the actor's, reference's and "
            f"critic's configs together), not a key of {parent}: write {name}={given}"
        )
    if any(key.startswith(section + ".") for section in PLUGIN_SECTIONS):
        return (
            f"{key}={given}: the plugin's key, which verl's config does not have, so Hydra adds it only with "
            f"+: write +{key}={given}"
        )
    if parent == "actor_rollout_ref.actor.policy_loss" and name in {f.name for f in dataclasses.fields(DPPOLossConfig)}:
        return (
            f"{key}={given}: {name} is an option of the plugin's DPPOLossConfig, which verl's config does not "
            f"have: write +{key}={given} with actor_rollout_ref.actor.policy_loss._target_="
            "verl_dppo.DPPOLossConfig (README, From GRPO)"
        )
    return None


def unknown_key_problem(baseline: Any, key: str, given: str) -> Optional[str]:
    """`key=given` where verl's config has no such key (Hydra's answer would be "To append to your config use +key"):
    the problem, with the existing keys it is nearest to (the same parent's first, then anywhere); a key of the
    plugin's, or a top-level group under a section, with the line that works (`plugin_key_problem`)."""
    import difflib

    from omegaconf import DictConfig, OmegaConf

    parent, _, name = key.rpartition(".")
    if not _has_key(baseline, key):
        problem = plugin_key_problem(key, given)
        if problem:
            return problem
    try:
        node = OmegaConf.select(baseline, parent, default=None, throw_on_missing=False) if parent else baseline
    except Exception:  # noqa: BLE001  (an interpolation on the way: not this check's to judge)
        return None
    if not isinstance(node, DictConfig) and parent:  # the parent itself is missing
        ending = [path for path in _leaf_paths(baseline) if path.endswith("." + key)][
            :2
        ]  # `optim.lr`: a full key's end
        if ending:
            return f"{key}={given}: verl's config has no key {key}; did you mean {' or '.join(ending)}?"
        moved = _moved(baseline, key)
        if moved:
            return f"{key}={given}: verl's config has no key {key}; did you mean {moved}?"
        return unknown_key_problem(baseline, parent, "...") and _no_key(key, given, baseline, parent)
    if isinstance(node, DictConfig) and (
        name in node.keys() or not node._get_flag("struct") and node._get_flag("struct") is not None
    ):
        return None  # there (a value of ??? included), or a node that takes any key
    close = []
    if isinstance(node, DictConfig):
        close = [
            f"{parent}.{near}" if parent else near
            for near in difflib.get_close_matches(name, [str(k) for k in node.keys()], n=2, cutoff=0.75)
        ]
    if not close:
        paths = list(_leaf_paths(baseline))
        close = [path for path in paths if path.endswith("." + key)][:2] or difflib.get_close_matches(
            key, paths, n=2, cutoff=0.85
        )
    hint = (
        f"; did you mean {' or '.join(close)}?"
        if close
        else (f"; to add a key verl's config does not have, write +{key}={given}")
    )
    return f"{key}={given}: verl's config has no key {key}{hint}"


def _moved(baseline: Any, key: str) -> Optional[str]:
    """Where a key from the first missing section on lives in verl's config (a section verl moved:
    `actor_rollout_ref.actor.router_replay.mode` -> `actor_rollout_ref.actor.megatron.router_replay.mode`,
    `actor_rollout_ref.distillation.enabled` -> `distillation.enabled`), the path sharing the most of the key's
    start; None where no path ends so."""
    from omegaconf import DictConfig, OmegaConf

    parts = key.split(".")
    for depth in range(1, len(parts)):
        try:
            node = OmegaConf.select(baseline, ".".join(parts[:depth]), default=None, throw_on_missing=False)
        except Exception:  # noqa: BLE001
            return None
        if not isinstance(node, DictConfig):
            break
    else:
        return None
    tail = ".".join(parts[depth - 1 :])
    paths = list(_leaf_paths(baseline))
    # the same tail in the key's own section, or a section of its own (`distillation.*`): not another section's
    found = [path for path in paths if path == tail or (path.endswith("." + tail) and path.split(".")[0] == parts[0])]
    if not found:  # the same setting under another name in the key's section (`critic.model.fsdp_config.x` ->
        # `critic.fsdp.x`), where there is one
        found = [path for path in paths if path.split(".")[0] == parts[0] and path.split(".")[-1] == parts[-1]]
        if len(found) != 1:
            return None

    def shared(path: str) -> int:
        return next((i for i, (a, b) in enumerate(zip(path.split("."), parts)) if a != b), len(parts))

    return max(found, key=shared)


def _no_key(key: str, given: str, baseline: Any, parent: str) -> str:
    """A key under a parent verl's config lacks: the problem names the parent's nearest existing path."""
    inner = unknown_key_problem(baseline, parent, "...") or ""
    hint = (
        inner.split("; ", 1)[1]
        if "; did you mean" in inner
        else (f"remove it (a key of another verl version?), or write +{key}={given} to add it")
    )
    return f"{key}={given}: verl's config has no {parent}; {hint}"
