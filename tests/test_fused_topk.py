"""Top-K DPPO's and TROLL's statistics fused with the LM head (verl_dppo.math.fused_topk / fused_troll, issue 20)
against the unfused path on the materialised logits = hidden @ W^T / temperature:

- float64, small V: log pi at A'_t = TopK U {a_t}, log pi(other) (summed from the complement), the entropy, Eq.
  (15)/(16) and TROLL's terms equal `topk_divergence` / `troll_token_terms` / a log-softmax to 1e-10, and so do
  the gradients to the hidden states and the weight; gradcheck of the autograd function;
- float32 at Qwen3's vocabulary (V = 151,936): divergence, loss and gradients within 1e-5 of the unfused path;
- where real models live: rows at top-1 probability 1 - 1e-9 and log-probs down to -100, bf16 hidden states and
  weight, T not a multiple of the chunk, a_t inside and outside mu's top-K, masked rows;
- verl: log pi(a_t) and the entropy equal verl's own fused kernel (`FusedLinearForPPO`), gradients included; what
  the function keeps for its backward is [T, K]-sized (no [T, V] tensor).
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from reference import entropy_reference, host_reads, live_bytes, llm_logits, rollout_topk, topk_reference
from verl_dppo.math.fused_topk import fused_topk_divergence, fused_topk_logprobs
from verl_dppo.math.fused_troll import fused_troll_token_terms
from verl_dppo.math.topk import TopKInputError, topk_divergence
from verl_dppo.math.troll import TrollInputError, troll_token_loss, troll_token_terms

QWEN3_VOCAB = 151_936


def case(rows, hidden, vocab, k, seed, dtype=torch.float64, temperature=1.0, noise=1.0):
    """hidden [rows, H], W [V, H], the rollout's top-K of mu = softmax(logits + noise); a_t inside mu's top-K on
    every third row, outside elsewhere; a mask with some rows out."""
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, hidden, generator=gen, dtype=torch.float64)).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
    logits = (h.double() @ w.double().t()) / temperature
    mu_logp = torch.log_softmax(logits + noise * torch.randn(rows, vocab, generator=gen, dtype=torch.float64), -1)
    topk_lp, topk_ids = mu_logp.topk(k, dim=-1)
    sampled = torch.randint(0, vocab, (rows,), generator=gen)
    sampled[::3] = topk_ids[::3, k // 2]
    sampled_lp = mu_logp.gather(1, sampled[:, None]).squeeze(1)
    mask = torch.rand(rows, generator=gen) > 0.25
    mask[:2] = True
    return h, w, topk_ids, topk_lp.float(), sampled, sampled_lp.float(), mask


def unfused_logits(h, w, temperature):
    return (h @ w.t()) / temperature


def reference_statistics(logits, topk_ids, sampled):
    """log pi(a_t), log pi at the top-K, log pi(other) from the complement and the entropy: a full log-softmax."""
    log_p = torch.log_softmax(logits.double() if logits.dtype != torch.float32 else logits, dim=-1)
    kept = torch.zeros_like(log_p, dtype=torch.bool).scatter_(1, topk_ids, True).scatter_(1, sampled[:, None], True)
    other = torch.logsumexp(log_p.masked_fill(kept, -math.inf), dim=-1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return log_p.gather(1, sampled[:, None]).squeeze(1), log_p.gather(1, topk_ids), other, entropy


def weighted(a, k, o, ent, mask, seed):
    """A scalar that reaches every output with its own random weight (rows outside the mask: only a_t and H)."""
    gen = torch.Generator().manual_seed(seed)
    m = mask.double()
    ga, gk, go, gh = (
        torch.randn(s, generator=gen, dtype=torch.float64) for s in (a.shape, k.shape, o.shape, ent.shape)
    )
    return (
        (a.double() * ga).sum()
        + (k.double() * gk * m[:, None]).sum()
        + (o.double() * go * m).sum()
        + (ent.double() * gh).sum()
    )


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


# --- float64, small V: the unfused path to rounding ------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_float64_equals_the_unfused_path(chunk, temperature):
    """29 rows (not a multiple of 7), K = 5, V = 48: Eq. (15)/(16) as `topk_divergence` computes them from the
    logits, bit for bit where the arithmetic is the same; the statistics and their gradients to 1e-10."""
    h, w, topk_ids, topk_lp, sampled, sampled_lp, mask = case(29, 12, 48, 5, seed=1, temperature=temperature)
    h.requires_grad_(), w.requires_grad_()
    logits = unfused_logits(h, w, temperature)
    tv_ref, kl_ref = topk_divergence(logits.detach(), topk_ids, topk_lp, sampled, sampled_lp, mask=mask)
    tv, kl, stats = fused_topk_divergence(
        h, w, topk_ids, topk_lp, sampled, sampled_lp, mask, temperature=temperature, entropy=True, chunk_tokens=chunk
    )
    assert torch.equal(tv, tv_ref) and torch.equal(kl, kl_ref)
    assert bool(((tv > 0) == mask).all()) and float(kl[mask].min()) > 0  # nothing trivially 0
    ref = reference_statistics(logits, topk_ids, sampled)
    every, in_mask = slice(None), mask  # the top-K and "other" only where the mask reads them
    for got, want, rows in zip(stats, ref, (every, in_mask, in_mask, every)):
        assert (got[rows].double() - want[rows]).abs().max() < 1e-10
    fused_grads = grads(weighted(*stats, mask, seed=2), h, w)
    reference_grads = grads(weighted(*ref, mask, seed=2), h, w)
    for got, want in zip(fused_grads, reference_grads):
        assert (got - want).abs().max() < 1e-10 * max(1.0, float(want.abs().max()))


def test_float64_troll_equals_the_unfused_path():
    """TROLL's terms (support Top(mu) U {a_t} U Top(pi), the projection, Eq. 5) and the gradient of its loss equal
    `troll_token_terms` on the logits; log pi(a_t) and the entropy on every row equal the log-softmax's."""
    h, w, topk_ids, topk_lp, sampled, sampled_lp, mask = case(23, 10, 40, 6, seed=3, temperature=0.8, noise=0.6)
    h.requires_grad_(), w.requires_grad_()
    advantages = torch.randn(23, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    options = dict(eps=0.05, support_mass=0.95, topk=8)
    ref = troll_token_terms(unfused_logits(h, w, 0.8), topk_ids, topk_lp, sampled, sampled_lp, mask, **options)
    terms, policy = fused_troll_token_terms(
        h, w, topk_ids, topk_lp, sampled, sampled_lp, mask, temperature=0.8, entropy=True, chunk_tokens=5, **options
    )
    assert float(ref.diagnostics["projected"].float().sum()) >= 3  # the projection is exercised
    for name in ("log_p_sampled", "regression_kl", "log_mu_sampled"):
        assert (getattr(terms, name) - getattr(ref, name)).abs().max() < 1e-10, name
    for name, value in ref.diagnostics.items():
        assert torch.allclose(terms.diagnostics[name].double(), value.double(), atol=1e-10, rtol=0), name
    want = grads(troll_token_loss(ref, advantages).sum(), h, w)
    got = grads(troll_token_loss(terms, advantages).sum(), h, w)
    for g, r in zip(got, want):
        assert (g - r).abs().max() < 1e-10 * max(1.0, float(r.abs().max()))
    log_p_a, _, _, entropy = reference_statistics(unfused_logits(h, w, 0.8), topk_ids, sampled)
    assert (policy.log_p_sampled - log_p_a).abs().max() < 1e-10
    assert (policy.entropy - entropy).abs().max() < 1e-10


def test_troll_rows_with_nan_or_inf_logits_answer_nan_as_topk_does():
    """Issue 53.2, fused: a row whose hidden state holds a NaN or an inf (NaN or +-inf logits) has no pi: TROLL's
    log p(a_t), regression KL, eta, kl_before, kl_after and loss are NaN there, where fused Top-K's D is NaN (0
    before); a masked-out row of NaN is not read (0); the other rows keep the values of the clean input."""
    h, w, topk_ids, topk_lp, sampled, sampled_lp, mask = case(12, 6, 30, 4, seed=21, dtype=torch.float32)
    mask[:] = True
    mask[7] = False
    bad = h.clone()
    bad[2, 1], bad[4, 0], bad[7] = math.nan, math.inf, math.nan
    terms, _ = fused_troll_token_terms(bad, w, topk_ids, topk_lp, sampled, sampled_lp, mask, topk=8, chunk_tokens=5)
    _, topk_kl, _ = fused_topk_divergence(bad, w, topk_ids, topk_lp, sampled, sampled_lp, mask, chunk_tokens=5)
    clean, _ = fused_troll_token_terms(h, w, topk_ids, topk_lp, sampled, sampled_lp, mask, topk=8, chunk_tokens=5)
    no_pi = [r in (2, 4) for r in range(12)]
    assert torch.isnan(topk_kl).tolist() == no_pi
    values = {
        "loss": troll_token_loss(terms, torch.ones(12)),
        "log_p_sampled": terms.log_p_sampled,
        "regression_kl": terms.regression_kl,
        **{k: terms.diagnostics[k] for k in ("eta", "kl_before", "kl_after")},
    }
    for name, value in values.items():
        assert torch.isnan(value).tolist() == no_pi and float(value[7].detach()) == 0.0, (name, value)
    keep = ~torch.tensor(no_pi) & mask
    for name in ("log_p_sampled", "regression_kl"):
        assert torch.equal(getattr(terms, name)[keep].detach(), getattr(clean, name)[keep].detach()), name


def test_gradcheck():
    """The autograd function's backward (the slots, the complement, the entropy; a_t inside and outside the
    top-K, a masked row) against finite differences."""
    h, w, topk_ids, _, sampled, _, mask = case(7, 4, 11, 3, seed=5)
    mask[3] = False

    def outputs(h, w):
        stats = fused_topk_logprobs(h, w, sampled, topk_ids, 0.7, mask, entropy=True, chunk_tokens=3)
        return stats.log_p_sampled, stats.log_p_topk[mask], stats.log_p_other[mask], stats.entropy

    assert torch.autograd.gradcheck(outputs, (h.requires_grad_(), w.requires_grad_()), eps=1e-6, atol=1e-8)


def test_gradcheck_troll():
    h, w, topk_ids, topk_lp, sampled, sampled_lp, mask = case(5, 4, 12, 4, seed=6, noise=0.5)

    def outputs(h, w):
        terms, policy = fused_troll_token_terms(
            h, w, topk_ids, topk_lp, sampled, sampled_lp, mask, eps=0.02, support_mass=0.9, topk=5, chunk_tokens=2
        )
        return terms.log_p_sampled, policy.log_p_sampled  # regression_kl holds a stop-gradient: no function

    assert torch.autograd.gradcheck(outputs, (h.requires_grad_(), w.requires_grad_()), eps=1e-6, atol=1e-7)


# --- float32 at Qwen3's vocabulary --------------------------------------------------------------------------------


def _close_to_truth(fused, float32_path, truth, what):
    """The fused float32 result within 1e-5 of the unfused computation (relative to the largest entry), the unfused
    computation taken in float64 on the same float32 inputs: the unfused float32 path itself drifts from it by up
    to 2.5e-5 here (float32 sums over 151,936 terms; CPU matmuls also round differently with the number of rows),
    so it is no reference at 1e-5; its error is shown beside the fused one."""
    scale = max(1.0, float(truth.abs().max()))
    fused_error = float((fused.double() - truth).abs().max()) / scale
    float32_error = float((float32_path.double() - truth).abs().max()) / scale
    assert fused_error < 1e-5, (what, fused_error, float32_error)


def test_float32_at_qwen3_vocabulary_matches_the_unfused_path():
    """V = 151,936, 20 rows in chunks of 8: Top-K TV/KL within 1e-5 of `topk_divergence` on the float32 logits; a
    DPPO-shaped loss (ratio x advantage on log pi(a_t), a KL through the top-K and "other", the entropy: every output
    carries gradient) and TROLL's loss, and their gradients, within 1e-5 of the same unfused computation."""
    rows = 20
    h, w, topk_ids, topk_lp, sampled, sampled_lp, mask = case(
        rows, 16, QWEN3_VOCAB, 20, seed=7, dtype=torch.float32, temperature=0.9
    )
    h.requires_grad_(), w.requires_grad_()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    advantages = torch.randn(rows, generator=torch.Generator().manual_seed(8))
    logits = unfused_logits(h, w, 0.9)
    tv_ref, kl_ref = topk_divergence(logits.detach(), topk_ids, topk_lp, sampled, sampled_lp, mask=mask)
    tv, kl, stats = fused_topk_divergence(
        h, w, topk_ids, topk_lp, sampled, sampled_lp, mask, temperature=0.9, entropy=True, chunk_tokens=8
    )
    assert float(kl_ref.max()) > 0.05
    assert (tv - tv_ref).abs().max() < 1e-5 and (kl - kl_ref).abs().max() < 1e-5

    def loss(log_p_a, log_p_topk, log_p_other, entropy):
        ratio = torch.exp(log_p_a.double() - sampled_lp.double())
        mu = torch.cat([topk_lp.double(), topk_lp.new_zeros(rows, 1).double()], dim=1).exp()
        pi = torch.cat([log_p_topk.double(), log_p_other.double()[:, None]], dim=1)
        reduced_kl = (mu * (mu.clamp(min=1e-30).log() - pi)).sum(dim=1)
        per_token = -ratio * advantages.double() + 1e-3 * entropy.double() + 0.1 * reduced_kl
        return per_token.masked_fill(~mask, 0).sum()

    fused = loss(*stats)
    float32_path = loss(*reference_statistics(logits, topk_ids, sampled))
    truth = loss(*reference_statistics(unfused_logits(h64, w64, 0.9), topk_ids, sampled))
    _close_to_truth(fused.detach(), float32_path.detach(), truth.detach(), "Top-K loss")
    for got, f32, want, name in zip(grads(fused, h, w), grads(float32_path, h, w), grads(truth, h64, w64), "hw"):
        _close_to_truth(got, f32, want, f"Top-K gradient to {name}")

    options = dict(eps=0.05, support_mass=1 - 1e-5, topk=20)
    inputs = (topk_ids, topk_lp, sampled, sampled_lp, mask)
    troll, _ = fused_troll_token_terms(h, w, *inputs, temperature=0.9, chunk_tokens=8, **options)
    float32_terms = troll_token_terms(unfused_logits(h, w, 0.9), *inputs, **options)
    truth_terms = troll_token_terms(unfused_logits(h64, w64, 0.9), *inputs, **options)
    assert bool(truth_terms.diagnostics["projected"].any())
    fused, float32_path, truth = (troll_token_loss(t, advantages).sum() for t in (troll, float32_terms, truth_terms))
    _close_to_truth(fused.detach(), float32_path.detach(), truth.detach(), "TROLL loss")
    for got, f32, want, name in zip(grads(fused, h, w), grads(float32_path, h, w), grads(truth, h64, w64), "hw"):
        _close_to_truth(got, f32, want, f"TROLL gradient to {name}")


# --- where real models live ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("top1", [1 - 1e-9, 1 - 1e-7], ids=lambda p: f"top1=1-{1 - p:.0e}")
@pytest.mark.parametrize("inside", [True, False], ids=["a_in_topk", "a_outside_topk"])
def test_peaked_rows_and_deep_tails_float32(top1, inside):
    """Rows at top-1 probability 1 - 1e-9 with an eighth of the vocabulary ~100 nats down (W = I, so the logits are
    the hidden states exactly): pi(other) is summed from the complement (a "1 - kept mass" would round to 0 in
    float32 and give D_KL = +inf where mu == pi), and the fused values equal the unfused ones on the same float32
    logits and the float64 reference of Eq. (15)/(16)."""
    vocab, k = 64, 4
    logits = llm_logits(12, vocab, seed=9, top1_prob=top1).float()
    _, topk_ids, topk_lp, sampled, sampled_lp = rollout_topk(logits.double(), k, seed=10, inside=inside)
    eye = torch.eye(vocab)
    tv, kl, stats = fused_topk_divergence(logits, eye, topk_ids, topk_lp, sampled, sampled_lp, chunk_tokens=5)
    tv_unfused, kl_unfused = topk_divergence(logits, topk_ids, topk_lp, sampled, sampled_lp)
    assert torch.equal(tv, tv_unfused) and torch.equal(kl, kl_unfused)
    tv_ref, kl_ref = topk_reference(logits, topk_ids, topk_lp, sampled, sampled_lp)
    assert bool(torch.isfinite(kl).all())
    assert (tv.double() - tv_ref).abs().max() < 1e-6
    assert ((kl.double() - kl_ref).abs() <= 0.02 * kl_ref.clamp(min=1e-4)).all()
    _, _, other_ref, _ = reference_statistics(logits.double(), topk_ids, sampled)
    assert ((stats.log_p_other - other_ref).abs() < 1e-5 * other_ref.abs()).all()  # ~1e-9 of mass, to 5 digits


def test_bf16_hidden_states_and_weight():
    """bf16 inputs: the logits are bf16 products, as in verl's fused kernel (matmul in the inputs' dtype, then float32);
    the divergence equals the unfused one on those very logits, and the gradients (in bf16) are those of the
    float64 log-softmax of them to bf16 precision."""
    h, w, topk_ids, topk_lp, sampled, sampled_lp, mask = case(19, 32, 300, 8, seed=11, dtype=torch.bfloat16)
    h.requires_grad_(), w.requires_grad_()
    chunk = 8
    logits = torch.cat([h[s : s + chunk] @ w.t() for s in range(0, 19, chunk)])  # the same bf16 products
    tv_ref, kl_ref = topk_divergence(logits.detach(), topk_ids, topk_lp, sampled, sampled_lp, mask=mask)
    tv, kl, stats = fused_topk_divergence(
        h, w, topk_ids, topk_lp, sampled, sampled_lp, mask, entropy=True, chunk_tokens=chunk
    )
    assert (tv - tv_ref).abs().max() < 1e-6 and (kl - kl_ref).abs().max() < 1e-6
    assert stats.log_p_sampled.dtype == torch.float32
    fused = grads(weighted(*stats, mask, seed=12), h, w)
    assert fused[0].dtype == fused[1].dtype == torch.bfloat16
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    # the reference differentiates the bf16-rounded logits in float64
    logits64 = h64 @ w64.t()
    logits64 = logits64 + (logits.detach().double() - logits64.detach())
    want = grads(weighted(*reference_statistics(logits64, topk_ids, sampled), mask, seed=12), h64, w64)
    for g, r in zip(fused, want):
        assert (g.double() - r).abs().max() < 2e-2 * float(r.abs().max())


def test_masked_rows_and_chunking_do_not_change_anything():
    """Rows outside the mask get D = 0 and are not validated (their top-K may be garbage), yet log pi(a_t) and the
    entropy are computed there (verl reads them on every token); every chunk size gives the same values."""
    h, w, topk_ids, topk_lp, sampled, sampled_lp, mask = case(17, 8, 30, 4, seed=13)
    topk_ids[~mask] = 0  # as the hook lays them out on prompt positions: one id repeated
    results = [
        fused_topk_divergence(h, w, topk_ids, topk_lp, sampled, sampled_lp, mask, entropy=True, chunk_tokens=c)
        for c in (1, 4, 17, 100)
    ]
    for tv, kl, stats in results:
        assert bool((tv[~mask] == 0).all()) and bool((kl[~mask] == 0).all())
        for a, b in zip(stats, results[0][2]):
            assert torch.allclose(a, b, rtol=0, atol=1e-12)
    log_p_a, _, _, entropy = reference_statistics(h @ w.t(), topk_ids, sampled)
    assert (results[0][2].log_p_sampled - log_p_a).abs().max() < 1e-12
    assert (results[0][2].entropy - entropy).abs().max() < 1e-12
    with pytest.raises(TopKInputError, match="repeat a token id"):
        fused_topk_divergence(h, w, topk_ids, topk_lp, sampled, sampled_lp)  # the same rows, all in the mask
    bad = sampled.clone()
    bad[~mask] = 30
    with pytest.raises(TopKInputError, match="outside the vocabulary"):
        fused_topk_logprobs(h, w, bad, topk_ids, mask=mask)  # a_t is read on every row


@pytest.mark.parametrize("masked", [False, True])
def test_troll_waits_for_the_device_a_constant_number_of_times(masked):
    """Issue 54.2: TROLL's forward + loss + backward waits for the device a fixed number of times per call, however
    many chunks: fused, 3 (every input check and the update's row count; S_t's widest row with the crowded rows after
    the pass; the projection's rows with the solver's first convergence check), at 5 chunks of 8 tokens as at one of
    40; unfused, 4 (the same, and the backward's check of the logits), at 40 chunks of one row as at one chunk.
    Counted on the CPU by `host_reads`; the kernels' path in tests/probes/kernel_agreement.py."""
    h, w, topk_ids, topk_lp, sampled, sampled_lp, mask = case(40, 16, 300, 16, seed=54, dtype=torch.float32)
    sampled_lp[7] = -math.inf  # a row dropped from the update (no finite ratio)
    mask = mask if masked else None
    advantages = torch.randn(40, generator=torch.Generator().manual_seed(54))

    def fused(chunk):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with host_reads() as reads:
            terms, policy = fused_troll_token_terms(
                hh, ww, topk_ids, topk_lp, sampled, sampled_lp, mask, topk=16, entropy=True, chunk_tokens=chunk
            )
            loss = troll_token_loss(terms, advantages).sum() + (policy.log_p_sampled + policy.entropy).sum()
            loss.backward()
        return reads, (terms.log_p_sampled, terms.regression_kl, hh.grad, ww.grad)

    def unfused(chunk_bytes):
        logits = unfused_logits(h, w, 1.0).requires_grad_()
        with host_reads() as reads:
            terms = troll_token_terms(
                logits, topk_ids, topk_lp, sampled, sampled_lp, mask, topk=16, chunk_bytes=chunk_bytes
            )
            troll_token_loss(terms, advantages).sum().backward()
        return reads, (terms.log_p_sampled, terms.regression_kl, logits.grad)

    for run, sizes, bound in ((fused, (8, 40), 3), (unfused, (1, 2**30), 4)):
        (many, got), (one, want) = run(sizes[0]), run(sizes[1])
        assert len(many) == len(one) <= bound, (run.__name__, many, one)
        for g, r in zip(got, want):
            assert torch.allclose(g, r, rtol=1e-6, atol=1e-6)


def test_troll_selection_after_the_pass_stays_within_its_bytes_per_row():
    """Issue 54.2: on the kernels the fused TROLL pass selects S_t after the pass, for many chunks' rows at once,
    in blocks sized by the selector's `bytes_per_row` so that the selection holds no more than a chunk's logits.
    The selection's peak (outputs included) at Qwen3's vocabulary and K = 64, on rows of an LLM's shape (pi's
    threshold finding a few more candidates than its 65 most likely, some rows a_t outside them), stays within it.
    Runs `support_from_candidates` on the CPU (the same torch ops as on a GPU); the kernels' reads are faked."""
    from verl_dppo.math.fused_troll import _SupportSelector
    from verl_dppo.math.troll_support import CandidateReads, pi_read_width

    n, k, vocab = 512, 64, 151_936
    gen = torch.Generator().manual_seed(54)
    sampled, mu_ids = torch.randint(0, vocab, (n,), generator=gen), torch.randint(0, vocab, (n, k), generator=gen)
    selector = _SupportSelector(
        sampled,
        mu_ids,
        torch.rand(n, k, generator=gen) < 0.7,
        torch.ones(n, dtype=torch.bool),
        64,
        1 - 1e-5,
        1 + k + 65,
        vocab,
    )
    width = pi_read_width(64, vocab)
    count = torch.randint(width, width + 24, (n,), generator=gen)
    found = torch.full((n, selector.capacity), -1, dtype=torch.int32)
    for row in range(n):
        found[row, : count[row]] = torch.randperm(vocab, generator=gen)[: count[row]].int()
    logits = (torch.randn(n, selector.capacity, generator=gen) * 3).bfloat16()
    reads = CandidateReads(
        logits.float().amax(dim=1),
        torch.rand(n, generator=gen) * 50,
        count,
        found,
        logits,
        (torch.randn(n, 1 + k, generator=gen) * 3 - 4).bfloat16(),
    )
    with live_bytes() as memory:
        slots = selector.finish(tuple(reads), slice(None))
    assert slots.ids.shape == (n, 1 + k + 65) and not slots.again.any()
    assert 0.5 * selector.bytes_per_row < memory["peak"] / n <= selector.bytes_per_row, (memory, selector.bytes_per_row)


def test_troll_errors_read_in_one_wait_keep_their_order_and_rows():
    """The checks run on every row at once (one read), as each did in turn before: the fused path's a_t outside the
    vocabulary on any row comes first, then the rollout's problems of the rows in the update only, in their order;
    the mass above 1 names the largest among those rows."""
    h, w, topk_ids, topk_lp, sampled, sampled_lp, mask = case(12, 8, 50, 4, seed=55)
    out = int((~mask).nonzero()[0])
    ids, lp = topk_ids.clone(), topk_lp.clone()
    ids[out, 1] = ids[out, 0]  # garbage outside the mask: not read
    lp[out] = 0.0
    fused_troll_token_terms(h, w, ids, lp, sampled, sampled_lp, mask, topk=4)
    lp[0, 1] = math.nan
    with pytest.raises(TrollInputError, match="NaN"):
        fused_troll_token_terms(h, w, ids, lp, sampled, sampled_lp, mask, topk=4)
    ids[1, 2] = ids[1, 3]  # a repeat outranks the NaN
    with pytest.raises(TrollInputError, match="repeat a token id"):
        troll_token_terms(h @ w.t(), ids, lp, sampled, sampled_lp, mask, topk=4)
    bad = sampled.clone()
    bad[out] = 50  # a_t outside the vocabulary on a row outside the update: the fused path reads it, first
    with pytest.raises(TrollInputError, match="^sampled token ids outside"):
        fused_troll_token_terms(h, w, ids, lp, bad, sampled_lp, mask, topk=4)
    troll_token_terms(h @ w.t(), topk_ids, topk_lp, bad, sampled_lp, mask, topk=4)  # unfused: not read there
    lp = topk_lp.clone()
    lp[out], lp[2] = 0.0, -0.5  # mass 4+ on the row outside the update; 4 exp(-0.5) on row 2
    with pytest.raises(TrollInputError, match=f"sum to {4 * math.exp(-0.5):.4f} > 1"):
        troll_token_terms(h @ w.t(), topk_ids, lp, sampled, sampled_lp, mask, topk=4)


# --- verl ----------------------------------------------------------------------------------------------------------


def test_the_entropy_is_relatively_exact_on_peaked_rows():
    """Issue 53.3: the torch path's entropy (fused Top-K and TROLL, `fused_chunk.entropy_rows`) against a float64
    reference that keeps Z - 1 apart from the max's 1, on rows with 1 - p(top) from 0.1 to 1e-12 and flat ones:
    within 1e-4 of H, where a float32 sum rounding Z = 1 + 1e-9 to 1 was off by 3.6% (absolute 1e-9)."""
    from verl_dppo.math.fused_chunk import entropy_rows

    vocab, gen = 20_000, torch.Generator().manual_seed(53)
    w = torch.zeros(vocab, 2)
    w[1:, 0] = torch.randn(vocab - 1, generator=gen) * 2  # every other token's logit: w[j, 0]
    w[0, 1] = 1.0  # the top token's logit: h[r, 1]
    rest = torch.logsumexp(w[1:, 0].double(), dim=0)
    gaps = torch.tensor([0.1, 1e-3, 1e-6, 1e-9, 1e-12], dtype=torch.float64)  # 1 - p(top)
    h = torch.ones(len(gaps) + 2, 2)
    h[: len(gaps), 1] = (rest + torch.log((1 - gaps) / gaps)).float()
    h[len(gaps) :, 0], h[len(gaps) :, 1] = 0.05, 0.0  # flat rows
    topk_ids = torch.arange(4).repeat(h.shape[0], 1)
    topk_lp = torch.full((h.shape[0], 4), -10.0)
    sampled, sampled_lp = torch.zeros(h.shape[0], dtype=torch.long), torch.full((h.shape[0],), -0.1)
    *_, stats = fused_topk_divergence(h, w, topk_ids, topk_lp, sampled, sampled_lp, entropy=True, chunk_tokens=3)
    logits = h @ w.t()
    want = entropy_reference(logits)
    assert float(want[len(gaps) - 2]) < 1e-7 < float(want[0])  # the peaked rows this is about
    for got in (stats.entropy.double(), entropy_rows(logits, logits.amax(dim=1))):
        relative = (got - want).abs() / want
        assert float(relative.max()) < 1e-4, relative


def test_log_prob_and_entropy_equal_verls_fused_kernel():
    """The outputs verl's `use_fused_kernels` path hands the engine (FusedLinearForPPO: log pi(a_t) and the entropy,
    chunks of 512 tokens) and their gradients, from the same float32 hidden states and LM head, within 1e-5."""
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    h, w, topk_ids, _, sampled, _, mask = case(600, 16, 2000, 8, seed=14, dtype=torch.float32, temperature=0.7)
    h.requires_grad_(), w.requires_grad_()
    verl_log_p, verl_entropy = FusedLinearForPPO()(h, w, sampled, temperature=0.7)
    stats = fused_topk_logprobs(h, w, sampled, topk_ids, 0.7, mask, entropy=True)
    assert (stats.log_p_sampled - verl_log_p).abs().max() < 1e-5
    assert (stats.entropy - verl_entropy).abs().max() < 1e-5
    gen = torch.Generator().manual_seed(15)
    ga, ge = torch.randn(600, generator=gen), torch.randn(600, generator=gen)
    want = grads((verl_log_p * ga + verl_entropy * ge).sum(), h, w)
    got = grads((stats.log_p_sampled * ga + stats.entropy * ge).sum(), h, w)
    for g, r in zip(got, want):
        assert (g - r).abs().max() < 1e-5 * max(1.0, float(r.abs().max()))


def test_backward_keeps_no_vocabulary_sized_tensor():
    """Between forward and backward the function keeps the inputs and [T, K + 1] / [T] tensors, never a [T, V] one."""
    h, w, topk_ids, _, sampled, _, mask = case(40, 8, 500, 5, seed=16)
    stats = fused_topk_logprobs(h.requires_grad_(), w.requires_grad_(), sampled, topk_ids, mask=mask, entropy=True)
    node = stats.log_p_topk.grad_fn
    while not type(node).__name__.startswith("_FusedSlotLogprobs"):
        node = node.next_functions[0][0]
    saved = [t for t in node.saved_tensors if t.data_ptr() not in (h.data_ptr(), w.data_ptr())]
    assert saved and max(t.numel() for t in saved) <= 40 * 6


def test_math_layer_imports_no_verl():
    code = (
        "import sys, verl_dppo.math.fused_topk, verl_dppo.math.fused_troll; "
        "assert 'verl' not in sys.modules, sorted(m for m in sys.modules if m.startswith('verl'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
