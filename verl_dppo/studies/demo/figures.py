"""The demo's figures, drawn from the JSONL logs it wrote (the same reader as `verl-dppo plot`)."""

from __future__ import annotations

import os

import numpy as np

from verl_dppo.studies.demo.rl import COLLAPSE_FRACTION
from verl_dppo.studies.colors import colors_for
from verl_dppo.studies.plot import load_run


def _series(run, metric):
    points = run.series.get(metric, {})
    steps = sorted(points)
    return np.array(steps), np.array([points[s] for s in steps])


def _smooth(values: np.ndarray, window: int = 10) -> np.ndarray:
    out = np.empty_like(values)
    for i in range(len(values)):
        out[i] = values[max(0, i - window + 1) : i + 1].mean()
    return out


def _mean_and_range(series: list[tuple[np.ndarray, np.ndarray]]):
    """Steps logged by every run, and the mean, lowest and highest value over the runs at each."""
    common = sorted(set.intersection(*(set(steps.tolist()) for steps, _ in series)))
    stacked = np.array([[dict(zip(steps.tolist(), values))[s] for s in common] for steps, values in series])
    return np.array(common), stacked.mean(axis=0), stacked.min(axis=0), stacked.max(axis=0)


def draw_all(out_dir: str, results: list[dict], dpi: int = 90) -> list[str]:
    """Write reward.png, mismatch.png, masked.png and blocked_probs.png into out_dir; returns their paths. Several
    runs of one method (one per seed) are drawn as their mean, with a band from the lowest to the highest run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_method: dict[str, list[dict]] = {}
    for r in results:
        by_method.setdefault(r["method"], []).append(r)
    runs = {
        name: [load_run(os.path.join(out_dir, f"{r.get('run', name)}.jsonl")) for r in group]
        for name, group in by_method.items()
    }
    seeds = sorted({r.get("seed", 0) for r in results})
    several = len(seeds) > 1
    over_seeds = (
        f"mean of seeds {','.join(map(str, seeds))} (band: lowest to highest)"
        if several
        else f"seed {seeds[0]}, one run (--seeds 0,1,2: mean and spread)"
    )
    colors = dict(zip(runs, colors_for(list(runs))))  # each method in its colour in every figure (and in `plot`)
    paths = []

    def lines(axis, metric, smooth=10, log=False):
        for name, method_runs in runs.items():
            series = [_series(run, metric) for run in method_runs]
            if any(len(steps) == 0 for steps, _ in series):
                continue
            if smooth > 1:
                series = [(steps, _smooth(values, smooth)) for steps, values in series]
            steps, mean, low, high = _mean_and_range(series)
            if several:
                axis.fill_between(steps, low, high, color=colors[name], alpha=0.15, linewidth=0)
            elif smooth > 1:
                raw_steps, raw = _series(method_runs[0], metric)
                axis.plot(raw_steps, raw, color=colors[name], alpha=0.18, linewidth=0.7)
            axis.plot(steps, mean, color=colors[name], label=name, linewidth=1.4)
        axis.set_xlabel("RL step", fontsize=8)
        axis.grid(alpha=0.3)
        axis.tick_params(labelsize=7)
        if log:
            axis.set_yscale("log")

    def save(figure, name, rect=(0, 0, 1, 1)):
        path = os.path.join(out_dir, name)
        figure.tight_layout(rect=rect)
        figure.savefig(path, dpi=dpi)
        plt.close(figure)
        paths.append(path)

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.9))
    lines(left, "critic/score/mean")
    # The demo's collapse verdict (rl.summarize): a COLLAPSE_WINDOW-step mean below this line (each seed has its
    # own warm start; the line is drawn at their mean).
    threshold = COLLAPSE_FRACTION * float(np.mean([r["initial_reward"] for r in by_method[next(iter(runs))]]))
    left.axhline(
        threshold,
        color="black",
        linestyle="--",
        linewidth=0.9,
        label=f"collapse: {results[0].get('collapse_window', 20)}-step mean below "
        f"{COLLAPSE_FRACTION:g} x warm start ({threshold:.2f})",
    )
    left.set_title(f"training reward (critic/score/mean; 10-step mean)\n{over_seeds}", fontsize=8.5)
    for name, group in by_method.items():
        series = [tuple(np.array(column) for column in zip(*r["held_out_accuracy"])) for r in group]
        if not all(series):
            continue
        steps, mean, low, high = _mean_and_range(series)
        if several:
            right.fill_between(steps, low, high, color=colors[name], alpha=0.1, linewidth=0)
        right.plot(steps, mean, "o-", color=colors[name], label=name, markersize=3, linewidth=1.2)
    n_held_out = sorted({r.get("n_held_out", 0) for r in results})
    size = f"{n_held_out[0]:,}" if len(n_held_out) == 1 else f"{n_held_out[0]:,}-{n_held_out[-1]:,}"
    right.set_title(
        f"held-out greedy accuracy (val-core/digit_sum/acc/mean@1)\n{size} problems, {over_seeds}", fontsize=8.5
    )
    right.set_xlabel("RL step", fontsize=8)
    right.grid(alpha=0.3)
    right.tick_params(labelsize=7)
    # One legend under both panels: inside, it covered the curves.
    handles, labels = left.get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=4, fontsize=7, frameon=False)
    save(figure, "reward.png", rect=(0, 0.05 * -(-len(labels) // 4), 1, 1))

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    lines(left, "training/rollout_probs_diff_mean", log=True)
    left.set_title(
        "bf16 rollout vs fp32 learner, same weights: mean |pi - mu|\n"
        "(training/rollout_probs_diff_mean, before the updates)",
        fontsize=8.5,
    )
    lines(right, "actor/dppo/mismatch_tv_mean", log=True)
    right.set_title(
        "|pi - mu| during the mini-batch updates\n(actor/dppo/mismatch_tv_mean: mismatch + drift)", fontsize=8.5
    )
    right.legend(fontsize=7)
    save(figure, "mismatch.png")

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    lines(left, "actor/pg_clipfrac")
    left.set_title("masked fraction of response tokens (actor/pg_clipfrac)", fontsize=9)
    left.legend(fontsize=7)
    lines(right, "actor/dppo/bad_update_frac")
    right.set_title("bad updates: A<0 and mu - pi > 0.5 (actor/dppo/bad_update_frac)", fontsize=9)
    save(figure, "masked.png")

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    edges = np.array(results[0]["prob_bins"])
    centers, width = (edges[:-1] + edges[1:]) / 2, np.diff(edges)
    pooled = {
        name: (
            np.sum([r["blocked_by_prob"] for r in group], axis=0).astype(float),
            np.sum([r["updates_by_prob"] for r in group], axis=0).astype(float),
        )
        for name, group in by_method.items()
    }
    masking = [name for name, (blocked, _) in pooled.items() if blocked.sum() > 0]
    bar_width = width / max(1, len(masking))
    for k, name in enumerate(masking):
        blocked, updates = pooled[name]
        left.bar(
            edges[:-1] + k * bar_width,
            blocked / blocked.sum(),
            width=bar_width,
            align="edge",
            color=colors[name],
            label=f"{name} ({int(blocked.sum())} tokens)",
        )
        rate = np.divide(blocked, updates, out=np.full_like(blocked, np.nan), where=updates > 0)
        right.plot(centers, rate, "o-", color=colors[name], label=name, markersize=3)
    left.set_title(
        "rollout probability mu(a_t) of the tokens each method blocked\n(share of its blocked tokens"
        + (", all seeds)" if several else ")"),
        fontsize=8.5,
    )
    left.set_xlabel("mu(a_t)", fontsize=8)
    right.set_title("blocked share of the updates (A != 0), by mu(a_t)", fontsize=8.5)
    right.set_xlabel("mu(a_t)", fontsize=8)
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.tick_params(labelsize=7)
    # One legend under both panels: inside, it covered the bars at mu < 0.45, the region the argument is about.
    handles, labels = left.get_legend_handles_labels()
    if handles:
        figure.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=7, frameon=False)
    rows = -(-len(labels) // 3) if handles else 0
    save(figure, "blocked_probs.png", rect=(0, 0.06 * rows, 1, 1))
    return paths
