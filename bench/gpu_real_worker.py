"""Every loss mode of the plugin through verl 0.9.1's real `ActorRolloutRefWorker` at a realistic size, on one GPU.

Per mode it prints the actor's step time, the peak GPU memory, the loss and the masked fraction, and for the
Top-K modes the step time and peak memory as ratios to `dppo_binary_tv` measured in the same run.

    python bench/gpu_real_worker.py                         # one CUDA GPU (nccl, strategy=fsdp, bf16)
    python bench/gpu_real_worker.py --device cpu --tiny     # the CPU smoke path (tests/e2e runs it)
    python bench/gpu_real_worker.py --trainer-mode separate_async   # verl's DetachActorWorker on stale rollouts
    python bench/gpu_real_worker.py --moe                   # a Qwen3-30B-A3B-shaped MoE without and with R3

What runs is the CPU end-to-end suite's driver (tests/e2e/driver.py) with the device and the sizes as parameters:
each mode's config is composed from the recipes (`sanity_1p5b` x the mode's method, as `verl-dppo run` composes
it) with the model, batch and token budget below; verl's worker is built on it (FSDP1 with verl's default bf16
mixed precision and gradient checkpointing on CUDA; FSDP2 over gloo in fp32 on CPU), and driven as verl's v1
trainer drives it (`update_actor` with the trainer's batch keys and settings; bypass mode, so no recompute pass).

Default size (CUDA): a random-init Qwen3 with Qwen3-0.6B's widths and 8 of its 28 layers, Qwen3's real vocabulary
of 151,936 (about 280M parameters), 8 prompts x 4 samples, prompts of 128-256 tokens, responses of 512-1,024
tokens (max_response_length 1,024), 2 mini-batches per step, 8,192 tokens per micro-batch (several micro-batches
per mini-batch), K = 20, the recipe's lr 1e-6. One rollout batch is sampled once by the bf16 copy of the initial
policy (mu and its top-K per token, as an inference engine reports them) and every mode trains on it, each with a
fresh worker from the same initial weights: --warmup steps, then --steps timed steps. Step time: the median of the
timed `update_actor` calls; peak memory: torch.cuda.max_memory_allocated over them, less what was allocated before
the mode's worker was built (what earlier modes' workers left; the JSON has both) (on CPU: the process's
resident-set high-water mark); loss and masked fraction (actor/pg_clipfrac): the first timed step.

With the `device` tool (this machine has no GPU; the GPU machine has torch and transformers but neither verl nor
network access, so verl and its pure-Python needs travel as wheels, a few MiB in all):

  1. Here, once, in the repository root:

       echo /.whl/ >> .git/info/exclude
       .venv/bin/pip wheel --no-deps -w .whl . antlr4-python3-runtime==4.9.3   # this package; antlr4 is sdist-only
       python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \\
         verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 omegaconf==2.3.1 hydra-core==1.3.8 datasets==5.2.0 \\
         multiprocess==0.70.19 dill==0.4.1 codetiming==1.4.0 orjson==3.13.0 pydantic==2.14.3 pydantic_core==2.50.4 \\
         typing_extensions==4.16.0 typing-inspection==0.4.5 annotated-types==0.8.0 fastapi==0.165.0 \\
         starlette==1.10.0 uvicorn==0.54.0 opentelemetry-api==1.45.2

     (the set real-worker.md records as sufficient; Ray's wheel is too large to travel and is not needed: when
     `import ray` fails, this script puts a stand-in in its place, whose every call raises.)

  2. run(carry=[".whl"], timeout_s=600, command=
       "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site
        .whl/*.whl && export PYTHONPATH=/tmp/site || exit; set -o pipefail; PYTHONUNBUFFERED=1 python3
        bench/gpu_real_worker.py --json $OUT/gpu_real_worker.json 2>&1 | tee $OUT/log")

  For the asynchronous comparison, run it twice in the same command, `--json $OUT/sync.json` and
  `--trainer-mode separate_async --json $OUT/separate_async.json`: same device, same rollout, same modes.

  Where the time goes (docs/benchmarks.md, "How long the GPU calls take"): imports, the model's save and the configs;
  the rollout of 32 x up to 1,024 tokens (HF's token-by-token forward with a KV cache; on CUDA each token is drawn on
  the GPU, --rollout-sampling cpu draws them as the CPU suite's driver does, copying [32, 151,936] probabilities to
  the CPU at every token); then per mode a worker build (verl's init_model) and --warmup + --steps steps, the first
  mode's warm-up the longest. Every phase prints a timestamped line as it ends, and --json is
  rewritten after each mode ("complete": false until the last), so a run stopped by `timeout` keeps the modes it
  finished: list the modes that matter first. --modes measures a subset (dppo_binary_tv is always added, first: the
  ratios are to it); --response-length, --prompts, --steps and --warmup shrink the run (the JSON records the size
  that ran).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import json
import math
import re
import statistics
import sys
import tempfile
import time
import types
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASELINE = "dppo_binary_tv"


# ---------------------------------------------------------------------------------------------------------------
# Ray stand-in (the GPU machine has no Ray; verl's worker path only imports it)
# ---------------------------------------------------------------------------------------------------------------


_DECORATORS = ("remote", "method")
"""`@ray.remote` / `@ray.remote(...)` / `@ray.method(...)` run at import time in modules verl imports: as
decorators they leave the decorated object as it is (a later `.remote()` on it fails)."""


class _RayUnavailable:
    """Any name under `ray`: importable, usable as a base class or an annotation; calling it raises."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        if self._name.rsplit(".", 1)[-1] in _DECORATORS:
            if len(args) == 1 and not kwargs and callable(args[0]):
                return args[0]
            return lambda decorated: decorated
        raise RuntimeError(f"{self._name}(): Ray is not installed here (bench/gpu_real_worker.py's stand-in)")

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _RayUnavailable(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        return (object,)


class _RayModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _RayUnavailable(f"{self.__name__}.{attr}")


class _RayFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "ray" or fullname.startswith("ray."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _RayModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+stand-in"
        return module

    def exec_module(self, module):
        module.is_initialized = lambda: False


def install_ray_stand_in() -> None:
    if "ray" in sys.modules:
        raise RuntimeError("ray is already imported; the stand-in must be installed first")
    sys.meta_path.insert(0, _RayFinder())


# ---------------------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------------------


class PeakMemory:
    """Peak memory over a block: CUDA's allocator, or on CPU the process's resident-set high-water mark."""

    def __init__(self, device: str):
        self.device = device

    def reset(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            try:
                with open("/proc/self/clear_refs", "w") as clear:
                    clear.write("5")  # VmHWM := current RSS
            except OSError:
                pass

    def peak_bytes(self) -> float:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            return float(torch.cuda.max_memory_allocated())
        try:
            with open("/proc/self/status") as status:
                return float(re.search(r"^VmHWM:\s+(\d+) kB", status.read(), re.M).group(1)) * 1024
        except (OSError, AttributeError):
            return math.nan


def device_sampling_rollout_copy(driver, model_dir, device: str):
    """driver.RolloutCopy whose token draws run on `device`, with a generator of that device seeded from the run's
    CPU generator. The driver's copy (the CPU suite's, which must stay reproducible on CPU) moves the [batch, V]
    probabilities to the CPU at every token and draws there: a 19 MB copy and a CPU draw per token at 32 x 151,936.
    Same model, same bf16 logits, same float32 log-softmax, same top-K; only the random stream differs."""
    import torch

    class DeviceSamplingRolloutCopy(driver.RolloutCopy):
        def _generate(self, prompts, length, generator, topk):
            # one device generator per rollout, seeded from the caller's: the draws stay on the GPU
            self._sampler = torch.Generator(device=self.device).manual_seed(
                int(torch.randint(0, 2**62, (), generator=generator))
            )
            return super()._generate(prompts, length, generator, topk)

        def _draw(self, logp, generator):
            return torch.multinomial(logp.exp(), 1, generator=self._sampler)

    return DeviceSamplingRolloutCopy(model_dir, device)


class Progress:
    """Timestamped progress lines (seconds since the script started), flushed at once: a run stopped by a time
    limit still tells where its time went."""

    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f} s] {message}", flush=True)


SIZE_FLAGS = {
    "layers": ("num_layers", "number of layers"),
    "hidden": ("hidden_size", "hidden size"),
    "vocab": ("vocab_size", "vocabulary size"),
    "experts": ("num_experts", "number of experts (with --moe)"),
    "experts-per-token": ("experts_per_token", "experts per token (with --moe)"),
    "expert-width": ("moe_intermediate_size", "experts' intermediate size (with --moe)"),
}
"""The model's shape, flag by flag, over the size --tiny / --moe picks: R3's fixed cost per micro-batch against a
model of some size on the CPU (docs/benchmarks.md)."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the CPU suite's tiny model and batch (smoke test)")
    parser.add_argument("--modes", default="", help="comma-separated loss modes (default: every registered one)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per mode first")
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--samples-per-prompt", type=int, default=None)
    parser.add_argument("--prompt-length", type=int, default=None)
    parser.add_argument("--response-length", type=int, default=None)
    parser.add_argument("--token-budget", type=int, default=None, help="ppo_max_token_len_per_gpu")
    for flag, (field, what) in SIZE_FLAGS.items():
        parser.add_argument(f"--{flag}", type=int, default=None, help=f"override the model's {what}")
    parser.add_argument(
        "--trainer-mode",
        choices=["sync", "separate_async"],
        default="sync",
        help="sync: verl's ActorRolloutRefWorker; separate_async: the recipes' separate_async switch, "
        "verl's DetachActorWorker, a weight push (update_weights) after every step and the rollout "
        "from version 0, so that step i trains on samples i versions old",
    )
    parser.add_argument(
        "--fused",
        choices=["off", "on", "both"],
        default="off",
        help="actor_rollout_ref.model.use_fused_kernels: off, on (the plugin's LM-head-fused paths and "
        "verl's own for dppo_binary_tv, torch backend), or both (each mode twice; the ratios compare "
        "runs of the same setting)",
    )
    parser.add_argument(
        "--verl-paths",
        action="store_true",
        help=f"also run {BASELINE} on verl's own log-prob path (as before issue 54.1: verl's "
        "logprobs_from_logits and entropy_from_logits unfused, its FusedLinearForPPO fused), for each "
        "--fused setting, beside the plugin's one-read pass; the plugin's row gets time_vs_verl_path",
    )
    parser.add_argument(
        "--moe",
        action="store_true",
        help="a Qwen3-MoE of Qwen3-30B-A3B's layer shape (128 experts, top-8, hidden 2,048; with "
        "--tiny 8 experts, top-2) whose routes the rollout copy returns as vLLM does; each mode twice, "
        "without and with R3 on verl's FSDP engine (the plugin's replay): the R3 rows get "
        "time_vs_without_r3, memory_vs_without_r3 and the replay's metrics",
    )
    parser.add_argument(
        "--r3-first",
        action="store_true",
        help="with --moe: each mode's R3 side before the side without (an order check: the ratio should not flip)",
    )
    parser.add_argument("--ray-stand-in", action="store_true", help="use the Ray stand-in even if Ray is installed")
    parser.add_argument(
        "--json",
        default=None,
        help="also write the results here (rewritten after each mode, with "
        '"complete": false until the last, so a run stopped by a time limit keeps what it measured)',
    )
    parser.add_argument(
        "--rollout-sampling",
        choices=["device", "cpu"],
        default="device",
        help="where the rollout copy draws each token: device (a generator of the run's device; on "
        "CPU the same as cpu) or cpu (the CPU suite's driver: the probabilities copied to the CPU at "
        "every token)",
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace, progress: Progress = None) -> dict:
    progress = progress or Progress()
    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    import torch

    import driver

    progress("imported torch, verl's driver")

    driver.init_distributed(args.device)
    if args.moe:
        size = driver.TINY_MOE if args.tiny else driver.GPU_MOE
    else:
        size = driver.TINY_MODEL if args.tiny else driver.GPU_MODEL
    given = {field: getattr(args, flag.replace("-", "_")) for flag, (field, _) in SIZE_FLAGS.items()}
    size = replace(size, **{field: value for field, value in given.items() if value is not None})
    if args.tiny:
        shape = driver.RunShape(
            prompts=4,
            samples_per_prompt=4,
            mini_batches=2,
            prompt_length=8,
            response_length=16,
            token_budget=64,
            lr=1e-2,
        )
    else:
        shape = driver.RunShape(
            prompts=8,
            samples_per_prompt=4,
            mini_batches=2,
            prompt_length=256,
            response_length=1024,
            token_budget=8192,
            lr=None,
        )
    shape = replace(
        shape,
        **{
            k: v
            for k, v in {
                "prompts": args.prompts,
                "samples_per_prompt": args.samples_per_prompt,
                "prompt_length": args.prompt_length,
                "response_length": args.response_length,
                "token_budget": args.token_budget,
            }.items()
            if v is not None
        },
    )
    modes = [m for m in args.modes.split(",") if m] or ([BASELINE] if args.moe else driver.plugin_loss_modes())
    modes = [BASELINE] + [m for m in modes if m != BASELINE]
    unknown = set(modes) - set(driver.plugin_loss_modes())
    if unknown:
        raise SystemExit(f"unknown loss modes {sorted(unknown)}; registered: {driver.plugin_loss_modes()}")

    workdir = Path(tempfile.mkdtemp(prefix="gpu_real_worker_"))
    model_dir = driver.save_model(workdir / "model", size)
    separate = args.trainer_mode == "separate_async"
    if separate:
        import async_worker

        extra = dict(trainer_mode="separate_async", overrides=async_worker.ENGINE_OVERRIDES)
    else:
        extra = {}
    settings = {"off": (False,), "on": (True,), "both": (False, True)}[args.fused]
    configs = {}
    for fused in settings:
        for mode in modes:
            overrides = (*extra.get("overrides", ()), *(FUSED_OVERRIDES if fused else ()))
            config = driver.compose_config(
                mode, model_dir, shape, device=args.device, **{**extra, "overrides": overrides}
            )
            configs[mode, fused, "plugin"] = config
            if args.verl_paths and mode == BASELINE:
                configs[mode, fused, "verl"] = config
            if args.moe:  # the same mode with R3: the rollout's routes in the batch, replayed by the trainer's routers
                configs[mode, fused, "r3"] = driver.compose_config(
                    mode,
                    model_dir,
                    shape,
                    device=args.device,
                    **{**extra, "overrides": (*overrides, *driver.R3_OVERRIDES)},
                )
    if args.r3_first:  # each mode's R3 side before the side without: the later worker of a process may run warmer
        configs = dict(
            sorted(configs.items(), key=lambda item: (modes.index(item[0][0]), item[0][1], item[0][2] != "r3"))
        )
    topk = max(driver.rollout_topk(c) or 1 for c in configs.values())
    counted = count_plugin_passes()
    setup_seconds = time.perf_counter() - progress.start
    sampling = args.rollout_sampling if args.device != "cpu" else "cpu"
    progress(
        f"model saved, {len(configs)} configs composed; sampling the rollout ({shape.batch_size} sequences, "
        f"responses <= {shape.response_length}, tokens drawn on {sampling})"
    )
    started = time.perf_counter()
    if sampling == "device":
        rollout_copy = device_sampling_rollout_copy(driver, model_dir, args.device)
    else:
        rollout_copy = driver.RolloutCopy(model_dir, args.device)
    n_params = sum(p.numel() for p in rollout_copy.model.parameters())
    rollout = rollout_copy.sample(shape, torch.Generator().manual_seed(shape.seed), topk)
    rewards = driver.target_token_reward(rollout)
    del rollout_copy
    if args.device == "cuda":
        torch.cuda.empty_cache()
    rollout_seconds = time.perf_counter() - started
    tokens = sum(p.numel() + r.numel() for p, r in zip(rollout.prompts, rollout.responses))
    progress(f"rollout sampled in {rollout_seconds:.1f} s: {tokens:,} tokens")

    memory = PeakMemory(args.device)
    rows = []
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    result = {
        "device": device_name,
        "torch": torch.__version__,
        "trainer_mode": args.trainer_mode,
        "parameters": n_params,
        "vocab_size": size.vocab_size,
        "layers": size.num_layers,
        "experts": size.num_experts,
        "experts_per_token": size.experts_per_token,
        "sequences": shape.batch_size,
        "tokens": tokens,
        "prompt_length": shape.prompt_length,
        "response_length": shape.response_length,
        "token_budget": shape.token_budget,
        "topk": topk,
        "setup_seconds": setup_seconds,
        "rollout_seconds": rollout_seconds,
        "rollout_sampling": sampling,
        "warmup": args.warmup,
        "steps": args.steps,
        "modes_asked": modes,
        "complete": False,
        "modes": rows,
    }
    for (mode, fused, path), config in configs.items():
        label = (
            f"{mode}{' (fused)' if fused else ''}{' (verl path)' if path == 'verl' else ''}"
            f"{' (R3)' if path == 'r3' else ''}"
        )
        # What earlier modes' workers left allocated (measured on an H100: about 1 GiB more per earlier mode), before
        # this mode's worker is built: the mode's own peak is the allocator's peak minus this.
        leftover = float(torch.cuda.memory_allocated()) if args.device == "cuda" else 0.0
        built = time.perf_counter()
        worker = async_worker.build_worker(config) if separate else driver.build_worker(config)
        trainer = driver.Trainer(config, worker)
        build_seconds = time.perf_counter() - built
        progress(f"{label}: worker built in {build_seconds:.1f} s")
        versions = async_worker.versions(0, len(rollout.responses)) if separate else None
        times, peaks, pushes, first, warm = [], [], [], None, None
        if separate:
            async_worker.push(worker, 0)
        counted["calls"] = 0
        for step in range(args.warmup + args.steps):
            memory.reset()
            start = time.perf_counter()
            with verl_logprob_path() if path == "verl" else contextlib.nullcontext():
                metrics = trainer.step(rollout, rewards, versions)
            warm = warm or metrics  # the first step: every mode's worker from the same weights on the same rollout
            if args.device == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if separate:  # on_step_end: the new weights go to the rollout, labelled with the step
                pushed = time.perf_counter()
                async_worker.push(worker, step + 1)
                pushes.append(time.perf_counter() - pushed)
            if step >= args.warmup:
                times.append(elapsed)
                peaks.append(memory.peak_bytes())
                first = first or metrics
            progress(
                f"{mode}: step {step + 1}/{args.warmup + args.steps} "
                f"({'timed' if step >= args.warmup else 'warm-up'}) {elapsed:.2f} s"
            )
        rows.append(
            {
                "mode": mode,
                "fused": fused,
                "logprob_path": path,
                "plugin_pass_calls": counted["calls"],  # the plugin's log-prob passes over the mode's steps
                "method": driver.method_for_mode(mode),
                "step_seconds": statistics.median(times),
                "peak_memory_gib": (max(peaks) - leftover) / 2**30,
                "peak_memory_absolute_gib": max(peaks) / 2**30,
                "left_by_earlier_modes_gib": leftover / 2**30,
                "loss": first["actor/loss"],
                "grad_norm": first["actor/grad_norm"],
                "masked_frac": first["actor/pg_clipfrac"],
                "mismatch_tv_mean": first["actor/dppo/mismatch_tv_mean"],
                # |mu - pi| on the sampled tokens in the first step, whose first mini-batch every mode computes from the
                # same weights: equal across modes when their log pi(a_t) are (issue 53.5)
                "first_step_mismatch_tv_mean": warm["actor/dppo/mismatch_tv_mean"],
                "tokens_per_second": tokens / statistics.median(times),
                "lag_mean": first.get("actor/dppo/lag_mean", math.nan),
                "push_seconds": statistics.median(pushes) if pushes else math.nan,
                "build_seconds": build_seconds,
                # the replay in the first step (from version 0's weights, as the rollout's; later steps train on the
                # same rollout with moved routers)
                **(
                    {f"r3_{name}": warm.get(f"actor/dppo/r3_{name}", math.nan) for name in R3_METRICS}
                    if path == "r3"
                    else {}
                ),
            }
        )
        del worker, trainer
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        add_ratios(rows)
        row = rows[-1]
        progress(
            f"{label}: step {row['step_seconds']:.3f} s (median of {args.steps}), peak "
            f"{row['peak_memory_gib']:.2f} GiB, time vs {BASELINE} {row.get('time_vs_binary_tv', math.nan):.3f}, "
            f"memory vs {BASELINE} {row.get('memory_vs_binary_tv', math.nan):.3f}"
        )
        if args.json:  # what is measured so far, should a time limit stop the run
            Path(args.json).write_text(json.dumps(result, indent=1))
    result["complete"] = True
    result["total_seconds"] = time.perf_counter() - progress.start
    return result


R3_METRICS = ("replayed_frac", "route_fit", "router_differs_frac", "unrouted_frac")
"""The replay's metrics an R3 row records from its first step (docs/megatron.md says what they mean)."""

FUSED_OVERRIDES = (
    "actor_rollout_ref.model.use_fused_kernels=True",
    "actor_rollout_ref.model.fused_kernel_options.impl_backend=torch",
)
"""--fused: verl's fused forward (no [T, V] logits) with its torch backend, the plugin's fused Top-K and TROLL."""


def add_ratios(rows: list[dict]) -> None:
    """Each mode's step time and peak memory as ratios to the baseline's (the binary mode without R3 on the plugin's
    path, of the same fused setting, whichever order the rows ran in; none yet under --r3-first until it has run);
    with --verl-paths, the baseline's step time and peak memory on the plugin's pass as ratios to verl's path."""
    for row in rows:
        baseline = next(
            (
                r
                for r in rows
                if r["mode"] == BASELINE
                and r["logprob_path"] == "plugin"
                and r.get("fused", False) == row.get("fused", False)
            ),
            None,
        )
        if baseline is not None:
            row["time_vs_binary_tv"] = row["step_seconds"] / baseline["step_seconds"]
            peak, base = row["peak_memory_gib"], baseline["peak_memory_gib"]
            row["memory_vs_binary_tv"] = peak / base if base and math.isfinite(base) else math.nan
        if row.get("logprob_path") == "r3":
            without = next(
                (
                    r
                    for r in rows
                    if r["mode"] == row["mode"]
                    and r.get("fused") == row.get("fused")
                    and r.get("logprob_path") == "plugin"
                ),
                None,
            )
            if without is not None:
                row["time_vs_without_r3"] = row["step_seconds"] / without["step_seconds"]
                base = without["peak_memory_gib"]
                row["memory_vs_without_r3"] = (
                    row["peak_memory_gib"] / base if base and math.isfinite(base) else math.nan
                )
        verl = next(
            (
                r
                for r in rows
                if r["mode"] == row["mode"] and r.get("fused") == row.get("fused") and r.get("logprob_path") == "verl"
            ),
            None,
        )
        if verl is not None and row.get("logprob_path") == "plugin":
            row["time_vs_verl_path"] = row["step_seconds"] / verl["step_seconds"]
            verl_peak = verl["peak_memory_gib"]
            row["memory_vs_verl_path"] = peak / verl_peak if verl_peak and math.isfinite(verl_peak) else math.nan


@contextlib.contextmanager
def verl_logprob_path():
    """The plugin's binary modes on verl's own log-prob path, as before issue 54.1 (the comparison's other side):
    neither the plugin's unfused pass (verl's logprobs_from_logits and entropy_from_logits run) nor its fused head
    (verl's FusedLinearForPPO runs); the Top-K and TROLL modes' fused steps as always (unfused, their log pi and
    entropy take verl's path too, as before issue 53.5)."""
    from verl_dppo.patches import fused_lm_head
    from verl_dppo.plugin.modes import is_topk_mode
    from verl_dppo.plugin.options import policy_loss_get

    unfused, fused = fused_lm_head._unfused_config, fused_lm_head._topk_config

    def topk_only(loss_function, micro_batch):
        config = fused(loss_function, micro_batch)
        return config if config is not None and is_topk_mode(policy_loss_get(config, "loss_mode")) else None

    fused_lm_head._unfused_config, fused_lm_head._topk_config = (lambda *_: None), topk_only
    try:
        yield
    finally:
        fused_lm_head._unfused_config, fused_lm_head._topk_config = unfused, fused


def count_plugin_passes() -> dict:
    """Counts the calls of the plugin's log-prob passes (unfused `logits_logprobs`, fused `fused_token_logprobs`)
    in a dict's "calls", so that each row says which path its steps took."""
    from verl_dppo.math import fused_logprob, logits_logprob

    counted = {"calls": 0}
    for module, name in ((logits_logprob, "logits_logprobs"), (fused_logprob, "fused_token_logprobs")):

        def wrap(original):
            def counting(*args, **kwargs):
                counted["calls"] += 1
                return original(*args, **kwargs)

            return counting

        setattr(module, name, wrap(getattr(module, name)))
    return counted


def print_table(result: dict) -> None:
    model = (
        f"Qwen3-MoE ({result['experts']} experts, top-{result['experts_per_token']})"
        if result.get("experts")
        else "Qwen3"
    )
    print(
        f"\nverl's real worker, {result['device']}: {model} random init, {result['parameters'] / 1e6:.1f}M parameters, "
        f"vocabulary {result['vocab_size']:,}, {result['layers']} layers; {result['sequences']} sequences, "
        f"{result['tokens']:,} tokens, responses <= {result['response_length']}, {result['token_budget']} tokens "
        f"per micro-batch, K={result['topk']}; median of {result['steps']} steps after {result['warmup']} warm-up; "
        f"trainer mode {result['trainer_mode']}"
    )
    print(
        f"setup (imports, model saved, configs) {result['setup_seconds']:.1f} s; rollout "
        f"{result['rollout_seconds']:.1f} s (tokens drawn on {result['rollout_sampling']}); worker builds "
        + ", ".join(f"{row['build_seconds']:.1f}" for row in result["modes"])
        + " s"
    )
    print(
        "every step trains on the one rollout sampled by version 0, so the first timed step's samples (loss, masked "
        "fraction) are --warmup versions old"
        + (
            "; separate_async: verl's DetachActorWorker, a weight push "
            "(update_weights, timed apart) after each step, the lag as the plugin logs it"
            if result["trainer_mode"] == "separate_async"
            else ""
        )
    )
    memory_label = "peak GiB" if result["device"] != "CPU" else "peak RSS GiB"
    print(
        f"{'mode':<22} {'step s':>8} {'tokens/s':>9} {memory_label:>12} {'loss':>10} {'masked':>7} {'lag':>4} "
        f"{'time vs ' + BASELINE:>24} {'memory vs ' + BASELINE:>26}"
    )
    for row in result["modes"]:
        ratios = (
            f"{row['time_vs_binary_tv']:>24.3f} {row['memory_vs_binary_tv']:>26.3f}"
            if row["mode"] != BASELINE or row.get("logprob_path") in ("verl", "r3")
            else f"{'':>24} {'':>26}"
        )
        lag = "" if math.isnan(row["lag_mean"]) else f"{row['lag_mean']:g}"
        name = (
            row["mode"]
            + (" +fused" if row.get("fused") else "")
            + (" @verl" if row.get("logprob_path") == "verl" else "")
            + (" +R3" if row.get("logprob_path") == "r3" else "")
        )
        print(
            f"{name:<22} {row['step_seconds']:>8.3f} {row['tokens_per_second']:>9.0f} "
            f"{row['peak_memory_gib']:>12.2f} {row['loss']:>10.5f} {row['masked_frac']:>7.4f} {lag:>4} {ratios}"
        )
    for row in result["modes"]:
        if "time_vs_without_r3" in row:
            print(
                f"{row['mode']}{' +fused' if row.get('fused') else ''} with R3: {row['time_vs_without_r3']:.3f}x "
                f"the step without, {row['memory_vs_without_r3']:.3f}x its peak memory; replayed "
                f"{row['r3_replayed_frac']:.4f}, route fit {row['r3_route_fit']:.4f}, router differs "
                f"{row['r3_router_differs_frac']:.4f}, no route {row['r3_unrouted_frac']:.4f}"
            )
        if "time_vs_verl_path" in row:
            print(
                f"{row['mode']}{' +fused' if row.get('fused') else ''}: the plugin's log-prob pass "
                f"{row['time_vs_verl_path']:.3f}x the step on verl's path, {row['memory_vs_verl_path']:.3f}x its "
                f"peak memory"
            )


def main(argv=None) -> int:
    progress = Progress()
    args = parse_args(argv)
    if args.ray_stand_in or importlib.util.find_spec("ray") is None:
        install_ray_stand_in()
    if args.device == "cpu":
        import torch

        torch.set_num_threads(1)
    result = run(args, progress)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
