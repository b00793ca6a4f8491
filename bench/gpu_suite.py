"""The prepared GPU check (issue 41): what the plugin's per-token work costs on a GPU, in one command.

    python3 bench/gpu_suite.py --out $OUT                  # on a GPU (its duration: docs/benchmarks.md)
    .venv/bin/python bench/gpu_suite.py --device cpu --smoke --out out/gpu_suite   # the CPU smoke path (tests)

Parts, each printed as it ends and written to OUT/gpu_suite.json (rewritten after each part, "complete": false until
the last, so a run stopped by a time limit keeps what it measured) and OUT/gpu_suite.md (markdown tables). The
markdown begins with the goals of issues 72 and 75, each beside the value this run measured and whether it holds
(`bench/gpu_goals.py`; "not measured" where its part did not run), the JSON holds them under "goals", and the log
ends with the same tables.

1. per_token: N = 16,384 rows, Qwen3's vocabulary 151,936, bf16 logits (4,748 MiB), K = 20 for Top-K, 64 for TROLL,
   drawn on the device (bench_topk.make_inputs). Each method's median time over --repeats after a warm-up (CUDA
   events around the call: wall time, the device's idle gaps included), the device's own time in one more call
   (`device_seconds`, torch.profiler's kernel time; `device_share` = it / wall, issue 54's "bound by the GPU"), and
   its extra peak memory (the allocator's peak minus what was allocated before), with its
   ratio to one read of the logits (`amax`) and to torch's cross entropy (forward, or forward + backward):
   `topk_divergence` and TROLL's `troll_token_terms` + `troll_token_loss` + backward on the kernels (the default on a
   GPU; TROLL also with Top(pi) by torch's top-k, the kernels' first version, for the threshold kernels' gain) and on
   the torch path (VERL_DPPO_KERNELS=torch: chunks sized by the device, and the old 8 MiB chunks).
2. fused: the LM-head-fused paths (T tokens, H = 1,024): verl's own chunked torch path (`FusedLinearForPPO`, what
   dppo_binary_tv ran with use_fused_kernels=True before issue 54.1) against the plugin's one-read binary head
   (`fused_binary_plugin`), fused Top-K and fused TROLL, forward + backward with the entropy
   (bench_fused_topk.step_fn), on the kernels and on the torch path; each of the four again at H = 4,096 (Qwen3-8B's
   head) against verl's step at that size; and torch.profiler's top device ops of
   the fused Top-K and TROLL steps on the kernels.
2b. unfused (issues 54.1, 53.5): the unfused steps (the [T, V] logits formed, H = 1,024, fwd + bwd with the entropy)
   as verl's engine runs them: dppo_binary_tv and troll, each with log pi(a_t) and the entropy by verl's
   logprobs_from_logits + entropy_from_logits (before issues 54.1 / 53.5) and by the plugin's one-read pass (now;
   troll's loss through TROLL's own pass either way); each with its device time, the device's events counted
   (kernels on CUDA) and torch.profiler's top ops, all from one profiled call; and log pi(a_t) and the entropy by
   verl's functions and by the plugin's pass on the same bf16 logits, each against float64 (one profiled call per
   row: the profiler's events of verl's row loop made this the longest part, docs/benchmarks.md).
3. troll_devices: TROLL on the same bf16-valued logits and rollout rows (256 x 151,936, K = 64) on CUDA (the kernels)
   and on the CPU (the torch path): support sizes, log p(a_t), the gradient; and on CUDA against a permutation of
   the vocabulary. Goal: 1e-5 on log p(a_t), the same support on every row.
4. worker: verl's real worker (bench/gpu_real_worker.py, a child process) for dppo_binary_tv, dppo_topk_tv and troll,
   unfused and with use_fused_kernels=True, at --worker-response-length tokens per response; dppo_binary_tv also on
   verl's own log-prob path, unfused and fused (--verl-paths: the plugin's pass against verl's, issue 54's goals).
5. r3_worker: verl's real worker on a Qwen3-MoE of Qwen3-30B-A3B's layer shape (128 experts, top-8, hidden 2,048,
   --r3-layers of its 48 layers, its real vocabulary), routes returned by the bf16 rollout copy as vLLM returns
   them, dppo_binary_tv without and with R3 on the FSDP engine: step time and peak memory as ratios (goal: the step
   with R3 at most 1.05x), and the replay's metrics in the first step (replayed 1 on CUDA, the route fit). Not run
   on a GPU yet (no GPU lent since it was written, 2026-12-02): give it a call of its own (`--parts r3_worker`,
   timeout_s 400) the first time.

With the `device` tool: verl, its pure-Python needs and this package travel as wheels in .whl (gpu_real_worker.py's
docstring says how to build them). Rebuild this package's wheel from the tree before each call
(`rm -f .whl/verl_dppo-*.whl && .venv/bin/pip wheel -q --no-deps -w .whl .`): the GPU machine imports verl_dppo from
it, recipes and patches included. How long each part took on the calls that ran (docs/benchmarks.md, "How long
the GPU calls take") decides the split: run the worker as a call of its own (`--parts worker`), or give the whole
suite a limit of 600 s:

    run(carry=[".whl"], timeout_s=400, command="python3 -m pip install -q --no-index --no-deps --no-compile
        --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit;
        set -o pipefail; PYTHONUNBUFFERED=1 timeout 380 python3 bench/gpu_suite.py --out $OUT 2>&1 | tee $OUT/log")

Also: launch_shapes (the four kernels for BLOCK 1,024-4,096 x 4-16 warps) and profile (torch.profiler's top device ops of
TROLL's forward + backward and of topk_divergence, in the JSON and the log). --parts picks a subset. The machine's
start and the transfers come on top of the parts' times.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
PARTS = ("per_token", "launch_shapes", "profile", "fused", "unfused", "troll_devices", "worker", "r3_worker")


class Clock:
    """Seconds since start, for the progress lines."""

    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f} s] {message}", flush=True)


@contextlib.contextmanager
def kernels(choice: str):
    """VERL_DPPO_KERNELS for the block ('auto': the default, the kernels on a GPU). 'auto+topk': the kernels, with
    TROLL's Top(pi) read by torch's top-k as before the threshold kernels (the same answer; for the comparison)."""
    from verl_dppo.math import troll_support
    from verl_dppo.math.kernels import KERNELS_ENV

    before = os.environ.get(KERNELS_ENV)
    os.environ[KERNELS_ENV] = choice.split("+")[0]
    reader = troll_support.support_by_kernel
    if choice.endswith("+topk"):
        troll_support.support_by_kernel = troll_support.support_by_topk
    try:
        yield
    finally:
        troll_support.support_by_kernel = reader
        if before is None:
            os.environ.pop(KERNELS_ENV)
        else:
            os.environ[KERNELS_ENV] = before


def measure(device: torch.device, fn, repeats: int, with_device_time: bool = True) -> dict:
    """fn() after a warm-up: the median seconds and the largest extra peak memory (CUDA's allocator; NaN on CPU);
    with `with_device_time`, the device's own time in one more call (`device_seconds`)."""
    fn()
    times, peaks = [], []
    for _ in range(repeats):
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
            peaks.append(torch.cuda.max_memory_allocated() - base)
        else:
            begin = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - begin)
            peaks.append(math.nan)
        del out
    seconds = statistics.median(times)
    if not with_device_time:
        return {"seconds": seconds, "extra_peak_MiB": max(peaks) / 2**20}
    device_time = device_seconds(device, fn)
    return {
        "seconds": seconds,
        "extra_peak_MiB": max(peaks) / 2**20,
        "device_seconds": device_time,
        "device_share": device_time / seconds,
    }


