"""The registry of the plugin's loss modes: every mode's facts, asked for by name here and nowhere else.

Each `verl_dppo/plugin/<name>_mode.py` holds a `FAMILY` (`verl_dppo.plugin.loss_family.LossFamily`) whose `modes` are
its rows; this module finds every such module (a new mode is one new module) and answers what the rest of the
plugin, the command line and the studies ask about a mode: which family serves it, what its thresholds measure, the
paper's threshold, whether it reads the rollout's top-K and its default K, its short label, colour and plot panels.
`verl_dppo.plugin.losses` registers these modes in verl's POLICY_LOSS_REGISTRY.

The modules are found and imported at the first question, not at this module's import: a family module may ask the
registry about its own modes (Top-K's default K) while it is itself being imported.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache
from typing import Optional

from verl_dppo.plugin.loss_family import LossMode

__all__ = ["loss_modes", "mode_named", "topk_modes", "is_topk_mode", "logits_hook"]


@lru_cache(maxsize=None)
def loss_modes() -> tuple[LossMode, ...]:
    """Every registered mode, by family module name, then in the family's order."""
    import verl_dppo.plugin

    names = sorted(m.name for m in pkgutil.iter_modules(verl_dppo.plugin.__path__) if m.name.endswith("_mode"))
    return tuple(mode for name in names for mode in importlib.import_module(f"verl_dppo.plugin.{name}").FAMILY.modes)


def mode_named(name: Optional[str]) -> Optional[LossMode]:
    """The plugin's mode of that name, or None (verl's own modes, an unknown name)."""
    return next((mode for mode in loss_modes() if mode.name == name), None)


def topk_modes() -> tuple[str, ...]:
    """The names of the modes that read the rollout's top-K in the engine's logits hook."""
    return tuple(mode.name for mode in loss_modes() if mode.reads_topk)


def is_topk_mode(name: Optional[str]) -> bool:
    """True for a mode that needs the rollout's top-K and the engine's logits hook (dppo_topk_*, troll)."""
    mode = mode_named(name)
    return mode is not None and mode.reads_topk


def logits_hook(name: Optional[str]) -> Optional[str]:
    """What the engine's logits hook computes for the mode: "topk", "troll", or None (no hook)."""
    mode = mode_named(name)
    return mode.family.logits_hook if mode is not None else None
