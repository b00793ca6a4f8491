"""Orchestration: warm-up once, train the methods in parallel processes, draw the figures, print the table."""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import sys
import time
import traceback
from dataclasses import replace
from typing import Optional, TextIO

from verl_dppo.rehearsal.isa import PINNED
from verl_dppo.studies.demo.settings import DemoSettings, check_settings, parse_seeds

_progress_queue = None


def _init_worker(queue) -> None:
    global _progress_queue
    _progress_queue = queue
    import torch

    # One thread per process: results do not depend on how many methods run at once.
    torch.set_num_threads(1)
    logging.getLogger("verl_dppo").setLevel(logging.ERROR)  # the resolved options are in the table instead


def _train_one(job: tuple) -> dict:
    run_name, method_name, settings_dict, warm_path, out_dir = job
    named = {"run": run_name} if run_name != method_name else {}  # the demo's rows stay as they were
    try:
        import torch

        from verl_dppo.studies.demo.methods import runnable_methods
        from verl_dppo.studies.demo.rl import train_method

        settings = DemoSettings(**settings_dict)
        (method,) = runnable_methods([method_name])
        warm = torch.load(warm_path, weights_only=False)

        def on_step(step: int, score: float) -> None:
            if _progress_queue is not None:
                _progress_queue.put((run_name, step, score))

        return {**train_method(method, settings, warm, out_dir, on_step, run_name=run_name), **named}
    except Exception as error:  # reported by the parent with the run's name
        return {
            "method": method_name,
            **named,
            "error": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc(),
        }


CPU_CODE_PATHS = PINNED
"""The CPU code paths the demo and the staleness study pin (verl_dppo.rehearsal.isa.PINNED: a value set in the shell wins)."""


def pin_cpu_code_paths() -> None:
    """Before the first torch operation of the process (torch reads both lazily); the spawned workers inherit them."""
    for name, value in CPU_CODE_PATHS.items():
        os.environ.setdefault(name, value)


def run_demo(
    settings: DemoSettings,
    out_dir: str,
    progress: bool = True,
    stream: Optional[TextIO] = None,
    seeds: Optional[list[int]] = None,
) -> int:
    """Warm up once per seed, train every method from each; with several seeds the runs are <method>_seed<S> and
    the figures and the table give the mean and the spread over the seeds."""
    stream = stream if stream is not None else sys.stdout  # read at call time: tests swap sys.stdout
    from verl_dppo.studies.demo.figures import draw_all
    from verl_dppo.studies.demo.methods import METHODS, mode_rows, runnable_methods

    pin_cpu_code_paths()
    start = time.perf_counter()
    seeds = seeds or [settings.seed]
    methods = runnable_methods(settings.methods or None, accepted=(*METHODS, *mode_rows()))
    warms, jobs = {}, []
    for seed in seeds:
        seeded = replace(settings, seed=seed)
        several = len(seeds) > 1
        warms[seed], warm_path = warm_up(
            seeded,
            methods,
            out_dir,
            progress,
            stream,
            f"verl-dppo demo: {len(methods)} methods x {settings.steps} steps",
            f"warmup_seed{seed}.pt" if several else "warmup.pt",
        )
        jobs += [
            (f"{m.name}_seed{seed}" if several else m.name, m.name, seeded.to_dict(), warm_path, out_dir)
            for m in methods
        ]
    results = run_jobs(jobs, settings.steps, settings.workers, progress, stream)

    def outputs(good: list[dict]) -> list[str]:
        figures = draw_all(out_dir, good)
        write_summary(
            out_dir,
            settings,
            warms if len(seeds) > 1 else warms[seeds[0]],
            results,
            time.perf_counter() - start,
            seeds=seeds,
        )
        return [
            table(good, settings) if len(seeds) == 1 else seeds_table(good, seeds),
            "figures: " + ", ".join(os.path.basename(f) for f in figures),
            f"logs (verl file-logger format): {', '.join(r.get('run', r['method']) + '.jsonl' for r in good)} "
            f"(`verl-dppo plot {out_dir} -o FIG.png` draws them all)",
        ]

    return finish(results, outputs, start, stream)


def finish(results: list[dict], outputs, start: float, stream: TextIO) -> int:
    """Print what `outputs(successful results)` writes (figures, summary) and returns (table and file lines), then
    every failure with its traceback on stderr and the total time; exit code 1 if any run failed."""
    failed = [r for r in results if "error" in r]
    good = [r for r in results if "error" not in r]
    if good:
        for line in outputs(good):
            print(line, file=stream)
    for result in failed:
        print(
            f"{result.get('run', result['method'])} FAILED: {result['error']}\n{result['traceback']}", file=sys.stderr
        )
    print(f"total time {time.perf_counter() - start:.0f} s", file=stream)
    return 1 if failed else 0


