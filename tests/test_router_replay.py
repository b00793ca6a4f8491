"""R3 on verl's FSDP engine (issue 52): transformers' MoE routers replay the rollout's routes
(verl_dppo.plugin.router_replay, patches/fsdp_router_replay.py), on tiny random-init Qwen3-MoE, Qwen2-MoE and Mixtral
models from their configs."""

from __future__ import annotations

import pytest
import torch

from verl_dppo.patches.fsdp_router_replay import replay_rows
from verl_dppo.patches._import_hook import patch_once
from verl_dppo.plugin import router_replay
from verl_dppo.plugin.router_replay import RouterReplayError, arm, ratio_parts, replaying_forward, routers_of

LAYERS, EXPERTS, TOP_K = 3, 4, 2


def tiny_moe(family: str = "qwen3_moe", dtype=torch.float32):
    from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=TOP_K, max_position_embeddings=64)
    torch.manual_seed(0)
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, num_experts=EXPERTS, moe_intermediate_size=24,
                                                   decoder_sparse_step=1, head_dim=8, norm_topk_prob=True))
    elif family == "qwen2_moe":
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**common, num_experts=EXPERTS, moe_intermediate_size=24,
                                                   shared_expert_intermediate_size=24, decoder_sparse_step=1))
    else:
        model = MixtralForCausalLM(MixtralConfig(**common, num_local_experts=EXPERTS))
    for _, router in routers_of(model):  # the patch, on the class, as the import hook installs it
        patch_once(type(router), "forward", replaying_forward)
    return model.to(dtype)


def _keep(store: dict, index: int, out) -> None:
    """A forward hook's body: the router's experts kept (the first forward's), the output untouched (None)."""
    store.setdefault(index, out[2].clone())


def own_routes(model, input_ids) -> torch.Tensor:
    """[rows, layers, top-k]: the experts each layer's router chooses itself."""
    seen = {}
    handles = [router.register_forward_hook(lambda module, args, out, i=i: _keep(seen, i, out))
               for i, router in routers_of(model)]
    with torch.no_grad():
        arm(model, None)
        model(input_ids=input_ids)
    for handle in handles:
        handle.remove()
    return torch.stack([seen[i] for i in range(LAYERS)], dim=1)


def used_experts(model, input_ids, routes) -> tuple[torch.Tensor, torch.Tensor]:
    """(the experts each layer's MoE block computed with, the logits), with `routes` armed."""
    used = {}
    handles = [router.register_forward_hook(lambda module, args, out, i=i: _keep(used, i, out))
               for i, router in routers_of(model)]
    arm(model, routes)
    logits = model(input_ids=input_ids).logits
    for handle in handles:
        handle.remove()
    return torch.stack([used[i] for i in range(LAYERS)], dim=1), logits


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_the_rollouts_routes_are_the_experts_the_update_uses(family):
    model = tiny_moe(family)
    ids = torch.randint(0, 64, (1, 24))
    own = own_routes(model, ids)
    with torch.no_grad():
        arm(model, None)
        plain = model(input_ids=ids).logits
        # the router's own routes replayed: the forward is the model's own, to the bit
        _, same = used_experts(model, ids, own)
        assert torch.equal(same, plain)
        assert ratio_parts() == {"actor/dppo/r3_replayed_frac": (24 * LAYERS, 24 * LAYERS),
                                 "actor/dppo/r3_router_differs_frac": (0, 24 * LAYERS),
                                 "actor/dppo/r3_unrouted_frac": (0, 24 * LAYERS)}
        # other routes: the update computes through them, and the router's own choice differs on every row
        other = (own + 1) % EXPERTS
        used, logits = used_experts(model, ids, other)
        assert torch.equal(used, other) and not torch.allclose(logits, plain)
        assert ratio_parts()["actor/dppo/r3_router_differs_frac"] == (24 * LAYERS, 24 * LAYERS)


