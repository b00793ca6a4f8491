"""TROLL's importance ratio p(a_t) / mu'(a_t) where mu gave a_t almost nothing (issue 18, item 1; docs/bad-input.md).

A finite rollout log-prob of -100 for a token outside mu's top-K row, with mu agreeing with pi elsewhere, puts
log r = log p(a_t) - log mu'(a_t) at 92-96 (the projection keeps p(a_t) near 1 / 100): past float32's exp overflow
(88.7), r = inf, so the loss was -inf (A = 1) or NaN (A = 0, inf x 0) and the gradient non-finite, in the math
layer and through verl's engine. Pinned: TROLL's ratio is treated as the DPPO modes treat theirs
(`verl_dppo.plugin.losses.MAX_LOG_RATIO`): its value is exp(min(log r, 20)) and its gradient that weight times the
score d log p(a_t) (DPPO's sg(min(r, C)) d log pi), so the loss and the gradient stay finite at eps = 1 and 0.05 for
A = 1, 0, -1 (bf16, float32, float64 logits; a peaked mu row too), and Eq. 5 is unchanged below the cap. Through
verl's real FSDP engine (prepare_model_inputs -> tiny Llama -> the plugin's logits hook -> verl's ppo_loss): the
loss equals a direct float64 call of the math layer, and the parameter gradient is the capped weight times the score
on the engine's own graph.
"""

from __future__ import annotations

import math

import pytest
import torch

from verl.workers.utils.padding import no_padding_2_padding

from test_troll_verl import K, reference_loss, run, troll_batch
from test_topk_actor import VOCAB, _poke, model  # noqa: F401  (model: the tiny Llama fixture)
from helpers import actor_config
from verl_dppo.math import troll
from verl_dppo.math.troll import troll_token_loss, troll_token_terms

FLOAT32_EXP_OVERFLOW = math.log(torch.finfo(torch.float32).max)  # 88.72
PEAK = math.log1p(-1e-9)


def test_the_cap_is_the_dppo_modes_cap():
    from verl_dppo.plugin.losses import MAX_LOG_RATIO

    assert troll.MAX_LOG_RATIO == MAX_LOG_RATIO == 20.0