def warm_up(
    settings: DemoSettings,
    methods,
    out_dir: str,
    progress: bool,
    stream: TextIO,
    header: str,
    file_name: str = "warmup.pt",
):
    """Check every method's batch sizes, print the run's header, warm-start once and save it for the workers.
    Returns (warm, path of the saved warm start)."""
    import torch
    from tqdm import tqdm

    from verl_dppo.studies.demo.methods import actor_config
    from verl_dppo.studies.demo.warmup import warm_start

    for method in methods:  # batch-size problems surface here, before the warm-up, as one-line errors
        actor_config(
            method,
            settings.prompts_per_step,
            settings.samples_per_prompt,
            settings.mini_batches,
            settings.micro_batch_size,
            settings.lr,
            settings.grad_clip,
        )
    os.makedirs(out_dir, exist_ok=True)
    torch.set_num_threads(1)
    print(
        f"{header}, {settings.prompts_per_step} prompts x {settings.samples_per_prompt} samples, "
        f"{settings.mini_batches} mini-batch updates per step, lr {settings.lr:g}, "
        f"rollout {settings.rollout_precision}, seed {settings.seed} -> {out_dir}",
        file=stream,
    )

    warm_bar = tqdm(
        total=settings.warmup_max_steps, desc="warm-up (supervised)", disable=not progress, leave=False, file=stream
    )

    def warm_progress(step: int, accuracy: float) -> None:
        warm_bar.n = step
        warm_bar.set_postfix(sampled_acc=f"{accuracy:.2f}")

    warm = warm_start(
        settings.seed,
        settings.hidden_size,
        settings.num_layers,
        settings.rollout_precision,
        target_accuracy=settings.warmup_target,
        max_supervised_steps=settings.warmup_max_steps,
        n_train=settings.n_train,
        n_val=settings.n_val,
        progress=warm_progress,
    )
    warm_bar.close()
    print(
        f"warm-up: {warm.supervised_steps} supervised steps, sampled accuracy {warm.probe_accuracy:.2f}; "
        f"sanity set of {len(warm.train_problems)} problems solved {warm.train_success_rate:.0%} of the time "
        f"on average; {len(warm.val_problems)} held-out problems ({warm.seconds:.0f} s)",
        file=stream,
    )
    warm_path = os.path.join(out_dir, file_name)
    torch.save(warm, warm_path)
    return warm, warm_path


def run_jobs(jobs: list[tuple], steps: int, workers: int, progress: bool, stream: TextIO) -> list[dict]:
    """Train each job (run name, method name, settings dict, warm-up path, out dir) in a pool of `workers`
    processes, with a progress bar per run (or one line per finished run); returns the results in job order."""
    from tqdm import tqdm

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    width = max(15, *(len(job[0]) for job in jobs))
    bars = {
        job[0]: tqdm(
            total=steps, desc=f"{job[0]:<{width}}", position=i, disable=not progress, file=stream, mininterval=0.5
        )
        for i, job in enumerate(jobs)
    }
    workers = max(1, min(workers, len(jobs)))
    with context.Pool(workers, initializer=_init_worker, initargs=(queue,)) as pool:
        pending = [pool.apply_async(_train_one, (job,)) for job in jobs]
        reported: set[int] = set()
        while len(reported) < len(pending):
            _drain(queue, bars)
            for index, result in enumerate(pending):
                if index not in reported and result.ready():
                    reported.add(index)
                    _drain(queue, bars)
                    line = _finished_line(result.get())
                    if progress:
                        tqdm.write(line, file=stream)
                    else:
                        print(line, file=stream, flush=True)
            time.sleep(0.2)
        results = [result.get() for result in pending]
    for bar in bars.values():
        bar.close()
    return results


def _finished_line(result: dict) -> str:
    """One line per finished method (what a log file gets instead of progress bars)."""
    name = result.get("run", result["method"])
    if "error" in result:
        return f"{name}: FAILED ({result['error']})"
    return (
        f"{name}: done, {result['steps']} steps in {result['seconds']:.0f} s, final reward "
        f"{result['final_reward']:.2f} (start {result['initial_reward']:.2f})"
        + (", collapsed" if result["collapsed"] else "")
    )


def _drain(queue, bars) -> None:
    import queue as queue_module

    while True:
        try:
            name, step, score = queue.get_nowait()
        except queue_module.Empty:
            return
        bar = bars[name]
        bar.update(step - bar.n)
        bar.set_postfix(reward=f"{score:.2f}", refresh=False)


