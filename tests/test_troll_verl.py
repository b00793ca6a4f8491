"""The `troll` loss mode (issue 10) through verl 0.9.1's real code: the FSDP engine's `prepare_model_inputs` -> a tiny
random `transformers` model -> `prepare_model_outputs` with the plugin's logits hook (both branches) -> verl's
`ppo_loss` (wrapped by the plugin). Pinned: TROLL's Eq. 5 aggregated by verl's agg_loss equals a direct float64 call
of `verl_dppo.math.troll` on the same logits, in value and in gradient at the model's parameters; the gradient flows
through the hook's tensors only; actor/troll/* diagnostics are exact ratios; the Megatron engine is refused; the
rollout hand-over treats troll like a Top-K mode (K = 64 raises vLLM's max_logprobs); the recipe composes."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import verl  # noqa: F401  (loads the plugin)
import verl.workers.utils.losses as verl_losses
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, agg_loss
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPEngineConfig
from verl.workers.utils.padding import no_padding_2_padding

from helpers import actor_config
from test_topk_actor import VOCAB, engine, micro_batch, model  # noqa: F401  (model: the tiny Llama fixture)
from verl_dppo.math.troll import troll_token_loss, troll_token_terms

K = 8
"""The batch's top-K width (micro_batch draws K = 4 of mu; this file re-draws with 8 of the 64-token vocabulary)."""


def troll_batch(prompt_lens, response_lens, seed=0, remove_padding=True, k=K):
    import test_topk_actor

    saved = test_topk_actor.K
    test_topk_actor.K = k
    try:
        return micro_batch(prompt_lens, response_lens, seed=seed, remove_padding=remove_padding)
    finally:
        test_topk_actor.K = saved


def run(model, data, config, keep_graph=True):
    loss_fn = functools.partial(verl_losses.ppo_loss, config=config)
    eng = engine()
    inputs, output_args = eng.prepare_model_inputs(data)
    raw = model(**inputs, use_cache=False)
    model_output = eng.prepare_model_outputs(raw, output_args, data, logits_processor_func=loss_fn)
    return loss_fn, model_output, inputs


def reference_loss(model, data, config, k=K):
    """Eq. 5 by a direct float64 call of the math layer, sequence by sequence on the model's own logits (the
    response rows only), aggregated with verl's agg_loss (token-mean over the micro-batch)."""
    from verl_dppo.plugin.troll_mode import troll_options

    options = troll_options(config)
    losses, masks = [], []
    width = max(int(r.numel()) for r in data["responses"].unbind())
    for i in range(data.batch_size[0]):
        ids = data["input_ids"][i]
        p, r = data["prompts"][i].numel(), data["responses"][i].numel()
        logits = model(input_ids=ids[None], use_cache=False).logits[0].double()
        temperature = float(data["temperature"][i])
        rows = logits[p - 1 : p - 1 + r] / temperature
        terms = troll_token_terms(
            rows,
            data["rollout_topk_ids"][i].long(),
            data["rollout_topk_logprobs"][i].double(),
            data["responses"][i].long(),
            data["rollout_log_probs"][i].double(),
            eps=options.eps,
            support_mass=options.support_mass,
            topk=options.topk,
        )
        row_loss = troll_token_loss(terms, data["advantages"][i].double(), alpha=options.alpha)
        losses.append(torch.nn.functional.pad(row_loss, (0, width - r)))
        masks.append(torch.nn.functional.pad(torch.ones(r, dtype=torch.bool), (0, width - r)))
    return agg_loss(loss_mat=torch.stack(losses), loss_mask=torch.stack(masks), loss_agg_mode="token-mean")


def grads(model):
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


