"""Benchmark of TROLL's per-token computation (forward + backward to the logits) against what dppo_binary_tv needs.

    .venv/bin/python bench/bench_troll.py                    # N=2048, V=151,936, bf16, K=64, CPU (the issue's goal)
    python3 bench/bench_troll.py --device cuda --n 16384

dppo_binary_tv needs log pi(a_t) with gradient, which verl computes from the same logits. The baselines, same
inputs, same run: the naive `log_softmax(logits.float()).gather` and verl's own `logprobs_from_logits_v2` (its
row-by-row log-softmax, the path verl takes without flash-attn), each followed by backward to the logits. TROLL:
`troll_token_terms` + `troll_token_loss` and backward, with `inplace_backward` off (a fresh [N, V] gradient, like
the baselines) and on (the gradient written into the logits' storage, as verl's flash-attn cross entropy does).

Reported per method: the extra peak memory of the block as a fraction of the bf16 logits (goal for TROLL <= 0.25x),
the same without the [N, V] gradient tensor the method returns (any loss on the logits produces one; in place it is
the logits themselves), and the median time over interleaved repeats, with ratios to each baseline. On CPU the peak
is the process's resident-set high-water mark, reset before each block (/proc/self/clear_refs), measured in a child
process where glibc returns every allocation above 64 KiB to the system on free (MALLOC_MMAP_THRESHOLD_); on CUDA,
torch.cuda.max_memory_allocated, in this process. The inputs are drawn on the device itself (a generator of that
device, seed 0). On CPU the times use one torch thread by default: on a shared 2-core machine
OpenMP makes every parallel op wait for its descheduled second thread, which penalises TROLL's many chunk-sized
ops (with 2 threads under load TROLL's time was several times the naive baseline's, with 1 below it).

mu is the logits plus noise (--noise), so most rows are projected, and the random logits are flat, so the support
holds about 2K tokens: a worst case for the per-token math (real rows hold 5-10 tokens).
"""

from __future__ import annotations

import argparse
import importlib.util
import gc
import json
import statistics
import time

import torch

from peak_memory import PeakMemory, child_json  # the benchmarks' memory probe (same folder)
from verl_dppo.math.troll import TOPK, troll_token_loss, troll_token_terms


def make_inputs(n: int, vocab: int, k: int, noise: float, device: torch.device):
    """Drawn on `device` by a generator of that device (seed 0), as bench_topk.py draws its inputs: the CPU path
    draws what it always drew; on CUDA the [N, V] draws take well under a second."""
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(n, vocab, generator=generator, device=device).mul_(2).to(dtype=torch.bfloat16)
    # In place: two [N, V] float32 tensors at a time here, not four (10 GB each at N=16,384); the same numbers.
    mu_logits = torch.randn(n, vocab, generator=generator, device=device).mul_(noise).add_(logits.float())
    mu_logp = torch.log_softmax(mu_logits, dim=-1)
    del mu_logits
    topk_lp, topk_ids = mu_logp.topk(k, dim=-1)
    sampled = torch.multinomial(mu_logp.exp(), 1, generator=generator).squeeze(1)
    sampled_lp = mu_logp.gather(1, sampled[:, None]).squeeze(1)
    advantages = torch.randn(n, generator=generator, device=device)
    del mu_logp
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the draws' temporaries go back before anything is measured
    return [logits, topk_ids, topk_lp, sampled, sampled_lp, advantages]


