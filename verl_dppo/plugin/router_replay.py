"""R3 on verl's FSDP engine: the trainer's MoE routers replay the experts the rollout engine routed each token to.

verl 0.9.1 replays routes on its Megatron and VeOmni engines only; its FSDP engine trains the Hugging Face model,
whose sparse-MoE layers choose their experts in a router module (`Qwen3MoeTopKRouter`, `Qwen2MoeTopKRouter`,
`MixtralTopKRouter` in transformers 5: `forward(hidden) -> (logits, weights, experts)`). With
`actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3` and the rollout's `enable_rollout_routing_replay=True`,
verl's agent loop puts the rollout's routes in the batch (`routed_experts`, [tokens, layers, top-k] per sequence,
by absolute decoder-layer index, as vLLM captures them), and verl's no-padding layout packs them like `input_ids`.

`arm(module, routes)` (called by patches/fsdp_router_replay.py for every micro-batch the engine runs, right after
verl's `prepare_model_inputs` packed, padded and Ulysses-sliced the tokens) hands each router of that engine's model
its layer's rows. A router with rows replays them: the experts are the rollout's, the weights the trainer's own
router probabilities at those experts, normalised as the model normalises its top-k (`norm_topk_prob`; Mixtral
always), so the gradient reaches the router as in the model's own forward. A row without a route (the packed
layout's padding, the response's last token, which the rollout never fed back: all-zero rows, or any row whose
experts repeat) is routed by the router's own top-k, and counted. Gradient checkpointing's recomputation fires the
same router with the same rows (they stay armed until the engine's next micro-batch), so backward sees the forward's
experts. Another engine in the process (the reference model) is armed by its own config only.

Per micro-batch, `take_counts` gives what the loss reports, counted on each layer's first forward only, over the rows
that carry a rollout route: `actor/dppo/r3_replayed_frac`, the share whose experts the layer handed on (what the
update computes with) are exactly the rollout's (1 under R3); `actor/dppo/r3_router_differs_frac`, the share where
the router's own top-k would have chosen another set (the routing mismatch R3 removes); and
`actor/dppo/r3_unrouted_frac`, the share of all rows the layers routed that carried no route (padding, last tokens).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["ROUTER_CLASSES", "RouterReplayError", "arm", "begin_counting", "count_rows", "routers_of",
           "replaying_forward", "take_counts", "ratio_parts"]

ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter")
"""transformers' MoE router classes R3 replays on (one `forward(hidden) -> (logits, weights, experts)` each)."""

_COUNTS: dict[str, Any] = {"routed": 0, "with_route": 0, "replayed": 0, "differs": 0}
"""Since the last `arm` (or `begin_counting`): rows routed by armed routers; of them, rows with a rollout route; of
those, rows whose experts handed on were exactly the route's, and rows the router's own top-k would have routed
otherwise (tensors on the model's device until read: no wait for the GPU per layer)."""
_ARMED = [False]
_GENERATION = [0]


class RouterReplayError(RuntimeError):
    """R3 configured where it cannot act: no routes in the batch, no router in the model, a layer count that does
    not match, rows that do not align."""


def routers_of(module: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder-layer index, router) for every MoE router of a model, by its name's `layers.<i>.` (the absolute index
    the rollout's routes are laid out by), in layer order."""
    found = []
    for name, child in module.named_modules():
        if type(child).__name__ not in ROUTER_CLASSES:
            continue
        parts = name.split(".")
        index = next((int(parts[i + 1]) for i in range(len(parts) - 1)
                      if parts[i] == "layers" and parts[i + 1].isdigit()), None)
        if index is None:
            raise RouterReplayError(f"router replay: cannot tell the decoder layer of the MoE router {name!r}")
        found.append((index, child))
    return sorted(found, key=lambda item: item[0])


def arm(module: torch.nn.Module, routes: Optional[torch.Tensor]) -> int:
    """Give each router of `module` its rows of `routes` ([rows, layers, top-k], the rows the model's MoE layers will
    route in this micro-batch), or take them away (None). Returns the number of routers armed. Resets the counts."""
    routers = routers_of(module)
    begin_counting(routes is not None)
    if routes is None:
        for _, router in routers:
            router._dppo_replay = None
        return 0
    if not routers:
        raise RouterReplayError("router_replay.mode=R3, but the trained model has no MoE router of a kind R3 replays "
                                f"({', '.join(ROUTER_CLASSES)}): a dense model routes nothing")
    layers = routes.shape[1]
    deepest = routers[-1][0]
    if deepest >= layers:
        raise RouterReplayError(f"router replay: the rollout's routes cover {layers} layers, but the trained model "
                                f"routes in layer {deepest}: not the model the rollout ran")
    for index, router in routers:
        if routes.shape[2] != router.top_k:
            raise RouterReplayError(f"router replay: the rollout routed each token to {routes.shape[2]} experts, the "
                                    f"trained model's layer {index} to {router.top_k}")
        router._dppo_replay = (routes[:, index, :].long(), _GENERATION[0])
    return len(routers)


