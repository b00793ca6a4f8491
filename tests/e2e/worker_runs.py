"""The end-to-end runs, one process per data-parallel rank: `python worker_runs.py SCENARIO --out FILE ...`.

Each scenario trains verl's real worker (tests/e2e/driver.py) and writes what a user would look at (the metrics
verl logs, the plugin's log lines, whether the parameters moved) to a JSON file that test_real_worker.py checks.
They run as processes of their own because verl's platform, the default process group and the plugin's
log-once state are per process, as on a cluster (one worker per process), and so that the pytest process keeps
verl's own platform for the other tests.

Scenarios (`all`: every one, each in a process of its own; what test_real_worker.py runs):
  single    every loss mode through one worker each (2 steps), the Top-K vs binary pairs, the anchor settings
  dp        every loss mode (1 step) and the decoupled recipe on rank --rank of --world-size: the single run's
            first steps, on the same data
  learning  a toy reward, 12 steps, per trust-region mode
  async     every loss mode through verl's separate_async actor (DetachActorWorker), rollouts 0, 2, 8 versions old
            (async_worker.py)
  fused     the Top-K modes and troll with use_fused_kernels=True (the hook fused with the LM head), each beside the
            same step unfused
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

torch.set_num_threads(1)  # one core per process: the ranks and scenarios run side by side on a small machine

from verl_dppo.rehearsal import platform as cpu_platform  # noqa: E402

cpu_platform.install()  # before anything in verl asks for the platform

import async_worker  # noqa: E402
import driver  # noqa: E402

MAIN_SHAPE = driver.RunShape(
    prompts=4,
    samples_per_prompt=4,
    mini_batches=2,
    prompt_length=8,
    response_length=16,
    token_budget=64,
    lr=1e-2,
    seed=0,
)
"""16 sequences of 5-24 tokens: 2 mini-batches per step, 2-4 micro-batches each (token budget 64)."""

COMPARE_SHAPE = replace(MAIN_SHAPE, mini_batches=1)
"""One mini-batch: every micro-batch sees the same pi, so two modes' masks can be compared token by token."""

LEARNING_SHAPE = replace(MAIN_SHAPE, response_length=12, token_budget=256, lr=2e-2)
"""One micro-batch per mini-batch: the gradient is the same as with several (verl normalises by the global
mini-batch), and the learning runs are most of the module's time."""
LEARNING_STEPS = 12

COMPARE_DELTA = {"tv": 0.005, "kl": 0.0002}
"""Thresholds small enough that the bf16/fp32 mismatch at the first update masks some tokens under the binary D."""

NO_TRUST_REGION = {"pg_is"}
"""Registered modes without a trust region (README: PG-IS masks nothing); every other mode gets a learning run."""


def delta_overrides(delta: float) -> tuple[str, ...]:
    return (
        f"actor_rollout_ref.actor.policy_loss.delta_low={delta}",
        f"actor_rollout_ref.actor.policy_loss.delta_high={delta}",
    )


class Runner:
    """Runs in one process (one data-parallel rank), recording what the plugin logs."""

    def __init__(self, model_dir: Path, rank: int = 0, world_size: int = 1):
        self.rank, self.world_size = rank, world_size
        self.model_dir = Path(model_dir)
        self.log = driver.LogCapture()

    def run(
        self, loss_mode: str, shape: driver.RunShape, steps: int, method=None, overrides=(), params: bool = False
    ) -> dict:
        """A fresh worker from the saved model; `steps` training steps, each on a fresh rollout of the bf16 copy
        re-synced from the worker; `params`: also record how far the parameters moved at each step."""
        config = driver.compose_config(
            loss_mode, self.model_dir, shape, world_size=self.world_size, method=method, overrides=tuple(overrides)
        )
        logged_before = len(self.log.messages)
        worker = driver.build_worker(config)
        trainer = driver.Trainer(config, worker, rank=self.rank, world_size=self.world_size)
        rollout_copy = driver.RolloutCopy(self.model_dir, "cpu")
        generator = torch.Generator().manual_seed(shape.seed)
        topk = trainer.topk or 1  # the copy always computes a top-K; it reaches the batch when the run asks
        record = {
            "method": method or driver.method_for_mode(loss_mode),
            "steps": [],
            "rewards": [],
            "checksums": [],
            "param_change": [],
            "seconds": [],
            "mini_batch_tokens": [],
            "token_budget": shape.token_budget,
        }
        try:
            for _ in range(steps):
                start = time.perf_counter()
                before = driver.full_state(worker) if params else None
                rollout_copy.sync(worker)
                rollout = rollout_copy.sample(shape, generator, topk)
                rewards = driver.target_token_reward(rollout)
                record["steps"].append(trainer.step(rollout, rewards))
                record["rewards"].append(float(rewards.mean()))
                record["checksums"].append(rollout.checksum())
                record["mini_batch_tokens"].append(trainer.mini_batch_tokens(rollout))
                if params:
                    after = driver.full_state(worker)
                    record["param_change"].append(max(float((after[k] - before[k]).abs().max()) for k in after))
                record["seconds"].append(time.perf_counter() - start)
        except Exception as error:  # recorded, so that the test shows it next to the other runs' results
            record["error"] = f"{type(error).__name__}: {error}"
            record["traceback"] = traceback.format_exc()
        record["in_effect"] = self.log.in_effect(loss_mode, since=logged_before)
        del worker, trainer, rollout_copy
        gc.collect()
        return record


