"""Which arm of the paper's with/without-R3 MoE comparison a composed config launches (`verl-dppo check`'s
summary). A replay on a model whose readable config.json names no experts is a run check's problem
(`verl_dppo.plugin.run_config.router_replay_model_problem`), for `check`, `run --dry-run` and the launch alike."""

from __future__ import annotations

from typing import Any

from verl_dppo.plugin.moe.router_replay import model_experts

__all__ = ["ENGINE_REPLAY", "replay_mode", "moe_arm"]


ENGINE_REPLAY = {"fsdp": "fsdp_config", "fsdp2": "fsdp_config", "megatron": "megatron", "veomni": "veomni"}
"""actor.strategy -> the actor section whose `router_replay.mode` that engine reads."""


def replay_mode(config: Any) -> tuple[str, str | None]:
    """(the router_replay.mode the actor's engine reads, "disabled" where none; that engine's actor section)."""
    from omegaconf import OmegaConf

    actor = config.actor_rollout_ref.actor
    section = ENGINE_REPLAY.get(str(actor.get("strategy", "fsdp")))
    mode = OmegaConf.select(actor, f"{section}.router_replay.mode", default=None) if section else None
    return str(mode or "disabled"), section


def moe_arm(config: Any) -> str | None:
    """The MoE arm the command launches: R3 on the FSDP, Megatron or VeOmni engine, R2, the routing mismatch
    measured without a replay, or none (the paper's without-R3 arm); None where neither a replay is set nor the
    model's config.json (readable here) names experts."""
    strategy = str(config.actor_rollout_ref.actor.get("strategy", "fsdp"))
    mode, section = replay_mode(config)
    experts = model_experts(str(config.actor_rollout_ref.model.get("path", "")))
    engine = {"fsdp": "FSDP", "fsdp2": "FSDP", "megatron": "Megatron", "veomni": "VeOmni"}.get(strategy, strategy)
    if mode == "disabled":
        if not experts:
            return None
        return (
            f"MoE arm: without R3 (the paper's without-R3 arm: the {engine} trainer's {experts}-expert routers "
            "choose their own experts, unlike the rollout's on some tokens)"
        )
    kind = {
        "R3": "R3: the rollout's routes replayed",
        "R2": "R2: the routes recorded in verl's recompute pass replayed",
        "measure": "without R3, its routing mismatch measured (routes compared, not replayed)",
    }.get(mode, f"router_replay.mode={mode}")
    who = "the plugin's replay" if section == "fsdp_config" else "verl's replay"
    return f"MoE arm: {kind} on the {engine} engine ({who})"
