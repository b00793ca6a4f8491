"""`topk_divergence` against an independent brute-force float64 reference of Eq. (15)/(16), and the ordering
Binary <= Top-K <= exact (data processing: each is a coarsening of the next); then on rows as peaked as a real
LLM's (top-1 probability up to 1 - 1e-9), where pi's "other" mass must be summed from the complement (issue 8.1)."""

from __future__ import annotations

import math

import pytest
import torch

from reference import host_reads, llm_logits, rollout_topk, topk_mismatch, topk_reference
from verl_dppo.math.divergence import binary_kl, binary_tv
from verl_dppo.math.topk import TopKInputError, topk_divergence

VOCAB = 50


def reference_topk(mu: list[float], pi: list[float], k: int, sampled: int) -> tuple[float, float]:
    """Eq. (15)/(16) from the text, token by token: A' = TopK(mu, K) U {a}; reduce to A' U {other}."""
    top = sorted(range(len(mu)), key=lambda x: -mu[x])[:k]
    kept = set(top) | {sampled}
    mu_r = [mu[x] for x in kept] + [max(0.0, 1.0 - sum(mu[x] for x in kept))]
    pi_r = [pi[x] for x in kept] + [max(0.0, 1.0 - sum(pi[x] for x in kept))]
    tv = 0.5 * sum(abs(a - b) for a, b in zip(mu_r, pi_r))
    kl = sum(a * math.log(a / b) for a, b in zip(mu_r, pi_r) if a > 0)
    return tv, kl


def random_case(rows: int, k: int, seed: int, inside: bool, dtype=torch.float64, spread: float = 3.0):
    """mu and pi as random full distributions (float64), logits of pi in `dtype`; sampled inside/outside top-K."""
    gen = torch.Generator().manual_seed(seed)
    pi_logits = (torch.randn(rows, VOCAB, generator=gen, dtype=torch.float64) * spread).to(dtype)
    mu_logp = torch.log_softmax(pi_logits.double() + torch.randn(rows, VOCAB, generator=gen, dtype=torch.float64), -1)
    topk_lp, topk_ids = mu_logp.topk(k, dim=-1)
    order = mu_logp.argsort(dim=-1, descending=True)
    if inside:
        sampled = order[torch.arange(rows), torch.randint(0, k, (rows,), generator=gen)]
    else:
        sampled = order[torch.arange(rows), torch.randint(k, VOCAB, (rows,), generator=gen)]
    sampled_lp = mu_logp.gather(1, sampled.unsqueeze(1)).squeeze(1)
    return pi_logits, mu_logp, topk_ids, topk_lp, sampled, sampled_lp


