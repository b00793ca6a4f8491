"""R3 on verl's FSDP engine: the trainer's MoE routers replay the experts the rollout engine routed each token to.

verl 0.9.1 replays routes on its Megatron and VeOmni engines only; its FSDP engine trains the Hugging Face model,
whose sparse-MoE layers choose their experts in a router module (`Qwen3MoeTopKRouter`, `Qwen2MoeTopKRouter`,
`MixtralTopKRouter` in transformers 5: `forward(hidden) -> (logits, weights, experts)`). With
`actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3` and the rollout's `enable_rollout_routing_replay=True`,
verl's agent loop puts the rollout's routes in the batch (`routed_experts`, [tokens, layers, top-k] per sequence,
by absolute decoder-layer index, as vLLM captures them), and verl's no-padding layout packs them like `input_ids`.

`arm(module, routes)` (called by patches/fsdp_router_replay.py for every micro-batch the engine runs, right after
verl's `prepare_model_inputs` packed, padded and Ulysses-sliced the tokens) hands each router of that engine's model
its layer's rows, and which rows carry a route: as verl's own R3 marks them (`build_r3_replay_mask` in its
Megatron engine), every row of a sequence but its last (the response's last token, which the rollout never fed back),
and no row of a sequence without a response token (verl's padding samples, whose routes are all zeros) nor of the
packed layout's padding. A marked row replays its route: the experts are the rollout's, the weights the trainer's own
router probabilities at those experts, normalised as the model normalises its top-k (`norm_topk_prob`; Mixtral
always), so the gradient reaches the router as in the model's own forward. Every other row, and a marked row that
holds no valid route (an expert out of range, or experts that repeat: a top-k > 1 row of zeros), is routed by the
router's own top-k and counted. The mask, not the zeros, tells a top-1 model's expert 0 from no route. Gradient
checkpointing's recomputation fires the same router with the same rows (they stay armed until the engine's next
micro-batch), so backward sees the forward's experts. Another engine in the process (the reference model) is armed
by its own config only.

Per micro-batch, `take_counts` gives what the loss reports, counted on each layer's first forward only, over the rows
that carry a rollout route: `actor/dppo/r3_replayed_frac`, the share whose experts the layer handed on (what the
update computes with) are exactly the rollout's (1 under R3: it shows the mechanism acted, not that the routes are
the tokens' own); `actor/dppo/r3_router_differs_frac`, the share where the router's own top-k would have chosen
another set (the routing mismatch R3 removes); `actor/dppo/r3_route_fit`, how well the rollout's experts fit the
trainer router's own ranking of the experts for that row, with chance taken out (`route_fit`): 1 when they are its
own top-k, a little under 1 when precision flips near-ties, about 0 when the routes belong to other tokens or another
layer (a replay shifted by one row reads as correct in the other two; this one does not); and
`actor/dppo/r3_unrouted_frac`, the share of all rows the layers routed that carried no route (padding, last tokens,
padding samples). A micro-batch that routes rows but has none to replay (verl's padding samples alone) is counted,
not refused; one whose marked rows all lack a valid route (the rollout returned none) is an error.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from verl_dppo.plugin.log_once import warn_once

__all__ = [
    "ARMED",
    "ROUTER_CLASSES",
    "FIT_FLOOR",
    "RouterReplayError",
    "arm",
    "begin_counting",
    "count_rows",
    "routers_of",
    "replaying_forward",
    "route_fit",
    "take_counts",
    "ratio_parts",
]

ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter")
"""transformers' MoE router classes R3 replays on (one `forward(hidden) -> (logits, weights, experts)` each)."""

FIT_FLOOR = 0.5
"""`r3_route_fit` below this in a micro-batch is warned about: a precision mismatch only swaps near-tied experts (a
fit near 1), and the later mini-batches' moved routers lower it a little; routes of other tokens or another layer
read about 0."""

