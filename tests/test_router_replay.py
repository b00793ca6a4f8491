"""R3 on verl's FSDP engine (issue 52): transformers' MoE routers replay the rollout's routes
(verl_dppo.plugin.moe.router_replay, patches/fsdp_router_replay.py), on tiny random-init Qwen3-MoE, Qwen2-MoE and
Mixtral models from their configs."""

from __future__ import annotations

import pytest
import torch

from verl_dppo.patches.fsdp_router_replay import replay_marks, replay_rows, response_lengths
from verl_dppo.patches._import_hook import patch_once
from verl_dppo.plugin.moe import router_replay
from verl_dppo.plugin.log_once import _SEEN
from verl_dppo.plugin.moe.router_replay import RouterReplayError, arm, ratio_parts, replaying_forward, routers_of

from test_topk_actor import _count_host_reads

LAYERS, EXPERTS, TOP_K = 3, 4, 2


def tiny_moe(family: str = "qwen3_moe", dtype=torch.float32, experts: int = EXPERTS, top_k: int = TOP_K):
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=top_k,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                **common,
                num_experts=experts,
                moe_intermediate_size=24,
                decoder_sparse_step=1,
                head_dim=8,
                norm_topk_prob=True,
            )
        )
    elif family == "qwen2_moe":
        model = Qwen2MoeForCausalLM(
            Qwen2MoeConfig(
                **common,
                num_experts=EXPERTS,
                moe_intermediate_size=24,
                shared_expert_intermediate_size=24,
                decoder_sparse_step=1,
            )
        )
    else:
        model = MixtralForCausalLM(MixtralConfig(**common, num_local_experts=EXPERTS))
    for _, router in routers_of(model):  # the patch, on the class, as the import hook installs it
        patch_once(type(router), "forward", replaying_forward)
    return model.to(dtype)


def _keep(store: dict, index: int, out) -> None:
    """A forward hook's body: the router's experts kept (the first forward's), the output untouched (None)."""
    store.setdefault(index, out[2].clone())


def own_routes(model, input_ids) -> torch.Tensor:
    """[rows, layers, top-k]: the experts each layer's router chooses itself (every row of the batch, packed)."""
    seen = {}
    handles = [
        router.register_forward_hook(lambda module, args, out, i=i: _keep(seen, i, out))
        for i, router in routers_of(model)
    ]
    with torch.no_grad():
        arm(model, None)
        model(input_ids=input_ids)
    for handle in handles:
        handle.remove()
    return torch.stack([seen[i] for i in range(LAYERS)], dim=1)


