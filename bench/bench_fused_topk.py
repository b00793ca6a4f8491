"""Benchmark of Top-K DPPO and TROLL fused with the LM head (issue 20) against verl's fused path and today's unfused
Top-K step: one training step of the LM head and the loss, forward + backward to the hidden states and the weight.

    .venv/bin/python bench/bench_fused_topk.py                  # T=4,096, H=1,024, V=151,936, float32, CPU
    .venv/bin/python bench/bench_fused_topk.py --device cuda    # T=32,768, bfloat16, on a GPU

The four steps, same inputs (mu = softmax(logits + noise), its top-K, a_t drawn from it), each measured in a child
process of its own (its peak memory is then its own), ratios printed by this process:

  fused_binary   verl's `FusedLinearForPPO` (the torch backend of `use_fused_kernels`) as dppo_binary_tv uses it:
                 log pi(a_t) and the entropy, the binary TV from log pi(a_t), loss on the masked ratio
  fused_topk     `fused_topk_divergence` (K = 20): Top-K TV from the fused statistics, log pi(a_t) and the entropy
                 from the same pass, the same loss
  fused_troll    `fused_troll_token_terms` (K = 64, TROLL's default), Eq. 5's loss
  fused_binary_plugin  the same step on the plugin's one-read head (`fused_logprob.fused_token_logprobs`), what
                 dppo_binary_tv runs with use_fused_kernels=True since issue 54.1 (opt in: --methods ...)
  unfused_topk   today's Top-K step with use_fused_kernels=False: the [T, V] logits, verl's entropy_from_logits and
                 logprobs_from_logits (its CPU path; flash-attn's cross entropy on a GPU that has it) as verl's
                 engine calls them, `topk_divergence` in the logits hook, the same loss
  unfused_binary_verl    dppo_binary_tv with use_fused_kernels=False on verl's own path: the [T, V] logits, verl's
                 entropy_from_logits and logprobs_from_logits as its engine calls them (opt in: --methods ...)
  unfused_binary_plugin  the same step on the plugin's one-read pass over the logits
                 (`logits_logprob.logits_logprobs`), what dppo_binary_tv runs with use_fused_kernels=False since
                 issue 54.1 (opt in)

--rounds R runs the children R times, the methods interleaved (round 1: every method, round 2: every method...),
and reports each method's median over the rounds and the unfused plugin step's ratio to verl's in each round:

    .venv/bin/python bench/bench_fused_topk.py --t 1024 --h 256 --repeats 3 --rounds 3 \
        --methods unfused_binary_verl,unfused_binary_plugin

Reported per step: the extra peak memory over the inputs (hidden states, weight, rollout fields), which includes
the gradients of the hidden states and the weight; the median forward + backward time. Targets: fused Top-K and
fused TROLL <= 1.1x fused_binary's peak and <= 0.2x unfused_topk's; time <= 1.2x fused_binary's. On CPU the peak is
the child's resident-set high-water mark, reset before the step (/proc/self/clear_refs), with every allocation above
64 KiB mmap'd and returned on free (MALLOC_MMAP_THRESHOLD_); the time is the child's CPU time with one torch thread
(--threads), which other processes on a shared machine do not inflate as they do the wall time (both reported). On CUDA: torch.cuda.max_memory_allocated, and the bandwidth bound: each chunk of tokens reads the LM head
once in the forward and twice in the backward (recomputed logits, dh) and reads and writes dW once, so a step
cannot take less than chunks x (3 x |W| + 2 x |dW|) / HBM bandwidth (measured here with a device copy).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_topk import PeakMemory  # noqa: E402  (the project's peak-memory probe, same folder)

METHODS = ("fused_binary", "fused_topk", "fused_troll", "unfused_topk")
DELTA_TV = 0.2
"""dppo_binary_tv / dppo_topk_tv's threshold (the recipes' value): tokens above it are masked in the loss."""


def make_inputs(args, device: torch.device) -> dict:
    """hidden [T, H], W [V, H] in args.dtype; mu's top-K (20 and 64), a_t and log mu(a_t), built chunk by chunk."""
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    hidden = torch.randn(args.t, args.h, generator=gen).to(device, dtype)
    weight = (torch.randn(args.v, args.h, generator=gen) * (2.0 / math.sqrt(args.h))).to(device, dtype)
    k_max = 64
    ids = torch.empty(args.t, k_max, dtype=torch.long, device=device)
    lps = torch.empty(args.t, k_max, dtype=torch.float32, device=device)
    sampled = torch.empty(args.t, dtype=torch.long, device=device)
    sampled_lp = torch.empty(args.t, dtype=torch.float32, device=device)
    noise_gen = torch.Generator(device=device).manual_seed(1)
    for s in range(0, args.t, 512):
        logits = (hidden[s : s + 512] @ weight.t()).float()
        mu = torch.log_softmax(logits + args.noise * torch.randn(logits.shape, generator=noise_gen, device=device), -1)
        lps[s : s + 512], ids[s : s + 512] = mu.topk(k_max, dim=-1)
        sampled[s : s + 512] = torch.multinomial(mu.exp(), 1, generator=noise_gen).squeeze(1)
        sampled_lp[s : s + 512] = mu.gather(1, sampled[s : s + 512, None]).squeeze(1)
        del logits, mu
    advantages = torch.randn(args.t, generator=gen).to(device)
    return dict(
        hidden=hidden, weight=weight, ids=ids, lps=lps, sampled=sampled, sampled_lp=sampled_lp, advantages=advantages
    )


