"""One colour per method in every figure the plugin draws (`plot`, the demo's and the staleness study's figures), and
line styles that keep coinciding lines visible.

A run is matched to a method by its label: the method's name (recipes/method/<name>.yaml, the demo's rows) as the
whole label or one of its '-'/'/'-separated parts (`cpu_tiny-dppo_binary_tv-sync` is dppo_binary_tv). Runs of no
known method take the spare colours, in order.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

__all__ = ["METHOD_COLORS", "method_of", "colors_for", "line_style"]

METHOD_COLORS = {
    # the clipped and unclipped baselines: blues and greys
    "pg_is": "#7f7f7f",
    "pg_tis": "#525252",
    "cispo": "#8c564b",
    "grpo_clip_higher": "#1f77b4",
    "minirl": "#6baed6",
    "minirl_tis": "#08519c",
    "relax_low": "#9ecae1",
    "relax_high": "#3182bd",
    "relax_both": "#17becf",
    # DPPO: reds, oranges, greens
    "dppo_binary_tv": "#d62728",
    "dppo_binary_tv_recompute": "#ff9896",
    "dppo_binary_kl": "#ff7f0e",
    "dppo_binary_kl_decoupled": "#fdae6b",
    "dppo_topk_tv": "#2ca02c",
    "dppo_topk_kl": "#98df8a",
    "minimal_mask_0.5": "#e377c2",
    "minimal_mask_0.5_recompute": "#f7b6d2",
    "minimal_mask_0.8": "#bcbd22",
    # TROLL: purple
    "troll": "#9467bd",
}
ALIASES = {"grpo_clip": "grpo_clip_higher"}
"""Other names of a method (the demo's earlier name of grpo_clip_higher, its loss mode)."""
SPARE = ("#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#5254a3", "#8ca252", "#bd9e39")

_STYLES = ("-", "--", "-.", ":")


def method_of(label: str) -> Optional[str]:
    """The known method a run label names, or None."""
    parts = [label, *re.split(r"[-/]", label)]
    for part in parts:
        name = ALIASES.get(part, part)
        if name in METHOD_COLORS:
            return name
    return None


def colors_for(labels: Sequence[str]) -> list[str]:
    """A colour per label: its method's, else the next spare one (one per distinct unknown label)."""
    spare: dict[str, str] = {}
    colors = []
    for label in labels:
        method = method_of(label)
        if method is not None:
            colors.append(METHOD_COLORS[method])
            continue
        if label not in spare:
            spare[label] = SPARE[len(spare) % len(SPARE)]
        colors.append(spare[label])
    return colors


def line_style(index: int) -> dict:
    """Matplotlib keywords for the index-th line of a panel: later lines thinner and dashed, drawn on top, so that
    lines with equal values (two methods that both log 0) stay visible."""
    return {"linestyle": _STYLES[index % len(_STYLES)], "linewidth": max(0.9, 2.2 - 0.45 * index),
            "zorder": 2 + index}
