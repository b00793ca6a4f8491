"""Every option of the DPPO loss family checked in one place: its rule, its default, and how it is read.

`checked(name, value)` is the one definition of what `policy_loss.<name>` accepts, and `resolve_options` how a run's
config resolves to the values a loss call uses (`ResolvedOptions`). `DPPOLossConfig.__post_init__`
calls it for each field it holds, `resolve_options` for each value a run's config gives (a `DPPOLossConfig`, a plain
`PolicyLossConfig` or a DictConfig, and verl's `clip_ratio_*` where an option is unset), the families for their own
options (TROLL's, IPO's); `verl-dppo check` reaches the same rules through them. A new option is one row of `RULES`.

verl-free, as the registry is: the studies and the command line read the defaults without loading verl.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

from verl_dppo.math.trust_region import RELAX_SIDES

__all__ = [
    "ANCHORS",
    "DEFAULTS",
    "FALLBACK_KEYS",
    "RULES",
    "ResolvedOptions",
    "checked",
    "checked_fields",
    "policy_loss_get",
    "read_key",
    "resolve_options",
]

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
instead: `FALLBACK_KEYS`; topk to the mode's K, `LossMode.default_topk`)."""

FALLBACK_KEYS = {"delta_low": "clip_ratio_low", "delta_high": "clip_ratio_high", "ratio_cap": "clip_ratio_c"}
"""Each option left unset -> the actor key of verl's whose value it takes (verl's own `dppo_tv` convention)."""


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
    "max_off_policy_threshold": (
        "integer",
        None,
        "null or an integer >= 1 (verl's trainer.v1.sampler.max_off_policy_threshold)",
    ),
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


def checked_fields(values: dict[str, Any]) -> dict[str, Any]:
    """Each of `values` (option name -> value) converted and checked by its rule, as `checked` does one."""
    return {name: checked(name, value) for name, value in values.items()}


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


@dataclass(frozen=True)
class ResolvedOptions:
    """The values a loss call actually uses, after verl's fallbacks."""

    delta_low: float
    delta_high: float
    ratio_cap: float
    anchor: str
    relax_below: float
    relax_side: str
    topk: Optional[int]  # None: the mode's default (topk_mode.configured_topk)
    max_off_policy_threshold: Optional[int]  # None: over-threshold samples not counted
    sources: tuple[str, ...]  # which values came from verl's clip_ratio_* fallbacks

    def inherited(self) -> dict[str, str]:
        """Option -> the verl key its value came from, for the options left unset ({"delta_low": "clip_ratio_low"})."""
        keys = {source.split("=", 1)[0] for source in self.sources}
        return {name: key for name, key in FALLBACK_KEYS.items() if key in keys}

    def describe(self, topk: Optional[int] = None) -> str:
        """The values in effect, key=value; K only where given (the modes that read it: a binary mode's line does not
        show the recipes' `topk: 20`, which it never reads)."""
        text = (
            f"delta_low={self.delta_low:g} delta_high={self.delta_high:g} ratio_cap={self.ratio_cap:g} "
            f"anchor={self.anchor} relax_below={self.relax_below:g} relax_side={self.relax_side}"
        )
        if topk is not None:
            text += f" topk={topk}"
        if self.sources:
            text += " (from verl's " + ", ".join(self.sources) + ")"
        return text


_SHARED = tuple(field.name for field in fields(ResolvedOptions) if field.name != "sources")
"""The options every mode reads (the families read their own, TROLL's and IPO's, with `checked`)."""


def resolve_options(config: Any, uses_divergence_thresholds: bool) -> ResolvedOptions:
    """Resolve the options in effect from an actor config (verl's `ActorConfig` or a DictConfig/dict), each checked
    by its rule (`checked`) whichever config class carried it.

    `uses_divergence_thresholds` is False for `grpo_clip`, which always takes its eps from clip_ratio_low/high.
    """
    if config is None:
        raise ValueError("DPPO losses need the actor config (verl passes config=ActorConfig); got config=None")
    policy_loss = read_key(config, "policy_loss", None)
    values = checked_fields({name: read_key(policy_loss, name, None) for name in _SHARED})
    if not uses_divergence_thresholds:
        values["delta_low"] = values["delta_high"] = None
    sources = []
    for name, verl_key in FALLBACK_KEYS.items():  # an option left unset takes verl's value (`dppo_tv`'s convention)
        if values[name] is None:
            verl_value = read_key(config, verl_key, None)
            if verl_value is None:
                verl_value = 3.0 if name == "ratio_cap" else read_key(config, "clip_ratio", 0.2)
            values[name] = checked(name, verl_value, source=f"actor.{verl_key}")
            sources.append(f"{verl_key}={values[name]:g}")
    for name, value in values.items():
        if value is None:
            values[name] = DEFAULTS.get(name)
    return ResolvedOptions(**values, sources=tuple(sources))