def scenario_single(runner: Runner) -> dict:
    modes = driver.plugin_loss_modes()
    results = {"modes": {}, "compare": {}, "anchor": {}}
    # The suite composes each recipe once and sets the overrides on copies; `verl-dppo run` composes recipe and
    # overrides in one Hydra call. Both must give the same config.
    from omegaconf import OmegaConf

    method = driver.method_for_mode("dppo_binary_kl", anchor="recompute")
    overrides = delta_overrides(COMPARE_DELTA["kl"])
    both = [
        driver.compose_config(
            "dppo_binary_kl",
            runner.model_dir,
            COMPARE_SHAPE,
            method=method,
            overrides=overrides,
            reuse_composition=reuse,
        )
        for reuse in (True, False)
    ]
    results["composition_agrees"] = OmegaConf.to_container(both[0]) == OmegaConf.to_container(both[1])
    # First, one worker per mode with the recipe's own settings: the first worker of its kind in this process, so
    # its "in effect" line must appear exactly once.
    for mode in modes:
        results["modes"][mode] = runner.run(mode, MAIN_SHAPE, steps=2, params=True)
    # Top-K vs binary D on the same batch and the same pi.
    for topk_mode in [m for m in modes if m.startswith("dppo_topk_")]:
        statistic = topk_mode.removeprefix("dppo_topk_")
        binary_mode = f"dppo_binary_{statistic}"
        if binary_mode not in modes:
            continue
        overrides = delta_overrides(COMPARE_DELTA[statistic])
        for mode in (binary_mode, topk_mode):
            results["compare"][mode] = runner.run(mode, COMPARE_SHAPE, steps=1, overrides=overrides)
    # The anchor: bypass on / off with the rollout anchor, and the decoupled recipe (recomputed anchor).
    mode = "dppo_binary_kl"
    overrides = delta_overrides(COMPARE_DELTA["kl"])
    bypass_off = ("algorithm.rollout_correction.bypass_mode=False",)
    decoupled = driver.method_for_mode(mode, anchor="recompute")
    results["anchor"] = {
        "rollout_bypass": results["compare"].get(mode) or runner.run(mode, COMPARE_SHAPE, 1, overrides=overrides),
        "rollout_recompute_pass": runner.run(mode, COMPARE_SHAPE, 1, overrides=overrides + bypass_off),
        "recompute": runner.run(mode, COMPARE_SHAPE, 1, method=decoupled, overrides=overrides),
    }
    return results


def scenario_dp(runner: Runner) -> dict:
    """Each mode's first single-rank step, through this rank; and the decoupled recipe's, whose recompute pass
    (compute_log_prob) runs on both ranks too."""
    results = {"modes": {mode: runner.run(mode, MAIN_SHAPE, steps=1) for mode in driver.plugin_loss_modes()}}
    mode = "dppo_binary_kl"
    results["recompute"] = runner.run(
        mode,
        COMPARE_SHAPE,
        1,
        method=driver.method_for_mode(mode, anchor="recompute"),
        overrides=delta_overrides(COMPARE_DELTA["kl"]),
    )
    return results


def scenario_learning(runner: Runner) -> dict:
    modes = [m for m in driver.plugin_loss_modes() if m not in NO_TRUST_REGION]
    return {"modes": {mode: runner.run(mode, LEARNING_SHAPE, steps=LEARNING_STEPS) for mode in modes}}


FUSED_MODES = ("dppo_topk_tv", "dppo_topk_kl", "troll", "dppo_binary_tv")
"""The modes whose logits hook runs fused with the LM head under use_fused_kernels (issue 20), and a binary mode,
which takes log pi(a_t) and the entropy from the plugin's one-read head there (issue 54.1)."""


