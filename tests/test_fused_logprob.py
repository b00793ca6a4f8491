"""log pi(a_t) and the entropy fused with the LM head for the binary modes and the baselines
(verl_dppo.math.fused_logprob, issue 54.1), against a float64 log-softmax of the materialised logits and against
verl's own fused kernel (`FusedLinearForPPO`): float64 to rounding with gradients, float32 at peaked rows (top-1
1 - 1e-9) and log-probs down to -100, bf16 hidden states and weight, chunking that changes nothing."""

from __future__ import annotations

import pytest
import torch

from reference import entropy_reference, llm_logits
from verl_dppo.math.fused_logprob import fused_token_logprobs


def case(rows, hidden, vocab, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=gen, dtype=torch.float64).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
    return h, w, torch.randint(0, vocab, (rows,), generator=gen)


def reference(logits, labels):
    log_p = torch.log_softmax(logits.double(), dim=-1)
    return log_p.gather(1, labels[:, None]).squeeze(1), -(log_p.exp() * log_p).sum(dim=-1)


def weighted(log_p, entropy, seed):
    gen = torch.Generator().manual_seed(seed)
    ga, ge = (torch.randn(log_p.shape, generator=gen, dtype=torch.float64) for _ in range(2))
    return (log_p.double() * ga).sum() + (entropy.double() * ge).sum()


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_float64_equals_a_log_softmax_with_gradients(chunk, temperature):
    h, w, labels = case(23, 8, 50, seed=1)
    h.requires_grad_(), w.requires_grad_()
    log_p, ent = fused_token_logprobs(h, w, labels, temperature, entropy=True, chunk_tokens=chunk)
    want_lp, want_ent = reference(h @ w.t() / temperature, labels)
    assert (log_p - want_lp).abs().max() < 1e-12 and (ent - want_ent).abs().max() < 1e-12
    got = torch.autograd.grad(weighted(log_p, ent, 2), (h, w))
    want = torch.autograd.grad(weighted(want_lp, want_ent, 2), (h, w))
    for g, r in zip(got, want):
        assert (g - r).abs().max() < 1e-10 * max(1.0, float(r.abs().max()))
    lp_only, none = fused_token_logprobs(h, w, labels, temperature, chunk_tokens=chunk)
    assert none is None and torch.equal(lp_only, log_p)


@pytest.mark.parametrize("top1", [1 - 1e-9, 1 - 1e-3])
def test_peaked_rows_and_deep_tails_float32(top1):
    """W = I: the logits are the hidden states exactly; a_t the dominant token on some rows and ~100 nats down on
    others: log pi(a_t) to float32 rounding of the float64 value, the entropy relative to 1e-4."""
    vocab = 64
    logits = llm_logits(16, vocab, seed=3, top1_prob=top1).float()
    labels = logits.argmax(dim=1)
    labels[::2] = logits[::2].argmin(dim=1)  # the deep tail: log-probs near -100
    log_p, ent = fused_token_logprobs(logits, torch.eye(vocab), labels, entropy=True, chunk_tokens=5)
    want_lp, _ = reference(logits, labels)
    assert float(want_lp.min()) < -90
    assert ((log_p.double() - want_lp).abs() <= 1e-6 * want_lp.abs().clamp(min=1.0)).all()
    want_ent = entropy_reference(logits)
    assert ((ent.double() - want_ent).abs() <= 1e-4 * want_ent + 1e-12).all()


def test_equal_to_verls_fused_kernel_float32_and_bf16():
    """What verl's FusedLinearForPPO hands the engine (log pi(a_t) and the entropy, and their gradients to the
    hidden states and the LM head) from the same inputs: float32 within 1e-5 (the entropy within 3e-5: verl's own
    float32 entropy is 1.3e-5 from float64 on an AVX2 CPU's matmul, while the plugin's stays within 1e-5 of float64);
    bf16 (the logits the same bf16 products on both sides) log pi to 1e-5, the entropy and the gradients to bf16
    rounding."""
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    for dtype, tol_ent, tol_grad in ((torch.float32, 3e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2)):
        h, w, labels = case(300, 32, 1000, seed=4, dtype=dtype)
        h.requires_grad_(), w.requires_grad_()
        log_p, ent = fused_token_logprobs(h, w, labels, 0.7, entropy=True, chunk_tokens=128)
        verl_lp, verl_ent = FusedLinearForPPO(chunk_size=128)(h, w, labels, temperature=0.7)
        assert log_p.dtype == torch.float32 and ent.dtype == torch.float32
        assert (log_p - verl_lp).abs().max() < 1e-5 and (ent - verl_ent).abs().max() < tol_ent
        if dtype == torch.float32:  # the plugin's to float64 on the same float32 inputs, whatever the CPU's branch
            want_lp, want_ent = reference((h.detach().double() @ w.detach().double().t()) / 0.7, labels)
            assert (log_p.double() - want_lp).abs().max() < 1e-5 and (ent.double() - want_ent).abs().max() < 1e-5
        gen = torch.Generator().manual_seed(5)
        ga, ge = torch.randn(300, generator=gen), torch.randn(300, generator=gen)
        got = torch.autograd.grad((log_p * ga + ent * ge).sum(), (h, w))
        want = torch.autograd.grad((verl_lp * ga + verl_ent * ge).sum(), (h, w))
        for g, r in zip(got, want):
            assert g.dtype == dtype and (g.float() - r.float()).abs().max() < tol_grad * max(1.0, float(r.abs().max()))