def step_fn(method: str, x: dict):
    """The method's forward: (hidden, weight) -> loss, and the statistics of the run."""
    from verl_dppo.math.divergence import binary_tv

    sampled, sampled_lp, adv = x["sampled"], x["sampled_lp"], x["advantages"]
    ids20, lps20 = x["ids"][:, :20].contiguous(), x["lps"][:, :20].contiguous()
    stats = {}

    def masked_ratio_loss(log_p, tv):
        kept = (tv <= DELTA_TV).float()
        stats["masked_frac"] = float(1 - kept.mean())
        return -(torch.exp(log_p.float() - sampled_lp) * adv * kept).sum()

    if method == "fused_binary":
        from verl.utils.experimental.torch_functional import FusedLinearForPPO

        def forward(h, w):
            log_p, _entropy = FusedLinearForPPO(impl_backend="torch")(h, w, sampled, temperature=1.0)
            return masked_ratio_loss(log_p, binary_tv(sampled_lp, log_p.detach()))

    elif method == "fused_binary_plugin":  # what dppo_binary_tv runs with use_fused_kernels=True (issue 54.1)
        from verl_dppo.math.fused_logprob import fused_token_logprobs

        def forward(h, w):
            log_p, _entropy = fused_token_logprobs(h, w, sampled, 1.0, entropy=True)
            return masked_ratio_loss(log_p, binary_tv(sampled_lp, log_p.detach()))

    elif method in ("unfused_binary_verl", "unfused_binary_plugin"):  # dppo_binary_tv, use_fused_kernels=False
        from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

        from verl_dppo.math.logits_logprob import logits_logprobs

        def forward(h, w):
            logits = h @ w.t()  # temperature 1: verl's engine leaves the logits as they are
            if method == "unfused_binary_verl":
                _entropy = entropy_from_logits(logits)  # calculate_entropy=True, as the recipes set it
                log_p = logprobs_from_logits(logits, sampled, inplace_backward=False)
            else:
                log_p, _entropy = logits_logprobs(logits, sampled, entropy=True)
            return masked_ratio_loss(log_p, binary_tv(sampled_lp, log_p.detach()))

    elif method == "fused_topk":
        from verl_dppo.math.fused_topk import fused_topk_divergence

        def forward(h, w):
            tv, _kl, fused = fused_topk_divergence(h, w, ids20, lps20, sampled, sampled_lp, entropy=True)
            return masked_ratio_loss(fused.log_p_sampled, tv)

    elif method == "fused_troll":
        from verl_dppo.math.fused_troll import fused_troll_token_terms
        from verl_dppo.math.troll import troll_token_loss

        def forward(h, w):
            terms, _policy = fused_troll_token_terms(h, w, x["ids"], x["lps"], sampled, sampled_lp, entropy=True)
            stats["troll_projected_frac"] = float(terms.diagnostics["projected"].float().mean())
            stats["troll_support_size_mean"] = float(terms.diagnostics["support_size"].float().mean())
            return troll_token_loss(terms, adv).sum()

    elif method in ("unfused_troll_verl", "unfused_troll_plugin"):  # troll, use_fused_kernels=False (issue 53.5)
        from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

        from verl_dppo.math.logits_logprob import logits_logprobs
        from verl_dppo.math.troll import troll_token_loss, troll_token_terms

        def forward(h, w):
            logits = h @ w.t()  # temperature 1: verl's engine leaves the logits as they are
            # the entropy and log pi(a_t), formed in the graph as the engine forms them (verl's functions before
            # issue 53.5, the plugin's pass now); TROLL's loss reaches the logits through its own terms only
            # (troll_mode's docstring), so no gradient flows back through these
            if method == "unfused_troll_verl":
                _entropy = entropy_from_logits(logits)
                _log_p = logprobs_from_logits(logits, sampled, inplace_backward=False)
            else:
                _log_p, _entropy = logits_logprobs(logits, sampled, entropy=True)
            terms = troll_token_terms(logits, x["ids"], x["lps"], sampled, sampled_lp)  # the logits hook's pass
            stats["troll_projected_frac"] = float(terms.diagnostics["projected"].float().mean())
            return troll_token_loss(terms, adv).sum()

    elif method == "unfused_topk":
        from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

        from verl_dppo.math.topk import topk_divergence

        def forward(h, w):
            logits = h @ w.t()  # temperature 1: verl's engine leaves the logits as they are
            _entropy = entropy_from_logits(logits)  # calculate_entropy=True, as the recipes set it
            tv, _kl = topk_divergence(logits.detach(), ids20, lps20, sampled, sampled_lp)  # the logits hook
            log_p = logprobs_from_logits(logits, sampled, inplace_backward=False)  # False: the entropy is computed
            return masked_ratio_loss(log_p, tv)

    else:
        raise ValueError(method)
    return forward, stats


