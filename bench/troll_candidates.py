"""How many candidates TROLL's threshold kernels hand to torch per row (verl_dppo.math.troll_support.support_by_kernel).

    .venv/bin/python bench/troll_candidates.py [--n 512] [--vocab 151936] [--k 64]

`top_threshold` puts the threshold t at the (k + 1)-th largest of the 1,024 lanes' maxima (lane = column mod 1,024),
and `sum_exp_below` writes out every column with a logit >= t: at least k + 1, a few more where two of pi's top
tokens share a lane or tie. A row with more than the room (max(256, 4 (k + 1)) ids) is read again with torch's
top-k. This computes the same rule with torch on CPU (the kernels' own agreement is tests/test_kernels.py) for three
kinds of bf16 rows at Qwen3's vocabulary:
- body: gpu_suite's inputs, N(0, 2^2) logits (bench_topk.make_inputs);
- peaked: one token at probability 1 - 1e-6, the body below it, 1/8 of the vocabulary 100 nats down;
- coarse: the body rounded to multiples of 0.5 (a few dozen distinct values: ties at every threshold).
Prints, per kind, the candidates per row (min / median / max) and the share of rows read again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_topk import make_inputs  # noqa: E402
from verl_dppo.math.kernels import LANES  # noqa: E402
from verl_dppo.math.troll_support import CANDIDATE_ROOM  # noqa: E402


def candidates(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, how many columns lie at or above the (k + 1)-th largest lane max (the kernels' rule)."""
    n, vocab = logits.shape
    padded = torch.full((n, -(-vocab // LANES) * LANES), float("-inf"))
    padded[:, :vocab] = logits.float()
    lane_max = padded.view(n, -1, LANES).amax(dim=1)
    threshold = lane_max.topk(k + 1, dim=1).values[:, -1]
    return (logits.float() >= threshold[:, None]).sum(dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--k", type=int, default=64, help="TROLL's K for pi (default 64)")
    args = parser.parse_args()
    torch.manual_seed(0)
    body = make_inputs(args.n, args.vocab, 20, torch.device("cpu"))[0].float()
    peaked = body.clone()
    peaked[:, : args.vocab // 8] -= 100.0
    rest = torch.logsumexp(peaked, dim=1)
    peaked[:, -1] = rest + torch.log(torch.tensor((1 - 1e-6) / 1e-6))  # p(top) = 1 - 1e-6 against the rest
    coarse = (body * 2).round() / 2
    room = max(CANDIDATE_ROOM, 4 * (args.k + 1))
    print(
        f"N = {args.n} rows, V = {args.vocab:,}, bf16, K = {args.k}: pi's top {args.k + 1} by the lanes' threshold, "
        f"room {room} a row"
    )
    print("| rows | candidates per row: min | median | max | rows read again by torch's top-k |")
    print("|---|---|---|---|---|")
    for name, rows in (("body N(0, 4)", body), ("peaked (1 - 1e-6)", peaked), ("coarse (multiples of 0.5)", coarse)):
        count = candidates(rows.to(torch.bfloat16), args.k)
        crowded = int((count > room).sum())
        print(
            f"| {name} | {int(count.min())} | {int(count.median())} | {int(count.max())} | "
            f"{crowded} of {args.n} ({crowded / args.n:.1%}) |"
        )


if __name__ == "__main__":
    main()
