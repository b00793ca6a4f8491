"""Properties of the math layer on rows shaped like a real LLM's, against float64 references (tests/reference.py).

The equations' tests elsewhere use well-spread random distributions; a real LLM emits rows with top-1 probability
1 - 1e-9, bf16 logits and log-probs of -100 (issue 8). Here every check runs on generated rows of that kind, for
many seeded parameter sets:

- flat rows (no token above a few per cent) and peaked rows (top-1 probability 1 - 1e-9 .. 1 - 1e-3), float32 and
  bf16 logits, 1/8 of the vocabulary ~100 nats down; mu equal to pi, close to it (logits off by 0.05) or far (1);
  the sampled token inside and outside the top-K.
- Binary TV / KL (Eq. 13/14) against float64, on those rows and on a grid of extreme log-probs.
- Top-K TV / KL (Eq. 15/16) against a float64 reference that sums pi over the complement of A'_t directly.
- Binary <= Top-K <= exact (data processing), for TV and KL, up to rounding.
- The mask of Eq. (12) on extreme values: its truth table, exactly.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from reference import (
    binary_reference,
    eq12_blocked,
    exact_divergences,
    llm_logits,
    rollout_topk,
    topk_mismatch,
    topk_reference,
)
from verl_dppo.math.divergence import binary_kl, binary_tv
from verl_dppo.math.topk import topk_divergence
from verl_dppo.math.trust_region import trust_region_blocked

ROWS, VOCAB = 8, 4096
TOP1 = {"flat": None, **{f"top1=1-{1 - p:.0e}": p for p in (1 - 1e-9, 1 - 1e-7, 1 - 1e-5, 1 - 1e-3)}}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PERTURB = {"pi_eq_mu": 0.0, "mu_off_by_0.05": 0.05, "mu_off_by_1": 1.0}

ROUNDING = 1e-6
"""Slack of the orderings: float32 outputs and the float32 rounding of the engine's log-probs (measured <= 1e-7)."""


