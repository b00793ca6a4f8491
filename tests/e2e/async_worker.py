"""The `separate_async` actor end to end (issue 14.5): verl's real `DetachActorWorker`, trained on rollouts from a
bf16 copy of the policy k weight versions old (k = 0, 2, 8), the lag as verl's async trainer reports it.

What is real: the recipe composed with the recipes' switch (`trainer_mode=separate_async`, as `verl-dppo run
--trainer-mode separate_async` composes it) and verl's validation; `DetachActorWorker` (the class
`PPOTrainerSeparateAsync` puts in the actor role) with its model, optimizer and checkpoint engine built by
`init_model`; every weight push through the worker's own `update_weights(global_steps=v)`, which hands verl's
engine export to the checkpoint engine (`checkpoint_engine.backend`, loaded through verl's `custom_backend_module`
hook); `save_model_to_cpu` / `restore_model_from_cpu` (verl's decoupled-PPO tools of that worker) to measure every k
against the same policy; `update_actor` with each sample's `extra_fields` (`min_global_steps` / `max_global_steps`)
as the v1 agent loop stores them.
What stands in: the checkpoint engine's far side. `RolloutCopyEngine` keeps each pushed version (cast to bf16)
where the rollout copy loads it, in this process, instead of sending it over NCCL to a vLLM server.
"""

from __future__ import annotations

import asyncio
import gc
import time
import traceback
from typing import Any

import torch

import driver

BACKEND = "dppo_e2e_rollout_copy"
MODULE = "async_worker"
"""This module, as verl's `checkpoint_engine.custom_backend_module` imports it (tests/e2e is on sys.path)."""

STALENESS = (0, 2, 8)
"""Weight versions between the trainer and the copy that samples the measured batch."""
VERSIONS = max(STALENESS)
"""Training steps (one weight push each) before the measured batch: the trainer is at version VERSIONS."""

SHAPE = driver.RunShape(
    prompts=4,
    samples_per_prompt=4,
    mini_batches=1,
    prompt_length=8,
    response_length=16,
    token_budget=64,
    lr=5e-3,
    seed=0,
)
"""16 sequences, one mini-batch (every micro-batch of the measured step sees the same pi) of 2-4 micro-batches."""

MEASURE_SEED = 1234
"""The measured batches' sampling seed: the same prompts and sampling noise for every k."""

_received: dict[int, dict[str, torch.Tensor]] = {}
"""The versions the rollout side received: global_steps -> the weights (bf16), in this process."""


def _register_backend():
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

    @CheckpointEngineRegistry.register(BACKEND)
    class RolloutCopyEngine(CheckpointEngine):
        """A checkpoint engine whose rollout side is the bf16 copy in this process: `send_weights` stores the
        version the trainer pushes under its `global_steps` label, `receive_weights` hands it out again."""

        def __init__(self, bucket_size: int, is_master: bool = False, **kwargs: Any) -> None:
            self.bucket_size, self.is_master = bucket_size, is_master

        def prepare(self) -> dict:
            return {}

        @classmethod
        def build_topology(cls, actor_wg_world_size, rollout_world_size, metadata):
            return {}, {}

        def init_process_group(self, **kwargs) -> None:
            pass

        def finalize(self) -> None:
            pass

        async def send_weights(self, weights, global_steps=None):
            if global_steps is None:
                raise ValueError("a weight push without its version (global_steps)")
            _received[int(global_steps)] = {
                name: tensor.detach().to("cpu", torch.bfloat16).clone() for name, tensor in weights
            }

        async def receive_weights(self, global_steps=None):
            for item in _received[int(global_steps)].items():
                yield item

    return RolloutCopyEngine


RolloutCopyEngine = _register_backend()


def versions(version: int, count: int) -> list[dict]:
    """Each sample's `extra_fields` versions: sampled start to end by weights `version` (verl's
    FullyAsyncLLMServerClient sets min/max over a response's resumed replies)."""
    return [{"min_global_steps": version, "max_global_steps": version} for _ in range(count)]


