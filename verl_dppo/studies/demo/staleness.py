"""`verl-dppo staleness`: the demo's methods trained with a rollout engine 0, 1, 2, 4 and 8 versions stale (issue 14.6).

A version is the learner's weights after that many RL steps (0: the warm start). At RL step s the trainer holds
version s - 1 and, with a rollout lag L, the rollout engine samples with version max(0, s - 1 - L): every sample is
min(L, s - 1) versions stale, as in an asynchronous trainer whose rollouts run L weight pushes behind. The runs use
verl's bypass mode by default (old_log_probs = the stale rollout's log-probs, how the async recipes run): GRPO's clip
and PG-IS's ratio are pi / mu_stale and DPPO masks on D(mu_stale, pi). The row `dppo_binary_tv_recompute` anchors
the trust region on the learner's recompute instead (the decoupled variant, Sec. 5.2). Each micro-batch carries the
trainer's and the rollout's versions, so the plugin's own lag metrics (actor/dppo/lag_*) land in the logs.

Writes `<out>/<method>_lag<L>.jsonl` (verl file-logger format), `summary.json`, a method x lag table and
reward_vs_lag.png, masked_vs_lag.png, collapse_vs_lag.png and staleness.png (the three panels side by side).
See docs/staleness.md for one run and what it shows.
"""

from __future__ import annotations

DEFAULT_LAGS = (0, 1, 2, 4, 8)
DEFAULT_STEPS = 100


def add_command(commands) -> None:
    from verl_dppo.studies.demo import add_parser, add_process_options, add_training_options
    from verl_dppo.studies.demo.methods import METHODS, STUDY_METHODS

    parser, defaults = add_parser(
        commands,
        "staleness",
        "CPU staleness study: each demo method with rollouts 0-8 versions stale; reward, masking, collapse vs lag",
        "Train each demo method (and DPPO anchored on the recompute) with a rollout engine that lags the learner "
        "by each of --lags versions, in verl's bypass mode; write verl-format logs, a table and figures against "
        "the lag to --out. Seeded; about 12-16 minutes on 2 cores with the defaults (40 runs).",
    )
    parser.add_argument(
        "--lags",
        default=",".join(map(str, DEFAULT_LAGS)),
        metavar="L,L",
        help="rollout lags in versions (RL steps), comma-separated (default: %(default)s)",
    )
    add_training_options(parser, defaults, DEFAULT_STEPS, (*METHODS, *STUDY_METHODS), "run")
    parser.add_argument(
        "--no-bypass",
        action="store_true",
        help="old_log_probs = the learner's recompute instead of the rollout's (verl's bypass_mode=False)",
    )
    add_process_options(parser, defaults, "run")
    parser.set_defaults(handler=_handler)


def parse_lags(text: str) -> list[int]:
    """`--lags 0,1,2`: distinct non-negative integers in the order given; UsageError otherwise."""
    from verl_dppo.errors import UsageError

    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise UsageError(f"--lags {text!r}: name at least one lag, e.g. --lags 0,1,2,4,8")
    lags = []
    for item in items:
        try:
            lag = int(item)
        except ValueError:
            raise UsageError(f"--lags: {item!r} is not a whole number of versions") from None
        if lag < 0:
            raise UsageError(f"--lags: {lag} is negative; a rollout cannot be ahead of the learner")
        if lag in lags:
            raise UsageError(f"--lags: {lag} is named twice")
        lags.append(lag)
    return lags


def base_settings():
    """The DemoSettings the flags start from (tests shrink them)."""
    from verl_dppo.studies.demo.settings import DemoSettings

    return DemoSettings()


