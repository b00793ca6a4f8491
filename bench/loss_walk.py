"""The reader's walk of one loss mode: the plugin's files one call runs through, from the config to the masked loss.

    .venv/bin/python bench/loss_walk.py [--mode dppo_binary_tv] [--delta 0.15] [--trace]

Builds the mode's `DPPOLossConfig` (the paper's settings: delta on both sides, no cap) inside a real verl `ActorConfig`
and calls verl's own `ppo_loss` on a v1 micro-batch (as verl's FSDP engine hands it over), with a tracer on every line
the plugin and its patches run (verl_dppo/, patches/). Prints the files in the order the walk first enters them, each
with its length in lines, the total, the lines of the functions that ran in each (from each `def` to its last line,
docstring included: what a reader opens of that file), and the returns: how often the walk comes back into a file it had
left for another of the plugin's files (calls into torch or verl and back do not count), and how many of those are
distinct (a return from one function into another counted once, however often a loop repeats it). --trace prints the
walk itself, one line per change of file. This is the figure docs/loss-modes.md and issue 74 quote: how many files, how
many lines a reader opens to follow a mode, and how often the path doubles back.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import verl  # noqa: E402,F401  (loads the plugin through the verl.plugins entry point)
from helpers import v1_micro_batch  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from verl_dppo import DPPOLossConfig  # noqa: E402

OURS = tuple(str(ROOT / part) + "/" for part in ("verl_dppo", "patches"))
FUNCTIONS: list[tuple[str, str]] = []
"""(file, function) at each change of file, beside `walk`'s files: the distinct returns count each call site once."""
RAN: dict[str, set] = {}
"""file -> the code objects of the plugin's that ran a line: the functions a reader of the walk reads."""


def micro_batch():
    gen = torch.Generator().manual_seed(0)
    lens = [6, 3, 5, 1]
    mu = torch.log(torch.rand(len(lens), 6, generator=gen).clamp(min=1e-4))
    pi = (mu + 0.5 * torch.randn(mu.shape, generator=gen)).clamp(max=-1e-4).requires_grad_()
    adv = torch.randn(mu.shape, generator=gen)
    return v1_micro_batch(pi, mu, adv, lens, rollout_log_prob=mu)


def walk(mode: str, delta: float) -> list[str]:
    """The plugin's files in the order the lines run (one entry per change of file)."""
    visits: list[str] = []

    def local(frame, event, arg):
        if event == "line":
            name = frame.f_code.co_filename
            RAN.setdefault(name, set()).add(frame.f_code)
            if not visits or visits[-1] != name:
                visits.append(name)
                FUNCTIONS.append((name, frame.f_code.co_name))
        return local

    def tracer(frame, event, arg):
        code = frame.f_code  # a module's body (an import the first call makes) is not the mode's path
        return local if code.co_filename.startswith(OURS) and code.co_name != "<module>" else None

    model_output, data, _ = micro_batch()
    sys.settrace(tracer)
    try:
        config = ActorConfig(
            strategy="fsdp",
            rollout_n=1,
            ppo_micro_batch_size_per_gpu=4,
            clip_ratio_high=0.28,
            policy_loss=DPPOLossConfig(loss_mode=mode, delta_low=delta, delta_high=delta, ratio_cap=10000.0),
        )
        loss, _ = ppo_loss(config, model_output, data)
    finally:
        sys.settrace(None)
    loss.backward()
    return visits


def function_lines(codes) -> int:
    """The lines of a file's functions that ran (each from its `def` to its last line; a function nested in one that
    ran counted once): what a reader opens of that file, as against its length."""
    spans = sorted((code.co_firstlineno, max(line for _, _, line in code.co_lines() if line)) for code in codes)
    covered, reach = 0, 0
    for first, last in spans:  # spans nest or are apart (a function lies within another or beside it)
        if last > reach:
            covered, reach = covered + last - first + 1, last
    return covered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", default="dppo_binary_tv")
    parser.add_argument("--delta", type=float, default=0.15, help="delta_low = delta_high (the paper's 0.15)")
    parser.add_argument("--trace", action="store_true", help="print the walk, one line per change of file")
    args = parser.parse_args()
    visits = walk(args.mode, args.delta)
    if args.trace:
        for name in visits:
            print("  ", Path(name).relative_to(ROOT))
    files = list(dict.fromkeys(visits))
    returns = len(visits) - len(files)
    total = ran = 0
    for name in files:
        lines, read = len(Path(name).read_text().splitlines()), function_lines(RAN[name])
        total, ran = total + lines, ran + read
        print(f"{lines:6d} {read:5d}  {Path(name).relative_to(ROOT)}  (entered {visits.count(name)}x)")
    seen, distinct = set(), set()
    for (left, left_fn), (into, into_fn) in zip(FUNCTIONS, FUNCTIONS[1:]):
        if into in seen:
            distinct.add((left, left_fn, into, into_fn))
        seen.add(left)
    print(
        f"{args.mode}: {len(files)} files, {total} lines, {returns} returns into a file already left "
        f"({len(distinct)} distinct: a call site counted once however often a loop makes it); "
        f"{ran} lines in the functions that ran (the second column: each from its def to its last line)"
    )


if __name__ == "__main__":
    main()
