"""The rows of `verl-dppo mismatch` (`verl_dppo.studies.mismatch`): per bucket of mu's probability of the sampled
token, the deviations of pi from mu and the share of tokens each method's trust region acts on, and their table.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["BUCKETS", "METHODS", "bucket_rows", "region", "table"]

BUCKETS = (0.0, 1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0 + 1e-9)
"""Edges of mu(a_t)'s buckets: [0, 1e-4), [1e-4, 1e-3), ..., [0.9, 1]."""
METHODS = {  # the methods measured (recipes/method/<name>.yaml) -> their loss mode
    "grpo_clip_higher": "grpo_clip",
    "dppo_binary_tv": "dppo_binary_tv",
    "dppo_binary_kl": "dppo_binary_kl",
    "dppo_topk_tv": "dppo_topk_tv",
    "dppo_topk_kl": "dppo_topk_kl",
}


def region(method: str) -> str:
    """How the method's region is read off the tokens: "ratio" (PPO's eps on |r - 1|), else its mode's D."""
    from verl_dppo.plugin.modes import mode_named

    mode = mode_named(METHODS[method])
    if not mode.uses_divergence_thresholds:
        return "ratio"
    return f"{'topk' if mode.reads_topk else 'binary'}_{mode.measure}"


def _label(method: str) -> str:
    from verl_dppo.plugin.modes import mode_named

    return mode_named(METHODS[method]).label


def _bucket_name(low: float, high: float) -> str:
    label = lambda x: "0" if x == 0 else ("1" if x > 1 else f"{x:g}")  # noqa: E731
    return f"[{label(low)}, {label(high)}{']' if high > 1 else ')'}"


def _dtype(name: Any):
    import torch

    return getattr(torch, str(name).replace("torch.", "")) if name else torch.float32


def bucket_rows(tokens: dict, bounds: dict[str, tuple[float, float]]) -> list[dict]:
    """Per bucket of mu(a_t): counts, deviations and the fraction each region acts on (see the module's docstring)."""
    from verl_dppo.math.divergence import binary_kl, binary_tv, nearest_within_rounding, rounding_radius
    from verl_dppo.math.trust_region import trust_region_blocked

    mu_lp, pi_lp = tokens["mu"].float(), tokens["pi"].float()
    mu, pi = mu_lp.double().exp(), pi_lp.double().exp()
    ratio = (pi_lp.double() - mu_lp.double()).exp()
    # as the loss measures them (losses._measure): the binary divergences at the pair nearest each other with each
    # side within the rounding of the dtype it was computed in, the ratio at the values given
    mu_near, pi_near = nearest_within_rounding(
        mu_lp,
        pi_lp,
        rounding_radius(mu_lp, _dtype(tokens.get("mu_dtype"))),
        rounding_radius(pi_lp, _dtype(tokens.get("pi_dtype"))),
    )
    measures = {
        "ratio": (ratio - 1).abs(),
        "binary_tv": binary_tv(mu_near, pi_near).double(),
        "binary_kl": binary_kl(mu_near, pi_near).double(),
    }
    for name in ("topk_tv", "topk_kl"):
        if name in tokens:
            measures[name] = tokens[name].double()
    rows = []
    for low, high in zip(BUCKETS[:-1], BUCKETS[1:]):
        inside = (mu >= low) & (mu < high)
        n = int(inside.sum())
        row: dict[str, Any] = {"bucket": _bucket_name(low, high), "tokens": n}
        if n:
            deviation = (ratio[inside] - 1).abs()
            gap = (pi[inside] - mu[inside]).abs()
            row.update(
                ratio_dev_mean=float(deviation.mean()),
                ratio_dev_max=float(deviation.max()),
                abs_diff_mean=float(gap.mean()),
                abs_diff_max=float(gap.max()),
                binary_tv_mean=float(measures["binary_tv"][inside].mean()),
                binary_kl_mean=float(measures["binary_kl"][inside].mean()),
            )
            if "topk_tv" in measures:
                row["topk_tv_mean"] = float(measures["topk_tv"][inside].mean())
            acted = {}
            for method in METHODS:
                kind = region(method)
                if kind not in measures:
                    continue
                lower, upper = bounds[method]
                if kind == "ratio":
                    out = (ratio[inside] < 1 - lower) | (ratio[inside] > 1 + upper)
                else:  # the mode's own rule, with the advantage that would push pi further the way it moved
                    moved = pi_lp[inside].double() - mu_lp[inside].double()
                    out = trust_region_blocked(moved.sign(), moved, measures[kind][inside], lower, upper)
                acted[method] = float(out.double().mean())
            row["acted_frac"] = acted
        rows.append(row)
    return rows


def table(label: str, rows: list[dict]) -> str:
    methods = [m for m in METHODS if any(m in row.get("acted_frac", {}) for row in rows)]
    head = (
        f"{'mu(a) in':<14}{'tokens':>7}  {'|pi/mu-1| mean':>14} {'max':>8}  {'|pi-mu| mean':>12} {'max':>8}  "
        f"{'bin. TV':>8} {'TopK TV':>8} {'bin. KL':>8}  acted on (%): " + " ".join(f"{_label(m):>5}" for m in methods)
    )
    lines = [f"trainer {label}:", head]
    for row in rows:
        if not row["tokens"]:
            lines.append(f"{row['bucket']:<14}{0:>7}")
            continue
        acted = " ".join(f"{100 * row['acted_frac'][m]:>5.1f}" for m in methods)
        lines.append(
            f"{row['bucket']:<14}{row['tokens']:>7}  {row['ratio_dev_mean']:>14.2e} "
            f"{row['ratio_dev_max']:>8.1e}"
            f"  {row['abs_diff_mean']:>12.2e} {row['abs_diff_max']:>8.1e}  {row['binary_tv_mean']:>8.1e} "
            f"{row.get('topk_tv_mean', math.nan):>8.1e} {row['binary_kl_mean']:>8.1e}  {'':14}{acted}"
        )
    return "\n".join(lines)
