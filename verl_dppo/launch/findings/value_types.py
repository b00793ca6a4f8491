"""The type an override's value must have: the one verl's config dataclass declares for the key, or where none does,
the type of the value it replaces (`verl_dppo.launch.findings.overrides` checks each override with it)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

__all__ = ["declared_type", "expected_type", "type_problem"]


def type_problem(baseline: Any, key: str, new: Any, given: str, source: str = "the recipe's") -> Optional[str]:
    """The override `key=given` (parsed to `new`) against the type verl's config dataclass declares for the key, or
    where none does, the type of the value it replaces: None where it fits, else the one-line problem. `source`:
    whose value it replaces ("the recipe's", "verl's")."""
    from omegaconf import OmegaConf

    try:
        old = OmegaConf.select(baseline, key, throw_on_missing=False)
    except Exception:  # an interpolation that does not resolve: validate_recipe names it
        return None
    declared, expected = declared_type(baseline, key)
    expected = expected if declared else expected_type(old)
    if expected is None or new is None or _fits(new, expected):
        return None
    return f"{key}={given}: expected {expected} like {source} value {old!r}, got {type(new).__name__} {new!r}"


def declared_type(baseline: Any, key: str) -> tuple[bool, Optional[str]]:
    """(whether one of verl's config dataclasses declares `key`, the kind of value it declares: "a number", "an
    integer", "a boolean (true/false)", or None for anything else, a string among them). The dataclass is the
    `_target_` of the nearest node above the key, its fields followed down to the key (`algorithm.rollout_correction.
    rollout_is_threshold`: `AlgoConfig.rollout_correction` -> `RolloutCorrectionConfig`, declared `str | float`, so
    verl's `0.5_4.0` form is a value the user may give). A recipe's `entropy_coeff: 0` is an int in YAML, but verl's
    `ActorConfig.entropy_coeff` is a float, so 0.01 is fine. (False, None) where no dataclass declares the key."""
    import importlib

    from omegaconf import OmegaConf

    parts = key.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        try:
            node = OmegaConf.select(baseline, ".".join(parts[:depth]), throw_on_missing=False) if depth else baseline
            target = node.get("_target_") if node is not None and hasattr(node, "get") else None
        except Exception:  # noqa: BLE001  (an interpolation on the way)
            return False, None
        if not target:
            continue
        module, _, cls_name = str(target).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except Exception:  # noqa: BLE001  (a _target_ that does not import: verl's own instantiation names it)
            return False, None
        return _field_type(cls, parts[depth:])
    return False, None


def _field_type(cls: Any, names: Sequence[str]) -> tuple[bool, Optional[str]]:
    """`declared_type` below one dataclass: its field `names[0]`, and down through nested dataclasses."""
    import dataclasses
    import types
    import typing

    try:
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
    except Exception:  # noqa: BLE001  (a hint that does not resolve)
        return False, None
    if names[0] not in hints:
        return False, None
    declared = hints[names[0]]
    if typing.get_origin(declared) in (typing.Union, types.UnionType):  # Optional[float], str | float
        args = [a for a in typing.get_args(declared) if a is not type(None)]
        if len(args) != 1:
            numbers = set(args) <= {int, float}
            return True, "a number" if numbers else None
        declared = args[0]
    if len(names) > 1:
        return _field_type(declared, names[1:]) if dataclasses.is_dataclass(declared) else (False, None)
    kinds = {bool: "a boolean (true/false)", int: "an integer", float: "a number"}
    return True, kinds.get(declared)


def expected_type(value: Any) -> Optional[str]:
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
