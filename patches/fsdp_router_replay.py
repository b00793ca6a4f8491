"""R3 on verl's FSDP engine (verl_dppo.plugin.router_replay has the why and the what).

| verl / transformers                                              | patched                                        |
|------------------------------------------------------------------|------------------------------------------------|
| workers.engine.fsdp.transformer_impl `FSDPEngineWithLMHead.prepare_model_inputs` | after verl packed, padded and sliced the micro-batch's tokens: the same rows of its `routed_experts` armed in the model's routers (router_replay.mode=R3 only) |
| transformers' `Qwen3MoeTopKRouter`, `Qwen2MoeTopKRouter`, `MixtralTopKRouter` `.forward` | the armed rows replayed; the original forward when none |

verl 0.9.1 has no hook in its FSDP engine for routing (its R3 lives in the Megatron and VeOmni engines, where a
replay controller is tapped into the MoE layer the same way). The change that would make this unnecessary: the FSDP
engine arming a replay controller in `prepare_model_inputs`, as `VeOmniEngineWithLMHead` does.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_dppo.patches._import_hook import patch_once, when_imported
from verl_dppo.plugin.router_replay import RouterReplayError, arm, replaying_forward

__all__ = ["install", "replay_rows", "r3_enabled"]

_ROUTER_MODULES = {"transformers.models.qwen3_moe.modeling_qwen3_moe": "Qwen3MoeTopKRouter",
                   "transformers.models.qwen2_moe.modeling_qwen2_moe": "Qwen2MoeTopKRouter",
                   "transformers.models.mixtral.modeling_mixtral": "MixtralTopKRouter"}


def r3_enabled(engine: Any) -> bool:
    """Whether this engine's own config asks R3 (`fsdp_config.router_replay.mode=R3`: the actor's; the reference
    model's config has its own, off unless set)."""
    replay = getattr(getattr(engine, "engine_config", None), "router_replay", None)
    mode = replay.get("mode", "disabled") if isinstance(replay, dict) else getattr(replay, "mode", "disabled")
    return str(mode) == "R3"  # a dataclass, or the plain dict verl 0.9.1's worker leaves there for an added key


def replay_rows(routes: Any, packed: int, static_pad: int, sp_size: int, sp_rank: int) -> torch.Tensor:
    """The rollout's routes of a micro-batch ([sequences, tokens, layers, top-k], nested as verl packs `input_ids`)
    laid out as the model's MoE layers see the tokens: packed (`packed` rows), padded by verl's static pad, then
    padded to a multiple of the Ulysses group and this rank's slice taken (verl's rule for `input_ids`). Padding rows
    are zeros: no route (the router routes them itself)."""
    rows = routes.values() if getattr(routes, "is_nested", False) else routes.reshape(-1, *routes.shape[-2:])
    if rows.shape[0] != packed:
        raise RouterReplayError(f"router replay: the micro-batch packs {packed} tokens, its routed_experts "
                                f"{rows.shape[0]}")
    pad = static_pad
    if sp_size > 1:
        pad += (-(packed + static_pad)) % sp_size
    if pad:
        rows = torch.cat([rows, rows.new_zeros((pad, *rows.shape[1:]))])
    if sp_size > 1:
        share = rows.shape[0] // sp_size
        rows = rows[sp_rank * share:(sp_rank + 1) * share]
    return rows


def patch_fsdp_engine(module: Any) -> None:
    def make(original):
        def prepare_model_inputs(self, micro_batch):
            model_inputs, output_args = original(self, micro_batch)
            if not r3_enabled(self):
                return model_inputs, output_args
            routes = micro_batch.get("routed_experts", None) if hasattr(micro_batch, "get") else None
            if routes is None:
                raise RouterReplayError(
                    "router_replay.mode=R3, but the micro-batch has no routed_experts: the rollout returned no routes "
                    "(set actor_rollout_ref.rollout.enable_rollout_routing_replay=True, on a rollout that returns "
                    "them: vLLM)")
            if not tu_bool(micro_batch, "use_remove_padding"):
                raise RouterReplayError("router_replay.mode=R3 on the FSDP engine needs use_remove_padding=True")
            input_ids = micro_batch["input_ids"]
            packed = int(input_ids.values().shape[0]) if input_ids.is_nested else int(input_ids.numel())
            sp_size = int(getattr(self, "ulysses_sequence_parallel_size", 1) or 1)
            sp_rank = 0
            if sp_size > 1:
                from verl.utils.ulysses import get_ulysses_sequence_parallel_rank

                sp_rank = get_ulysses_sequence_parallel_rank()
            rows = replay_rows(routes, packed, self._get_packed_pad_size(packed), sp_size, sp_rank)
            local = model_inputs["input_ids"].shape[-1]
            if rows.shape[0] != local:
                raise RouterReplayError(f"router replay: this rank routes {local} rows, the routes were laid out for "
                                        f"{rows.shape[0]}")
            arm(self.module, rows.to(model_inputs["input_ids"].device))
            return model_inputs, output_args

        return prepare_model_inputs

    patch_once(module.FSDPEngineWithLMHead, "prepare_model_inputs", make)


def tu_bool(micro_batch: Any, key: str) -> bool:
    from verl.utils import tensordict_utils as tu

    return bool(tu.get_non_tensor_data(data=micro_batch, key=key, default=True))


def _patch_router(class_name: str):
    def patch(module: Any) -> None:
        patch_once(getattr(module, class_name), "forward", replaying_forward)

    return patch


def install() -> None:
    when_imported("verl.workers.engine.fsdp.transformer_impl", patch_fsdp_engine)
    for name, class_name in _ROUTER_MODULES.items():
        when_imported(name, _patch_router(class_name))
