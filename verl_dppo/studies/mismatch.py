"""`verl-dppo mismatch [SETUP] --out DIR`: the paper's Figure 2 for a model and its two engines, before training.

The paper starts from an observation (its Sec. 1, Fig. 2): the same weights in the rollout engine and in the trainer
give different probabilities, and the ratio pi/mu moves most on the rare tokens while |pi - mu| moves most on the likely
ones, so PPO's ratio clip treats engine noise on rare tokens as a large update. This command measures it for a setup's
own model and engines, as a run computes them: it launches the setup through `verl-dppo run` for one step of
`dppo_topk_tv` (so the rollout returns mu's top-K rows), one update on the policy that sampled, with the training worker
writing every response token's mu (the rollout server's log-prob) and pi (the training engine's, from the update's
forward) and the Top-K TV over mu's rows (`verl_dppo.plugin.mismatch_dump`). It then prints and writes, per bucket of
mu's probability of the sampled token: the tokens, |pi/mu - 1| and |pi - mu| (mean and max), the binary KL, the Top-K
TV, and the fraction of tokens each trust region would act on at its method's settings (PPO's ratio clip at its eps;
each DPPO mode's divergence above its delta: the tokens whose update it would mask if the advantage pushed further; the
rows: `verl_dppo.studies.mismatch_rows`). On this CPU the default setup is `smollm2` (the real model on vLLM-CPU in
bf16) against the trainer in fp32 and in bf16: two launches. A cluster setup (`verl-dppo mismatch moe_base`) runs once,
with the setup's own model, engines and dtypes.

Output in DIR: `mismatch.json` (the rows, the settings, the commands), `mismatch.png` (the figure), the runs'
token files under `tokens/` and each launch's console in `runs/<label>.log` (the command names it and says each phase,
build, rollout, update, as the launch reaches it). Both outputs are written again as each launch ends, with what is
measured so far: until the last launch ends, the JSON says `"partial": true` and which launches are pending, the
figure's title too, so a measurement cut in its second launch keeps the first. `--redraw DIR` launches nothing: it
writes the table, the JSON and the figure again from the records a complete measurement left in DIR (`tokens/`), the
JSON byte for byte as the measurement wrote it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Sequence

from verl_dppo.errors import UsageError, writable_folder
from verl_dppo.studies.mismatch_rows import BUCKETS, METHODS, bucket_rows, region, table

__all__ = ["BUCKETS", "METHODS", "bucket_rows", "redraw", "add_command"]

CPU_PROMPTS = 16
"""Prompts per run on a CPU setup (x its samples per prompt: smollm2's 4 give about 2,500 response tokens)."""
CPU_TRAINER_DTYPES = {"fp32": (), "bf16": ("actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",)}
LAUNCHER = (sys.executable, "-m", "verl_dppo.cli")
"""How a launch calls `verl-dppo run` (the tests put a fake launch here, one that writes token records)."""
SETTINGS = "measurement.json"
"""In DIR/tokens, written before the first launch: the setup, the rollout engine, the thresholds and the launches'
labels in order: with each launch's records, all a redraw needs."""
LAUNCHED = "launch.json"
"""In DIR/tokens/<label>, written when the launch ended with its tokens: its command and seconds."""
PHASES = {  # a launch's phase (verl_dppo.studies.launches.follow_launch) -> what the command says of it
    "build": "the model and data where missing, Ray, verl's workers and the rollout server",
    "rollout": "the rollout engine samples the responses (mu)",
    "update": "the trainer ({label}) scores them in the update's forward (pi)",
}


def thresholds(setup: str, config_dir: list, overrides: Sequence[str] = ()) -> dict[str, tuple[float, float]]:
    """Each method's region bounds at the setup's settings and the user's overrides (a clip_ratio_high or a DPPO
    delta given on the command line counts): (eps_low, eps_high) for the ratio clip, (delta_low, delta_high) for
    the DPPO modes, read from the composed recipes."""
    from verl_dppo.launch.compose import compose_recipe
    from verl_dppo.plugin.options import resolve_options

    found = {}
    for method in METHODS:
        actor = compose_recipe(setup, method, list(overrides), config_dir).actor_rollout_ref.actor
        if region(method) == "ratio":
            low = float(actor.get("clip_ratio_low") or actor.clip_ratio)
            found[method] = (low, float(actor.get("clip_ratio_high") or actor.clip_ratio))
        else:
            options = resolve_options(actor, True)
            found[method] = (float(options.delta_low), float(options.delta_high))
    return found


def _labels(setup: str, config_dir: list, overrides: list) -> tuple[dict[str, tuple], str, list]:
    """The trainer dtypes to measure (fp32 and bf16 for a CPU setup, the setup's own dtype elsewhere), the rollout
    engine as the runs use it, and the runs' batch: a CPU setup's step samples CPU_PROMPTS prompts (unless the
    command line says otherwise), a cluster setup's its own."""
    from verl_dppo.launch.compose import compose_recipe
    from verl_dppo.rehearsal.setups.cpu_engines import is_cpu_run

    config = compose_recipe(setup, "dppo_topk_tv", overrides, config_dir)
    rollout = config.actor_rollout_ref.rollout
    engine = f"{rollout.name} ({rollout.get('dtype')})"
    if not is_cpu_run(config):
        return {"trainer": ()}, engine, []
    chosen = any(override.lstrip("+").startswith("data.train_batch_size=") for override in overrides)
    return dict(CPU_TRAINER_DTYPES), engine, [] if chosen else [f"data.train_batch_size={CPU_PROMPTS}"]


def _launch(
    setup: str, label: str, extra: tuple, out: Path, overrides: list, config_dir: Sequence[str] = ()
) -> tuple[str, float]:
    """One step of the setup through `verl-dppo run`, the worker writing its tokens to out/tokens/label (emptied
    first: an earlier measurement's files are never merged into this one's), its console to out/runs/label.log. The
    console names the log and says each phase as the launch reaches it; a launch that ends with its tokens leaves
    LAUNCHED beside them (the command and its seconds): the records are complete."""
    from verl_dppo.studies.launches import follow_launch
    from verl_dppo.plugin.mismatch_dump import ENV

    tokens = out / "tokens" / label
    shutil.rmtree(tokens, ignore_errors=True)
    arguments = [
        "run",
        setup,
        "--method",
        "dppo_topk_tv",
        *(f"--config-dir={folder}" for folder in config_dir),
        "trainer.total_training_steps=1",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.resume_mode=disable",
        # one update, on the policy that sampled: every token's pi is the sampling weights'
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=${data.train_batch_size}",
        f"trainer.experiment_name=mismatch-{setup}-{label}",
        f"trainer.default_local_dir={out / 'runs' / label}",
        f"++ray_kwargs.ray_init.runtime_env.env_vars.{ENV}={tokens}",
        *extra,
        *overrides,
    ]
    log = out / "runs" / f"{label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    _say(f"{label}: its console: {log}")
    start = time.monotonic()

    def on_phase(name: str) -> None:
        _say(f"{label}: {name}: {PHASES[name].format(label=label)} ({time.monotonic() - start:.0f} s in)")

    code = follow_launch([*LAUNCHER, *arguments], str(log), {**os.environ, ENV: str(tokens)}, on_phase)
    seconds = time.monotonic() - start
    if code != 0 or not any(tokens.glob("tokens-*.pt")):
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise UsageError(f"the {label} run exited {code} without the tokens (its log: {log}):\n{tail}")
    command = " ".join(["verl-dppo", *arguments])
    (tokens / LAUNCHED).write_text(json.dumps({"command": command, "seconds": round(seconds, 1)}))
    return command, seconds


def _say(line: str) -> None:
    print(f"verl-dppo: mismatch: {line}", file=sys.stderr, flush=True)


def _tokens(folder: Path) -> dict:
    """The run's token records, concatenated; the dtypes (one per run) as strings."""
    import torch

    try:
        parts = [torch.load(path) for path in sorted(folder.glob("tokens-*.pt"))]
    except Exception as error:  # a file cut short: torch's own message, on one line
        raise UsageError(
            f"cannot read the token records in {folder} ({_first_line(error)}): measure again with "
            f"`verl-dppo mismatch --out {folder.parent.parent}`"
        ) from None
    merged = {
        key: torch.cat([part[key] for part in parts])
        for key in parts[0]
        if all(key in p for p in parts) and torch.is_tensor(parts[0][key])
    }
    for key in ("mu_dtype", "pi_dtype"):
        found = {part.get(key) for part in parts}
        if len(found) == 1 and None not in found:
            merged[key] = found.pop()
    return merged


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _measured(out: Path, label: str, bounds: dict) -> tuple[list[dict], dict]:
    """A launch's rows and its run entry, from its records alone: what the live command and a redraw both report."""
    tokens = _tokens(out / "tokens" / label)
    launched = json.loads((out / "tokens" / label / LAUNCHED).read_text())
    run = {
        "command": launched["command"],
        "seconds": launched["seconds"],
        "tokens": int(tokens["mu"].numel()),
        "topk_mass_mean": float(tokens["topk_mass"].mean()) if "topk_mass" in tokens else None,
    }
    rows = bucket_rows(tokens, bounds)
    print(table(label, rows))
    print(f"({run['tokens']} tokens, {run['seconds']:.0f} s)\n", flush=True)
    return rows, run


def _write_outputs(out: Path, settings: dict, measured: dict[str, tuple[list, dict]]) -> None:
    """mismatch.json and mismatch.png with the launches measured so far; until the last, both say which are pending
    (the JSON's "partial" and "pending", the figure's title)."""
    pending = [label for label in settings["labels"] if label not in measured]
    results = {label: rows for label, (rows, _) in measured.items()}
    (out / "mismatch.json").write_text(
        json.dumps(
            {
                "setup": settings["setup"],
                "rollout": settings["rollout"],
                "buckets": list(BUCKETS),
                "thresholds": settings["thresholds"],
                "runs": {label: run for label, (_, run) in measured.items()},
                "rows": results,
                "partial": bool(pending),
                "pending": pending,
            },
            indent=1,
        )
    )
    _figure(results, out / "mismatch.png", settings["setup"], settings["rollout"], pending)
    note = f" (partial: trainer {', '.join(pending)} not measured yet)" if pending else ""
    _say(f"wrote {out / 'mismatch.json'} and {out / 'mismatch.png'}{note}")


def _figure(results: dict, path: Path, setup: str, engine: str, pending: Sequence[str] = ()) -> None:
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
    title = f"{setup}: the same weights in the rollout engine, {engine} (mu), and the trainer (pi)"
    if pending:
        title += f"\npartial: trainer {', '.join(pending)} not measured yet"
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def cmd_mismatch(args) -> int:
    from verl_dppo.launch.recipe_files import setup_and_overrides

    if args.redraw is not None:
        if args.setup is not None or args.overrides or args.config_dir:
            raise UsageError(
                "--redraw draws DIR's records as they were measured: give no setup, overrides or --config-dir with it"
            )
        return redraw(Path(args.redraw))
    args.setup, args.overrides = setup_and_overrides(args.setup or "smollm2", args.overrides, "smollm2")
    out = Path(writable_folder(args.out, "--out")).resolve()
    labels, engine, batch = _labels(args.setup, args.config_dir, args.overrides)
    bounds = thresholds(args.setup, args.config_dir, args.overrides)
    # an earlier measurement's outputs and records in DIR are never read as this one's
    for stale in (out / "mismatch.json", out / "mismatch.png", out / "tokens" / SETTINGS):
        stale.unlink(missing_ok=True)
    for label in labels:
        shutil.rmtree(out / "tokens" / label, ignore_errors=True)
    (out / "tokens").mkdir(parents=True, exist_ok=True)
    (out / "tokens" / SETTINGS).write_text(
        json.dumps({"setup": args.setup, "rollout": engine, "thresholds": bounds, "labels": list(labels)}, indent=1)
    )
    settings = _settings(out)  # as a redraw reads them: the same JSON, byte for byte
    measured: dict[str, tuple[list, dict]] = {}
    for label, extra in labels.items():
        _say(f"sampling with {engine}, scoring with the trainer ({label})...")
        try:
            _launch(args.setup, label, extra, out, [*batch, *args.overrides], args.config_dir)
        except UsageError as error:
            if not measured:
                raise
            first, _, rest = str(error).partition("\n")
            raise UsageError(
                f"{first.rstrip(':')}; {out / 'mismatch.json'} and mismatch.png keep what was measured "
                f"({', '.join(measured)}):\n{rest}"
            ) from None
        measured[label] = _measured(out, label, settings["thresholds"])
        _write_outputs(out, settings, measured)  # what is measured stays, whatever happens to the next launch
    return 0


def _settings(folder: Path) -> dict:
    try:
        settings = json.loads((folder / "tokens" / SETTINGS).read_text())
        list(settings["labels"]), settings["setup"], settings["rollout"], dict(settings["thresholds"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(
            f"--redraw {folder}: no token records of a `verl-dppo mismatch` here "
            f"({folder / 'tokens' / SETTINGS} is missing or unreadable): measure with "
            f"`verl-dppo mismatch --out {folder}`"
        ) from None
    return settings


def redraw(folder: Path) -> int:
    """The table, mismatch.json and mismatch.png again from the records a complete measurement left in the folder,
    launching nothing: the same JSON, byte for byte, as the measurement wrote."""
    if not folder.is_dir():
        raise UsageError(f"--redraw {folder}: no such folder; give the --out folder of a `verl-dppo mismatch`")
    settings = _settings(folder)
    labels = settings["labels"]
    for label in labels:
        records = folder / "tokens" / label
        if not (records / LAUNCHED).is_file() or not any(records.glob("tokens-*.pt")):
            done = [other for other in labels if (folder / "tokens" / other / LAUNCHED).is_file()]
            raise UsageError(
                f"--redraw {folder}: the token records are incomplete: the {label} launch did not end "
                f"with its tokens (no {records / LAUNCHED}); measure again with `verl-dppo mismatch --out "
                f"{folder}`" + (f" (mismatch.json holds what ended: {', '.join(done)})" if done else "")
            )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--redraw {folder}: the folder is not writable; copy it somewhere writable and redraw there")
    measured = {label: _measured(folder, label, settings["thresholds"]) for label in labels}
    _write_outputs(folder, settings, measured)
    return 0


def add_command(commands) -> None:
    from verl_dppo.launch.commands import IntermixedParser

    parser = commands.add_parser(
        "mismatch",
        help="the paper's Figure 2 for a setup: the same weights in the rollout engine and the trainer",
        description=(__doc__ or "").split("\n\n")[1].replace("\n", " "),
    )
    parser.__class__ = IntermixedParser  # options and overrides in any order, as `verl-dppo run` takes them
    parser.add_argument(
        "setup",
        nargs="?",
        default=None,
        help="the setup whose model and engines to measure (default: smollm2, the real model on CPU)",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="folder for mismatch.json, mismatch.png and the token files")
    where.add_argument(
        "--redraw",
        metavar="DIR",
        help="launch nothing: the table, mismatch.json and mismatch.png again from the token records "
        "a complete measurement left in DIR (its --out)",
    )
    parser.add_argument(
        "--config-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="your own setups and methods, as for `verl-dppo run`",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the runs, e.g. data.train_batch_size=16")
    parser.set_defaults(handler=cmd_mismatch)