def test_chunking_changes_nothing_and_bad_labels_are_refused():
    h, w, labels = case(17, 8, 30, seed=6)
    runs = [fused_token_logprobs(h, w, labels, entropy=True, chunk_tokens=c) for c in (1, 4, 17, 100)]
    for log_p, ent in runs:
        assert torch.allclose(log_p, runs[0][0], rtol=0, atol=1e-13) and torch.allclose(
            ent, runs[0][1], rtol=0, atol=1e-13
        )
    with pytest.raises(ValueError, match="labels"):
        fused_token_logprobs(h, w, labels[:5])


# ---- the same from materialised logits (verl_dppo.math.logits_logprob: unfused plugin modes, issue 54.1) ----


def test_from_logits_float64_gradcheck_and_chunks():
    from verl_dppo.math.logits_logprob import logits_logprobs

    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(9, 13, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    labels = torch.randint(0, 13, (9,), generator=gen)
    for chunk in (1, 4, 100):
        assert torch.autograd.gradcheck(lambda x: logits_logprobs(x, labels, entropy=True, chunk_rows=chunk), logits)
        log_p, ent = logits_logprobs(logits, labels, entropy=True, chunk_rows=chunk)
        want_lp, want_ent = reference(logits, labels)
        assert (log_p - want_lp).abs().max() < 1e-13 and (ent - want_ent).abs().max() < 1e-13
    assert torch.autograd.gradcheck(lambda x: logits_logprobs(x, labels, chunk_rows=2)[0], logits)
    assert torch.autograd.gradcheck(lambda x: logits_logprobs(x, entropy=True, chunk_rows=2)[1], logits)
    lp3, ent3 = logits_logprobs(logits.view(3, 3, 13), labels.view(3, 3), entropy=True)  # [..., V], as verl's padded
    assert lp3.shape == (3, 3) and torch.equal(lp3.reshape(-1), log_p) and torch.equal(ent3.reshape(-1), ent)
    with pytest.raises(ValueError, match="labels"):
        logits_logprobs(logits, labels[:5])


@pytest.mark.parametrize("top1", [1 - 1e-9, 1 - 1e-3])
def test_from_logits_peaked_rows_deep_tails_and_bf16(top1):
    """float32 logits: log pi(a_t) to float32 rounding of float64's at a dominant token and ~100 nats down, the
    entropy relative to 1e-4, gradients of the float64 log-softmax's; bf16 logits: the same from the bf16 values, the
    gradient in bf16, the logits never written."""
    from verl_dppo.math.logits_logprob import logits_logprobs

    vocab = 64
    exact = llm_logits(16, vocab, seed=3, top1_prob=top1)
    labels = exact.argmax(dim=1)
    labels[::2] = exact[::2].argmin(dim=1)
    for dtype, tol_grad in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        logits = exact.to(dtype).requires_grad_()
        before = logits.detach().clone()
        log_p, ent = logits_logprobs(logits, labels, entropy=True, chunk_rows=5)
        assert log_p.dtype == ent.dtype == torch.float32
        x = logits.detach().double().requires_grad_()
        want_lp, _ = reference(x, labels)
        assert float(want_lp.detach().min()) < -90
        assert ((log_p.double() - want_lp).abs() <= 1e-6 * want_lp.abs().clamp(min=1.0)).all()
        want_ent = entropy_reference(x.detach())
        assert ((ent.double() - want_ent).abs() <= 1e-4 * want_ent + 1e-12).all()
        (got,) = torch.autograd.grad(weighted(log_p, ent, 7), logits)
        log_soft = torch.log_softmax(x, dim=-1)
        (want,) = torch.autograd.grad(weighted(want_lp, -(log_soft.exp() * log_soft).sum(-1), 7), x)
        assert got.dtype == dtype and (got.double() - want).abs().max() < tol_grad * max(1.0, float(want.abs().max()))
        assert torch.equal(logits.detach(), before)
