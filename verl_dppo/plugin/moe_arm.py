"""Which arm of the paper's with/without-R3 MoE comparison a composed config launches (`verl-dppo check`'s
summary), and a router replay on a model whose readable config.json names no experts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl_dppo.plugin.router_replay import config_experts

__all__ = ["moe_arm"]


def _model_experts(path: str) -> int | None:
    """The routed experts a model's config.json names (0: dense), None where it is not readable here."""
    import json

    local = Path(path).expanduser()
    try:
        if local.is_dir():
            text = (local / "config.json").read_text()
        else:
            if "://" in path or path.startswith(("/", ".", "~")):
                return None
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
            if not isinstance(cached, str):
                return None
            text = Path(cached).read_text()
        return config_experts(json.loads(text))
    except Exception:  # noqa: BLE001  (unreadable: nothing said)
        return None


ENGINE_REPLAY = {"fsdp": "fsdp_config", "fsdp2": "fsdp_config", "megatron": "megatron", "veomni": "veomni"}
"""actor.strategy -> the actor section whose `router_replay.mode` that engine reads."""


def moe_arm(config: Any) -> tuple[str | None, str | None]:
    """(the MoE arm the command launches, a problem): R3 on the FSDP, Megatron or VeOmni engine, R2, the routing
    mismatch measured without a replay, or none (the paper's without-R3 arm); None where neither a replay is set nor
    the model's config.json (readable here) names experts. The problem: a replay set on a model whose config.json
    names none (on FSDP the plugin's run checks say it already)."""
    from omegaconf import OmegaConf

    actor = config.actor_rollout_ref.actor
    strategy = str(actor.get("strategy", "fsdp"))
    section = ENGINE_REPLAY.get(strategy)
    mode = str(OmegaConf.select(actor, f"{section}.router_replay.mode", default=None) or "disabled") if section \
        else "disabled"
    experts = _model_experts(str(config.actor_rollout_ref.model.get("path", "")))
    engine = {"fsdp": "FSDP", "fsdp2": "FSDP", "megatron": "Megatron", "veomni": "VeOmni"}.get(strategy, strategy)
    if mode == "disabled":
        if not experts:
            return None, None
        return (f"MoE arm: without R3 (the paper's without-R3 arm: the {engine} trainer's {experts}-expert routers "
                "choose their own experts, unlike the rollout's on some tokens)"), None
    kind = {"R3": "R3: the rollout's routes replayed", "R2": "R2: the routes recorded in verl's recompute pass "
            "replayed", "measure": "without R3, its routing mismatch measured (routes compared, not replayed)"
            }.get(mode, f"router_replay.mode={mode}")
    who = "the plugin's replay" if section == "fsdp_config" else "verl's replay"
    arm = f"MoE arm: {kind} on the {engine} engine ({who})"
    if experts == 0 and section != "fsdp_config":
        return arm, (f"actor_rollout_ref.actor.{section}.router_replay.mode={mode}, but the model's config.json "
                     f"({config.actor_rollout_ref.model.path}) names no routed experts: a dense model routes "
                     "nothing (drop the router replay settings)")
    return arm, None