@pytest.mark.parametrize("k", list(range(1, 21)))
@pytest.mark.parametrize("inside", [True, False], ids=["sampled_in_topk", "sampled_outside_topk"])
def test_matches_float64_reference_eq15_eq16(k, inside):
    pi_logits, mu_logp, topk_ids, topk_lp, sampled, sampled_lp = random_case(6, k, seed=k, inside=inside)
    tv, kl = topk_divergence(pi_logits, topk_ids, topk_lp, sampled, sampled_lp)
    assert tv.dtype == kl.dtype == torch.float32 and tv.shape == kl.shape == (6,)
    pi_p = torch.softmax(pi_logits.double(), -1)
    for row in range(6):
        ref_tv, ref_kl = reference_topk(mu_logp[row].exp().tolist(), pi_p[row].tolist(), k, int(sampled[row]))
        assert tv[row].item() == pytest.approx(ref_tv, rel=1e-5, abs=1e-7)
        assert kl[row].item() == pytest.approx(ref_kl, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_any_logits_dtype_matches_reference_on_the_same_logits(dtype):
    pi_logits, mu_logp, topk_ids, topk_lp, sampled, sampled_lp = random_case(8, 5, seed=3, inside=False, dtype=dtype)
    tv, kl = topk_divergence(pi_logits, topk_ids, topk_lp.float(), sampled, sampled_lp.float())
    pi_p = torch.softmax(pi_logits.double(), -1)  # the reference sees the very same (rounded) logits
    for row in range(8):
        ref_tv, ref_kl = reference_topk(mu_logp[row].exp().tolist(), pi_p[row].tolist(), 5, int(sampled[row]))
        assert tv[row].item() == pytest.approx(ref_tv, rel=1e-4, abs=1e-6)
        assert kl[row].item() == pytest.approx(ref_kl, rel=1e-4, abs=1e-6)


def test_chunking_does_not_change_the_result():
    pi_logits, _, topk_ids, topk_lp, sampled, sampled_lp = random_case(
        37, 4, seed=5, inside=False, dtype=torch.bfloat16
    )
    whole = topk_divergence(pi_logits, topk_ids, topk_lp, sampled, sampled_lp, chunk_bytes=2**30)
    one_row = topk_divergence(pi_logits, topk_ids, topk_lp, sampled, sampled_lp, chunk_bytes=1)
    assert torch.equal(whole[0], one_row[0]) and torch.equal(whole[1], one_row[1])


@pytest.mark.parametrize("k", [1, 3, 20])
def test_binary_le_topk_le_exact(k):
    pi_logits, mu_logp, topk_ids, topk_lp, sampled, sampled_lp = random_case(64, k, seed=100 + k, inside=k > 1)
    tv, kl = topk_divergence(pi_logits, topk_ids, topk_lp, sampled, sampled_lp)
    pi_logp = torch.log_softmax(pi_logits.double(), -1)
    exact_tv = 0.5 * (mu_logp.exp() - pi_logp.exp()).abs().sum(-1)
    exact_kl = (mu_logp.exp() * (mu_logp - pi_logp)).sum(-1)
    pi_sampled = pi_logp.gather(1, sampled.unsqueeze(1)).squeeze(1)
    slack = 1e-6
    assert (binary_tv(sampled_lp, pi_sampled) <= tv + slack).all()
    assert (tv <= exact_tv + slack).all()
    assert (binary_kl(sampled_lp, pi_sampled) <= kl + slack).all()
    assert (kl <= exact_kl + slack).all()
    # and not trivially: Top-K is strictly between somewhere
    assert (tv > binary_tv(sampled_lp, pi_sampled) + 1e-4).any() and (kl < exact_kl - 1e-4).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_callers_logits_are_left_untouched(dtype):
    """The chunks are overwritten in place (exp of the shifted logits): never the caller's tensor."""
    pi_logits, _, topk_ids, topk_lp, sampled, sampled_lp = random_case(9, 4, seed=6, inside=False, dtype=dtype)
    before = pi_logits.clone()
    for mask in (None, torch.arange(9) % 2 == 0):
        topk_divergence(pi_logits, topk_ids, topk_lp, sampled, sampled_lp, mask=mask, chunk_bytes=1)
        assert torch.equal(pi_logits, before)


def test_k_covering_the_vocabulary_is_exact():
    pi_logits, mu_logp, topk_ids, topk_lp, sampled, sampled_lp = random_case(4, VOCAB, seed=9, inside=True)
    tv, kl = topk_divergence(pi_logits, topk_ids, topk_lp, sampled, sampled_lp)
    pi_logp = torch.log_softmax(pi_logits, -1)
    assert torch.allclose(tv.double(), 0.5 * (mu_logp.exp() - pi_logp.exp()).abs().sum(-1), atol=1e-6)
    assert torch.allclose(kl.double(), (mu_logp.exp() * (mu_logp - pi_logp)).sum(-1), atol=1e-6)


def test_identical_policies_give_zero():
    pi_logits, _, _, _, sampled, _ = random_case(5, 3, seed=1, inside=False)
    logp = torch.log_softmax(pi_logits, -1)
    topk_lp, topk_ids = logp.topk(3, -1)
    tv, kl = topk_divergence(pi_logits, topk_ids, topk_lp, sampled, logp.gather(1, sampled[:, None]).squeeze(1))
    assert tv.abs().max() < 1e-6 and kl.abs().max() < 1e-6


def test_masked_rows_are_skipped_and_zero():
    pi_logits, mu_logp, topk_ids, topk_lp, sampled, sampled_lp = random_case(6, 3, seed=2, inside=False)
    mask = torch.tensor([True, False, True, False, False, True])
    garbage_ids = topk_ids.clone()
    garbage_ids[~mask] = 0  # padding rows: repeated / meaningless ids must not be read
    tv, kl = topk_divergence(pi_logits, garbage_ids, topk_lp, sampled, sampled_lp, mask=mask)
    full_tv, full_kl = topk_divergence(pi_logits, topk_ids, topk_lp, sampled, sampled_lp)
    assert torch.equal(tv[mask], full_tv[mask]) and torch.equal(kl[mask], full_kl[mask])
    assert (tv[~mask] == 0).all() and (kl[~mask] == 0).all()


def test_mass_rounding_above_one_is_floored_not_negative():
    # mu puts all its mass on the top-2, with the engine's rounding pushing the sum slightly above 1.
    logits = torch.tensor([[2.0, 1.0, -1.0, -3.0]], dtype=torch.float64)
    topk_lp = torch.log(torch.tensor([[0.7 + 2e-4, 0.3]], dtype=torch.float64))
    ids = torch.tensor([[0, 1]])
    tv, kl = topk_divergence(logits, ids, topk_lp, torch.tensor([0]), topk_lp[:, 0])
    pi = torch.softmax(logits, -1)[0].tolist()
    other_pi = float(1 - pi[0] - pi[1])
    assert tv.item() == pytest.approx(0.5 * (abs(0.7002 - pi[0]) + abs(0.3 - pi[1]) + other_pi), rel=1e-5)
    assert math.isfinite(kl.item()) and kl.item() >= 0


def test_bad_inputs_raise_clear_errors():
    pi_logits, _, topk_ids, topk_lp, sampled, sampled_lp = random_case(3, 4, seed=4, inside=False)
    dup = topk_ids.clone()
    dup[1, 2] = dup[1, 0]
    with pytest.raises(TopKInputError, match="repeat a token id"):
        topk_divergence(pi_logits, dup, topk_lp, sampled, sampled_lp)
    out = topk_ids.clone()
    out[0, 0] = VOCAB
    with pytest.raises(TopKInputError, match="outside the vocabulary"):
        topk_divergence(pi_logits, out, topk_lp, sampled, sampled_lp)
    with pytest.raises(TopKInputError, match="outside the vocabulary"):
        topk_divergence(pi_logits, topk_ids, topk_lp, torch.tensor([0, -1, 0]), sampled_lp)
    with pytest.raises(TopKInputError, match="sum to .* > 1"):
        topk_divergence(pi_logits, topk_ids, torch.zeros_like(topk_lp) - 0.1, sampled, sampled_lp)
    with pytest.raises(TopKInputError, match="must match"):
        topk_divergence(pi_logits, topk_ids, topk_lp[:, :2], sampled, sampled_lp)
    with pytest.raises(TopKInputError, match="NaN"):
        topk_divergence(pi_logits, topk_ids, topk_lp.clone().fill_(math.nan), sampled, sampled_lp)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_nan_error_names_what_is_nan(bad):
    """Issue 18.4: only the sampled token's rollout log-prob is NaN/+inf (a_t outside the top-K): the error names
    rollout_sampled_logprobs, not the top-K rows; a bad top-K entry names the top-K; a bad a_t inside the top-K
    is not read (the top-K entry is used) and raises nothing."""
    pi_logits, _, topk_ids, topk_lp, sampled, sampled_lp = random_case(3, 4, seed=4, inside=False)
    bad_sampled = sampled_lp.clone()
    bad_sampled[1] = bad
    with pytest.raises(
        TopKInputError,
        match=r"^the rollout's log-prob of the sampled token \(rollout_sampled_logprobs"
        r"\) is NaN or \+inf at 1 of 3 rows",
    ) as err:
        topk_divergence(pi_logits, topk_ids, topk_lp, sampled, bad_sampled)
    assert "top-K log-probs" not in str(err.value)
    bad_topk = topk_lp.clone()
    bad_topk[2, 1] = bad
    with pytest.raises(
        TopKInputError,
        match=r"^the rollout's top-K log-probs \(rollout_topk_logprobs\) contain NaN "
        r"or \+inf at 1 of 3 rows",
    ) as err:
        topk_divergence(pi_logits, topk_ids, bad_topk, sampled, sampled_lp)
    assert "sampled token" not in str(err.value)
    with pytest.raises(TopKInputError, match="top-K log-probs .* and the rollout's log-prob of the sampled token"):
        topk_divergence(pi_logits, topk_ids, bad_topk, sampled, bad_sampled)
    inside = topk_ids[:, 0].clone()
    tv, kl = topk_divergence(pi_logits, topk_ids, topk_lp, inside, bad_sampled)
    assert bool(torch.isfinite(tv).all() and torch.isfinite(kl).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ["all", "masked", "mask_all_true"])
def test_one_wait_for_the_device_per_call(rows, dtype):
    """Issue 54.2: every input check's flag and the number of rows the mask keeps come back to the host in one read;
    nothing else in the call waits for the device (no `bool(t.any())`, no `nonzero`, no tensor built from host
    data). Counted on the CPU by `host_reads`; the kernels' path is counted in tests/probes/kernel_agreement.py."""
    pi_logits, _, topk_ids, topk_lp, sampled, sampled_lp = random_case(9, 4, seed=7, inside=False, dtype=dtype)
    mask = {"all": None, "masked": torch.arange(9) % 3 != 1, "mask_all_true": torch.ones(9, dtype=torch.bool)}[rows]
    with host_reads() as reads:
        tv, kl = topk_divergence(pi_logits, topk_ids, topk_lp, sampled, sampled_lp, mask=mask, chunk_bytes=1)
    assert len(reads) <= 1, reads
    with host_reads() as reads:
        topk_divergence(pi_logits, topk_ids, topk_lp, sampled, sampled_lp, mask=torch.zeros(9, dtype=torch.bool))
    assert len(reads) <= 1, reads
    keep = torch.ones(9, dtype=torch.bool) if mask is None else mask
    one_by_one = [
        topk_divergence(
            pi_logits[r : r + 1], topk_ids[r : r + 1], topk_lp[r : r + 1], sampled[r : r + 1], sampled_lp[r : r + 1]
        )
        for r in range(9)
    ]
    assert torch.equal(tv, torch.where(keep, torch.cat([t for t, _ in one_by_one]), 0.0))
    assert torch.equal(kl, torch.where(keep, torch.cat([k for _, k in one_by_one]), 0.0))


def test_errors_count_the_masked_rows_only():
    """The checks run on every row at once (one read), masked: a bad row outside the mask raises nothing, and an
    error's counts are of the rows the mask keeps, as when only those rows were checked."""
    pi_logits, _, topk_ids, topk_lp, sampled, sampled_lp = random_case(5, 4, seed=8, inside=False)
    mask = torch.tensor([True, False, True, True, False])
    ids, lp = topk_ids.clone(), topk_lp.clone()
    ids[1, 1] = ids[1, 0]  # repeats, out of range, NaN and mass > 1 in rows the mask drops
    ids[4, 0] = -5
    lp[1, 0] = math.nan
    lp[4] = -0.1
    tv, kl = topk_divergence(pi_logits, ids, lp, sampled, sampled_lp, mask=mask)
    assert (tv[~mask] == 0).all() and bool(torch.isfinite(tv).all() and torch.isfinite(kl).all())
    lp[2, 3] = math.nan
    with pytest.raises(TopKInputError, match=r"^the rollout's top-K log-probs .* at 1 of 3 rows"):
        topk_divergence(pi_logits, ids, lp, sampled, sampled_lp, mask=mask)
    ids[0, 2] = ids[0, 1]  # a repeat outranks the NaN, as when each check waited in turn
    with pytest.raises(TopKInputError, match=r"^1 rows of rollout_topk_ids repeat a token id"):
        topk_divergence(pi_logits, ids, lp, sampled, sampled_lp, mask=mask)
    ids[3, 0] = VOCAB  # and an id outside the vocabulary outranks both
    with pytest.raises(TopKInputError, match="outside the vocabulary"):
        topk_divergence(pi_logits, ids, lp, sampled, sampled_lp, mask=mask)
    lp = topk_lp.clone()
    lp[3], lp[4] = -0.1, 0.0  # the largest mass, 4+, lies in a row the mask drops: the message names row 3's
    worst = 4 * math.exp(-0.1) + math.exp(float(sampled_lp[3]))
    with pytest.raises(TopKInputError, match=f"sum to {worst:.4f} > 1"):
        topk_divergence(pi_logits, topk_ids, lp, sampled, sampled_lp, mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# Issue 8.1: rows as peaked as a real LLM's. pi(other) summed from the complement, never 1 - (kept mass): before,
# pi == mu on peaked rows gave D_KL = +inf (the kept mass rounded to 1 in float32, pi(other) to 0).

QWEN3_VOCAB = 151_936


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identical_peaked_policies_give_finite_kl_near_zero(dtype):
    """The issue's measurement at a smaller N: pi == mu (the engine's float32 log-softmax of the same logits),
    V = 151,936, a dominant token 5-40 nats above the rest, K = 20. Before the fix 7% of such rows were +inf."""
    rows, k = 64, 20
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(rows, QWEN3_VOCAB, generator=gen) * 2
    top = torch.randint(0, QWEN3_VOCAB, (rows,), generator=gen)
    logits[torch.arange(rows), top] = logits.max(-1).values + 5 + 35 * torch.rand(rows, generator=gen)
    logits = logits.to(dtype)
    mu_logp = torch.log_softmax(logits.float(), -1)
    topk_lp, topk_ids = mu_logp.topk(k, -1)
    sampled = torch.multinomial(mu_logp.double().exp(), 1, generator=gen).squeeze(1)
    sampled[::2] = topk_ids[::2, 0]  # a_t is the dominant token on half the rows
    sampled_lp = mu_logp.gather(1, sampled[:, None]).squeeze(1)
    tv, kl = topk_divergence(logits, topk_ids, topk_lp, sampled, sampled_lp)
    assert torch.isfinite(kl).all(), f"{int((~torch.isfinite(kl)).sum())} of {rows} rows give D_KL = inf"
    # What remains is the engine's float32 log-softmax (log mu off pi's by up to ~6e-5 on these rows): far below
    # any delta.
    assert kl.max() < 1e-4 and tv.max() < 1e-3
    bad_tv, bad_kl = topk_mismatch(tv, kl, *topk_reference(logits, topk_ids, topk_lp, sampled, sampled_lp))
    assert not bad_tv.any() and not bad_kl.any()


@pytest.mark.parametrize("inside", [True, False], ids=["sampled_in_topk", "sampled_outside_topk"])
@pytest.mark.parametrize("perturb", [0.0, 0.05, 1.0], ids=["pi_eq_mu", "mu_off_by_0.05", "mu_off_by_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("top1", [1 - 1e-9, 1 - 1e-7, 1 - 1e-5, 1 - 1e-3], ids=lambda p: f"top1=1-{1 - p:.0e}")
@pytest.mark.parametrize("k", [1, 5, 20, 64])
def test_peaked_rows_match_the_complement_reference(k, top1, dtype, perturb, inside):
    """Issue 8.1's requirement, Eq. (15)/(16): TV within 1e-4 and KL within 2% (relative to max(ref, 1e-4)) of
    a float64 reference that sums pi over the complement of A'_t directly, and finite wherever it is."""
    rows, vocab, seed = 8, 8192, k * 1000 + int(-math.log10(1 - top1))
    logits = llm_logits(rows, vocab, seed, top1_prob=top1).to(dtype)
    mu_logits = logits.double()
    if perturb:
        mu_logits = mu_logits + perturb * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))
    _, topk_ids, topk_lp, sampled, sampled_lp = rollout_topk(mu_logits, k, seed, inside)
    tv, kl = topk_divergence(logits, topk_ids, topk_lp, sampled, sampled_lp)
    ref_tv, ref_kl = topk_reference(logits, topk_ids, topk_lp, sampled, sampled_lp)
    bad_tv, bad_kl = topk_mismatch(tv, kl, ref_tv, ref_kl)
    assert not bad_tv.any(), f"TV {tv[bad_tv].tolist()} vs reference {ref_tv[bad_tv].tolist()}"
    assert not bad_kl.any(), f"KL {kl[bad_kl].tolist()} vs reference {ref_kl[bad_kl].tolist()}"
