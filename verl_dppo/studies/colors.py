"""One colour per method in every figure the plugin draws (`plot`, the demo's and the staleness study's figures), and
line styles that keep coinciding lines visible.

A run is matched to a method by its label: the method's name (recipes/method/<name>.yaml, the demo's rows) as the
whole label or one of its '-'/'/'-separated parts (`cpu_tiny-dppo_binary_tv-sync` is dppo_binary_tv). Runs of no
known method take the spare colours, in order.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Optional, Sequence

from verl_dppo.studies.demo.methods import ALIASES

__all__ = ["METHOD_COLORS", "method_colors", "method_of", "colors_for", "line_style"]  # noqa: F822 (__getattr__)

VARIANT_COLORS = {
    # the clipped and unclipped baselines: blues and greys
    "pg_tis": "#525252",
    "cispo": "#8c564b",
    "minirl": "#6baed6",
    "minirl_tis": "#08519c",
    "relax_low": "#9ecae1",
    "relax_high": "#3182bd",
    "relax_both": "#17becf",
    # DPPO: reds, oranges, greens
    "dppo_binary_tv_recompute": "#ff9896",
    "dppo_binary_kl_decoupled": "#fdae6b",
    "minimal_mask_0.5": "#e377c2",
    "minimal_mask_0.5_recompute": "#f7b6d2",
    "minimal_mask_0.8": "#bcbd22",
}
"""The colours of the recipes that are a variant of a loss mode; a mode's own colour is on its registry entry
(`LossMode.color`), under the name of the method that runs it (`ALIASES`: grpo_clip's is grpo_clip_higher's)."""
SPARE = ("#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#5254a3", "#8ca252", "#bd9e39")

_STYLES = ("-", "--", "-.", ":")


@lru_cache(maxsize=None)
def method_colors() -> dict[str, str]:
    """Method name -> its colour: each loss mode's (`LossMode.color`) under its method's name, then the variants'."""
    from verl_dppo.plugin.modes import loss_modes

    return {**{ALIASES.get(m.name, m.name): m.color for m in loss_modes() if m.color}, **VARIANT_COLORS}


def __getattr__(name: str):
    if name == "METHOD_COLORS":  # read lazily: the registry imports the loss modes' modules
        return method_colors()
    raise AttributeError(name)


def method_of(label: str) -> Optional[str]:
    """The known method a run label names, or None."""
    parts = [label, *re.split(r"[-/]", label)]
    for part in parts:
        name = ALIASES.get(part, part)
        if name in method_colors():
            return name
    return None


def colors_for(labels: Sequence[str]) -> list[str]:
    """A colour per label: its method's, else the next spare one (one per distinct unknown label)."""
    spare: dict[str, str] = {}
    colors = []
    for label in labels:
        method = method_of(label)
        if method is not None:
            colors.append(method_colors()[method])
            continue
        if label not in spare:
            spare[label] = SPARE[len(spare) % len(SPARE)]
        colors.append(spare[label])
    return colors


def line_style(index: int) -> dict:
    """Matplotlib keywords for the index-th line of a panel: later lines thinner and dashed, drawn on top, so that
    lines with equal values (two methods that both log 0) stay visible."""
    return {"linestyle": _STYLES[index % len(_STYLES)], "linewidth": max(0.9, 2.2 - 0.45 * index), "zorder": 2 + index}