def far_token_case(dtype):
    """a_t = 40 is outside mu's top-8 report with the rollout's log mu(a_t) = -100 in rows 0 and 1. Row 0: pi's mode
    is a_t, mu agrees with pi everywhere else (pi without a_t). Row 1: pi peaked on a_t, mu's report peaked on
    token 0 (1 - 1e-9, seven more at e^-30). Row 2: an ordinary row (mu = a perturbed pi, a_t reported)."""
    vocab, k, a = 64, 8, 40
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, vocab, generator=gen, dtype=torch.float64)
    logits[0, a] = logits[0].max() + 1.0
    logits[1] = 0.0
    logits[1, a] = 30.0
    logits = logits.to(dtype)
    mu0 = torch.log_softmax(logits[0].double().index_fill(0, torch.tensor([a]), -math.inf), -1)
    mu2 = torch.log_softmax(logits[2].double() + 0.3 * torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
    (lp0, ids0), (lp2, ids2) = mu0.topk(k), mu2.topk(k)
    ids = torch.stack([ids0, torch.arange(k), ids2])
    lps = torch.stack([lp0, torch.tensor([PEAK] + [-30.0] * (k - 1), dtype=torch.float64), lp2])
    sampled = torch.tensor([a, a, int(ids2[2])])
    sampled_lp = torch.tensor([-100.0, -100.0, float(lp2[2])])
    return logits, ids, lps.float(), sampled, sampled_lp.float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("eps", [1.0, 0.05])
@pytest.mark.parametrize("adv", [1.0, 0.0, -1.0])
def test_a_far_token_gives_a_finite_loss_and_the_capped_weight_times_the_score(dtype, eps, adv):
    logits, ids, lps, sampled, sampled_lp = far_token_case(dtype)
    x = logits.clone().requires_grad_()
    terms = troll_token_terms(x, ids, lps, sampled, sampled_lp, eps=eps)
    log_r = (terms.log_p_sampled - terms.log_mu_sampled).detach().double()
    # eps = 1: past float32's exp (r = inf); eps = 0.05: log r 48 and 79, r up to 2e34, finite but far past the cap.
    assert log_r[0] > (FLOAT32_EXP_OVERFLOW if eps == 1.0 else 45.0) and log_r[1] > 60.0
    assert log_r[2] < troll.MAX_LOG_RATIO
    advantages = torch.tensor([adv, adv, 0.7])
    loss = troll_token_loss(terms, advantages, alpha=1.0)
    (grad,) = torch.autograd.grad(loss.sum(), x, retain_graph=True)
    assert bool(torch.isfinite(loss).all()) and bool(torch.isfinite(grad.float()).all())

    # Value: -exp(min(log r, 20)) A + KL; gradient: -exp(min(log r, 20)) A d log p(a_t) + d KL (the weight is
    # constant in the score's direction only: DPPO's sg(min(r, C)) x d log pi, and exactly d r below the cap).
    weight = log_r.clamp(max=troll.MAX_LOG_RATIO).exp()
    expected = -weight * advantages.double() + terms.regression_kl.detach().double()
    torch.testing.assert_close(loss.detach().double(), expected, rtol=1e-6, atol=1e-6)
    work = terms.log_p_sampled.dtype
    surrogate = (-weight.to(work) * advantages.to(work) * terms.log_p_sampled + terms.regression_kl).sum()
    (want,) = torch.autograd.grad(surrogate, x)
    for row in range(3):  # each row on its own scale: the capped rows' weight 4.85e8 would hide row 2
        scale = float(want[row].double().abs().max()) + 1e-30
        torch.testing.assert_close(grad[row].double() / scale, want[row].double() / scale, rtol=0, atol=1e-5)
    if adv != 0.0:  # the capped tokens still learn: a clamp with zero gradient above the cap would not
        assert float(grad[0].double().abs().max()) > 1e3


def test_below_the_cap_the_loss_is_eq5_unchanged():
    logits, ids, lps, sampled, sampled_lp = far_token_case(torch.float64)
    x = logits[2:].clone().requires_grad_()
    terms = troll_token_terms(x, ids[2:], lps[2:], sampled[2:], sampled_lp[2:], eps=0.05)
    loss = troll_token_loss(terms, torch.tensor([-1.3], dtype=torch.float64))
    eq5 = -torch.exp(terms.log_p_sampled - terms.log_mu_sampled) * -1.3 + terms.regression_kl
    assert loss.item() == eq5.item()
    g_loss = torch.autograd.grad(loss.sum(), x, retain_graph=True)[0]
    g_eq5 = torch.autograd.grad(eq5.sum(), x)[0]
    torch.testing.assert_close(g_loss, g_eq5, rtol=1e-12, atol=0)


def poke_far_token(model, data, seq, t, adv):
    """Token t of sequence seq becomes the model's favourite there; mu agrees with the model everywhere else (its
    top-K report is the model's distribution without that token) and gives it a rollout log-prob of -100."""
    prompt_len = data["prompts"][seq].numel()
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"][seq][None], use_cache=False).logits[0].double()
    row = logits[prompt_len - 1 + t] / float(data["temperature"][seq])
    sampled = int(row.argmax())  # position t's logits do not depend on token t
    _poke(data, "responses", seq, t, sampled)
    _poke(data, "input_ids", seq, prompt_len + t, sampled)
    mu = torch.log_softmax(row.index_fill(0, torch.tensor([sampled]), -math.inf), -1)
    lp, ids = mu.topk(K)
    _poke(data, "rollout_topk_ids", seq, t, ids, column=slice(None))
    _poke(data, "rollout_topk_logprobs", seq, t, lp.float(), column=slice(None))
    _poke(data, "rollout_log_probs", seq, t, -100.0)
    _poke(data, "advantages", seq, t, adv)


@pytest.mark.parametrize("eps", [1.0, 0.05])
@pytest.mark.parametrize("adv", [1.0, 0.0, -1.0])
def test_through_verls_engine_the_loss_and_gradients_are_finite_with_the_capped_weight(model, eps, adv):
    data, _ = troll_batch([3, 5], [4, 6], seed=7)
    poke_far_token(model, data, 0, 1, adv)
    config = actor_config("troll", topk=K, troll_eps=eps, troll_alpha=1.0)
    model.zero_grad(set_to_none=True)
    loss_fn, model_output, _ = run(model, data, config)
    terms = {
        key: no_padding_2_padding(model_output[f"troll_{key}"], data) for key in ("log_p", "log_mu", "regression_kl")
    }
    log_r = (terms["log_p"] - terms["log_mu"]).detach()
    assert float(log_r[0, 1]) > FLOAT32_EXP_OVERFLOW, "the case must overflow float32's exp"
    assert float(log_r.masked_fill(log_r == log_r[0, 1], 0.0).max()) < troll.MAX_LOG_RATIO  # one far token
    loss, metrics = loss_fn(model_output=model_output, data=data, dp_group=None)
    params = list(model.parameters())
    got = torch.autograd.grad(loss, params, retain_graph=True)
    assert torch.isfinite(loss), f"loss {loss.item()}"
    assert all(bool(torch.isfinite(g).all()) for g in got)
    assert metrics["actor/dppo/dropped_frac"].aggregate() == 0.0  # finite inputs: kept, not dropped

    # The gradient is the capped weight times the score, on the engine's own graph (token-mean over 10 tokens).
    # Not against a float64 model: at this token p(a_t) is pinned by the constraint (d log p(a_t) ~ 1e-8), and
    # the weight 4.85e8 turns float32's rounding of the logits into O(1) changes of the gradient.
    advantages = torch.nested.to_padded_tensor(data["advantages"], 0.0).float()
    response = torch.nested.to_padded_tensor(data["response_mask"], 0).bool()
    weight = log_r.clamp(max=troll.MAX_LOG_RATIO).exp()
    surrogate = torch.where(response, -weight * advantages * terms["log_p"] + terms["regression_kl"], 0.0)
    want = torch.autograd.grad(surrogate.sum() / response.sum(), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))

    model.double()  # the value: Eq. 5 with the same cap, by a direct float64 call of the math layer
    try:
        with torch.no_grad():
            expected = reference_loss(model, data, config)
    finally:
        model.float()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-6)