def run_child(args) -> dict:
    device = torch.device(args.device)
    x = make_inputs(args, device)
    forward, stats = step_fn(args.method, x)

    def step():
        h = x["hidden"].detach().requires_grad_()
        w = x["weight"].detach().requires_grad_()
        forward(h, w).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        del h, w

    def timed():
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        return time.perf_counter() - wall, time.process_time() - cpu

    with PeakMemory(device) as memory:
        first = timed()
    times = [timed() for _ in range(args.repeats)] or [first]
    # On a shared CPU the process's CPU time is the step's cost; the wall time also counts the other processes.
    clock = 0 if device.type == "cuda" else 1
    return {
        "extra_peak_MiB": memory.extra / 2**20,
        "median_s": statistics.median(t[clock] for t in times),
        "wall_s": [t[0] for t in times],
        "cpu_s": [t[1] for t in times],
        **stats,
    }


def hbm_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read + write) of 1 GiB, the best of five."""
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    best = math.inf
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * x.numel() / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--t", type=int, default=None, help="tokens (default 4,096 on CPU, 32,768 on CUDA)")
    parser.add_argument("--h", type=int, default=1024)
    parser.add_argument("--v", type=int, default=151_936)
    parser.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    parser.add_argument("--noise", type=float, default=0.5, help="std of the noise between pi's and mu's logits")
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed steps after the memory step (0: time the memory step)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--rounds", type=int, default=1, help="children per method, the methods interleaved")
    parser.add_argument("--method", default=None, help=argparse.SUPPRESS)  # a child's one step
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    args.t = args.t or (32_768 if cuda else 4_096)
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.method is not None:
        print(json.dumps(run_child(args)))
        return

    env = dict(os.environ)
    if not cuda:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed memory leaves the RSS: its high-water mark is the live peak
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "T": args.t,
        "H": args.h,
        "V": args.v,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
    }
    rounds: dict[str, list] = {}
    for _ in range(max(args.rounds, 1)):
        for method in args.methods.split(","):
            child = subprocess.run(
                [sys.executable, *sys.argv, "--method", method], env=env, capture_output=True, text=True
            )
            if child.returncode != 0:
                raise SystemExit(f"{method} failed:\n{child.stderr[-4000:]}")
            row = json.loads(child.stdout.strip().splitlines()[-1])
            rounds.setdefault(method, []).append(row)
            print(f"{method}: {json.dumps(row)}", file=sys.stderr, flush=True)
    for method, rows in rounds.items():
        result[method] = dict(
            rows[0],
            median_s=statistics.median(r["median_s"] for r in rows),
            extra_peak_MiB=statistics.median(r["extra_peak_MiB"] for r in rows),
            rounds_median_s=[r["median_s"] for r in rows],
        )
    if "unfused_binary_verl" in rounds and "unfused_binary_plugin" in rounds:
        verl_rows, plugin_rows = rounds["unfused_binary_verl"], rounds["unfused_binary_plugin"]
        plugin = result["unfused_binary_plugin"]
        plugin["time_x_unfused_binary_verl_per_round"] = [
            p["median_s"] / v["median_s"] for p, v in zip(plugin_rows, verl_rows)
        ]
        plugin["time_x_unfused_binary_verl"] = plugin["median_s"] / result["unfused_binary_verl"]["median_s"]
        plugin["peak_x_unfused_binary_verl"] = (
            plugin["extra_peak_MiB"] / result["unfused_binary_verl"]["extra_peak_MiB"]
        )
    for method in ("fused_topk", "fused_troll", "fused_binary_plugin"):
        row = result.get(method)
        if row is None:
            continue
        for baseline in ("fused_binary", "unfused_topk"):
            if baseline in result:
                row[f"peak_x_{baseline}"] = row["extra_peak_MiB"] / result[baseline]["extra_peak_MiB"]
        if "fused_binary" in result:
            row["time_x_fused_binary"] = row["median_s"] / result["fused_binary"]["median_s"]
    if cuda:
        from verl_dppo.math.fused_topk import DEFAULT_CHUNK_TOKENS

        bandwidth = hbm_bandwidth(torch.device(args.device))
        element = torch.finfo(getattr(torch, args.dtype)).bits // 8
        chunks = math.ceil(args.t / DEFAULT_CHUNK_TOKENS)
        bound = chunks * (3 + 2) * args.v * args.h * element / bandwidth
        result["hbm_GBps"] = bandwidth / 1e9
        result["bandwidth_bound_s"] = bound
        for method in METHODS:
            if method in result:
                result[method]["time_x_bandwidth_bound"] = result[method]["median_s"] / bound
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