@pytest.mark.parametrize("remove_padding", [True, False], ids=["rmpad_branch", "padded_branch"])
def test_loss_and_gradient_equal_a_direct_float64_call_of_the_math_layer(model, remove_padding):
    data, _ = troll_batch([3, 5, 2], [4, 1, 6], seed=3, remove_padding=remove_padding)
    # The random mu lies at KL(pi' || mu') 0.45 .. 2.7 from the model: eps = 0.9 projects some tokens, not all.
    config = actor_config("troll", topk=K, troll_eps=0.9, troll_alpha=1.0)
    model.zero_grad(set_to_none=True)
    loss_fn, model_output, _ = run(model, data, config)
    for key in ("troll_log_p", "troll_regression_kl"):
        assert model_output[key].requires_grad, f"{key} lost its autograd graph in verl's engine"
    loss, metrics = loss_fn(model_output=model_output, data=data, dp_group=None)
    loss.backward()
    got = grads(model)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in got)
    assert sum(float(g.abs().sum()) for g in got) > 0, "no gradient reached the model"

    model.double()
    try:
        model.zero_grad(set_to_none=True)
        expected = reference_loss(model, data, config)
        expected.backward()
        want = grads(model)
    finally:
        model.float()
        model.zero_grad(set_to_none=True)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=2e-3, atol=1e-6)
    projected = metrics["actor/troll/projected_frac"].aggregate()
    assert 0 < projected < 1, "the case must project some tokens and leave others"
    assert metrics["actor/troll/eta_mean"].aggregate() > 0
    assert metrics["actor/troll/kl_after_mean"].aggregate() <= metrics["actor/troll/kl_before_mean"].aggregate()
    assert metrics["actor/troll/support_size_mean"].aggregate() >= 1
    assert metrics["actor/pg_clipfrac"].aggregate() == 0.0  # TROLL masks nothing: the projection is the region


def test_gradient_flows_through_the_hook_only_not_verls_log_prob(model):
    data, _ = troll_batch([3, 4], [5, 6], seed=4)
    loss_fn, model_output, _ = run(model, data, actor_config("troll", topk=K))
    offsets = model_output["log_probs"].offsets()
    leaf = model_output["log_probs"].values().detach().requires_grad_(True)
    model_output["log_probs"] = torch.nested.nested_tensor_from_jagged(leaf, offsets)
    loss, _ = loss_fn(model_output=model_output, data=data, dp_group=None)
    assert loss.requires_grad
    loss.backward()
    assert leaf.grad is None or float(leaf.grad.abs().sum()) == 0.0


def test_diagnostics_are_exact_ratios_over_micro_batches(model):
    parts = []
    for seed, (prompts, responses) in enumerate([([3, 4], [5, 2]), ([2], [7])]):
        data, _ = troll_batch(prompts, responses, seed=10 + seed)
        loss_fn, model_output, _ = run(model, data, actor_config("troll", topk=K, troll_eps=0.02))
        _, metrics = loss_fn(model_output=model_output, data=data, dp_group=None)
        parts.append(metrics)
        terms = {k: no_padding_2_padding(v, data).detach() for k, v in model_output.items() if k.startswith("troll_")}
        valid = (
            terms["troll_valid"].bool()
            & no_padding_2_padding(
                torch.nested.nested_tensor_from_jagged(
                    torch.ones_like(model_output["troll_valid"].values()), model_output["troll_valid"].offsets()
                ),
                data,
            ).bool()
        )
        assert metrics["actor/troll/kl_before_mean"].parts[0] == pytest.approx(
            (float(terms["troll_kl_before"][valid].sum()), float(valid.sum())), rel=1e-5
        )
    merged = parts[0]["actor/troll/projected_frac"].init_list()
    for metrics in parts:
        merged.extend(metrics["actor/troll/projected_frac"])
    numerator = sum(n for m in parts for n, _ in m["actor/troll/projected_frac"].parts)
    denominator = sum(d for m in parts for _, d in m["actor/troll/projected_frac"].parts)
    assert merged.aggregate() == pytest.approx(numerator / denominator)
    for name in ("projected_frac", "eta_mean", "kl_before_mean", "kl_after_mean", "support_size_mean"):
        assert f"actor/troll/{name}" in parts[0]


