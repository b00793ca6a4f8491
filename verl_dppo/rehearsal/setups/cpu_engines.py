"""Which of verl's engines a `trainer.device=cpu` run can use, and the settings each needs there.

- `engine_settings(config)`: vLLM's CPU build as the rollout (`vllm_cpu`), verl's Megatron engine for training
  (`megatron_cpu`), and the run's experiment-name suffix (`dppo.rollout_suffix`) naming what differs from a cpu_tiny
  run on the `hf` rollout and FSDP2 with the dense model (`-vllm`, `-megatron`, `-moe4`), so that no run resumes
  another kind's checkpoint.
- `check_engine(config)`, `strategy_problem(config)`: an engine group or actor strategy the CPU cannot run;
  `r3_problems(config)`: what R3 needs on the CPU.
"""

from __future__ import annotations

from typing import Any, Optional

from verl_dppo.errors import UsageError

__all__ = [
    "CpuRunError",
    "check_engine",
    "engine_settings",
    "is_cpu_run",
    "r3_problems",
    "run_suffix",
    "strategy_problem",
]


class CpuRunError(UsageError, ValueError):
    """A CPU run or the cpu_tiny build cannot go ahead; the message names the setting or path to change."""


def is_cpu_run(config: Any) -> bool:
    return str(config.trainer.get("device", "cuda")) == "cpu"


def _uses(config: Any) -> tuple[bool, bool, int]:
    """(vLLM rollout, Megatron engine, the cpu_tiny model's experts)."""
    tiny = config.get("dppo", {}).get("tiny_model", {}) or {}
    return (
        str(config.actor_rollout_ref.rollout.get("name")) == "vllm",
        str(config.get("model_engine", "dp")) == "megatron",
        int(tiny.get("num_experts", 0) or 0),
    )


def run_suffix(config: Any) -> str:
    vllm, megatron, experts = _uses(config)
    return ("-vllm" if vllm else "") + ("-megatron" if megatron else "") + (f"-moe{experts}" if experts > 0 else "")


def engine_settings(config: Any) -> None:
    vllm, megatron, _ = _uses(config)
    if vllm:
        from verl_dppo.rehearsal.setups.vllm_cpu import vllm_cpu_settings

        vllm_cpu_settings(config)
    if megatron:
        from verl_dppo.rehearsal.setups.megatron_cpu import megatron_cpu_settings

        megatron_cpu_settings(config)
    if config.get("dppo", {}).get("rollout_suffix") is not None:
        from omegaconf import open_dict

        with open_dict(config.dppo):
            config.dppo.rollout_suffix = run_suffix(config)


def check_engine(config: Any) -> None:
    """A CPU run with an engine group other than verl's `dp` (FSDP) or `megatron` (megatron-core and mbridge at the
    shim's versions): refused before verl's validation, whose own error would not say why."""
    engine = str(config.get("model_engine", "dp"))
    if not is_cpu_run(config):
        return
    if engine == "dp":
        replay = (config.actor_rollout_ref.actor.get("fsdp_config") or {}).get("router_replay", None) or {}
        if str(replay.get("mode", "disabled")) in ("R3", "measure") and _uses(config)[2] <= 0:
            raise CpuRunError(
                "the run cannot start: R3 replays a MoE model's routes, and cpu_tiny's model is dense: "
                "add dppo.tiny_model.num_experts=4"
            )
        return
    if engine == "megatron":
        from verl_dppo.rehearsal.setups.megatron_cpu import megatron_cpu_problems

        problems = megatron_cpu_problems(config) + r3_problems(config)
        if problems:
            raise CpuRunError("the run cannot start: " + problems[0])
        return
    raise CpuRunError(
        f"the run cannot start: model_engine={engine}: on CPU (trainer.device=cpu) verl's dp (FSDP2) and megatron "
        f"engines run ({engine} is not supported there): drop the model_engine override, or run on GPUs "
        "(trainer.device=cuda)"
    )


def r3_problems(config: Any) -> list[str]:
    """R3 (rollout router replay) on a CPU run with model_engine=megatron: what it needs there (docs/megatron.md)."""
    actor = config.actor_rollout_ref.actor
    replay = str((actor.get("megatron") or {}).get("router_replay", {}).get("mode", "disabled"))
    returned = bool(config.actor_rollout_ref.rollout.get("enable_rollout_routing_replay", False))
    if replay != "R3" and not returned:
        return []
    vllm, _, experts = _uses(config)
    both = (
        "actor_rollout_ref.actor.megatron.router_replay.mode=R3 with "
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"
    )
    if replay != "R3" or not returned:
        return [
            f"R3 takes two settings, {both} (the rollout returns its routes, the trainer replays them); this run "
            f"has router_replay.mode={replay}, enable_rollout_routing_replay={returned}"
        ]
    if not vllm:
        return [
            "R3 on the Megatron engine on the CPU needs the vllm rollout (actor_rollout_ref.rollout.name=vllm), "
            "whose routes the shim lays out as it is tested; the hf rollout's routes are replayed on the FSDP "
            "engine (model_engine=dp)"
        ]
    if experts <= 0:
        return ["R3 replays a MoE model's routes, and cpu_tiny's model is dense: add dppo.tiny_model.num_experts=4"]
    if int((actor.get("megatron") or {}).get("tensor_model_parallel_size", 1)) > 1:
        return [
            "R3 on the CPU runs at actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1: verl splits the "
            "routes across tensor-parallel ranks for sequence parallelism, which needs TransformerEngine"
        ]
    return []


def strategy_problem(config: Any) -> Optional[str]:
    strategy = str(config.actor_rollout_ref.actor.get("strategy"))
    if strategy == "megatron" and str(config.get("model_engine", "dp")) != "megatron":
        return (
            "actor_rollout_ref.actor.strategy=megatron needs verl's megatron engine group: set "
            "model_engine=megatron (the CPU settings it needs come with it), or actor_rollout_ref.actor.strategy=fsdp2"
        )
    if strategy not in ("fsdp2", "megatron"):
        return (
            f"actor_rollout_ref.actor.strategy={strategy}: on CPU (trainer.device=cpu) verl's FSDP2 and Megatron "
            f"engines run ({strategy} does not run on CPU): set actor_rollout_ref.actor.strategy=fsdp2 (or "
            "model_engine=megatron), or run on GPUs (trainer.device=cuda)"
        )
    return None