_ZERO = {"routed": 0, "marked": 0, "with_route": 0, "replayed": 0, "differs": 0, "fit": 0.0, "fit_of": 0.0}
_COUNTS: dict[str, Any] = dict(_ZERO)
"""Since the last `arm` (or `begin_counting`): rows routed by armed routers; of them, rows marked to carry a route,
and rows that carry a valid one; of those, rows whose experts handed on were exactly the route's, rows the router's
own top-k would have routed otherwise, and the route fit's numerator and denominator (`route_fit`). Tensors on the
model's device until read: no wait for the GPU per layer."""
ARMED = [False]
"""True from `begin_counting(armed=True)` on: this micro-batch's routers replay routes, and `ratio_parts` has counts
(the `ppo_loss` wrapper asks for them only then)."""
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
        index = next(
            (int(parts[i + 1]) for i in range(len(parts) - 1) if parts[i] == "layers" and parts[i + 1].isdigit()), None
        )
        if index is None:
            raise RouterReplayError(f"router replay: cannot tell the decoder layer of the MoE router {name!r}")
        found.append((index, child))
    return sorted(found, key=lambda item: item[0])


EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Where a Hugging Face config holds its number of routed experts (0 or absent: a dense model)."""


def config_experts(config: Any) -> int:
    """The number of routed experts a model config (a transformers config, a dict, a DictConfig) names, 0 if none."""
    get = (
        config.get
        if hasattr(config, "get") and not hasattr(config, "to_dict")
        else (lambda key, default=None: getattr(config, key, default))
    )
    for key in EXPERT_KEYS:
        value = get(key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def model_config(path: str) -> Optional[dict]:
    """A model's config.json (a local folder, or a hub id in the Hugging Face cache), None where it is not readable
    here (a hub id not cached, a remote path, an unresolved interpolation): the one reader the run's checks and
    `verl-dppo check`'s MoE arm share."""
    import json
    from pathlib import Path

    local = Path(path).expanduser()
    try:
        if local.is_dir():
            return json.loads((local / "config.json").read_text())
        if not path or "://" in path or path.startswith(("/", ".", "~", "$")):
            return None
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json")
        return json.loads(Path(cached).read_text()) if isinstance(cached, str) else None
    except Exception:  # noqa: BLE001  (unreadable: nothing said)
        return None


def model_experts(path: str) -> Optional[int]:
    """The routed experts a model's config.json names (0: dense), None where it is not readable here."""
    config = model_config(path)
    return None if config is None else config_experts(config)


def no_router_problem(module: torch.nn.Module) -> str:
    """Why `module` has no router R3 replays: a dense model, or an MoE whose router class the plugin does not know."""
    config = getattr(module, "config", None)
    experts = config_experts(config) if config is not None else 0
    kinds = ", ".join(ROUTER_CLASSES)
    if experts:
        gates = sorted(
            {
                type(child).__name__
                for name, child in module.named_modules()
                if name.rsplit(".", 1)[-1] in ("gate", "router")
            }
        )
        return (
            f"router_replay.mode=R3, but the trained model ({type(module).__name__}, {experts} experts) routes "
            f"with {', '.join(gates) or 'a router'}, which R3 on the FSDP engine does not replay (it replays "
            f"{kinds}): train it on verl's Megatron engine, whose R3 covers it, or without R3"
        )
    return (
        f"router_replay.mode=R3, but the trained model has no MoE router of a kind R3 replays ({kinds}): a dense "
        "model routes nothing (drop router_replay.mode=R3 and enable_rollout_routing_replay)"
    )


def arm(
    module: torch.nn.Module, routes: Optional[torch.Tensor], marked: Optional[torch.Tensor] = None, replay: bool = True
) -> int:
    """Give each router of `module` its rows of `routes` ([rows, layers, top-k], the rows the model's MoE layers will
    route in this micro-batch) and which of them carry a route (`marked`, [rows] bool; None: every row), or take them
    away (None). With `replay` False (router_replay.mode=measure) the routers route on their own and only compare:
    the same metrics, `r3_replayed_frac` then the share whose own experts were the rollout's anyway. Returns the
    number of routers armed. Resets the counts."""
    routers = routers_of(module)
    begin_counting(routes is not None)
    if routes is None:
        for _, router in routers:
            router._dppo_replay = None
        return 0
    if not routers:
        raise RouterReplayError(no_router_problem(module))
    if marked is None:
        marked = torch.ones(routes.shape[0], dtype=torch.bool, device=routes.device)
    if marked.shape != routes.shape[:1]:
        raise RouterReplayError(f"router replay: {marked.shape[0]} rows marked for {routes.shape[0]} routes")
    layers = routes.shape[1]
    deepest = routers[-1][0]
    if deepest >= layers:
        raise RouterReplayError(
            f"router replay: the rollout's routes cover {layers} layers, but the trained model "
            f"routes in layer {deepest}: not the model the rollout ran"
        )
    for index, router in routers:
        if routes.shape[2] != router.top_k:
            raise RouterReplayError(
                f"router replay: the rollout routed each token to {routes.shape[2]} experts, the "
                f"trained model's layer {index} to {router.top_k}"
            )
        router._dppo_replay = (routes[:, index, :].long(), marked.bool(), _GENERATION[0], replay)
    return len(routers)


