"""R3 on verl's FSDP engine (verl_dppo.plugin.moe.router_replay has the why and the what).

| verl / transformers                                              | patched                                        |
|------------------------------------------------------------------|------------------------------------------------|
| workers.engine.fsdp.transformer_impl `FSDPEngineWithLMHead.prepare_model_inputs` | after verl packed, padded and sliced the micro-batch's tokens: the same rows of its `routed_experts` armed in the model's routers (router_replay.mode=R3 only) |
| transformers' `Qwen3MoeTopKRouter`, `Qwen2MoeTopKRouter`, `MixtralTopKRouter` `.forward` | the armed rows replayed; the original forward when none |

verl 0.9.1 has no hook in its FSDP engine for routing (its R3 lives in the Megatron and VeOmni engines, where a
replay controller is tapped into the MoE layer the same way). The change that would make this unnecessary: the FSDP
engine arming a replay controller in `prepare_model_inputs`, as `VeOmniEngineWithLMHead` does.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from verl_dppo.patches._import_hook import patch_once, when_imported
from verl_dppo.plugin.moe.router_replay import RouterReplayError, arm, replaying_forward

__all__ = ["install", "replay_rows", "replay_marks", "response_lengths", "r3_enabled", "replay_mode"]

_ROUTER_MODULES = {
    "transformers.models.qwen3_moe.modeling_qwen3_moe": "Qwen3MoeTopKRouter",
    "transformers.models.qwen2_moe.modeling_qwen2_moe": "Qwen2MoeTopKRouter",
    "transformers.models.mixtral.modeling_mixtral": "MixtralTopKRouter",
}


def replay_mode(engine: Any) -> str:
    """This engine's own `fsdp_config.router_replay.mode` (the actor's; the reference model's config has its own, off
    unless set): "R3", "measure" (the rollout's routes compared, not replayed: the without-R3 arm, its routing
    mismatch measured) or "disabled"."""
    replay = getattr(getattr(engine, "engine_config", None), "router_replay", None)
    mode = replay.get("mode", "disabled") if isinstance(replay, dict) else getattr(replay, "mode", "disabled")
    return str(mode)  # a dataclass, or the plain dict verl 0.9.1's worker leaves there for an added key


def r3_enabled(engine: Any) -> bool:
    """Whether this engine's config asks R3 or its measurement alone (the routes go to its routers either way)."""
    return replay_mode(engine) in ("R3", "measure")


def response_lengths(response_mask: Any) -> torch.Tensor:
    """Each sequence's number of response tokens, from verl's `response_mask` (nested as verl packs it, or padded)."""
    if getattr(response_mask, "is_nested", False):
        values, offsets = response_mask.values(), response_mask.offsets()
        sums = torch.cumsum(torch.cat([values.new_zeros(1), values.long()]), 0)
        return sums[offsets[1:]] - sums[offsets[:-1]]
    return response_mask.long().sum(dim=-1)


def replay_marks(lengths: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """[packed rows] bool: the rows that carry a rollout route, as verl's own R3 marks them (`build_r3_replay_mask`,
    its Megatron engine): every token of a sequence but its last, whose route the rollout never recorded (it samples
    that token, never feeds it); no token of a sequence without a response token (verl's padding samples)."""
    if lengths.shape != responses.shape:
        raise RouterReplayError(
            f"router replay: the micro-batch has {lengths.numel()} sequences, its response_mask {responses.numel()}"
        )
    lengths, responses = torch.stack([lengths.long(), responses.long().to(lengths.device)]).cpu()  # one transfer
    replayed = torch.where(responses > 0, lengths - 1, torch.zeros_like(lengths))
    counts = torch.stack([replayed, lengths - replayed], dim=1).flatten()
    return torch.repeat_interleave(torch.tensor([True, False]).repeat(lengths.numel()), counts)


def replay_rows(
    routes: Any, packed: int, static_pad: int, sp_size: int, sp_rank: int, responses: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout's routes of a micro-batch ([sequences, tokens, layers, top-k], nested as verl packs `input_ids`)
    laid out as the model's MoE layers see the tokens: packed (`packed` rows), padded by verl's static pad, then
    padded to a multiple of the Ulysses group and this rank's slice taken (verl's rule for `input_ids`); and which of
    those rows carry a route (`replay_marks`, from each sequence's response length `responses`; None: every row of a
    sequence but its last). Padding rows are zeros and carry none (the router routes them itself)."""
    nested = getattr(routes, "is_nested", False)
    rows = routes.values() if nested else routes.reshape(-1, *routes.shape[-2:])
    if rows.shape[0] != packed:
        raise RouterReplayError(
            f"router replay: the micro-batch packs {packed} tokens, its routed_experts {rows.shape[0]}"
        )
    lengths = routes.offsets().diff() if nested else torch.full((routes.shape[0],), routes.shape[1])
    marked = replay_marks(lengths, torch.ones_like(lengths) if responses is None else responses)
    pad = static_pad
    if sp_size > 1:
        pad += (-(packed + static_pad)) % sp_size
    if pad:
        rows = torch.cat([rows, rows.new_zeros((pad, *rows.shape[1:]))])
        marked = torch.cat([marked, marked.new_zeros(pad)])
    if sp_size > 1:
        share = rows.shape[0] // sp_size
        rows = rows[sp_rank * share : (sp_rank + 1) * share]
        marked = marked[sp_rank * share : (sp_rank + 1) * share]
    return rows, marked


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
                    "them: vLLM)"
                )
            if not tu_bool(micro_batch, "use_remove_padding"):
                raise RouterReplayError("router_replay.mode=R3 on the FSDP engine needs use_remove_padding=True")
            input_ids = micro_batch["input_ids"]
            packed = int(input_ids.values().shape[0]) if input_ids.is_nested else int(input_ids.numel())
            sp_size = int(getattr(self, "ulysses_sequence_parallel_size", 1) or 1)
            sp_rank = 0
            if sp_size > 1:
                from verl.utils.ulysses import get_ulysses_sequence_parallel_rank

                sp_rank = get_ulysses_sequence_parallel_rank()
            response_mask = micro_batch.get("response_mask", None)
            responses = response_lengths(response_mask) if response_mask is not None else None
            rows, marked = replay_rows(routes, packed, self._get_packed_pad_size(packed), sp_size, sp_rank, responses)
            local = model_inputs["input_ids"].shape[-1]
            if rows.shape[0] != local:
                raise RouterReplayError(
                    f"router replay: this rank routes {local} rows, the routes were laid out for {rows.shape[0]}"
                )
            device = model_inputs["input_ids"].device
            arm(self.module, rows.to(device), marked.to(device), replay=replay_mode(self) == "R3")
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
