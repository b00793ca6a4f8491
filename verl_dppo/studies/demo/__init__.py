"""`verl-dppo demo`: a CPU-sized sanity test of the paper's claims (Sec. 4.2 and 5), in minutes.

A tiny random-init Qwen3-style LM is warm-started on a verifiable task (digit sums) until it solves 20-80% of its
training problems, then trained with RL by several methods side by side (same seed, same prompts): our loss
modes called through verl's own `ppo_loss`, verl's GRPO advantage estimator, a bf16 rollout copy as mu.
See docs/demo.md for what it shows and what it does not.

Modules: task (the digit-sum task), policy (model, bf16 rollout engine), warmup (supervised phase, sanity set),
methods (the compared loss modes), rl (one method's RL loop), figures, runner (processes, progress, table);
staleness and staleness_figures: `verl-dppo staleness`, the same loop with a rollout engine L versions stale.
"""

from __future__ import annotations


DEMO_MINUTES = "about 5 minutes"
"""`make demo`'s wall time on 2 cores (measured, docs/demo.md); the README and docs/demo.md state the same."""


def _handler(args) -> int:
    from verl_dppo.studies.demo.runner import main_from_args

    return main_from_args(args)


def add_command(commands) -> None:
    from verl_dppo.studies.demo.methods import METHODS

    parser, defaults = add_parser(
        commands,
        "demo",
        "CPU sanity test: PG-IS vs GRPO vs DPPO on a tiny LM, logs + figures in minutes",
        "Train a tiny LM with each method side by side on CPU and write verl-format logs, figures "
        f"and a table to --out. Seeded and reproducible; {DEMO_MINUTES} on 2 cores with the defaults "
        "(one seed), about that per seed with --seeds.",
    )
    add_training_options(parser, defaults, defaults.steps, METHODS, "method")
    parser.add_argument(
        "--seeds",
        default="",
        metavar="S,S",
        help="several seeds, e.g. 0,1,2: every method from each seed's own warm-up; the figures "
        "and the table give the mean and the spread (min-max) over the seeds (replaces --seed)",
    )
    parser.add_argument(
        "--rollout-precision",
        default=defaults.rollout_precision,
        choices=("bf16-emulated", "bf16", "fp32"),
        help="the rollout copy's arithmetic (bf16-emulated: fast on CPU; fp32: no mismatch)",
    )
    add_process_options(parser, defaults, "method")
    parser.set_defaults(handler=_handler)


def add_parser(commands, name: str, help: str, description: str):
    """The command's parser with its --out (default out/<name>), and the DemoSettings its defaults come from."""
    from verl_dppo.studies.demo.settings import DemoSettings

    parser = commands.add_parser(name, help=help, description=description)
    parser.add_argument("--out", default=f"out/{name}", help=f"output folder (default: out/{name})")
    return parser, DemoSettings()


def add_training_options(parser, defaults, steps: int, methods, unit: str) -> None:
    """--steps, --seed, --lr, --mini-batches, --methods: shared by `demo` and `staleness`."""
    from verl_dppo.studies.demo.methods import accepted_names

    parser.add_argument("--steps", type=int, default=steps, help=f"RL steps per {unit} ({steps})")
    parser.add_argument("--seed", type=int, default=defaults.seed, help=f"seed ({defaults.seed})")
    parser.add_argument("--lr", type=float, default=defaults.lr, help=f"RL learning rate ({defaults.lr:g})")
    parser.add_argument(
        "--mini-batches",
        type=int,
        default=defaults.mini_batches,
        help=f"optimizer updates per rollout batch ({defaults.mini_batches})",
    )
    parser.add_argument(
        "--methods",
        default="",
        metavar="A,B",
        help="comma-separated subset of: " + accepted_names(methods) + " (default: all); also any "
        "other loss mode of the plugin's that carries demo settings (LossMode.demo)",
    )


def add_process_options(parser, defaults, unit: str) -> None:
    """--workers, --no-progress: shared by `demo` and `staleness`."""
    parser.add_argument(
        "--workers",
        type=int,
        default=defaults.workers,
        help=f"{unit}s trained at once, one process each ({defaults.workers})",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help=f"no progress bars, one line per finished {unit} (the default when stdout is not a terminal)",
    )