@pytest.mark.parametrize("perturb", PERTURB)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", TOP1)
def test_binary_and_topk_match_float64_and_are_ordered(family, dtype, perturb):
    """Eq. (13)-(16) against float64 on LLM-like rows, then Binary <= Top-K <= exact (Appendix C); for K in
    {1, 5, 20, 64} and a_t inside and outside the top-K."""
    seed = list(TOP1).index(family) * 100 + list(DTYPES).index(dtype) * 10 + list(PERTURB).index(perturb)
    logits = llm_logits(ROWS, VOCAB, seed, top1_prob=TOP1[family]).to(DTYPES[dtype])
    noise = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    mu_logits = logits.double() + PERTURB[perturb] * noise
    pi_logp = torch.log_softmax(logits.double(), dim=-1)
    for k, inside in itertools.product([1, 5, 20, 64], [True, False]):
        where = f"K={k} a_t {'inside' if inside else 'outside'} the top-K"
        mu_logp, topk_ids, topk_lp, sampled, sampled_lp = rollout_topk(mu_logits, k, seed, inside)
        pi_sampled = pi_logp.gather(1, sampled[:, None]).squeeze(1).float()  # the actor's float32 log pi(a_t)

        b_tv, b_kl = binary_tv(sampled_lp, pi_sampled), binary_kl(sampled_lp, pi_sampled)
        ref_b_tv, ref_b_kl = binary_reference(sampled_lp, pi_sampled)
        torch.testing.assert_close(b_tv.double(), ref_b_tv, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")
        torch.testing.assert_close(b_kl.double(), ref_b_kl, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")

        tv, kl = topk_divergence(logits, topk_ids, topk_lp, sampled, sampled_lp)
        assert torch.isfinite(tv).all() and torch.isfinite(kl).all(), where
        bad_tv, bad_kl = topk_mismatch(tv, kl, *topk_reference(logits, topk_ids, topk_lp, sampled, sampled_lp))
        rows = f"rows {bad_tv.nonzero().flatten().tolist()} (TV), {bad_kl.nonzero().flatten().tolist()} (KL)"
        assert not bad_tv.any() and not bad_kl.any(), f"{where}: {rows}"

        exact_tv, exact_kl = exact_divergences(mu_logp, pi_logp)
        tv, kl, b_tv, b_kl = tv.double(), kl.double(), b_tv.double(), b_kl.double()
        assert (b_tv <= tv + ROUNDING).all() and (tv <= exact_tv + ROUNDING).all(), where
        assert (b_kl <= kl + ROUNDING).all() and (kl <= exact_kl + ROUNDING).all(), where


EXTREME_LOGPROBS = [0.0, -1e-9, -1e-7, -6e-5, -1e-3, -math.log(2), -5.0, -30.0, -87.0, -100.0]


def test_binary_on_a_grid_of_extreme_logprobs():
    """Eq. (13)/(14) for every pair of log-probs from 0 down to -100: finite, non-negative and equal to float64
    with binary_kl's documented floor (probabilities at least float32's smallest normal number)."""
    pairs = torch.tensor(list(itertools.product(EXTREME_LOGPROBS, repeat=2)), dtype=torch.float32)
    mu_lp, pi_lp = pairs[:, 0], pairs[:, 1]
    tv, kl = binary_tv(mu_lp, pi_lp), binary_kl(mu_lp, pi_lp)
    assert torch.isfinite(kl).all() and (kl >= 0).all()
    ref_tv, ref_kl = binary_reference(mu_lp, pi_lp)
    torch.testing.assert_close(tv.double(), ref_tv, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(kl.double(), ref_kl, rtol=1e-5, atol=1e-6)
    same = mu_lp == pi_lp
    assert (tv[same] == 0).all() and (kl[same] < 1e-7).all()


# ---------------------------------------------------------------------------------------------------------------
# The mask, Eq. (12), on extreme values.

ADVANTAGES = [-1e30, -1.0, -1e-30, -0.0, 0.0, 1e-30, 1.0, 1e30]
LOG_RATIOS = [-math.inf, -100.0, -1e-30, 0.0, 1e-30, 100.0, math.inf]
DELTA = 0.125  # a power of two: "D equal to delta" means the same number in float32 and float64
_NEXT_DOWN, _NEXT_UP = (torch.nextafter(torch.tensor(DELTA), torch.tensor(to)).item() for to in (0.0, 1.0))
DIVERGENCES = [0.0, _NEXT_DOWN, DELTA, _NEXT_UP, 1.0, 87.0, math.inf]
"""D at, one float32 step below and above delta, and beyond."""


def _check_truth_table(delta_low: float, delta_high: float, advantages=ADVANTAGES, log_ratios=LOG_RATIOS) -> None:
    grid = list(itertools.product(advantages, log_ratios, DIVERGENCES))
    a, lr, d = (torch.tensor(column, dtype=torch.float32) for column in zip(*grid))
    blocked = trust_region_blocked(a, lr, d, delta_low, delta_high)
    wrong = [
        (row, bool(got)) for row, got in zip(grid, blocked.tolist()) if got != eq12_blocked(*row, delta_low, delta_high)
    ]
    assert not wrong, f"{len(wrong)} of {len(grid)} wrong, e.g. (A, log r, D) -> blocked: {wrong[:4]}"


@pytest.mark.parametrize("delta_low, delta_high", [(DELTA, DELTA), (DELTA, 2 * DELTA), (2 * DELTA, DELTA)])
def test_mask_truth_table_on_extreme_values(delta_low, delta_high):
    """Eq. (12) exactly: masked iff (A > 0, r > 1, D > delta_high) or (A < 0, r < 1, D > delta_low), for
    advantages and log-ratios from +-1e30 to +-inf, D at, just below and just above delta, and D = inf."""
    _check_truth_table(
        delta_low, delta_high, [a for a in ADVANTAGES if abs(a) != 1e-30], [r for r in LOG_RATIOS if abs(r) != 1e-30]
    )


def test_mask_truth_table_tiny_advantage_times_tiny_log_ratio():
    # Was: A_t * log r_t > 0, whose product underflows to 0 (1e-30 x 1e-30 in float32): never masked.
    """The sign of A_t and of log r_t decide the direction, whatever their size (Eq. 12)."""
    _check_truth_table(DELTA, DELTA, [-1e-30, 1e-30], [-1e-30, 1e-30])


# Was: the threshold delta_low + (delta_high - delta_low) * (A > 0): inf * 0 is NaN, so an infinite delta on one
# side switched the mask off on the other side too.
@pytest.mark.parametrize("delta_low, delta_high", [(DELTA, math.inf), (math.inf, DELTA)], ids=["high_off", "low_off"])
def test_mask_truth_table_with_one_side_switched_off(delta_low, delta_high):
    """delta = inf on one side never masks that side and leaves the other side's Eq. (12) as it is."""
    _check_truth_table(delta_low, delta_high)


BOUND_CHECK = """
import json, math, torch
from verl.utils.torch_functional import logprobs_from_logits_v2
from verl_dppo.math.divergence import rounding_radius
from verl_dppo.rehearsal.isa import describe
gen = torch.Generator().manual_seed(0)
rows, vocab = 256, 32768
logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2
logits = torch.where(torch.rand(rows, vocab, generator=gen) < 0.125, logits - 100.0, logits)  # log-probs to -100
complement = torch.exp(torch.empty(rows, dtype=torch.float64).uniform_(math.log(1e-9), math.log(0.9), generator=gen))
logits[:, 0] = torch.logsumexp(logits[:, 1:], -1) + torch.log((1 - complement) / complement)  # peaked rows
logits = logits.bfloat16()
truth = torch.log_softmax(logits.double(), -1)
worst, deepest = 0.0, 0.0
for token in (0, 1, 2, 7, 100):
    labels = torch.full((rows,), token)
    pi = logprobs_from_logits_v2(logits, labels)  # verl's bf16 path: a bf16 log-softmax per row
    assert pi.dtype == torch.bfloat16
    error = (pi.double() - truth[:, token]).abs()
    worst = max(worst, float((error / rounding_radius(pi, pi.dtype).double()).max()))
    deepest = min(deepest, float(truth[:, token].min()))
print("BOUND " + json.dumps({"worst": worst, "deepest": deepest, "branch": describe()}))
"""


@pytest.mark.parametrize("level", ["this CPU", "avx2"])
def test_the_bf16_radius_bounds_verls_bf16_log_softmax_on_every_cpu_branch(level):
    """Issue 40.3: `rounding_radius` is the error bound of the path that makes a bf16 log-prob (verl's
    `logprobs_from_logits_v2` on bf16 logits), not more: on peaked rows (1 - p from 1e-9 to 0.9) and log-probs down
    to -100, torch's kernel errs by at most the radius (measured: 0.99 of it near p = 1, where the sum of exponentials
    rounds to 1 in bf16), and by more than half of it somewhere (a radius twice too large fails). In a child process,
    on the CPU branch torch takes here and forced to an AVX2-only CPU's (ATen's kernels differ by CPU)."""
    import json
    import os
    import subprocess
    import sys

    from verl_dppo.rehearsal import isa

    if level == "avx2" and isa.level() == "avx2":
        pytest.skip("this CPU is AVX2-only: its own branch is the other case")
    env = isa.forced_env("avx2") if level == "avx2" else dict(os.environ)
    out = subprocess.run([sys.executable, "-c", BOUND_CHECK], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("BOUND ", 1)[1])
    assert 0.5 < result["worst"] <= 1.0 and result["deepest"] < -100, result
    assert result["branch"].startswith("CPU branch: avx2" if level == "avx2" else f"CPU branch: {isa.level()}")
