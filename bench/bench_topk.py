"""Benchmark of the Top-K divergence (Eq. 15/16) and of the vLLM top-K extraction.

    .venv/bin/python bench/bench_topk.py                     # N=2048, V=151,936 (Qwen3's vocabulary), bf16, CPU
    .venv/bin/python bench/bench_topk.py --device cuda --n 16384

Part 1, `topk_divergence` against the naive `log_softmax(logits.float())` + gather (the straightforward
implementation), same inputs, same run: extra peak memory as a fraction of the logits tensor (target <= 0.25x, ideally 0.1x) and
time (target <= 1x the naive baseline). On CPU the peak is the process's resident-set high-water mark, reset before
each measurement (/proc/self/clear_refs); on CUDA, torch.cuda.max_memory_allocated.

Part 2, the vectorised extraction of K ids/log-probs per generated token from vLLM-shaped `logprobs` (a list of
{token_id: Logprob(logprob, rank, decoded_token)} dicts) against a per-token loop that sorts each dict by rank
(target >= 5x).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import time
from pathlib import Path

import torch

from verl_dppo.math.topk import topk_divergence


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.M)
    return int(match.group(1)) * 1024


class PeakMemory:
    """Extra peak memory of a block, in bytes (CUDA allocator, or the CPU process's RSS high-water mark)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.extra = 0

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # reset VmHWM to the current RSS
            self.base = _rss_bytes("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.extra = torch.cuda.max_memory_allocated() - self.base
        else:
            self.extra = _rss_bytes("VmHWM") - self.base


def naive(logits, topk_ids, sampled_ids):
    """What the reference fork does: a full-vocabulary fp32 log-softmax, then gather."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(1, topk_ids), logp.gather(1, sampled_ids.unsqueeze(1))


def timed(fn, device, repeat):
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
        del out
    return best


def bench_divergence(n: int, vocab: int, k: int, device: torch.device, repeat: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(n, vocab, generator=generator) * 2).to(device=device, dtype=torch.bfloat16)
    mu_logits = logits.float() + 0.1 * torch.randn(n, vocab, generator=generator).to(device)
    mu_logp = torch.log_softmax(mu_logits, dim=-1)
    topk_lp, topk_ids = mu_logp.topk(k, dim=-1)
    sampled_ids = torch.multinomial(mu_logp.exp(), 1).squeeze(1)
    sampled_lp = mu_logp.gather(1, sampled_ids.unsqueeze(1)).squeeze(1)
    del mu_logits, mu_logp
    logits_bytes = logits.numel() * logits.element_size()

    def ours():
        return topk_divergence(logits, topk_ids, topk_lp, sampled_ids, sampled_lp)

    def baseline():
        return naive(logits, topk_ids, sampled_ids)

    ours()  # warm-up (allocator, kernels)
    baseline()
    with PeakMemory(device) as mem_naive:
        baseline()
    with PeakMemory(device) as mem_ours:
        ours()
    t_naive = timed(baseline, device, repeat)
    t_ours = timed(ours, device, repeat)
    result = {
        "device": str(device),
        "N": n,
        "V": vocab,
        "K": k,
        "dtype": "bfloat16",
        "logits_MiB": logits_bytes / 2**20,
        "naive_extra_peak_MiB": mem_naive.extra / 2**20,
        "topk_extra_peak_MiB": mem_ours.extra / 2**20,
        "topk_extra_peak_x_logits": mem_ours.extra / logits_bytes,
        "naive_extra_peak_x_logits": mem_naive.extra / logits_bytes,
        "naive_s": t_naive,
        "topk_s": t_ours,
        "time_ratio_topk_over_naive": t_ours / t_naive,
    }
    if device.type == "cuda":
        result["topk_bandwidth_GBps"] = logits_bytes / t_ours / 1e9
    return result


def bench_extraction(tokens: int, k: int, repeat: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the vLLM-shaped fixtures
    from vllm_fixtures import flat_from_dicts, per_token_loop_vllm_topk, vllm_shaped_logprobs

    from verl_dppo.patches.vllm_async_server import extract_vllm_topk

    logprobs, token_ids = vllm_shaped_logprobs(tokens, k, vocab=151_936, seed=0)
    flat = flat_from_dicts(logprobs, token_ids, k)
    cpu = torch.device("cpu")
    slow = timed(lambda: per_token_loop_vllm_topk(logprobs, token_ids, k), cpu, repeat)
    fast_dict = timed(lambda: extract_vllm_topk(logprobs, token_ids, k), cpu, repeat)
    fast_flat = timed(lambda: extract_vllm_topk(flat, token_ids, k), cpu, repeat)
    ids_b, lp_b = per_token_loop_vllm_topk(logprobs, token_ids, k)
    same = all(
        bool((ids == ids_b).all() and (lps == lp_b).all())
        for ids, lps in (extract_vllm_topk(logprobs, token_ids, k), extract_vllm_topk(flat, token_ids, k))
    )
    return {
        "tokens": tokens,
        "K": k,
        "per_token_loop_s (dict positions)": slow,
        "vectorised_s (dict positions)": fast_dict,
        "vectorised_s (FlatLogprobs)": fast_flat,
        "speedup (dict positions)": slow / fast_dict,
        "speedup (FlatLogprobs)": slow / fast_flat,
        "identical": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=8192, help="generated tokens for the extraction benchmark")
    parser.add_argument("--skip-extraction", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    results = {"divergence": bench_divergence(args.n, args.vocab, args.k, device, args.repeat)}
    if not args.skip_extraction:
        results["vllm_extraction"] = bench_extraction(args.tokens, args.k, args.repeat)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
