"""The pure-math layer: Eq. (13), (14), the ratio deviation of Eq. (9)/(10), and the shared mask of Eq. (12)."""

import math
import subprocess
import sys

import pytest
import torch

from verl_dppo.math.divergence import (
    binary_kl,
    binary_tv,
    log1mexp,
    nearest_within_rounding,
    ratio_deviation,
    rounding_radius,
)
from verl_dppo.math.trust_region import trust_region_keep

lg = math.log


def test_math_layer_imports_no_verl():
    code = "import sys, verl_dppo.math.divergence, verl_dppo.math.topk, verl_dppo.math.trust_region, verl_dppo.math.troll; assert 'verl' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_binary_tv_eq13_hand_values():
    mu = torch.tensor([lg(0.99), lg(1e-4), lg(0.5)])
    pi = torch.tensor([lg(0.80), lg(1e-2), lg(0.5)])
    torch.testing.assert_close(binary_tv(mu, pi), torch.tensor([0.19, 0.0099, 0.0]), atol=1e-6, rtol=1e-5)


def test_binary_kl_eq14_hand_values():
    def eq14(m, p):
        return m * math.log(m / p) + (1 - m) * math.log((1 - m) / (1 - p))

    pairs = [(0.99, 0.80), (1e-4, 1e-2), (0.3, 0.6), (0.999999, 0.9), (0.5, 0.5)]
    mu = torch.tensor([lg(m) for m, _ in pairs], dtype=torch.float64)
    pi = torch.tensor([lg(p) for _, p in pairs], dtype=torch.float64)
    expected = torch.tensor([eq14(m, p) for m, p in pairs], dtype=torch.float32)
    torch.testing.assert_close(binary_kl(mu, pi), expected, rtol=2e-4, atol=1e-7)


def test_binary_kl_edges_follow_0log0_convention():
    # mu = 1: only the sampled term remains; mu = 0: only the "other" term. pi = 1 or 0 where mu is not: the exact
    # value is +inf; with probabilities floored at float32's tiny it is finite and about 87 x the mass involved.
    got = binary_kl(
        torch.tensor([0.0, -math.inf, lg(0.5), lg(0.5), -math.inf]),
        torch.tensor([lg(0.5), lg(0.5), 0.0, -math.inf, -math.inf]),
    )
    assert got[0].item() == pytest.approx(math.log(2), rel=1e-5)
    assert got[1].item() == pytest.approx(math.log(2), rel=1e-5)
    assert 40 < got[2].item() < 50 and 40 < got[3].item() < 50
    assert got[4].item() == 0.0
    assert torch.isnan(binary_kl(torch.tensor([math.nan]), torch.tensor([-1.0]))).all()  # NaN is never hidden


def test_log1mexp_accurate_near_both_ends():
    x = torch.tensor([-1e-10, -1e-3, -0.5, -5.0, -50.0], dtype=torch.float64)
    expected = torch.log1p(-torch.exp(x)).float()
    expected[0] = math.log(1e-10)
    torch.testing.assert_close(log1mexp(x.float()), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_any_float_dtype_in_float32_out(dtype):
    mu, pi = torch.tensor([-0.1, -2.0], dtype=dtype), torch.tensor([-0.3, -1.0], dtype=dtype)
    for fn in (binary_tv, binary_kl, ratio_deviation):
        out = fn(mu, pi)
        assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_mismatched_shapes_and_int_inputs_raise():
    with pytest.raises(ValueError, match="shape"):
        binary_tv(torch.zeros(3), torch.zeros(4))
    with pytest.raises(TypeError, match="float"):
        binary_kl(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))


def test_binary_divergences_lower_bound_the_exact_ones():
    # Appendix C: collapsing to {a_t, other} can only shrink an f-divergence.
    gen = torch.Generator().manual_seed(0)
    mu = torch.softmax(3 * torch.randn(256, 50, generator=gen, dtype=torch.float64), -1)
    pi = torch.softmax(torch.log(mu) + 0.7 * torch.randn(256, 50, generator=gen, dtype=torch.float64), -1)
    a = torch.multinomial(mu, 1, generator=gen).squeeze(-1)
    mu_a, pi_a = mu.gather(-1, a[:, None]).squeeze(-1), pi.gather(-1, a[:, None]).squeeze(-1)
    exact_tv = 0.5 * (mu - pi).abs().sum(-1)
    exact_kl = (mu * (mu.log() - pi.log())).sum(-1)
    assert (binary_tv(mu_a.log(), pi_a.log()) <= exact_tv.float() + 1e-6).all()
    assert (binary_kl(mu_a.log(), pi_a.log()) <= exact_kl.float() + 1e-6).all()


def _kl64(log_mu: torch.Tensor, log_pi: torch.Tensor) -> torch.Tensor:
    """Eq. (14) in float64, 1 - p by expm1, 0 log 0 = 0."""
    mu, one_minus_mu, one_minus_pi = log_mu.exp(), -torch.expm1(log_mu), (-torch.expm1(log_pi)).clamp(min=1e-300)
    other = torch.where(one_minus_mu > 0, one_minus_mu * torch.log(one_minus_mu.clamp(min=1e-300) / one_minus_pi), 0.0)
    return mu * (log_mu - log_pi) + other