def push(worker: Any, version: int) -> None:
    """`update_weights(global_steps=version)` as `CheckpointEngineManager.update_weights` calls it on the actor."""
    asyncio.run(worker.update_weights(global_steps=version))


ENGINE_OVERRIDES = (
    f"actor_rollout_ref.rollout.checkpoint_engine.backend={BACKEND}",
    f"actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module={MODULE}",
)
"""The checkpoint engine whose far side is the rollout copy, loaded as verl loads a custom one."""


def build_worker(config: Any) -> Any:
    """verl's separate_async actor, `DetachActorWorker`, in the actor role, its model, optimizer and checkpoint
    engine built (init_model)."""
    from verl.experimental.separation.engine_workers import DetachActorWorker

    worker = DetachActorWorker(config.actor_rollout_ref, role="actor")
    worker.init_model()
    return worker


def run_mode(runner: Any, loss_mode: str) -> dict:
    record: dict[str, Any] = {"method": driver.method_for_mode(loss_mode), "warm_rewards": [], "stale": {}}
    start = time.perf_counter()
    try:
        config = driver.compose_config(
            loss_mode, runner.model_dir, SHAPE, trainer_mode="separate_async", overrides=ENGINE_OVERRIDES
        )
        record["parameter_sync_step"] = int(config.trainer.v1.separate_async.parameter_sync_step)
        record["max_off_policy_threshold"] = config.actor_rollout_ref.actor.policy_loss.max_off_policy_threshold
        worker = build_worker(config)
        record["worker_class"] = type(worker).__name__
        record["checkpoint_engine"] = type(worker.checkpoint_engine).__name__
        trainer = driver.Trainer(config, worker)
        rollout_copy = driver.RolloutCopy(runner.model_dir, "cpu")
        topk = trainer.topk or 1
        generator = torch.Generator().manual_seed(SHAPE.seed)
        _received.clear()
        push(worker, 0)  # on_init_end: the rollout starts from version 0
        for version in range(1, VERSIONS + 1):  # one training step per version, on-policy (lag 0)
            rollout_copy.load(_received[version - 1].items())
            rollout = rollout_copy.sample(SHAPE, generator, topk)
            rewards = driver.target_token_reward(rollout)
            trainer.step(rollout, rewards, versions(version - 1, len(rollout.responses)))
            record["warm_rewards"].append(float(rewards.mean()))
            push(worker, version)  # on_step_end
        record["pushed"] = sorted(_received)
        worker.save_model_to_cpu(VERSIONS)
        for k in STALENESS:
            worker.restore_model_from_cpu(VERSIONS)  # the same pi for every k
            rollout_copy.load(_received[VERSIONS - k].items())
            rollout = rollout_copy.sample(SHAPE, torch.Generator().manual_seed(MEASURE_SEED), topk)
            metrics = trainer.step(
                rollout, driver.target_token_reward(rollout), versions(VERSIONS - k, len(rollout.responses))
            )
            record["stale"][str(k)] = metrics
    except Exception as error:  # recorded, so that the test shows it next to the other modes' results
        record["error"] = f"{type(error).__name__}: {error}"
        record["traceback"] = traceback.format_exc()
    record["seconds"] = time.perf_counter() - start
    gc.collect()
    return record


def scenario_async(runner: Any) -> dict:
    return {"modes": {mode: run_mode(runner, mode) for mode in driver.plugin_loss_modes()}}


def compose_all() -> None:
    """The recipes under separate_async, composed once (forked processes inherit them)."""
    driver.compose_recipes({driver.method_for_mode(mode) for mode in driver.plugin_loss_modes()}, "separate_async")


__all__ = [
    "BACKEND",
    "ENGINE_OVERRIDES",
    "STALENESS",
    "VERSIONS",
    "RolloutCopyEngine",
    "build_worker",
    "compose_all",
    "push",
    "scenario_async",
    "versions",
]