def used_experts(model, input_ids, routes, marked=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the experts each layer's MoE block computed with, the logits), with `routes` (and `marked`) armed."""
    used = {}
    handles = [
        router.register_forward_hook(lambda module, args, out, i=i: _keep(used, i, out))
        for i, router in routers_of(model)
    ]
    arm(model, routes, marked)
    logits = model(input_ids=input_ids).logits
    for handle in handles:
        handle.remove()
    return torch.stack([used[i] for i in range(LAYERS)], dim=1), logits


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_the_rollouts_routes_are_the_experts_the_update_uses(family, monkeypatch):
    model = tiny_moe(family)
    ids = torch.randint(0, 64, (1, 24))
    own = own_routes(model, ids)
    with torch.no_grad():
        arm(model, None)
        plain = model(input_ids=ids).logits
        # the router's own routes replayed: the forward is the model's own, to the bit
        _, same = used_experts(model, ids, own)
        assert torch.equal(same, plain)
        half_gap = TOP_K * (EXPERTS - TOP_K) / 2  # a row's route fit denominator
        reads = _count_host_reads(monkeypatch)
        parts = ratio_parts()
        monkeypatch.undo()
        assert len(reads) == 1, reads  # the micro-batch's counts, kept on the device, read back at once
        assert parts == {
            "actor/dppo/r3_replayed_frac": (24 * LAYERS, 24 * LAYERS),
            "actor/dppo/r3_router_differs_frac": (0, 24 * LAYERS),
            "actor/dppo/r3_route_fit": (24 * LAYERS * half_gap, 24 * LAYERS * half_gap),
            "actor/dppo/r3_unrouted_frac": (0, 24 * LAYERS),
        }
        # other routes: the update computes through them, and the router's own choice differs on every row
        other = (own + 1) % EXPERTS
        used, logits = used_experts(model, ids, other)
        assert torch.equal(used, other) and not torch.allclose(logits, plain)
        assert ratio_parts()["actor/dppo/r3_router_differs_frac"] == (24 * LAYERS, 24 * LAYERS)
        # router_replay.mode=measure (the without-R3 arm): the routers route on their own, the mismatch is counted
        half = other.clone()
        half[:12] = own[:12]
        arm(model, half, replay=False)
        assert torch.equal(model(input_ids=ids).logits, plain)
        parts = ratio_parts()
        assert parts["actor/dppo/r3_router_differs_frac"] == (12 * LAYERS, 24 * LAYERS)
        assert parts["actor/dppo/r3_replayed_frac"] == (12 * LAYERS, 24 * LAYERS)  # the rollout's experts anyway


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
    """Rows the mask leaves out, and marked rows that hold no valid route (a top-2 row of zeros: the trailing rows of a
    multi-turn sample): routed natively, counted apart."""
    model = tiny_moe()
    ids = torch.randint(0, 64, (1, 12))
    own = own_routes(model, ids)
    routes = (own + 1) % EXPERTS
    routes[10:] = 0  # no route: both experts 0
    marked = torch.arange(12) < 10
    marked[8:10] = False  # not marked (their routes are valid but must not be replayed)
    with torch.no_grad():
        used, _ = used_experts(model, ids, routes, marked)
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
        ratio_parts()  # rows meant to carry a route and none did: an error, not a quiet 0


def _packed(model, samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A micro-batch of `samples` as verl's no-padding layout packs it: (input_ids [1, rows], routed_experts and
    response_mask nested per sequence)."""
    ids = torch.cat([s["input_ids"] for s in samples])[None]
    routes = torch.nested.nested_tensor([s["routed_experts"] for s in samples], layout=torch.jagged)
    responses = torch.nested.nested_tensor([s["response_mask"] for s in samples], layout=torch.jagged)
    return ids, routes, responses


def test_verls_padding_samples_are_counted_not_refused(caplog):
    """verl's v1 trainer pads a batch to a multiple of lcm(DP, mini-batch x n) with synthetic samples built by its own
    `construct_minimal_padding_template` (routes all zeros, no response token). With them in a micro-batch, or alone
    (micro_batch_size_per_gpu=1), the step goes on: their rows are routed by the routers and counted, as verl's own R3
    leaves them native (`build_r3_replay_mask`); each real sequence replays all its rows but the last."""
    from verl.trainer.ppo.padding_utils import construct_minimal_padding_template

    model = tiny_moe()
    prompt, response = torch.randint(2, 64, (5,)), torch.randint(2, 64, (4,))
    real_ids = torch.cat([prompt, response])
    own = own_routes(model, real_ids[None])
    routes = (own + 1) % EXPERTS
    routes[-1] = 0  # the response's last token: never fed back, no route (verl's agent loop fills zeros)
    real = {
        "input_ids": real_ids,
        "prompts": prompt,
        "responses": response,
        "routed_experts": routes.to(torch.int16),
        "response_mask": torch.ones(4, dtype=torch.int64),
        "attention_mask": torch.ones(9, dtype=torch.int64),
    }
    padding, tag = construct_minimal_padding_template(real, {"is_padding": False}, eos_token_id=1)
    assert tag["is_padding"] and not padding["routed_experts"].any() and not padding["response_mask"].any()
    pad_len = padding["input_ids"].shape[0]

    ids, nested, responses = _packed(model, [real, padding])
    rows, marked = replay_rows(nested, ids.shape[1], 0, 1, 0, response_lengths(responses))
    assert marked.tolist() == [True] * 8 + [False] + [False] * pad_len
    with torch.no_grad():
        used, _ = used_experts(model, ids, rows, marked)
    assert torch.equal(used[:8], routes[:8].long())
    parts = ratio_parts()
    assert parts["actor/dppo/r3_replayed_frac"] == (8 * LAYERS, 8 * LAYERS)
    assert parts["actor/dppo/r3_unrouted_frac"] == ((1 + pad_len) * LAYERS, (9 + pad_len) * LAYERS)

    ids, nested, responses = _packed(model, [padding])  # a micro-batch of one padding sample
    rows, marked = replay_rows(nested, ids.shape[1], 3, 1, 0, response_lengths(responses))  # and verl's static pad
    with torch.no_grad():
        used_experts(model, torch.cat([ids, ids.new_zeros(1, 3)], dim=1), rows, marked)
    _SEEN.discard(("r3", "nothing to replay"))
    with caplog.at_level("WARNING", logger="verl_dppo"):
        parts = ratio_parts()
    assert parts["actor/dppo/r3_replayed_frac"] == (0, 0)
    assert parts["actor/dppo/r3_unrouted_frac"] == ((pad_len + 3) * LAYERS, (pad_len + 3) * LAYERS)
    assert "verl's padding samples alone" in caplog.text


def test_a_top1_models_rows_without_a_route_are_not_expert_0():
    """On a top-1 model an all-zero row is a valid route (expert 0): the mask, not the zeros, says which rows carry
    one. The last token of each sequence and the padding sample's rows are routed by the router itself."""
    model = tiny_moe(experts=8, top_k=1)
    ids = torch.randint(0, 64, (1, 10))
    own = own_routes(model, ids)
    assert (own[:, :, 0] != 0).any(dim=0).all()  # the router itself picks other experts than 0 on some rows
    routes = own.clone()
    routes[-1] = 0
    lengths, responses = torch.tensor([6, 4]), torch.tensor([3, 0])  # a sample, then a padding sample
    marked = replay_marks(lengths, responses)
    assert marked.tolist() == [True] * 5 + [False] * 5
    routes[5:] = 0
    with torch.no_grad():
        used, _ = used_experts(model, ids, routes, marked)
    assert torch.equal(used[:5], own[:5]) and torch.equal(used[5:, 0], own[5:, 0])
    parts = ratio_parts()
    assert parts["actor/dppo/r3_replayed_frac"] == (5 * LAYERS, 5 * LAYERS)
    assert parts["actor/dppo/r3_unrouted_frac"] == (5 * LAYERS, 10 * LAYERS)


def test_a_replay_shifted_by_a_token_or_a_layer_does_not_read_as_correct(caplog):
    """The audit's cases: routes one token late and routes of another layer are replayed exactly as armed (replayed
    reads 1 either way), but `r3_route_fit` (the routes against the router's own ranking, chance taken out) reads
    about 0 and is warned about; the correct routes read 1, and routes computed in bf16 against a float32 router (a
    precision mismatch) stay near 1."""
    model = tiny_moe(experts=16, top_k=2)
    ids = torch.randint(0, 64, (1, 48))
    own = own_routes(model, ids)
    with torch.no_grad():
        bf16 = own_routes(tiny_moe(experts=16, top_k=2, dtype=torch.bfloat16), ids)
    late = torch.cat([own[:1], own[:-1]])  # each row gets the route of the token before it
    other_layer = own.roll(1, dims=1)
    fits = {}
    for name, routes in (("right", own), ("bf16", bf16), ("late", late), ("other layer", other_layer)):
        caplog.clear()
        _SEEN.discard(("r3", "route fit"))
        with torch.no_grad(), caplog.at_level("WARNING", logger="verl_dppo"):
            used_experts(model, ids, routes)
            parts = ratio_parts()
        assert parts["actor/dppo/r3_replayed_frac"][0] == parts["actor/dppo/r3_replayed_frac"][1], name
        fits[name] = parts["actor/dppo/r3_route_fit"][0] / parts["actor/dppo/r3_route_fit"][1]
        assert ("do not look like these tokens'" in caplog.text) == (fits[name] < router_replay.FIT_FLOOR), name
    print("r3_route_fit:", {name: round(fit, 3) for name, fit in fits.items()})
    assert fits["right"] == 1.0 and fits["bf16"] > 0.9, fits
    assert fits["late"] < 0.3 and fits["other layer"] < 0.3, fits


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
    routes = torch.nested.nested_tensor(
        [torch.full((3, LAYERS, TOP_K), 1), torch.full((2, LAYERS, TOP_K), 2)], layout=torch.jagged
    )

    def laid(*args):
        rows, marked = replay_rows(routes, *args)
        return rows[:, 0, 0].tolist(), marked.tolist()

    assert laid(5, 0, 1, 0) == ([1, 1, 1, 2, 2], [True, True, False, True, False])  # each sequence's last: no route
    assert laid(5, 3, 1, 0) == ([1, 1, 1, 2, 2, 0, 0, 0], [True, True, False, True, False, False, False, False])
    assert laid(5, 0, 2, 0) == ([1, 1, 1], [True, True, False])
    assert laid(5, 0, 2, 1) == ([2, 2, 0], [True, False, False])
    assert laid(5, 0, 1, 0, torch.tensor([2, 0]))[1] == [True, True, False, False, False]  # no response: none
    with pytest.raises(RouterReplayError, match="packs 6 tokens"):
        replay_rows(routes, 6, 0, 1, 0)


def test_r3_where_it_cannot_act_is_refused_in_one_line():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dense = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        )
    )
    with pytest.raises(RouterReplayError, match="a dense model routes nothing"):
        arm(dense, torch.zeros(4, 2, TOP_K, dtype=torch.long))
    from transformers import OlmoeConfig, OlmoeForCausalLM

    unknown = OlmoeForCausalLM(
        OlmoeConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
        )
    )
    with pytest.raises(RouterReplayError, match=r"\(OlmoeForCausalLM, 4 experts\) routes with OlmoeTopKRouter, whi"):
        arm(unknown, torch.zeros(4, 2, TOP_K, dtype=torch.long))  # an MoE: not told it is dense
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