def device_seconds(device: torch.device, fn) -> float:
    """One more call of fn under torch.profiler: the seconds the device spent in it, beside `measure`'s wall time
    (CUDA events around the call, so the device's idle gaps count there). On CUDA the kernels' own time (the
    events of device type CUDA, as torch's profiler table sums its "Self CUDA time total"); on the CPU the ops' own
    CPU time (what the ops ran, not the Python between them). device_share = this / wall: issue 54's goals ask
    at least 0.9 for the per-token Top-K call and 0.85 for the fused TROLL step (the host not the bound)."""
    return profiled(device, fn)[0]


def profiled(device: torch.device, fn, row_limit: int = 0) -> tuple[float, int, str]:
    """One call of fn under torch.profiler: (the device's own seconds in it, as `device_seconds` counts them; the
    device's events counted: kernels and copies on CUDA, ops on the CPU; torch.profiler's table of the top `row_limit`
    ops by the device's own time, or "" for 0)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.type == "cuda"
    with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        out = fn()
        if cuda:
            torch.cuda.synchronize()
    del out
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    events = [
        event
        for event in prof.events()
        if event.device_type == kind and not getattr(event, "is_user_annotation", False)
    ]
    seconds = sum(event.self_device_time_total if cuda else event.self_cpu_time_total for event in events) / 1e6
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=row_limit, max_name_column_width=60) if row_limit else ""
    return seconds, len(events), table


def per_token(args, device, clock) -> dict:
    import torch.nn.functional as F

    from bench_topk import make_inputs
    from verl_dppo.math.kernels import backend_for
    from verl_dppo.math.topk import topk_divergence
    from verl_dppo.math.troll import troll_token_loss, troll_token_terms

    logits, ids, lps, sampled, sampled_lp, advantages = make_inputs(args.n, args.vocab, 64, device)
    ids20, lps20 = ids[:, :20].contiguous(), lps[:, :20].contiguous()
    clock(f"per_token: inputs drawn ({args.n} x {args.vocab}, bf16, {logits.numel() * 2 / 2**20:,.0f} MiB)")

    def backward_of(loss_fn):
        def run():
            x = logits.detach().requires_grad_()
            (grad,) = torch.autograd.grad(loss_fn(x), x)
            return grad

        return run

    def troll_loss(x):
        return troll_token_loss(troll_token_terms(x, ids, lps, sampled, sampled_lp), advantages).sum()

    forward = {
        "one read (amax)": (None, lambda: logits.amax(dim=-1)),
        "torch cross_entropy": (None, lambda: F.cross_entropy(logits, sampled, reduction="none")),
        "naive log_softmax(float) + gather": (None, lambda: torch.log_softmax(logits.float(), -1).gather(1, ids20)),
        "topk_divergence, kernels": ("auto", lambda: topk_divergence(logits, ids20, lps20, sampled, sampled_lp)),
        "topk_divergence, torch path, device chunks": (
            "torch",
            lambda: topk_divergence(logits, ids20, lps20, sampled, sampled_lp),
        ),
        "topk_divergence, torch path, 8 MiB chunks": (
            "torch",
            lambda: topk_divergence(logits, ids20, lps20, sampled, sampled_lp, chunk_bytes=8 * 2**20),
        ),
    }
    both = {
        "fwd+bwd torch cross_entropy": (
            None,
            backward_of(lambda x: (F.cross_entropy(x, sampled, reduction="none") * advantages).sum()),
        ),
        "fwd+bwd TROLL, kernels": ("auto", backward_of(troll_loss)),
        "fwd+bwd TROLL, kernels, Top(pi) by torch.topk": ("auto+topk", backward_of(troll_loss)),
        "fwd+bwd TROLL, torch path, device chunks": ("torch", backward_of(troll_loss)),
    }
    rows = {}
    for table, baseline in ((forward, "torch cross_entropy"), (both, "fwd+bwd torch cross_entropy")):
        for name, (choice, fn) in table.items():
            try:
                with kernels(choice or "auto"):
                    rows[name] = measure(device, fn, args.repeats)
                    if choice:
                        rows[name]["backend"] = backend_for(logits)
            except Exception as error:  # a kernel that does not compile on this Triton: the other rows still run
                rows[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
            clock(f"per_token: {name}: {rows[name]}")
        for name in table:
            if "seconds" in rows[name]:
                rows[name]["x_one_read"] = rows[name]["seconds"] / rows["one read (amax)"]["seconds"]
                rows[name]["x_torch_ce"] = rows[name]["seconds"] / rows[baseline]["seconds"]
                rows[name]["extra_peak_x_logits"] = rows[name]["extra_peak_MiB"] * 2**20 / (logits.numel() * 2)
    del logits
    return {"N": args.n, "V": args.vocab, "K_topk": 20, "K_troll": 64, "rows": rows}


def launch_shapes(args, device, clock) -> dict:
    """The two kernels for each (BLOCK, num_warps), in milliseconds, beside one read of the same logits."""
    from bench_topk import make_inputs
    from verl_dppo.math import kernels

    logits, ids, _, sampled, *_ = make_inputs(args.n, args.vocab, 20, device)
    slots = torch.cat([ids, sampled[:, None]], dim=1)
    out = torch.empty_like(logits)
    base, coef = torch.zeros(args.n, device=device), torch.ones(args.n, device=device)
    result = {"one_read_ms": measure(device, lambda: logits.amax(dim=-1), args.repeats)["seconds"] * 1e3}
    for block in (1024, 2048, 4096):
        for warps in (4, 8, 16):
            if device.type != "cuda" and (block, warps) != (1024, 4):
                continue
            try:
                first = measure(
                    device,
                    lambda: kernels.max_and_sum_exp_outside(logits, slots, block=block, num_warps=warps),
                    args.repeats,
                )["seconds"]
                second = measure(
                    device,
                    lambda: kernels.scaled_exp_into(out, logits, base, coef, block=block, num_warps=warps),
                    args.repeats,
                )["seconds"]
                threshold = measure(
                    device, lambda: kernels.top_threshold(logits, 64, block=block, num_warps=warps), args.repeats
                )["seconds"]
                row_max, at = kernels.top_threshold(logits, 64, block=block, num_warps=warps)
                below = measure(
                    device,
                    lambda: kernels.sum_exp_below(logits, slots, row_max, at, 260, block=block, num_warps=warps),
                    args.repeats,
                )["seconds"]
                result[f"{block}/{warps}"] = {
                    "max_and_sum_ms": first * 1e3,
                    "scaled_exp_ms": second * 1e3,
                    "top_threshold_ms": threshold * 1e3,
                    "sum_exp_below_ms": below * 1e3,
                }
            except Exception as error:
                result[f"{block}/{warps}"] = {"error": f"{type(error).__name__}: {error}"[:300]}
            clock(f"launch_shapes: BLOCK {block}, {warps} warps: {result[f'{block}/{warps}']}")
    return result


def profile(args, device, clock) -> dict:
    """Where TROLL's forward + backward and topk_divergence spend their device time: torch.profiler's top ops."""
    from bench_topk import make_inputs
    from verl_dppo.math.topk import topk_divergence
    from verl_dppo.math.troll import troll_token_loss, troll_token_terms

    logits, ids, lps, sampled, sampled_lp, advantages = make_inputs(args.n, args.vocab, 64, device)

    def troll():
        x = logits.detach().requires_grad_()
        terms = troll_token_terms(x, ids, lps, sampled, sampled_lp)
        return torch.autograd.grad(troll_token_loss(terms, advantages).sum(), x)

    def topk():
        return topk_divergence(logits, ids[:, :20].contiguous(), lps[:, :20].contiguous(), sampled, sampled_lp)

    result = {}
    for name, fn in (("troll_forward_backward", troll), ("topk_divergence", topk)):
        fn()
        table = profiled(device, fn, row_limit=18)[2]
        result[name] = table
        print(f"profile of {name}:\n{table}", flush=True)
    return result


FUSED_ROWS = (  # (row name, step_fn's method, VERL_DPPO_KERNELS)
    ("fused_binary", "fused_binary", "auto"),
    ("fused_binary_plugin", "fused_binary_plugin", "auto"),
    ("fused_topk", "fused_topk", "auto"),
    ("fused_troll", "fused_troll", "auto"),
    ("fused_topk, torch path", "fused_topk", "torch"),
    ("fused_troll, torch path", "fused_troll", "torch"),
)


def _fused_step(method: str, x: dict):
    """(step, stats): one forward + backward of bench_fused_topk's `method` on the inputs `x`."""
    from bench_fused_topk import step_fn

    forward, stats = step_fn(method, x)

    def step():
        h = x["hidden"].detach().requires_grad_()
        w = x["weight"].detach().requires_grad_()
        forward(h, w).backward()
        return h.grad

    return step, stats