def begin_counting(armed: bool = True) -> None:
    """Start a micro-batch's counts (`arm` calls it; the Megatron engine's replay hook too)."""
    _GENERATION[0] += 1
    _COUNTS.update(_ZERO)
    ARMED[0] = armed


def route_fit(routes: torch.Tensor, has_route: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, float]:
    """How well the rollout's experts fit the router's own ranking, chance taken out: (the numerator summed over the
    rows with a route, the denominator of one row). Per row the experts' ranks in `scores` ([rows, experts], any
    score the router ranks by: logits or probabilities) are summed: k experts chosen at random sum to k(E-1)/2 on
    average, the router's own top-k to k(k-1)/2; the fit is the share of that gap the route closes, so 1 for the
    router's own set, 0 for a route no better than chance, whatever the router's sharpness. A precision mismatch,
    which swaps near-tied experts of neighbouring rank, costs about 1/(E-k) per swap; a route of another token or
    layer keeps only the correlation between them. Tied scores (a bf16 router's) share their mean rank, so two
    experts tied for the top rank 0.5 each, not 0 each, and the fit never exceeds 1."""
    top_k, experts = routes.shape[-1], scores.shape[-1]
    if experts <= top_k:
        return torch.zeros((), device=scores.device), 0.0
    picked = scores.gather(1, routes.clamp(0, experts - 1))
    above = (scores[:, None, :] > picked[:, :, None]).sum(dim=-1)
    tied = (scores[:, None, :] == picked[:, :, None]).sum(dim=-1) - 1  # the expert itself left out
    ranks = (above + 0.5 * tied).sum(dim=-1)  # [rows]: 0 for the best expert (its mean rank where scores tie)
    chance = top_k * (experts - 1) / 2
    closed = torch.where(has_route, chance - ranks.to(torch.float64), 0.0).sum()
    return closed, top_k * (experts - top_k) / 2  # chance - k(k-1)/2


def count_rows(
    routes: torch.Tensor,
    has_route: torch.Tensor,
    used: torch.Tensor,
    own: torch.Tensor,
    scores: Optional[torch.Tensor] = None,
    marked: Optional[torch.Tensor] = None,
) -> None:
    """Add one layer's forward to the counts: `routes` the rollout's experts per row ([rows, top-k]), `has_route` the
    rows that carry a valid one, `used` the experts the layer handed on, `own` the router's own top-k choice, `scores`
    the router's scores of every expert ([rows, experts], for the route fit), `marked` the rows meant to carry a route
    (default: `has_route`)."""
    wanted = routes.sort(dim=-1).values
    _COUNTS["routed"] += int(has_route.shape[0])
    _COUNTS["marked"] = _COUNTS["marked"] + (has_route if marked is None else marked).sum()
    _COUNTS["with_route"] = _COUNTS["with_route"] + has_route.sum()
    _COUNTS["replayed"] = _COUNTS["replayed"] + ((used.sort(dim=-1).values == wanted).all(dim=-1) & has_route).sum()
    _COUNTS["differs"] = _COUNTS["differs"] + ((own.sort(dim=-1).values != wanted).any(dim=-1) & has_route).sum()
    if scores is not None:
        closed, per_row = route_fit(routes, has_route, scores.detach().float())
        _COUNTS["fit"] = _COUNTS["fit"] + closed
        _COUNTS["fit_of"] = _COUNTS["fit_of"] + has_route.sum() * per_row


