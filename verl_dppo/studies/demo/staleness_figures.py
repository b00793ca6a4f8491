"""The staleness study's figures: final reward, masked fraction and the lowest window reward against the lag."""

from __future__ import annotations

import os

from verl_dppo.studies.colors import colors_for
from verl_dppo.studies.demo.rl import COLLAPSE_FRACTION

PANELS = (
    ("reward_vs_lag.png", "final_reward", "final training reward (mean of the last {final_window} steps)"),
    ("masked_vs_lag.png", "masked_frac", "masked fraction of response tokens\n(actor/pg_clipfrac, mean over the run)"),
    (
        "collapse_vs_lag.png",
        "lowest_window_reward",
        "lowest {collapse_window}-step mean training reward\n(below the dashed line: collapsed)",
    ),
)


def draw_study(out_dir: str, results: list[dict], lags: list[int], dpi: int = 90) -> list[str]:
    """Write the three figures of PANELS and staleness.png (all three side by side) into out_dir; returns paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in results))
    colors = dict(zip(methods, colors_for(methods)))  # each method in its colour in every figure (and in `plot`)
    by_run = {(r["method"], r["lag"]): r for r in results}
    first = results[0]

    def panel(axis, key, title):
        for method in methods:
            points = [(i, by_run[method, lag][key]) for i, lag in enumerate(lags) if (method, lag) in by_run]
            style = "s--" if method.endswith("_recompute") else "o-"
            axis.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                style,
                color=colors[method],
                label=method,
                markersize=4,
                linewidth=1.3,
            )
        if key == "lowest_window_reward":
            threshold = COLLAPSE_FRACTION * first["initial_reward"]
            axis.axhline(
                threshold,
                color="black",
                linestyle="--",
                linewidth=0.9,
                label=f"collapse threshold ({COLLAPSE_FRACTION:g} x warm start = {threshold:.2f})",
            )
        if key == "masked_frac":
            axis.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        axis.set_xticks(range(len(lags)), [str(lag) for lag in lags])
        axis.set_xlabel("rollout lag (versions behind the learner)", fontsize=8)
        axis.set_title(title.format(**first), fontsize=8.5)
        axis.grid(alpha=0.3)
        axis.tick_params(labelsize=7)

    def save(figure, name, rect=(0, 0, 1, 1)):
        path = os.path.join(out_dir, name)
        figure.tight_layout(rect=rect)
        figure.savefig(path, dpi=dpi)
        plt.close(figure)
        return path

    paths = []
    for name, key, title in PANELS:
        figure, axis = plt.subplots(figsize=(5.5, 3.6))
        panel(axis, key, title)
        axis.legend(fontsize=6.5)
        paths.append(save(figure, name))
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.9))
    for axis, (_, key, title) in zip(axes, PANELS):
        panel(axis, key, title)
    handles, labels = axes[2].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=min(5, len(labels)), fontsize=7, frameon=False)
    rows = -(-len(labels) // 5)
    paths.append(save(figure, "staleness.png", rect=(0, 0.05 * rows, 1, 1)))
    return paths