def fit_reference(routes: torch.Tensor, scores: torch.Tensor) -> tuple[float, float]:
    """r3_route_fit's parts by its definition, in float64, by sorting: per row, k(E-1)/2 minus the sum of the
    route's ranks (0 = the router's best expert), over k(E-k)/2."""
    rows, (experts, k) = routes.shape[0], (scores.shape[1], routes.shape[1])
    rank_of = scores.double().argsort(dim=1, descending=True).argsort(dim=1)
    ranks = rank_of.gather(1, routes.long()).sum(dim=1).double()
    return float((k * (experts - 1) / 2 - ranks).sum()), rows * k * (experts - k) / 2


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
    assert ratio_parts() == {
        "actor/dppo/r3_replayed_frac": (5, 5),
        "actor/dppo/r3_router_differs_frac": (3, 5),
        "actor/dppo/r3_route_fit": fit_reference(targets[:5], scores[:5]),
        "actor/dppo/r3_unrouted_frac": (1, 6),
    }

    class NoOp(verl_replay.RouterReplay):  # a replay that does nothing: the router's own experts handed on
        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            return default_compute_topk(scores, topk)

    patch_router_replay(
        type("module", (), {"RouterReplay": NoOp, "RouterReplayAction": verl_replay.RouterReplayAction})
    )
    noop = NoOp()
    verl_replay.RouterReplay.router_instances.remove(noop)
    router_replay.begin_counting(True)
    noop.set_target_indices(targets, mask)
    noop.set_router_replay_action(verl_replay.RouterReplayAction.REPLAY_FORWARD)
    noop.get_replay_topk(scores, TOP_K, default_compute_topk=compute)
    assert ratio_parts()["actor/dppo/r3_replayed_frac"] == (2, 5)


