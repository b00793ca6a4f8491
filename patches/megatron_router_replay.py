"""R3 visible on verl's Megatron engine: what its routers replayed, counted per micro-batch for the loss's metrics.

| verl                                                                        | patched                                       |
|-----------------------------------------------------------------------------|-----------------------------------------------|
| workers.engine.megatron.transformer_impl `set_router_replay_data` (as the engine calls it) | then: a micro-batch's counts start (verl_dppo.plugin.moe.router_replay.begin_counting) |
| utils.megatron.router_replay_patch `RouterReplay.get_replay_topk`           | then, replaying forward: the rows counted (`count_rows`) |

verl 0.9.1 replays the rollout's routes in its Megatron engine (`RouterReplay`, one per MoE router: the experts of
the rows its replay mask marks are the rollout's, the others the router's own top-k) and reports nothing about it.
Each time a router replays forward (not backward's recomputation, which replays the same experts again), the patch
counts the rows with a route, those whose experts handed to the MoE layer are the route's, and those where the
router's own top-k (verl's `default_compute_topk` on the same scores) would have chosen another set, and how well the
routes fit the router's ranking of the same scores: the loss reports them as `actor/dppo/r3_replayed_frac`,
`actor/dppo/r3_router_differs_frac`, `actor/dppo/r3_route_fit` and `actor/dppo/r3_unrouted_frac`, as on the FSDP
engine. Counted from the replay's own tensors after it ran, so the CPU shim's layout of the rows
(verl_dppo.rehearsal.megatron_r3) is what is counted. Under pipeline parallelism the loss's rank counts the routers
of its own stage.

The change that would make this unnecessary: verl's `RouterReplay` counting what it replayed.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_dppo.patches._import_hook import patch_once, when_imported
from verl_dppo.plugin.moe.router_replay import begin_counting, count_rows

__all__ = ["install", "patch_engine", "patch_router_replay"]


def patch_engine(module: Any) -> None:
    def make(original):
        def set_router_replay_data(*args, **kwargs):
            result = original(*args, **kwargs)
            begin_counting(True)  # the micro-batch's forward replays next
            return result

        return set_router_replay_data

    patch_once(module, "set_router_replay_data", make)


def patch_router_replay(module: Any) -> None:
    forward = module.RouterReplayAction.REPLAY_FORWARD

    def make(original):
        def get_replay_topk(self, scores, topk, *args, **kwargs):
            result = original(self, scores, topk, *args, **kwargs)
            compute = kwargs.get("default_compute_topk")
            targets = self.target_topk_idx
            if self.router_replay_action != forward or targets is None or compute is None:
                return result
            with torch.no_grad():
                _, own = compute(
                    scores.detach(), topk, num_groups=kwargs.get("num_groups"), group_topk=kwargs.get("group_topk")
                )
                mask = self.target_replay_mask
                has_route = (
                    torch.ones(scores.shape[0], dtype=torch.bool, device=own.device)
                    if mask is None
                    else mask.reshape(-1).to(own.device).bool()
                )
                count_rows(
                    targets.to(own.device).long(), has_route, result[1].long(), own.long(), scores=scores.detach()
                )
            return result

        return get_replay_topk

    patch_once(module.RouterReplay, "get_replay_topk", make)


def install() -> None:
    when_imported("verl.workers.engine.megatron.transformer_impl", patch_engine)
    when_imported("verl.utils.megatron.router_replay_patch", patch_router_replay)