def measure(args, part: str) -> dict:
    """Extra peak memory (part="memory": one block per method after a warm-up, the largest of two) or median time
    (part="time": interleaved repeats) of each method, with the run's TROLL statistics."""
    device = torch.device(args.device)
    from verl.utils.torch_functional import logprobs_from_logits_v2

    base, topk_ids, topk_lp, sampled, sampled_lp, advantages = make_inputs(
        args.n, args.vocab, args.k, args.noise, device
    )
    logits_bytes = base.numel() * base.element_size()
    stats = {}

    def naive(logits):
        log_prob = torch.log_softmax(logits.float(), dim=-1).gather(1, sampled[:, None]).squeeze(1)
        return (log_prob * advantages).sum()

    def verl_rowwise(logits):
        return (logprobs_from_logits_v2(logits, sampled) * advantages).sum()

    def troll(inplace):
        def loss(logits):
            terms = troll_token_terms(logits, topk_ids, topk_lp, sampled, sampled_lp, inplace_backward=inplace)
            stats.update(
                projected_frac=float(terms.diagnostics["projected"].float().mean()),
                support_size_mean=float(terms.diagnostics["support_size"].float().mean()),
                kl_before_mean=float(terms.diagnostics["kl_before"].mean()),
                kl_after_max=float(terms.diagnostics["kl_after"].max()),
            )
            return troll_token_loss(terms, advantages).sum()

        return loss

    methods = {
        "naive_log_softmax_gather": naive,
        "verl_logprobs_from_logits_v2": verl_rowwise,
        "troll": troll(False),
        "troll_inplace_backward": troll(True),
    }

    def run(fn):
        logits = base.clone().requires_grad_()  # in-place backward overwrites it
        gc.collect()
        with PeakMemory(device) as memory:
            start = time.perf_counter()
            (grad,) = torch.autograd.grad(fn(logits), logits)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
        own_grad = grad.data_ptr() != logits.data_ptr()
        del grad, logits
        return memory.extra, own_grad, elapsed

    for fn in methods.values():  # warm-up (allocator, kernels)
        run(fn)
    result = {name: {} for name in methods}
    repeats = 2 if part == "memory" else args.repeats
    samples = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            extra, own_grad, elapsed = run(fn)
            samples[name].append(extra if part == "memory" else elapsed)
            if part == "memory":
                result[name]["gradient_bytes"] = logits_bytes if own_grad else 0
    for name in methods:
        if part == "memory":
            peak = max(samples[name])
            result[name].update(
                extra_peak_MiB=peak / 2**20,
                extra_peak_x_logits=peak / logits_bytes,
                extra_peak_without_gradient_x_logits=(peak - result[name].pop("gradient_bytes")) / logits_bytes,
            )
        else:
            result[name]["median_s"] = statistics.median(samples[name])
    result["logits_MiB"] = logits_bytes / 2**20
    result["troll_statistics"] = stats
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--k", type=int, default=TOPK)
    parser.add_argument("--noise", type=float, default=0.4, help="std of the noise between pi's and mu's logits")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats for the times")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--part", choices=["memory", "time", "both"], default="both", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if importlib.util.find_spec("ray") is None:  # the GPU machine has no Ray; verl's package imports it
        from gpu_real_worker import install_ray_stand_in  # (same folder) every call of the stand-in raises

        install_ray_stand_in()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.part != "both":
        print(json.dumps(measure(args, args.part)))
        return
    # On CPU in a child process whose allocator returns freed memory to the system (peak_memory.py says why); on
    # CUDA in this process, whose allocator's peak counter is exact. The times are taken in this process, with the
    # ordinary allocator.
    if torch.device(args.device).type == "cuda":
        memory = measure(args, "memory")
        gc.collect()
        torch.cuda.empty_cache()
    else:
        memory = child_json(["--part", "memory"], args.device)
    times = measure(args, "time")
    result = {
        "device": str(torch.device(args.device)) if args.device != "cuda" else torch.cuda.get_device_name(),
        "N": args.n,
        "V": args.vocab,
        "K": args.k,
        "logits": f"bfloat16, {memory.pop('logits_MiB'):.1f} MiB",
        "threads": torch.get_num_threads(),
        **memory.pop("troll_statistics"),
    }
    times.pop("logits_MiB"), times.pop("troll_statistics")
    for name in times:
        result[name] = {**memory[name], **times[name]}
    for name in ("troll", "troll_inplace_backward"):
        for baseline in ("naive_log_softmax_gather", "verl_logprobs_from_logits_v2"):
            result[name][f"time_x_{baseline}"] = result[name]["median_s"] / result[baseline]["median_s"]
            result[name][f"extra_peak_x_{baseline}"] = (
                result[name]["extra_peak_MiB"] / result[baseline]["extra_peak_MiB"]
            )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