def _handler(args) -> int:
    import sys
    from dataclasses import replace

    from verl_dppo.studies.demo.settings import check_settings
    from verl_dppo.errors import UsageError, writable_folder

    lags = parse_lags(args.lags)
    methods = [name.strip() for name in args.methods.split(",") if name.strip()]
    settings = replace(
        base_settings(),
        steps=args.steps,
        seed=args.seed,
        lr=args.lr,
        mini_batches=args.mini_batches,
        methods=methods,
        workers=args.workers,
        bypass=not args.no_bypass,
        version_fields=True,
    )
    check_settings(settings)
    out_dir = writable_folder(args.out, "--out")
    progress = not args.no_progress and sys.stdout.isatty()
    try:
        return run_study(settings, lags, out_dir, progress=progress)
    except (ValueError, RuntimeError) as error:  # settings or warm-up problems: one line, the setting to change
        raise UsageError(f"staleness: {error}") from None


def run_name(method: str, lag: int) -> str:
    return f"{method}_lag{lag}"


def run_study(settings, lags: list[int], out_dir: str, progress: bool = True, stream=None) -> int:
    import os
    import sys
    import time
    from dataclasses import replace

    from verl_dppo.studies.demo.methods import METHODS, STUDY_METHODS, runnable_methods
    from verl_dppo.studies.demo.runner import finish, pin_cpu_code_paths, run_jobs, warm_up, write_summary

    pin_cpu_code_paths()
    from verl_dppo.studies.demo.staleness_figures import draw_study

    stream = stream if stream is not None else sys.stdout
    start = time.perf_counter()
    methods = runnable_methods(settings.methods or None, default=(*METHODS, *STUDY_METHODS))
    warm, warm_path = warm_up(
        settings,
        methods,
        out_dir,
        progress,
        stream,
        f"verl-dppo staleness: {len(methods)} methods x lags {','.join(map(str, lags))} x {settings.steps} steps, "
        f"bypass mode {'on' if settings.bypass else 'off'}",
    )
    jobs = [
        (run_name(m.name, lag), m.name, replace(settings, rollout_lag=lag).to_dict(), warm_path, out_dir)
        for m in methods
        for lag in lags
    ]
    results = run_jobs(jobs, settings.steps, settings.workers, progress, stream)
    for job, result in zip(jobs, results):
        result["lag"] = job[2]["rollout_lag"]
        if "error" not in result:
            result.update(logged_lag(os.path.join(out_dir, f"{job[0]}.jsonl")))

    def outputs(good: list[dict]) -> list[str]:
        figures = draw_study(out_dir, good, lags)
        write_summary(out_dir, settings, warm, results, time.perf_counter() - start, lags=lags)
        return [
            study_table(good, lags),
            "figures: " + ", ".join(os.path.basename(f) for f in figures),
            f"logs (verl file-logger format): {len(good)} files <method>_lag<L>.jsonl",
        ]

    return finish(results, outputs, start, stream)


def logged_lag(path: str) -> dict:
    """What the plugin logged about the lag: the mean of actor/dppo/lag_mean over the run's steps."""
    from verl_dppo.studies.plot import load_run

    values = list(load_run(path).series.get("actor/dppo/lag_mean", {}).values())
    return {"logged_lag_mean": sum(values) / len(values) if values else None}


def study_table(results: list[dict], lags: list[int]) -> str:
    """Method x lag, markdown: final reward, masked fraction (actor/pg_clipfrac, mean over the run), collapsed."""
    by_run = {(r["method"], r["lag"]): r for r in results}
    methods = list(dict.fromkeys(r["method"] for r in results))
    first = results[0]
    lines = [
        f"final reward (last {first['final_window']} steps; start {first['initial_reward']:.2f}) / masked fraction "
        f"/ collapsed (a {first['collapse_window']}-step mean below half the start)",
        "",
        "| method | " + " | ".join(f"lag {lag}" for lag in lags) + " |",
        "|---|" + "---|" * len(lags),
    ]
    for method in methods:
        cells = []
        for lag in lags:
            r = by_run.get((method, lag))
            cells.append(
                "failed"
                if r is None
                else f"{r['final_reward']:.2f} / {r['masked_frac']:.1%} / " + ("**YES**" if r["collapsed"] else "no")
            )
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
