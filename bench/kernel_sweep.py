"""Where the GPU time of Top-K and TROLL goes, and the kernels' launch shapes (block, warps) on this GPU.

    python3 bench/kernel_sweep.py --out $OUT        # a GPU; about a minute after the inputs are drawn

N = 16,384 rows of Qwen3's 151,936-token vocabulary, bf16, as bench/gpu_suite.py. Prints and writes OUT/sweep.json:
- `max_and_sum_exp_outside` for each (BLOCK, num_warps), against one read of the logits, with Top-K's 21 slots and
  with TROLL's 130 candidate ids;
- `topk_divergence` whole, TROLL's forward, and its forward + backward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def timed(fn, repeats=3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)  # milliseconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=16_384)
    parser.add_argument("--vocab", type=int, default=151_936)
    args = parser.parse_args()
    from bench_topk import make_inputs
    from verl_dppo.math import kernels
    from verl_dppo.math.topk import topk_divergence
    from verl_dppo.math.troll import troll_token_loss, troll_token_terms

    device = torch.device("cuda")
    logits, ids, lps, sampled, sampled_lp, advantages = make_inputs(args.n, args.vocab, 64, device)
    ids20, lps20 = ids[:, :20].contiguous(), lps[:, :20].contiguous()
    slots = torch.cat([ids20, sampled[:, None]], dim=1)
    result = {"device": torch.cuda.get_device_name(), "one_read_ms": timed(lambda: logits.amax(dim=-1))}
    print(result, flush=True)
    sweep = {}
    for block in (1024, 2048, 4096):
        for warps in (4, 8, 16):
            sweep[f"{block}/{warps}"] = timed(
                lambda: kernels.max_and_sum_exp_outside(logits, slots, block=block, num_warps=warps)
            )
            print(block, warps, sweep[f"{block}/{warps}"], flush=True)
    result["sweep"] = sweep
    candidates = torch.cat([sampled[:, None], ids, logits.topk(65, dim=1).indices], dim=1)  # TROLL's 130 ids
    for block, warps in ((1024, 4), (2048, 8), (4096, 16)):
        result[f"troll_candidates_{block}/{warps}"] = timed(
            lambda: kernels.max_and_sum_exp_outside(
                logits, candidates, row_max=logits.amax(dim=-1).float(), block=block, num_warps=warps
            )
        )
        print(block, warps, "troll candidates", result[f"troll_candidates_{block}/{warps}"], flush=True)
    result["topk_divergence_ms"] = timed(lambda: topk_divergence(logits, ids20, lps20, sampled, sampled_lp))
    print(result, flush=True)

    x = logits.detach().requires_grad_()
    result["troll_forward_ms"] = timed(lambda: troll_token_terms(x, ids, lps, sampled, sampled_lp))

    def both():
        terms = troll_token_terms(x, ids, lps, sampled, sampled_lp)
        return torch.autograd.grad(troll_token_loss(terms, advantages).sum(), x)

    result["troll_forward_backward_ms"] = timed(both)
    print(result, flush=True)
    Path(args.out, "sweep.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