def test_the_weights_are_the_routers_own_probabilities_at_the_replayed_experts_normalised():
    model = tiny_moe()
    ids = torch.randint(0, 64, (1, 10))
    own = own_routes(model, ids)
    other = (own + 1) % EXPERTS
    router = routers_of(model)[0][1]
    hidden = torch.randn(10, 32)
    arm(model, other)
    _, weights, experts = router(hidden)
    probs = torch.softmax(torch.nn.functional.linear(hidden, router.weight).float(), dim=-1)
    expected = probs.gather(1, other[:, 0].long())
    assert torch.equal(experts, other[:, 0].long())
    torch.testing.assert_close(weights, expected / expected.sum(-1, keepdim=True), rtol=0, atol=1e-7)


def test_rows_without_a_route_are_routed_by_the_router_and_counted():
    """The packed layout's padding and the response's last token come as all-zero rows: routed natively."""
    model = tiny_moe()
    ids = torch.randint(0, 64, (1, 12))
    own = own_routes(model, ids)
    routes = (own + 1) % EXPERTS
    routes[8:] = 0  # no route: both experts 0
    with torch.no_grad():
        used, _ = used_experts(model, ids, routes)
    # (past layer 0 the unrouted rows' inputs differ: they attend to rows that took other experts)
    assert torch.equal(used[:8], routes[:8]) and torch.equal(used[8:, 0], own[8:, 0])
    assert (used[8:, :, 0] != used[8:, :, 1]).all()  # the router's own top-k, not the zeros
    parts = ratio_parts()  # the share replayed is over the rows with a route; the others are counted apart
    assert parts["actor/dppo/r3_replayed_frac"] == (8 * LAYERS, 8 * LAYERS)
    assert parts["actor/dppo/r3_router_differs_frac"] == (8 * LAYERS, 8 * LAYERS)
    assert parts["actor/dppo/r3_unrouted_frac"] == (4 * LAYERS, 12 * LAYERS)
    arm(model, torch.zeros_like(routes))
    with torch.no_grad():
        model(input_ids=ids)
    with pytest.raises(RouterReplayError, match="replayed none"):
        ratio_parts()  # R3 armed and acting on no row: an error, not a quiet 0


def test_gradient_checkpointing_recomputes_through_the_replayed_experts_in_bf16():
    """Backward's recomputation fires the routers again: it must take the forward's (replayed) experts, or the
    gradient would be of another network. The same gradient with and without checkpointing, in bf16; counted once."""
    ids = torch.randint(0, 64, (1, 16))
    grads = []
    for checkpointing in (False, True):
        model = tiny_moe(dtype=torch.bfloat16)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        own = own_routes(model, ids)
        model.zero_grad()
        _, logits = used_experts(model, ids, (own + 1) % EXPERTS)
        logits.float().logsumexp(-1).sum().backward()
        grads.append(torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None]))
        assert ratio_parts()["actor/dppo/r3_replayed_frac"] == (16 * LAYERS, 16 * LAYERS)
    assert torch.equal(grads[0], grads[1])


def test_routes_are_laid_out_as_verl_packs_pads_and_slices_the_tokens():
    """verl's no-padding layout (nested sequences packed), its static pad, Ulysses' pad to the group and slice."""
    routes = torch.nested.nested_tensor([torch.full((3, LAYERS, TOP_K), 1), torch.full((2, LAYERS, TOP_K), 2)],
                                        layout=torch.jagged)
    assert replay_rows(routes, 5, 0, 1, 0)[:, 0, 0].tolist() == [1, 1, 1, 2, 2]
    assert replay_rows(routes, 5, 3, 1, 0)[:, 0, 0].tolist() == [1, 1, 1, 2, 2, 0, 0, 0]
    assert replay_rows(routes, 5, 0, 2, 0)[:, 0, 0].tolist() == [1, 1, 1]
    assert replay_rows(routes, 5, 0, 2, 1)[:, 0, 0].tolist() == [2, 2, 0]
    with pytest.raises(RouterReplayError, match="packs 6 tokens"):
        replay_rows(routes, 6, 0, 1, 0)


