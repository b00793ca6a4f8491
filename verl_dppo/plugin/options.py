"""Every option of the DPPO loss family checked in one place: its rule, its default, and how it is read.

`checked(name, value)` is the one definition of what `policy_loss.<name>` accepts. `DPPOLossConfig.__post_init__`
calls it for each field it holds, `resolve_options` for each value a run's config gives (a `DPPOLossConfig`, a plain
`PolicyLossConfig` or a DictConfig, and verl's `clip_ratio_*` where an option is unset), the families for their own
options (TROLL's, IPO's); `verl-dppo check` reaches the same rules through them. A new option is one row of `RULES`.

verl-free, as the registry is: the studies and the command line read the defaults without loading verl.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from verl_dppo.math.trust_region import RELAX_SIDES

__all__ = ["ANCHORS", "DEFAULTS", "RULES", "checked", "policy_loss_get", "read_key"]

ANCHORS = ("rollout", "recompute")

DEFAULTS: dict[str, Any] = {
    "anchor": "rollout",
    "relax_below": 0.0,
    "relax_side": "high",
    "troll_eps": 0.05,  # TROLL's reported values (Becker et al. 2025, arXiv 2510.03817)
    "troll_alpha": 1.0,
    "troll_support_mass": 1.0 - 1e-5,
    "ipo_tau": 0.0,  # prime-rl's default: no log-ratio penalty
}
"""The value an option takes when a run leaves it unset (the thresholds and the cap fall back to verl's keys
instead: `verl_dppo.plugin.config.FALLBACK_KEYS`; topk to the mode's K, `LossMode.default_topk`)."""


def _finite_at_least_0(value: float) -> bool:
    return value >= 0 and math.isfinite(value)


def _integer_at_least_1(value: Any) -> Any:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


RULES: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    # name: (kind, the test a value passes, what it must be)
    "delta_low": ("float", _finite_at_least_0, "a finite number >= 0"),
    "delta_high": ("float", _finite_at_least_0, "a finite number >= 0"),
    "ratio_cap": ("float", lambda v: v > 0, "> 0 (use .inf for no truncation)"),
    "anchor": ("choice", lambda v: v in ANCHORS, f"one of {ANCHORS}"),
    "relax_below": ("float", lambda v: 0.0 <= v <= 1.0, "in [0, 1] (alpha, Sec. 6)"),
    "relax_side": ("choice", lambda v: v in RELAX_SIDES, f"one of {RELAX_SIDES}"),
    "topk": ("integer", None, "an integer >= 1"),
    "max_off_policy_threshold": ("integer", None, "null or an integer >= 1 (verl's "
                                 "trainer.v1.sampler.max_off_policy_threshold)"),
    "troll_eps": ("float", lambda v: v > 0 and math.isfinite(v), "a finite number > 0 (TROLL: 0.05)"),
    "troll_alpha": ("float", _finite_at_least_0, "a finite number >= 0 (TROLL: 1.0)"),
    "troll_support_mass": ("float", lambda v: 0 < v <= 1, "in (0, 1] (TROLL: 1 - 1e-5)"),
    "ipo_tau": ("float", _finite_at_least_0, "a finite number >= 0 (0: no penalty)"),
}
"""Each option's kind, its rule and the words that say it."""


def checked(name: str, value: Any, source: Optional[str] = None) -> Any:
    """`value` of `policy_loss.<name>` converted (Hydra may pass "inf", "1e4", "20" as strings) and checked against
    its rule; None stays None (unset). `source`: the verl key the value came from, named in the error instead."""
    if value is None:
        return None
    kind, rule, wanted = RULES[name]
    where = f"policy_loss.{name}" if source is None else f"policy_loss.{name} (unset: verl's {source})"
    if kind == "float":
        value = _to_float(where, value)
    elif kind == "integer":
        converted = _integer_at_least_1(value)
        if converted is None:
            raise ValueError(f"{where} must be {wanted}, got {value!r}")
        return converted
    else:
        value = str(value)
    if not rule(value):
        raise ValueError(f"{where} must be {wanted}, got {value!r}")
    return value


def _to_float(where: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{where} must be a number, got {value!r}")
    if isinstance(value, str):
        text = value.strip().lower()
        text = {".inf": "inf", "+.inf": "inf", "-.inf": "-inf", ".nan": "nan"}.get(text, text)
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{where} must be a number, got {value!r}") from None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where} must be a number, got {value!r}") from None


def read_key(config: Any, key: str, default: Any = None) -> Any:
    """`config[key]` of a mapping (a dict, a DictConfig, verl's config dataclasses, which have `get`) or an object's
    attribute; `default` where absent or where `config` is None."""
    if config is None:
        return default
    getter = getattr(config, "get", None)
    return getter(key, default) if getter is not None else getattr(config, key, default)


def policy_loss_get(config: Any, key: str, default: Any = None) -> Any:
    """`policy_loss.<key>` of an actor config (verl's `ActorConfig`, a DictConfig or a dict)."""
    return read_key(read_key(config, "policy_loss", None), key, default)