def replaying_forward(original: Any) -> Any:
    """A router class's `forward`, replaying the armed rows (see the module's docstring); the original where none."""

    def forward(self, hidden_states):
        armed = getattr(self, "_dppo_replay", None)
        if armed is None:
            return original(self, hidden_states)
        targets, marked, generation, replay = armed
        hidden = hidden_states.reshape(-1, self.hidden_dim)
        if hidden.shape[0] != targets.shape[0]:
            raise RouterReplayError(
                f"router replay: the layer routes {hidden.shape[0]} rows, the rollout's routes "
                f"were laid out for {targets.shape[0]}"
            )
        logits = torch.nn.functional.linear(hidden, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        _, own = torch.topk(probs, self.top_k, dim=-1)
        targets, marked = targets.to(own.device), marked.to(own.device)
        ordered = targets.sort(dim=-1).values
        valid = marked & ((ordered >= 0) & (ordered < self.num_experts)).all(dim=-1)
        if self.top_k > 1:
            valid &= (ordered[:, 1:] != ordered[:, :-1]).all(dim=-1)
        experts = torch.where(valid[:, None], targets, own) if replay else own
        weights = probs.gather(1, experts)
        if getattr(self, "norm_topk_prob", True):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if type(self).__name__ != "MixtralTopKRouter":  # Mixtral keeps float32 weights, the Qwen routers cast
            weights = weights.to(logits.dtype)
        if getattr(self, "_dppo_counted", None) != generation:  # the layer's first forward, not a recomputation
            self._dppo_counted = generation
            count_rows(targets, valid, experts, own, scores=probs, marked=marked)
        return logits, weights, experts

    return forward


def take_counts() -> dict[str, float]:
    """The rows the armed routers routed, meant to carry a route, had a valid one for, replayed, and would have
    routed otherwise, and the route fit's parts, since the last `arm`: the counts kept on the device read back in one
    host transfer (one wait for the device a micro-batch, not one a count)."""
    on_device = [name for name, value in _COUNTS.items() if isinstance(value, torch.Tensor)]
    values = dict(_COUNTS)
    if on_device:
        device = _COUNTS[on_device[0]].device
        read = torch.stack([_COUNTS[name].to(device, torch.float64) for name in on_device]).tolist()
        values.update(zip(on_device, read))
    return {name: (float(value) if name.startswith("fit") else int(value)) for name, value in values.items()}


def ratio_parts() -> dict[str, tuple[float, float]]:
    """The loss's R3 metrics as (numerator, denominator) pairs (verl_dppo.plugin.metrics.RatioMetric), {} where no
    router was armed for this micro-batch. R3 armed but acting on no row is an error, not a quiet 0."""
    if not ARMED[0]:
        return {}
    counts = take_counts()
    if counts["marked"] > 0 and counts["with_route"] == 0:
        raise RouterReplayError(
            f"router_replay.mode=R3: the routers routed {counts['routed']} rows of this micro-batch and replayed none "
            f"({counts['marked']} should carry a route, {counts['with_route']} did: the rollout's routes are empty or "
            "all repeat, or the engine's routers never took them: does the rollout engine return routed experts?)"
        )
    if counts["marked"] == 0:
        warn_once(
            ("r3", "nothing to replay"),
            "verl-dppo R3: a micro-batch with no row to replay (%d rows routed: verl's padding samples alone); "
            "its rows were routed by the routers and counted in actor/dppo/r3_unrouted_frac",
            counts["routed"],
        )
    if counts["fit_of"] > 0 and counts["fit"] < FIT_FLOOR * counts["fit_of"]:
        warn_once(
            ("r3", "route fit"),
            "verl-dppo R3: actor/dppo/r3_route_fit %.2f in a micro-batch (1: the routes are the trainer router's "
            "own choice; about 0: no better than chance): the replayed routes do not look like these tokens' "
            "(routes shifted by a token or a layer, or of another model)",
            counts["fit"] / counts["fit_of"],
        )
    return {
        "actor/dppo/r3_replayed_frac": (counts["replayed"], counts["with_route"]),
        "actor/dppo/r3_router_differs_frac": (counts["differs"], counts["with_route"]),
        "actor/dppo/r3_route_fit": (counts["fit"], counts["fit_of"]),
        "actor/dppo/r3_unrouted_frac": (counts["routed"] - counts["with_route"], counts["routed"]),
    }
