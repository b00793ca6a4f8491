"""The demo's figures, drawn from the JSONL logs it wrote (the same reader as `verl-dppo plot`)."""

from __future__ import annotations

import os

import numpy as np

from verl_dppo.cli.demo.rl import COLLAPSE_FRACTION
from verl_dppo.cli.plot import load_run


def _series(run, metric):
    points = run.series.get(metric, {})
    steps = sorted(points)
    return np.array(steps), np.array([points[s] for s in steps])


def _smooth(values: np.ndarray, window: int = 10) -> np.ndarray:
    out = np.empty_like(values)
    for i in range(len(values)):
        out[i] = values[max(0, i - window + 1) : i + 1].mean()
    return out


def draw_all(out_dir: str, results: list[dict], dpi: int = 90) -> list[str]:
    """Write reward.png, mismatch.png, masked.png and blocked_probs.png into out_dir; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {r["method"]: load_run(os.path.join(out_dir, f"{r['method']}.jsonl")) for r in results}
    colors = dict(zip(runs, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    paths = []

    def lines(axis, metric, smooth=10, log=False):
        for name, run in runs.items():
            steps, values = _series(run, metric)
            if len(steps) == 0:
                continue
            if smooth > 1:
                axis.plot(steps, values, color=colors[name], alpha=0.18, linewidth=0.7)
                values = _smooth(values, smooth)
            axis.plot(steps, values, color=colors[name], label=name, linewidth=1.4)
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

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    lines(left, "critic/score/mean")
    # The demo's collapse verdict (rl.summarize): a COLLAPSE_WINDOW-step mean below this line.
    threshold = COLLAPSE_FRACTION * results[0]["initial_reward"]
    left.axhline(threshold, color="black", linestyle="--", linewidth=0.9,
                 label=f"collapse: {results[0].get('collapse_window', 20)}-step mean below "
                       f"{COLLAPSE_FRACTION:g} x warm start ({threshold:.2f})")
    left.set_title("training reward (critic/score/mean; 10-step mean)", fontsize=9)
    left.legend(fontsize=7)
    for name, run in runs.items():
        steps, values = _series(run, "val-core/digit_sum/acc/mean@1")
        right.plot(steps, values, "o-", color=colors[name], label=name, markersize=3, linewidth=1.2)
    right.set_title("held-out greedy accuracy (val-core/digit_sum/acc/mean@1)\n"
                    "one seed: the order of close methods changes with --seed", fontsize=8.5)
    right.set_xlabel("RL step", fontsize=8)
    right.grid(alpha=0.3)
    right.tick_params(labelsize=7)
    save(figure, "reward.png")

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    lines(left, "training/rollout_probs_diff_mean", log=True)
    left.set_title("bf16 rollout vs fp32 learner, same weights: mean |pi - mu|\n"
                   "(training/rollout_probs_diff_mean, before the updates)", fontsize=8.5)
    lines(right, "actor/dppo/mismatch_tv_mean", log=True)
    right.set_title("|pi - mu| during the mini-batch updates\n(actor/dppo/mismatch_tv_mean: mismatch + drift)",
                    fontsize=8.5)
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
    masking = [r for r in results if sum(r["blocked_by_prob"]) > 0]
    bar_width = width / max(1, len(masking))
    for k, r in enumerate(masking):
        blocked = np.array(r["blocked_by_prob"], dtype=float)
        left.bar(edges[:-1] + k * bar_width, blocked / blocked.sum(), width=bar_width, align="edge",
                 color=colors[r["method"]], label=f"{r['method']} ({int(blocked.sum())} tokens)")
        updates = np.array(r["updates_by_prob"], dtype=float)
        rate = np.divide(blocked, updates, out=np.full_like(blocked, np.nan), where=updates > 0)
        right.plot(centers, rate, "o-", color=colors[r["method"]], label=r["method"], markersize=3)
    left.set_title("rollout probability mu(a_t) of the tokens each method blocked\n(share of its blocked tokens)",
                   fontsize=8.5)
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