def scenario_fused(runner: Runner) -> dict:
    """Each FUSED_MODES mode: one COMPARE_SHAPE step unfused, then the same step with use_fused_kernels=True (same
    data, same start). A process of its own: verl's fused-kernel patch (`patch_forward_with_backends`) replaces the
    model class's forward for the whole process, so the unfused runs go first, and after each fused build the fused
    forward is kept on the worker's FSDP class only while the bf16 rollout copy samples with the plain one.
    The model ties its embeddings: verl's fused forward reads lm_head.weight outside lm_head's forward, which FSDP2
    (the CPU engine) leaves sharded when it wraps an untied lm_head as a unit of its own (verl's own fused kernel
    fails there; the plugin names the setting). On GPUs the recipes' FSDP1 keeps the LM head in the root unit."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM

    tied = runner.model_dir.parent / "model_tied_embeddings"
    driver.save_model(tied, replace(driver.TINY_MODEL, tie_word_embeddings=True))
    runner = Runner(tied, runner.rank, runner.world_size)

    plain_forward, build, fused_forwards = Qwen3ForCausalLM.forward, driver.build_worker, []

    def build_fused(config):
        worker = build(config)
        module_class = type(worker.actor.engine.module)
        module_class.forward = Qwen3ForCausalLM.forward  # what verl installed: fused for use_fused_kernels=True
        fused_forwards.append(module_class.forward.__name__)
        Qwen3ForCausalLM.forward = plain_forward
        return worker

    modes = [m for m in FUSED_MODES if m in driver.plugin_loss_modes()]
    # The recipes' calculate_entropy=False: no gradient then reaches the model's own output through the entropy,
    # which is how a real fused troll run crashed while this scenario (entropy on) passed (issue 24.1).
    overrides = {
        m: (delta_overrides(COMPARE_DELTA[m.removeprefix("dppo_topk_")]) if m.startswith("dppo_topk_") else ())
        + ("actor_rollout_ref.actor.calculate_entropy=False",)
        for m in modes
    }
    results = {mode: {"unfused": runner.run(mode, COMPARE_SHAPE, steps=1, overrides=overrides[mode])} for mode in modes}
    driver.build_worker = build_fused
    try:
        for mode in modes:
            fused = ("actor_rollout_ref.model.use_fused_kernels=True",)
            results[mode]["fused"] = runner.run(
                mode, COMPARE_SHAPE, steps=1, overrides=overrides[mode] + fused, params=True
            )
    finally:
        driver.build_worker = build
    return {"modes": results, "fused_forwards": fused_forwards}


SCENARIOS = {
    "single": scenario_single,
    "dp": scenario_dp,
    "learning": scenario_learning,
    "fused": scenario_fused,
    "async": async_worker.scenario_async,
}


def run_scenario(scenario: str, out: Path, model_dir: Path, rank: int = 0, world_size: int = 1, port=None) -> None:
    """One process's share: its process group, its scenario, its JSON."""
    start, cpu_start = time.perf_counter(), time.process_time()
    driver.init_distributed("cpu", rank=rank, world_size=world_size, port=port)
    runner = Runner(model_dir, rank, world_size)
    results = SCENARIOS[scenario](runner)
    results["seconds"] = time.perf_counter() - start
    results["cpu_seconds"] = time.process_time() - cpu_start
    Path(out).write_text(json.dumps(results, indent=1))
    torch.distributed.destroy_process_group()


def _forked(scenario, out, model_dir, rank, world_size, port) -> None:
    # torch marks its intra-op thread pool corrupted at fork and rebuilds it at the next set_num_threads; do that
    # here, in the main thread, before any loader thread races to do it (an "Invalid thread pool" assert).
    torch.set_num_threads(1)
    log = open(Path(out).with_suffix(".log"), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    run_scenario(scenario, out, model_dir, rank, world_size, port)


def run_all(out_dir: Path, model_dir: Path, port: int) -> int:
    """Every scenario, each in a process of its own: the two data-parallel ranks and the learning runs are forked
    from this one once verl, transformers and the recipes' compositions are loaded (each would otherwise pay
    for them again on a 2-core machine), and this process then runs the single-rank scenario itself."""
    import multiprocessing

    import verl.workers.engine_workers  # noqa: F401  (the worker and its FSDP engine: imported once, inherited)
    from transformers.models.qwen3 import modeling_qwen3  # noqa: F401

    methods = {driver.method_for_mode(mode) for mode in driver.plugin_loss_modes()}
    methods.add(driver.method_for_mode("dppo_binary_kl", anchor="recompute"))
    driver.compose_recipes(methods)  # inherited by the forked processes
    async_worker.compose_all()
    context = multiprocessing.get_context("fork")
    plan = (
        ("dp0", "dp", 0, 2),
        ("dp1", "dp", 1, 2),
        ("learning", "learning", 0, 1),
        ("async", "async", 0, 1),
        ("fused", "fused", 0, 1),
    )
    children = {
        name: context.Process(
            target=_forked,
            name=name,
            args=(scenario, out_dir / f"{name}.json", model_dir, rank, world_size, port if world_size > 1 else None),
        )
        for name, scenario, rank, world_size in plan
    }
    for child in children.values():
        child.start()
    failed = 0
    try:
        run_scenario("single", out_dir / "single.json", model_dir)
    except Exception:
        traceback.print_exc()
        failed = 1
    for name, child in children.items():
        child.join()
        if child.exitcode != 0:
            print(f"{name} exited with {child.exitcode}; see {out_dir / (name + '.log')}", file=sys.stderr)
            failed = 1
    return failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=sorted(SCENARIOS) + ["all"])
    parser.add_argument("--out", required=True, help="the JSON file (with 'all': the folder of every scenario's)")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args(argv)
    if args.scenario == "all":
        return run_all(Path(args.out), Path(args.model_dir), args.port or driver.free_port())
    run_scenario(args.scenario, Path(args.out), Path(args.model_dir), args.rank, args.world_size, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