def test_r3_where_it_cannot_act_is_refused_in_one_line():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    with pytest.raises(RouterReplayError, match="a dense model routes nothing"):
        arm(dense, torch.zeros(4, 2, TOP_K, dtype=torch.long))
    model = tiny_moe()
    with pytest.raises(RouterReplayError, match="cover 2 layers"):
        arm(model, torch.zeros(4, 2, TOP_K, dtype=torch.long))
    with pytest.raises(RouterReplayError, match="to 3 experts"):
        arm(model, torch.zeros(4, LAYERS, 3, dtype=torch.long))
    arm(model, torch.zeros(5, LAYERS, TOP_K, dtype=torch.long))
    with pytest.raises(RouterReplayError, match="routes 4 rows"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    arm(model, None)
    assert router_replay.ratio_parts() == {}


def test_megatron_replay_is_counted_forward_only_from_the_replays_own_rows():
    """patches/megatron_router_replay.py on verl's own RouterReplay: the rows its replay mask marks count, the experts
    it hands on are compared with the targets, and the router's own top-k (verl's default_compute_topk on the same
    scores) with both; backward's recomputation is not counted again. A replay that hands on the router's own choice
    instead (a no-op) reads below 1."""
    from verl_dppo.rehearsal.setups.megatron_cpu import megatron_cpu_problems

    if megatron_cpu_problems(None):
        pytest.skip("megatron-core 0.16.1 / mbridge 0.15.1 are not installed: `make venv`")
    from verl.utils.megatron import router_replay_patch as verl_replay

    from verl_dppo.patches.megatron_router_replay import patch_router_replay

    patch_router_replay(verl_replay)
    replay = verl_replay.RouterReplay()
    verl_replay.RouterReplay.router_instances.remove(replay)
    scores = torch.softmax(torch.randn(6, EXPERTS), dim=-1)
    own = torch.topk(scores, TOP_K, dim=1).indices
    targets = own.clone()
    targets[:3] = (own[:3] + 1) % EXPERTS  # 3 rows the router would route otherwise
    mask = torch.tensor([True, True, True, True, True, False])
    compute = lambda s, k, num_groups=None, group_topk=None: torch.topk(s, k=k, dim=1)  # noqa: E731
    router_replay.begin_counting(True)
    replay.set_target_indices(targets, mask)
    replay.set_router_replay_action(verl_replay.RouterReplayAction.REPLAY_FORWARD)
    _, used = replay.get_replay_topk(scores, TOP_K, default_compute_topk=compute)
    assert torch.equal(used[:5], targets[:5])
    replay.replay_backward_list, replay.replay_backward_mask_list = [targets], [mask]
    replay.set_router_replay_action(verl_replay.RouterReplayAction.REPLAY_BACKWARD)
    replay.get_replay_topk(scores, TOP_K, default_compute_topk=compute)
    assert ratio_parts() == {"actor/dppo/r3_replayed_frac": (5, 5), "actor/dppo/r3_router_differs_frac": (3, 5),
                             "actor/dppo/r3_unrouted_frac": (1, 6)}

    class NoOp(verl_replay.RouterReplay):  # a replay that does nothing: the router's own experts handed on
        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            return default_compute_topk(scores, topk)

    patch_router_replay(type("module", (), {"RouterReplay": NoOp, "RouterReplayAction": verl_replay.RouterReplayAction}))
    noop = NoOp()
    verl_replay.RouterReplay.router_instances.remove(noop)
    router_replay.begin_counting(True)
    noop.set_target_indices(targets, mask)
    noop.set_router_replay_action(verl_replay.RouterReplayAction.REPLAY_FORWARD)
    noop.get_replay_topk(scores, TOP_K, default_compute_topk=compute)
    assert ratio_parts()["actor/dppo/r3_replayed_frac"] == (2, 5)