def test_nearest_pair_within_each_sides_rounding_is_the_least_divergence_of_the_box():
    """Issue 53.1: (mu', pi'), each log-prob within its own side's bf16 radius of the value given, is where binary TV
    and KL take their least value over every pair the two roundings allow: checked against a float64 grid of the box
    (its corners included; to its step where the intervals overlap), on confident, middling and rare tokens, both orders, overlapping intervals (least 0,
    mu' = pi') and a float32 side (radius 0). Both radii on pi alone (the rule before) read KL 0.046 for bf16 mu 0.95
    against pi 0.999; every pair in the box is at least 0.063."""
    pairs = [
        (0.95, 0.999),
        (0.999, 0.95),
        (0.97, 0.999),
        (0.9999, 0.99),
        (0.5, 0.6),
        (0.6, 0.5),
        (0.3, 0.302),
        (1e-3, 3e-3),
        (0.2, 1e-4),
        (0.99, 1.0),
        (1.0, 0.995),
        (0.9, 0.9),
        (0.999, 0.9995),
    ]
    dtypes = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)]
    grid, apart = torch.linspace(0.0, 1.0, 801, dtype=torch.float64), 0
    for (mu_p, pi_p), (mu_dtype, pi_dtype) in ((p, d) for p in pairs for d in dtypes):
        mu = torch.tensor([math.log(mu_p)]).to(mu_dtype).double()
        pi = torch.tensor([math.log(pi_p)]).to(pi_dtype).double()
        mu_r, pi_r = rounding_radius(mu, mu_dtype).double(), rounding_radius(pi, pi_dtype).double()
        mu_near, pi_near = nearest_within_rounding(mu, pi, mu_r, pi_r)
        assert (mu_near - mu).abs() <= mu_r + 1e-15 and (pi_near - pi).abs() <= pi_r + 1e-15
        mu_box = ((mu - mu_r) + grid * ((mu + mu_r).clamp(max=0.0) - (mu - mu_r)))[:, None]
        pi_box = ((pi - pi_r) + grid * ((pi + pi_r).clamp(max=0.0) - (pi - pi_r)))[None, :]
        least_kl, least_tv = float(_kl64(mu_box, pi_box).min()), float((mu_box.exp() - pi_box.exp()).abs().min())
        case = (mu_p, pi_p, mu_dtype, pi_dtype, least_kl)
        kl_near, tv_near = float(_kl64(mu_near, pi_near)), float((mu_near.exp() - pi_near.exp()).abs())
        assert kl_near <= least_kl * (1 + 1e-9) and tv_near <= least_tv * (1 + 1e-9), case  # none in the box less
        if float((pi - mu).abs()) <= float(mu_r + pi_r):  # the intervals overlap: nothing the rounding can tell
            assert float(mu_near) == float(pi_near), case
            continue
        assert kl_near == pytest.approx(least_kl, rel=1e-9) and tv_near == pytest.approx(least_tv, rel=1e-9), case
        apart += 0 if mu_dtype is torch.float32 or pi_dtype is torch.float32 else 1
    assert 0 < apart < len(pairs)  # both sides bf16: some pairs apart, some overlapping
    mu, pi = torch.tensor([math.log(0.95)]).bfloat16(), torch.tensor([math.log(0.999)]).bfloat16()
    mu_near, pi_near = nearest_within_rounding(
        mu.float(), pi.float(), rounding_radius(mu, mu.dtype), rounding_radius(pi, pi.dtype)
    )
    assert 0.06 < float(binary_kl(mu_near, pi_near)) < 0.065 < 0.14 < float(binary_kl(mu, pi))


def test_ratio_deviation_is_abs_ratio_minus_one():
    got = ratio_deviation(torch.tensor([lg(1e-4), lg(0.99)]), torch.tensor([lg(1e-2), lg(0.80)]))
    torch.testing.assert_close(got, torch.tensor([99.0, 1 - 0.80 / 0.99]), rtol=1e-4, atol=1e-6)


def test_eq12_mask_blocks_only_moves_away_in_the_advantage_direction():
    A = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 0.0])
    log_r = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.5, -0.5, 0.5])
    D = torch.tensor([0.3, 0.3, 0.3, 0.3, 0.1, 0.1, 0.9])
    keep = trust_region_keep(A, log_r, D, delta_low=0.2, delta_high=0.2)
    # blocked: A>0 moving up past delta; A<0 moving down past delta. Toward-anchor moves, small D, A=0 pass.
    assert keep.tolist() == [False, True, False, True, True, True, True]


def test_eq12_thresholds_are_per_side():
    A, log_r, D = torch.tensor([1.0, -1.0]), torch.tensor([0.1, -0.1]), torch.tensor([0.3, 0.3])
    assert trust_region_keep(A, log_r, D, delta_low=0.5, delta_high=0.2).tolist() == [False, True]
    assert trust_region_keep(A, log_r, D, delta_low=0.2, delta_high=0.5).tolist() == [True, False]


@pytest.mark.parametrize(
    "side,expected", [("high", [True, False, False]), ("low", [False, True, False]), ("both", [True, True, False])]
)
def test_relax_frees_rare_tokens_on_the_chosen_side(side, expected):
    A, log_r, D = torch.tensor([1.0, -1.0, 1.0]), torch.tensor([1.0, -1.0, 1.0]), torch.tensor([0.9, 0.9, 0.9])
    mu = torch.tensor([0.01, 0.01, 0.5])  # the third token is not rare: always blocked
    keep = trust_region_keep(A, log_r, D, 0.2, 0.2, rollout_prob=mu, relax_below=0.1, relax_side=side)
    assert keep.tolist() == expected


def test_no_divergence_means_no_mask_and_bad_relax_side_raises():
    assert trust_region_keep(torch.ones(3), torch.ones(3), None, 0.0, 0.0).all()
    with pytest.raises(ValueError, match="relax_side"):
        trust_region_keep(torch.ones(1), torch.ones(1), torch.ones(1), 0.1, 0.1, torch.ones(1), 0.5, "up")
