"""How a bf16 log-softmax rounds a confident token's log-prob, on this machine's kernels (CPU, and CUDA where there is
a GPU), and what the binary divergences then say, raw and at the inputs' resolution (issue 34.2).

Rows as a real LLM's: a Qwen-sized vocabulary (151,936) of unit-normal logits with one dominant token whose lead is
drawn so that 1 - p spans 1e-5 to 0.3 (log-uniform). pi is the bf16 log-softmax of the bf16 logits (verl's log-prob
path without flash-attn's cross entropy, `logprobs_from_logits_v2`), mu the float32 log-softmax of the same bf16
logits (a rollout engine's: vLLM computes its log-probs in float32), so mu and pi are one policy: any divergence is
rounding. Printed per kernel: the share of rows whose log pi is exactly 0, the mean and max binary KL, and the share
of rows DPPO-Binary-KL (delta 0.05) and DPPO-Binary-TV (delta 0.15) would block, raw (before the fix) and at the
resolution (verl_dppo.math.divergence.within_rounding, what the loss now measures), and the bf16 kernel's largest
error as a share of the radius the loss allows it (`rounding_radius`: at most 1 if the radius bounds it).

    python bench/bf16_logprob_rounding.py [--rows 4096] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from verl_dppo.math.divergence import binary_kl, binary_tv, rounding_radius, within_rounding  # noqa: E402


def rows(n: int, vocab: int, device: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen)
    rest = torch.logsumexp(logits[:, 1:], dim=-1)  # the other tokens' log-mass
    complement = torch.exp(torch.empty(n).uniform_(math.log(1e-5), math.log(0.3), generator=gen))
    logits[:, 0] = rest + torch.log((1 - complement) / complement)  # p(token 0) = 1 - complement
    return logits.bfloat16().to(device)


def measure(device: str, n: int, vocab: int, shift: float) -> dict:
    """mu: float32 log-softmax of the bf16 logits; pi: the same logits with the dominant token's lead moved by
    `shift` (0: the same policy), scored in bf16 (what verl's path gives) and in float32 (the truth)."""
    logits = rows(n, vocab, device)
    mu = torch.log_softmax(logits.float(), dim=-1)[:, 0]
    moved = logits.clone()
    moved[:, 0] += shift
    pi_bf16 = torch.log_softmax(moved, dim=-1)[:, 0]  # bf16 arithmetic, bf16 result
    pi_true = torch.log_softmax(moved.float(), dim=-1)[:, 0]
    radius = rounding_radius(pi_bf16, pi_bf16.dtype)
    # the bf16 kernel's error against the float64 log-softmax of the same logits, as a share of the radius
    exact = torch.log_softmax(moved.double(), dim=-1)[:, 0]
    out = {
        "log_pi_zero": float((pi_bf16 == 0).float().mean()),
        "error_of_bound": float(((pi_bf16.double() - exact).abs() / radius.double()).max()),
    }
    resolved = within_rounding(mu, pi_bf16.float(), radius)
    for label, p in (("float32 pi", pi_true), ("bf16 pi raw", pi_bf16.float()), ("bf16 pi resolved", resolved)):
        kl, tv = binary_kl(mu, p), binary_tv(mu, p)
        out[label] = (float(kl.mean()), float((kl > 0.05).float().mean()), float((tv > 0.15).float().mean()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(
        f"torch {torch.__version__}"
        + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "")
        + f"; vocabulary {args.vocab}"
    )
    print(
        "| kernel | rows | pi vs mu | log pi = 0 (bf16) | bf16 error / radius (max) | pi scored in | binary KL mean |"
        " KL > 0.05 | TV > 0.15 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for device in devices:
        n = args.rows if device == "cuda" else min(args.rows, 1024)
        for shift, policy in ((0.0, "same policy"), (-3.0, "lead moved by -3")):
            m = measure(device, n, args.vocab, shift)
            for label in ("float32 pi", "bf16 pi raw", "bf16 pi resolved"):
                kl, blocked_kl, blocked_tv = m[label]
                print(
                    f"| {device} | {n} | {policy} | {m['log_pi_zero']:.3f} | {m['error_of_bound']:.3f} | {label} | "
                    f"{kl:.4g} | {blocked_kl:.3f} | {blocked_tv:.3f} |"
                )


if __name__ == "__main__":
    main()
