"""The `study` command's figure: per step, the training reward, the fraction of tokens each method's trust region
acted on, and the rollout's mismatch, each method in its colour (the seeds' mean bold, each seed faint)."""

from __future__ import annotations

from pathlib import Path

from verl_dppo.studies.colors import colors_for

PANELS = (
    ("reward", "training reward (critic/score/mean)"),
    ("acted", "tokens acted on: clipped / masked\n(actor/pg_clipfrac; TROLL: projected)"),
    ("mismatch_tv", "mean divergence of pi from mu, as masked on\n(actor/dppo/mismatch_tv_mean)"),
)


def _values(run: dict, key: str) -> list:
    series = run["series"]
    if key == "acted" and series.get("troll_projected"):
        return series["troll_projected"]
    return series.get(key, [])


def draw(runs: list[dict], path: Path, setup: str, dpi: int = 100) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(run["method"] for run in runs))
    colors = dict(zip(methods, colors_for(methods)))
    figure, axes = plt.subplots(1, len(PANELS), figsize=(14, 3.9))
    for axis, (key, title) in zip(axes, PANELS):
        for method in methods:
            series = [_values(run, key) for run in runs if run["method"] == method]
            series = [values for values in series if values and any(v is not None for v in values)]
            for values in series:
                axis.plot(range(1, len(values) + 1), values, color=colors[method], alpha=0.3, linewidth=0.8)
            if series:
                longest = max(len(values) for values in series)
                mean = []
                for i in range(longest):
                    here = [values[i] for values in series if i < len(values) and values[i] is not None]
                    mean.append(sum(here) / len(here) if here else None)
                axis.plot(
                    range(1, longest + 1),
                    mean,
                    "o-",
                    color=colors[method],
                    markersize=3,
                    linewidth=1.6,
                    label=f"{method} ({len(series)} seed{'s' if len(series) > 1 else ''})",
                )
        if key == "acted":
            axis.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        axis.set_xlabel("RL step", fontsize=8)
        axis.set_title(title, fontsize=8.5)
        axis.grid(alpha=0.3)
        axis.tick_params(labelsize=7)
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)) or 1, fontsize=7.5, frameon=False)
    figure.suptitle(f"verl-dppo study {setup}: the sanity test in miniature", fontsize=10)
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