def test_unusable_rollout_statistics_drop_the_token(model):
    from test_topk_actor import _poke

    data, _ = troll_batch([3, 4], [5, 6], seed=2)
    _poke(data, "rollout_log_probs", 0, 1, math.nan)
    _poke(data, "rollout_topk_logprobs", 1, 2, math.inf, column=0)
    loss_fn, model_output, _ = run(model, data, actor_config("troll", topk=K))
    loss, metrics = loss_fn(model_output=model_output, data=data, dp_group=None)
    loss.backward()
    assert torch.isfinite(loss)
    assert metrics["actor/dppo/dropped_frac"].aggregate() == pytest.approx(2 / 11)


def test_registered_with_paper_defaults():
    from verl_dppo import DPPOLossConfig
    from verl_dppo.plugin.topk_mode import configured_topk, is_topk_mode

    assert "troll" in POLICY_LOSS_REGISTRY and is_topk_mode("troll")
    config = DPPOLossConfig(loss_mode="troll")
    assert (config.troll_eps, config.troll_alpha, config.troll_support_mass) == (0.05, 1.0, 1.0 - 1e-5)
    assert configured_topk({"policy_loss": config}) == 64
    assert configured_topk({"policy_loss": DPPOLossConfig(loss_mode="dppo_topk_tv")}) == 20
    with pytest.raises(ValueError, match="troll_eps"):
        DPPOLossConfig(loss_mode="troll", troll_eps=0.0)
    with pytest.raises(ValueError, match="troll_support_mass"):
        DPPOLossConfig(loss_mode="troll", troll_support_mass=1.5)


def test_k_mismatch_between_batch_and_config_is_refused(model):
    data, _ = troll_batch([3], [4])
    with pytest.raises(ValueError, match="policy_loss.topk=64"):
        run(model, data, actor_config("troll"))  # default K = 64; the batch carries 8


def test_train_batch_turns_the_hook_on_and_refuses_megatron():
    from verl.workers.engine_workers import TrainingWorker

    from verl_dppo.patches.engine_workers import prepare_train_batch

    worker = object.__new__(TrainingWorker)
    worker.loss_fn = functools.partial(verl_losses.ppo_loss, config=actor_config("troll", topk=K))
    worker.engine_config = FSDPEngineConfig()
    data, _ = troll_batch([3], [4])
    tu.assign_non_tensor(data, distillation_use_topk=False)
    prepare_train_batch(worker, data)
    assert tu.get_non_tensor_data(data, "distillation_use_topk", False) is True


def test_rollout_hand_over_treats_troll_like_topk_and_raises_max_logprobs():
    from omegaconf import OmegaConf

    from verl_dppo.patches.llm_server import sync_rollout_config

    config = OmegaConf.create(
        {
            "trainer": {"use_v1": True},
            "actor_rollout_ref": {
                "actor": {"policy_loss": {"loss_mode": "troll"}},
                "rollout": {"name": "vllm", "calculate_log_probs": True, "custom": None, "engine_kwargs": None},
                "model": {"use_fused_kernels": False},
            },
        }
    )
    assert sync_rollout_config(config) == 64
    assert config.actor_rollout_ref.rollout.custom.dppo_topk == 64
    assert config.actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs == 64


def test_recipe_composes_on_fsdp_and_on_megatron():
    from test_recipes import recipe  # the recipe tests' composer

    from verl_dppo.launch.compose import check_supported

    config = recipe("dense_8b", "troll")
    policy_loss = config.actor_rollout_ref.actor.policy_loss
    assert policy_loss.loss_mode == "troll" and int(policy_loss.topk) == 64
    assert check_supported(config) == []  # dense_8b: the FSDP engine
    megatron = recipe("moe_base", "troll")  # Megatron: the projection over vocabulary-parallel logits
    assert megatron.actor_rollout_ref.actor.strategy == "megatron"
    assert check_supported(megatron) == []
