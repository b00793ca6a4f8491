"""The four loss modes through verl's real `ppo_loss`, against the independent float64 reference of
Eq. (9), (11)-(14) (tests/reference.py), with and without rollout log-probs in the micro-batch."""

import math

import pytest
import torch

from helpers import actor_config, v1_micro_batch
from reference import reference_loss
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.utils.losses import ppo_loss

MODES = ("dppo_binary_tv", "dppo_binary_kl", "grpo_clip", "pg_is")
LENS = [6, 3, 5, 1]
T = 6


def random_case(seed: int, drift: float = 0.6):
    """pi, mu (rollout) and a recomputed old policy for 4 responses, with a real spread of probabilities."""
    gen = torch.Generator().manual_seed(seed)
    shape = (len(LENS), T)
    mu = torch.log(torch.rand(shape, generator=gen).clamp(min=1e-4) ** 2)
    old = (mu + 0.05 * torch.randn(shape, generator=gen)).clamp(max=-1e-4)
    pi = (mu + drift * torch.randn(shape, generator=gen)).clamp(max=-1e-4)
    adv = torch.randn(shape, generator=gen)
    adv[:, ::3] = 0.0
    return pi, mu, old, adv


def run_ppo_loss(config, pi, old, adv, rollout=None, nested=True, entropy=None):
    pi = pi.clone().requires_grad_()
    model_output, data, leaf = v1_micro_batch(
        pi, old, adv, LENS, rollout_log_prob=rollout, entropy=entropy, nested_fields=nested
    )
    loss, metrics = ppo_loss(config, model_output, data)
    loss.backward()
    # Per-response-token gradient, read back from the model output's (left-shifted) positions.
    grads, offset = [], 0
    for i, r in enumerate(LENS):
        p = 3 + (i % 2)
        grads.append(leaf.grad[offset + p - 1 : offset + p - 1 + r].tolist())
        offset += p + r
    return loss.item(), grads, metrics


def rows(t):
    return [t[i, :n].double().tolist() for i, n in enumerate(LENS)]


CASES = [
    # mode, DPPOLossConfig fields, resolved (delta_low, delta_high, cap)
    ("dppo_binary_tv", dict(delta_low=0.15, delta_high=0.15, ratio_cap=10000.0), (0.15, 0.15, 10000.0)),
    ("dppo_binary_kl", dict(delta_low=0.05, delta_high=0.05, ratio_cap=10000.0), (0.05, 0.05, 10000.0)),
    ("dppo_binary_tv", dict(delta_low=0.1, delta_high=0.3, ratio_cap=2.0), (0.1, 0.3, 2.0)),
    ("grpo_clip", dict(ratio_cap=10000.0), (0.2, 0.28, 10000.0)),
    ("grpo_clip", dict(ratio_cap=10000.0, relax_below=0.3, relax_side="high"), (0.2, 0.28, 10000.0)),
    ("grpo_clip", dict(ratio_cap=10000.0, relax_below=0.3, relax_side="low"), (0.2, 0.28, 10000.0)),
    ("grpo_clip", dict(ratio_cap=10000.0, relax_below=0.3, relax_side="both"), (0.2, 0.28, 10000.0)),
    ("pg_is", dict(ratio_cap=math.inf), (0.0, 0.0, math.inf)),
    ("pg_is", dict(ratio_cap=1.5), (0.0, 0.0, 1.5)),  # PG-TIS / CISPO
]