def begin_counting(armed: bool = True) -> None:
    """Start a micro-batch's counts (`arm` calls it; the Megatron engine's replay hook too)."""
    _GENERATION[0] += 1
    _COUNTS.update(routed=0, with_route=0, replayed=0, differs=0)
    _ARMED[0] = armed


def count_rows(routes: torch.Tensor, has_route: torch.Tensor, used: torch.Tensor, own: torch.Tensor) -> None:
    """Add one layer's forward to the counts: `routes` the rollout's experts per row ([rows, top-k]), `has_route` the
    rows that carry one, `used` the experts the layer handed on, `own` the router's own top-k choice."""
    wanted = routes.sort(dim=-1).values
    _COUNTS["routed"] += int(has_route.shape[0])
    _COUNTS["with_route"] = _COUNTS["with_route"] + has_route.sum()
    _COUNTS["replayed"] = _COUNTS["replayed"] + ((used.sort(dim=-1).values == wanted).all(dim=-1) & has_route).sum()
    _COUNTS["differs"] = _COUNTS["differs"] + ((own.sort(dim=-1).values != wanted).any(dim=-1) & has_route).sum()


def replaying_forward(original: Any) -> Any:
    """A router class's `forward`, replaying the armed rows (see the module's docstring); the original where none."""

    def forward(self, hidden_states):
        armed = getattr(self, "_dppo_replay", None)
        if armed is None:
            return original(self, hidden_states)
        targets, generation = armed
        hidden = hidden_states.reshape(-1, self.hidden_dim)
        if hidden.shape[0] != targets.shape[0]:
            raise RouterReplayError(f"router replay: the layer routes {hidden.shape[0]} rows, the rollout's routes "
                                    f"were laid out for {targets.shape[0]}")
        logits = torch.nn.functional.linear(hidden, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        _, own = torch.topk(probs, self.top_k, dim=-1)
        targets = targets.to(own.device)
        ordered = targets.sort(dim=-1).values
        valid = ((ordered >= 0) & (ordered < self.num_experts)).all(dim=-1)
        if self.top_k > 1:
            valid &= (ordered[:, 1:] != ordered[:, :-1]).all(dim=-1)
        experts = torch.where(valid[:, None], targets, own)
        weights = probs.gather(1, experts)
        if getattr(self, "norm_topk_prob", True):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if type(self).__name__ != "MixtralTopKRouter":  # Mixtral keeps float32 weights, the Qwen routers cast
            weights = weights.to(logits.dtype)
        if getattr(self, "_dppo_counted", None) != generation:  # the layer's first forward, not a recomputation
            self._dppo_counted = generation
            count_rows(targets, valid, experts, own)
        return logits, weights, experts

    return forward


def take_counts() -> dict[str, int]:
    """The rows the armed routers routed, had a route for, replayed, and would have routed otherwise, since the last
    `arm`."""
    return {name: int(value) for name, value in _COUNTS.items()}


def ratio_parts() -> dict[str, tuple[float, float]]:
    """The loss's R3 metrics as (numerator, denominator) pairs (verl_dppo.plugin.metrics.RatioMetric), {} where no
    router was armed for this micro-batch. R3 armed but acting on no row is an error, not a quiet 0."""
    if not _ARMED[0]:
        return {}
    counts = take_counts()
    if counts["replayed"] == 0:
        raise RouterReplayError(
            f"router_replay.mode=R3: the routers routed {counts['routed']} rows of this micro-batch and replayed none "
            f"({counts['with_route']} carried a route: the rollout's routes are empty or all repeat, or the engine's "
            "routers never took them: does the rollout engine return routed experts?)")
    return {"actor/dppo/r3_replayed_frac": (counts["replayed"], counts["with_route"]),
            "actor/dppo/r3_router_differs_frac": (counts["differs"], counts["with_route"]),
            "actor/dppo/r3_unrouted_frac": (counts["routed"] - counts["with_route"], counts["routed"])}