def fused(args, device, clock) -> dict:
    """The fused paths' forward + backward (entropy asked for, as the recipes' calculate_entropy does) against verl's
    own, on the kernels (the default on a GPU) and on the torch path; torch.profiler's top device ops of each of our
    fused steps on the kernels, for where the time beyond verl's goes."""
    from bench_fused_topk import make_inputs
    from verl_dppo.math.kernels import backend_for

    shape = argparse.Namespace(
        t=args.fused_tokens, h=1024, v=args.vocab, noise=0.5, dtype="bfloat16" if device.type == "cuda" else "float32"
    )
    x = make_inputs(shape, device)
    rows, profiles = {}, {}
    for name, method, choice in FUSED_ROWS:
        step, stats = _fused_step(method, x)
        try:
            with kernels(choice):
                rows[name] = {
                    **measure(device, step, args.repeats),
                    **stats,
                    "backend": backend_for(x["hidden"].float()),
                }
                if method in ("fused_topk", "fused_troll") and choice == "auto":
                    profiles[name] = profiled(device, step, row_limit=14)[2]
                    print(f"profile of {name}:\n{profiles[name]}", flush=True)
        except Exception as error:
            rows[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
        clock(f"fused: {name}: {rows[name]}")
    for name in rows:
        if "seconds" in rows[name] and "seconds" in rows["fused_binary"]:
            rows[name]["x_fused_binary"] = rows[name]["seconds"] / rows["fused_binary"]["seconds"]
    # Issue 54.3: every mode's fused step at a real model's hidden size (Qwen3-8B's head: H = 4,096) against verl's
    # kernel at that size, ratios from the same run.
    wide = make_inputs(argparse.Namespace(**{**vars(shape), "h": 128 if args.smoke else 4096}), device)
    for method in ("fused_binary", "fused_binary_plugin", "fused_topk", "fused_troll"):
        name = f"{method}, H=4096"
        step, stats = _fused_step(method, wide)
        try:
            rows[name] = {**measure(device, step, args.repeats), **stats}
        except Exception as error:
            rows[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
        clock(f"fused: {name}: {rows[name]}")
        if "seconds" in rows[name] and "seconds" in rows.get("fused_binary, H=4096", {}):
            rows[name]["x_fused_binary"] = rows[name]["seconds"] / rows["fused_binary, H=4096"]["seconds"]
    del wide
    return {"T": args.fused_tokens, "H": 1024, "V": args.vocab, "chunk_tokens": 512, "rows": rows, "profiles": profiles}


UNFUSED_STEPS = ("unfused_binary_verl", "unfused_binary_plugin", "unfused_troll_verl", "unfused_troll_plugin")
"""The unfused steps (use_fused_kernels=False, the [T, V] logits formed, calculate_entropy=True) as verl's engine
runs them: dppo_binary_tv with log pi(a_t) and the entropy by verl's logprobs_from_logits + entropy_from_logits
(before issue 54.1) and by the plugin's one-read pass (now); troll, whose step forms the two as well (verl's before
issue 53.5, the plugin's now) and takes its loss through TROLL's own pass."""


def unfused(args, device, clock) -> dict:
    """Issue 53.5: why the unfused `troll` step was slower than `dppo_binary_tv`'s in verl's worker
    (docs/benchmarks.md). Per step: wall and device time, the device's events counted and torch.profiler's top ops (one more call); and the log
    pi(a_t) and entropy that verl's functions and the plugin's pass compute on the same logits, each against float64
    (the `_verl` steps' log pi and entropy are verl's functions', the `_plugin` steps' the plugin's pass)."""
    from bench_fused_topk import make_inputs

    cuda = device.type == "cuda"
    shape = argparse.Namespace(
        t=args.fused_tokens, h=1024, v=args.vocab, noise=0.5, dtype="bfloat16" if cuda else "float32"
    )
    x = make_inputs(shape, device)
    rows, profiles = {}, {}
    for name in UNFUSED_STEPS:
        step, stats = _fused_step(name, x)
        try:  # one profiled call gives the device time, the events and the table (verl's row loop: 1e5 events)
            row = {**measure(device, step, args.repeats, with_device_time=False), **stats}
            row["device_seconds"], row["device_events"], profiles[name] = profiled(device, step, row_limit=12)
            row["device_share"] = row["device_seconds"] / row["seconds"]
            rows[name] = row
            print(f"profile of {name}:\n{profiles[name]}", flush=True)
        except Exception as error:
            rows[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
        clock(f"unfused: {name}: {rows[name]}")
    for name in UNFUSED_STEPS:
        for base in ("unfused_binary_verl", "unfused_binary_plugin"):
            if name != base and "seconds" in rows[name] and "seconds" in rows[base]:
                rows[name][f"x_{base}"] = rows[name]["seconds"] / rows[base]["seconds"]
    agreement = _logprob_agreement(x, min(args.fused_tokens, 2048))
    clock(f"unfused: agreement: {agreement}")
    return {
        "T": args.fused_tokens,
        "H": 1024,
        "V": args.vocab,
        "dtype": shape.dtype,
        "rows": rows,
        "profiles": profiles,
        "agreement": agreement,
        "flash_attn_cross_entropy": _flash_attn_ce(),
    }


def _logprob_agreement(x: dict, rows: int) -> dict:
    """log pi(a_t) and the entropy of `rows` rows of the inputs' logits (their dtype: bf16 on the GPU) by verl's
    logprobs_from_logits + entropy_from_logits and by the plugin's logits_logprobs, each against float64 over the same
    logits, and against each other: the largest absolute difference of each."""
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    from verl_dppo.math.logits_logprob import logits_logprobs

    labels = x["sampled"][:rows]
    with torch.no_grad():
        logits = x["hidden"][:rows] @ x["weight"].t()
        exact = []  # float64 a chunk of rows at a time: [rows, V] in float64 is 2.5 GB at Qwen3's vocabulary
        for chunk, chunk_labels in zip(logits.split(256), labels.split(256)):
            lp = torch.log_softmax(chunk.double(), dim=-1)
            exact.append((lp.gather(1, chunk_labels[:, None]).squeeze(1), -(lp.exp() * lp).sum(-1)))
            del lp
        values = {"float64": tuple(torch.cat(parts) for parts in zip(*exact))}
        values["verl"] = (logprobs_from_logits(logits, labels), entropy_from_logits(logits))
        values["plugin"] = logits_logprobs(logits, labels, entropy=True)
    result = {
        "rows": rows,
        "logits_dtype": str(logits.dtype).replace("torch.", ""),
        "entropy_mean": float(values["float64"][1].mean()),
        "log_p_mean": float(values["float64"][0].mean()),
    }
    for a, b in (("verl", "float64"), ("plugin", "float64"), ("plugin", "verl")):
        result[f"{a}_vs_{b}"] = {
            "log_p_max_abs_diff": float((values[a][0].double() - values[b][0].double()).abs().max()),
            "entropy_max_abs_diff": float((values[a][1].double() - values[b][1].double()).abs().max()),
        }
    return result


def _flash_attn_ce() -> bool:
    """Whether verl's logprobs_from_logits takes flash-attn's cross entropy here (its faster path)."""
    try:
        from verl.utils import torch_functional

        return bool(
            getattr(torch_functional, "FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE", False)
            or getattr(torch_functional, "FLASH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE", False)
        )
    except Exception:  # noqa: BLE001
        return False


def troll_devices(args, device, clock) -> dict:
    from verl_dppo.math.troll import troll_token_loss, troll_token_terms

    rows, vocab, k = args.agreement_rows, args.vocab, 64
    gen = torch.Generator().manual_seed(41)
    logits = (torch.randn(rows, vocab, generator=gen) * 2.5).to(torch.bfloat16)
    mu = torch.log_softmax((logits.float() + 0.3 * torch.randn(rows, vocab, generator=gen)).double(), -1)
    lps, ids = mu.topk(k, dim=-1)
    sampled = torch.multinomial(mu.exp(), 1, generator=gen).squeeze(1)
    sampled_lp = mu.gather(1, sampled[:, None]).squeeze(1).float()
    lps = lps.float()
    advantages = torch.randn(rows, generator=gen)
    perm = torch.randperm(vocab, generator=gen)
    new_id = torch.empty_like(perm)
    new_id[perm] = torch.arange(vocab)

    def run(on, x, ids_, sampled_):
        x = x.to(on).requires_grad_()
        terms = troll_token_terms(x, ids_.to(on), lps.to(on), sampled_.to(on), sampled_lp.to(on))
        (grad,) = torch.autograd.grad(troll_token_loss(terms, advantages.to(on)).sum(), x)
        return terms, grad.float().cpu()

    cpu_terms, cpu_grad = run(torch.device("cpu"), logits, ids, sampled)
    dev_terms, dev_grad = run(device, logits, ids, sampled)
    perm_terms, perm_grad = run(device, logits[:, perm], new_id[ids], new_id[sampled])

    def compare(a, grad_a, b, grad_b):
        log_p = (a.log_p_sampled.detach().cpu() - b.log_p_sampled.detach().cpu()).abs()
        return {
            "rows": rows,
            "support_differs_rows": int(
                (a.diagnostics["support_size"].cpu() != b.diagnostics["support_size"].cpu()).sum()
            ),
            "projected_differs_rows": int((a.diagnostics["projected"].cpu() != b.diagnostics["projected"].cpu()).sum()),
            "log_p_max_abs_diff": float(log_p.max()),
            "log_p_rows_over_1e-5": int((log_p > 1e-5).sum()),
            "grad_max_abs_diff_x_max": float((grad_a - grad_b).abs().max() / grad_a.abs().max()),
        }

    result = {
        "device_vs_cpu": compare(dev_terms, dev_grad, cpu_terms, cpu_grad),
        "permuted_vocabulary_on_device": compare(dev_terms, dev_grad, perm_terms, perm_grad[:, new_id]),
        "V": vocab,
        "K": k,
        "projected_rows": int(dev_terms.diagnostics["projected"].sum()),
    }
    clock(f"troll_devices: {result}")
    return result


def worker(args, device, clock) -> dict:
    out = Path(args.out) / "gpu_real_worker.json"
    command = [
        sys.executable,
        str(HERE / "gpu_real_worker.py"),
        "--modes",
        "dppo_binary_tv,dppo_topk_tv,troll",
        "--fused",
        "both",
        "--json",
        str(out),
    ]
    if device.type == "cpu":
        command += ["--device", "cpu", "--tiny"]
    else:  # dppo_binary_tv also on verl's own log-prob path, unfused and fused (FSDP1 here: verl's kernel runs)
        command += ["--response-length", str(args.worker_response_length), "--verl-paths"]
    clock(f"worker: {' '.join(command[1:])}")
    done = subprocess.run(command, text=True, timeout=args.worker_timeout)
    result = json.loads(out.read_text()) if out.exists() else {}
    result["exit_code"] = done.returncode
    return result


def r3_worker(args, device, clock) -> dict:
    """R3 on verl's FSDP engine (issue 72.6): a Qwen3-MoE of Qwen3-30B-A3B's layer shape through verl's real worker,
    dppo_binary_tv without and with the rollout's routes replayed (gpu_real_worker.py --moe, a child process)."""
    out = Path(args.out) / "gpu_real_worker_r3.json"
    command = [
        sys.executable,
        str(HERE / "gpu_real_worker.py"),
        "--moe",
        "--modes",
        "dppo_binary_tv",
        "--json",
        str(out),
    ]
    if device.type == "cpu":
        command += ["--device", "cpu", "--tiny"]
    else:
        command += ["--response-length", str(args.worker_response_length), "--layers", str(args.r3_layers)]
    clock(f"r3_worker: {' '.join(command[1:])}")
    done = subprocess.run(command, text=True, timeout=args.worker_timeout)
    result = json.loads(out.read_text()) if out.exists() else {}
    result["exit_code"] = done.returncode
    return result


def markdown(result: dict) -> str:
    from gpu_goals import goals_markdown

    lines = [
        f"# GPU check: {result['device']} (torch {result['torch']}, triton {result['triton']}), {result['date']}",
        "",
        *goals_markdown(result, result.get("goals") or []),
    ]
    part = result.get("per_token")
    if part:
        lines += [
            f"## Per-token work: N = {part['N']:,}, V = {part['V']:,}, bf16, K = 20 (Top-K) / 64 (TROLL)",
            "",
            "| method | time ms | device ms | x one read | x torch CE | extra peak MiB | x logits |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, row in part["rows"].items():
            if "error" in row:
                lines.append(f"| {name} | {row['error']} | | | | | |")
                continue
            label = f"{name} ({row['backend']})" if "backend" in row else name
            lines.append(
                f"| {label} | {row['seconds'] * 1e3:.2f} | {row.get('device_seconds', math.nan) * 1e3:.2f} | "
                f"{row.get('x_one_read', math.nan):.2f} | "
                f"{row.get('x_torch_ce', math.nan):.2f} | {row['extra_peak_MiB']:,.0f} | "
                f"{row.get('extra_peak_x_logits', math.nan):.3f} |"
            )
        lines.append("")
    part = result.get("launch_shapes")
    if part and "one_read_ms" in part:
        lines += [
            f"## Launch shapes (BLOCK/warps): the kernels in ms; one read of the logits {part['one_read_ms']:.2f} ms",
            "",
            "| BLOCK/warps | max_and_sum_exp_outside | scaled_exp_into | top_threshold (K + 1 = 65) | sum_exp_below |",
            "|---|---|---|---|---|",
        ]
        for name, row in part.items():
            if name != "one_read_ms":
                lines.append(
                    f"| {name} | {row.get('max_and_sum_ms', math.nan):.2f} | "
                    f"{row.get('scaled_exp_ms', math.nan):.2f} | {row.get('top_threshold_ms', math.nan):.2f} | "
                    f"{row.get('sum_exp_below_ms', math.nan):.2f} |"
                    if "error" not in row
                    else f"| {name} | {row['error']} | | | |"
                )
        lines.append("")
    part = result.get("fused")
    if part:
        lines += [
            f"## Fused with the LM head: T = {part['T']:,}, H = {part['H']:,}, 512 tokens a chunk, fwd + bwd",
            "",
            "| method | time ms | device ms | x fused_binary | extra peak MiB |",
            "|---|---|---|---|---|",
        ]
        for name, row in part["rows"].items():
            if "error" in row:
                lines.append(f"| {name} | {row['error']} | | | |")
            else:
                label = f"{name} ({row['backend']})" if "backend" in row and name != "fused_binary" else name
                lines.append(
                    f"| {label} | {row['seconds'] * 1e3:.1f} | "
                    f"{row.get('device_seconds', math.nan) * 1e3:.1f} | {row.get('x_fused_binary', math.nan):.3f} | "
                    f"{row['extra_peak_MiB']:,.0f} |"
                )
        lines.append("")
    part = result.get("unfused")
    if part and "rows" in part:
        lines += [
            f"## Unfused steps (the [T, V] logits formed): T = {part['T']:,}, H = {part['H']:,}, fwd + bwd with "
            "the entropy",
            "",
            "| step | time ms | device ms | device events | x binary, verl's path | "
            "x binary, plugin's pass | extra peak MiB |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, row in part["rows"].items():
            if "error" in row:
                lines.append(f"| {name} | {row['error']} | | | | | |")
            else:
                lines.append(
                    f"| {name} | {row['seconds'] * 1e3:.1f} | {row['device_seconds'] * 1e3:.1f} | "
                    f"{row['device_events']:,} | {row.get('x_unfused_binary_verl', 1.0):.3f} | "
                    f"{row.get('x_unfused_binary_plugin', 1.0):.3f} | {row['extra_peak_MiB']:,.0f} |"
                )
        agreement = part["agreement"]
        lines += [
            "",
            f"log pi(a_t) and the entropy on {agreement['rows']:,} rows of {agreement['logits_dtype']} "
            "logits, largest absolute differences:",
            "",
            "| pair | log pi(a_t) | entropy |",
            "|---|---|---|",
        ]
        for pair in ("verl_vs_float64", "plugin_vs_float64", "plugin_vs_verl"):
            lines.append(
                f"| {pair} | {agreement[pair]['log_p_max_abs_diff']:.2e} | "
                f"{agreement[pair]['entropy_max_abs_diff']:.2e} |"
            )
        lines.append("")
    part = result.get("troll_devices")
    if part:
        lines += [
            f"## TROLL on bf16 ties: {part['device_vs_cpu']['rows']} rows, V = {part['V']:,}, K = {part['K']}, "
            f"{part['projected_rows']} rows projected",
            "",
            "| comparison | support differs | projected differs | max abs diff log p(a_t) | rows over 1e-5 | "
            "grad max diff / max |",
            "|---|---|---|---|---|---|",
        ]
        for name in ("device_vs_cpu", "permuted_vocabulary_on_device"):
            row = part[name]
            lines.append(
                f"| {name} | {row['support_differs_rows']} | {row['projected_differs_rows']} | "
                f"{row['log_p_max_abs_diff']:.2e} | {row['log_p_rows_over_1e-5']} | "
                f"{row['grad_max_abs_diff_x_max']:.2e} |"
            )
        lines.append("")
    part = result.get("worker")
    if part and part.get("modes"):
        lines += [
            f"## verl's real worker: {part.get('tokens', 0):,} tokens a step, responses <= "
            f"{part.get('response_length')}",
            "",
            "| mode | fused | log-prob path | step s | x binary (same fused) | peak GiB | "
            "first step's mean TV(mu, pi) on a_t |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in part["modes"]:
            lines.append(
                f"| {row['mode']} | {row.get('fused', False)} | {row.get('logprob_path', 'plugin')} | "
                f"{row['step_seconds']:.3f} | {row['time_vs_binary_tv']:.3f} | {row['peak_memory_gib']:.2f} | "
                f"{row.get('first_step_mismatch_tv_mean', math.nan):.3g} |"
            )
    part = result.get("r3_worker")
    if part and part.get("modes"):
        lines += [
            "",
            f"## R3 on verl's FSDP engine: a Qwen3-MoE of {part.get('experts')} experts, top-"
            f"{part.get('experts_per_token')}, {part.get('layers')} layers, {part.get('tokens', 0):,} tokens a "
            "step",
            "",
            "| replay | step s | x without R3 (goal <= 1.05) | peak GiB | x without | replayed | "
            "route fit | router differs |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in part["modes"]:
            r3 = row.get("logprob_path") == "r3"
            lines.append(
                f"| {'R3' if r3 else 'none'} | {row['step_seconds']:.3f} | "
                f"{row.get('time_vs_without_r3', 1.0):.3f} | {row['peak_memory_gib']:.2f} | "
                f"{row.get('memory_vs_without_r3', 1.0):.3f} | {row.get('r3_replayed_frac', math.nan):.4f} | "
                f"{row.get('r3_route_fit', math.nan):.4f} | {row.get('r3_router_differs_frac', math.nan):.4f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from gpu_goals import goal_rows

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--smoke", action="store_true", help="small sizes (the CPU smoke path)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n", type=int, default=16_384)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--fused-tokens", type=int, default=16_384)
    parser.add_argument("--agreement-rows", type=int, default=256)
    parser.add_argument("--worker-response-length", type=int, default=512)
    parser.add_argument("--worker-timeout", type=int, default=300)
    parser.add_argument("--r3-layers", type=int, default=4, help="r3_worker: the MoE's decoder layers (of 48)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.n, args.vocab, args.fused_tokens, args.agreement_rows, args.repeats = 64, 2_048, 256, 16, 1
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    if importlib_find("ray") is None:  # the GPU image has no Ray; verl's package imports it
        from gpu_real_worker import install_ray_stand_in

        install_ray_stand_in()
    device = torch.device(args.device)
    clock = Clock()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "CPU",
        "torch": torch.__version__,
        "triton": triton_version(),
        "date": time.strftime("%Y-%m-%d"),
        "complete": False,
    }
    clock(f"{result['device']}, torch {result['torch']}, triton {result['triton']}; parts {', '.join(parts)}")
    for name in parts:
        try:
            result[name] = globals()[name](args, device, clock)
        except Exception as error:  # one part failing leaves the others' numbers
            result[name] = {"error": f"{type(error).__name__}: {error}"[:1000]}
            clock(f"{name}: FAILED {result[name]['error']}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["goals"] = goal_rows(result)
        (out / "gpu_suite.json").write_text(json.dumps(result, indent=1))
        (out / "gpu_suite.md").write_text(markdown(result))
    result["complete"] = True
    (out / "gpu_suite.json").write_text(json.dumps(result, indent=1))
    (out / "gpu_suite.md").write_text(markdown(result))
    print(markdown(result))
    return 0 if all("error" not in result[name] for name in parts) else 1


def importlib_find(name: str):
    import importlib.util

    return importlib.util.find_spec(name)


def triton_version() -> str:
    try:
        import triton
    except Exception:
        return "not installed"
    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