@pytest.mark.parametrize("mode,fields,resolved", CASES)
@pytest.mark.parametrize("with_rollout,anchor", [(True, "rollout"), (False, "rollout"), (True, "recompute")])
def test_matches_reference_through_verl_ppo_loss(mode, fields, resolved, with_rollout, anchor):
    pi, mu, old, adv = random_case(seed=hash((mode, str(fields))) % 1000)
    config = actor_config(mode, clip_ratio_low=0.2, clip_ratio_high=0.28, anchor=anchor, **fields)
    loss, grads, _ = run_ppo_loss(config, pi, old, adv, rollout=mu if with_rollout else None)
    # Without rollout log-probs in the batch, old_log_probs are mu (bypass mode / direct call).
    mu_ref = mu if with_rollout else old
    anchor_ref = old if anchor == "recompute" else mu_ref
    relax = {k: fields[k] for k in ("relax_below", "relax_side") if k in fields}
    ref_loss, ref_grads = reference_loss(
        mode, rows(adv), rows(pi), rows(mu_ref), rows(anchor_ref), LENS, "token-mean", *resolved, **relax
    )
    assert loss == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    for got_row, ref_row in zip(grads, ref_grads):
        assert got_row == pytest.approx(ref_row, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize(
    "agg", ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_every_loss_agg_mode_goes_through_verl_agg_loss(agg):
    pi, mu, old, adv = random_case(seed=3)
    config = actor_config("dppo_binary_kl", loss_agg_mode=agg, delta_low=0.05, delta_high=0.05, ratio_cap=10000.0)
    loss, grads, _ = run_ppo_loss(config, pi, old, adv, rollout=mu)
    ref_loss, ref_grads = reference_loss(
        "dppo_binary_kl", rows(adv), rows(pi), rows(mu), rows(mu), LENS, agg, 0.05, 0.05, 10000.0, horizon=T
    )
    assert loss == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    assert sum(grads, []) == pytest.approx(sum(ref_grads, []), rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_is_minus_mask_times_capped_ratio_times_advantage(mode):
    # token-sum, dp 1: d loss / d log pi_t is exactly -M_t * min(r_t, C) * A_t.
    pi, mu, old, adv = random_case(seed=11, drift=0.8)
    config = actor_config(mode, loss_agg_mode="token-sum", delta_low=0.1, delta_high=0.1, ratio_cap=2.5)
    _, grads, metrics = run_ppo_loss(config, pi, old, adv, rollout=mu)
    r = torch.exp(pi - mu)
    expected_unmasked = -(r.clamp(max=2.5)) * adv
    n_masked = 0
    for i, n in enumerate(LENS):
        for t in range(n):
            got, full = grads[i][t], expected_unmasked[i, t].item()
            assert got == pytest.approx(full, rel=1e-5, abs=1e-7) or got == 0.0
            n_masked += got == 0.0 and full != 0.0
    if mode == "pg_is":
        assert n_masked == 0
    else:
        assert n_masked > 0  # the case is built so that every trust-region mode blocks something


def test_nested_and_padded_fields_agree():
    pi, mu, old, adv = random_case(seed=5)
    config = actor_config("dppo_binary_tv", delta_low=0.15, delta_high=0.15)
    nested = run_ppo_loss(config, pi, old, adv, rollout=mu, nested=True)
    padded = run_ppo_loss(config, pi, old, adv, rollout=mu, nested=False)
    assert nested[0] == pytest.approx(padded[0]) and nested[1] == padded[1]


def test_paper_sec42_examples_rare_token_passes_dppo_dominant_token_blocked():
    # Sec. 4.2 / Fig. 1: 1e-4 -> 1e-2 (A>0) and 0.99 -> 0.80 (A<0), the anchor being mu.
    mu = torch.tensor([[math.log(1e-4), math.log(0.99)]])
    pi = torch.tensor([[math.log(1e-2), math.log(0.80)]])
    adv = torch.tensor([[1.0, -1.0]])
    blocked = {}
    for mode, fields in [
        ("grpo_clip", {}),
        ("dppo_binary_tv", dict(delta_low=0.15, delta_high=0.15)),
        ("dppo_binary_kl", dict(delta_low=0.05, delta_high=0.05)),
    ]:
        config = actor_config(mode, loss_agg_mode="token-sum", clip_ratio_high=0.28, ratio_cap=10000.0, **fields)
        pi_leaf = pi.clone().requires_grad_()
        loss, _ = get_policy_loss_fn(mode)(
            mu, pi_leaf, adv, torch.ones_like(adv, dtype=torch.bool), "token-sum", config
        )
        loss.backward()
        blocked[mode] = (pi_leaf.grad == 0).squeeze(0).tolist()
    assert blocked["grpo_clip"] == [True, False]  # ratio 100 clipped; ratio 0.81 allowed
    assert blocked["dppo_binary_tv"] == [False, True]  # |TV| 0.0099 passes; 0.19 > 0.15 blocked
    assert blocked["dppo_binary_kl"] == [False, True]


def test_minimal_negative_mask_sec53():
    # dppo_binary_tv with delta_low=delta, delta_high=1.0: block only A<0 and mu - pi > delta.
    mu = torch.log(torch.tensor([[0.9, 0.9, 0.9, 0.1, 0.99]]))
    pi = torch.log(torch.tensor([[0.3, 0.5, 0.3, 0.95, 0.3]]))
    adv = torch.tensor([[-1.0, -1.0, 1.0, 1.0, -1.0]])
    config = actor_config("dppo_binary_tv", loss_agg_mode="token-sum", delta_low=0.5, delta_high=1.0, ratio_cap=10000.0)
    pi_leaf = pi.clone().requires_grad_()
    loss, _ = get_policy_loss_fn("dppo_binary_tv")(
        mu, pi_leaf, adv, torch.ones_like(adv, dtype=torch.bool), "token-sum", config
    )
    loss.backward()
    assert (pi_leaf.grad == 0).squeeze(0).tolist() == [True, False, False, False, True]


def test_unset_fields_follow_verl_convention_and_plain_policy_loss_config_works():
    pi, mu, old, adv = random_case(seed=8)
    via_fallback = actor_config("dppo_binary_tv", clip_ratio_low=0.12, clip_ratio_high=0.18, clip_ratio_c=4.0)
    explicit = actor_config("dppo_binary_tv", delta_low=0.12, delta_high=0.18, ratio_cap=4.0)
    plain = actor_config("dppo_binary_tv", clip_ratio_low=0.12, clip_ratio_high=0.18, clip_ratio_c=4.0, plain=True)
    results = [run_ppo_loss(c, pi, old, adv, rollout=mu)[:2] for c in (via_fallback, explicit, plain)]
    assert results[0] == results[1] == results[2]


def test_grpo_clip_ignores_deltas():
    pi, mu, old, adv = random_case(seed=9)
    with_deltas = actor_config("grpo_clip", clip_ratio_high=0.28, delta_low=0.01, delta_high=0.01)
    without = actor_config("grpo_clip", clip_ratio_high=0.28)
    assert (
        run_ppo_loss(with_deltas, pi, old, adv, rollout=mu)[:2] == run_ppo_loss(without, pi, old, adv, rollout=mu)[:2]
    )


def test_rollout_log_probs_are_mu_when_present():
    # The same batch with a different rollout policy must change the loss: the hook really hands mu over.
    pi, mu, old, adv = random_case(seed=12)
    config = actor_config("pg_is", ratio_cap=math.inf)
    a = run_ppo_loss(config, pi, old, adv, rollout=mu)[0]
    b = run_ppo_loss(config, pi, old, adv, rollout=mu - 0.5)[0]
    c = run_ppo_loss(config, pi, old, adv, rollout=None)[0]
    assert a != pytest.approx(b) and a != pytest.approx(c)


@pytest.mark.parametrize("mode", ["vanilla", "dppo_tv", "dppo_kl", "gspo"])
def test_verl_builtin_losses_pass_through_unchanged(mode):
    pi, mu, old, adv = random_case(seed=13)
    config = actor_config(mode, plain=True)
    wrapped = ppo_loss
    original = ppo_loss.__wrapped__
    outs = []
    for fn in (wrapped, original):
        leaf_pi = pi.clone().requires_grad_()
        model_output, data, leaf = v1_micro_batch(leaf_pi, old, adv, LENS, rollout_log_prob=mu)
        loss, metrics = fn(config, model_output, data)
        loss.backward()
        outs.append((loss.item(), leaf.grad.clone(), {k: (v.aggregation, v.values) for k, v in metrics.items()}))
    assert outs[0][0] == outs[1][0]
    assert torch.equal(outs[0][1], outs[1][1])
    assert outs[0][2] == outs[1][2]


def test_loss_and_metrics_under_bf16_inputs():
    pi, mu, old, adv = random_case(seed=14)
    config = actor_config("dppo_binary_kl", delta_low=0.05, delta_high=0.05, ratio_cap=10000.0)
    loss32 = run_ppo_loss(config, pi, old, adv, rollout=mu)[0]
    loss16, _, metrics = run_ppo_loss(config, pi.bfloat16(), old.bfloat16(), adv.bfloat16(), rollout=mu.bfloat16())
    assert math.isfinite(loss16) and loss16 == pytest.approx(loss32, rel=0.1, abs=1e-2)
    assert all(math.isfinite(v) for m in metrics.values() for v in m.values)


def test_unique_names_registered_without_overwriting_verl():
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    for mode in MODES:
        assert getattr(POLICY_LOSS_REGISTRY[mode], "__verl_dppo__", False)
    for builtin in ("vanilla", "dppo_tv", "dppo_kl", "cispo"):
        assert not getattr(POLICY_LOSS_REGISTRY[builtin], "__verl_dppo__", False)


def test_all_combinations_of_sides_are_distinct():
    # Guard against a relax option silently doing nothing: the three sides give three different losses.
    pi, mu, old, adv = random_case(seed=15, drift=1.0)
    losses = set()
    for side in ("low", "high", "both"):
        config = actor_config("grpo_clip", relax_below=0.5, relax_side=side)
        losses.add(round(run_ppo_loss(config, pi, old, adv, rollout=mu)[0], 7))
    assert len(losses) == 3


def _bf16_on_policy_case(seed: int = 3, tokens: int = 64, vocab: int = 1000):
    """One on-policy micro-batch as a bf16 run gives it: the same bf16 logits scored by verl's log-prob path without
    flash-attn (`logprobs_from_logits_v2`: a bf16 log-softmax, pi) and by the rollout engine (float32 log-softmax of
    the bf16 logits, mu), confident rows (top logit 10-16 above 1,000 unit-normal others: 1 - p from 2e-4 to 0.07)."""
    from verl.utils.torch_functional import logprobs_from_logits_v2

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(LENS), T, vocab, generator=gen)
    logits[..., 0] += 10.0 + 6.0 * torch.rand(len(LENS), T, generator=gen)
    logits = logits.bfloat16()
    labels = torch.zeros(len(LENS), T, dtype=torch.long)  # the sampled token is the top one
    pi = logprobs_from_logits_v2(logits, labels)
    mu = torch.log_softmax(logits.float(), dim=-1)[..., 0]
    return pi, mu, torch.ones(len(LENS), T)


@pytest.mark.parametrize("mode, delta", [("dppo_binary_kl", 0.05), ("dppo_binary_tv", 0.15)])
def test_bf16_log_probs_on_policy_mask_nothing(mode, delta):
    """Issue 34.2: on the policy that sampled, a bf16 log-softmax (log pi = 0 exactly where 1 - pi is below bf16's
    resolution) against the engine's float32 mu is no divergence: nothing is masked and the mismatch KL stays at the
    rounding's size, as with float32 on both sides. Before, the binary KL read about 87 x (1 - mu) at those tokens."""
    pi, mu, adv = _bf16_on_policy_case()
    assert pi.dtype == torch.bfloat16 and int((pi[:, :T] == 0).sum()) > 5  # the rounding this test is about
    config = actor_config(mode, delta_low=delta, delta_high=delta, ratio_cap=10000.0)
    *_, metrics = run_ppo_loss(config, pi, mu, adv, rollout=mu)
    values = {name: m.values[0] if hasattr(m, "values") else m for name, m in metrics.items()}
    assert values["actor/dppo/masked_frac_pos"] == 0.0, values
    assert values["actor/dppo/mismatch_kl_mean"] < 1e-3, values
    # float32 inputs keep the exact divergence: the same pi, given in float32, is taken at its value
    *_, exact = run_ppo_loss(config, pi.float(), mu, adv, rollout=mu)
    exact_kl = exact["actor/dppo/mismatch_kl_mean"]
    assert (exact_kl.values[0] if hasattr(exact_kl, "values") else exact_kl) > 0.05


# (mu(a_t), pi(a_t) before bf16, sign of A): near p = 1, the cases an audit found kept in bf16 though fp32 masks them
# (issue 40.3); pi = 1.0 is the CPU kernel's own pattern, a bf16 log-softmax reading log pi = 0 exactly.
BF16_NEAR_ONE = [
    (0.95, 0.999, 1.0),
    (0.97, 0.999, 1.0),
    (0.98, 0.9995, 1.0),
    (0.99, 0.99999, 1.0),
    (0.9999, 0.95, -1.0),
    (0.955, 1.0, 1.0),
    (0.96, 1.0, 1.0),
]


def _least_kl_within_the_bound(mu: float, log_pi_bf16: float) -> float:
    """The least binary KL(mu || pi) over every pi the bf16 value is consistent with: |log pi - value| within the
    error bound of verl's bf16 log-softmax, 2^-8 x (1 + |value|) (tests/test_math_properties.py measures it), on a
    float64 grid of that interval: an independent reference for what the loss may exempt."""
    radius = 2.0**-8 * (1.0 + abs(log_pi_bf16))
    grid = torch.linspace(log_pi_bf16 - radius, min(0.0, log_pi_bf16 + radius), 20001, dtype=torch.float64)
    pi = grid.exp().clamp(max=1 - 1e-300)
    kl = mu * torch.log(mu / pi) + (1 - mu) * torch.log((1 - mu) / (1 - pi))
    return float(kl.min())


def test_bf16_exempts_no_more_than_the_rounding_bound_near_p_one():
    """Issue 40.3: a bf16 log pi is exempt from a divergence only as far as bf16's error bound reaches. With
    dppo_binary_kl (delta 0.05), each token is masked exactly where every pi consistent with the bound gives a KL
    above delta (the float64 reference above), kept where one within it does not; the same pi in float32 is taken
    at its value (every case masked: their exact KLs are 0.051-0.15). mu 0.95 -> 0.999 and the kernel's log pi = 0
    at mu 0.955 and 0.96 were kept before (a radius twice the bound); 0.97 -> 0.999 stays kept: log pi = -0.001 in
    bf16 may be -0.0049 in truth, 1 - pi 5 times larger, and KL(0.97 || 0.9951) is 0.030."""
    pi, mu, adv = torch.zeros(len(LENS), T), torch.zeros(len(LENS), T), torch.ones(len(LENS), T)
    for t, (mu_p, pi_p, sign) in enumerate(BF16_NEAR_ONE):
        mu[0 if t < 6 else 2, t % 6] = math.log(mu_p)
        pi[0 if t < 6 else 2, t % 6] = math.log(pi_p)
        adv[0 if t < 6 else 2, t % 6] = sign
    pi_bf16 = pi.bfloat16()
    config = actor_config("dppo_binary_kl", delta_low=0.05, delta_high=0.05, ratio_cap=10000.0)
    _, grads, _ = run_ppo_loss(config, pi_bf16, mu, adv, rollout=mu)
    _, grads_fp32, _ = run_ppo_loss(config, pi_bf16.float(), mu, adv, rollout=mu)
    outcomes = []
    for t, (mu_p, pi_p, _) in enumerate(BF16_NEAR_ONE):
        row, col = (0 if t < 6 else 2), t % 6
        masked = grads[row][col] == 0.0
        expected = _least_kl_within_the_bound(mu_p, float(pi_bf16[row, col])) > 0.05
        assert masked == expected, (mu_p, pi_p, grads[row][col])
        assert grads_fp32[row][col] == 0.0, (mu_p, pi_p)  # float32: the exact divergence, above delta
        outcomes.append(masked)
    assert outcomes == [True, False, False, False, False, True, True], outcomes


def test_bf16_on_both_sides_moves_each_within_its_own_bound():
    """Issue 53.1: with mu in bf16 too, each side moves within its own bf16 bound only, not both bounds on pi: a token
    is masked exactly where every pair (mu', pi') the two bounds allow has a KL above delta (a float64 grid of that
    box). mu 0.95 -> 0.999 (KL 0.148) was kept before (0.046 at pi moved by both radii; the box's least is 0.063),
    and on the policy that sampled (pi verl's bf16 log-softmax, mu the engine's float32 one handed over in bf16)
    nothing is masked."""
    pi, mu, adv = torch.zeros(len(LENS), T), torch.zeros(len(LENS), T), torch.ones(len(LENS), T)
    for t, (mu_p, pi_p, sign) in enumerate(BF16_NEAR_ONE):
        mu[0 if t < 6 else 2, t % 6], pi[0 if t < 6 else 2, t % 6] = math.log(mu_p), math.log(pi_p)
        adv[0 if t < 6 else 2, t % 6] = sign
    mu, pi = mu.bfloat16(), pi.bfloat16()
    config = actor_config("dppo_binary_kl", delta_low=0.05, delta_high=0.05, ratio_cap=10000.0)
    _, grads, _ = run_ppo_loss(config, pi, mu, adv, rollout=mu)
    grid = torch.linspace(0.0, 1.0, 1001, dtype=torch.float64)
    outcomes = []
    for t in range(len(BF16_NEAR_ONE)):
        row, col = (0 if t < 6 else 2), t % 6
        box = []
        for value in (float(mu[row, col]), float(pi[row, col])):
            radius = 2.0**-8 * (1.0 + abs(value))
            box.append((value - radius) + grid * (min(0.0, value + radius) - (value - radius)))
        log_mu, log_pi = box[0][:, None], box[1][None, :]
        one_minus_pi = (-torch.expm1(log_pi)).clamp(min=1e-300)
        kl = log_mu.exp() * (log_mu - log_pi) - torch.expm1(log_mu) * torch.log(-torch.expm1(log_mu) / one_minus_pi)
        masked = grads[row][col] == 0.0
        assert masked == (float(kl.min()) > 0.05), (BF16_NEAR_ONE[t], grads[row][col], float(kl.min()))
        outcomes.append(masked)
    assert outcomes == [True, False, False, False, False, True, False], outcomes
    pi_bf16, mu_fp32, adv = _bf16_on_policy_case()  # the engine's float32 log-softmax, handed over in bf16
    *_, metrics = run_ppo_loss(config, pi_bf16, mu_fp32.bfloat16(), adv, rollout=mu_fp32.bfloat16())
    values = {name: m.values[0] if hasattr(m, "values") else m for name, m in metrics.items()}
    assert values["actor/dppo/masked_frac_pos"] == 0.0 and values["actor/dppo/mismatch_kl_mean"] == 0.0, values


def test_thresholds_inherited_from_the_ratio_clip_are_warned_once_in_the_worker(caplog):
    """Issue 32.3: a GRPO command switched by its loss_mode line alone trains DPPO with PPO's eps as delta (verl's
    PolicyLossConfig has no delta): the worker says so in one line naming the fix; with DPPOLossConfig's own values
    (the README's "From GRPO" overrides) it does not."""
    import logging

    pi, mu, old, adv = random_case(seed=21)
    inherited = actor_config("dppo_binary_tv", clip_ratio_low=0.21, clip_ratio_high=0.29, plain=True)
    with caplog.at_level(logging.WARNING, logger="verl_dppo"):
        run_ppo_loss(inherited, pi, old, adv, rollout=mu)
        run_ppo_loss(inherited, pi, old, adv, rollout=mu)
    lines = [r.getMessage() for r in caplog.records if "inherited from verl's ratio clip" in r.getMessage()]
    assert len(lines) == 1 and "clip_ratio_low=0.21 clip_ratio_high=0.29 clip_ratio_c=3" in lines[0], lines
    assert "delta_low=0.15" in lines[0] and "verl_dppo.DPPOLossConfig" in lines[0]
    caplog.clear()
    own = actor_config(
        "dppo_binary_tv", clip_ratio_low=0.21, clip_ratio_high=0.29, delta_low=0.15, delta_high=0.15, ratio_cap=10000.0
    )
    with caplog.at_level(logging.WARNING, logger="verl_dppo"):
        run_ppo_loss(own, pi, old, adv, rollout=mu)
    assert not [r for r in caplog.records if "inherited" in r.getMessage()]