def test_r3_on_a_model_whose_config_json_shows_no_router_it_replays_is_refused_before_the_launch(tmp_path):
    """Issue 72.5: a readable config.json of a dense model, or of an MoE whose router R3 on FSDP does not replay, is
    one line from the run's config checks (`run --dry-run`, `check`, the worker), before any model load or rollout;
    an MoE it replays, and a path it cannot read here (a hub id), pass on."""
    import json

    from omegaconf import OmegaConf

    from verl_dppo.plugin.run_config import fsdp_router_replay_problem

    def problem(model_config):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        if model_config is not None:
            (folder / "config.json").write_text(json.dumps(model_config))
        return fsdp_router_replay_problem(
            OmegaConf.create(
                {
                    "actor_rollout_ref": {
                        "actor": {"strategy": "fsdp2", "fsdp_config": {"router_replay": {"mode": "R3"}}},
                        "rollout": {"enable_rollout_routing_replay": True},
                        "model": {"path": str(folder), "use_remove_padding": True},
                    }
                }
            )
        )

    assert "names no routed experts: a dense model" in problem({"model_type": "qwen3", "hidden_size": 8})
    assert "is an MoE of type olmoe, whose router" in problem({"model_type": "olmoe", "num_experts": 64})
    assert problem({"model_type": "qwen3_moe", "num_experts": 128}) is None
    assert problem({"model_type": "mixtral", "num_local_experts": 8}) is None
    assert problem(None) is None


def test_the_route_fit_shares_tied_ranks_and_never_exceeds_one():
    """A bf16 router's scores tie (the suite's vLLM R3 launch once read a fit above 1): tied experts share their
    mean rank, so the router's own top-k reads exactly 1 with a tie inside it, just under 1 with a tie across its
    edge, and no route reads above 1; without ties the fit is the rank-sum form's."""
    from verl_dppo.plugin.moe.router_replay import route_fit

    scores = torch.tensor(
        [
            [0.4, 0.4, 0.1, 0.1],  # the top two tied: either order is the router's own
            [0.5, 0.2, 0.2, 0.1],  # a tie across the top-2's edge: the route takes one of them
            [0.4, 0.3, 0.2, 0.1],
        ]
    )  # no tie
    routes = torch.tensor([[1, 0], [0, 2], [0, 1]])
    has_route = torch.ones(3, dtype=torch.bool)
    for row in range(3):
        closed, per_row = route_fit(routes[row : row + 1], has_route[:1], scores[row : row + 1])
        fit = float(closed) / per_row
        assert fit == pytest.approx([1.0, 0.75, 1.0][row]) and fit <= 1.0, (row, fit)
    ties = torch.zeros(64, 8).to(torch.bfloat16).float()  # every expert tied: any route is as good as any other
    closed, per_row = route_fit(
        torch.randint(0, 8, (64, 2)).sort(dim=-1).values, torch.ones(64, dtype=torch.bool), ties
    )
    assert float(closed) == pytest.approx(0.0), float(closed)
