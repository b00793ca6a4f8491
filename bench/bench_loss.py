"""Forward + backward time of the DPPO losses against verl's own `vanilla` PPO loss on the same tensors.

    .venv/bin/python bench/bench_loss.py [--batch 64] [--length 4096] [--repeats 15]

Runs the registered functions as verl's ppo_loss calls them (token-mean, a real ActorConfig), interleaving the
modes each repeat so machine noise hits them alike, and prints the median time and its ratio to vanilla.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import verl  # noqa: F401  (loads the plugin)
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import ActorConfig

from verl_dppo import DPPOLossConfig

MODES = ("vanilla", "dppo_binary_tv", "dppo_binary_kl", "grpo_clip", "pg_is")


def make_config(mode: str) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_high=0.28,
        policy_loss=DPPOLossConfig(loss_mode=mode, delta_low=0.15, delta_high=0.15, ratio_cap=10000.0),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.length)
    old = torch.log(torch.rand(shape, generator=gen).clamp(min=1e-6))
    logp = (old + 0.1 * torch.randn(shape, generator=gen)).clamp(max=0.0)
    adv = torch.randn(shape, generator=gen)
    mask = torch.rand(shape, generator=gen) < 0.9
    configs = {mode: make_config(mode) for mode in MODES}
    times = {mode: [] for mode in MODES}

    def step(mode: str) -> float:
        leaf = logp.clone().requires_grad_()
        start = time.perf_counter()
        loss, _ = get_policy_loss_fn(mode)(old, leaf, adv, mask, "token-mean", configs[mode])
        loss.backward()
        return time.perf_counter() - start

    for mode in MODES:  # warm-up
        step(mode)
    for _ in range(args.repeats):
        for mode in MODES:
            times[mode].append(step(mode))

    base = statistics.median(times["vanilla"])
    print(
        f"B={args.batch} T={args.length} threads={torch.get_num_threads()} repeats={args.repeats} "
        f"(forward+backward, median)"
    )
    for mode in MODES:
        median = statistics.median(times[mode])
        print(f"  {mode:<16} {median * 1e3:8.1f} ms   {median / base:5.2f}x vanilla")


if __name__ == "__main__":
    main()
