"""Benchmark of the Top-K divergence (Eq. 15/16) and of the vLLM top-K extraction.

    .venv/bin/python bench/bench_topk.py                     # N=2048, V=151,936 (Qwen3's vocabulary), bf16, CPU
    python3 bench/bench_topk.py --device cuda --n 16384 --skip-extraction

Part 1, the Top-K modes' per-token work against baselines on the same inputs, in the same run. Each method's extra
peak memory is measured in its own child process on CPU (peak_memory.py says why), in this process on CUDA (the
allocator's peak counter is exact there), as a fraction of the bf16 logits; its time is the median of interleaved
repeats in this process. The inputs are drawn on the device itself (on CUDA: a CUDA generator, seed 0).
  Forward (what the logits hook adds): `topk_divergence` against the naive `log_softmax(logits.float())` + gather
  (the straightforward implementation); target <= 0.25x the logits, ideally 0.1x, time <= 1x the naive one.
  Forward + backward to the logits (what a training step pays): `dppo_topk_*` = verl's `logprobs_from_logits_v2`
  (log pi(a_t) with gradient, the path verl takes without flash-attn) + `topk_divergence` (no gradient: it only
  masks), against `dppo_binary_*` = `logprobs_from_logits_v2` alone, and against the naive Top-K (a float32
  log-softmax, gathered at the top-K and a_t, log pi(a_t) with gradient). Any loss on the logits returns an [N, V]
  gradient: the figures are given with and without it.

Part 2, the vectorised extraction of K ids/log-probs per generated token from vLLM-shaped `logprobs` (a list of
{token_id: Logprob(logprob, rank, decoded_token)} dicts) against a per-token loop that sorts each dict by rank
(target >= 5x).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from peak_memory import PeakMemory, check_allocator, child_json  # the benchmarks' memory probe (same folder)
from verl_dppo.math.topk import topk_divergence


def make_inputs(n: int, vocab: int, k: int, device: torch.device):
    """Drawn on `device` by a generator of that device (seed 0): on CUDA at N=16,384 the [N, V] draws take well under
    a second there, against minutes on one CPU thread followed by a 5 GB copy. The CPU path draws what it always
    drew; the CUDA path draws other (equally distributed) numbers."""
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(n, vocab, generator=generator, device=device).mul_(2).to(dtype=torch.bfloat16)
    # In place: two [N, V] float32 tensors at a time here, not four (10 GB each at N=16,384); the same numbers.
    mu_logits = torch.randn(n, vocab, generator=generator, device=device).mul_(0.1).add_(logits.float())
    mu_logp = torch.log_softmax(mu_logits, dim=-1)
    del mu_logits
    topk_lp, topk_ids = mu_logp.topk(k, dim=-1)
    sampled_ids = torch.multinomial(mu_logp.exp(), 1, generator=generator).squeeze(1)
    sampled_lp = mu_logp.gather(1, sampled_ids.unsqueeze(1)).squeeze(1)
    advantages = torch.randn(n, generator=generator, device=device)
    del mu_logp
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the draws' temporaries (about 8x the logits) go back before anything is measured
    return [logits, topk_ids, topk_lp, sampled_ids, sampled_lp, advantages]


def methods(inputs) -> dict:
    """name -> (backward?, fn(logits) returning a loss or the forward's outputs)."""
    from verl.utils.torch_functional import logprobs_from_logits_v2

    _, topk_ids, topk_lp, sampled, sampled_lp, advantages = inputs

    def naive_gather(logits):  # the reference fork: a full-vocabulary fp32 log-softmax, then gather
        log_p = torch.log_softmax(logits.float(), dim=-1)
        return log_p.gather(1, topk_ids), log_p.gather(1, sampled[:, None]).squeeze(1)

    def naive_topk_loss(logits):
        _, log_pi = naive_gather(logits)
        return (log_pi * advantages).sum()

    def binary_loss(logits):
        return (logprobs_from_logits_v2(logits, sampled) * advantages).sum()

    def topk_loss(logits):
        topk_divergence(logits.detach(), topk_ids, topk_lp, sampled, sampled_lp)
        return binary_loss(logits)

    table = {
        "forward/naive_log_softmax_gather": (False, naive_gather),
        "forward/topk_divergence": (
            False,
            lambda logits: topk_divergence(logits, topk_ids, topk_lp, sampled, sampled_lp),
        ),
        "forward_backward/naive_topk": (True, naive_topk_loss),
        "forward_backward/dppo_binary": (True, binary_loss),
        "forward_backward/dppo_topk": (True, topk_loss),
    }
    assert tuple(table) == METHOD_NAMES
    return table


METHOD_NAMES = (
    "forward/naive_log_softmax_gather",
    "forward/topk_divergence",
    "forward_backward/naive_topk",
    "forward_backward/dppo_binary",
    "forward_backward/dppo_topk",
)


def run_once(fn, backward: bool, base: torch.Tensor, device: torch.device, memory: bool):
    """(extra peak bytes or None, seconds, whether the gradient is a tensor of its own) of one call."""
    logits = base.clone().requires_grad_(backward)
    probe = PeakMemory(device) if memory else None
    if probe is not None:
        probe.__enter__()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    if backward:
        (out,) = torch.autograd.grad(fn(logits), logits)
    else:
        out = fn(logits)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if probe is not None:
        probe.__exit__(None, None, None)
    del out, logits
    return (probe.extra if probe is not None else None), elapsed


def memory_of(args, name: str, inputs=None) -> dict:
    """One method's extra peak memory: a warm-up call, then the largest of two measured calls. On CPU in a fresh
    process (the child's entry point); on CUDA the allocator's peak counter is exact within a process, so the parent
    passes its own `inputs` (a child per method would spend its time starting CUDA and importing verl)."""
    device = torch.device(args.device)
    check_allocator(device)
    if inputs is None:
        inputs = make_inputs(args.n, args.vocab, args.k, device)
    backward, fn = methods(inputs)[name]
    run_once(fn, backward, inputs[0], device, memory=False)
    peak = max(run_once(fn, backward, inputs[0], device, memory=True)[0] for _ in range(2))
    return {"extra_peak_bytes": peak}


def bench_divergence(args) -> dict:
    device = torch.device(args.device)
    inputs = make_inputs(args.n, args.vocab, args.k, device)
    logits_bytes = inputs[0].numel() * inputs[0].element_size()
    table = methods(inputs)
    if device.type == "cuda":
        memory = {name: memory_of(args, name, inputs)["extra_peak_bytes"] for name in table}
    else:
        memory = {name: child_json(["--memory-of", name], args.device)["extra_peak_bytes"] for name in table}
    for backward, fn in table.values():  # warm-up (allocator, kernels)
        run_once(fn, backward, inputs[0], device, memory=False)
    samples = {name: [] for name in table}
    for _ in range(args.repeat):  # interleaved: a busy moment on a shared machine hits every method alike
        for name, (backward, fn) in table.items():
            samples[name].append(run_once(fn, backward, inputs[0], device, memory=False)[1])
    result = {
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(),
        "N": args.n,
        "V": args.vocab,
        "K": args.k,
        "logits": f"bfloat16, {logits_bytes / 2**20:.1f} MiB",
        "threads": torch.get_num_threads(),
    }
    for name, (backward, _) in table.items():
        entry = {
            "extra_peak_MiB": memory[name] / 2**20,
            "extra_peak_x_logits": memory[name] / logits_bytes,
            "median_s": statistics.median(samples[name]),
        }
        if backward:  # the [N, V] gradient any loss on the logits returns
            entry["extra_peak_without_gradient_x_logits"] = (memory[name] - logits_bytes) / logits_bytes
        result[name] = entry
    ratios = {
        "forward/topk_divergence": ["forward/naive_log_softmax_gather"],
        "forward_backward/dppo_topk": ["forward_backward/dppo_binary", "forward_backward/naive_topk"],
    }
    for name, baselines in ratios.items():
        for baseline in baselines:
            short = baseline.split("/")[1]
            result[name][f"time_x_{short}"] = result[name]["median_s"] / result[baseline]["median_s"]
            result[name][f"extra_peak_x_{short}"] = memory[name] / memory[baseline]
    result["forward_backward/dppo_topk"]["extra_peak_over_dppo_binary_x_logits"] = (
        memory["forward_backward/dppo_topk"] - memory["forward_backward/dppo_binary"]
    ) / logits_bytes
    return result


def timed(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
        del out
    return best


def bench_extraction(tokens: int, k: int, repeat: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the vLLM-shaped fixtures
    from vllm_fixtures import flat_from_dicts, per_token_loop_vllm_topk, vllm_shaped_logprobs

    from verl_dppo.patches.vllm_async_server import extract_vllm_topk

    logprobs, token_ids = vllm_shaped_logprobs(tokens, k, vocab=151_936, seed=0)
    flat = flat_from_dicts(logprobs, token_ids, k)
    slow = timed(lambda: per_token_loop_vllm_topk(logprobs, token_ids, k), repeat)
    fast_dict = timed(lambda: extract_vllm_topk(logprobs, token_ids, k), repeat)
    fast_flat = timed(lambda: extract_vllm_topk(flat, token_ids, k), repeat)
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
    parser.add_argument("--repeat", type=int, default=5, help="interleaved repeats for the times")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (0: torch's default); one by "
        "default, as bench_troll.py: on a shared 2-core machine OpenMP waits for a descheduled thread",
    )
    parser.add_argument("--tokens", type=int, default=8192, help="generated tokens for the extraction benchmark")
    parser.add_argument("--skip-extraction", action="store_true")
    parser.add_argument("--memory-of", choices=METHOD_NAMES, help=argparse.SUPPRESS)  # the child's entry point
    args = parser.parse_args()
    if importlib.util.find_spec("ray") is None:  # the GPU machine has no Ray; verl's package imports it
        from gpu_real_worker import install_ray_stand_in  # (same folder) every call of the stand-in raises

        install_ray_stand_in()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.memory_of:
        print(json.dumps(memory_of(args, args.memory_of)))
        return
    results = {"divergence": bench_divergence(args)}
    if not args.skip_extraction:
        results["vllm_extraction"] = bench_extraction(args.tokens, args.k, args.repeat)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