def table(results: list[dict], settings: DemoSettings) -> str:
    """The final table, markdown so it pastes into a README."""
    lines = [
        f"| method | final reward (last {results[0]['final_window']} steps) | lowest "
        f"{results[0].get('collapse_window', 20)}-step reward | collapsed "
        "| masked fraction | blocked updates with mu < 0.2 | held-out accuracy | time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['method']} | {r['final_reward']:.2f} (start {r['initial_reward']:.2f}) | "
            f"{r['lowest_window_reward']:.2f} | {'YES' if r['collapsed'] else 'no'} | {r['masked_frac']:.2%} | "
            f"{_low_rate([r])} | {_held_out(r, 0):.2f} -> {_held_out(r, -1):.2f} | {r['seconds']:.0f} s |"
        )
    return "\n".join(lines)


def _low_rate(runs: list[dict]) -> str:
    """Blocked share of the updates on tokens with mu < 0.2, pooled over the runs."""
    low_bins = sum(1 for edge in runs[0]["prob_bins"][1:] if edge <= 0.2 + 1e-9)
    updates = sum(sum(r["updates_by_prob"][:low_bins]) for r in runs)
    blocked = sum(sum(r["blocked_by_prob"][:low_bins]) for r in runs)
    return f"{blocked / updates:.1%}" if updates else "n/a"


def _held_out(run: dict, index: int) -> float:
    """Greedy held-out accuracy at the run's first (index 0) or last (-1) validation."""
    return run["held_out_accuracy"][index][1] if run.get("held_out_accuracy") else math.nan


def seeds_table(results: list[dict], seeds: list[int]) -> str:
    """The final table over several seeds, per method: the mean and, in brackets, the lowest and highest seed."""

    def spread(values: list[float], digits: str = ".2f") -> str:
        return f"{sum(values) / len(values):{digits}} ({min(values):{digits}}-{max(values):{digits}})"

    first = results[0]
    lines = [
        f"mean over seeds {','.join(map(str, seeds))} (lowest-highest seed); start = warm-started training reward",
        "",
        f"| method | final reward (last {first['final_window']} steps) | lowest {first['collapse_window']}-step "
        "reward | collapsed | masked fraction | blocked updates with mu < 0.2 (pooled) | held-out accuracy at "
        "the start | held-out accuracy at the end | time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_method: dict[str, list[dict]] = {}
    for r in results:
        by_method.setdefault(r["method"], []).append(r)
    for method, runs in by_method.items():
        lines.append(
            f"| {method} | {spread([r['final_reward'] for r in runs])} (start "
            f"{spread([r['initial_reward'] for r in runs])}) | {spread([r['lowest_window_reward'] for r in runs])} "
            f"| {sum(r['collapsed'] for r in runs)} of {len(runs)} | "
            f"{spread([100 * r['masked_frac'] for r in runs], '.1f')} % | {_low_rate(runs)} | "
            f"{spread([_held_out(r, 0) for r in runs])} | {spread([_held_out(r, -1) for r in runs])} | "
            f"{sum(r['seconds'] for r in runs) / len(runs):.0f} s |"
        )
    return "\n".join(lines)


def write_summary(out_dir, settings, warm, results, seconds, **extra) -> None:
    """summary.json; `warm` is one WarmStart, or {seed: WarmStart} for several seeds."""
    import json

    def described(w) -> dict:
        return {
            "supervised_steps": w.supervised_steps,
            "probe_accuracy": w.probe_accuracy,
            "train_success_rate": w.train_success_rate,
            "n_train": len(w.train_problems),
            "n_held_out": len(w.val_problems),
        }

    summary = {
        "settings": settings.to_dict(),
        **extra,
        "warmup": (
            {str(seed): described(w) for seed, w in warm.items()} if isinstance(warm, dict) else described(warm)
        ),
        "methods": results,
        "seconds": seconds,
    }
    with open(os.path.join(out_dir, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=1)


def main_from_args(args) -> int:
    from verl_dppo.errors import UsageError, writable_folder

    methods = [name.strip() for name in args.methods.split(",") if name.strip()]
    seeds = parse_seeds(args.seeds) if args.seeds else [args.seed]
    settings = replace(
        DemoSettings(),
        steps=args.steps,
        seed=seeds[0],
        lr=args.lr,
        mini_batches=args.mini_batches,
        methods=methods,
        rollout_precision=args.rollout_precision,
        workers=args.workers,
    )
    for seed in seeds:
        check_settings(replace(settings, seed=seed))
    out_dir = writable_folder(args.out, "--out")
    # Bars only on a terminal: `make demo > log 2>&1` gets plain lines, not cursor escapes.
    progress = not args.no_progress and sys.stdout.isatty()
    try:
        return run_demo(settings, out_dir, progress=progress, seeds=seeds)
    except (ValueError, RuntimeError) as error:  # settings or warm-up problems: one line, the setting to change
        raise UsageError(f"demo: {error}") from None
